#!/usr/bin/env bash
# PACS v2's reset period K by measurement, cheaply (issue 56, item 3): the CPU default (cpu_tiny.yaml: a tiny
# model learning "a+b=" from chance, 5 mini-batches a step) with the reference anchor, K in {2, 5, 10, never}
# over 5 seeds, 40 steps each (the CPU default reaches ~0.9 train reward by step 50). Each finished run is kept
# in RESULTS/K<k>/runs/ (commit it; a rerun reuses it), then tools/reference_age.py writes RESULTS/k_table.md
# (per K: the classifier's Brier during and after the update, train reward, validation) and
# RESULTS/brier_by_age.png (the Brier against the reference's age). ~1 min a run on 2 cores, 20 runs.
#   examples/k_sweep_cpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
RESULTS="${RESULTS:-docs/results/k_sweep_cpu_default}"
for K in ${KS:-2 5 10 0}; do  # 0: never reset (the reference stays the policy RL started from)
  pacs-megatron compare --config examples/configs/cpu_tiny.yaml --out "${OUT:-outputs/k_sweep}/K$K" \
    --results "$RESULTS/K$K" --methods pacs_v2 --seeds "${SEEDS:-5}" --lrs 3e-4 --steps 40 --jobs 1 \
    trainer.test_freq=20 trainer.save_freq=0 "algorithm.reference_reset_every=$K" "$@"
done
python -m pacs_megatron.tools.reference_age "$RESULTS" --out "$RESULTS"
