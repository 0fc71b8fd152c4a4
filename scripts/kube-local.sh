#!/usr/bin/env bash
# A real Kubernetes control plane on loopback, for tests and for users without a cluster.
#
#   bash scripts/kube-local.sh start        # prints the kubeconfig's path as its last line
#   bash scripts/kube-local.sh stop         # ends only what start started
#   bash scripts/kube-local.sh build [CMD]  # only builds (kube-apiserver by default; `node` builds
#                                           # kubelet, kube-scheduler, kube-controller-manager, kube-proxy)
#   bash scripts/kube-local.sh status
#   bash scripts/kube-local.sh built [CMD...|node]  # exit 0 when those binaries are built already
#   bash scripts/kube-local.sh start-node   # after start: a node that runs pods (see below)
#   bash scripts/kube-local.sh stop-node    # ends the node only
#
# Nothing is downloaded outside the package registries: kube-apiserver is built once from Debian's
# own `kubernetes` source package (pinned below; its Go modules are vendored, so the build is
# offline) and cached under ~/.cache/posttrain/kube/<version>/; etcd is Debian's `etcd-server`.
# The first build took 13-16 minutes on 2 busy shared cores (run niced); later starts take seconds.
#
# `start` runs etcd and kube-apiserver on 127.0.0.1 with RBAC, service-account tokens (the
# TokenRequest API), a static admin token and PodSecurityPolicy admission, creates the namespace
# (POSTTRAIN_KUBE_NAMESPACE, default `posttrain`, labelled for Pod Security Admission `restricted`)
# with its `default` service account (what the controller-manager would do), the plane's three
# PodSecurityPolicies (below), and writes a kubeconfig. Without `start-node` there is no kubelet:
# pods are accepted and stay Pending.
#
# PodSecurityPolicies (every pod must be admitted under one its creator or its service account may
# `use`; see docs/kubernetes.md, "Least privilege"):
#   posttrain-sandbox     what sandboxes.k8s.pod_spec makes and nothing broader: emptyDir volumes
#                         only, non-root, no privilege or escalation, every capability dropped, no
#                         host namespaces or ports, RuntimeDefault seccomp, RuntimeClass gvisor or
#                         kata (a pod that names none gets gvisor: PSP lets an unset one through).
#                         Used by each run's sandbox pool (its Role, training/planner/k8s.py).
#   posttrain-workload    the run's workloads (trainer, engines, router, pool): the same, plus
#                         claims, ConfigMaps, Secrets, projected and downward-API volumes, any
#                         RuntimeClass. Used by the controllers that create their pods (ReplicaSet,
#                         StatefulSet, Job, DaemonSet), not by any account of a run's namespace.
#   posttrain-privileged  anything: kube-system's own accounts, in kube-system only, and the admin
#                         (system:masters may use every policy).
#
# `start-node` adds a node to the running plane, so that pods run: kube-scheduler,
# kube-controller-manager, kube-proxy (iptables mode) and a kubelet (cgroupfs driver) built from the
# same source, containerd and runc from Debian with a bridge network (containernetworking-plugins,
# bridge pt0 on 10.244.0.0/24) and gVisor (`runsc`, the RuntimeClass `gvisor`) as a second runtime,
# and two images built here from this machine's files and imported with `ctr`:
# `posttrain.local/pause:N` (Debian's static busybox, sleeping) and `posttrain.local/python:N` (this
# machine's python3 and its standard library in the skeleton of a task image, pxd at
# /opt/pxd/pxd.py). It needs root. What a run needs of a cluster besides: cluster DNS (Debian's
# dnsmasq on the bridge's address, the kubelet's --cluster-dns, answering
# <svc>.<ns>.svc.cluster.local and a StatefulSet pod's <host>.<svc>.<ns>.svc.cluster.local from
# hosts files the plane agent writes from the API), Services' ClusterIPs (kube-proxy), the API
# server reachable from pods (it listens on every address, advertises the bridge's for the
# `kubernetes` Service, and an INPUT rule drops its port to anything but this machine and the pod
# network), and volumes: the plane agent gives each Pending claim without a storage class a hostPath
# PersistentVolume of its own under STATE/volumes/<namespace>/<claim>. A test plane: one node,
# hostPath volumes, fixed node ports (10250, 53 on the bridge), so one node plane per machine.
#
# Settings (environment): POSTTRAIN_KUBE_CACHE (build cache, shared: builds take a lock),
# POSTTRAIN_KUBE_STATE (where a running plane keeps its data, certificates, logs, pids and ports;
# default ~/.cache/posttrain/kube-local/CHECKOUT-HASH, one per checkout, so two checkouts never
# share or stop a plane; scripts/test.sh gives each test session a folder of its own),
# POSTTRAIN_KUBE_PORT (apiserver), POSTTRAIN_KUBE_ETCD_PORT (etcd clients; peers on the port 10
# above): without them a plane's first start picks free ports and keeps them in STATE/ports.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)

# The pinned source: Debian bookworm's kubernetes (upstream v1.20.2).
KUBE_DEB_VERSION=1.20.5+really1.20.2-1.1+deb12u1
KUBE_UPSTREAM=1.20.5+really1.20.2
cache=${POSTTRAIN_KUBE_CACHE:-$HOME/.cache/posttrain/kube/$KUBE_DEB_VERSION}
checkout_id=$(basename "$repo" | sed 's/[^A-Za-z0-9._-]/-/g')-$(printf '%s' "$repo" | sha256sum | cut -c1-10)
state=${POSTTRAIN_KUBE_STATE:-$HOME/.cache/posttrain/kube-local/$checkout_id}
namespace=${POSTTRAIN_KUBE_NAMESPACE:-posttrain}
service_cidr=10.96.0.0/24
# The node's pod network: the bridge pt0 (made by start-node, then used by the CNI bridge plugin) and
# its address, where pods reach the API server (the `kubernetes` Service's endpoint) and cluster DNS.
pod_cidr=10.244.0.0/24
bridge_ip=10.244.0.1
cluster_domain=cluster.local

log() { echo "kube-local: $*" >&2; }
die() { log "$*"; exit 1; }

# The plane's ports: the environment's, else those STATE/ports keeps from its first start, else
# free ones (asked of the kernel), written there. Read by every command that talks to the plane.
load_ports() {
    local saved_api= saved_etcd= saved_peer=
    [[ -f $state/ports ]] && read -r saved_api saved_etcd saved_peer <"$state/ports"
    apiserver_port=${POSTTRAIN_KUBE_PORT:-$saved_api}
    etcd_port=${POSTTRAIN_KUBE_ETCD_PORT:-$saved_etcd}
    if [[ -n ${POSTTRAIN_KUBE_ETCD_PORT:-} ]]; then etcd_peer_port=$((etcd_port + 10)); else etcd_peer_port=$saved_peer; fi
    if [[ -z $apiserver_port || -z $etcd_port || -z $etcd_peer_port ]]; then
        local free
        free=($(python3 -c 'import socket
socks = [socket.socket() for _ in range(3)]
for s in socks: s.bind(("127.0.0.1", 0))
print(*[s.getsockname()[1] for s in socks])'))
        apiserver_port=${apiserver_port:-${free[0]}}
        etcd_port=${etcd_port:-${free[1]}}
        etcd_peer_port=${etcd_peer_port:-${free[2]}}
    fi
    [[ $apiserver_port =~ ^[0-9]+$ && $etcd_port =~ ^[0-9]+$ && $etcd_peer_port =~ ^[0-9]+$ ]] ||
        die "bad ports: apiserver '$apiserver_port', etcd '$etcd_port', etcd peers '$etcd_peer_port' (POSTTRAIN_KUBE_PORT, POSTTRAIN_KUBE_ETCD_PORT, $state/ports)"
}

save_ports() {
    mkdir -p "$state" && chmod 700 "$state"
    echo "$apiserver_port $etcd_port $etcd_peer_port" >"$state/ports"
}

ensure_packages() {
    local missing=() pkg
    for pkg in "$@"; do dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg"); done
    ((${#missing[@]})) || return 0
    [[ $(id -u) -eq 0 ]] || die "missing Debian packages ${missing[*]}; install them as root (apt-get install ${missing[*]})"
    log "installing Debian packages: ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# deb-src for bookworm main, added once when no deb-src entry exists, so `apt-get source` works.
ensure_deb_src() {
    if grep -rqs --include='*.list' --include='*.sources' -E '^(deb-src|Types:.*deb-src)' /etc/apt/sources.list /etc/apt/sources.list.d/; then
        local versions
        versions=$(apt-cache showsrc kubernetes 2>/dev/null || true)
        [[ $versions == *"Version: $KUBE_DEB_VERSION"* ]] && return 0
    fi
    [[ $(id -u) -eq 0 ]] || die "no deb-src entry for Debian bookworm main in /etc/apt; add one (Types: deb-src) as root"
    log "adding deb-src for bookworm main (/etc/apt/sources.list.d/posttrain-deb-src.sources)"
    cat >/etc/apt/sources.list.d/posttrain-deb-src.sources <<'EOF'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
    apt-get update -qq
}

# What the binaries in $cache/bin were built from besides the pinned source; a change rebuilds them.
# 2: vendored github.com/modern-go/reflect2 v1.0.1 replaced by Debian's 1.0.2 (v1.0.1 crashes under
# Go >= 1.18, bookworm's golang-go is 1.19: kube-apiserver panicked decoding any apply patch).
KUBE_BUILD_REV=2
# what start-node runs, built from the same source (`build node`, `built node`)
NODE_BINARIES=(kubelet kube-scheduler kube-controller-manager kube-proxy)

# build CMD...: builds cmd/<CMD> from the pinned source into $cache/bin (skipping those there).
# One build at a time per cache (a lock): a second caller waits, then finds the binaries built.
build() {
    mkdir -p "$cache"
    exec {build_lock}>"$cache/.build.lock"
    if ! flock -n "$build_lock"; then
        log "another build is using $cache; waiting for it"
        flock "$build_lock"
    fi
    build_locked "$@"
    flock -u "$build_lock"
}

build_locked() {
    local wanted=() cmd
    if [[ $(cat "$cache/bin/.build-rev" 2>/dev/null) != "$KUBE_BUILD_REV" ]]; then rm -f "$cache"/bin/kube*; fi
    for cmd in "$@"; do [[ -x $cache/bin/$cmd ]] || wanted+=("$cmd"); done
    ((${#wanted[@]})) || return 0
    ensure_packages golang-go jq rsync dpkg-dev golang-github-modern-go-reflect2-dev
    local src=$cache/src/kubernetes-$KUBE_UPSTREAM
    if [[ ! -f $src/.posttrain-unpacked ]]; then
        ensure_deb_src
        log "fetching Debian's kubernetes source package $KUBE_DEB_VERSION"
        rm -rf "$cache/src" && mkdir -p "$cache/src"
        (cd "$cache/src" && apt-get source -qq "kubernetes=$KUBE_DEB_VERSION" >/dev/null 2>&1) ||
            die "apt-get source kubernetes=$KUBE_DEB_VERSION failed (is deb-src for bookworm main reachable?)"
        touch "$src/.posttrain-unpacked"
    fi
    local reflect2=/usr/share/gocode/src/github.com/modern-go/reflect2
    [[ -f $reflect2/reflect2.go ]] || die "golang-github-modern-go-reflect2-dev has no $reflect2/reflect2.go"
    if ! cmp -s "$reflect2/reflect2.go" "$src/vendor/github.com/modern-go/reflect2/reflect2.go"; then
        log "vendoring Debian's github.com/modern-go/reflect2 $(dpkg-query -W -f='${Version}' golang-github-modern-go-reflect2-dev) (v1.0.1 crashes under Go >= 1.18)"
        rm -rf "$src/vendor/github.com/modern-go/reflect2"
        mkdir -p "$src/vendor/github.com/modern-go/reflect2"
        find "$reflect2" -maxdepth 1 -type f \( -name '*.go' -o -name '*.s' \) ! -name '*_test.go' \
            -exec cp {} "$src/vendor/github.com/modern-go/reflect2/" \;
    fi
    log "building ${wanted[*]} from Debian's kubernetes $KUBE_UPSTREAM (first time: 13-16 min on 2 busy cores); log: $cache/build.log"
    mkdir -p "$src/.go/src/k8s.io" "$cache/bin" "$cache/go-build"
    [[ -L $src/.go/src/k8s.io/kubernetes ]] || ln -s ../../.. "$src/.go/src/k8s.io/kubernetes"
    local start=$SECONDS
    (cd "$src" && env GOPATH="$src/.go" GOCACHE="$cache/go-build" CGO_ENABLED=0 HOME="$cache" \
        nice -n 10 make WHAT="${wanted[*]/#/cmd/}") >>"$cache/build.log" 2>&1 ||
        die "the build failed; see the end of $cache/build.log"
    for cmd in "${wanted[@]}"; do install -m 0755 "$src/_output/bin/$cmd" "$cache/bin/$cmd"; done
    echo "$KUBE_BUILD_REV" >"$cache/bin/.build-rev"
    log "built ${wanted[*]} in $((SECONDS - start)) s"
    # Every binary there: the build's objects and Go cache (GBs in _output) go, the source stays. A
    # test machine's disk is not ours alone, and the image builds that follow need it more.
    for cmd in kube-apiserver "${NODE_BINARIES[@]}"; do
        [[ -x $cache/bin/$cmd ]] || return 0
    done
    rm -rf "$src/_output"
}

# built CMD...: whether every cmd/<CMD> is in $cache/bin, built from the pinned source (so a start
# that needs them builds nothing).
built() {
    [[ $(cat "$cache/bin/.build-rev" 2>/dev/null) == "$KUBE_BUILD_REV" ]] || return 1
    local cmd
    for cmd in "$@"; do [[ -x $cache/bin/$cmd ]] || return 1; done
}

pid_alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

# Ends the process in pidfile $1 (one that start started), waiting for it to go.
end_pid() {
    local pidfile=$1 pid i
    pid_alive "$pidfile" || { rm -f "$pidfile"; return 0; }
    pid=$(cat "$pidfile")
    kill "$pid" 2>/dev/null || true
    for ((i = 0; i < 100; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null || true
    rm -f "$pidfile"
}

make_pki() {
    local pki=$state/pki
    make_kubelet_client_cert
    # kube-proxy's token (planes made before it had one get it here; read at the API server's start)
    if [[ -f $pki/tokens.csv ]] && ! grep -q ',system:kube-proxy,' "$pki/tokens.csv"; then
        echo "$(openssl rand -hex 16),system:kube-proxy,system:kube-proxy" >>"$pki/tokens.csv"
    fi
    [[ -f $pki/apiserver.crt ]] && return 0
    mkdir -p "$pki"
    openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj /CN=posttrain-kube-local-ca \
        -keyout "$pki/ca.key" -out "$pki/ca.crt" 2>/dev/null
    openssl req -newkey rsa:2048 -nodes -subj /CN=kube-apiserver \
        -keyout "$pki/apiserver.key" -out "$pki/apiserver.csr" 2>/dev/null
    printf 'subjectAltName=IP:127.0.0.1,IP:10.96.0.1,IP:10.244.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc\n' >"$pki/san.ext"
    openssl x509 -req -in "$pki/apiserver.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -CAcreateserial \
        -days 3650 -extfile "$pki/san.ext" -out "$pki/apiserver.crt" 2>/dev/null
    openssl genrsa -out "$pki/sa.key" 2048 2>/dev/null
    openssl rsa -in "$pki/sa.key" -pubout -out "$pki/sa.pub" 2>/dev/null
    # Static tokens: the admin (system:masters) and, for a node plane, the kubelet and controllers.
    {
        echo "$(openssl rand -hex 16),admin,admin,system:masters"
        echo "$(openssl rand -hex 16),system:node:posttrain-node,system:node:posttrain-node,system:nodes"
        echo "$(openssl rand -hex 16),system:kube-controller-manager,system:kube-controller-manager"
        echo "$(openssl rand -hex 16),system:kube-scheduler,system:kube-scheduler"
        echo "$(openssl rand -hex 16),system:kube-proxy,system:kube-proxy"
    } >"$pki/tokens.csv"
    chmod 600 "$pki"/*.key "$pki/tokens.csv"
    make_kubelet_client_cert
}

# The apiserver's client certificate towards kubelets (exec, attach, logs): system:masters.
make_kubelet_client_cert() {
    local pki=$state/pki
    [[ -f $pki/ca.key && ! -f $pki/kubelet-client.crt ]] || return 0
    openssl req -newkey rsa:2048 -nodes -subj "/O=system:masters/CN=kube-apiserver-kubelet-client" \
        -keyout "$pki/kubelet-client.key" -out "$pki/kubelet-client.csr" 2>/dev/null
    openssl x509 -req -in "$pki/kubelet-client.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -CAcreateserial \
        -days 3650 -out "$pki/kubelet-client.crt" 2>/dev/null
    chmod 600 "$pki/kubelet-client.key"
}

# token_for USER: the static token of USER.
token_for() { awk -F, -v u="$1" '$2 == u {print $1}' "$state/pki/tokens.csv"; }

write_kubeconfig() {  # write_kubeconfig PATH USER
    cat >"$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: posttrain-local
  cluster:
    server: https://127.0.0.1:$apiserver_port
    certificate-authority: $state/pki/ca.crt
users:
- name: $2
  user:
    token: $(token_for "$2")
contexts:
- name: posttrain-local
  context:
    cluster: posttrain-local
    user: $2
    namespace: $namespace
current-context: posttrain-local
EOF
    chmod 600 "$1"
}

apiserver_ready() {
    curl -fsS --max-time 2 --cacert "$state/pki/ca.crt" -H "Authorization: Bearer $(token_for admin)" \
        "https://127.0.0.1:$apiserver_port/readyz" >/dev/null 2>&1
}

# apply REST_PATH YAML: a server-side apply of one object as the admin (curl: no kubectl needed).
apply() {
    curl -fsS --max-time 30 --cacert "$state/pki/ca.crt" -H "Authorization: Bearer $(token_for admin)" \
        -X PATCH -H 'Content-Type: application/apply-patch+yaml' --data-binary "$2" \
        "https://127.0.0.1:$apiserver_port$1?fieldManager=kube-local&force=true" >/dev/null ||
        die "applying $1 failed"
}

start() {
    build kube-apiserver
    ensure_packages etcd-server curl openssl
    load_ports
    save_ports
    mkdir -p "$state/logs"
    make_pki
    local t0
    t0=$(date +%s%N)
    if ! pid_alive "$state/etcd.pid"; then
        setsid etcd --name posttrain-local --data-dir "$state/etcd" \
            --listen-client-urls "http://127.0.0.1:$etcd_port" --advertise-client-urls "http://127.0.0.1:$etcd_port" \
            --listen-peer-urls "http://127.0.0.1:$etcd_peer_port" --initial-advertise-peer-urls "http://127.0.0.1:$etcd_peer_port" \
            --initial-cluster "posttrain-local=http://127.0.0.1:$etcd_peer_port" \
            --quota-backend-bytes $((1024 * 1024 * 1024)) \
            </dev/null >"$state/logs/etcd.log" 2>&1 &
        echo $! >"$state/etcd.pid"
    fi
    if ! pid_alive "$state/apiserver.pid"; then
        setsid "$cache/bin/kube-apiserver" \
            --bind-address=0.0.0.0 --advertise-address="$bridge_ip" --secure-port="$apiserver_port" \
            --etcd-servers="http://127.0.0.1:$etcd_port" \
            --tls-cert-file="$state/pki/apiserver.crt" --tls-private-key-file="$state/pki/apiserver.key" \
            --client-ca-file="$state/pki/ca.crt" \
            --kubelet-client-certificate="$state/pki/kubelet-client.crt" --kubelet-client-key="$state/pki/kubelet-client.key" \
            --kubelet-preferred-address-types=InternalIP,Hostname \
            --token-auth-file="$state/pki/tokens.csv" \
            --authorization-mode=Node,RBAC \
            --service-account-key-file="$state/pki/sa.pub" \
            --service-account-signing-key-file="$state/pki/sa.key" \
            --service-account-issuer=https://kubernetes.default.svc \
            --api-audiences=https://kubernetes.default.svc \
            --service-cluster-ip-range="$service_cidr" \
            --enable-admission-plugins=NamespaceLifecycle,ServiceAccount,LimitRanger,ResourceQuota,NodeRestriction,PodSecurityPolicy \
            --allow-privileged=true \
            </dev/null >"$state/logs/kube-apiserver.log" 2>&1 &
        echo $! >"$state/apiserver.pid"
    fi
    write_kubeconfig "$state/kubeconfig" admin
    local i
    for ((i = 0; i < 600; i++)); do
        apiserver_ready && break
        pid_alive "$state/apiserver.pid" || die "kube-apiserver exited; see $state/logs/kube-apiserver.log"
        sleep 0.2
    done
    apiserver_ready || die "kube-apiserver not ready after 120 s; see $state/logs/kube-apiserver.log"
    guard_apiserver_port
    log "apiserver ready in $((($(date +%s%N) - t0) / 1000000)) ms on https://127.0.0.1:$apiserver_port"
    # The pod security policies first: with the admission plugin on, no pod is admitted without one.
    apply_pod_security_policies
    # What a namespace needs: the namespace (with the Pod Security Admission labels a server >= 1.23
    # enforces; this one ignores them) and its default service account (the controller-manager
    # creates that one on a full cluster; pods cannot be admitted without it); and the RuntimeClass
    # every sandbox pod names (gVisor, handler runsc: docs/kubernetes.md, "What to install first").
    apply "/api/v1/namespaces/$namespace" "{apiVersion: v1, kind: Namespace, metadata: {name: $namespace, labels: $POD_SECURITY_LABELS}}"
    apply "/api/v1/namespaces/$namespace/serviceaccounts/default" \
        "{apiVersion: v1, kind: ServiceAccount, metadata: {name: default, namespace: $namespace}}"
    apply /apis/node.k8s.io/v1/runtimeclasses/gvisor "{apiVersion: node.k8s.io/v1, kind: RuntimeClass, metadata: {name: gvisor}, handler: runsc}"
    echo "$state/kubeconfig"
}

# Pod Security Admission (Kubernetes >= 1.23) on a run's namespace: every pod of a run, sandboxes
# included, meets the `restricted` level.
POD_SECURITY_LABELS='{pod-security.kubernetes.io/enforce: restricted, pod-security.kubernetes.io/warn: restricted, pod-security.kubernetes.io/audit: restricted}'

# The three PodSecurityPolicies and who may use them (see the top of this file).
apply_pod_security_policies() {
    local restricted_spec='privileged: false, allowPrivilegeEscalation: false, defaultAllowPrivilegeEscalation: false,
        requiredDropCapabilities: [ALL], hostNetwork: false, hostPID: false, hostIPC: false,
        runAsUser: {rule: MustRunAsNonRoot},
        runAsGroup: {rule: MayRunAs, ranges: [{min: 1, max: 65535}]},
        supplementalGroups: {rule: MayRunAs, ranges: [{min: 1, max: 65535}]},
        fsGroup: {rule: MayRunAs, ranges: [{min: 1, max: 65535}]},
        seLinux: {rule: RunAsAny}, readOnlyRootFilesystem: false, forbiddenSysctls: ["*"]'
    local seccomp='seccomp.security.alpha.kubernetes.io/allowedProfileNames: runtime/default'
    apply /apis/policy/v1beta1/podsecuritypolicies/posttrain-sandbox "{apiVersion: policy/v1beta1, kind: PodSecurityPolicy,
        metadata: {name: posttrain-sandbox, annotations: {$seccomp}},
        spec: {$restricted_spec, volumes: [emptyDir], runtimeClass: {allowedRuntimeClassNames: [gvisor, kata], defaultRuntimeClassName: gvisor}}}"
    apply /apis/policy/v1beta1/podsecuritypolicies/posttrain-workload "{apiVersion: policy/v1beta1, kind: PodSecurityPolicy,
        metadata: {name: posttrain-workload, annotations: {$seccomp,
            seccomp.security.alpha.kubernetes.io/defaultProfileName: runtime/default}},
        spec: {$restricted_spec, volumes: [emptyDir, persistentVolumeClaim, configMap, secret, projected, downwardAPI]}}"
    apply /apis/policy/v1beta1/podsecuritypolicies/posttrain-privileged "{apiVersion: policy/v1beta1, kind: PodSecurityPolicy,
        metadata: {name: posttrain-privileged, annotations: {seccomp.security.alpha.kubernetes.io/allowedProfileNames: '*'}},
        spec: {privileged: true, allowPrivilegeEscalation: true, allowedCapabilities: ['*'], volumes: ['*'],
            hostNetwork: true, hostPID: true, hostIPC: true, hostPorts: [{min: 0, max: 65535}],
            runAsUser: {rule: RunAsAny}, supplementalGroups: {rule: RunAsAny}, fsGroup: {rule: RunAsAny},
            seLinux: {rule: RunAsAny}}}"
    local which
    for which in workload privileged; do
        apply "/apis/rbac.authorization.k8s.io/v1/clusterroles/posttrain-psp-$which" "{apiVersion: rbac.authorization.k8s.io/v1,
            kind: ClusterRole, metadata: {name: posttrain-psp-$which},
            rules: [{apiGroups: [policy], resources: [podsecuritypolicies], verbs: [use], resourceNames: [posttrain-$which]}]}"
    done
    # the controllers act as their own service accounts (--use-service-account-credentials)
    apply /apis/rbac.authorization.k8s.io/v1/clusterrolebindings/posttrain-psp-workload "{apiVersion: rbac.authorization.k8s.io/v1,
        kind: ClusterRoleBinding, metadata: {name: posttrain-psp-workload},
        roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: posttrain-psp-workload},
        subjects: [{kind: ServiceAccount, namespace: kube-system, name: replicaset-controller},
                   {kind: ServiceAccount, namespace: kube-system, name: statefulset-controller},
                   {kind: ServiceAccount, namespace: kube-system, name: job-controller},
                   {kind: ServiceAccount, namespace: kube-system, name: daemon-set-controller}]}"
    apply /apis/rbac.authorization.k8s.io/v1/namespaces/kube-system/rolebindings/posttrain-psp-privileged "{apiVersion: rbac.authorization.k8s.io/v1,
        kind: RoleBinding, metadata: {name: posttrain-psp-privileged, namespace: kube-system},
        roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: posttrain-psp-privileged},
        subjects: [{kind: Group, apiGroup: rbac.authorization.k8s.io, name: 'system:serviceaccounts:kube-system'}]}"
}

# The API server listens on every address (pods reach it on the bridge's, through the `kubernetes`
# Service): an INPUT rule drops what comes to its port from elsewhere than this machine's own
# addresses and the pod network. Root only (without root the port stays open to the machine's networks).
apiserver_guard_rule() { echo "INPUT -p tcp --dport $apiserver_port -m addrtype ! --src-type LOCAL ! -s $pod_cidr -j DROP"; }
guard_apiserver_port() {
    [[ $(id -u) -eq 0 ]] && command -v iptables >/dev/null || { log "not root: the API server's port is not guarded"; return 0; }
    # shellcheck disable=SC2046
    iptables -C $(apiserver_guard_rule) 2>/dev/null || iptables -I $(apiserver_guard_rule)
}

stop() {
    load_ports
    # shellcheck disable=SC2046
    [[ $(id -u) -eq 0 ]] && command -v iptables >/dev/null && iptables -D $(apiserver_guard_rule) 2>/dev/null || true
    end_pid "$state/apiserver.pid"
    end_pid "$state/etcd.pid"
    log "stopped (state kept in $state; remove it for a fresh plane)"
}

status() {
    local what
    for what in etcd apiserver node/containerd node/kubelet node/scheduler node/controller-manager node/kube-proxy node/dnsmasq node/plane-agent; do
        if pid_alive "$state/$what.pid"; then echo "${what#node/}: running (pid $(cat "$state/$what.pid"))"; else echo "${what#node/}: stopped"; fi
    done
    [[ -f $state/kubeconfig ]] && echo "kubeconfig: $state/kubeconfig"
    [[ -f $state/ports ]] && echo "ports: $(cat "$state/ports") (apiserver, etcd clients, etcd peers)"
    echo "state: $state"
    return 0
}

# The tag of the node's images; a change rebuilds them. It names the pxd the python image carries, so
# a node built with another pxd builds its images again.
IMAGES_REV=4-$(cat "$repo/sandboxes/pxd.py" "$repo/sandboxes/standalone.py" | sha256sum | cut -c1-12)

# import_image NAME LAYER_TAR [CMD]: an OCI archive of one layer (scripts/oci-archive.py), imported
# into containerd's k8s.io namespace.
import_image() {
    local name=$1 layer=$2 cmd=${3:-'["/bin/sh"]'} sock=$state/node/containerd.sock
    printf '{"Env": ["PATH=/usr/local/bin:/usr/bin:/bin"], "Cmd": %s}\n' "$cmd" >"$state/node/image-config.json"
    python3 "$repo/scripts/oci-archive.py" --uncompressed "$name" "$layer" "$state/node/image.oci.tar" \
        "$state/node/image-config.json" || die "could not pack $layer into an OCI archive"
    ctr -a "$sock" -n k8s.io images import "$state/node/image.oci.tar" >/dev/null || die "ctr could not import $name"
    rm -f "$state/node/image.oci.tar"
}

# The two images of the node, built from this machine's files (nothing pulled).
build_images() {
    local work=$state/node/images py lib root
    [[ -n $state && $work == */node/images ]] || die "refusing to build images in '$work'"
    rm -rf "$work" && mkdir -p "$work/pause/bin" "$work/python"
    cp /bin/busybox "$work/pause/bin/busybox"
    ln -sf busybox "$work/pause/bin/sh"
    ln -sf busybox "$work/pause/bin/sleep"
    tar -C "$work/pause" -cf "$work/pause.tar" .
    import_image posttrain.local/pause:$IMAGES_REV "$work/pause.tar" '["/bin/sleep", "2147483647"]'
    # python3, the libraries it loads and its standard library; busybox for /bin/sh and cp; the
    # skeleton of sandboxes.images (pxd at /opt/pxd/pxd.py, /workspace and /home/sandbox of uid 1000)
    root=$work/python
    py=$(readlink -f /usr/bin/python3)
    mkdir -p "$root/bin" "$root/usr/bin" "$root/usr/lib" "$root/opt/pxd" "$root/workspace" "$root/home/sandbox" "$root/tmp" "$root/etc"
    for lib in $(ldd "$py" | grep -o '/[^ ]*'); do
        mkdir -p "$root$(dirname "$lib")"
        cp -L "$lib" "$root$lib"
    done
    cp "$py" "$root/usr/bin/python3"
    rsync -a --exclude test --exclude __pycache__ --exclude idlelib --exclude tkinter --exclude ensurepip \
        "/usr/lib/$(basename "$py")" "$root/usr/lib/"
    # the libraries the standard library's extension modules load (ctypes: libffi, ssl, zlib, ...)
    local so
    for so in "/usr/lib/$(basename "$py")"/lib-dynload/*.so; do
        for lib in $(ldd "$so" 2>/dev/null | grep -o '/[^ ]*'); do
            [[ -e $root$lib ]] && continue
            mkdir -p "$root$(dirname "$lib")"
            cp -L "$lib" "$root$lib"
        done
    done
    cp /bin/busybox "$root/bin/busybox"
    for lib in sh cp cat ls mkdir rm sleep env echo; do ln -sf busybox "$root/bin/$lib"; done
    cp "$repo/sandboxes/pxd.py" "$repo/sandboxes/standalone.py" "$root/opt/pxd/"  # pxd takes standalone.py from beside it
    printf 'root:x:0:0:root:/root:/bin/sh\nsandbox:x:1000:1000:sandbox:/home/sandbox:/bin/sh\n' >"$root/etc/passwd"
    printf 'root:x:0:\nsandbox:x:1000:\n' >"$root/etc/group"
    echo 'print(2 + 2)' >"$root/workspace/calc.py"
    chown -R 1000:1000 "$root/workspace" "$root/home/sandbox"
    chmod 1777 "$root/tmp"
    tar -C "$root" -cf "$work/python.tar" .
    import_image posttrain.local/python:$IMAGES_REV "$work/python.tar"
    rm -rf "$work"
}

# The plane's agent (python3, standard library only), run by start-node beside the node:
# - cluster DNS: every Service as <svc>.<ns>.svc.cluster.local (its ClusterIP; a headless one's
#   ready pod addresses, and <hostname>.<svc>.<ns>.svc.cluster.local for each pod with a hostname,
#   as a StatefulSet's are) written as a hosts file into the folder dnsmasq watches;
# - the run volume: each claim that is Pending with no storage class gets a hostPath
#   PersistentVolume of its own under STATE/volumes/<namespace>/<claim> (owned by uid 1000, the
#   workloads' user), bound to it by name, so the claim binds (what a storage provisioner does).
# It polls the API server as the admin once a second; its log is STATE/logs/plane-agent.log.
write_plane_agent() {
    cat >"$1" <<'PLANE_AGENT'
import hashlib, json, os, ssl, sys, time, urllib.request

server, ca, token_file, hosts_dir, volumes_dir, domain = sys.argv[1:7]
token = open(token_file).read().strip()
context = ssl.create_default_context(cafile=ca)


def call(method, path, body=None):
    request = urllib.request.Request(server + path, method=method, data=None if body is None else json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, context=context, timeout=10) as answer:
        return json.load(answer)


def hosts() -> str:
    lines = []
    endpoints = {(e["metadata"]["namespace"], e["metadata"]["name"]): e for e in call("GET", "/api/v1/endpoints")["items"]}
    for svc in call("GET", "/api/v1/services")["items"]:
        ns, name = svc["metadata"]["namespace"], svc["metadata"]["name"]
        names = f"{name}.{ns}.svc.{domain} {name}.{ns}.svc"
        ip = svc["spec"].get("clusterIP")
        if ip and ip != "None":
            lines.append(f"{ip} {names}")
            continue
        for subset in (endpoints.get((ns, name)) or {}).get("subsets") or []:
            for address in subset.get("addresses") or []:
                lines.append(f"{address['ip']} {names}")
                if address.get("hostname"):
                    host = address["hostname"]
                    lines.append(f"{address['ip']} {host}.{name}.{ns}.svc.{domain} {host}.{name}.{ns}.svc")
    return "".join(f"{line}\n" for line in sorted(set(lines)))


def provision():
    for claim in call("GET", "/api/v1/persistentvolumeclaims")["items"]:
        spec, meta = claim["spec"], claim["metadata"]
        if claim.get("status", {}).get("phase") != "Pending" or spec.get("volumeName") or spec.get("storageClassName"):
            continue
        ns, name = meta["namespace"], meta["name"]
        path = os.path.join(volumes_dir, ns, name)
        os.makedirs(path, exist_ok=True)
        os.chown(path, 1000, 1000)
        os.chmod(path, 0o775)
        volume = "kube-local-" + hashlib.sha256(f"{ns}/{name}/{meta['uid']}".encode()).hexdigest()[:16]
        try:
            call("POST", "/api/v1/persistentvolumes", {
                "apiVersion": "v1", "kind": "PersistentVolume",
                "metadata": {"name": volume, "labels": {"posttrain.dev/kube-local": "run-volume"}},
                "spec": {"capacity": {"storage": spec["resources"]["requests"]["storage"]},
                         "accessModes": spec.get("accessModes") or ["ReadWriteOnce"], "storageClassName": "",
                         "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": path, "type": "Directory"},
                         "claimRef": {"namespace": ns, "name": name, "uid": meta["uid"]}}})
            print(f"volume {volume} at {path} for claim {ns}/{name}", flush=True)
        except urllib.error.HTTPError as exc:
            if exc.code != 409:
                raise


os.makedirs(hosts_dir, exist_ok=True)
written = None
while True:
    try:
        text = hosts()
        if text != written:
            tmp = os.path.join(hosts_dir, ".cluster.tmp")
            with open(tmp, "w") as out:
                out.write(text)
            os.chmod(tmp, 0o644)
            os.replace(tmp, os.path.join(hosts_dir, "cluster"))
            written = text
        provision()
    except Exception as exc:  # the API server restarting, a claim deleted meanwhile: try again
        print(f"plane agent: {exc!r}", flush=True)
    time.sleep(1)
PLANE_AGENT
}

start_node() {
    [[ $(id -u) -eq 0 ]] || die "start-node needs root (containerd and the kubelet)"
    pid_alive "$state/apiserver.pid" || die "the control plane is not running: run start first"
    load_ports
    build "${NODE_BINARIES[@]}"
    ensure_packages containerd runc runsc containernetworking-plugins busybox-static iptables rsync dnsmasq-base conntrack
    local node=$state/node i ready node_ip
    # the kubelet refuses a loopback node IP: the machine's first global IPv4 address (the
    # kubelet listens there, authenticating callers against the plane's CA and tokens)
    node_ip=$(ip -4 -o addr show scope global | awk '$2 != "pt0" {sub("/.*", "", $4); print $4; exit}')
    [[ -n $node_ip ]] || die "no global IPv4 address for the node (the kubelet refuses loopback)"
    mkdir -p "$node/cni" "$node/kubelet" "$node/dns" "$state/volumes"
    # the pods' bridge, made here rather than by the CNI plugin at the first pod: cluster DNS listens
    # on its address from the start
    ip link show pt0 >/dev/null 2>&1 || ip link add pt0 type bridge
    ip -4 addr show dev pt0 | grep -q " $bridge_ip/" || ip addr add "$bridge_ip/24" dev pt0
    ip link set pt0 up
    # gVisor under containerd's runc shim (runsc speaks runc's command line)
    cat >"$node/runsc-wrapper" <<'RUNSC_WRAPPER'
#!/bin/sh
# gVisor under containerd's runc shim (Debian's runsc has no containerd-shim-runsc-v1): each
# container of a pod becomes a gVisor sandbox of its own. runsc would add a pod's containers to the
# pod's first sandbox (the CRI annotations), which the runc shim cannot follow; the annotations are
# dropped at create. No network (a sandbox pod has none), the kubelet's cgroups left alone, and the
# ptrace platform the local runtime uses (runsc 20240729 defaults to systrap, whose command in a
# sandbox costs nearly twice ptrace's here: docs/benchmarks.md, "gVisor from bookworm-backports").
prev=
for arg in "$@"; do
    if [ "$prev" = "--bundle" ] && [ -f "$arg/config.json" ]; then
        python3 -c 'import json, sys
p = sys.argv[1] + "/config.json"; c = json.load(open(p))
a = c.get("annotations") or {}
for k in ("io.kubernetes.cri.container-type", "io.kubernetes.cri.sandbox-id"):
    a.pop(k, None)
json.dump(c, open(p, "w"))' "$arg"
    fi
    prev=$arg
done
runsc="/usr/bin/runsc --platform=ptrace --network=none --ignore-cgroups"
case " $* " in
*" kill "*)
    # runsc says "sandbox is not running" of a container that has exited; containerd's shim knows
    # runc's words for it, and otherwise retries the exit's cleanup for ever (the pod never ends)
    out=$($runsc "$@" 2>&1) && exit 0
    rc=$?
    case $out in *"sandbox is not running"*) echo "container not running" >&2 ;; *) printf '%s\n' "$out" >&2 ;; esac
    exit $rc
    ;;
esac
exec $runsc "$@"
RUNSC_WRAPPER
    chmod +x "$node/runsc-wrapper"
    cat >"$node/containerd.toml" <<CONTAINERD_TOML
version = 2
root = "$node/containerd-root"
state = "$node/containerd-state"
[grpc]
  address = "$node/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "posttrain.local/pause:$IMAGES_REV"
  # pods' oom_score_adj no lower than containerd's own: the kubelet asks -998 for a pod's sandbox,
  # which this machine refuses (runc then fails with "can't get final child's PID from pipe")
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runsc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runsc.options]
        BinaryName = "$node/runsc-wrapper"
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$node/cni"
CONTAINERD_TOML
    cat >"$node/cni/10-posttrain.conflist" <<'CNI_CONF'
{"cniVersion": "0.4.0", "name": "posttrain", "plugins": [
  {"type": "bridge", "bridge": "pt0", "isGateway": true, "ipMasq": true, "hairpinMode": true,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.244.0.0/24"}]], "routes": [{"dst": "0.0.0.0/0"}]}},
  {"type": "portmap", "capabilities": {"portMappings": true}}]}
CNI_CONF
    if ! pid_alive "$node/containerd.pid"; then
        setsid containerd --config "$node/containerd.toml" </dev/null >"$state/logs/containerd.log" 2>&1 &
        echo $! >"$node/containerd.pid"
        for ((i = 0; i < 100; i++)); do [[ -S $node/containerd.sock ]] && break; sleep 0.2; done
        [[ -S $node/containerd.sock ]] || die "containerd did not start; see $state/logs/containerd.log"
    fi
    ctr -a "$node/containerd.sock" -n k8s.io images ls -q | grep -q "^posttrain.local/python:$IMAGES_REV\$" || build_images
    write_kubeconfig "$node/kubelet.kubeconfig" system:node:posttrain-node
    write_kubeconfig "$node/scheduler.kubeconfig" system:kube-scheduler
    write_kubeconfig "$node/controller-manager.kubeconfig" system:kube-controller-manager
    if ! pid_alive "$node/controller-manager.pid"; then
        setsid "$cache/bin/kube-controller-manager" --kubeconfig "$node/controller-manager.kubeconfig" \
            --leader-elect=false --bind-address=127.0.0.1 --port=0 --secure-port=10257 \
            --use-service-account-credentials=true --service-account-private-key-file="$state/pki/sa.key" \
            --root-ca-file="$state/pki/ca.crt" --cluster-signing-cert-file="$state/pki/ca.crt" \
            --cluster-signing-key-file="$state/pki/ca.key" --service-cluster-ip-range="$service_cidr" \
            --controllers='*,-nodeipam,-cloud-node-lifecycle,-route,-service' \
            </dev/null >"$state/logs/kube-controller-manager.log" 2>&1 &
        echo $! >"$node/controller-manager.pid"
    fi
    if ! pid_alive "$node/scheduler.pid"; then
        setsid "$cache/bin/kube-scheduler" --kubeconfig "$node/scheduler.kubeconfig" --leader-elect=false \
            --bind-address=127.0.0.1 --port=0 --secure-port=10259 \
            </dev/null >"$state/logs/kube-scheduler.log" 2>&1 &
        echo $! >"$node/scheduler.pid"
    fi
    # cluster DNS: dnsmasq on the bridge's address, answering cluster.local from the hosts files the
    # plane agent writes (re-read when they change), nothing else (no upstream: pods reach no internet)
    if ! pid_alive "$node/dnsmasq.pid"; then
        setsid dnsmasq --keep-in-foreground --conf-file=/dev/null --no-resolv --no-hosts --hostsdir="$node/dns" \
            --listen-address="$bridge_ip" --bind-interfaces --port=53 --local="/$cluster_domain/" --domain-needed \
            --user=root --pid-file= --log-facility="$state/logs/dnsmasq.log" \
            </dev/null >>"$state/logs/dnsmasq.log" 2>&1 &
        echo $! >"$node/dnsmasq.pid"
    fi
    write_plane_agent "$node/plane-agent.py"
    token_for admin >"$node/agent.token" && chmod 600 "$node/agent.token"
    if ! pid_alive "$node/plane-agent.pid"; then
        setsid python3 "$node/plane-agent.py" "https://127.0.0.1:$apiserver_port" "$state/pki/ca.crt" "$node/agent.token" \
            "$node/dns" "$state/volumes" "$cluster_domain" </dev/null >>"$state/logs/plane-agent.log" 2>&1 &
        echo $! >"$node/plane-agent.pid"
    fi
    # Services' ClusterIPs (the `kubernetes` Service's included: the API server on the bridge's
    # address), in iptables mode; every connection to a ClusterIP is masqueraded, so a reply between
    # two pods of the bridge comes back through the host's conntrack
    write_kubeconfig "$node/kube-proxy.kubeconfig" system:kube-proxy
    if ! pid_alive "$node/kube-proxy.pid"; then
        setsid "$cache/bin/kube-proxy" --kubeconfig "$node/kube-proxy.kubeconfig" --proxy-mode=iptables \
            --hostname-override=posttrain-node --cluster-cidr="$pod_cidr" --masquerade-all \
            --metrics-bind-address=127.0.0.1:10249 --healthz-bind-address=127.0.0.1:10256 --conntrack-max-per-core=0 \
            </dev/null >"$state/logs/kube-proxy.log" 2>&1 &
        echo $! >"$node/kube-proxy.pid"
    fi
    if ! pid_alive "$node/kubelet.pid"; then
        setsid "$cache/bin/kubelet" --kubeconfig "$node/kubelet.kubeconfig" --hostname-override=posttrain-node \
            --node-ip="$node_ip" --address="$node_ip" --port=10250 --read-only-port=0 \
            --container-runtime=remote --container-runtime-endpoint="unix://$node/containerd.sock" \
            --cgroup-driver=cgroupfs --cgroups-per-qos=false --enforce-node-allocatable= --fail-swap-on=false \
            --root-dir="$node/kubelet" --cert-dir="$node/kubelet/pki" --pod-infra-container-image=posttrain.local/pause:$IMAGES_REV \
            --anonymous-auth=false --client-ca-file="$state/pki/ca.crt" --authentication-token-webhook=true \
            --authorization-mode=Webhook \
            --eviction-hard='memory.available<100Mi' --image-gc-high-threshold=100 --image-gc-low-threshold=99 \
            --max-pods=64 --register-node=true --cluster-dns="$bridge_ip" --cluster-domain="$cluster_domain" \
            </dev/null >"$state/logs/kubelet.log" 2>&1 &
        echo $! >"$node/kubelet.pid"
    fi
    ready=
    for ((i = 0; i < 300; i++)); do
        ready=$(curl -fsS --max-time 2 --cacert "$state/pki/ca.crt" -H "Authorization: Bearer $(token_for admin)" \
            "https://127.0.0.1:$apiserver_port/api/v1/nodes/posttrain-node" 2>/dev/null |
            python3 -c 'import json,sys; c={x["type"]:x["status"] for x in json.load(sys.stdin)["status"].get("conditions",[])}; print(c.get("Ready",""))' 2>/dev/null || true)
        [[ $ready == True ]] && break
        pid_alive "$node/kubelet.pid" || die "the kubelet exited; see $state/logs/kubelet.log"
        sleep 1
    done
    [[ $ready == True ]] || die "node posttrain-node not Ready after 300 s; see $state/logs/kubelet.log"
    log "node posttrain-node Ready (containerd with runc and runsc; kubelet, scheduler, controller-manager)"
    # The shared run volume ([kubernetes] volume_claim = "posttrain-data", examples/embedded-k8s.toml):
    # the plane agent binds it to a hostPath folder, which is also Dagster's storage root (POSTTRAIN_HOME)
    apply "/api/v1/namespaces/$namespace/persistentvolumeclaims/posttrain-data" \
        "{apiVersion: v1, kind: PersistentVolumeClaim, metadata: {name: posttrain-data, namespace: $namespace}, spec: {accessModes: [ReadWriteMany], resources: {requests: {storage: 50Gi}}}}"
    log "shared run volume: claim $namespace/posttrain-data, on this machine at $state/volumes/$namespace/posttrain-data (POSTTRAIN_HOME)"
    echo "$state/kubeconfig"
}

stop_node() {
    local what sock=$state/node/containerd.sock task
    for what in kubelet scheduler controller-manager kube-proxy plane-agent dnsmasq; do end_pid "$state/node/$what.pid"; done
    # kube-proxy's iptables chains
    [[ -x $cache/bin/kube-proxy ]] && "$cache/bin/kube-proxy" --cleanup >/dev/null 2>&1 || true
    # the pods' containers (and their shims) end with containerd's tasks
    if pid_alive "$state/node/containerd.pid"; then
        for task in $(ctr -a "$sock" -n k8s.io tasks ls -q 2>/dev/null); do
            ctr -a "$sock" -n k8s.io tasks kill -s SIGKILL "$task" >/dev/null 2>&1 || true
        done
        sleep 1
        for task in $(ctr -a "$sock" -n k8s.io tasks ls -q 2>/dev/null); do
            ctr -a "$sock" -n k8s.io tasks delete -f "$task" >/dev/null 2>&1 || true
        done
    fi
    end_pid "$state/node/containerd.pid"
    # shims of this node's containerd that outlived it (a gVisor container's shim may), and what
    # they run: found by this node's socket, ended one by one
    local shim child grandchild
    for shim in $(pgrep -f -- "-address $sock\$" || true); do
        for child in $(ps -o pid= --ppid "$shim"); do
            for grandchild in $(ps -o pid= --ppid "$child"); do kill -9 "$grandchild" 2>/dev/null || true; done
            kill -9 "$child" 2>/dev/null || true
        done
        kill -9 "$shim" 2>/dev/null || true
    done
    # what the kubelet and containerd mounted under the node's folder (pod volumes, rootfs, shm)
    local mount
    for mount in $(awk -v prefix="$state/node/" 'index($2, prefix) == 1 {print $2}' /proc/mounts | sort -r); do
        umount "$mount" 2>/dev/null || umount -l "$mount" 2>/dev/null || true
    done
}

case ${1:-} in
start) start ;;
start-node) start_node ;;
stop-node)
    # the node's processes, and its Node object (a plane without a node again)
    load_ports
    stop_node
    curl -fsS --max-time 10 --cacert "$state/pki/ca.crt" -H "Authorization: Bearer $(token_for admin)" -X DELETE \
        "https://127.0.0.1:$apiserver_port/api/v1/nodes/posttrain-node" >/dev/null 2>&1 || true
    log "node stopped"
    ;;
stop)
    [[ -d $state/node ]] && stop_node
    stop
    ;;
status) status ;;
build)
    shift
    if [[ ${1:-} == node ]]; then build "${NODE_BINARIES[@]}"
    elif (($#)); then build "$@"
    else build kube-apiserver; fi
    ;;
built)
    shift
    if [[ ${1:-} == node ]]; then built "${NODE_BINARIES[@]}"
    elif (($#)); then built "$@"
    else built kube-apiserver; fi
    ;;
*) die "usage: $0 start|start-node|stop-node|stop|status|build [CMD...|node]|built [CMD...|node]" ;;
esac
