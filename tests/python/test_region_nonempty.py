"""A softmax of scores filled with -inf outside a mask is zero outside the mask, except in a row the mask leaves
empty, which eager makes NaN throughout. When something sits between the softmax and `@ v` (a Dropout, the
HF layout) the masked-attention idiom does not match, and the region reads the probabilities under the mask's
pattern: the pattern carries the softmax's letter ("nonempty"), the op checks per call (once per version of a
cached mask) that every row keeps an entry, and runs the dense product where one does not, so the NaN comes
through as in eager (forward and gradients). The program text's "nonempty" field is checked like the rest."""

from __future__ import annotations

import json

import pytest
import torch

import scorch_backend as sb  # noqa: F401 - registers the backend
from scorch_backend import _C
from scorch_backend.custom_ops import region


class Attention(torch.nn.Module):
    """softmax(q k^T / 4 masked with -inf) -> Dropout -> @ v, the mask a buffer."""

    def __init__(self, mask):
        super().__init__()
        self.drop = torch.nn.Dropout(0.1)
        self.register_buffer("mask", mask)

    def forward(self, q, k, v):
        scores = (q @ k.transpose(-2, -1) / 4.0).masked_fill(~self.mask, float("-inf"))
        return self.drop(scores.softmax(-1)) @ v


def band(L, width=4, empty=()):
    i = torch.arange(L)
    m = (i[:, None] - i[None, :]).abs() < width
    for r in empty:
        m[r] = False
    return m


def inputs(L, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, 3, L, 8, generator=g).requires_grad_(grad) for _ in range(3))


def same(got, want):
    """Equal values where eager's are finite, and NaN exactly where eager's are."""
    assert torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(torch.nan_to_num(got), torch.nan_to_num(want), rtol=1e-4, atol=1e-5)


def regions_seen(model, *args):
    reports = []
    from scorch_backend.compiler import backend

    backend._recorders.append(reports)
    try:
        model(*args)
    finally:
        backend._recorders.remove(reports)
    return [r for rep in reports for r in rep.regions if r.fused is not None]


@pytest.mark.parametrize("dispatch", ["auto", "sparse"])
@pytest.mark.parametrize("L,empty", [(127, (3,)), (33, (0, 32)), (9, tuple(range(9)))])
def test_an_empty_mask_row_is_nan_as_in_eager(dispatch, L, empty, monkeypatch):
    monkeypatch.setenv("SCORCH_DISPATCH", dispatch)
    torch._dynamo.reset()
    m = Attention(band(L, empty=empty)).eval()
    q, k, v = inputs(L)
    compiled = torch.compile(m, backend="scorch")
    with torch.no_grad():
        want = m(q, k, v)
        fused = regions_seen(compiled, q, k, v)
        got = compiled(q, k, v)
    if dispatch == "sparse":  # (auto may leave a product dense: its cost model measures the call's overhead)
        assert fused, "the product with the probabilities is a region read under the mask's pattern"
        texts = [r.program_text for r in fused]
        assert any(o.nonempty for t in texts for o in region.parse_program(t).operands if o.kind == "pattern")
    assert want[..., list(empty), :].isnan().all()
    same(got, want)


def compiled_attention(mask, monkeypatch):
    """(eager model, its compiled form, q, k, v) under the forced sparse path."""
    monkeypatch.setenv("SCORCH_DISPATCH", "sparse")
    torch._dynamo.reset()
    m = Attention(mask).eval()
    return (m, torch.compile(m, backend="scorch"), *inputs(mask.shape[0]))


def test_rows_that_all_keep_an_entry_stay_on_the_sparse_path(monkeypatch):
    m, compiled, q, k, v = compiled_attention(band(127), monkeypatch)
    with torch.no_grad():
        want = m(q, k, v)
        compiled(q, k, v)
        before = region.stats["sparse_runs"], region.stats["dense_runs"]
        got = compiled(q, k, v)
        after = region.stats["sparse_runs"], region.stats["dense_runs"]
    assert after == (before[0] + 1, before[1])
    same(got, want)


def test_a_mask_emptied_in_place_is_seen_on_the_next_call(monkeypatch):
    m, compiled, q, k, v = compiled_attention(band(40), monkeypatch)
    with torch.no_grad():
        same(compiled(q, k, v), m(q, k, v))
        m.mask[7] = False  # moves the buffer's version: the check is made again
        want = m(q, k, v)
        assert want[..., 7, :].isnan().all()
        same(compiled(q, k, v), want)
        m.mask[7, 7] = True
        same(compiled(q, k, v), m(q, k, v))


@pytest.mark.parametrize("dispatch", ["auto", "sparse"])
def test_gradients_with_an_empty_row_match_eager(dispatch, monkeypatch):
    monkeypatch.setenv("SCORCH_DISPATCH", dispatch)
    torch._dynamo.reset()
    L = 24
    m = Attention(band(L, empty=(5,))).eval()  # eval: the Dropout is the identity, as in a fine-tune's eval step
    compiled = torch.compile(m, backend="scorch")
    for model in (m, compiled):
        q, k, v = inputs(L, grad=True, seed=1)
        out = model(q, k, v)
        out.sum().backward()
        if model is m:
            want = (out.detach(), q.grad, k.grad, v.grad)
        else:
            for got, ref in zip((out.detach(), q.grad, k.grad, v.grad), want):
                same(got, ref)


def test_a_mask_broadcast_along_the_softmax_dimension_claims_no_zeros(monkeypatch):
    # mask (L, 1): a zero masks a whole row, which is NaN, never zero: nothing may be skipped.
    monkeypatch.setenv("SCORCH_DISPATCH", "sparse")
    torch._dynamo.reset()
    L = 16
    rows = torch.ones(L, 1, dtype=torch.bool)
    rows[[2, 9]] = False
    m = Attention(rows).eval()
    q, k, v = inputs(L)
    with torch.no_grad():
        same(torch.compile(m, backend="scorch")(q, k, v), m(q, k, v))


def _program(nonempty, kind="pattern"):
    return json.dumps({"operands": [["ij", "dense", False, True, 0, False], ["ij", kind, False, False, 0, False],
                                     ["jk", "dense", False, True, 0, False]],
                       "out": "ik", "coef": 1.0, "frozen": False, "name": "nonempty_test", "nonempty": nonempty})


@pytest.mark.parametrize("force", ["", "sparse", "dense"])
def test_program_text_runs_dense_only_where_a_row_is_empty(force):
    g = torch.Generator().manual_seed(3)
    p = torch.rand(6, 5, generator=g)
    pattern = torch.rand(6, 5, generator=g) < 0.5
    pattern[:, 0] = True
    v = torch.randn(5, 4, generator=g)
    text = _program([[1, "j"]])
    assert region.parse_program(text).operands[1].nonempty == "j"
    # The gradient program of the dense factor keeps the pattern and its letter (the NaN reaches gradients too).
    grad_text = _C.region_gradient(text, 2)[0]
    kept = [o for o in region.parse_program(grad_text).operands if o.kind == "pattern"]
    assert [o.nonempty for o in kept] == ["j"]
    want = (p * pattern) @ v
    torch.testing.assert_close(region.run(text, [p, pattern, v], force or None), want)
    pattern[4] = False
    p[4] = float("nan")  # the factor's empty row is NaN, as a softmax over nothing makes it
    got = region.run(text, [p, pattern, v], force or None)
    assert got[4].isnan().all() and not got[:4].isnan().any()
    assert region.choose_path(text, [p, pattern, v]) == "dense"


@pytest.mark.parametrize("nonempty,match", [([[0, "j"]], "own letters"), ([[1, "k"]], "own letters"),
                                            ([[1, "jj"]], "own letters"), ([[5, "j"]], "names no operand"),
                                            ([[1]], "pairs"), ("j", "list")])
def test_bad_nonempty_text_is_a_value_error(nonempty, match):
    with pytest.raises(ValueError, match=match):
        _C.region_layout(_program(nonempty))


class GatedAttention(torch.nn.Module):
    """A gate masked like the scores multiplies the probabilities: the gate brings the mask's zeros itself."""

    def __init__(self, mask, order):
        super().__init__()
        self.register_buffer("mask", mask)
        self.w = torch.nn.Parameter(torch.randn(mask.shape))
        self.order = order

    def forward(self, q, k, v):
        p = (q @ k.mT).masked_fill(~self.mask, float("-inf")).softmax(-1)
        gate = self.w.masked_fill(~self.mask, 0.0)
        return ((gate * p) if self.order == 0 else (p * gate)) @ v


@pytest.mark.parametrize("order", [0, 1])
def test_an_empty_row_stays_nan_when_another_factor_brings_the_mask_zeros(order, monkeypatch):
    monkeypatch.setenv("SCORCH_DISPATCH", "sparse")
    torch._dynamo.reset()
    L = 64
    m = GatedAttention(band(L, empty=(5,)), order)
    q, k, v = inputs(L)
    with torch.no_grad():
        want = m(q, k, v)
        fused = regions_seen(torch.compile(m, backend="scorch"), q, k, v)
        got = torch.compile(m, backend="scorch")(q, k, v)
    assert any(o.nonempty for r in fused for o in region.parse_program(r.program_text).operands)
    assert want[..., 5, :].isnan().all()
    same(got, want)
