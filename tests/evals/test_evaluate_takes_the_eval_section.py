"""``evaluate`` is handed the run's ``[eval]`` section whole (issue 53): how each task is run
(attempts, turns, tokens per turn, temperature, seed, workers) comes from the section, whose
defaults are the only ones. Before, ``evaluate`` had loose keyword arguments with defaults of its
own, and a caller that left ``max_new_tokens`` out got 64 tokens a turn while ``[eval]`` says 48.

Real bubblewrap sandboxes and a real bundled task; the model is a client that records what each
call asked for (no model is needed to read the sampling parameters it was sent)."""

from __future__ import annotations

import pytest

from evals.evaluate import evaluate
from evals.settings import EvalSection
from tests.sandboxes.conftest import installed

pytestmark = pytest.mark.skipif(not installed("bwrap"), reason="bubblewrap is not installed")


class Recorder:
    """Answers every call with a line that does nothing, and keeps the sampling parameters it was sent."""

    def __init__(self, tokenizer):
        self.tokenizer, self.params = tokenizer, []

    def generate(self, input_ids, sampling_params=None, *, return_logprob=False, lora_path=None, rid=None):
        self.params.append(dict(sampling_params or {}))
        ids = self.tokenizer.encode("no idea", add_special_tokens=False)
        return {"output_ids": ids, "meta_info": {"output_token_logprobs": [[0.0, t, None] for t in ids]}}


def test_the_run_keys_left_out_are_the_eval_sections(small_tasks, tokenizer):
    from evals.sandbox import platform_sandbox_factory

    model = Recorder(tokenizer)
    rows = evaluate(small_tasks[:1], model, tokenizer, platform_sandbox_factory("bwrap"), checkpoint="d-step_000000",
                    attempts=1, max_turns=1, workers=1)
    assert len(rows) == 1 and rows[0]["status"] != "infra_error", rows
    assert [p["max_new_tokens"] for p in model.params] == [EvalSection().max_new_tokens] == [48]
    assert model.params[0]["temperature"] == EvalSection().temperature


def test_the_section_says_how_each_task_is_run(small_tasks, tokenizer):
    from evals.sandbox import platform_sandbox_factory

    model = Recorder(tokenizer)
    section = EvalSection(attempts=2, max_turns=1, max_new_tokens=7, temperature=0.5, workers=1)
    rows = evaluate(small_tasks[:1], model, tokenizer, platform_sandbox_factory("bwrap"), section,
                    checkpoint="d-step_000000")
    assert [r["attempt"] for r in rows] == [0, 1]
    assert [(p["max_new_tokens"], p["temperature"]) for p in model.params] == [(7, 0.5)] * 2
