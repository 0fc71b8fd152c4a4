#!/usr/bin/env bash
# Quick start, part one: set up this machine, then run the whole asset graph on the embedded default.
# bash scripts/demo.sh [--seed N] [--home DIR]: N is the trainer's seed and the RL task stream's.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/posttrain demo "$@"
