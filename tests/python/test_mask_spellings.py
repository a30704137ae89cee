"""The ways users write a masked (pruned) weight, each seen as sparse by torch.compile(backend="scorch") and
matching eager: torch.nn.utils.prune's hook (`mask.to(dtype=...) * orig`), casts by keyword or by another
tensor, where() with a zeros_like branch, and a product with the bool mask itself (helper-42 found the
first, the zeros_like branch and the bool products left dense)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from model_check import recorded_reports

SPELLINGS = {
    "float_mask": lambda s, x: s.mf * s.w,
    "to_dtype_keyword": lambda s, x: s.mf.to(dtype=x.dtype) * s.w,
    "to_dtype_positional": lambda s, x: s.mb.to(x.dtype) * s.w,
    "to_tensor": lambda s, x: s.mb.to(x) * s.w,
    "type_as": lambda s, x: s.mb.type_as(x) * s.w,
    "where_zeros_like": lambda s, x: torch.where(s.mb, s.w, torch.zeros_like(s.w)),
    "where_scalar": lambda s, x: torch.where(s.mb, s.w, 0.0),
    "masked_fill": lambda s, x: s.w.masked_fill(~s.mb, 0.0),
    "masked_fill_eq_zero": lambda s, x: s.w.masked_fill(s.mb == 0, 0.0),
    "masked_fill_float_eq_zero": lambda s, x: s.w.masked_fill(s.mf.eq(0), 0.0),
    "bool_mask_times_weight": lambda s, x: s.mb * s.w,  # (helper-42: left dense, "not a float32/float64 tensor")
    "weight_times_bool_mask": lambda s, x: s.w * s.mb,
}


class _Masked(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(512, 256, generator=g))
        mb = torch.rand(512, 256, generator=g) < 0.05
        self.register_buffer("mb", mb)
        self.register_buffer("mf", mb.float())
        self.how = how

    def forward(self, x):
        return nn.functional.linear(x, SPELLINGS[self.how](self, x))


def _regions(reports) -> int:
    return sum(len(r.regions) for r in reports)


@pytest.mark.parametrize("how", list(SPELLINGS))
@pytest.mark.parametrize("grad", [False, True])
def test_each_spelling_of_a_masked_weight_is_a_region(how, grad):
    torch._dynamo.reset()
    m = _Masked(how)
    x = torch.randn(64, 256)
    with recorded_reports() as reports, torch.set_grad_enabled(grad):
        got = torch.compile(m, backend="scorch")(x)
    torch.testing.assert_close(got, m(x), rtol=1e-4, atol=1e-4)
    assert _regions(reports) == 1, [d.reason for r in reports for d in r.decisions]


def test_torch_nn_utils_prune_trains_as_a_region():
    from torch.nn.utils import prune

    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))
    prune.l1_unstructured(eager[0], "weight", amount=0.95)
    twin = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))
    prune.l1_unstructured(twin[0], "weight", amount=0.95)
    twin.load_state_dict(eager.state_dict())
    x = torch.randn(64, 256)
    with recorded_reports() as reports:
        compiled = torch.compile(twin, backend="scorch")
        compiled(x).square().sum().backward()
    eager(x).square().sum().backward()
    assert _regions(reports) >= 1, [d.reason for r in reports for d in r.decisions]
    torch.testing.assert_close(twin[0].weight_orig.grad, eager[0].weight_orig.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(twin[0].bias.grad, eager[0].bias.grad, rtol=1e-4, atol=1e-4)


ATTENTION_SPELLINGS = {
    "not": lambda s, m: s.masked_fill(~m, float("-inf")),
    "eq_zero": lambda s, m: s.masked_fill(m == 0, float("-inf")),  # The Annotated Transformer's, HF's
    "float_eq_zero": lambda s, m: s.masked_fill(m.float() == 0, float("-inf")),
    "eq_false": lambda s, m: s.masked_fill(m == False, float("-inf")),  # noqa: E712
}


@pytest.mark.parametrize("how", list(ATTENTION_SPELLINGS))
@pytest.mark.parametrize("grad", [False, True])
def test_each_spelling_of_the_masked_positions_is_masked_attention(how, grad, monkeypatch):
    """masked_fill(mask == 0, -inf), the most common spelling in attention code, was left dense: only ~mask
    was read as the negated mask. (Recognition is the subject: the sparse path is forced, since under the
    default dispatch a 64x64 attention is rightly left dense.)"""
    from scorch_backend import _C

    monkeypatch.setenv("SCORCH_DISPATCH", "sparse")

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(1)
            mask = torch.rand(64, 64, generator=g) < 0.1
            self.register_buffer("mask", mask | torch.eye(64, dtype=torch.bool))

        def forward(self, q, k, v):
            scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
            return torch.softmax(ATTENTION_SPELLINGS[how](scores, self.mask), -1) @ v

    torch._dynamo.reset()
    m = Attention()
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 64, 16, generator=g, requires_grad=grad) for _ in range(3))
    before = _C.attention_stats()
    with torch.set_grad_enabled(grad):
        got = torch.compile(m, backend="scorch")(q, k, v)
    after = _C.attention_stats()
    assert after["sparse_runs"] + after["dense_runs"] == before["sparse_runs"] + before["dense_runs"] + 1
    q2, k2, v2 = (t.detach().clone().requires_grad_(grad) for t in (q, k, v))
    want = m(q2, k2, v2)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    if grad:
        got.square().sum().backward()
        want.square().sum().backward()
        for a, b in ((q, q2), (k, k2), (v, v2)):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)
