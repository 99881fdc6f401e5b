#!/usr/bin/env bash
# Set up a virtual environment with everything distmetrics, its tests and its demos need.
# Idempotent: a second run only checks, and installs again where the torch spec or pyproject.toml
# changed. torch is pinned to the CPU build that these machines install from a local file (any
# other spec downloads GBs of CUDA packages); on a GPU machine set DISTMETRICS_TORCH to the torch
# spec you want.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${DISTMETRICS_VENV:-.venv}
TORCH_SPEC=${DISTMETRICS_TORCH:-torch==2.13.0}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
# What the environment was installed for: the torch spec and pyproject.toml (its dependencies and pins). A
# change to either (DISTMETRICS_TORCH set on an existing .venv, a dependency added by a pull) installs again;
# checking only that the modules exist kept the old torch and never installed a new dependency.
STAMP="$VENV/.distmetrics-setup"
WANT="$TORCH_SPEC $("$PY" -c "import hashlib; print(hashlib.sha256(open('pyproject.toml', 'rb').read()).hexdigest())")"
# Found, not imported (importing them all took about 9 s, on every demo and test run): the line that
# ends this script imports torch and distmetrics, and a module found but broken fails where it is used
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ] || \
   ! "$PY" -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in sys.argv[1:]))" \
    torch distmetrics tensorboard wandb megatron.core nvdlfw_inspect pytest xdist matplotlib PIL orjson \
    lightning accelerate transformers 2>/dev/null; then
  rm -f "$STAMP"  # written again only once both installs succeed
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q "$TORCH_SPEC"
  "$PY" -m pip install -q -e ".[all,dev]"
  echo "$WANT" > "$STAMP"
fi
"$PY" -c "import torch, distmetrics; print(f'distmetrics {distmetrics.__version__}, torch {torch.__version__}')"
