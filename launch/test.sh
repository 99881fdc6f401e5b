#!/usr/bin/env bash
# Set up (if needed) and run the test suite: real gloo process groups, real sinks read back.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
VENV=${DISTMETRICS_VENV:-.venv}
# Hundreds of fresh interpreters (torchrun ranks, CLI runs, killed jobs) import distmetrics and tests: with
# PYTHONDONTWRITEBYTECODE set, each compiled them anew (0.25 s of CPU each; 13% of two child-heavy files' CPU)
unset PYTHONDONTWRITEBYTECODE
if [ $# -eq 0 ]; then
  # Test files share out over one pytest worker per core, at most 4 (DISTMETRICS_TEST_WORKERS sets it): one
  # worker alone left a third of 2 cores idle (ranks waiting on each other, sinks, timeouts, fresh interpreters).
  CORES=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || echo 2)  # nproc reads OMP_NUM_THREADS
  WORKERS=${DISTMETRICS_TEST_WORKERS:-$(( CORES < 4 ? CORES : 4 ))}
  "$VENV/bin/python" -m pytest tests -q -n "$WORKERS" --dist loadfile --durations=20  # 20 slowest: where time goes
else  # only what was asked: a test file or id, or options alone (pyproject's testpaths: tests)
  "$VENV/bin/python" -m pytest -q "$@"
fi
# The suite hides the GPU (tests/conftest.py); where torch sees one, the GPU tests run on their own
# after the whole suite. With arguments the run above was the one asked for: say how to run them.
if "$VENV/bin/python" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
  if [ $# -eq 0 ]; then
    exec "$VENV/bin/python" -m pytest tests/test_cuda.py -q
  fi
  echo "GPU tests not run with arguments; run them on their own: $VENV/bin/python -m pytest tests/test_cuda.py"
fi
