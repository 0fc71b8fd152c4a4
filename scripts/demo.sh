#!/usr/bin/env bash
# Quick start, part one: set up this machine, then run the whole asset graph on the embedded default.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/posttrain demo "$@"
