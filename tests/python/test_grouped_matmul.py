"""The grouped runner's products (csrc/torch/grouped_matmul.cpp, grouped.cpp; issue 13): rows sorted by group,
each group's slice times that group's matrix, with a gradient that is grouped products again. Checked against
the chain's steps run densely and with gradcheck, at group sizes that take each thread split (groups shared
among threads; a group holding most rows run with every thread; empty groups), with the per-group matrix read
in both orientations and per-entry factors (gates, S's values) folded into the rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from scorch_backend.custom_ops import chain as Ch
from scorch_backend.custom_ops import region as R
from scorch_backend.tools import zoo
from model_check import check_model

P, O = R.Program, R.Operand


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)


def _experts(kind: str, b: int, n: int, g: torch.Generator) -> torch.Tensor:
    e = torch.randint(0, n, (b,), generator=g)
    if kind == "one_large":
        e[: b - 4] = 1  # one group holds most rows: it runs alone, split across threads
    elif kind == "empty_groups":
        e = e % 2 * 3  # only groups 0 and 3 have rows
    return e


def _moe(kind: str, transposed: bool, scaled: bool, b=26, n=5, d=4, h=7, seed=0):
    """A 3-step MoE chain: relu(S x W1) W2 combined with gates. `transposed`: W2 stored (groups, d, h) and read
    as its transpose. `scaled`: S holds values other than 1 (they scale the gathered rows)."""
    g = torch.Generator().manual_seed(seed)
    mask = F.one_hot(_experts(kind, b, n, g), n).double()
    s = mask * (torch.rand(b, n, dtype=torch.float64, generator=g) + 0.5) if scaled else mask
    soft = torch.rand(b, n, dtype=torch.float64, generator=g)
    x = torch.randn(b, d, dtype=torch.float64, generator=g)
    w1 = torch.randn(n, d, h, dtype=torch.float64, generator=g)
    w2 = torch.randn(n, d, h, dtype=torch.float64, generator=g) if transposed else \
        torch.randn(n, h, d, dtype=torch.float64, generator=g)
    steps = (Ch.ChainStep(P((O("pq", "sparse"), O("pd"), O("qdh")), "pqh").text(), (0, 1, 2), ("aten.relu",)),
             Ch.ChainStep(P((O("abh"), O("bdh" if transposed else "bhd"), O("ab", "pattern")), "abd").text(),
                          (-1, 3, 0)),
             Ch.ChainStep(P((O("xyz"), O("xy", "sparse"), O("xy")), "xz").text(), (-2, 5, 4)))
    return Ch.ChainProgram(steps, "g").text(), [s, x, w1, w2, soft, mask]


@pytest.mark.parametrize("kind", ["spread", "one_large", "empty_groups"])
@pytest.mark.parametrize("transposed", [False, True], ids=["w", "w_t"])
@pytest.mark.parametrize("scaled", [False, True], ids=["mask", "values"])
def test_grouped_products_match_dense_with_gradients(threads, kind, transposed, scaled):
    text, ops = _moe(kind, transposed, scaled)
    torch.testing.assert_close(torch.ops.scorch.chain(text, ops), Ch.run_chain_dense(text, ops))
    x, w1, w2, soft = (t.clone().requires_grad_() for t in ops[1:5])
    assert torch.autograd.gradcheck(lambda *a: torch.ops.scorch.chain(text, [ops[0], *a, ops[5]]), (x, w1, w2, soft))


def test_empty_group_gets_a_zero_weight_gradient():
    text, ops = _moe("empty_groups", False, False)
    w1 = ops[2].clone().requires_grad_()
    torch.ops.scorch.chain(text, [ops[0], ops[1], w1, *ops[3:]]).sum().backward()
    assert torch.equal(w1.grad[1], torch.zeros_like(w1.grad[1]))  # group 1 has no rows
    assert w1.grad[0].abs().sum() > 0 and w1.grad[3].abs().sum() > 0


def test_gradient_runs_grouped_products_not_one_einsum_per_group():
    """The recorded gradient takes the ragged layout's grouped products: no per-group einsum, no padded bmm."""
    text, ops = _moe("spread", False, False, b=40, n=4, d=8, h=16)
    x, w1, w2, soft = (t.clone().requires_grad_() for t in ops[1:5])
    old = torch.get_num_threads()
    torch.set_num_threads(1)  # every product on this thread, where the profiler records it
    try:
        with torch.profiler.profile() as prof:
            torch.ops.scorch.chain(text, [ops[0], x, w1, w2, soft, ops[5]]).sum().backward()
    finally:
        torch.set_num_threads(old)
    names = [e.name for e in prof.events()]
    assert "scorch::chain_backward" in names
    assert "aten::bmm" not in names  # the padded layout's batched products
    assert names.count("aten::einsum") <= 2  # the combine's one product over all rows (forward, recomputation)
    assert names.count("aten::mm") >= 8  # two steps' products per group, forward and recomputation alone


@pytest.mark.parametrize("name", ["moe", "moe16"])
def test_zoo_moe_chain_trains_like_eager(name):
    case = zoo.make(name)
    check_model(case, options={"chains": "always"})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_grouped_path_of_a_region_that_applies_a_relu(monkeypatch, dtype):
    """A region whose dense operand is relu(x) (the op applies the ReLU) and whose rule takes the grouped
    path: the path applies the ReLU itself and runs the product grouped. The grouped runner refused the
    program's ReLU flag (ValueError from scorch::chain on the first call)."""
    monkeypatch.setenv("SCORCH_DISPATCH", "auto")
    monkeypatch.setenv("SCORCH_MEASURE", "0")
    g = torch.Generator().manual_seed(3)
    b, n, d, h = 512, 16, 32, 24
    s = F.one_hot(torch.randint(0, n, (b,), generator=g), n).to(dtype)
    x = torch.randn(b, d, dtype=dtype, generator=g)
    w = torch.randn(n, d, h, dtype=dtype, generator=g)
    text = P((O("pq", "sparse"), O("pd", relu=True), O("qdh")), "pqh", name="grouped_relu").text()
    assert R.choose_path(text, [s, x, w]) == "grouped"
    got = torch.ops.scorch.region(text, [s, x, w])
    torch.testing.assert_close(got, torch.einsum("pq,pd,qdh->pqh", s, torch.relu(x), w))
