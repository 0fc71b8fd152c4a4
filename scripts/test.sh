#!/usr/bin/env bash
# Quick start, part two: set up this machine, then run the whole test suite.
# Fails when any test fails, and also when no test ran (pytest's exit code 5). The 30 slowest
# tests are listed at the end, with their times. The files are shared out among
# POSTTRAIN_TEST_WORKERS pytest processes (2 by default; 0 runs them all in this one): much of the
# suite waits on servers, daemons and sandboxes rather than using a core, and a file's tests stay
# together so that a file's shared servers start once. The files go out in the order
# tests/conftest.py gives them (the longest first), not re-sorted by their number of tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -p no:cacheprovider -ra --durations=30 \
    -n "${POSTTRAIN_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
