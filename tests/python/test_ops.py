"""The torch ops themselves: opcheck (schema, fake kernels, autograd registration), profiler names, threads."""

import pytest
import torch

import scorch_backend as sb
from conftest import random_dense


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


def test_kernels_show_in_the_profiler(monkeypatch):
    monkeypatch.setenv("SCORCH_DISPATCH", "sparse")  # a tiny product: the default dispatch would run it dense
    S = sb.sparse(random_dense((50, 40), 0.2, torch.float32, 7), "csr")
    D = torch.randn(40, 8)
    sb.einsum("ij,jk->ik", S, D)
    with torch.profiler.profile() as prof:
        sb.einsum("ij,jk->ik", S, D)
    names = [e.name for e in prof.events()]
    assert any(n.startswith("scorch::kernel out(") for n in names), names
