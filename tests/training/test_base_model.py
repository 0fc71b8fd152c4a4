"""The base model's demonstration augmentation: variants stay correct demonstrations."""

from __future__ import annotations

import collections
import random
import re

import pytest

from training.base_model import BaseModelSpec, build_base_model
from training.demonstrations import augment

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
ANSWER_TEXT = "replace kitchen.py:5     return x * 4\ncommit\n"


def _edited_line(prompt: str, answer: str) -> tuple[str, str, str]:
    """(file, text of the line the answer edits as the prompt lists it, new text)."""
    m = re.match(r"replace (\S+):(\d+) (.*)", answer.splitlines()[0])
    listed = dict(re.findall(r"^(\d+) (.*)$", prompt, flags=re.M))
    return m.group(1), listed[m.group(2)], m.group(3)


def test_variants_rename_consistently_and_keep_the_edit_on_the_buggy_line() -> None:
    variants = augment([(PROMPT, ANSWER_TEXT)], copies=6, seed=3)
    assert variants[0] == (PROMPT, ANSWER_TEXT)
    for prompt, answer in variants[1:]:
        assert "scale_price" not in prompt and "scale_price" not in answer
        new_name = re.search(r"^Fix (\w+) in", prompt).group(1)
        assert f"def {new_name}(x):" in prompt and f"assert {new_name}(2) == 8" in prompt
        path, old_text, new_text = _edited_line(prompt, answer)
        assert path == "kitchen.py"  # module names stay unless asked
        assert (old_text, new_text) == ("    return x + 4", "    return x * 4")


def test_rename_modules_renames_the_file_everywhere() -> None:
    for prompt, answer in augment([(PROMPT, ANSWER_TEXT)], copies=6, seed=5, rename_modules=True)[1:]:
        assert "kitchen" not in prompt and "kitchen" not in answer
        module = re.search(r"^(\w+)\.py:$", prompt, flags=re.M).group(1)
        assert f"in {module}.py so" in prompt
        path, old_text, _ = _edited_line(prompt, answer)
        assert path == f"{module}.py" and old_text == "    return x + 4"


def test_a_verify_transcript_tests_then_commits_after_all_tests_pass() -> None:

    from training.demonstrations import ANSWER, OBSERVATION, transcript

    segments = transcript(PROMPT, ANSWER_TEXT, "verify", random.Random(0))
    assert segments == (("replace kitchen.py:5     return x * 4\ntest\n", ANSWER),
                        ("\nok\nall tests pass\n>", OBSERVATION), ("commit\n", ANSWER))
    assert transcript(PROMPT, ANSWER_TEXT, "direct", random.Random(0)) == ANSWER_TEXT


def test_a_retry_transcript_fails_first_with_the_prompts_asserts_and_is_not_trained_on_the_failures() -> None:

    from training.demonstrations import ANSWER, OBSERVATION, TRIED, transcript

    mistakes = set()
    for seed in range(60):
        segments = transcript(PROMPT, ANSWER_TEXT, "retry", random.Random(seed), max_failures=3)
        *failures, (fixed, role), (passed, _), (commit, _) = segments
        assert (fixed, role) == ("reset\nreplace kitchen.py:5     return x * 4\ntest\n", ANSWER)
        assert passed == "\nok\nok\nall tests pass\n>" and commit == "commit\n"
        assert 1 <= len(failures) // 2 <= 3
        for k in range(0, len(failures), 2):
            (tried, role0), (failed, role1) = failures[k], failures[k + 1]
            assert (role0, role1) == (TRIED, OBSERVATION)
            lines = tried.splitlines()
            assert lines[-1] == "test" and (lines[0] == "reset") == (k > 0)
            path, line, text = re.match(r"replace (\S+):(\d+) (.*)", lines[-2]).groups()
            assert (path, line, text) != ("kitchen.py", "5", "    return x * 4")
            assert failed.endswith("\nassert scale_price(2) == 8 -> assert 6 == 8\n>")
            if path != "kitchen.py":
                assert f"\nerror: {path}\n" in failed and (line, text) == ("5", "    return x * 4")
                mistakes.add("file")
            elif line != "5":
                assert text == "    return x * 4" and line in "1245"
                mistakes.add("line")
            else:
                mistakes.add("text")
    assert mistakes == {"text", "file", "line"}


def test_examples_train_on_the_models_turns_only_each_ending_with_end_of_text() -> None:

    from training.base_model import sft_examples
    from training.demonstrations import transcript

    class Chars:  # one id per character; 0 is the end-of-text token
        eos_token_id = 0

        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

    segments = transcript(PROMPT, ANSWER_TEXT, "retry", random.Random(1))
    [(ids, mask)] = sft_examples(Chars(), [(PROMPT, segments)])
    assert len(ids) == len(mask) == len(PROMPT) + sum(len(t) for t, _ in segments) + 3  # 3 model turns
    trained = "".join("\x00" if i == 0 else chr(i) for i, m in zip(ids, mask) if m)
    assert len(segments) == 5  # one failure, then the fix
    assert trained == segments[-3][0] + "\x00" + "commit\n\x00"  # not the prompt, the failure, or the observations


def test_variants_of_a_transcript_rename_and_renumber_every_model_turn() -> None:

    from training.demonstrations import OBSERVATION, transcript

    segments = transcript(PROMPT, ANSWER_TEXT, "retry", random.Random(2))
    for prompt, answer in augment([(PROMPT, segments)], copies=6, seed=4)[1:]:
        name = re.search(r"^Fix (\w+) in", prompt).group(1)
        fixed = answer[-3][0].splitlines()[1]
        path, old_text, new_text = _edited_line(prompt, fixed)
        assert (path, old_text, new_text) == ("kitchen.py", "    return x + 4", "    return x * 4")
        assert f"assert {name}(2) == 8" in answer[1][0] and answer[1][1] == OBSERVATION
        assert all("scale_price" not in text for text, _ in answer)


def test_edit_transcripts_fail_with_the_harness_observations() -> None:
    """Demonstrations in ``edit`` actions (the default): a wrong attempt either changes the fix (the
    test still fails) or names code the module does not hold, whose observation is the harness's own
    error."""
    from evals.harness import replace_once
    from training.demonstrations import ANSWER, TRIED, transcript

    answer = "edit return x + 4 => return x * 4\ncommit\n"
    listing = "\n".join(re.findall(r"^\d+ (.*)$", PROMPT, flags=re.M))  # the module, where the harness looks
    seen = set()
    for seed in range(30):
        segments = transcript(PROMPT, answer, "retry", random.Random(seed))
        assert segments[-3][0].endswith("edit return x + 4 => return x * 4\ntest\n") and segments[-3][1] == ANSWER
        for (tried, role), (observation, _) in zip(segments[0:-3:2], segments[1:-3:2]):
            assert role == TRIED
            old = re.search(r"^edit (.+?) => ", tried, flags=re.M).group(1)
            if old != "return x + 4":
                try:
                    replace_once(listing, old, "", "kitchen.py")
                except ValueError as exc:
                    assert f"error: {exc}" in observation
                    seen.add("missing")
            else:
                seen.add("wrong fix")
    assert seen == {"missing", "wrong fix"}


TWO_BUGS = (
    "Two tests of garden.py fail. Fix both bugs in garden.py.\n"
    "garden.py:\n"
    "1 def scale_price(x):\n"
    "2     return x + 4\n"
    "3 \n"
    "4 def first_row(items):\n"
    "5     return items[-1] if items else None\n"
    "fail: assert scale_price(2) == 8 -> assert 6 == 8\n"
    "fail: assert first_row([5, 2, 9]) == 5 -> assert 9 == 5\n"
    ">"
)
TWO_FIXES = "edit return x + 4 => return x * 4\nedit return items[-1] if => return items[0] if\ncommit\n"


def test_a_two_edit_retry_shows_the_one_failing_function_and_repairs_it_without_reset() -> None:
    """A wrong attempt at a two-bug task spoils one edit: its test lists that function's failing
    assert only (the other edit was right), and the demonstration then fixes the spoiled edit in
    place, without ``reset`` (which would undo the right one); done on the harness's own text, the
    repaired module is the reference solution."""
    from evals.harness import replace_once
    from training.demonstrations import ANSWER, TRIED, transcript

    base = "\n".join(re.findall(r"^\d+ (.*)$", TWO_BUGS, flags=re.M))
    solved = base.replace("return x + 4", "return x * 4").replace("return items[-1] if", "return items[0] if")
    endings = collections.Counter()
    for seed in range(40):
        segments = transcript(TWO_BUGS, TWO_FIXES, "retry", random.Random(seed))
        tried, observation = segments[-5][0], segments[-4][0]
        assert segments[-5][1] == TRIED and segments[-1] == ("commit\n", ANSWER)
        fails = [line for line in observation.split("\n") if line.startswith("assert ")]
        assert len(fails) == 1  # only the spoiled function's test fails
        text = base  # the last wrong attempt, as the harness runs it
        for line in tried.split("\n"):
            if line.startswith("edit "):
                old, new = line[len("edit "):].split(" => ", 1)
                try:
                    text = replace_once(text, old, new)
                except ValueError:
                    pass
        final = segments[-3][0]
        if final.startswith("reset\n"):
            endings["reset"] += 1
            continue
        endings["repair"] += 1
        edits = [line for line in final.split("\n") if line.startswith("edit ")]
        assert len(edits) == 1 and final.endswith("\ntest\n")
        old, new = edits[0][len("edit "):].split(" => ", 1)
        assert replace_once(text, old, new) == solved
        assert fails[0].split("(")[0] in ("assert scale_price", "assert first_row")
    assert endings["repair"] >= 30  # a reset only where the repair's text would not be found once


def test_an_unknown_answer_form_or_micro_batch_size_is_refused_before_anything_is_built(tmp_path) -> None:
    with pytest.raises(ValueError, match="answer_form 'diff': expected one of edit, replace"):
        build_base_model(tmp_path / "base", [], BaseModelSpec(answer_form="diff"))
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="micro_batch_tokens"):
            build_base_model(tmp_path / "base", [], BaseModelSpec(micro_batch_tokens=bad))
    assert not (tmp_path / "base").exists()
    assert not list(tmp_path.iterdir())


def test_the_variants_do_not_depend_on_the_interpreters_hash_seed() -> None:
    """Functions whose names are equally long are renamed in name order, not in set order, so the
    same demonstrations give the same variants (and the same base model fingerprint) in every process."""
    import json
    import os
    import subprocess
    import sys

    prompt = PROMPT.replace("shift_size", "scale_costs")  # as long as scale_price
    code = ("import json; from training.demonstrations import augment; "
            f"print(json.dumps(augment([({prompt!r}, {ANSWER_TEXT!r})], copies=4, seed=0)))")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout for seed in (1, 2, 3)]
    assert runs[0] == runs[1] == runs[2] and len(json.loads(runs[0])) == 5


def test_the_sft_loss_without_an_attention_mask_is_the_padded_masks() -> None:
    """SFT batches are right-padded and passed without an attention mask: the loss and every gradient
    equal those computed with the padding masked out of attention."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from training.base_model import masked_lm_loss

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=1,
        num_key_value_heads=1, max_position_embeddings=64))
    rng = random.Random(0)
    lengths = [9, 23, 17, 4]
    width = max(lengths)
    ids = torch.tensor([[rng.randrange(1, 64) for _ in range(n)] + [0] * (width - n) for n in lengths])
    mask = torch.tensor([[float(rng.random() < 0.5) for _ in range(n)] + [0.0] * (width - n) for n in lengths])
    attn = torch.tensor([[1] * n + [0] * (width - n) for n in lengths])

    loss = masked_lm_loss(model, ids, mask)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1), reduction="none")
    want = (nll * mask[:, 1:].reshape(-1)).sum() / mask[:, 1:].sum()
    want_grads = torch.autograd.grad(want, list(model.parameters()))
    assert torch.allclose(loss, want, atol=1e-6)
    for got, expected in zip(grads, want_grads):
        assert torch.allclose(got, expected, atol=1e-6)


def test_a_batch_in_micro_batches_has_the_padded_batchs_loss_and_gradients() -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from training.backends.batch import micro_batches
    from training.base_model import batch_backward

    rng = random.Random(0)
    batch = []
    for n in (9, 23, 17, 4, 31, 6, 30):
        mask = [int(rng.random() < 0.5) for _ in range(n)]
        mask[-1] = 1
        batch.append(([rng.randrange(1, 64) for _ in range(n)], mask))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=1,
        num_key_value_heads=1, max_position_embeddings=64))
    got = {}
    for micro_batch_tokens in (0, 64):
        model.zero_grad(set_to_none=True)
        loss = batch_backward(model, batch, micro_batch_tokens)
        got[micro_batch_tokens] = loss, [p.grad.clone() for p in model.parameters()]
    assert len(micro_batches([ids for ids, _ in batch], 64)) > 2
    assert got[64][0] == pytest.approx(got[0][0], abs=1e-6)
    for micro_grad, padded_grad in zip(got[64][1], got[0][1]):
        assert torch.allclose(micro_grad, padded_grad, atol=1e-6)


def test_length_bucketed_batches_cover_every_example_and_cut_the_padding() -> None:
    from training.base_model import length_bucketed_batches

    rng = random.Random(3)
    examples = [([0] * rng.randint(80, 700), []) for _ in range(675)]
    spec = BaseModelSpec(batch_size=16, length_pool=8)

    def padded_share(batches) -> float:
        work = real = 0
        for idx in batches:
            widths = [len(examples[i][0]) for i in idx]
            work, real = work + max(widths) * len(idx), real + sum(widths)
        return 1 - real / work

    batches = length_bucketed_batches(examples, spec, random.Random(0))
    drawn = [next(batches) for _ in range(10 * len(examples) // 16)]  # ten epochs' worth
    assert all(len(b) == 16 for b in drawn)
    counts = collections.Counter(i for b in drawn for i in b)
    assert set(counts) == set(range(len(examples))) and max(counts.values()) - min(counts.values()) <= 2
    first = drawn[:len(examples) // 16]
    random_batches = length_bucketed_batches(examples, BaseModelSpec(batch_size=16, length_pool=1), random.Random(0))
    bucketed, unsorted = padded_share(first), padded_share(next(random_batches) for _ in range(len(first)))
    assert bucketed < unsorted / 3, (bucketed, unsorted)
