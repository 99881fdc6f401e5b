#!/usr/bin/env bash
# Launch a trainer with torchrun, single node or multi-node (c10d rendezvous).
#
#   launch/torchrun.sh launch/train_fsdp.py --steps 40                      # one node
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 launch/torchrun.sh launch/train_fsdp.py   # on node0
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 launch/torchrun.sh launch/train_fsdp.py   # on node1
#
# Environment: NNODES (1), NODE_RANK (0), MASTER_ADDR (127.0.0.1), MASTER_PORT (one node: a free
# port; several: 29500), NPROC_PER_NODE (the GPUs CUDA_VISIBLE_DEVICES lists, else the node's GPU
# count, else 2 CPU ranks; given more ranks than GPUs, they run on the CPU, said), RDZV_ID
# (distmetrics), PYTHON (the project's virtual environment when there is one: $DISTMETRICS_VENV,
# else .venv, as launch/setup.sh makes it; otherwise python3).
# One node without RDZV_ID meets on MASTER_PORT alone, so a port another job holds fails at once
# (a shared c10d rendezvous made a second job wait, silent, as the first one's spare); several
# nodes meet through c10d rendezvous. The trainers pick NCCL when CUDA is available, else gloo.
set -euo pipefail
if [ -z "${PYTHON:-}" ]; then
  ROOT=$(cd "$(dirname "$0")/.." && pwd)
  VENV=${DISTMETRICS_VENV:-.venv}
  case $VENV in /*) ;; *) VENV=$ROOT/$VENV ;; esac  # relative to the project, as in setup.sh
  if [ -x "$VENV/bin/python" ]; then
    PYTHON=$VENV/bin/python
  elif [ -n "${DISTMETRICS_VENV:-}" ]; then
    echo "launch/torchrun.sh: DISTMETRICS_VENV=$DISTMETRICS_VENV has no bin/python (run launch/setup.sh)" >&2
    exit 2
  else
    PYTHON=python3
  fi
fi
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
if [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then  # the GPUs this job may use, not all the node's: as CUDA reads
  # the list, up to its first entry that names no device (-1 and Slurm's NoDevFiles hide them all)
  IFS=, read -ra visible <<< "$CUDA_VISIBLE_DEVICES"
  gpus=0
  for device in "${visible[@]}"; do
    [[ $device =~ ^[[:space:]]*([0-9]+|GPU-.+|MIG-.+)[[:space:]]*$ ]] || break
    gpus=$((gpus + 1))
  done
else
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
fi
gpus=${gpus:-0}
if [ -z "${NPROC_PER_NODE:-}" ]; then
  NPROC_PER_NODE=$([ "$gpus" -gt 0 ] && echo "$gpus" || echo 2)
elif [ "$NNODES" = 1 ] && [[ $NPROC_PER_NODE =~ ^[0-9]+$ ]] && [ "$gpus" -gt 0 ] \
    && [ "$gpus" -lt "$NPROC_PER_NODE" ]; then  # a number: torchrun's own "gpu" and "auto" pass through
  # NCCL cannot put two ranks on one GPU (the demo's 2 ranks on a one-GPU machine): the CPU, said. One
  # node only: a node of several on gloo beside NCCL ones would wait; there the trainer stops, naming both
  echo "launch/torchrun.sh: $NPROC_PER_NODE ranks per node but $gpus GPU(s): running on the CPU (gloo);" \
       "NPROC_PER_NODE=$gpus runs on the GPUs" >&2
  export CUDA_VISIBLE_DEVICES=
fi
if [ "$NNODES" = 1 ] && [ -z "${RDZV_ID:-}" ]; then
  if [ -n "${MASTER_PORT:-}" ]; then
    RDZV=(--master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT")
  else
    RDZV=(--standalone)  # a free port of this node
  fi
else
  RDZV=(--rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}" --rdzv-id "${RDZV_ID:-distmetrics}")
fi
exec "$PYTHON" -m torch.distributed.run \
  --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC_PER_NODE" "${RDZV[@]}" \
  "$@"
