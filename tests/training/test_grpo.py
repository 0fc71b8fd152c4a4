"""The GRPO loss and its gradients, pinned on fixed inputs computed by hand."""

from __future__ import annotations

import inspect
import math
from types import SimpleNamespace

import pytest
import torch

from training.backends import micro_batches
from training.backends.torch_peft import TorchPeftBackend
from training.grpo import DEFAULT_LOSS, LossConfig, TrainBatch, batch_from_groups, group_advantages, grpo_loss

LOGPROBS = [[0.0, -1.0, -2.0], [0.0, -0.5, -0.25]]
SERVING = [[0.0, -1.0, -1.5], [0.0, -0.5, -1.0]]
MASK = [[0, 1, 1], [0, 1, 1]]
ADV = [1.0, -0.5]


def test_group_advantages_drop_and_count_zero_variance_groups():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0]])
    out = group_advantages(rewards)
    assert out.dropped_groups == 1
    assert out.kept.tolist() == [True, False, True]
    assert out.advantages.tolist() == [[0.5, -0.5, -0.5, 0.5], [0.0] * 4, [-0.25, -0.25, -0.25, 0.75]]
    scaled = group_advantages(rewards, scale_by_std=True).advantages
    assert scaled[0].tolist() == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)
    assert scaled[2].tolist() == pytest.approx([-1 / math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3), math.sqrt(3)], abs=1e-5)


def _group(rewards: list[float], generated: list[int]) -> SimpleNamespace:
    """A group whose rollout i has a 2-token prompt and ``generated[i]`` generated tokens."""
    rollouts = [SimpleNamespace(reward=r, input_ids=[1] * (2 + n), loss_mask=[0, 0] + [1] * n,
                                serving_logprobs=[0.0] * (2 + n)) for r, n in zip(rewards, generated)]
    return SimpleNamespace(rollouts=rollouts)


def test_sequence_weighting_makes_every_episode_weigh_alike():
    """A one-turn pass (2 tokens) and a five-turn failure (8 tokens): by token the failure's tokens
    carry 8/10 of the gradient; by sequence each episode's tokens share 1/2 of it."""
    groups = [_group([1.0, 0.0], [2, 8]), _group([1.0, 1.0], [3, 3])]
    for weighting, per_token in (("token", [-0.5 / 10, 0.5 / 10]), ("sequence", [-0.5 / (2 * 2), 0.5 / (2 * 8)])):
        batch, dropped = batch_from_groups(groups, LossConfig(weighting=weighting))
        assert dropped == 1 and len(batch.input_ids) == 2
        width = max(len(r) for r in batch.input_ids)
        pad = lambda rows: torch.tensor([list(r) + [0] * (width - len(r)) for r in rows], dtype=torch.float32)  # noqa: E731
        lp = torch.zeros(2, width, requires_grad=True)
        loss, _ = grpo_loss(lp, pad(batch.serving_logprobs), pad(batch.loss_mask), torch.tensor(batch.advantages))
        loss.backward()
        for row, mask, expected in zip(lp.grad.tolist(), batch.loss_mask, per_token):
            assert [g for g, m in zip(row, mask) if m] == pytest.approx([expected] * sum(mask))
    # An episode that generated nothing adds no term: the other is the whole mean.
    batch, _ = batch_from_groups([_group([1.0, 0.0], [0, 4])], LossConfig(weighting="sequence"))
    assert batch.advantages == pytest.approx([0.0, -0.5])
    with pytest.raises(ValueError, match="loss weighting 'episode'"):
        batch_from_groups(groups, LossConfig(weighting="episode"))


def test_loss_config_comes_from_the_trainer_keys_and_no_backend_takes_a_loss_setting():
    """The loss settings are built once from the trainer config, with its defaults; a backend is
    given them with each step and takes none of them when built."""
    from training.backends import backend_class
    from training.config import BACKENDS, TrainConfig

    cfg = TrainConfig.from_mapping({"base_model": "m", "tis_cap": 3.0, "kl_coef": 0.05, "loss_weighting": "sequence",
                                    "scale_advantages_by_std": True})
    assert cfg.loss == LossConfig(tis_cap=3.0, kl_coef=0.05, weighting="sequence", scale_advantages_by_std=True)
    assert TrainConfig().loss == LossConfig() == DEFAULT_LOSS
    for name in BACKENDS:
        constructor = inspect.signature(backend_class(name)).parameters
        assert not {"tis_cap", "kl_coef", "loss_weighting", "weighting", "scale_advantages_by_std"} & set(constructor), name
        assert list(inspect.signature(backend_class(name).train_step).parameters) == ["self", "batch", "loss"], name


def test_backend_settings_that_are_trainer_keys_default_to_the_trainer_config():
    """A backend's keyword argument named like a trainer key takes the trainer config's default, and
    those that are not trainer keys take training.backends' one default, alike in every backend."""
    from training import backends
    from training.backends import backend_class
    from training.config import BACKEND_KEYS, BACKENDS, TrainConfig

    shared = {"target_modules": backends.LORA_TARGET_MODULES, "weight_decay": backends.DEFAULT_WEIGHT_DECAY,
              "max_grad_norm": backends.DEFAULT_MAX_GRAD_NORM, "micro_batch_tokens": backends.DEFAULT_MICRO_BATCH_TOKENS}
    trainer = TrainConfig()
    for name in BACKENDS:
        defaults = {k: p.default for k, p in inspect.signature(backend_class(name)).parameters.items()}
        for key in BACKEND_KEYS:
            assert defaults[key] == getattr(trainer, key), (name, key)
        assert {k: defaults[k] for k in shared} == shared, name
    assert TrainConfig(base_model="m", lora_rank=4, seed=3, device="cpu").backend_args() == {
        "model_path": "m", "lora_rank": 4, "lora_alpha": 32, "learning_rate": 2e-3, "seed": 3, "recompute": "none",
        "device": "cpu"}


def test_the_loss_weighting_key_is_validated_naming_the_key():
    from training.config import TrainConfig

    assert TrainConfig(base_model="m").loss.weighting == "token"
    assert TrainConfig.from_mapping({"base_model": "m", "loss_weighting": "sequence"}).loss.weighting == "sequence"
    with pytest.raises(ValueError, match="key 'loss_weighting' must be one of token, sequence, got 'episode'"):
        TrainConfig.from_mapping({"base_model": "m", "loss_weighting": "episode"})


def test_loss_and_gradient_with_truncated_importance_weights():
    lp = torch.tensor(LOGPROBS, requires_grad=True)
    loss, stats = grpo_loss(lp, torch.tensor(SERVING), torch.tensor(MASK), torch.tensor(ADV), LossConfig(tis_cap=2.0))
    w02 = math.exp(-0.5)  # exp(-2.0 - -1.5), under the cap
    w12 = 2.0  # exp(0.75) = 2.117, truncated to the cap
    expected = -(1 * 1.0 * -1.0 + w02 * 1.0 * -2.0 + 1 * -0.5 * -0.5 + w12 * -0.5 * -0.25) / 4
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert loss.item() == pytest.approx(0.4282653, abs=1e-6)
    loss.backward()
    expected_grad = [[0.0, -0.25, -w02 / 4], [0.0, 0.125, 0.25]]
    assert lp.grad.tolist() == [pytest.approx(row, abs=1e-6) for row in expected_grad]
    assert stats.tokens == 4
    assert stats.clipped_is_fraction == pytest.approx(0.25)
    assert stats.mean_is_weight == pytest.approx((1 + w02 + 1 + 2) / 4, abs=1e-6)


def test_loss_only_counts_model_generated_tokens():
    lp = torch.tensor(LOGPROBS, requires_grad=True)
    mask = torch.tensor([[0, 1, 0], [0, 0, 1]])  # column 2 of row 0, column 1 of row 1: tool output
    loss, stats = grpo_loss(lp, torch.tensor(SERVING), mask, torch.tensor(ADV), LossConfig(tis_cap=2.0))
    assert stats.tokens == 2
    assert loss.item() == pytest.approx(-(1.0 * -1.0 + 2.0 * -0.5 * -0.25) / 2, abs=1e-6)
    loss.backward()
    assert lp.grad.tolist() == [pytest.approx([0.0, -0.5, 0.0]), pytest.approx([0.0, 0.0, 0.5])]


def test_kl_term_value_and_gradient():
    lp = torch.tensor(LOGPROBS, requires_grad=True)
    ref = torch.tensor([[0.0, -1.0, -1.0], [0.0, -1.0, -0.25]])
    loss, stats = grpo_loss(lp, torch.tensor(SERVING), torch.tensor(MASK), torch.tensor(ADV),
                            LossConfig(tis_cap=2.0, kl_coef=0.1), ref_logprobs=ref)
    kl = ((math.e - 2.0) + (math.exp(-0.5) + 0.5 - 1.0)) / 4
    assert stats.kl == pytest.approx(kl, abs=1e-6)
    assert loss.item() == pytest.approx(0.4282653 + 0.1 * kl, abs=1e-6)
    loss.backward()
    w02 = math.exp(-0.5)
    expected_grad = [
        [0.0, -0.25 + 0.1 * (1 - 1) / 4, -w02 / 4 + 0.1 * (1 - math.e) / 4],
        [0.0, 0.125 + 0.1 * (1 - math.exp(-0.5)) / 4, 0.25],
    ]
    assert lp.grad.tolist() == [pytest.approx(row, abs=1e-6) for row in expected_grad]


def test_shape_errors_name_the_argument():
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(3))


def _batch() -> TrainBatch:
    return TrainBatch(
        input_ids=[[1, 5, 7, 9, 11], [1, 5, 8], [2, 3, 4, 6, 10, 12, 13], [2, 3, 4, 14]],
        loss_mask=[[0, 0, 1, 1, 1], [0, 0, 1], [0, 0, 0, 1, 0, 1, 1], [0, 0, 0, 1]],
        serving_logprobs=[[0, 0, -4.0, -4.1, -4.2], [0, 0, -4.0], [0, 0, 0, -4.3, 0, -4.0, -4.1], [0, 0, 0, -4.2]],
        advantages=[0.5, -0.5, 0.75, -0.75],
    )


def test_backend_step_does_not_depend_on_micro_batching(tiny_model_dir):
    """One step over the whole batch and one over single-sequence micro-batches give the same
    loss and the same adapter: the loss is normalized by the whole batch's generated tokens."""
    whole = TorchPeftBackend(tiny_model_dir, lora_rank=4, micro_batch_tokens=10_000, seed=3)
    split = TorchPeftBackend(tiny_model_dir, lora_rank=4, micro_batch_tokens=7, seed=3)
    assert len(micro_batches(_batch().input_ids, split.micro_batch_tokens)) == 4
    a, b = whole.train_step(_batch(), LossConfig()), split.train_step(_batch(), LossConfig())
    assert a.tokens == b.tokens == 8
    assert a.loss == pytest.approx(b.loss, abs=1e-6)
    assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-4)
    for (name, x), (_, y) in zip(sorted(whole.adapter_state_dict().items()), sorted(split.adapter_state_dict().items())):
        assert torch.allclose(x, y, atol=1e-6), name


def test_backend_steps_raise_the_likelihood_of_advantaged_tokens(tiny_model_dir):
    backend = TorchPeftBackend(tiny_model_dir, lora_rank=4, learning_rate=1e-2, seed=0)
    ids = torch.tensor([[1, 5, 7, 9, 11]])
    before = backend.token_logprobs(ids, torch.ones_like(ids))[0, 2:].sum().item()
    batch = TrainBatch(input_ids=[[1, 5, 7, 9, 11]], loss_mask=[[0, 0, 1, 1, 1]],
                       serving_logprobs=[[0, 0, -4.0, -4.0, -4.0]], advantages=[1.0])
    for _ in range(5):
        backend.train_step(batch, LossConfig())
    after = backend.token_logprobs(ids, torch.ones_like(ids))[0, 2:].sum().item()
    assert after > before + 0.1
