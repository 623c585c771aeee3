"""Builds the ``pacs_megatron._C`` extension from ``csrc/``.

Always the C++ CPU op; the CUDA op too when torch is a CUDA build *and* a CUDA toolkit is found
(``torch.cuda.is_available()`` is the wrong test on a build host without a GPU). Knobs:

- ``PACS_BUILD_CUDA=auto|1|0``  force the CUDA part on or off (``auto``: decide as above).
- ``PACS_SKIP_EXT=1``           build no extension at all (ops fall back to the pure-torch reference).
- ``DEBUG=1``                   -O0 -g builds.
- ``MAX_JOBS``                  ninja parallelism (default: the number of cores).
- ``TORCH_CUDA_ARCH_LIST``      CUDA archs (default here: 8.0;9.0, Ampere and Hopper).

torch is imported here but is not a build requirement: install it first and build with
``pip install --no-build-isolation`` (see README), or pip would pull a CUDA torch into the build env.
"""

import glob
import os

from setuptools import setup


def _ext_modules():
    if os.environ.get("PACS_SKIP_EXT", "0") == "1":
        return [], {}
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as e:  # pragma: no cover - a message for humans
        raise RuntimeError(
            "pacs_megatron builds a torch extension: install torch first (pip install torch==2.13.0) "
            "and then this package with `pip install --no-build-isolation -e .`"
        ) from e

    mode = os.environ.get("PACS_BUILD_CUDA", "auto").lower()
    if mode not in ("auto", "0", "1"):
        raise ValueError(f"PACS_BUILD_CUDA={mode!r}: use auto, 1 or 0")
    cuda_possible = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    with_cuda = cuda_possible if mode == "auto" else mode == "1"
    if with_cuda and not cuda_possible:
        raise RuntimeError("PACS_BUILD_CUDA=1 but torch is a CPU build or no CUDA toolkit (CUDA_HOME) was found")

    debug = os.environ.get("DEBUG", "0") == "1"
    opt = ["-O0", "-g"] if debug else ["-O3"]
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")

    sources = sorted(glob.glob("csrc/*.cpp"))
    cxx = opt + ["-fopenmp"]
    args = {"cxx": cxx}
    ext_cls = cpp_extension.CppExtension
    if with_cuda:
        sources += sorted(glob.glob("csrc/*.cu"))
        args["cxx"] = cxx + ["-DPACS_WITH_CUDA"]
        # -ftz=true: exp2f becomes one ex2.approx.ftz.f32 (docs/kernel.md); no fp32 denormals matter here
        args["nvcc"] = opt + ["-DPACS_WITH_CUDA", "--expt-relaxed-constexpr", "-lineinfo", "-ftz=true"]
        ext_cls = cpp_extension.CUDAExtension
    ext = ext_cls("pacs_megatron._C", sources, extra_compile_args=args, extra_link_args=["-fopenmp"])
    return [ext], {"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _ext_modules()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
