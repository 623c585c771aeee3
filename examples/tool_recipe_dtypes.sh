#!/usr/bin/env bash
# The tool recipe in both dtypes on one box (issue 58, item 3): examples/configs/cpu_smollm2_tools.yaml as
# committed (the supervised warm-up until 80 % of sampled calls run, at most 30 steps, then 8 PACS steps), once
# with model.dtype=bfloat16 and once with float32, seed 0, one run at a time. Each finished run is kept in
# RESULTS/<dtype>/runs/NAME-KEY/ (metrics, rollout samples, config, the CPU it ran on; commit it: a rerun, even on
# a fresh machine, reuses it), then both are drawn on one figure, RESULTS/curves.png: the warm-up's call rate and
# loss, the RL steps' call rate and reward, the held-out pass@1. Run it alone: ~25 min a dtype on a CPU with
# native bf16 (AVX512-BF16 or AMX); an AVX2-only CPU (Zen 3) emulates bf16 and takes hours for that run.
#   examples/tool_recipe_dtypes.sh
set -euo pipefail
cd "$(dirname "$0")/.."
RESULTS="${RESULTS:-docs/results/smollm2_tools_cpu/dtypes}"
dtypes="${DTYPES:-bfloat16 float32}"
runs=()
for DTYPE in $dtypes; do
  pacs-megatron compare --config examples/configs/cpu_smollm2_tools.yaml --out "${OUT:-outputs/tool_dtypes}/$DTYPE" \
    --results "$RESULTS/$DTYPE" --methods pacs --seeds 1 --lrs 1e-5 --jobs 1 --score-validations 1 \
    "model.dtype=$DTYPE" "$@"
  runs+=("$(ls -d "$RESULTS/$DTYPE"/runs/pacs_*)")
done
pacs-megatron plot "${runs[@]}" --labels "${dtypes// /,}" --out "$RESULTS/curves.png" \
  --title "SmolLM2 tool recipe, $(python -c 'from pacs_megatron.utils.cpu import cpu_description as d; print(d())')" \
  --keys 'sft/call_rate,sft/loss,tools/call_rate,reward/mean,val/*/pass@1'
