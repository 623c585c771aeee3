#!/usr/bin/env bash
# The tool recipe in both dtypes on one box (issue 58, item 3): examples/configs/cpu_smollm2_tools.yaml as
# committed (the supervised warm-up until 80 % of sampled calls run, at most 30 steps, then 8 PACS steps), once
# with model.dtype=bfloat16 and once with float32, seed 0, one run at a time. Each finished run is kept in
# RESULTS/<dtype>/runs/NAME-KEY/ (metrics, rollout samples, config, the CPU it ran on; commit it: a rerun, even on
# a fresh machine, reuses it), then both are drawn on one figure, RESULTS/curves.png: the RL steps' call rate
# and reward, the held-out pass@1, each curve labelled with its run's CPU (the record keeps the warm-up's end,
# not each check: train.log has those). Run it alone. Measured: bf16 18 min on a Zen 5, fp32 37 min on a Zen 4
# (both with AVX512-BF16, on different days); an AVX2-only CPU (Zen 3) emulates bf16 and takes hours for that run.
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
# each curve is labelled with the CPU its run's record names (compare's run_cpu): the runs may come from two boxes
labels=$(python - "$dtypes" "${runs[@]}" <<'PY'
import sys
from pathlib import Path

from pacs_megatron.tools.compare.results import run_cpu

dtypes, runs = sys.argv[1].split(), sys.argv[2:]
print(",".join(f"{d} on {(run_cpu(Path(r)) or 'an unknown CPU').split(',')[0]}" for d, r in zip(dtypes, runs)))
PY
)
pacs-megatron plot "${runs[@]}" --labels "$labels" --out "$RESULTS/curves.png" \
  --title "SmolLM2 tool recipe as committed, seed 0 (the warm-up's checks: each run's train.log)" \
  --keys 'tools/call_rate,reward/mean,val/*/pass@1'
