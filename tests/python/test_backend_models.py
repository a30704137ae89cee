"""Whole models through torch.compile(backend=BACKEND) against eager PyTorch, forward and backward.

The models are the zoo's (scorch_backend/tools/zoo.py) at their small test sizes. BACKEND is "scorch"
unless SCORCH_TEST_BACKEND names another one, which is how these tests are checked against backends known to
be right:

    SCORCH_TEST_BACKEND=inductor .venv/bin/python -m pytest tests/python/test_backend_models.py
    SCORCH_TEST_BACKEND=eager    .venv/bin/python -m pytest tests/python/test_backend_models.py

The last tests make sure check_model itself can fail: backends that are slightly wrong must not pass.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn

from model_check import check_model
from scorch_backend.tools import zoo

BACKEND = os.environ.get("SCORCH_TEST_BACKEND", "scorch")
DISPATCH_MODES = ("sparse", "auto")  # every test under the forced kernels and the default dispatch (conftest.py)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _with_input_grads(inputs: tuple) -> tuple:
    """Floating dense inputs become leaves that require grad, so their gradients are compared too."""
    out = []
    for x in inputs:
        if type(x) is torch.Tensor and x.is_floating_point():
            x = x.detach().clone().requires_grad_(True)
        out.append(x)
    return tuple(out)


@pytest.mark.parametrize("name", zoo.TEST_CASES)
def test_zoo_model(name):
    case = zoo.make(name, "test")
    check_model(case, _with_input_grads(case.inputs), backend=BACKEND)


class TwoPrunedLinears(nn.Module):
    """Pruned Linear, ReLU, a graph break, pruned Linear: the backend sees two graphs."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 128)
        self.b = nn.Linear(128, 32)

    def forward(self, x):
        h = torch.relu(self.a(x))
        torch._dynamo.graph_break()
        return self.b(h)


def test_graph_break_between_pruned_linears():
    from scorch_backend.tools.sparsify import prune

    torch.manual_seed(0)
    model = TwoPrunedLinears()
    prune(model, "magnitude", 0.9)
    assert float((model.a.weight == 0).float().mean()) == pytest.approx(0.9, abs=1e-3)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    counts = []

    def counting(gm, example_inputs):
        counts.append(len(gm.graph.nodes))
        return gm.forward

    # The model really splits in two (checked with a counting backend, cheap), then the backend under test.
    torch.compile(TwoPrunedLinears(), backend=counting)(x)
    assert len(counts) == 2
    check_model(model, (x,), backend=BACKEND)


def test_changing_batch_size():
    case = zoo.make("pruned_mlp", "test")
    extra = [_with_input_grads(case.make_inputs(b)) for b in (3, 17)]
    check_model(case, _with_input_grads(case.make_inputs(8)), backend=BACKEND, extra_inputs=extra)


@pytest.mark.parametrize("name", ["pruned_mlp", "moe"])
def test_inference_under_no_grad(name):
    case = zoo.make(name, "test")
    with torch.no_grad():
        check_model(case, backend=BACKEND, train=False, extra_inputs=[case.make_inputs(5)])


# ------------------------------------------------------------------------------------ check_model can fail


def _off_by_a_bit(gm, example_inputs):
    """A wrong backend: runs the graph, then adds 1e-2 to every floating output."""

    def run(*args):
        outs = gm(*args)

        def bump(t):
            return t + 1e-2 if isinstance(t, torch.Tensor) and t.is_floating_point() else t

        return type(outs)(bump(t) for t in outs) if isinstance(outs, (tuple, list)) else bump(outs)

    return run


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * 1.01


def _wrong_gradient(gm, example_inputs):
    """A wrong backend whose forward is right but whose gradients are 1% too large."""

    def run(*args):
        outs = gm(*args)

        def fix(t):
            return _ScaleGrad.apply(t) if isinstance(t, torch.Tensor) and t.requires_grad else t

        return type(outs)(fix(t) for t in outs) if isinstance(outs, (tuple, list)) else fix(outs)

    return run


@pytest.mark.parametrize("name", ["pruned_mlp", "gcn"])
def test_check_model_fails_for_wrong_outputs(name):
    case = zoo.make(name, "test")
    with pytest.raises(AssertionError, match="max abs difference"):
        check_model(case, backend=_off_by_a_bit)
    with pytest.raises(AssertionError, match="max abs difference"):
        with torch.no_grad():
            check_model(case, backend=_off_by_a_bit, train=False)


def test_check_model_fails_for_wrong_gradients():
    case = zoo.make("pruned_mlp", "test")
    with pytest.raises(AssertionError, match="grad of parameter .*max abs difference"):
        check_model(case, backend=_wrong_gradient)
    # Forward alone is right, so without training the same backend passes.
    check_model(case, backend=_wrong_gradient, train=False)


def test_check_model_fails_when_only_another_batch_is_wrong():
    case = zoo.make("moe", "test")
    first = []

    def wrong_after_first_compile(gm, example_inputs):
        first.append(1)
        return gm.forward if len(first) == 1 else _off_by_a_bit(gm, example_inputs)

    with pytest.raises(AssertionError, match=r"extra_inputs\[0\].*max abs difference"):
        check_model(case, backend=wrong_after_first_compile, train=False, extra_inputs=[case.make_inputs(5)])
