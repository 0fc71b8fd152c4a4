"""The programs shipped into sandboxes as one file each, with :mod:`sandboxes.standalone` written into them.

``sandboxes/pxd.py`` (the daemon) and ``evals/call_probe.py`` (the grader's probe) run inside
sandboxes on the sandbox's own ``python3``, where nothing of the project's tree may be imported.
In the repository each takes its shared stand-ins in one block between ``# >>> standalone`` and
``# <<< standalone``: ``from sandboxes.standalone import ...``, or where the program runs as a file
from the repository (``python3 -I -S sandboxes/pxd.py``), ``standalone.py`` taken from its folder;
:func:`shipped_source` is the file that goes into a sandbox: the program with that block replaced
by ``sandboxes/standalone.py``'s text. The runtimes compile pxd's to the ``.pyc`` they
write into each sandbox (:func:`sandboxes.runtimes.compiled_pxd`), the image's base layer carries it
at ``/opt/pxd/pxd.py`` (:func:`sandboxes.images.base_layer_tar`), and the grader writes the probe's
into the grading sandbox (:mod:`evals.call_checks`).

To get the file a sandbox runs (for an image built by hand, or to run pxd on a folder)::

    posttrain sandbox shipped sandboxes/pxd.py > /tmp/pxd.py
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

STANDALONE = Path(__file__).with_name("standalone.py")
PXD = Path(__file__).with_name("pxd.py")
BLOCK_START = b"# >>> standalone"
BLOCK_END = b"# <<< standalone"

_lock = threading.Lock()
_shipped: dict[tuple, tuple[bytes, str]] = {}


def _stat_key(path: Path) -> tuple:
    st = os.stat(path)
    return (str(path), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _inlined(program: Path) -> bytes:
    source = program.read_bytes()
    lines = source.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.startswith(BLOCK_START)]
    ends = [i for i, line in enumerate(lines) if line.startswith(BLOCK_END)]
    if len(starts) != 1 or len(ends) != 1 or ends[0] < starts[0]:
        raise ValueError(f"{program} must import sandboxes.standalone in one block between a line starting "
                         f"{BLOCK_START.decode()!r} and one starting {BLOCK_END.decode()!r} (found {len(starts)} and "
                         f"{len(ends)}): that block is where the shipped copy holds standalone.py's text")
    standalone = STANDALONE.read_bytes()
    if not standalone.endswith(b"\n"):
        standalone += b"\n"
    return b"".join([*lines[:starts[0]], standalone, *lines[ends[0] + 1:]])


def _entry(program: Path) -> tuple[bytes, str]:
    key = (_stat_key(program), _stat_key(STANDALONE))  # read again only when either file changed
    with _lock:
        entry = _shipped.get(key)
        if entry is None:
            data = _inlined(program)
            entry = _shipped[key] = (data, hashlib.sha256(data).hexdigest())
    return entry


def shipped_source(program: Path) -> bytes:
    """The one file of ``program`` that runs in a sandbox: its text with its ``standalone`` block
    replaced by ``standalone.py``'s (module docstring and all: a no-op string there).
    :class:`ValueError`, naming the file, when the program has no such block or more than one."""
    return _entry(program)[0]


def shipped_digest(program: Path) -> str:
    """The SHA-256 (hex) of :func:`shipped_source`: what a compiled copy or a cached answer is keyed by,
    so a change to either file is a new key."""
    return _entry(program)[1]
