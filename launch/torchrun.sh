#!/usr/bin/env bash
# Launch a trainer with torchrun, single node or multi-node (c10d rendezvous).
#
#   launch/torchrun.sh launch/train_fsdp.py --steps 40                      # one node
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 launch/torchrun.sh launch/train_fsdp.py   # on node0
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 launch/torchrun.sh launch/train_fsdp.py   # on node1
#
# Environment: NNODES (1), NODE_RANK (0), MASTER_ADDR (127.0.0.1), MASTER_PORT (29500),
# NPROC_PER_NODE (the GPU count, else 2 CPU ranks), RDZV_ID (distmetrics), PYTHON (the project's
# virtual environment when there is one: $DISTMETRICS_VENV, else .venv, as launch/setup.sh makes it;
# otherwise python3). The trainers pick NCCL when CUDA is available and gloo otherwise.
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
MASTER_PORT=${MASTER_PORT:-29500}
if [ -z "${NPROC_PER_NODE:-}" ]; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  NPROC_PER_NODE=$([ "${gpus:-0}" -gt 0 ] && echo "$gpus" || echo 2)
fi
exec "$PYTHON" -m torch.distributed.run \
  --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC_PER_NODE" \
  --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "${RDZV_ID:-distmetrics}" \
  "$@"
