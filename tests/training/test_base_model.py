"""The base model's demonstration augmentation: variants stay correct demonstrations."""

from __future__ import annotations

import re

from training.base_model import augment

PROMPT = (
    "Fix scale_price in kitchen.py so its test passes.\n"
    "kitchen.py:\n"
    "1 def shift_size(x):\n"
    "2     return x + 7\n"
    "3 \n"
    "4 def scale_price(x):\n"
    "5     return x + 4\n"
    "fail: assert scale_price(2) == 8 -> assert 6 == 8\n"
    ">"
)
ANSWER = "replace kitchen.py:5     return x * 4\ncommit\n"


def _edited_line(prompt: str, answer: str) -> tuple[str, str, str]:
    """(file, text of the line the answer edits as the prompt lists it, new text)."""
    m = re.match(r"replace (\S+):(\d+) (.*)", answer.splitlines()[0])
    listed = dict(re.findall(r"^(\d+) (.*)$", prompt, flags=re.M))
    return m.group(1), listed[m.group(2)], m.group(3)


def test_variants_rename_consistently_and_keep_the_edit_on_the_buggy_line() -> None:
    variants = augment([(PROMPT, ANSWER)], copies=6, seed=3)
    assert variants[0] == (PROMPT, ANSWER)
    for prompt, answer in variants[1:]:
        assert "scale_price" not in prompt and "scale_price" not in answer
        new_name = re.search(r"^Fix (\w+) in", prompt).group(1)
        assert f"def {new_name}(x):" in prompt and f"assert {new_name}(2) == 8" in prompt
        path, old_text, new_text = _edited_line(prompt, answer)
        assert path == "kitchen.py"  # module names stay unless asked
        assert (old_text, new_text) == ("    return x + 4", "    return x * 4")


def test_rename_modules_renames_the_file_everywhere() -> None:
    for prompt, answer in augment([(PROMPT, ANSWER)], copies=6, seed=5, rename_modules=True)[1:]:
        assert "kitchen" not in prompt and "kitchen" not in answer
        module = re.search(r"^(\w+)\.py:$", prompt, flags=re.M).group(1)
        assert f"in {module}.py so" in prompt
        path, old_text, _ = _edited_line(prompt, answer)
        assert path == f"{module}.py" and old_text == "    return x + 4"
