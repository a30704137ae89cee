"""einsum broadcasts as torch.einsum does: a dense operand's dimension of size 1 stretches to its index's size
elsewhere, and "..." covering fewer dimensions in one operand gains leading ones. Sparse operands do not
broadcast: asking them to is a ValueError that names the operand."""
import pytest
import torch

import scorch_backend as sb

DISPATCH_MODES = ("sparse", "auto")  # the kernels and the default dispatch (conftest.py)


def _pruned(*shape, density=0.4, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    d = torch.rand(*shape, generator=g, dtype=dtype)
    return d * (torch.rand(*shape, generator=g, dtype=dtype) < density)


def _dense(x):
    return x.to_dense() if isinstance(x, sb.SparseTensor) else x


CASES = [
    # (equation, sparse operand's shape and format, dense operand's shape)
    ("ij,j->i", (6, 5), "csr", (1,)),
    ("ij,ij->ij", (6, 5), "csr", (1, 5)),
    ("ij,ij->ij", (6, 5), "csr", (6, 1)),
    ("ij,ij->ij", (6, 5), "csr", (1, 1)),
    ("ij,jk->ik", (6, 5), "csr", (1, 3)),
    ("ij,kj->ikj", (6, 5), "csc", (3, 1)),
    ("...j,...j->...", (6, 5), "csr", (5,)),
    ("...j,...j->...", (6, 5), "csr", (1, 5)),
    ("ij,...ij->...ij", (6, 5), "coo", (2, 1, 5)),
    ("bij,bj->bi", (3, 6, 5), "csf", (1, 5)),
    ("ij,j->i", (7, 1), "csr", (1,)),
    ("ij,j->i", (0, 5), "csr", (1,)),
]


@pytest.mark.parametrize("equation,shape,fmt,other", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_dense_operand_broadcasts_as_in_torch_einsum(equation, shape, fmt, other, dtype):
    d = _pruned(*shape, dtype=dtype)
    x = torch.rand(*other, dtype=dtype)
    want = torch.einsum(equation, d, x)
    got = sb.einsum(equation, sb.sparse(d, fmt), x)
    assert got.shape == want.shape
    torch.testing.assert_close(_dense(got), want)
    # The dense operand first, and with a dense result asked for (the Python path resolves out_format).
    got = sb.einsum(",".join(reversed(equation.split("->")[0].split(","))) + "->" + equation.split("->")[1],
                    x, sb.sparse(d, fmt), out_format="dense")
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("density", [0.0, 0.05, 1.0])
def test_the_broadcast_operand_gets_the_summed_gradient(density):
    d = _pruned(8, 6, density=density)
    b = torch.rand(1, 6, requires_grad=True)
    v = torch.rand(6, requires_grad=True)
    A = sb.sparse(d, "csr").requires_grad_()
    (sb.einsum("ij,ij,j->i", A, b, v) ** 2).sum().backward()
    b2 = b.detach().clone().requires_grad_()
    v2 = v.detach().clone().requires_grad_()
    d2 = d.clone().requires_grad_()
    (torch.einsum("ij,ij,j->i", d2, b2, v2) ** 2).sum().backward()
    torch.testing.assert_close(b.grad, b2.grad)
    torch.testing.assert_close(v.grad, v2.grad)
    stored = A.coordinates()
    torch.testing.assert_close(A.grad.to_dense()[tuple(stored)], d2.grad[tuple(stored)])


def test_a_sparse_operand_is_not_broadcast():
    A = sb.sparse(_pruned(1, 5), "csr")
    with pytest.raises(ValueError, match=r"operand 0 is sparse and would have to broadcast from shape \[1, 5\] to \[6, 5\]"):
        sb.einsum("ij,ij->ij", A, torch.rand(6, 5))
    with pytest.raises(ValueError, match="operand 1 is sparse"):
        sb.einsum("bij,ij->bij", torch.rand(2, 6, 5), A)


def test_sizes_that_do_not_broadcast_still_name_the_index():
    A = sb.sparse(_pruned(6, 5), "csr")
    with pytest.raises(ValueError, match="index 'j' has size 4 here but 5 elsewhere"):
        sb.einsum("ij,j->i", A, torch.rand(4))
    with pytest.raises(ValueError, match=r"dimension 0 of '\.\.\.' has size 3 here but 6 elsewhere"):
        sb.einsum("...j,...j->...", A, torch.rand(3, 5))


def test_broadcasting_under_torch_compile():
    A = sb.sparse(_pruned(6, 5), "csr")

    def f(x):
        return sb.einsum("ij,ij->i", A, x)

    x = torch.rand(1, 5)
    torch.testing.assert_close(torch.compile(f, backend="scorch", fullgraph=False)(x),
                               torch.einsum("ij,ij->i", A.to_dense(), x))
