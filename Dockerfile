# GPU image: NGC PyTorch ships CUDA, NCCL, Apex and Transformer Engine matched to its torch.
#   docker build -t pacs-megatron .
#   docker run --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 \
#     -v /data:/data -v $PWD/outputs:/workspace/pacs_megatron/outputs pacs-megatron \
#     torchrun --nproc-per-node 8 -m pacs_megatron.launch --config examples/configs/qwen2.5_7b_pacs.yaml
FROM nvcr.io/nvidia/pytorch:25.09-py3

ENV PIP_NO_CACHE_DIR=1 PIP_CONSTRAINT=""
WORKDIR /workspace/pacs_megatron

# vLLM must match the container's torch: pick the release that pins it (see README, "GPU stack").
# --no-deps keeps pip from replacing NGC's torch/TE/apex; vLLM's own runtime deps follow explicitly.
ARG VLLM_VERSION=0.11.0
RUN pip install --no-deps "vllm==${VLLM_VERSION}" && \
    pip install "megatron-core==0.16.1" "ray[default]>=2.40" "nvidia-modelopt>=0.27" huggingface_hub \
        transformers tokenizers safetensors "math-verify[antlr4_13_2]" omegaconf pyarrow psutil \
        tensorboard matplotlib rich pybind11 ninja \
        msgspec cloudpickle blake3 gguf openai prometheus-fastapi-instrumentator lm-format-enforcer \
        outlines_core xgrammar partial-json-parser compressed-tensors depyf mistral_common cbor2 pybase64 \
        setproctitle diskcache lark llguidance numba

COPY . .
# The CUDA kernel is built for Ampere and Hopper; torch and TE come from the container.
RUN TORCH_CUDA_ARCH_LIST="8.0;9.0" pip install --no-build-isolation --no-deps -e .

CMD ["pacs-megatron", "--help"]
