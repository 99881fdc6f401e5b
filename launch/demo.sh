#!/usr/bin/env bash
# Set up (if needed) and run the demo: a small transformer, FSDP2 over 2 CPU ranks (gloo),
# 40 steps. Each run writes a fresh folder, runs/demo/<date-time>/ (DEMO_RUNS sets runs/demo),
# with metrics.jsonl, progress.txt and tensorboard/, then the run report report.html in it
# (distmetrics report); an output_dir=... argument overrides the folder.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
VENV=${DISTMETRICS_VENV:-.venv}
export PYTHON="$VENV/bin/python"
RUNS=${DEMO_RUNS:-runs/demo}
stamp=$(date +%Y%m%d-%H%M%S)
RUN_DIR=$RUNS/$stamp
n=1
while [ -e "$RUN_DIR" ]; do  # two demos within one second
  n=$((n + 1))
  RUN_DIR=$RUNS/$stamp-$n
done
for arg in "$@"; do
  case $arg in output_dir=*) RUN_DIR=${arg#output_dir=} ;; esac
done
echo "demo run folder: $RUN_DIR"
NPROC_PER_NODE=${NPROC_PER_NODE:-2} \
  bash launch/torchrun.sh launch/train_fsdp.py --steps 40 --config configs/demo.yaml "output_dir=$RUN_DIR" "$@"
echo "metrics: $RUN_DIR/metrics.jsonl   progress: $RUN_DIR/progress.txt   summary: $VENV/bin/distmetrics summary $RUN_DIR"
echo "$VENV/bin/tensorboard --logdir $RUNS   (each demo run is one TensorBoard run)"
"$PYTHON" -m distmetrics.cli report "$RUN_DIR" --out "$RUN_DIR/report.html"
