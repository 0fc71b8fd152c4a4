"""The demonstrations the embedded base model learns from, synthesized from the training tasks.

:func:`demonstrations` gives each demonstration task's compact prompt and reference actions
(:mod:`evals.actions`); :func:`augment` adds renamed, reordered variants of each (the same bug and
fix under new names and line numbers); :func:`styled` tells each as one of three transcripts, as the
harness would run it (:func:`transcript`): commit at once, test then commit, or fail, reset and fix.
A transcript is a tuple of ``(text, role)`` segments (:func:`segments`): ``ANSWER`` and ``TRIED``
are model turns, ``OBSERVATION`` is what the harness appends. :mod:`training.base_model` trains on
them; every step is seeded, so the same tasks and settings give the same demonstrations.
"""

from __future__ import annotations

import random
import re
from typing import Any, Sequence
from evals.actions import compact_observation, parse_compact
from evals.actions import demonstration

def demonstrations(tasks: Sequence[Any], by_line: bool = False) -> list[tuple[str, str]]:
    """(prompt, actions) of every training task, in ``edit`` actions (with ``by_line``, ``replace``
    ones); a task without a reference solution, or one kept for RL (``metadata.demonstration =
    false``; :func:`evals.tasks.demonstration_tasks` leaves those out), is an error."""
    demos = []
    for task in tasks:
        if getattr(task, "split", "train") != "train":
            raise ValueError(f"task {task.id}: split {task.split!r}; the base model trains on 'train' tasks only")
        if task.metadata.get("demonstration") is False:
            raise ValueError(f"task {task.id}: kept for RL (metadata demonstration = false); the base model never sees it solved")
        demos.append(demonstration(task, by_line))
    if not demos:
        raise ValueError("no training task to build demonstrations from")
    return demos


_VERBS = ("compute", "get", "make", "find", "check", "scale", "clip", "pick", "join", "count", "apply", "merge")
_NOUNS = ("fee", "mass", "span", "gap", "load", "mark", "rank", "cost", "limit", "sum", "width", "share")


_SYLLABLES = ("ka", "lo", "mi", "ren", "tu", "vor", "sel", "dan", "pi", "gor", "ne", "bax", "quo", "fi", "zan", "hu")


def augment(demos: Sequence[tuple[str, Any]], copies: int, seed: int = 0,
            rename_modules: bool = False) -> list[tuple[str, Any]]:
    """Each demonstration plus ``copies`` variants with its functions (and, with ``rename_modules``,
    its module file) renamed consistently in prompt and answer and their order in the module
    shuffled: the same bug and fix under new names and line numbers, so the model learns to read the
    prompt rather than recall names and numbers.

    The answer is either the action text or a transcript: a tuple of ``(text, role)`` segments
    (:func:`transcript`), every one renamed and renumbered alike."""
    rng = random.Random(seed)
    out = list(demos)
    for prompt, actions in demos:
        # In a fixed order (longest first, then by name), not set order, so the names drawn for them
        # are the same in every process.
        funcs = sorted(set(re.findall(r"\bdef (\w+)\(", prompt)), key=lambda f: (-len(f), f))
        modules = sorted(set(re.findall(r"^(\w+)\.py:$", prompt, flags=re.M)))
        for _ in range(copies):
            mapping: dict[str, str] = {}
            if rename_modules:
                for module in modules:
                    mapping[module] = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3)))
            used: set[str] = set(mapping.values())
            for f in funcs:
                name = f"{rng.choice(_VERBS)}_{rng.choice(_NOUNS)}"
                while name in used:
                    name = f"{rng.choice(_VERBS)}_{rng.choice(_NOUNS)}_{rng.randint(2, 9)}"
                used.add(name)
                mapping[f] = name
            if not mapping:
                continue
            prompt_v, new_number = _permute_functions(prompt, rng)
            pattern = re.compile(r"\b(" + "|".join(re.escape(k) for k in sorted(mapping, key=len, reverse=True)) + r")\b")

            def rewrite(text: str, renumber: bool) -> str:
                text = _renumber(text, new_number) if renumber else text
                return pattern.sub(lambda m: mapping[m.group(1)], text)

            if isinstance(actions, str):
                answer: Any = rewrite(actions, True)
            else:
                answer = tuple((rewrite(text, role != OBSERVATION), role) for text, role in actions)
            out.append((rewrite(prompt_v, False), answer))
    return out


_NUMBERED = re.compile(r"^(\d+) (.*)$")
_REPLACE = re.compile(r"^replace (\S+):(\d+) (.*)$")


def _permute_functions(prompt: str, rng: random.Random) -> tuple[str, dict[int, int]]:
    """Shuffle the order of the module's functions in the numbered listing; return the new prompt
    and the map of old to new 0-based line indexes (for :func:`_renumber`), so a line is found by its
    content, not by a remembered number."""
    lines = prompt.split("\n")
    listing = [i for i, line in enumerate(lines) if _NUMBERED.match(line)]
    if not listing or listing != list(range(listing[0], listing[-1] + 1)):
        return prompt, {}
    body = [_NUMBERED.match(lines[i]).group(2) for i in listing]
    blocks: list[list[int]] = [[]]
    for j, text in enumerate(body):
        if text.strip() == "":
            blocks.append([])
        else:
            blocks[-1].append(j)
    blocks = [b for b in blocks if b]
    rng.shuffle(blocks)
    order: list[int | None] = []
    for k, block in enumerate(blocks):
        if k:
            order.append(None)
        order.extend(block)
    new_number = {old: new for new, old in enumerate(order, 1) if old is not None}
    numbered = [f"{n} {body[old] if old is not None else ''}" for n, old in enumerate(order, 1)]
    return "\n".join(lines[:listing[0]] + numbered + lines[listing[-1] + 1:]), new_number


def _renumber(actions: str, new_number: dict[int, int]) -> str:
    """``actions`` with each ``replace FILE:LINE`` moved to the line's new number."""
    answer = []
    for line in actions.split("\n"):
        m = _REPLACE.match(line)
        if m and int(m.group(2)) - 1 in new_number:
            line = f"replace {m.group(1)}:{new_number[int(m.group(2)) - 1]} {m.group(3)}"
        answer.append(line)
    return "\n".join(answer)


ANSWER, TRIED, OBSERVATION = "answer", "tried", "observation"
_OPERATOR_SWAPS = (("*", "+"), ("+", "-"), ("-", "+"), ("<=", "<"), (">=", ">"), ("<", ">"), (">", "<"),
                   ("==", "!="), ("!=", "=="), ("max", "min"), ("min", "max"))


def _wrong_text(text: str, rng: random.Random) -> str:
    """A plausible wrong fix: ``text`` with one constant or operator changed (never ``text`` itself)."""
    digits = [i for i, c in enumerate(text) if c.isdigit()]
    if digits and rng.random() < 0.5:
        i = rng.choice(digits)
        return text[:i] + rng.choice([d for d in "123456789" if d != text[i]]) + text[i + 1:]
    for old, new in rng.sample(_OPERATOR_SWAPS, len(_OPERATOR_SWAPS)):
        if old in text:
            return text.replace(old, new, 1)
    return text + " + 1"


def transcript(prompt: str, actions: str, style: str, rng: random.Random, max_failures: int = 2) -> Any:
    """The demonstration ``(prompt, actions)`` told in one of three styles, as the harness would
    run it (``actions`` is a compact answer ending ``commit``):

    - ``direct``: the answer and ``commit`` in one turn (``actions`` itself);
    - ``verify``: the answer and ``test``; the observation ``all tests pass``; then ``commit``;
    - ``retry``: one to ``max_failures`` wrong attempts, each with ``test`` and the failing asserts
      (an ``edit`` whose text is not in the module, told the closest line; a wrong constant or
      operator in the fix; or for ``replace`` the wrong line or the wrong file; each after the
      first starts with ``reset``),
      then ``reset``, the answer and ``test``, ``all tests pass`` and ``commit``. The wrong attempts
      are not trained on (role ``TRIED``): the model learns what to do after a failure, not the
      failure. A wrong attempt of an answer with several ``edit`` s spoils one of them, and its
      test lists only the failing asserts of that edit's function, as the harness would; the last
      such attempt is then repaired in place, without ``reset``: the one edit that fixes what it
      spoiled (the missed edit again, or the wrong text edited into the right one), ``test``,
      ``all tests pass`` and ``commit``. A reset there would undo the edits that were right.

    A transcript is a tuple of ``(text, role)`` segments: ``ANSWER`` and ``TRIED`` are model turns
    (each ends with the end-of-text token), ``OBSERVATION`` is what the harness appends.
    """
    # heavy: evals.bundled and evals.harness load numpy; only a transcript with failures needs them
    from evals.bundled import MODULES
    from evals.harness import replace_once

    if style == "direct":
        return actions
    edits = [a for a in parse_compact(actions) if a.tool in ("str_replace", "replace_line")]
    if not edits or style not in ("verify", "retry"):
        raise ValueError(f"transcript style {style!r} of an answer with {len(edits)} edit(s)")
    answer = "\n".join(a.to_compact() for a in edits) + "\ntest\n"
    if style == "verify":
        return ((answer, ANSWER), (compact_observation(["ok"] * len(edits) + ["all tests pass"]), OBSERVATION),
                ("commit\n", ANSWER))
    fails = "\n".join(line[len("fail: "):] for line in prompt.split("\n") if line.startswith("fail: ")) or "tests fail"
    modules = sorted(set(re.findall(r"\b(\w+)\.py\b", prompt)))
    numbered = [m for m in (_NUMBERED.match(line) for line in prompt.split("\n")) if m]
    listed = [m.group(1) for m in numbered if m.group(2).strip()]  # line numbers a wrong replace may pick
    listing = "\n".join(m.group(2) for m in numbered)  # the module's text, where an edit's old text is looked up
    module_file = f"{modules[0]}.py" if modules else "the file"
    several = len(edits) > 1 and all(a.tool == "str_replace" for a in edits)
    out: list[tuple[str, str]] = []
    repair: tuple[str, str] | None = None  # (old, new) of the edit that repairs the last wrong attempt
    for attempt in range(rng.randint(1, max_failures)):
        wrong, results = (["reset"], ["ok"]) if attempt else ([], [])
        spoiled = rng.randrange(len(edits))
        current, repair = listing, None  # the module as this attempt leaves it (each starts from the base)
        for i, action in enumerate(edits):
            if action.tool == "str_replace":  # a wrong fix, or text that is not in the module
                old, new = action.args["old"], action.args["new"]
                mistake = rng.choice(("new", "new", "old")) if i == spoiled else ""
                if mistake == "old":
                    old = _wrong_text(old, rng)
                elif mistake:
                    new = _wrong_text(new, rng)
                wrong.append(f"edit {old} => {new}")
                try:
                    current = replace_once(current, old, new, module_file)
                    results.append("ok")
                except ValueError as exc:  # the harness's observation of the same edit
                    results.append(f"error: {exc}")
                if mistake:  # what repairs it: the missed edit itself, or the wrong text made right
                    repair = (action.args["old"] if mistake == "old" else new, action.args["new"])
                continue
            path, number, text = action.args["path"], str(action.args["line"]), action.args["text"]
            mistake = rng.choice(("text", "text", "file", "line")) if i == spoiled else ""
            if mistake == "file":
                path = f"{rng.choice([x for x in MODULES if x not in modules])}.py"
            elif mistake == "line" and len(listed) > 1:
                number = rng.choice([n for n in listed if n != number])
            elif mistake:
                text = _wrong_text(text, rng)
            wrong.append(f"replace {path}:{number} {text}")
            results.append(f"error: {path}" if mistake == "file" else "ok")
        seen = _fails_of(fails, listing, edits[spoiled].args.get("old", "")) if several else fails
        out += [("\n".join(wrong) + "\ntest\n", TRIED), (compact_observation(results + [seen]), OBSERVATION)]
    if several and repair is not None:
        try:  # the repair's old text must be found once in the module the attempt left
            replace_once(current, *repair, module_file)
        except ValueError:
            pass  # told as a reset and the whole answer, below
        else:
            fixed = compact_observation(["ok", "all tests pass"])
            return tuple(out) + ((f"edit {repair[0]} => {repair[1]}\ntest\n", ANSWER), (fixed, OBSERVATION),
                                 ("commit\n", ANSWER))
    passed = compact_observation(["ok"] * (len(edits) + 1) + ["all tests pass"])
    return tuple(out) + (("reset\n" + answer, ANSWER), (passed, OBSERVATION), ("commit\n", ANSWER))


def _fails_of(fails: str, listing: str, old: str) -> str:
    """The lines of ``fails`` (failing asserts) that call the function of ``listing`` holding the
    text ``old``: what a test run shows when only that function is still wrong (all of ``fails``
    when that cannot be told)."""
    at = listing.find(old) if old else -1
    names = re.findall(r"\bdef (\w+)\(", listing[:at]) if at >= 0 else []
    mine = [line for line in fails.split("\n") if names and f"{names[-1]}(" in line]
    return "\n".join(mine) or fails


def styled(demos: Sequence[tuple[str, str]], verify_share: float, retry_share: float, seed: int = 0,
           max_failures: int = 2) -> list[tuple[str, Any]]:
    """Each demonstration told as a ``verify`` transcript with probability ``verify_share``, a
    ``retry`` one with ``retry_share``, else ``direct`` (:func:`transcript`)."""
    if verify_share < 0 or retry_share < 0 or verify_share + retry_share > 1:
        raise ValueError(f"verify_share {verify_share} and retry_share {retry_share}: each >= 0, together <= 1")
    rng = random.Random(f"styles-{seed}")
    out = []
    for prompt, actions in demos:
        u = rng.random()
        style = "verify" if u < verify_share else "retry" if u < verify_share + retry_share else "direct"
        out.append((prompt, transcript(prompt, actions, style, rng, max_failures)))
    return out


def segments(actions: Any) -> tuple[tuple[str, str], ...]:
    return ((actions, ANSWER),) if isinstance(actions, str) else tuple(actions)
