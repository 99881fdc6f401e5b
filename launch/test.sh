#!/usr/bin/env bash
# Set up (if needed) and run the test suite: real gloo process groups, real sinks read back.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
VENV=${DISTMETRICS_VENV:-.venv}
exec "$VENV/bin/python" -m pytest tests -q "$@"
