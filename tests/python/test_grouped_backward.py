"""The direct gradient of grouped chains (csrc/torch/grouped_backward.cpp; issue 13): a chain of plain grouped
products gets its gradient as grouped products, without autograd recomputing the chain, only for the operands
that need one. Checked with gradcheck (float64) at the forms it takes -- S with values, a scale and a negation
between steps, the per-group matrix in both orientations, a step reading S's pattern again, gates on the combine
or on a product, empty groups, one token -- and against the autograd route's numbers where the form is not plain."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from scorch_backend.custom_ops import chain as Ch
from scorch_backend.custom_ops import region as R
from scorch_backend.tools import zoo
from model_check import check_model

P, O = R.Program, R.Operand


def _chain(b=21, n=4, d=5, h=6, *, scaled=False, coef=1.0, then2=(), w2_t=False, combine=True, gates_on_product=False,
           experts=None, seed=0):
    """relu(S x W1) [coef, then2] W2, combined with gates (`combine`) or scattered straight back (gates, when
    `gates_on_product`, scaling the second product's rows instead)."""
    g = torch.Generator().manual_seed(seed)
    e = torch.randint(0, n, (b,), generator=g) if experts is None else torch.tensor(experts)
    mask = F.one_hot(e, n).double()
    s = mask * (torch.rand(b, n, dtype=torch.float64, generator=g) + 0.5) if scaled else mask
    x = torch.randn(b, d, dtype=torch.float64, generator=g)
    w1 = torch.randn(n, d, h, dtype=torch.float64, generator=g)
    w2 = torch.randn(n, d, h, dtype=torch.float64, generator=g) if w2_t else torch.randn(n, h, d, dtype=torch.float64,
                                                                                          generator=g)
    gates = torch.rand(b, n, dtype=torch.float64, generator=g)
    step0 = Ch.ChainStep(P((O("pq", "sparse"), O("pd"), O("qdh")), "pqh").text(), (0, 1, 2), ("aten.relu",))
    w2_letters = "bdh" if w2_t else "bhd"
    if gates_on_product:
        step1 = Ch.ChainStep(P((O("abh"), O(w2_letters), O("ab")), "ad", coef=coef).text(), (-1, 3, 4), then2)
        return Ch.ChainProgram((step0, step1), "g").text(), [s, x, w1, w2, gates]
    step1 = Ch.ChainStep(P((O("abh"), O(w2_letters), O("ab", "pattern")), "abd", coef=coef).text(), (-1, 3, 0), then2)
    steps = (step0, step1)
    if not combine:
        return Ch.ChainProgram(steps, "g").text(), [s, x, w1, w2]
    steps += (Ch.ChainStep(P((O("xyz"), O("xy", "sparse"), O("xy")), "xz").text(), (-2, 0, 4)),)
    return Ch.ChainProgram(steps, "g").text(), [s, x, w1, w2, gates]


def _gradcheck(text, ops, which):
    leaves = [t.clone().requires_grad_() if k in which else t for k, t in enumerate(ops)]

    def f(*args):
        it = iter(args)
        return torch.ops.scorch.chain(text, [next(it) if k in which else t for k, t in enumerate(leaves)])

    assert torch.autograd.gradcheck(f, tuple(leaves[k] for k in which))


FORMS = {
    "plain": {},
    "values": {"scaled": True},
    "coef_neg": {"coef": -0.5, "then2": ("aten.neg",)},
    "relu_last": {"then2": ("aten.relu",), "combine": False},
    "w_t": {"w2_t": True},
    "no_combine": {"combine": False},
    "gates_on_product": {"gates_on_product": True},
    "empty_groups": {"experts": [0, 3, 3, 0, 3, 0, 0]},
    "one_token": {"experts": [2]},
}


@pytest.mark.parametrize("form", FORMS)
def test_direct_gradient_matches_numerical(form):
    text, ops = _chain(**FORMS[form])
    _gradcheck(text, ops, tuple(range(1, len(ops))))


def _eager(s, x, w1, w2, gates):
    """The plain chain of _chain() written densely with torch ops."""
    h = torch.relu(torch.einsum("pq,pd,qdh->pqh", s, x, w1))
    y = torch.einsum("pqh,qhd,pq->pqd", h, w2, (s != 0).to(s.dtype))
    return torch.einsum("pqd,pq,pq->pd", y, s, gates)


def test_gradient_of_s_values_at_its_entries():
    """S's gradient is given at S's entries (a zero of S stays out of the chain: its slope there is not asked)."""
    text, ops = _chain(scaled=True)
    s = ops[0].clone().requires_grad_()
    torch.ops.scorch.chain(text, [s, *ops[1:]]).sum().backward()
    ref = ops[0].clone().requires_grad_()
    _eager(ref, *ops[1:]).sum().backward()
    torch.testing.assert_close(s.grad, ref.grad * (ops[0] != 0))


@pytest.mark.parametrize("threads", [1, 2])
def test_direct_gradient_runs_no_autograd_and_skips_unneeded_products(threads):
    """The gradient op calls no einsum (the autograd route recomputes the chain, the combine among it) and runs
    the first step again (one call of the grouped product kernel for every group, or one product per group where
    the kernel is not to be had), then per group dA and dW of the second, dW of the first -- and dA of the first
    only when x needs a gradient; the experts' outputs are not computed again."""
    text, ops = _chain(b=40, n=4, d=8, h=16, experts=[k % 4 for k in range(40)])
    old = torch.get_num_threads()
    torch.set_num_threads(1)  # every product on this thread, where the profiler records it
    try:
        counts = {}
        for x_grad in (False, True):
            leaves = [t.clone().requires_grad_(k in (2, 3, 4) or (x_grad and k == 1)) for k, t in enumerate(ops)]
            y = torch.ops.scorch.chain(text, leaves)
            with torch.profiler.profile() as prof:
                y.sum().backward()
            names = [e.name for e in prof.events()]
            assert "scorch::chain_backward" in names and "aten::einsum" not in names
            kernel = names.count("scorch::grouped_product")
            assert kernel <= 1
            counts[x_grad] = names.count("aten::mm") + 4 * kernel
    finally:
        torch.set_num_threads(old)
    assert counts[False] == 4 * 4 and counts[True] == 5 * 4


def test_needs_input_grad_narrows_the_gradients():
    text, ops = _chain()
    w1 = ops[2].clone().requires_grad_()
    torch.ops.scorch.chain(text, [ops[0], ops[1], w1, ops[3], ops[4]]).sum().backward()
    g = torch.ops.scorch.chain_backward(text, ops, torch.ones(ops[1].shape, dtype=torch.float64), [0, 0, 1, 0, 0])
    assert g[2].shape == ops[2].shape and all(g[k].numel() == 0 for k in (0, 1, 3, 4))
    torch.testing.assert_close(g[2], w1.grad)


def test_not_plain_chain_keeps_the_autograd_route():
    """A gelu between the steps is not of the plain form: the gradient is still right (autograd's)."""
    g = torch.Generator().manual_seed(3)
    b, n, d, h = 12, 3, 4, 5
    mask = F.one_hot(torch.randint(0, n, (b,), generator=g), n).double()
    x = torch.randn(b, d, dtype=torch.float64, generator=g)
    w1 = torch.randn(n, d, h, dtype=torch.float64, generator=g)
    w2 = torch.randn(n, h, d, dtype=torch.float64, generator=g)
    steps = (Ch.ChainStep(P((O("pq", "sparse"), O("pd"), O("qdh")), "pqh").text(), (0, 1, 2), ("aten.gelu",)),
             Ch.ChainStep(P((O("abh"), O("bhd"), O("ab", "pattern")), "ad").text(), (-1, 3, 0)))
    text = Ch.ChainProgram(steps, "g").text()
    _gradcheck(text, [mask, x, w1, w2], (1, 2, 3))


def test_float32_weights_get_float32_gradients():
    text, ops = _chain()
    ops = [t.float() for t in ops]
    w2 = ops[3].clone().requires_grad_()
    torch.ops.scorch.chain(text, [*ops[:3], w2, ops[4]]).sum().backward()
    assert w2.grad.dtype == torch.float32
    ref = ops[3].double().clone().requires_grad_()
    _eager(*[t.double() for t in ops[:3]], ref, ops[4].double()).sum().backward()
    torch.testing.assert_close(w2.grad.double(), ref.grad, rtol=1e-4, atol=1e-5)


def _keep(text: str) -> str:
    return dataclasses.replace(Ch.parse_chain(text), keep=True).text()


def _backward_mm_count(text, ops, wanted):
    """(gradients, matrix products the gradient op ran) for one chain_backward call, on this thread: ATen's, one per
    group, and the grouped product kernel's, a product for every group with rows in one call."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.profiler.profile() as prof:
            g = torch.ops.scorch.chain_backward(text, ops, torch.ones(ops[1].shape, dtype=ops[1].dtype), wanted)
    finally:
        torch.set_num_threads(old)
    names = [e.name for e in prof.events()]
    groups = int((ops[0] != 0).any(0).sum())
    return g, names.count("aten::mm") + groups * names.count("scorch::grouped_product")


def test_keep_chain_gradient_reads_the_forward_results():
    """A training graph's chain ("keep") hands its intermediates to the gradient of the same operands: the first
    step's products are not run again (3 products per group instead of 4). Taken once: a second gradient of the
    same operands, or one of other tensors (a copy), computes them again -- the same numbers every time."""
    text, ops = _chain(b=40, n=4, d=8, h=16, experts=[k % 4 for k in range(40)])
    keep = _keep(text)
    wanted = [0, 0, 1, 1, 1]
    ref, n_ref = _backward_mm_count(text, ops, wanted)
    assert n_ref == 4 * 4
    with torch.no_grad():
        torch.ops.scorch.chain(keep, ops)
    got, n_kept = _backward_mm_count(keep, ops, wanted)
    assert n_kept == 3 * 4
    again, n_again = _backward_mm_count(keep, ops, wanted)
    assert n_again == 4 * 4
    with torch.no_grad():
        torch.ops.scorch.chain(keep, ops)
    copies = [t.clone() for t in ops]
    other, n_other = _backward_mm_count(keep, copies, wanted)
    assert n_other == 4 * 4
    for k in (2, 3, 4):
        for g in (got, again, other):
            torch.testing.assert_close(g[k], ref[k])


def test_keep_chain_not_matched_after_an_in_place_change():
    text, ops = _chain()
    keep = _keep(text)
    ops = [t.clone() for t in ops]
    with torch.no_grad():
        torch.ops.scorch.chain(keep, ops)
        ops[2].mul_(2.0)  # w1 changed in place: the kept results are stale
    got, n = _backward_mm_count(keep, ops, [0, 0, 1, 1, 1])
    ref, _ = _backward_mm_count(text, ops, [0, 0, 1, 1, 1])
    assert n == 4 * len(set(ops[0].argmax(1).tolist()))
    for k in (2, 3, 4):
        torch.testing.assert_close(got[k], ref[k])


@pytest.mark.parametrize("form", FORMS)
def test_keep_chain_gradient_equals_the_recomputed_one(form):
    """Every form the direct gradient takes, with the forward's results kept: the same gradients as without
    them. (A last step ending in a ReLU reads its own output, which the forward does not keep: it was read one
    past the kept results, a crash.)"""
    text, ops = _chain(**FORMS[form])
    keep = _keep(text)
    with torch.no_grad():
        y = torch.ops.scorch.chain(keep, ops)
    wanted = [0] + [1] * (len(ops) - 1)
    got = torch.ops.scorch.chain_backward(keep, ops, torch.ones_like(y), wanted)
    ref = torch.ops.scorch.chain_backward(text, ops, torch.ones_like(y), wanted)
    for k in range(1, len(ops)):
        torch.testing.assert_close(got[k], ref[k])


def test_keep_chain_whose_last_step_passes_rows_on():
    """A last step that only passes the step before's rows on (a pattern read again, then negated): einsum gives
    a view of those rows, and the forward's in-place negation changed the kept result of the step before, so the
    gradient's ReLU mask came from the negated rows (gradients off by up to 6.5). The step's result is a copy."""
    text, ops = _chain(n=3)
    step0 = Ch.parse_chain(text).steps[0]
    step1 = Ch.ChainStep(P((O("abh"), O("ab", "pattern")), "ah").text(), (-1, 0), ("aten.neg",))
    chain = Ch.ChainProgram((step0, step1), "g").text()
    ops = ops[:3]
    with torch.no_grad():
        y = torch.ops.scorch.chain(_keep(chain), ops)
    g = torch.randn(y.shape, dtype=y.dtype, generator=torch.Generator().manual_seed(1))
    got = torch.ops.scorch.chain_backward(_keep(chain), ops, g, [0, 1, 1])
    ref = torch.ops.scorch.chain_backward(chain, ops, g, [0, 1, 1])
    for k in (1, 2):
        torch.testing.assert_close(got[k], ref[k])
    _gradcheck(chain, ops, (1, 2))


def test_grouped_chain_refuses_a_relu_flagged_operand():
    """The grouped runner reads its operands as they are; a step whose program applies a ReLU to an operand
    (the inference fold's flag) would have computed without it. Such a chain is refused, naming the step."""
    text, ops = _chain()
    c = Ch.parse_chain(text)
    prog = R.parse_program(c.steps[0].program)
    flagged = dataclasses.replace(prog, operands=(prog.operands[0], dataclasses.replace(prog.operands[1], relu=True),
                                                  prog.operands[2]))
    steps = (dataclasses.replace(c.steps[0], program=flagged.text()),) + tuple(c.steps[1:])
    bad = dataclasses.replace(c, steps=steps).text()
    with pytest.raises((RuntimeError, ValueError), match="applies a ReLU"):
        torch.ops.scorch.chain(bad, ops)


def test_keep_chain_model_trains_like_eager():
    """The zoo's MoE compiled for training takes a keep chain by default; its gradients match eager's."""
    case = zoo.make("moe")
    check_model(case)
