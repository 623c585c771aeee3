#!/usr/bin/env bash
# The comparison of issue 39 on the real model: PACS v1 in its own regime (4 mini-batches per rollout batch),
# PACS v2 (reference anchor, resets every 10 steps), GRPO with the same mini-batching, and the control, PACS
# with one update per batch (= class-weighted REINFORCE). Each method's lr is chosen on the validation split
# (a grid of 3 at 2 tuning seeds, reaching the paper's 1e-6: at 1e-5 four updates per batch collapsed SmolLM2's
# entropy in 3 steps, docs/results/smollm2_pacs_v1_v2_cpu/), then S seeds at the chosen lr are scored on the
# held-out split, pass@1/4/16 with 95% intervals (OUT/summary.md, OUT/curves.png). TASK=2digit: the harder task.
# PACS v2's reset period K is chosen the same way, at v2's chosen lr (KS, default 5,10,20: 20 is "no reset"
# within a 20-step run; the lr pass's runs at K = 10 count for it): 4 more tuning runs.
#   examples/compare_pacs_v2.sh                 # today's task, 3 seeds, 20 steps
#   SEEDS=5 STEPS=40 OUT=/tmp/cmp examples/compare_pacs_v2.sh
# Cost: 4 methods x (3 lrs x 2 tuning seeds + S seeds) + 4 runs; on the 2-core CPU a 20-step run with its
# three validations takes ~25-35 min, so the whole protocol is a day of CPU. On one H200 (2026-11-28, HF engine,
# JOBS=12 sharing the GPU, each capped at its share of the memory) a run took ~190 s: the protocol is ~13 min
# of GPU, two 15-minute leases (compare resumes; docs/results/smollm2_pacs_gpu_partial/).
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=examples/configs/cpu_smollm2_pacs_v1.yaml
[ "${TASK:-sums}" = 2digit ] && CONFIG=examples/configs/cpu_smollm2_2digit.yaml
exec pacs-megatron compare --config "$CONFIG" --out "${OUT:-outputs/compare_pacs_v2_${TASK:-sums}}" \
  --methods pacs,pacs_v2,grpo,reinforce --seeds "${SEEDS:-3}" --tune-seeds 2 --lrs "${LRS:-1e-6,3e-6,1e-5}" \
  --reset-every "${KS:-5,10,20}" \
  --steps "${STEPS:-20}" --tune-key val/arith_val/pass@1 --val-key val/arith_heldout/pass@1 ${JOBS:+--jobs $JOBS} \
  trainer.test_freq=10 "$@"
