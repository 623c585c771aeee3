#!/bin/bash
# PACS vs GRPO vs PPO with a learned critic on the CPU generalisation task (issue 20's protocol):
#   - problems split by unordered pair into train (60), validation (20) and held-out (20)
#     (examples/configs/cpu_generalize.yaml: data.arith.val_fraction / test_fraction);
#   - every method updates on 4 mini-batches per RL step (as the reference);
#   - each method's lr (and PPO's critic lr) tuned on the *validation* split (val/arith_val) over
#     seeds 1000-1001; a grid whose best value is an edge grows on that side (--max-extend) until the
#     optimum is interior;
#   - reported on the *held-out* split (val/arith_heldout) over seeds 0-4.
# Hours on a 2-core machine; resumable (rerun the same command). Raw results: OUT/summary.json,
# OUT/summary.md (per-method table), OUT/curves.png, OUT/runs/*/metrics.jsonl.
#   ./examples/compare_cpu.sh [extra overrides...]
#   QUICK=1 ./examples/compare_cpu.sh     # two curves on the CPU default: PACS vs GRPO, one seed
set -euo pipefail
OUT=${OUT:-outputs/compare_cpu}
LRS=${LRS:-3e-5,1e-4,3e-4,1e-3,3e-3}
CRITIC_LRS=${CRITIC_LRS:-3e-4,1e-3,3e-3}

if [ "${QUICK:-0}" = 1 ]; then
  for loss in pacs grpo; do
    pacs-megatron train --config examples/configs/cpu_tiny.yaml algorithm.loss=$loss \
      trainer.output_dir=$OUT/$loss trainer.save_freq=0 trainer.resume=never trainer.overwrite=true "$@"
  done
  pacs-megatron plot $OUT/pacs $OUT/grpo --labels PACS,GRPO \
    --keys reward/mean,data/mixed_group_frac,response/length_mean \
    --out $OUT/pacs_vs_grpo.png --title "PACS vs GRPO, CPU arithmetic task"
  exit 0
fi

pacs-megatron compare --config examples/configs/cpu_generalize.yaml --out "$OUT" \
  --methods pacs,grpo,ppo --seeds 5 --tune-seeds 2 --lrs "$LRS" --critic-lrs "$CRITIC_LRS" \
  --tune-key val/arith_val/pass@1 --val-key val/arith_heldout/pass@1 --max-extend 2 --steps 200 --jobs 2 \
  parallel.tp=1 trainer.save_freq=50 logging.post_update_metrics=false "$@"
