# GPU image: NGC PyTorch (CUDA, NCCL, cuDNN, Apex and Transformer Engine matched to its torch)
# + vLLM built from source against that torch + this package. Never built here (no registry or GPU
# was reachable where it was written; hadolint checks it in tests/launch/test_container.py).
#
#   docker build -t pacs-megatron .                       # ~30-60 min: vLLM's CUDA kernels compile
#   docker run --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 \
#     -v /models:/models:ro -v /data:/data:ro -v $PWD/outputs:/workspace/pacs_megatron/outputs \
#     -e PACS_DATA_ROOT=/data pacs-megatron \
#     torchrun --standalone --nproc-per-node 8 -m pacs_megatron.launch \
#       --config examples/configs/qwen2.5_7b_pacs.yaml model.path=/models/Qwen2.5-7B
#
# Why vLLM is built from source: vLLM's install docs (0.32, "Set up using Python") say its wheels are
# compiled against one PyTorch build and are binary-incompatible with any other, "even for the same
# PyTorch version with different building configurations"; to use an existing PyTorch (NGC's) they
# say to build from source after `python use_existing_torch.py`, which drops torch from vLLM's
# requirement files. So: no vLLM wheel over NGC's torch (its C++ ops would load against the wrong
# ABI), and no pip-installed torch over NGC's (it would discard NGC's Apex/TE/NCCL pairing). vLLM's
# own runtime requirements (requirements/cuda.txt minus torch: flashinfer, fastapi, openai-harmony,
# cachetools, ...) come from its source tree with their pins, so nothing `from vllm import LLM`
# imports is missing. NGC's PIP_CONSTRAINT stays in force: a dependency that would move a package
# NGC pinned fails the build loudly instead of breaking torch at run time.
ARG NGC_TAG=26.08-py3
FROM nvcr.io/nvidia/pytorch:${NGC_TAG}

# The NGC release must carry the torch vLLM 0.32 is written for (2.13): check its release notes.
ARG VLLM_VERSION=0.32.0
# Ampere, Hopper, Blackwell cubins, and PTX of the newest so later GPUs JIT-compile it.
ARG TORCH_CUDA_ARCH_LIST="8.0;9.0;10.0;12.0+PTX"
ARG MAX_JOBS=16
ENV PIP_NO_CACHE_DIR=1 \
    TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST} \
    MAX_JOBS=${MAX_JOBS}

WORKDIR /opt/vllm
RUN git clone --depth 1 --branch "v${VLLM_VERSION}" https://github.com/vllm-project/vllm.git . \
    && python use_existing_torch.py \
    && pip install --no-cache-dir -r requirements/build.txt \
    && pip install --no-cache-dir --no-build-isolation . \
    && python -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"

WORKDIR /workspace/pacs_megatron
COPY . .
# The log-prob kernel for the same archs; torch, TE and Apex stay NGC's (--no-build-isolation).
RUN pip install --no-cache-dir --no-build-isolation -e . \
    && pacs-megatron doctor

CMD ["pacs-megatron", "doctor"]
