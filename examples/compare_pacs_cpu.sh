#!/usr/bin/env bash
# Does PACS (v1, v2) beat GRPO on a real model? Issue 56's paired protocol, sized to a 2-core CPU.
#   examples/compare_pacs_cpu.sh                  # runs what is left of the protocol, then writes the report
#   REPORT_ONLY=1 examples/compare_pacs_cpu.sh    # the report of the runs finished so far; starts nothing
#   METHODS=pacs,grpo PAIRS=pacs-grpo examples/compare_pacs_cpu.sh  # a subset (the same runs, keys)
#
# SmolLM2-135M-Instruct on the CPU recipe's word sums, v1's mini-batching (8 prompts x 8 responses a step,
# 4 updates of 2 prompts): PACS v1, PACS v2 (reference anchor, reset every K steps, K from the CPU-default sweep
# of examples/k_sweep_cpu.sh, docs/pacs_v2.md) and GRPO with the same mini-batching. 6 paired seeds x 16 steps,
# the held-out split only (40 problems x 16 samples) validated at steps 8 and 16; a run's score is its last.
# Paired: the runs of one seed share their prompts, their first rollout batch and the seeds of their held-out
# samples (tests/tools/compare/test_paired.py checks step 1's tokens on the CPU), so compare reports each
# pair's per-seed difference and its 95% t-interval (v1 - GRPO, v2 - GRPO, v2 - v1): at a planned SD of 0.025
# for a paired difference, 6 seeds give about +-0.026.
# lr 1e-5 for all three, not tuned: every committed SmolLM2 comparison used or chose it (docs/results/
# smollm2_gpu, smollm2_lora_cpu), and on the H200 partial runs 1e-6 moved no method in 20 steps (held-out
# 0.34-0.37, docs/results/smollm2_pacs_gpu_partial/).
# dtype: auto, per block: a seed's three runs (its block) run on one CPU in one dtype, the machine's when the block
# begins (bf16 on a native-bf16 CPU, AVX512-BF16 or AMX; fp32 elsewhere, where torch emulates bf16), and a block
# begun in one dtype keeps it (tools/compare/runs.py block_dtype); each run records its CPU and dtype. bf16 was
# allowed only after the 3-step pilot showed its updates learn as fp32's do at lr 1e-5 (bench.dtype_pilot, same
# rollouts, stochastic rounding: bf16/fp32 mean |delta log-prob| 0.99 / 1.03 / 0.85, row correlation 0.94-0.97,
# AMD Zen 5 with AVX512-BF16, RESULTS/dtype_pilot.json). DTYPE=float32 or bfloat16 pins every block's dtype
# (the same keys as an auto block of that dtype).
# A block begun on another CPU waits: compare defers it until a machine of its kind runs the script.
# Resumable in pieces: each finished run's record (metrics, samples, config, placement, no checkpoint) is
# copied to RESULTS/runs/ as it finishes and reused from there on any machine: commit RESULTS. A restart loses
# only the run in progress (it checkpoints at step 8; kill the compare by its pid and it stops at a step's end).
# Never run it beside a timed benchmark or the full test suite: the step times go into the report.
# Budget, written before the main runs (AMD EPYC Zen 3, 2 cores, fp32, docs/results/smollm2_pacs_v1_v2_cpu/):
# a step ~115 s (v1) to ~130 s (v2), a held-out validation ~190 s, the GGUF import and start ~1 min: a run
# ~35-40 min, the 18 runs ~11-12 CPU hours; with a native-bf16 CPU and bf16 (once allowed) ~2.5x less.
set -euo pipefail
cd "$(dirname "$0")/.."
K="${K:-5}"  # PACS v2's reset period, chosen from the CPU-default sweep (docs/results/k_sweep_cpu_default/)
METHODS="${METHODS:-pacs,pacs_v2,grpo}"
KFLAG=()
[[ ",$METHODS," == *,pacs_v2,* ]] && KFLAG=(--reset-every "$K")
exec pacs-megatron compare --config examples/configs/cpu_smollm2_pacs_v1.yaml \
  --out "${OUT:-outputs/compare_pacs_cpu}" --results "${RESULTS:-docs/results/smollm2_pacs_cpu_paired}" \
  --methods "$METHODS" --seeds "${SEEDS:-6}" --lrs 1e-5 "${KFLAG[@]}" --steps 16 --score-validations 1 \
  --pairs "${PAIRS:-pacs-grpo,pacs_v2-grpo,pacs_v2-pacs}" --val-key val/arith_heldout/pass@1 --jobs 1 \
  ${REPORT_ONLY:+--report-only} \
  trainer.test_freq=8 trainer.val_before_train=false "trainer.val_sets=[arith_heldout]" \
  model.dtype="${DTYPE:-auto}" trainer.save_freq=8 trainer.keep_checkpoints=1 "$@"
