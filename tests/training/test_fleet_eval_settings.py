"""The eval pod's settings (``python -m training.fleet_eval --settings``) are the run's ``[eval]``
section, checked as everywhere else (``evals.settings``) before anything is served or loaded."""

from __future__ import annotations

import pytest

from training import fleet_eval


def _run(settings: str) -> str:
    args = fleet_eval.parse_args(["--checkpoint", "r-step_000001", "--checkpoint-dir", "/nowhere", "--rows", "/nowhere/rows",
                                  "--settings", settings])
    with pytest.raises(SystemExit) as raised:
        fleet_eval.run(args)
    return str(raised.value)


def test_a_bad_eval_setting_is_refused_naming_the_key_before_the_fleet_is_asked():
    message = _run('{"attempts": 0, "split": "eval"}')
    assert message.startswith("--settings: ") and "attempts" in message and "positive" in message


def test_settings_that_are_not_json_are_refused():
    assert _run("{attempts").startswith("--settings: ")


def test_an_unknown_eval_key_is_refused():
    assert "attemps" in _run('{"attemps": 2}')
