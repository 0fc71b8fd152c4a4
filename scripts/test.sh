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

# The tests marked kube (tests/kube) run against a real kube-apiserver on loopback. Its control
# plane starts in the background while the other tests run (the first time on a machine it builds
# kube-apiserver from Debian's kubernetes source package, niced: 6-13 minutes on 2 cores; cached in
# ~/.cache/posttrain/kube after that); the kube tests, sorted last, wait for it. When it cannot start
# (e.g. not root on a fresh machine), they are skipped with its log's last lines.
# POSTTRAIN_KUBECONFIG=PATH uses a plane (or cluster) already there; POSTTRAIN_KUBE_TESTS=0 skips them;
# POSTTRAIN_KUBE_NODE=1 also runs pods on a real node (tests/kube/test_node.py starts and stops it; root,
# and the first time a 9-minute build of the kubelet and controllers).
kube_started=
if [[ -z ${POSTTRAIN_KUBECONFIG:-} && ${POSTTRAIN_KUBE_TESTS:-1} != 0 ]]; then
    plane=$(bash scripts/kube-local.sh status 2>/dev/null || true)
    [[ $plane == *"apiserver: running"* ]] || kube_started=1  # a plane already running is left running
    kube_log=$(mktemp -t posttrain-kube-start.XXXXXX)
    export POSTTRAIN_KUBE_START_LOG=$kube_log
    (
        rc=0
        bash scripts/kube-local.sh start >"$kube_log.out" 2>"$kube_log" || rc=$?
        echo "$rc" >"$kube_log.rc"
    ) &
    kube_start=$!
fi
status=0
.venv/bin/python -m pytest -p no:cacheprovider -ra --durations=30 \
    -n "${POSTTRAIN_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@" || status=$?
if [[ -n ${kube_start:-} ]]; then
    wait "$kube_start" || true
    [[ -n $kube_started ]] && bash scripts/kube-local.sh stop || true
    rm -f "$kube_log" "$kube_log.out" "$kube_log.rc"  # the kube tests quoted it where it mattered
fi
exit "$status"
