import numpy as np
import pytest

from evals.metrics import bootstrap, paired_attempt_difference, paired_difference, pass_at_k


@pytest.mark.parametrize(
    "n,c,k,expected",
    [
        (8, 0, 1, 0.0),
        (8, 2, 1, 0.25),                 # c/n
        (8, 2, 4, 1 - 15 / 70),          # 1 - C(6,4)/C(8,4)
        (10, 3, 5, 1 - 21 / 252),        # 1 - C(7,5)/C(10,5)
        (8, 8, 8, 1.0),
        (8, 1, 8, 1.0),                  # fewer failures than k: every draw holds the pass
        (200, 1, 100, 0.5),              # 1 - C(199,100)/C(200,100) = 100/200
        (5, 2, 3, 1 - 1 / 10),           # 1 - C(3,3)/C(5,3)
    ],
)
def test_pass_at_k_pinned(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_stable_for_large_n():
    # the binomials would overflow floats; the product form stays exact enough
    value = pass_at_k(5000, 2500, 2)
    assert value == pytest.approx(1 - (2500 * 2499) / (5000 * 4999), rel=1e-12)
    assert 0.0 <= pass_at_k(10_000, 1, 1) == pytest.approx(1e-4)


@pytest.mark.parametrize("args", [(0, 0, 1), (8, 9, 1), (8, 2, 0), (8, 2, 9), (8, -1, 1)])
def test_pass_at_k_rejects_bad_counts(args):
    with pytest.raises(ValueError, match="pass_at_k"):
        pass_at_k(*args)


def test_bootstrap_is_seeded_and_brackets_the_mean():
    values = [0, 1, 1, 0, 1, 1, 1, 0, 1, 1]
    a = bootstrap(values, seed=3, resamples=500)
    b = bootstrap(values, seed=3, resamples=500)
    assert a == b
    assert a.value == pytest.approx(0.7)
    assert a.low < 0.7 < a.high
    assert 0.0 <= a.low and a.high <= 1.0
    constant = bootstrap([0.5] * 6)
    assert (constant.low, constant.value, constant.high) == (0.5, 0.5, 0.5)


def test_paired_difference_uses_common_tasks_only():
    new = {"a": 1.0, "b": 1.0, "c": 0.0, "only-new": 1.0}
    base = {"a": 0.0, "b": 1.0, "c": 0.0, "only-base": 0.0}
    est = paired_difference(new, base, resamples=300)
    assert est.value == pytest.approx(1 / 3)
    assert est.n_tasks == 3
    with pytest.raises(ValueError, match="share no task"):
        paired_difference({"x": 1.0}, {"y": 1.0})


def test_per_task_with_one_attempt_has_one_pass_column():
    import pandas as pd

    from evals.report import per_task, score_checkpoint

    rows = pd.DataFrame({
        "checkpoint": ["r-step_000001"] * 3, "task_id": ["a", "b", "c"], "status": ["ok", "ok", "ok"],
        "reward": [1.0, 0.0, 1.0], "target_score": [1.0, 0.5, 1.0], "strict_target_score": [1.0, 0.0, 1.0],
        "partial": [1.0, 0.5, 1.0],
    })
    table = per_task(rows, 1)
    assert list(table.columns).count("pass@1") == 1
    assert table["pass@1"].tolist() == [1.0, 0.0, 1.0]
    assert score_checkpoint(rows, k=1, resamples=50).estimates["pass@1"].value == pytest.approx(2 / 3)


def test_paired_attempt_difference_pairs_tasks_and_resamples_them():
    base = {f"t{i}": [1.0] * (i % 5) + [0.0] * (8 - i % 5) for i in range(40)}
    new = {t: [1.0] * (int(sum(v)) + 1) + [0.0] * (7 - int(sum(v))) for t, v in base.items()}
    new["only-new"] = [1.0] * 8  # not paired: left out
    est = paired_attempt_difference(new, base, resamples=1000, seed=3)
    assert est.n_tasks == 40 and est.value == pytest.approx(1 / 8)
    # the interval is the paired one over the tasks' attempt means
    task_means = paired_difference({t: sum(v) / 8 for t, v in new.items()}, {t: sum(v) / 8 for t, v in base.items()},
                                   resamples=1000, seed=3)
    assert est == task_means
    assert paired_attempt_difference(new, base, resamples=1000, seed=3) == est  # seeded
    with pytest.raises(ValueError, match="share no task"):
        paired_attempt_difference({"a": [1.0]}, {"b": [0.0]})
    with pytest.raises(ValueError, match="'t0' has no attempt in new"):
        paired_attempt_difference({"t0": []}, {"t0": [1.0]})


def test_the_paired_interval_covers_a_known_change_95_percent_of_the_time():
    """Simulated evaluations like the demo's (tasks of spread-out base pass rates, RL moving each by
    its own amount, 2 attempts of each checkpoint a task): the 95% interval holds the population's
    mean change in about 95% of them, neither too narrow (attempt noise left out) nor too wide (it
    counted twice, as a bootstrap that also resamples attempts does)."""
    rng = np.random.default_rng(0)
    mean, spread, shift, sd = 0.38, 0.43, 0.05, 0.15

    def draw(n: int) -> tuple[np.ndarray, np.ndarray]:
        p = rng.beta(mean * spread, (1 - mean) * spread, n)
        return p, np.clip(p + rng.normal(shift, sd, n), 0, 1)

    p, q = draw(2_000_000)
    truth = float((q - p).mean())
    covered, widths, runs = 0, [], 400
    for _ in range(runs):
        p, q = draw(150)
        base = {i: (rng.random(2) < p[i]).astype(float).tolist() for i in range(150)}
        new = {i: (rng.random(2) < q[i]).astype(float).tolist() for i in range(150)}
        est = paired_attempt_difference(new, base, resamples=500, seed=int(rng.integers(1 << 30)))
        covered += est.low <= truth <= est.high
        widths.append(est.high - est.low)
    assert 0.91 <= covered / runs <= 0.985, (covered, runs)
def test_headline_per_level_pairs_the_run_with_its_base():
    import pandas as pd

    from evals.report import headline_markdown, headlines

    rows = []
    for ckpt, solved in (("r-step_000000", 2), ("r-step_000010", 6)):
        for level in (1, 3):
            for t in range(10):
                for a in range(8):
                    reward = 1.0 if a < (solved if level == 1 else 1) else 0.0
                    rows.append({"checkpoint": ckpt, "task_id": f"l{level}-{t}", "difficulty": level, "attempt": a,
                                 "status": "graded", "reward": reward})
    rows.append({"checkpoint": "r-step_000010", "task_id": "l1-0", "difficulty": 1, "attempt": 8,
                 "status": "infra_error", "reward": 0.0})  # not an attempt of the policy: left out
    heads = headlines(pd.DataFrame(rows), resamples=500)
    assert [h.checkpoint for h in heads] == ["r-step_000010"] and heads[0].base == "r-step_000000"
    h = heads[0]
    assert h.change.value == pytest.approx((4 / 8) / 2) and h.change.low > 0
    assert [(lv["level"], lv["tasks"]) for lv in h.levels] == [(1, 10), (3, 10)]
    assert h.levels[0]["change"].value == pytest.approx(0.5) and h.levels[1]["change"].value == pytest.approx(0.0)
    text = headline_markdown(heads)
    assert "change **+25.0 points**" in text and "| 3 | 10 | 12.5% | 12.5% | +0.0 |" in text
