"""``ast.parse`` and ``ast.literal_eval`` that are safe to call from several threads at once.

CPython 3.11 (this project's interpreter) keeps one counter of the AST constructor's recursion depth
per interpreter, not per thread (``Python/Python-ast.c``). When a parse's conversion of the tree to
Python objects is interrupted, for instance by a garbage collection that runs a finalizer, and
another thread parses meanwhile, the first parse ends with ``SystemError: AST constructor recursion
depth mismatch`` (python/cpython#106905). The harness parses on its episode threads (a task's test
file for its call checks, an agent's patch for cheating signals), and 32 of them run at once: the
error stopped a demo's curriculum step. Every parse of ours on the host goes through :func:`parse`
or :func:`literal_eval` (a string given to ``ast.literal_eval`` is parsed the same way), which hold
one lock for the whole parse; the conversion holds the GIL anyway, so nothing is lost.
``tests/evals/test_safe_ast.py`` reproduces the error with ``ast.parse`` itself.
"""

from __future__ import annotations

import ast
import threading

_lock = threading.Lock()


def parse(source: str | bytes, filename: str = "<unknown>") -> ast.Module:
    """``ast.parse(source, filename)``, one thread at a time."""
    with _lock:
        return ast.parse(source, filename)


def literal_eval(value):
    """``ast.literal_eval(value)``; a string is parsed first, one thread at a time."""
    if isinstance(value, (str, bytes)):
        with _lock:
            return ast.literal_eval(value)
    return ast.literal_eval(value)
