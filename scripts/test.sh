#!/usr/bin/env bash
# Quick start, part two: set up this machine, then run the whole test suite.
# Fails when any test fails, and also when no test ran (pytest's exit code 5). The 30 slowest
# tests are listed at the end, with their times.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -p no:cacheprovider -ra --durations=30 "$@"
