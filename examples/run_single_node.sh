#!/bin/bash
# One node, 8 GPUs: PACS on Qwen2.5-7B (see examples/configs/qwen2.5_7b_pacs.yaml; untested on GPU here).
# Extra arguments are config overrides, e.g. ./examples/run_single_node.sh model.path=/ckpt/Qwen2.5-7B
set -euo pipefail
torchrun --standalone --nproc-per-node 8 -m pacs_megatron.launch \
  --config examples/configs/qwen2.5_7b_pacs.yaml "$@"
