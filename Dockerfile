# GPU image: NGC PyTorch (CUDA, NCCL, cuDNN, Apex and Transformer Engine matched to its torch)
# + vLLM built from source against that torch + this package. Never built here (no registry or GPU
# was reachable where it was written; hadolint checks it in tests/launch/test_container.py); its
# package install step (docker/install.sh) is shared with the CPU image, which was built and run.
#
#   docker build -t pacs-megatron .                       # ~30-60 min: vLLM's CUDA kernels compile
#   docker build --build-arg MAX_JOBS=32 --build-arg NVCC_THREADS=4 -t pacs-megatron .   # a big builder
#   docker run --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 \
#     -v /models:/models:ro -v /data:/data:ro -v $PWD/outputs:/workspace/outputs \
#     -e PACS_DATA_ROOT=/data pacs-megatron \
#     torchrun --standalone --nproc-per-node 8 -m pacs_megatron.launch \
#       --config examples/configs/qwen2.5_7b_pacs.yaml model.path=/models/Qwen2.5-7B \
#       trainer.output_dir=/workspace/outputs/run1
#
# Why vLLM is built from source: vLLM's install docs (0.32, "Set up using Python") say its wheels are
# compiled against one PyTorch build and are binary-incompatible with any other, "even for the same
# PyTorch version with different building configurations"; to use an existing PyTorch (NGC's) they
# say to build from source after `python use_existing_torch.py`, which drops torch from vLLM's
# requirement files.
#
# Why a wheel with --no-deps, then the dependencies on purpose (NeMo-RL's NGC image does the same):
# NGC's PIP_CONSTRAINT file pins *every* package the image ships, not only torch. Resolving vLLM's
# and our requirements against all of it fails (or silently picks old releases) wherever vLLM needs
# a newer fastapi, transformers, ... than NGC happened to ship. What must not move is the torch stack
# (torch, triton, the nvidia-* CUDA libraries, Transformer Engine, Apex, flash-attn): only those pins
# are kept (torch-stack.txt) while vLLM's own requirements (requirements/cuda.txt minus torch) and
# ours install; a dependency that would replace NGC's torch still fails the build loudly.
#
# NGC's torch is a pre-release version (X.Y.0a0+<git>): vLLM's "torch >= X.Y" checks see an older
# torch and take their old-torch code paths. VLLM_USE_STANDALONE_COMPILE=0 keeps vLLM on the
# torch.compile path that works with it (the standalone-compile path needs a released torch's
# API); unverified here, like everything GPU in this file.
ARG NGC_TAG=26.08-py3

FROM nvcr.io/nvidia/pytorch:${NGC_TAG} AS build
# The NGC release must carry the torch vLLM 0.32 is written for (2.13): check its release notes.
ARG VLLM_VERSION=0.32.0
# Ampere, Ada (8.9: FP8 rollouts on L40S / RTX 6000 Ada), Hopper, Blackwell cubins, and PTX of the
# newest so later GPUs JIT-compile it.
ARG TORCH_CUDA_ARCH_LIST="8.0;8.9;9.0;10.0;12.0+PTX"
# Compile parallelism: MAX_JOBS compilers x NVCC_THREADS threads each, ~2-4 GiB RAM per job. The
# defaults fit a 32 GiB / 16-core builder; raise them on bigger machines.
ARG MAX_JOBS=8
ARG NVCC_THREADS=2
ENV PIP_NO_CACHE_DIR=1 \
    TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST} \
    MAX_JOBS=${MAX_JOBS} \
    NVCC_THREADS=${NVCC_THREADS}
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

WORKDIR /opt/vllm
RUN git clone --depth 1 --branch "v${VLLM_VERSION}" https://github.com/vllm-project/vllm.git . \
    && python use_existing_torch.py \
    && grep -iE '^(torch|torchvision|torchaudio|triton|pytorch-triton|nvidia-|transformer[-_]engine|apex|flash[-_]attn)' \
        "${PIP_CONSTRAINT}" > /opt/torch-stack.txt \
    && PIP_CONSTRAINT=/opt/torch-stack.txt pip install --no-cache-dir -r requirements/build.txt \
    && pip wheel --no-deps --no-build-isolation --wheel-dir /opt/wheels . \
    && cp requirements/common.txt requirements/cuda.txt /opt/wheels/

WORKDIR /opt/pacs
COPY . .
# The log-prob kernel for the same archs; torch, TE and Apex stay NGC's (--no-build-isolation).
RUN pip wheel --no-deps --no-build-isolation --wheel-dir /opt/wheels .

FROM nvcr.io/nvidia/pytorch:${NGC_TAG} AS runtime
ENV PIP_NO_CACHE_DIR=1 \
    VLLM_USE_STANDALONE_COMPILE=0 \
    CUDA_DEVICE_MAX_CONNECTIONS=1
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
COPY --from=build /opt/wheels /opt/wheels
COPY --from=build /opt/torch-stack.txt /opt/torch-stack.txt
COPY docker/install.sh /opt/install.sh
WORKDIR /opt/wheels
# vLLM and this package without their dependencies, then the dependencies against the torch stack's
# pins only (requirements/cuda.txt includes common.txt; use_existing_torch.py removed torch from both).
# The package's own step is docker/install.sh, which the CPU image (docker/cpu.Dockerfile) runs too:
# those steps were built and run there (README, "CPU container"); this file as a whole never was.
RUN pip install --no-cache-dir --no-deps /opt/wheels/*.whl \
    && PIP_CONSTRAINT=/opt/torch-stack.txt pip install --no-cache-dir -r /opt/wheels/cuda.txt \
    && PIP_CONSTRAINT=/opt/torch-stack.txt /opt/install.sh "$(ls /opt/wheels/pacs_megatron-*.whl)" \
    && python -c "import torch, vllm, pacs_megatron; print('vllm', vllm.__version__, 'torch', torch.__version__)"

# bubblewrap: the sandbox of tool-integrated rollouts (docs/tools.md). Without it tools.sandbox=auto refuses to
# start a tool run. Inside a container it needs its own /proc and user namespaces: a tool run needs
# `docker run --security-opt systempaths=unconfined --security-opt seccomp=unconfined` (podman: `--security-opt
# unmask=/proc/*`, measured with podman 4.3 on the CPU image's base); preflight refuses without, in one line.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends bubblewrap \
    && rm -rf /var/lib/apt/lists/* \
    && bwrap --version

# A non-root runtime user; /workspace holds the examples and, by default, the outputs.
RUN useradd --create-home --uid 1000 pacs && mkdir -p /workspace && chown pacs:pacs /workspace
WORKDIR /workspace
COPY --chown=pacs:pacs examples ./examples
USER pacs

# The smoke test: the install is sound (imports, kernels, a 3-step CPU/GPU training run).
HEALTHCHECK NONE
CMD ["pacs-megatron", "selftest", "--quick"]
