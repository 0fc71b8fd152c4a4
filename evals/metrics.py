"""Metrics over attempts: pass@k, bootstrap intervals, paired comparisons.

The unit of resampling is the *task*: attempts of one task are correlated, so every interval here
resamples tasks with replacement (a seeded generator, so a report is reproducible) and recomputes the
statistic on the resampled set. A paired comparison resamples the tasks both checkpoints were scored
on, so the difference and its interval describe the same tasks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from ``n`` attempts of which ``c`` passed: 1 - C(n-c,k)/C(n,k).

    Computed as a running product 1 - prod_{i=n-c+1..n} (1 - k/i), which never forms the huge
    binomials. With fewer than ``k`` failures every draw of ``k`` contains a pass, so the value is 1.
    """
    if not (isinstance(n, int) and isinstance(c, int) and isinstance(k, int)):
        raise TypeError(f"pass_at_k(n={n!r}, c={c!r}, k={k!r}): expected integers")
    if n < 1 or not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k(n={n}, c={c}, k={k}): expected n >= 1, 0 <= c <= n, 1 <= k <= n")
    if n - c < k:
        return 1.0
    prob_all_fail = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_fail *= 1.0 - k / i
    return 1.0 - prob_all_fail


@dataclass(frozen=True)
class Estimate:
    """A point estimate with a bootstrap confidence interval (``level`` e.g. 0.95)."""

    value: float
    low: float
    high: float
    level: float = 0.95
    n_tasks: int = 0

    def fmt(self, digits: int = 3) -> str:
        return f"{self.value:.{digits}f} [{self.low:.{digits}f}, {self.high:.{digits}f}]"


def bootstrap(
    per_task: Sequence[float] | np.ndarray,
    *,
    statistic: Callable[[np.ndarray], float] = np.mean,
    resamples: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> Estimate:
    """The statistic of per-task values with a percentile bootstrap interval over tasks."""
    values = np.asarray(per_task, dtype=float)
    if values.size == 0:
        raise ValueError("bootstrap: no tasks to estimate over")
    if not 0 < level < 1:
        raise ValueError(f"bootstrap: level {level} must lie in (0, 1)")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, values.size, size=(resamples, values.size))
    stats = np.array([statistic(values[row]) for row in idx]) if statistic is not np.mean else values[idx].mean(axis=1)
    alpha = (1 - level) / 2
    low, high = np.quantile(stats, [alpha, 1 - alpha])
    return Estimate(float(statistic(values)), float(low), float(high), level, int(values.size))


def paired_difference(
    new: Mapping[str, float],
    base: Mapping[str, float],
    *,
    resamples: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> Estimate:
    """Mean of ``new[t] - base[t]`` over the tasks both have, with a paired bootstrap interval."""
    common = sorted(set(new) & set(base))
    if not common:
        raise ValueError("paired_difference: the two checkpoints share no task")
    diffs = np.array([new[t] - base[t] for t in common])
    return bootstrap(diffs, resamples=resamples, level=level, seed=seed)


def paired_attempt_difference(
    new: Mapping[str, Sequence[float]],
    base: Mapping[str, Sequence[float]],
    *,
    resamples: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> Estimate:
    """Mean over the tasks both have of (mean of ``new[t]``'s attempts - mean of ``base[t]``'s), with
    the paired bootstrap interval over tasks (:func:`paired_difference` of the per-task means).

    Tasks are the unit resampled, as everywhere in this module: a task's difference of attempt means
    already varies with the few attempts' sampling noise, so the spread of those differences carries
    it, and resampling the attempts within each drawn task as well would count it a second time
    (intervals about 1.4x too wide at 2 attempts a task; a simulation of known change covers it 95%
    of the time this way: tests/evals/test_metrics.py)."""
    common = sorted(set(new) & set(base))
    if not common:
        raise ValueError("paired_attempt_difference: the two checkpoints share no task")
    for name, attempts in (("new", new), ("base", base)):
        empty = next((t for t in common if len(attempts[t]) == 0), None)
        if empty is not None:
            raise ValueError(f"paired_attempt_difference: task {empty!r} has no attempt in {name}")
    return paired_difference({t: float(np.mean(new[t])) for t in common}, {t: float(np.mean(base[t])) for t in common},
                             resamples=resamples, level=level, seed=seed)
