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
# ~/.cache/posttrain/kube after that, one build at a time); the kube tests, sorted last, wait for it.
# Each run of this script gets a plane of its own (a fresh state folder, free ports), stopped and
# removed at the end, so two people testing on one machine never share or stop each other's plane.
# When it cannot start (e.g. not root on a fresh machine), the kube tests are skipped with its log's
# last lines, and fail instead under CI=true. POSTTRAIN_KUBECONFIG=PATH uses a plane (or cluster)
# already there; POSTTRAIN_KUBE_STATE=DIR uses that state folder (a plane already running there is
# left running); POSTTRAIN_KUBE_TESTS=0 skips them (CI too); POSTTRAIN_KUBE_NODE=1 also runs pods on
# a real node (tests/kube/test_node.py starts and stops it; root, and the first time a 9-minute build
# of the kubelet and controllers).
# Under CI=true, as root, the node tests run too (POSTTRAIN_KUBE_NODE=1): pods on a real node, and
# the run as pods (tests/kube/test_node.py: rl_run and a checkpoint's eval on the node, its two
# images built the first time, about 10 minutes; kept in the node's containerd and ~/.cache after).
if [[ ${CI:-} == true && -z ${POSTTRAIN_KUBE_NODE:-} && $(id -u) -eq 0 && ${POSTTRAIN_KUBE_TESTS:-1} != 0 ]]; then
    export POSTTRAIN_KUBE_NODE=1
fi
kube_started=
kube_own_state=
if [[ -z ${POSTTRAIN_KUBECONFIG:-} && ${POSTTRAIN_KUBE_TESTS:-1} != 0 ]]; then
    if [[ -n ${POSTTRAIN_KUBE_STATE:-} ]]; then
        plane=$(bash scripts/kube-local.sh status 2>/dev/null || true)
        [[ $plane == *"apiserver: running"* ]] || kube_started=1  # a plane already running is left running
    else
        POSTTRAIN_KUBE_STATE=$(mktemp -d -t posttrain-kube-plane.XXXXXX)
        export POSTTRAIN_KUBE_STATE
        kube_own_state=$POSTTRAIN_KUBE_STATE
        kube_started=1
    fi
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
    # this run's own plane: its etcd data, certificates and logs go with it (mounts a node left were
    # undone by stop; --one-file-system keeps rm out of any that were not)
    [[ -n $kube_own_state && $kube_own_state == */posttrain-kube-plane.* ]] && rm -rf --one-file-system "$kube_own_state"
    rm -f "$kube_log" "$kube_log.out" "$kube_log.rc"  # the kube tests quoted it where it mattered
fi
exit "$status"
