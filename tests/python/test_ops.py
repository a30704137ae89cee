"""The torch ops themselves: opcheck (schema, fake kernels, autograd registration), profiler names, threads."""

import subprocess
import sys

import pytest
import torch

import scorch_backend as sb
from conftest import random_dense

DISPATCH_MODES = ("sparse", "auto")  # every test under the forced kernels and the default dispatch (conftest.py)


def kernel_args(equation, *operands):
    """The (spec, inputs, sizes, threads) a front-end call would pass to torch.ops.scorch.kernel."""
    plan = sb.plan_einsum(equation, *operands)
    inputs = []
    for x in operands:
        if isinstance(x, sb.SparseTensor):
            inputs += list(x.level_buffers.values()) + [x.stored_values]
        else:
            inputs.append(x)
    return plan["spec"], inputs, plan["var_sizes"], 1


CASES = {
    "spmv": lambda: ("ij,j->i", sb.sparse(random_dense((6, 5), 0.4, torch.float64, 1), "csr"), torch.randn(5, dtype=torch.float64)),
    "spmm_coo": lambda: ("ij,jk->ik", sb.sparse(random_dense((6, 5), 0.4, torch.float64, 2), "coo"), torch.randn(5, 3, dtype=torch.float64)),
    "sddmm": lambda: ("ij,ik,jk->ij", sb.sparse(random_dense((6, 5), 0.4, torch.float64, 3), "csr"),
                      torch.randn(6, 2, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)),
    "spgemm": lambda: ("ij,jk->ik", sb.sparse(random_dense((6, 5), 0.4, torch.float64, 4), "csr"),
                       sb.sparse(random_dense((5, 4), 0.4, torch.float64, 5), "csr")),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_opcheck_kernel(name):
    spec, inputs, sizes, threads = kernel_args(*CASES[name]())
    inputs = [t.requires_grad_() if t.is_floating_point() else t for t in inputs]
    # Every check: schema, autograd registration, fake kernel, and AOTAutograd tracing (static and dynamic
    # shapes) of the forward and of the compiler-derived backward.
    torch.library.opcheck(torch.ops.scorch.kernel.default, (spec, inputs, sizes, threads))


def test_opcheck_format_ops():
    x = random_dense((5, 4), 0.5, torch.float32, 6)
    idx = x.nonzero().t().contiguous()
    vals = x[tuple(idx)]
    torch.library.opcheck(torch.ops.scorch.pack.default, (idx, vals, [5, 4], "dense(0),compressed(1)", torch.int32))
    S = sb.sparse(x, "csr")
    bufs = list(S.level_buffers.values())
    torch.library.opcheck(torch.ops.scorch.unpack.default, (bufs, S.stored_values, [5, 4], S.format.canonical))
    torch.library.opcheck(torch.ops.scorch.validate.default, (bufs, S.stored_values, [5, 4], S.format.canonical))
    values = S.stored_values.detach().clone().requires_grad_()  # to_dense is differentiable in the values
    torch.library.opcheck(torch.ops.scorch.to_dense.default, (bufs, values, [5, 4], S.format.canonical))


@pytest.mark.parametrize("fmt", ["csr", "coo", "dcsc", "bsr", "dense"])
def test_to_dense_gradient_is_the_dense_gradient_at_the_stored_values(fmt):
    # to_dense's autograd is C++ (csrc/torch/format_ops.cpp): the values' gradient is the dense gradient
    # gathered at their coordinates, padded zeros of a dense level or a block included.
    x = random_dense((6, 4), 0.4, torch.float64, 11)
    S = sb.sparse(x, fmt, blocksize=(2, 2)) if fmt == "bsr" else sb.sparse(x, fmt)
    bufs = list(S.level_buffers.values())
    values = S.stored_values.detach().clone().requires_grad_()
    to_dense = torch.ops.scorch.to_dense
    assert torch.autograd.gradcheck(lambda v: to_dense(bufs, v, [6, 4], S.format.canonical), (values,))
    W = torch.randn(6, 4, dtype=torch.float64)
    (to_dense(bufs, values, [6, 4], S.format.canonical) * W).sum().backward()
    coords = S.coordinates()
    torch.testing.assert_close(values.grad, W[tuple(coords)])


def test_to_dense_autograd_and_fake_kernel_need_no_python_package():
    # A process with the operator library alone (as a C++ or TorchScript program has it) differentiates
    # to_dense and traces it with fake tensors: both are registered in C++.
    code = f"""
import torch
torch.ops.load_library({sb.ops_library_path()!r})
to_dense = torch.ops.scorch.to_dense
pos, crd = torch.tensor([0, 1, 1, 3], dtype=torch.int32), torch.tensor([2, 0, 1], dtype=torch.int32)
values = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
fmt = "dense(0),compressed(1)"
(to_dense([pos, crd], values, [3, 3], fmt) * torch.arange(9.0).reshape(3, 3)).sum().backward()
assert values.grad.tolist() == [2.0, 6.0, 7.0], values.grad
from torch._subclasses.fake_tensor import FakeTensorMode
plain = values.detach()
m = FakeTensorMode()
fakes = [m.from_tensor(t) for t in (pos, crd, plain)]
with m:
    out = to_dense(fakes[:2], fakes[2], [3, 3], fmt)
assert tuple(out.shape) == (3, 3)
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_to_dense_of_a_zero_dimensional_tensor_has_a_gradient():
    a = sb.sparse(torch.tensor(3.0, dtype=torch.float64), "dense")
    values = a.stored_values.detach().clone().requires_grad_()
    out = torch.ops.scorch.to_dense([], values, [], a.format.canonical)
    assert out.shape == () and out.item() == 3.0
    (5 * out).backward()
    torch.testing.assert_close(values.grad, torch.tensor([5.0], dtype=torch.float64))


def test_kernels_show_in_the_profiler(monkeypatch):
    monkeypatch.setenv("SCORCH_DISPATCH", "sparse")  # a tiny product: the default dispatch would run it dense
    S = sb.sparse(random_dense((50, 40), 0.2, torch.float32, 7), "csr")
    D = torch.randn(40, 8)
    sb.einsum("ij,jk->ik", S, D)
    with torch.profiler.profile() as prof:
        sb.einsum("ij,jk->ik", S, D)
    names = [e.name for e in prof.events()]
    assert any(n.startswith("scorch::kernel out(") for n in names), names
