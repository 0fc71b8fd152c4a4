"""The grouped LoRA products that serving.engines.vllm_server puts in vLLM's torch LoRA ops compute
what vLLM's own ops compute: each op is run both ways on the same tensors (several adapter slots,
the -1 "no adapter" index, 4-d stacked weights, padding, add and overwrite) and compared."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
lora_ops = pytest.importorskip("vllm.lora.ops.torch_ops.lora_ops")

from serving.engines import vllm_server  # noqa: E402

ORIGINAL = {name: getattr(lora_ops, name) for name in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice",
                                                       "sgmv_shrink", "sgmv_expand", "sgmv_expand_slice")}


@pytest.fixture()
def grouped():
    """vLLM's lora_ops with the grouped products in, restored afterwards (the patch is process-wide)."""
    from vllm.lora.ops import torch_ops
    from vllm.lora.punica_wrapper import punica_cpu

    saved = [(mod, name, getattr(mod, name)) for mod in (lora_ops, torch_ops, punica_cpu)
             for name in ORIGINAL if hasattr(mod, name)]
    assert vllm_server.use_grouped_lora_ops()
    yield lora_ops
    for mod, name, fn in saved:
        setattr(mod, name, fn)


def _indices(tokens: int, slots: int, gen: torch.Generator) -> torch.Tensor:
    idx = torch.randint(-1, slots, (tokens,), generator=gen)
    idx[0] = -1
    return idx


@pytest.mark.parametrize("tokens,slots", [(1, 3), (7, 1), (40, 3)])
@pytest.mark.parametrize("stacked_4d", [False, True])
def test_shrink_matches_vllm(grouped, tokens, slots, stacked_4d):
    gen = torch.Generator().manual_seed(tokens * 10 + slots)
    x = torch.randn(tokens, 96, generator=gen)
    w = torch.randn(slots + 1, 16, 96, generator=gen)
    if stacked_4d:
        w = w.unsqueeze(1)
    idx = _indices(tokens, slots, gen)
    want = torch.zeros(tokens, 20)
    got = want.clone()
    ORIGINAL["bgmv_shrink"](x, w, want, idx, 0.5)
    grouped.bgmv_shrink(x, w, got, idx, 0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got[:, 16:].abs().sum() == 0  # the buffer's padding is left alone


@pytest.mark.parametrize("add_inputs", [True, False])
@pytest.mark.parametrize("slots", [1, 3])
def test_expand_matches_vllm(grouped, add_inputs, slots):
    gen = torch.Generator().manual_seed(slots + add_inputs)
    x = torch.randn(12, 16, generator=gen)
    w = torch.randn(slots + 1, 1, 100, 16, generator=gen)  # 100 outputs into a 96-wide tensor: padding
    idx = _indices(12, slots, gen)
    base = torch.randn(12, 96, generator=gen)
    want, got = base.clone(), base.clone()
    ORIGINAL["bgmv_expand"](x, w, want, idx, add_inputs)
    grouped.bgmv_expand(x, w, got, idx, add_inputs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("add_inputs", [True, False])
def test_expand_slice_and_prefill_ops_match_vllm(grouped, add_inputs):
    gen = torch.Generator().manual_seed(7)
    seq_lens = torch.tensor([5, 3, 9])
    lora_per_seq = torch.tensor([2, -1, 0])
    tokens = int(seq_lens.sum())
    starts = torch.cumsum(seq_lens, 0) - seq_lens
    meta = (starts, seq_lens, lora_per_seq, 3, int(seq_lens.max()), tokens)
    x = torch.randn(tokens, 16, generator=gen)
    w = torch.randn(4, 1, 32, 16, generator=gen)
    base = torch.randn(tokens, 96, generator=gen)
    want, got = base.clone(), base.clone()
    ORIGINAL["sgmv_expand_slice"](x, w, want, *meta, 32, 32, add_inputs)
    grouped.sgmv_expand_slice(x, w, got, *meta, 32, 32, add_inputs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    a = torch.randn(4, 1, 16, 96, generator=gen)
    h = torch.randn(tokens, 96, generator=gen)
    want_buf, got_buf = torch.zeros(tokens, 16), torch.zeros(tokens, 16)
    ORIGINAL["sgmv_shrink"](h, a, want_buf, *meta, 2.0)
    grouped.sgmv_shrink(h, a, got_buf, *meta, 2.0)
    torch.testing.assert_close(got_buf, want_buf, rtol=1e-5, atol=1e-5)


def test_shapes_outside_the_contract_run_vllms_own_op(grouped):
    """A single input row broadcast over a batch is what vLLM's einsum allows and the grouped product
    does not handle: the original op runs and gives its own answer."""
    x = torch.randn(1, 16)
    w = torch.randn(2, 32, 16)
    idx = torch.tensor([0, 1, 1])
    assert vllm_server._lora_products(x, w, idx, torch.float32) is None
    want, got = torch.zeros(3, 32), torch.zeros(3, 32)
    ORIGINAL["bgmv_shrink"](x, w, want, idx, 1.0)
    grouped.bgmv_shrink(x, w, got, idx, 1.0)
    torch.testing.assert_close(got, want)
