#!/bin/bash
# PACS vs GRPO on the CPU task, same seeds, one PNG with both reward curves.
#   ./examples/compare_cpu.sh [extra overrides...]
set -euo pipefail
OUT=${OUT:-outputs/compare_cpu}
for loss in pacs grpo; do
  pacs-megatron train --config examples/configs/cpu_tiny.yaml algorithm.loss=$loss \
    trainer.output_dir=$OUT/$loss trainer.save_freq=0 trainer.resume=never trainer.overwrite=true "$@"
done
pacs-megatron plot $OUT/pacs $OUT/grpo --labels PACS,GRPO --keys reward/mean,data/mixed_group_frac,response/length_mean \
  --out $OUT/pacs_vs_grpo.png --title "PACS vs GRPO, CPU arithmetic task"
