#!/usr/bin/env bash
# Prepares a fresh machine for posttrain: system packages (when root and missing), a virtual
# environment in .venv and the project installed into it. Safe to run again: it skips what is done.
set -euo pipefail
cd "$(dirname "$0")/.."

# bubblewrap and runsc (gVisor) isolate sandboxes; chromium renders the UI in tests; git holds task repos.
apt_packages=(git bubblewrap runsc chromium)
missing=()
for pkg in "${apt_packages[@]}"; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if ((${#missing[@]})); then
    if [[ $(id -u) -eq 0 ]]; then
        echo "setup: installing system packages: ${missing[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    else
        echo "setup: missing system packages ${missing[*]} (run as root to install them); sandbox runtimes that need them are unavailable" >&2
    fi
fi

python=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
    echo "setup: creating .venv"
    "$python" -m venv .venv
fi
stamp=.venv/.posttrain-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [[ ! -f $stamp || $(cat "$stamp") != "$want" ]]; then
    echo "setup: installing posttrain and its dependencies into .venv (first run takes a few minutes)"
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -e '.[test]'
    echo "$want" >"$stamp"
fi
