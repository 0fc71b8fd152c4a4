"""How a section of the run file is declared, validated and documented: one vocabulary for every package.

A section of the run file (``[eval]``, the trainer's loss keys, ...) is a frozen dataclass declared
once, in the package that uses it (``evals.settings.EvalSection``, ``training.config.LossConfig``);
each field says its constraint, its choices and its meaning with :func:`setting`::

    @dataclass(frozen=True)
    class EvalSection:
        attempts: int = field(default=8, metadata=setting(POSITIVE, doc="attempts per task"))

and :func:`parse_section` turns a table (TOML, JSON, a Dagster config) into that dataclass, one
message per bad key, each naming the source, the section and the key and saying what was expected.
The run planner composes the sections into the whole run file (``training.planner.schema``), and
the key reference (``docs/run-file.md``) is written from the same fields (:func:`markdown_table`).

It lives here, in the lowest package, so that a section can be declared in any package (a lower
package cannot import a higher one: ``tests/test_layering.py``); it holds no sandbox logic and
imports nothing of posttrain (as ``sandboxes.home`` decides the home folder for every package).
The sandboxes' own section, ``[sandbox]`` (:class:`SandboxSection`), is declared at its end.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
import math
import types
import typing
from typing import Any, Mapping

# Constraint tags carried in field metadata.
POSITIVE = "positive"
NON_NEGATIVE = "non-negative"
FRACTION = "fraction"  # 0 < x <= 1


def setting(check: str | None = None, *, choices: tuple[str, ...] | None = None, doc: str = "",
            key: str | None = None) -> dict[str, Any]:
    """The metadata of a run-file key: its constraint (:data:`POSITIVE`, :data:`NON_NEGATIVE`,
    :data:`FRACTION`), its choices, what it means, and ``key``, its name in the run file when that is
    not the field's (``LossConfig.weighting`` is ``[trainer] loss_weighting``)."""
    return {"check": check, "choices": choices, "doc": doc, "key": key}


class SettingsError(ValueError):
    """Settings that do not validate (a run file, a plan's table, a Dagster config). ``problems``
    holds one message per offending key; the run planner calls it ``PlanError``."""

    def __init__(self, problems: list[str], detail: str = "") -> None:
        self.problems = list(problems)
        self.detail = detail
        text = "\n".join(self.problems)
        super().__init__(text + (f"\n{detail}" if detail else ""))


def key_name(f: dataclasses.Field) -> str:
    """The run-file name of a section's field (``setting(key=...)``, else the field's name)."""
    return f.metadata.get("key") or f.name


def describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def convert(value: Any, hint: Any) -> tuple[Any, str | None]:
    """Convert a TOML value to ``hint``; return (value, None) or (None, what was expected)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return convert(value, inner[0])
    if hint is bool:
        return (value, None) if isinstance(value, bool) else (None, "true or false")
    if hint is int:
        return (value, None) if isinstance(value, int) and not isinstance(value, bool) else (None, "an integer")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value), None
        return None, "a number"
    if hint is str:
        return (value, None) if isinstance(value, str) and value else (None, "a non-empty string")
    if typing.get_origin(hint) is tuple and args[0] is str:
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            return None, "a list of names"
        return tuple(value), None
    if typing.get_origin(hint) is tuple:
        if not isinstance(value, list) or not value:
            return None, "a non-empty list of integers"
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return None, "a non-empty list of integers"
        return tuple(value), None
    raise TypeError(f"unsupported field type {hint!r}")  # a bug in a section's declaration, not in the file


def check(value: Any, meta: Mapping[str, Any]) -> str | None:
    """What a converted value should have been, by its field's :func:`setting`; ``None`` when it is fine."""
    tag, choices = meta.get("check"), meta.get("choices")
    values = value if isinstance(value, tuple) else (value,)
    if tag == POSITIVE and any(v <= 0 for v in values):
        return "a positive value" if len(values) == 1 else "positive values"
    if tag == NON_NEGATIVE and any(v < 0 for v in values):
        return "a value of 0 or more"
    if tag == FRACTION and not 0 < value <= 1:
        return "a fraction in (0, 1]"
    if choices and any(v not in choices for v in values):
        return ("names among " if isinstance(value, tuple) else "one of ") + ", ".join(repr(c) for c in choices)
    return None


def parse_section(cls: type, table: Any, section: str, source: str, problems: list[str]) -> tuple[Any, set[str]]:
    """``table`` validated into ``cls``, with its problems appended to ``problems`` (each naming
    ``source``, ``[section]`` and the key) and the ``"section.key"`` of every key it sets."""
    explicit: set[str] = set()
    if not isinstance(table, Mapping):
        problems.append(f"{source}: [{section}] must be a table, got {describe(table)}")
        return cls(), explicit
    hints = typing.get_type_hints(cls)
    fields = {key_name(f): f for f in dataclasses.fields(cls) if f.init}
    values: dict[str, Any] = {}
    for key, raw in table.items():
        if key not in fields:
            known = ", ".join(sorted(fields))
            problems.append(f"{source}: [{section}] {key}: unknown key; [{section}] takes: {known}")
            continue
        f = fields[key]
        value, expected = convert(raw, hints[f.name])
        if expected is None:
            expected = check(value, f.metadata)
        if expected is not None:
            problems.append(f"{source}: [{section}] {key}: expected {expected}, got {describe(raw)}")
            continue
        values[f.name] = value
        explicit.add(f"{section}.{key}")
    return cls(**values), explicit


def parse_table(cls: type, table: Any, section: str, source: str) -> Any:
    """A whole table validated into ``cls``; a ``None`` value counts as unset (a plan writes the keys
    left unset as null). :class:`SettingsError` naming ``source`` and each offending key."""
    problems: list[str] = []
    if isinstance(table, Mapping):
        table = {key: value for key, value in table.items() if value is not None}
    parsed, _ = parse_section(cls, table, section, source, problems)
    if problems:
        raise SettingsError(problems)
    return parsed


def as_table(section: Any) -> dict[str, Any]:
    """A section as the table it is written as (run-file names, lists for tuples, unset keys left
    out): the inverse of :func:`parse_table`, for a plan's JSON or a Dagster run config."""
    return {key_name(f): list(v) if isinstance(v := getattr(section, f.name), tuple) else v
            for f in dataclasses.fields(section) if getattr(section, f.name) is not None}


def _type_name(hint: Any) -> str:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return _type_name(args[0])
    if typing.get_origin(hint) is tuple:
        return "list of names" if args[0] is str else "list of integers"
    return {bool: "bool", int: "integer", float: "number", str: "string"}.get(hint, str(hint))


def _default_text(f: dataclasses.Field) -> str:
    if f.default is dataclasses.MISSING or f.default is None:
        return ""
    value = list(f.default) if isinstance(f.default, tuple) else f.default
    return "`" + (str(value).lower() if isinstance(value, bool) else repr(value).replace("'", '"')) + "`"


def markdown_table(cls: type, defaults: Any = None) -> str:
    """The key reference of one section, as a Markdown table: key, type, default, constraint and
    meaning, from the fields' declarations. ``defaults``: an instance whose values are the defaults
    shown (a section whose declared defaults are ``None``, "left to the trainer", shows the
    trainer's through it)."""
    hints = typing.get_type_hints(cls)
    lines = ["| key | type | default | allowed | meaning |", "| --- | --- | --- | --- | --- |"]
    for f in dataclasses.fields(cls):
        meta = f.metadata
        allowed = {POSITIVE: "> 0", NON_NEGATIVE: ">= 0", FRACTION: "(0, 1]"}.get(meta.get("check") or "", "")
        if meta.get("choices"):
            allowed = ", ".join(f"`{c}`" for c in meta["choices"])
        default = _default_text(f)
        if defaults is not None and not default and getattr(defaults, f.name, None) is not None:
            default = _default_text(dataclasses.field(default=getattr(defaults, f.name)))
        doc = str(meta.get("doc") or "").replace("|", "\\|")
        lines.append(f"| `{key_name(f)}` | {_type_name(hints[f.name])} | {default} | {allowed} | {doc} |")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class SandboxSection:
    """``[sandbox]``: one sandbox per episode."""

    runtime: str = field(default="auto", metadata=setting(choices=("auto", "runsc", "bwrap", "k8s")))
    cpus: float = field(default=1.0, metadata=setting(POSITIVE, doc="CPUs per sandbox"))
    memory_gib: float = field(default=2.0, metadata=setting(POSITIVE, doc="memory per sandbox"))
    max_sandboxes: int | None = field(default=None, metadata=setting(POSITIVE, doc="default: the producer budget"))
    command_timeout_s: float = field(default=120.0, metadata=setting(POSITIVE))
    image: str | None = field(default=None, metadata=setting(doc=(
        "on Kubernetes, the sandbox pod image of a task that is a folder (the bundled suite, the task stream): "
        "python3, git, tar, pxd at /opt/pxd/pxd.py; its repository is copied in at start")))
