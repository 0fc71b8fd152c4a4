#!/usr/bin/env bash
# Quick start, part one: set up this machine, then run the whole asset graph on the embedded default.
# bash scripts/demo.sh [--seed N] [--home DIR]: N is the trainer's seed and the RL task stream's.
set -euo pipefail
cd "$(dirname "$0")/.."
# The demo's 15 minutes count from here, set-up included: it leaves out the mid-run checkpoint's
# evaluation when that would run past them.
export POSTTRAIN_DEMO_STARTED_AT=${POSTTRAIN_DEMO_STARTED_AT:-$(date +%s)}
bash scripts/setup.sh
exec .venv/bin/posttrain demo "$@"
