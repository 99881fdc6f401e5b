#!/usr/bin/env bash
# Set up (if needed) and run the demo: a small transformer, FSDP2 over 2 CPU ranks (gloo),
# 40 steps; writes runs/demo/{metrics.jsonl,progress.txt,tensorboard/}, then the run report
# runs/demo/report.html (distmetrics report).
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
VENV=${DISTMETRICS_VENV:-.venv}
export PYTHON="$VENV/bin/python"
NPROC_PER_NODE=${NPROC_PER_NODE:-2} MASTER_PORT=${MASTER_PORT:-29517} \
  bash launch/torchrun.sh launch/train_fsdp.py --steps 40 --config configs/demo.yaml "$@"
echo "metrics: runs/demo/metrics.jsonl   progress: runs/demo/progress.txt   tensorboard --logdir runs/demo/tensorboard"
"$PYTHON" -m distmetrics.cli report runs/demo --out runs/demo/report.html
