"""The dense path of an einsum with three or more factors (csrc/torch/dense_einsum.cpp): contracted a pair at a
time in an order chosen by size, never left to right into a product of every letter."""

import os

import pytest
import torch

import scorch_backend as sb
from conftest import random_dense

EQUATIONS = [
    ("bnh,bnd,bn->nhd", {"b": 9, "n": 3, "h": 5, "d": 4}),
    ("ij,jk,kl->il", {"i": 7, "j": 1, "k": 6, "l": 5}),
    ("ij,j,i->i", {"i": 11, "j": 13}),
    ("abc,cd,da,b->ad", {"a": 4, "b": 3, "c": 5, "d": 6}),
    ("ij,ij,ij->", {"i": 5, "j": 4}),
    ("ik,jk,ij->ij", {"i": 0, "j": 4, "k": 3}),
]


def _operands(eq, sizes, seed):
    lhs = eq.split("->")[0].split(",")
    out = []
    for k, letters in enumerate(lhs):
        shape = tuple(sizes[c] for c in letters)
        x = random_dense(shape, 0.4, seed=seed + k) if shape else torch.tensor(1.5)
        out.append(sb.sparse(x, "csr") if k == 0 and len(shape) == 2 else x)
    return out


@pytest.mark.parametrize("eq,sizes", EQUATIONS)
def test_dense_path_matches_torch(eq, sizes, monkeypatch):
    monkeypatch.setenv("SCORCH_DISPATCH", "dense")
    ops = _operands(eq, sizes, seed=3)
    want = torch.einsum(eq, *[o.to_dense() if isinstance(o, sb.SparseTensor) else o for o in ops])
    got = sb.einsum(eq, *ops)
    got = got.to_dense() if isinstance(got, sb.SparseTensor) else got
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_three_factor_gradient_contracts_pairwise(monkeypatch):
    """The MoE's weight gradient shape: left to right, einsum would form a (b, n, h, d) product first."""
    monkeypatch.setenv("SCORCH_DISPATCH", "dense")
    b, n, h, d = 16, 4, 24, 12
    g = torch.Generator().manual_seed(0)
    hid = torch.randn(b, n, h, generator=g)
    dy = torch.randn(b, n, d, generator=g)
    gate = random_dense((b, n), 0.3, seed=5)
    S = sb.sparse(gate, "csr")
    with torch.profiler.profile(record_shapes=True) as prof:
        got = sb.einsum("bnh,bnd,bn->nhd", hid, dy, S)
    torch.testing.assert_close(got, torch.einsum("bnh,bnd,bn->nhd", hid, dy, gate), rtol=1e-5, atol=1e-5)
    calls = [e for e in prof.events() if e.name == "aten::einsum"]
    # one einsum per pair: (dy, gate) first, then (hid, that); left to right it is one call of three factors
    assert len(calls) == 2, [e.input_shapes for e in calls]
