#!/usr/bin/env bash
# Issue 43's LoRA-vs-full learning curve on the real model: the SmolLM2 recipe (examples/configs/cpu_smollm2.yaml,
# PACS, 8 prompts x 8, one update a step) trained in full and with LoRA (r 16, alpha 32, the four linears),
# each at its own lr chosen on the validation split (full: 3e-6, 1e-5, 3e-5; LoRA ~10x, PEFT practice:
# 3e-5, 1e-4, 3e-4), then held-out pass@1 at the chosen lrs (OUT/summary.md, OUT/curves.png).
#   examples/compare_lora.sh                          # 8 steps, 1 tuning seed, 1 reported seed
#   SEEDS=3 TUNE_SEEDS=2 examples/compare_lora.sh     # the fuller protocol (compare reuses finished runs)
# CPU budget: validations of 4 samples a problem (pass@1 and pass@4; pass@16 needs a GPU's time) every 4
# steps. On the 2-core Zen 3 box (fp32) a run is ~18-20 min, the default protocol (8 runs, 9 when LoRA's best lr is the grid's edge) ~3 h.
set -euo pipefail
cd "$(dirname "$0")/.."
exec pacs-megatron compare --config examples/configs/cpu_smollm2.yaml --out "${OUT:-outputs/compare_lora}" \
  --methods pacs,pacs_lora --seeds "${SEEDS:-1}" --tune-seeds "${TUNE_SEEDS:-1}" --max-extend 1 \
  --lrs 3e-6,1e-5,3e-5 --method-lrs pacs_lora=3e-5,1e-4,3e-4 --steps "${STEPS:-8}" \
  --tune-key val/arith_val/pass@1 --val-key val/arith_heldout/pass@1 ${JOBS:+--jobs $JOBS} \
  trainer.test_freq=4 trainer.val_before_train=false trainer.val_n=4 "trainer.val_k=[1,4]" trainer.save_freq=4 \
  trainer.keep_checkpoints=1 "$@"
