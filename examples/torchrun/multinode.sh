#!/bin/bash
# Multi-node PACS with torchrun, without a scheduler: run this once on every node.
#
#   # node 0 (its address: 10.0.0.1)             # node 1
#   examples/torchrun/multinode.sh --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 \
#       --config examples/configs/qwen2.5_7b_pacs.yaml model.path=/models/Qwen2.5-7B
#   examples/torchrun/multinode.sh --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --config ...
#
# Each option may come from the environment instead: NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT
# (default 29500), NPROC_PER_NODE (default: the GPUs this process sees, CUDA_VISIBLE_DEVICES and
# cgroups included; 1 without). parallel.dp follows from the world size. Rendezvous: torchrun's c10d
# backend on MASTER_ADDR:MASTER_PORT (RDZV_ID, default "pacs", names the job): the agents may start in
# any order and need not know their node rank (c10d assigns it; NODE_RANK is then informational).
# Set RDZV_BACKEND=static for the fixed --node-rank form. Stop: send SIGUSR1 (or SIGTERM / Ctrl-C) to every torchrun; torchrun forwards it,
# the ranks checkpoint after their step and exit 143 (130 for Ctrl-C), and torchrun waits
# SHUTDOWN_TIMEOUT seconds (default 900; size it above a step + a checkpoint) before it would
# SIGKILL them. Re-run the same command to resume.
set -euo pipefail
USAGE="usage: $0 [--nnodes N] [--node-rank R] [--master-addr A] [--master-port P] [--nproc-per-node G] --config FILE [a.b.c=value ...]"
CONFIG=
while [[ $# -gt 0 ]]; do
  case "$1" in
    --nnodes) NNODES=$2; shift 2 ;;
    --node-rank) NODE_RANK=$2; shift 2 ;;
    --master-addr) MASTER_ADDR=$2; shift 2 ;;
    --master-port) MASTER_PORT=$2; shift 2 ;;
    --nproc-per-node) NPROC_PER_NODE=$2; shift 2 ;;
    --config) CONFIG=$2; shift 2 ;;
    *) break ;;
  esac
done
if [[ -z "$CONFIG" || -z "${NNODES:-}" || -z "${MASTER_ADDR:-}" ]]; then
  echo "$USAGE" >&2
  exit 2
fi
PYTHON=${PYTHON:-python3}
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
  # What the ranks will see (nvidia-smi -L lists the node's GPUs, not this job's).
  NPROC_PER_NODE=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
  [[ "$NPROC_PER_NODE" -gt 0 ]] || NPROC_PER_NODE=1
fi
# Networks (docs/launch.md "Networks"): on nodes with several NICs name the one to use, e.g.
#   export NCCL_SOCKET_IFNAME=ib0 GLOO_SOCKET_IFNAME=ib0 NCCL_IB_HCA=mlx5_0,mlx5_1
# (set here or before submitting; the ranks inherit them).
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}  # Megatron's TP overlap, pre-Blackwell
if [[ "${RDZV_BACKEND:-c10d}" == static ]]; then
  [[ -n "${NODE_RANK:-}" ]] || { echo "$USAGE" >&2; exit 2; }
  RDZV=(--node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "${MASTER_PORT:-29500}")
else
  RDZV=(--rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}" --rdzv-id "${RDZV_ID:-pacs}")
fi
PLAN=$("$PYTHON" -m pacs_megatron.launch.slurm plan --nodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" \
  --config "$CONFIG" "$@") || exit 2

# shellcheck disable=SC2086  # PLAN is a list of a.b=c words
exec "$PYTHON" -m torch.distributed.run --nnodes "$NNODES" "${RDZV[@]}" --nproc-per-node "$NPROC_PER_NODE" \
  --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout "${SHUTDOWN_TIMEOUT:-900}" \
  -m pacs_megatron.launch --config "$CONFIG" "$@" $PLAN
