"""The trainer credential as an object: made in one place, handed to what needs it, checked by the
HTTP layer (:mod:`sandboxes.httpserver.app`) once per route that declares it.

    credential = Credential.from_environment()   # a process's boundary: its pod's Secret, its parent
    credential = Credential.generate()           # a process that starts its replicas itself
    subprocess.Popen(cmd, env=credential.environment())   # a child that must share it

The credential proves a caller is the trainer (``Authorization: Bearer <credential>``); the keys of
sessions and of an engine behind a capture front are HMACs made from it (:meth:`derive`). It is at
least 32 printable characters without spaces (one header token), never put on a command line (``ps``
shows those to every user) and never shown by ``repr``.

The environment variables are read in :meth:`Credential.from_environment` alone:
``$POSTTRAIN_TRAINER_CREDENTIAL``, else the contents of the file named by
``$POSTTRAIN_TRAINER_CREDENTIAL_FILE`` (a mounted Secret); :meth:`environment` writes the first for a
child process.

A process has one credential (:func:`process_credential`, the default of every server and client
that takes none): the one it was given at its start, read once, else one it makes, in memory only.
Nothing here writes to ``os.environ``, at import or later: a child that must share the credential
(a replica, its engine, a router, the trainer) is given it by the process that starts it, in the
child's environment (:meth:`Credential.environment`), and reads it once at its own start. A child
started without it makes its own, which no other process knows, so its parent's calls are refused
(403); a replica started as a child (``--exit-with-parent``) refuses to start without one instead,
naming the variable (:func:`require_given`), so its parent sees it exit rather than serve.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import sys
import threading
from pathlib import Path
from typing import Mapping

CREDENTIAL_ENV = "POSTTRAIN_TRAINER_CREDENTIAL"
CREDENTIAL_FILE_ENV = "POSTTRAIN_TRAINER_CREDENTIAL_FILE"
MIN_CREDENTIAL_CHARS = 32
_TOKEN = re.compile(r"[\x21-\x7e]+")  # printable ASCII, no spaces: one header token


class Credential:
    """A secret shared by the trainer and the servers it calls (see the module docstring)."""

    __slots__ = ("_value", "_bytes", "_bearer", "source")

    def __init__(self, value: str, source: str = "given"):
        if not isinstance(value, str) or len(value) < MIN_CREDENTIAL_CHARS or not _TOKEN.fullmatch(value):
            size = len(value) if isinstance(value, str) else type(value).__name__
            raise ValueError(f"{source}: the trainer credential must be at least {MIN_CREDENTIAL_CHARS} printable "
                             f"characters without spaces (e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`), "
                             f"got {size} characters")
        self._value = value
        self._bytes = value.encode()
        self._bearer = f"Bearer {value}"
        self.source = source  # where it came from, for messages (never the value)

    @classmethod
    def generate(cls) -> "Credential":
        """A new random credential, known to this process and to the children it passes it to."""
        return cls(secrets.token_hex(32), "generated")

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> "Credential | None":
        """The credential this process was given at its start (see the module docstring), or None
        when neither variable is set; a bad value raises naming its variable."""
        environ = os.environ if environ is None else environ
        value = environ.get(CREDENTIAL_ENV)
        if value:
            return cls(value, f"${CREDENTIAL_ENV}")
        path = environ.get(CREDENTIAL_FILE_ENV)
        if not path:
            return None
        where = f"${CREDENTIAL_FILE_ENV} ({path})"
        try:
            return cls(Path(path).read_text().strip(), where)
        except OSError as exc:
            raise ValueError(f"{where}: the trainer credential file cannot be read: {exc.strerror}") from None

    @property
    def value(self) -> str:
        """The secret itself: for a header of a call made by the trainer's side, or a Secret's data."""
        return self._value

    def environment(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) with this credential as the trainer
        credential, for a child process (never on its command line)."""
        env = {k: v for k, v in (os.environ if base is None else base).items() if k != CREDENTIAL_FILE_ENV}
        env[CREDENTIAL_ENV] = self._value
        return env

    def headers(self) -> dict[str, str]:
        """Headers that present this credential."""
        return {"Authorization": self._bearer}

    def derive(self, domain: bytes, message: bytes = b"") -> str:
        """An HMAC of ``message`` under this credential, in ``domain`` (a session's key, an engine's key)."""
        return hmac.new(self._bytes, domain + message, hashlib.sha256).hexdigest()

    def matches(self, given: str) -> bool:
        """True when ``given`` is this credential (compared in constant time)."""
        return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), self._bytes)

    def presented_by(self, headers: Mapping[str, str] | None) -> bool:
        """True when ``headers`` (lower-case names) carry ``Authorization: Bearer <this credential>``."""
        scheme, _, token = (headers or {}).get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and self.matches(token.strip())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Credential) and hmac.compare_digest(self._bytes, other._bytes)

    def __hash__(self) -> int:
        return hash(self._bytes)

    def __repr__(self) -> str:
        return f"Credential(<{len(self._value)} characters from {self.source}>)"


_process: Credential | None = None
_process_lock = threading.Lock()


def process_credential() -> Credential:
    """This process's credential: the one it was started with (:meth:`Credential.from_environment`,
    read on the first call only: a process's boundary is its start), else one made on the first
    call and kept here, never exported (module docstring). A bad value given raises on each call,
    naming its variable; nothing is kept until a good one is read."""
    global _process
    with _process_lock:
        if _process is None:
            _process = Credential.from_environment() or Credential.generate()
        return _process


def require_given(what: str) -> Credential:
    """This process's credential for a server started by another process (``--exit-with-parent``):
    it must have been given one, since one made here would be unknown to the parent, whose calls
    would all be refused. Exits (status 2) with a message naming the variable otherwise."""
    try:
        credential = process_credential()
    except ValueError as exc:
        print(f"{what}: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    if credential.source == "generated":
        print(f"{what}: started by a parent process (--exit-with-parent) without ${CREDENTIAL_ENV} or "
              f"${CREDENTIAL_FILE_ENV}: the parent must pass its trainer credential in this process's "
              "environment (Credential.environment()), or its calls here are all refused", file=sys.stderr, flush=True)
        raise SystemExit(2)
    return credential
