"""The durable rollout store: every finished rollout, on disk, until the trainer has used it.

Why SQLite in WAL mode rather than Parquet segments and a manifest: rollouts arrive one at a time
from many producer threads, and the trainer marks whole groups consumed or discarded at each step.
SQLite gives one atomic, durable commit per rollout and per status change without our own manifest
protocol; WAL lets the trainer read while producers write; a process killed mid-write (SIGKILL, OOM)
leaves the last committed state intact, because an uncommitted WAL frame is ignored on the next open.
With ``synchronous=FULL`` a commit also survives power loss. A Parquet segment would have to be
buffered (losing the rollouts not yet flushed) or written per rollout (thousands of tiny files).

Layout: ``rollouts`` (one row per rollout, tokens and logprobs as packed little-endian arrays) and
``groups`` (one row per group: task, adapter step, expected size). The column ``adapter_version`` of
both tables holds the adapter's *step*, an integer (:attr:`training.rollout.Rollout.adapter_step`), not
the adapter's name that ``adapter_version`` means everywhere else: the name is what existing stores
have, and resuming a run reads them. A group is *complete* when all of
its rollouts are stored. Status moves ``ready -> consumed`` (used by step N) or ``ready -> discarded``
(too stale when the trainer looked). :meth:`RolloutStore.rewind_to` undoes the status changes of steps
after a checkpoint, so a resumed run sees exactly the rollouts that were unused at that checkpoint,
plus every rollout finished since. A group that lost an episode to the infrastructure is *dropped*
(:meth:`RolloutStore.drop_group`, table ``dropped_groups``): never complete, never trained on.

A write that fails (the disk is full, the file read-only) raises :class:`StoreWriteError` naming the
store's file and the cause.

A damaged file (truncated or overwritten by something other than SQLite) is refused when the store
opens, with :class:`StoreDamagedError` naming the file; :func:`salvage` copies every whole group
and rollout that can still be read into a new store. A truncated WAL needs nothing: SQLite
checksums its frames and keeps every transaction up to the last whole one.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import threading
import time
from array import array
from dataclasses import dataclass
from pathlib import Path

from training.rollout import Rollout

SCHEMA = """
CREATE TABLE IF NOT EXISTS groups (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    group_id TEXT UNIQUE NOT NULL,
    task_id TEXT NOT NULL,
    adapter_version INTEGER NOT NULL,  -- the adapter's step (see the module docstring)
    group_size INTEGER NOT NULL,
    created_s REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS rollouts (
    rollout_id TEXT PRIMARY KEY,
    group_id TEXT NOT NULL REFERENCES groups(group_id),
    task_id TEXT NOT NULL,
    adapter_version INTEGER NOT NULL,
    reward REAL NOT NULL,
    total_tokens INTEGER NOT NULL,
    generated_tokens INTEGER NOT NULL,
    input_ids BLOB NOT NULL,
    loss_mask BLOB NOT NULL,
    serving_logprobs BLOB NOT NULL,
    info TEXT NOT NULL,
    created_s REAL NOT NULL,
    status TEXT NOT NULL DEFAULT 'ready',
    status_step INTEGER
);
CREATE INDEX IF NOT EXISTS rollouts_by_group ON rollouts(group_id);
CREATE INDEX IF NOT EXISTS rollouts_by_status ON rollouts(status);
CREATE TABLE IF NOT EXISTS dropped_groups (
    group_id TEXT PRIMARY KEY,
    reason TEXT NOT NULL,
    created_s REAL NOT NULL
);
"""


@dataclass(frozen=True)
class Group:
    group_id: str
    task_id: str
    adapter_step: int
    rollouts: list[Rollout]

    @property
    def generated_tokens(self) -> int:
        return sum(r.generated_tokens for r in self.rollouts)


@dataclass(frozen=True)
class Take:
    """What :meth:`RolloutStore.take_groups` returned: fresh groups and what it discarded as stale."""

    groups: list[Group]
    discarded_groups: list[Group]

    @property
    def discarded_samples(self) -> int:
        return sum(len(g.rollouts) for g in self.discarded_groups)

    @property
    def discarded_tokens(self) -> int:
        return sum(g.generated_tokens for g in self.discarded_groups)


def _pack(values: list, code: str) -> bytes:
    return array(code, values).tobytes()


def unpack_column(blob: bytes, code: str) -> list:
    """A token column as stored (``array`` bytes of type ``code``: "i" ids, "b" mask, "f" logprobs) -> a list."""
    out = array(code)
    out.frombytes(blob)
    return out.tolist()


class StoreDamagedError(RuntimeError):
    """The store's file is not a whole SQLite database (e.g. truncated); see :func:`salvage`."""


class StoreWriteError(OSError):
    """A write to the store failed (disk full, read-only file); the message names the file."""


def _write_error(path: Path, exc: sqlite3.Error) -> StoreWriteError:
    text = str(exc)
    if "disk is full" in text:
        try:
            free = f", {shutil.disk_usage(path.parent).free} bytes free"
        except OSError:
            free = ""
        cause = f"the disk is full{free}"
    elif "disk I/O error" in text:
        cause = "the disk failed to write it (I/O error)"
    elif "readonly" in text:
        cause = "the file is read-only"
    else:
        cause = "the write failed"
    return StoreWriteError(f"rollout store {path}: {cause} ({type(exc).__name__}: {text})")


class RolloutStore:
    """A SQLite database at ``path``; safe to use from several threads (one connection each)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        try:
            with self._conn() as conn:
                conn.executescript(SCHEMA)
                problems = [row[0] for row in conn.execute("PRAGMA quick_check").fetchall()]
        except StoreWriteError:
            self.close()
            raise
        except sqlite3.DatabaseError as exc:
            self.close()
            raise StoreDamagedError(f"rollout store {self.path}: the file is damaged ({exc}); recover it with "
                                    "training.store.salvage(path, new_path) or a checkpoint's store.sqlite") from exc
        if problems != ["ok"]:
            self.close()
            raise StoreDamagedError(f"rollout store {self.path}: the file is damaged ({problems[0]}); recover it with "
                                    "training.store.salvage(path, new_path) or a checkpoint's store.sqlite")

    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.path, timeout=60.0, isolation_level=None)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            self._local.conn = conn
        return _Tx(conn, self.path)  # type: ignore[return-value]

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    # -- writing --------------------------------------------------------------------------------

    def add_group(self, group_id: str, task_id: str, adapter_step: int, group_size: int) -> None:
        """Announce a group before its rollouts arrive (idempotent)."""
        with self._conn() as conn:
            conn.execute(
                "INSERT OR IGNORE INTO groups(group_id, task_id, adapter_version, group_size, created_s) VALUES (?,?,?,?,?)",
                (group_id, task_id, adapter_step, group_size, time.time()),
            )

    def drop_group(self, group_id: str, reason: str) -> None:
        """Mark a group dropped (it lost an episode): it is never complete, never trained on."""
        with self._conn() as conn:
            _drop(conn, [group_id], reason)

    def dropped_group_ids(self) -> set[str]:
        with self._conn() as conn:
            return {r[0] for r in conn.execute("SELECT group_id FROM dropped_groups").fetchall()}

    def put(self, rollout: Rollout) -> None:
        """Store one finished rollout durably; returns once it is committed."""
        with self._conn() as conn:
            row = conn.execute("SELECT 1 FROM groups WHERE group_id=?", (rollout.group_id,)).fetchone()
            if row is None:
                raise KeyError(f"rollout {rollout.rollout_id}: group {rollout.group_id!r} was never added")
            conn.execute(
                "INSERT INTO rollouts(rollout_id, group_id, task_id, adapter_version, reward, total_tokens, "
                "generated_tokens, input_ids, loss_mask, serving_logprobs, info, created_s) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    rollout.rollout_id, rollout.group_id, rollout.task_id, rollout.adapter_step,
                    float(rollout.reward), len(rollout.input_ids), rollout.generated_tokens,
                    _pack(rollout.input_ids, "i"), _pack(rollout.loss_mask, "b"),
                    _pack(rollout.serving_logprobs, "f"), json.dumps(rollout.info), time.time(),
                ),
            )

    # -- reading --------------------------------------------------------------------------------

    def _complete_group_rows(self, conn: sqlite3.Connection) -> list[tuple]:
        return conn.execute(
            "SELECT g.group_id, g.task_id, g.adapter_version FROM groups g "
            "JOIN rollouts r ON r.group_id = g.group_id "
            "WHERE g.group_id NOT IN (SELECT group_id FROM dropped_groups) "
            "GROUP BY g.seq HAVING SUM(r.status='ready') = g.group_size ORDER BY g.seq"
        ).fetchall()

    def _group(self, conn: sqlite3.Connection, group_id: str, task_id: str, adapter_step: int) -> Group:
        rows = conn.execute(
            "SELECT rollout_id, adapter_version, input_ids, loss_mask, serving_logprobs, reward, info "
            "FROM rollouts WHERE group_id=? ORDER BY rollout_id", (group_id,),
        ).fetchall()
        rollouts = [
            Rollout(
                rollout_id=r[0], group_id=group_id, task_id=task_id, adapter_step=r[1],
                input_ids=unpack_column(r[2], "i"), loss_mask=unpack_column(r[3], "b"),
                serving_logprobs=unpack_column(r[4], "f"),
                reward=r[5], info=json.loads(r[6]),
            )
            for r in rows
        ]
        return Group(group_id=group_id, task_id=task_id, adapter_step=adapter_step, rollouts=rollouts)

    def complete_group_ids(self) -> set[str]:
        """Ids of every group whose rollouts are all stored, whatever their status."""
        with self._conn() as conn:
            rows = conn.execute(
                "SELECT g.group_id FROM groups g JOIN rollouts r ON r.group_id = g.group_id "
                "GROUP BY g.seq HAVING COUNT(r.rollout_id) = g.group_size"
            ).fetchall()
        return {r[0] for r in rows}

    def ready_groups(self) -> int:
        with self._conn() as conn:
            return len(self._complete_group_rows(conn))

    def _unfinished_group_rows(self, conn: sqlite3.Connection) -> list[tuple]:
        """Groups announced, not dropped, not yet whole: (group_id, adapter_version)."""
        return conn.execute(
            "SELECT g.group_id, g.adapter_version FROM groups g LEFT JOIN rollouts r ON r.group_id = g.group_id "
            "WHERE g.group_id NOT IN (SELECT group_id FROM dropped_groups) "
            "GROUP BY g.seq HAVING COUNT(r.rollout_id) < g.group_size ORDER BY g.seq"
        ).fetchall()

    def drop_unfinished(self, reason: str) -> int:
        """Drop every group announced but not whole (its producer is gone: a trainer that stopped
        mid-group); returns how many. Their stored rollouts stay, never trained on."""
        with self._conn() as conn:
            conn.execute("BEGIN IMMEDIATE")
            rows = self._unfinished_group_rows(conn)
            _drop(conn, [group_id for group_id, _ in rows], reason)
            conn.execute("COMMIT")
        return len(rows)

    def take_groups(self, count: int, *, step: int, min_adapter_step: int, last_chance: int | None = None,
                    most: int | None = None) -> Take:
        """Mark up to ``count`` complete groups sampled at ``adapter_step >= min_adapter_step`` consumed
        by ``step`` and return them, the oldest adapter first; complete groups older than
        ``min_adapter_step`` are marked discarded and returned separately (they are counted, never
        trained on).

        ``last_chance``: the adapter step whose groups ``step`` is the last one to be allowed to use.
        Every complete one is taken, even past ``count`` (up to ``most``), and each one still unfinished keeps a place
        (fewer newer groups are taken), so that the trainer waits for it instead of letting it go
        stale. With the producers' window (:meth:`training.loop.RunState.occupied`) they are never more
        than a step's groups, and a run that is not resumed discards nothing."""
        with self._conn() as conn:
            conn.execute("BEGIN IMMEDIATE")
            fresh, stale = [], []
            room = count
            if last_chance is not None:  # a place kept for each of its groups still in flight
                room -= sum(v == last_chance for _, v in self._unfinished_group_rows(conn))
            rows = sorted(self._complete_group_rows(conn), key=lambda row: row[2])  # stable: seq within a version
            for group_id, task_id, adapter_step in rows:
                if adapter_step < min_adapter_step:
                    stale.append(self._group(conn, group_id, task_id, adapter_step))
                elif len(fresh) < room or (adapter_step == last_chance and len(fresh) < (most or count)):
                    fresh.append(self._group(conn, group_id, task_id, adapter_step))
            for status, groups in (("consumed", fresh), ("discarded", stale)):
                conn.executemany(
                    "UPDATE rollouts SET status=?, status_step=? WHERE group_id=?",
                    [(status, step, g.group_id) for g in groups],
                )
            conn.execute("COMMIT")
        return Take(groups=fresh, discarded_groups=stale)

    def rewind_to(self, step: int) -> int:
        """Make every rollout consumed or discarded by a step after ``step`` ready again; returns
        how many. Used on resume from the checkpoint of ``step``."""
        with self._conn() as conn:
            cur = conn.execute("UPDATE rollouts SET status='ready', status_step=NULL WHERE status_step > ?", (step,))
            return cur.rowcount

    def counts(self) -> dict[str, int]:
        with self._conn() as conn:
            rows = conn.execute("SELECT status, COUNT(*) FROM rollouts GROUP BY status").fetchall()
            groups = conn.execute("SELECT COUNT(*) FROM groups").fetchone()[0]
        out = {"ready": 0, "consumed": 0, "discarded": 0, **dict(rows)}
        out["groups"] = groups
        return out

    def snapshot(self, dest: str | Path) -> None:
        """A consistent copy of the whole store at ``dest`` (SQLite's online backup)."""
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        target = sqlite3.connect(dest)
        try:
            self._conn().conn.backup(target)
        except sqlite3.OperationalError as exc:  # writing the copy: name the copy
            raise _write_error(dest, exc) from exc
        finally:
            target.close()


def salvage(damaged: str | Path, dest: str | Path, max_gap: int = 10_000) -> dict[str, int]:
    """Copy every group and rollout row of a damaged store that SQLite can still read, one row at a
    time by rowid, into a new store at ``dest``; returns how many of each. A group whose rollouts are
    not all recovered stays incomplete there, so it is never trained on."""
    dest = Path(dest)
    copy = dest.with_name(f".damaged-{dest.name}")
    data = bytearray(Path(damaged).read_bytes())
    if len(data) >= 100 and data.startswith(b"SQLite format 3\x00"):
        # A truncated file reads as malformed as a whole; padded back to the size its header
        # records, only the rows on the lost pages are unreadable.
        page_size = int.from_bytes(data[16:18], "big") or 65536
        pages = int.from_bytes(data[28:32], "big")
        data.extend(b"\x00" * max(0, page_size * pages - len(data)))
    copy.write_bytes(bytes(data))
    src = sqlite3.connect(f"file:{copy}?mode=ro", uri=True)
    out = RolloutStore(dest)
    counts = {"groups": 0, "rollouts": 0, "damaged_rows": 0}
    try:
        for table, key in (("groups", "groups"), ("rollouts", "rollouts")):
            columns = SCHEMA_COLUMNS[table]
            rowid, gap = 0, 0
            while gap < max_gap:
                rowid += 1
                try:
                    row = src.execute(f"SELECT {', '.join(columns)} FROM {table} WHERE rowid=?", (rowid,)).fetchone()
                except sqlite3.DatabaseError:  # on a lost page
                    gap += 1
                    continue
                if row is None:
                    gap += 1
                    continue
                gap = 0
                if table == "rollouts" and not _whole_rollout_row(row):
                    counts["damaged_rows"] += 1
                    continue
                with out._conn() as conn:
                    conn.execute(f"INSERT OR IGNORE INTO {table}({', '.join(columns)}) VALUES ({','.join('?' * len(columns))})", row)
                counts[key] += 1
    finally:
        src.close()
        out.close()
        copy.unlink()
    return counts


def _whole_rollout_row(row: tuple) -> bool:
    """A salvaged row whose tail was on a lost page reads as zeros: check it is self-consistent."""
    total, generated, ids, mask, logprobs, info, status = row[5], row[6], row[7], row[8], row[9], row[10], row[12]
    try:
        json.loads(info)
    except (TypeError, ValueError):
        return False
    return (status in ("ready", "consumed", "discarded") and isinstance(ids, bytes) and isinstance(mask, bytes)
            and isinstance(logprobs, bytes) and len(ids) == 4 * total and len(mask) == total
            and len(logprobs) == 4 * total and sum(unpack_column(mask, "b")) == generated)


SCHEMA_COLUMNS = {
    "groups": ("group_id", "task_id", "adapter_version", "group_size", "created_s"),
    "rollouts": ("rollout_id", "group_id", "task_id", "adapter_version", "reward", "total_tokens", "generated_tokens",
                 "input_ids", "loss_mask", "serving_logprobs", "info", "created_s", "status", "status_step"),
}


def _drop(conn: sqlite3.Connection, group_ids: list[str], reason: str) -> None:
    """Record ``group_ids`` dropped for ``reason``."""
    conn.executemany("INSERT OR REPLACE INTO dropped_groups(group_id, reason, created_s) VALUES (?,?,?)",
                     [(group_id, reason[:2000], time.time()) for group_id in group_ids])


class _Tx:
    """``with store._conn() as conn``: the thread's connection; statements autocommit unless a
    ``BEGIN`` is issued, and an exception inside a ``BEGIN`` rolls it back."""

    def __init__(self, conn: sqlite3.Connection, path: Path) -> None:
        self.conn = conn
        self.path = path

    def __enter__(self) -> sqlite3.Connection:
        return self.conn

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and self.conn.in_transaction:
            try:
                self.conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass  # SQLite already rolled back (a full disk does): the error below is what matters
        if exc_type is not None and issubclass(exc_type, sqlite3.OperationalError) and _is_write_error(exc):
            raise _write_error(self.path, exc) from exc


def _is_write_error(exc: BaseException) -> bool:
    text = str(exc)
    return any(s in text for s in ("disk is full", "disk I/O error", "readonly", "unable to open database"))
