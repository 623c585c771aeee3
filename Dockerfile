# GPU image: NGC PyTorch ships CUDA, NCCL, Apex and Transformer Engine matched to its torch.
#   docker build -t pacs-megatron .
#   docker run --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 \
#     -v /data:/data -v $PWD/outputs:/workspace/pacs_megatron/outputs pacs-megatron \
#     torchrun --nproc-per-node 8 -m pacs_megatron.launch --config examples/configs/qwen2.5_7b_pacs.yaml
# vLLM's wheels are built against one torch: pick the NGC release whose torch is the one the pinned
# vLLM needs (vllm 0.32.0 <-> torch 2.13.0), so NGC's torch, Apex and TE stay in place.
# (The default tag is an assumption to check against NGC's release notes: no Docker engine was
# available where this file was written, so the image has never been built.)
ARG NGC_TAG=26.08-py3
FROM nvcr.io/nvidia/pytorch:${NGC_TAG}

ENV PIP_NO_CACHE_DIR=1 PIP_CONSTRAINT=""
WORKDIR /workspace/pacs_megatron

# --no-deps keeps pip from replacing NGC's torch/TE/apex; vLLM's own runtime deps follow explicitly
# (vllm 0.32.0 also wants transformers>=5.16.1,<5.20). The vLLM engine was written against 0.32.0.
ARG VLLM_VERSION=0.32.0
RUN pip install --no-deps "vllm==${VLLM_VERSION}" && \
    pip install "megatron-core==0.16.1" "nvidia-modelopt>=0.27" huggingface_hub \
        "transformers>=5.16.1,<5.20" tokenizers safetensors "math-verify[antlr4_13_2]" omegaconf pyarrow psutil \
        tensorboard matplotlib rich pybind11 ninja \
        msgspec cloudpickle blake3 gguf openai prometheus-fastapi-instrumentator lm-format-enforcer \
        outlines_core xgrammar partial-json-parser compressed-tensors depyf mistral_common cbor2 pybase64 \
        setproctitle diskcache lark llguidance numba

COPY . .
# The CUDA kernel is built for Ampere and Hopper; torch and TE come from the container.
RUN TORCH_CUDA_ARCH_LIST="8.0;9.0" pip install --no-build-isolation --no-deps -e .

CMD ["pacs-megatron", "--help"]
