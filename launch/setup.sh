#!/usr/bin/env bash
# Set up a virtual environment with everything distmetrics, its tests and its demos need.
# Idempotent: a second run only checks. It installs the project again where pyproject.toml changed
# since it last did (a dependency or pin added by a pull), and torch where DISTMETRICS_TORCH names
# another spec than the one it installed; with DISTMETRICS_TORCH unset the torch present is kept.
# torch is pinned to the CPU build that these machines install from a local file (any other spec
# downloads GBs of CUDA packages); on a GPU machine set DISTMETRICS_TORCH to the torch spec you want.
# `bash launch/setup.sh --check` installs nothing: it says what a run would install (exit status 1)
# or that nothing is to install (0).
set -euo pipefail
cd "$(dirname "$0")/.."
CHECK=$([ "${1:-}" = "--check" ] && echo 1 || echo 0)
VENV=${DISTMETRICS_VENV:-.venv}
TORCH_SPEC=${DISTMETRICS_TORCH:-torch==2.13.0}
if [ "$CHECK" = 1 ] && [ ! -x "$VENV/bin/python" ]; then
  echo "setup would make $VENV and install everything into it"
  exit 1
fi
if [ "$CHECK" = 0 ] && command -v flock >/dev/null; then  # a second set-up at once (a demo beside the tests)
  mkdir -p "$VENV"                                          # waits for this one, then finds it done; taken
  exec 9>>"$VENV/.distmetrics-setup.lock"                   # before the venv is made, whose bin/python is
  flock 9                                                   # there seconds before its pip
fi
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
# What this script last installed, two lines: the torch spec and pyproject.toml's sha256. Checking only
# that the modules exist kept an old torch where DISTMETRICS_TORCH changed and never installed a
# dependency a pull added.
STAMP="$VENV/.distmetrics-setup"
PROJECT=$("$PY" -c "import hashlib; print(hashlib.sha256(open('pyproject.toml', 'rb').read()).hexdigest())")
HAD_TORCH="" HAD_PROJECT=""
if [ -f "$STAMP" ]; then
  { read -r HAD_TORCH; read -r HAD_PROJECT; } < "$STAMP" || true
fi
HAD_TORCH=${HAD_TORCH%$'\r'} HAD_PROJECT=${HAD_PROJECT%$'\r'}
case $HAD_TORCH in *" "*) HAD_TORCH="" ;; esac  # the one-line "spec sha" of an earlier version: not known
found() {  # found, not imported (importing them all took about 9 s, on every demo and test run); the line
  # that ends this script imports torch and distmetrics, and a module found but broken fails where it is used
  "$PY" -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in sys.argv[1:]))" \
    "$@" 2>/dev/null
}
TORCH="" WHY=""
if ! found torch; then
  TORCH=$TORCH_SPEC WHY="torch is missing"
elif [ -n "${DISTMETRICS_TORCH:-}" ] && [ "$DISTMETRICS_TORCH" != "$HAD_TORCH" ]; then
  TORCH=$TORCH_SPEC WHY="DISTMETRICS_TORCH=$DISTMETRICS_TORCH is not the torch spec it installed (${HAD_TORCH:-none})"
fi
PROJECT_WHY=""
if [ "$PROJECT" != "$HAD_PROJECT" ]; then
  PROJECT_WHY="pyproject.toml is not the one it installed"
elif ! found distmetrics tensorboard wandb megatron.core nvdlfw_inspect pytest xdist matplotlib PIL orjson \
    lightning accelerate transformers; then
  PROJECT_WHY="a module it installs is missing"
fi
if [ "$CHECK" = 1 ]; then
  if [ -z "$TORCH$PROJECT_WHY" ]; then
    echo "setup has nothing to install into $VENV"
    exit 0
  fi
  echo "setup would install into $VENV:${TORCH:+ $TORCH ($WHY)}${PROJECT_WHY:+ the project ($PROJECT_WHY)}"
  exit 1
fi
if [ -n "$TORCH$PROJECT_WHY" ]; then
  "$PY" -m pip install -q --upgrade pip
  if [ -n "$TORCH" ]; then
    "$PY" -m pip install -q "$TORCH"
    HAD_TORCH=$TORCH
  fi
  if [ -n "$PROJECT_WHY" ]; then
    "$PY" -m pip install -q -e ".[all,dev]"
    HAD_PROJECT=$PROJECT
  fi
  printf '%s\n%s\n' "$HAD_TORCH" "$HAD_PROJECT" > "$STAMP"  # only once the installs succeeded
fi
"$PY" -c "import torch, distmetrics; print(f'distmetrics {distmetrics.__version__}, torch {torch.__version__}')"
