"""A region product of two compressed operands, one much denser than the other (a ReLU output at half zeros
times a 90%-pruned weight), reads the denser one dense (csrc/torch/region.cpp: demoted_variant): same values,
the layout the op's Meta kernel promised, gradients unchanged; operands of similar density stay compressed."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import random_dense
from scorch_backend import _C


def _program(name, kinds=("sparse", "sparse")):
    return json.dumps({"operands": [["ac", kinds[0], False, True, 0, False], ["bc", kinds[1], True, True, 0, True]],
                       "out": "ab", "coef": 1.0, "frozen": False, "name": name, "label": "demote test"})


@pytest.mark.parametrize("dispatch", ["sparse", "auto"])
@pytest.mark.parametrize("shape", [(64, 512, 512), (1, 7, 5), (33, 65, 17)])
def test_denser_operand_is_read_dense(monkeypatch, dispatch, shape):
    monkeypatch.setenv("SCORCH_DISPATCH", dispatch)
    m, k, n = shape
    x = torch.relu(torch.randn(m, k, generator=torch.Generator().manual_seed(1)))  # about half zeros
    w = random_dense((n, k), 0.1, seed=2)
    x.requires_grad_(True)
    w.requires_grad_(True)
    text = _program(f"demote{m}x{k}x{n}{dispatch}")
    before = _C.region_stats()["demoted"]
    out = torch.ops.scorch.region(text, [x, w])
    ref = x.detach() @ w.detach().t()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    fake = torch.empty_strided(out.shape, out.stride())
    assert out.stride() == fake.stride()
    if dispatch == "sparse":
        assert _C.region_stats()["demoted"] > before
    g = torch.randn_like(out)
    gx, gw = torch.autograd.grad(out, [x, w], g)
    torch.testing.assert_close(gx, g @ w.detach(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gw, g.t() @ x.detach(), rtol=1e-4, atol=1e-4)


def test_meta_layout_matches(monkeypatch):
    """The result's strides are those of the program's own storage order, whichever variant ran."""
    monkeypatch.setenv("SCORCH_DISPATCH", "sparse")
    x = torch.relu(torch.randn(64, 96, generator=torch.Generator().manual_seed(3)))
    w = random_dense((80, 96), 0.05, seed=4)
    text = _program("demote_meta")
    out = torch.ops.scorch.region(text, [x, w])
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fx, fw = mode.from_tensor(x), mode.from_tensor(w)
        fake = torch.ops.scorch.region(text, [fx, fw])
    assert out.stride() == fake.stride()


@pytest.mark.parametrize("dispatch", ["sparse", "auto"])
def test_two_dense_enough_operands_read_the_denser_dense(monkeypatch, dispatch):
    # A 60%-pruned MLP's second layer: activation about 0.5, weight 0.4. Co-iterated, the kernel ran 90x slower
    # than dense and measuring it took seconds (helper-43 F8); the activation is read dense, the weight stays.
    monkeypatch.setenv("SCORCH_DISPATCH", dispatch)
    x = torch.relu(torch.randn(48, 96, generator=torch.Generator().manual_seed(7))).requires_grad_(True)
    w = random_dense((40, 96), 0.4, seed=8).requires_grad_(True)
    before = _C.region_stats()["demoted"]
    out = torch.ops.scorch.region(_program(f"demote_both_dense_{dispatch}"), [x, w])
    torch.testing.assert_close(out, x.detach() @ w.detach().t(), rtol=1e-4, atol=1e-4)
    if dispatch == "sparse":
        assert _C.region_stats()["demoted"] == before + 1
    g = torch.randn_like(out)
    gx, gw = torch.autograd.grad(out, [x, w], g)
    torch.testing.assert_close(gx, g @ w.detach(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gw, g.t() @ x.detach(), rtol=1e-4, atol=1e-4)


def test_similar_sparse_densities_stay_compressed(monkeypatch):
    monkeypatch.setenv("SCORCH_DISPATCH", "sparse")
    x = random_dense((40, 50), 0.1, seed=5)
    w = random_dense((30, 50), 0.1, seed=6)
    before = _C.region_stats()["demoted"]
    out = torch.ops.scorch.region(_program("demote_similar"), [x, w])
    torch.testing.assert_close(out, x @ w.t(), rtol=1e-4, atol=1e-4)
    assert _C.region_stats()["demoted"] == before


def test_pattern_and_dense_kinds_never_demoted(monkeypatch):
    """A pattern factor is 0/1, not its values: reading it dense would change the result."""
    monkeypatch.setenv("SCORCH_DISPATCH", "sparse")
    x = torch.relu(torch.randn(20, 30, generator=torch.Generator().manual_seed(7)))
    w = random_dense((25, 30), 0.1, seed=8)
    before = _C.region_stats()["demoted"]
    out = torch.ops.scorch.region(_program("demote_pattern", ("pattern", "sparse")), [x, w])
    torch.testing.assert_close(out, (x != 0).float() @ w.t(), rtol=1e-4, atol=1e-4)
    assert _C.region_stats()["demoted"] == before


def _row_major_copies(fn) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name == "scorch::row_major")


@pytest.mark.parametrize("dispatch", ["sparse", "auto"])
def test_column_major_operand_read_dense_is_not_copied(monkeypatch, dispatch):
    """A transposed activation (a region's output in its storage order) that ends up read dense: its density is
    counted on the transpose, with no row-major copy of it; values and gradients as eager's."""
    monkeypatch.setenv("SCORCH_DISPATCH", dispatch)
    x = torch.relu(torch.randn(96, 64, generator=torch.Generator().manual_seed(9))).t()  # (64, 96), by columns
    w = random_dense((80, 96), 0.05, seed=10)
    assert not x.is_contiguous() and x.t().is_contiguous()
    x.requires_grad_(True)
    w.requires_grad_(True)
    text = _program(f"demote_colmajor_{dispatch}")
    out = torch.ops.scorch.region(text, [x, w])  # (compiles; measures in auto)
    out = None
    xc = x.detach().contiguous()
    torch.ops.scorch.region(text, [xc, w.detach()])
    # as many copies as with the same operand stored by rows (the result's own turn to the promised strides)
    copies = _row_major_copies(lambda: torch.ops.scorch.region(text, [x.detach(), w.detach()]))
    assert copies == _row_major_copies(lambda: torch.ops.scorch.region(text, [xc, w.detach()]))
    out = torch.ops.scorch.region(text, [x, w])
    torch.testing.assert_close(out, x.detach() @ w.detach().t(), rtol=1e-4, atol=1e-4)
    g = torch.randn_like(out)
    gx, gw = torch.autograd.grad(out, [x, w], g)
    torch.testing.assert_close(gx, g @ w.detach(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gw, g.t() @ x.detach(), rtol=1e-4, atol=1e-4)


def test_column_major_operand_compressed_by_rows(monkeypatch):
    """The same transposed operand at the weight's density stays compressed: its rows are copied when the
    kernel needs them, and the result is right (row counts not taken from the transpose)."""
    monkeypatch.setenv("SCORCH_DISPATCH", "sparse")
    x = random_dense((50, 40), 0.1, seed=11).t()  # (40, 50), by columns
    w = random_dense((30, 50), 0.1, seed=12)
    before = _C.region_stats()["demoted"]
    text = _program("colmajor_rows")
    out = torch.ops.scorch.region(text, [x, w])
    torch.testing.assert_close(out, x @ w.t(), rtol=1e-4, atol=1e-4)
    assert _C.region_stats()["demoted"] == before
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = torch.ops.scorch.region(text, [mode.from_tensor(x), mode.from_tensor(w)])
    assert out.stride() == fake.stride()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("batch", [(3, 7), (2, 32), (8, 16)])
def test_pruned_ffn_on_3d_input_compiled(dtype, batch):
    """A transformer FFN with pruned weights on (batch, sequence, features), without gradients: its second
    product reads a ReLU output (half zeros) against a pruned weight, and the activation is demoted to dense.
    The default dispatch took the grouped path there, whose runner refused the program's ReLU flag (ValueError
    from scorch::chain on the first call; the path now applies the ReLU first, test_grouped_matmul.py), and
    grouping a linear by output feature runs one matrix-vector product per feature (60x slower than the
    kernel): such a product is not grouped any more."""
    import scorch_backend  # noqa: F401  (registers the backend)

    torch.manual_seed(0)
    d, h = 512, 1024

    class FFN(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(d, h), torch.nn.Linear(h, d)
            with torch.no_grad():
                for lin in (self.fc1, self.fc2):
                    lin.weight.mul_((torch.rand_like(lin.weight) < 0.1).to(lin.weight.dtype))

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))

    model = FFN().to(dtype).eval()
    x = torch.randn(*batch, d, dtype=dtype)
    torch._dynamo.reset()
    grouped = _C.region_stats()["grouped_runs"]
    with torch.no_grad():
        ref = model(x)
        got = torch.compile(model, backend="scorch")(x)
        again = torch.compile(model, backend="scorch")(x)
    assert _C.region_stats()["grouped_runs"] == grouped
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    torch.testing.assert_close(again, ref, rtol=tol, atol=tol)
