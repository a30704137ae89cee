"""The region op's operand cache over long runs (csrc/torch/region.cpp): what it keeps is bounded, and what it
holds goes when the user drops it."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from scorch_backend import _C
from test_backend_edge_cases import Fn, pruned


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_cache_keeps_few_data_inputs():
    model = Fn(lambda x, W, b: x @ W.t())
    compiled = torch.compile(model, backend="scorch")
    with torch.no_grad():
        for _ in range(40):
            compiled((torch.rand(8, 24) < 0.05).float())  # sparse data, a new tensor every call
    sizes = _C.region_cache_sizes()
    assert sizes["inputs"] <= sizes["max_inputs"] == 8


def test_cache_lets_a_dropped_models_weights_go(monkeypatch):
    """The cache held each weight it compressed (an alias): a model dropped by the user kept its weights in
    memory until 512 newer ones pushed them out (helper-73: a checkpoint sweep grew by every model). Now the
    weight's memory goes with the model, its entry goes when the next one is made, and a new weight that gets
    the freed memory is not taken for the old one (each model's result is checked)."""
    monkeypatch.setenv("SCORCH_DISPATCH", "sparse")
    _C.region_clear_cache()
    x = torch.randn(4, 24)
    counts = []
    for seed in range(6):
        model = Fn(lambda x, W, b: x @ W.t() + b)
        with torch.no_grad():
            model.W.copy_(pruned(16, 24, seed=seed))
        compiled = torch.compile(model, backend="scorch")
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-6)
        weight = model.W.untyped_storage()
        del model, compiled
        torch._dynamo.reset()
        assert torch._C._storage_Use_Count(weight._cdata) == 1  # only `weight` holds it now
        del weight
        counts.append(_C.region_cache_sizes()["weights"])
    assert counts[-1] <= 2, counts  # the dropped models' entries swept (one per model before)


def test_cache_keeps_few_batch_sized_forms_of_a_mask(monkeypatch):
    """A mask's pattern broadcast over the batch, and its transpose for the backward, are sized by the call: the
    cache kept one of each per batch size met, for good (helper-73: +214 MB over 35 batch sizes in training).
    Now a few recent sizes are kept: the number of cached forms stops growing."""
    monkeypatch.setenv("SCORCH_DISPATCH", "sparse")  # the forms exist on the sparse path only

    class BlockMasked(nn.Module):
        def __init__(self, s=32):
            super().__init__()
            mask = torch.zeros(s, s, dtype=torch.bool)
            for i in range(0, s, 8):
                mask[i:i + 8, i:i + 8] = True
            self.register_buffer("mask", mask)

        def forward(self, q, k, v):
            scores = (q @ k.transpose(-2, -1)) * 0.5
            return torch.softmax(scores.masked_fill(~self.mask, float("-inf")), -1) @ v

    torch.manual_seed(0)
    model = BlockMasked()
    compiled = torch.compile(model, backend="scorch", dynamic=True)
    _C.region_clear_cache()
    forms = []
    for batch in range(1, 21):
        q, k, v = (torch.randn(batch, 32, 4, requires_grad=True) for _ in range(3))
        out = compiled(q, k, v)
        out.square().sum().backward()
        q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
        model(q2, k2, v2).square().sum().backward()
        torch.testing.assert_close(out, model(q2, k2, v2), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(q.grad, q2.grad, rtol=1e-4, atol=1e-5)
        forms.append(_C.region_cache_sizes()["forms"])
    assert forms[-1] > 0, forms  # the sparse path ran and cached the mask's forms
    assert forms[-1] == forms[9], forms
