"""SparseTensors under PyTorch's everyday module utilities (helper-64): sharing memory, `.data =`, foreach
updates, state dicts that change a parameter's pattern, files in torch's legacy format. Each is checked
against what the same utility does to a dense tensor, or must raise a clear error: never a silent no-op."""

import io
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.utils.prune as prune

import scorch_backend as sb
from scorch_backend.tensors.sparse_tensor import rebuild_sparse_tensor

D = torch.tensor([[1.0, 0.0, 2.0], [0.0, 0.0, 0.0], [3.0, 4.0, 0.0]])


@pytest.fixture(autouse=True)
def quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.mark.parametrize("fmt", ["csr", "coo", "bitmap"])
def test_share_memory_shares_the_buffers_and_values(fmt):
    # torch's own share_memory_ read the wrapper's storage, which it has none of: SIGSEGV. In a child.
    code = f"""
import torch, scorch_backend as sb
A = sb.sparse(torch.tensor({D.tolist()}), "{fmt}")
assert A.share_memory_() is A
assert A.stored_values.is_shared() and all(b.is_shared() for b in A.level_buffers.values())
m = torch.nn.Linear(3, 3, bias=False)
m.weight = torch.nn.Parameter(sb.sparse(torch.tensor({D.tolist()}), "{fmt}"))
m.share_memory()
assert torch.equal(m.weight.to_dense(), torch.tensor({D.tolist()}))
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.split()[-1] == "ok", (proc.returncode, proc.stderr[-2000:])


def test_setting_data_takes_the_new_pattern_and_values():
    W = torch.nn.Parameter(sb.sparse(D, "csr"))
    W.data = sb.sparse(2 * D, "csr")
    assert torch.equal(W.to_dense(), 2 * D)
    W.data = torch.eye(3)  # a dense tensor: stored in W's format, as copy_ does
    assert torch.equal(W.to_dense(), torch.eye(3)) and W.format.name == "csr"
    with pytest.raises(NotImplementedError, match="same shape"):
        W.data = torch.ones(2, 2)
    v = torch.nn.utils.parameters_to_vector([W])
    torch.nn.utils.vector_to_parameters(torch.zeros_like(v), [W])
    assert not W.to_dense().any()


def test_prune_remove_keeps_the_pruned_weight():
    lin = torch.nn.Linear(3, 3, bias=False)
    lin.weight = torch.nn.Parameter(sb.sparse(D, "csr"))
    prune.l1_unstructured(lin, "weight", amount=7)  # (the 5 zeros, then 1 and 2)
    pruned = lin.weight.to_dense().clone()
    prune.remove(lin, "weight")
    assert torch.equal(lin.weight.to_dense(), pruned)
    assert torch.count_nonzero(pruned) < torch.count_nonzero(D)


def test_foreach_updates_raise_instead_of_doing_nothing():
    A = sb.sparse(D, "csr")
    with pytest.raises(NotImplementedError, match="would write into a SparseTensor"):
        torch._foreach_add_([A], [torch.ones(3, 3)])
    dense = torch.ones(2)
    torch._foreach_mul_([A, dense], 3.0)  # (scaling keeps the pattern: done on the stored values)
    assert torch.equal(A.to_dense(), 3 * D) and torch.equal(dense, torch.full((2,), 3.0))
    p = torch.nn.Parameter(sb.sparse(D, "csr"))
    p.grad = sb.sparse(D, "csr")
    with pytest.raises(NotImplementedError):
        torch.optim.SGD([p], lr=0.1, foreach=True).step()
    torch.optim.SGD([p], lr=0.5, foreach=False).step()  # the per-tensor path works
    assert torch.equal(p.to_dense(), D * 0.5)


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("fmt", ["csr", "nm(2,4)", "bitmap"])
def test_gradient_clipping_and_zeroing_act_on_the_stored_values(fmt, foreach):
    # clip_grad_norm_ scales gradients in place, clip_grad_value_ clamps them, zero_grad(set_to_none=False)
    # zeroes them: each raised the generic in-place error on a SparseTensor gradient (helper-64).
    torch.manual_seed(0)
    w = torch.randn(4, 8) * torch.tensor([1.0, 0, 1, 0] * 8).reshape(4, 8)
    x, b = torch.randn(3, 8), torch.randn(4)

    def model(sparse):
        lin = torch.nn.Linear(8, 4)
        with torch.no_grad():
            lin.weight.copy_(w)
            lin.bias.copy_(b)
        if sparse:
            lin.weight = torch.nn.Parameter(sb.sparse(w, fmt))
        (lin(x) ** 2).sum().backward()
        if not sparse:
            lin.weight.grad *= (w != 0)  # the sparse weight's gradient lives on its pattern
        return lin

    for clip in (lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5, foreach=foreach),
                 lambda m: torch.nn.utils.clip_grad_value_(m.parameters(), 0.05, foreach=foreach)):
        dense, sparse = model(False), model(True)
        clip(dense)
        clip(sparse)
        torch.testing.assert_close(sparse.weight.grad.to_dense(), dense.weight.grad)
        torch.testing.assert_close(sparse.bias.grad, dense.bias.grad)
    sparse.zero_grad(set_to_none=False)
    assert not sparse.weight.grad.to_dense().any() and isinstance(sparse.weight.grad, sb.SparseTensor)
    g = sb.sparse(w, fmt)
    with pytest.raises(NotImplementedError, match="would write into a SparseTensor"):
        g.clamp_(min=0.1)  # (the unstored zeros would become 0.1)
    # The unstored zeros would become NaN (0 * inf, a NaN bound): refused, as out of place such a product is
    # dense. Scaling only the stored values was silently wrong (helper-68).
    for bad in (lambda: g.mul_(float("inf")), lambda: g.mul_(torch.tensor(float("nan"))),
                lambda: g.clamp_(min=float("nan")), lambda: torch._foreach_mul_([g], float("-inf"))):
        with pytest.raises(NotImplementedError, match="would write into a SparseTensor"):
            bad()
    torch.testing.assert_close(g.to_dense(), w)  # untouched


@pytest.mark.parametrize("fmt", ["csr", "coo", "bsr(2,2)", "nm(2,4)"])
def test_a_sum_over_an_empty_dimension_list_sums_everything(fmt):
    # torch.sum(x, []) is a full reduction; the rule summed nothing and gave x back (helper-68).
    w = torch.randn(4, 8) * torch.tensor([1.0, 0, 1, 0] * 8).reshape(4, 8)
    A = sb.sparse(w, fmt)
    for got in (A.sum(dim=[]), torch.sum(A, []), A.sum(dim=())):
        torch.testing.assert_close(got, w.sum())


def test_a_state_dict_with_another_pattern_moves_the_gradient_with_it():
    lin = torch.nn.Linear(3, 2, bias=False)
    lin.weight = torch.nn.Parameter(sb.sparse(torch.tensor([[1.0, 0, 0], [0, 0, 0]]), "csr"))
    new = torch.tensor([[0.0, 2, 0], [0, 0, 3]])
    lin.load_state_dict({"weight": sb.sparse(new, "csr")})
    lin(torch.ones(1, 3)).sum().backward()
    assert torch.equal(lin.weight.grad.to_dense(), (new != 0).float())
    torch.optim.SGD(lin.parameters(), lr=1.0).step()
    assert torch.equal(lin.weight.to_dense(), new - (new != 0).float())


@pytest.mark.parametrize("fmt", ["csr", "coo", "nm(2,4)"])
def test_legacy_format_files_load(fmt):
    x = torch.tensor([[1.0, 0, 2, 0], [0, 3, 0, 4]])
    A = sb.sparse(x, fmt)
    buf = io.BytesIO()
    torch.save(A, buf, _use_new_zipfile_serialization=False)
    for weights_only in (True, False):
        B = torch.load(io.BytesIO(buf.getvalue()), weights_only=weights_only)
        assert isinstance(B, sb.SparseTensor) and B.format == A.format
        assert torch.equal(B.to_dense(), x)


def test_a_legacy_file_with_bad_indices_is_refused_at_first_use():
    A = sb.sparse(D, "csr", index_dtype=torch.int64)
    buf = io.BytesIO()
    torch.save(A, buf, _use_new_zipfile_serialization=False)
    raw = bytearray(buf.getvalue())
    crd = A.level_buffers["crd1"].numpy().tobytes()
    at = raw.find(crd)
    assert at > 0
    raw[at + 8: at + 16] = torch.tensor([1000], dtype=torch.int64).numpy().tobytes()
    uses = [lambda B: B + B, lambda B: B @ torch.ones(3), lambda B: B.to_dense(),
            lambda B: B.to_torch(torch.sparse_csr), lambda B: B.sum(), lambda B: sb.einsum("ij,ij->ij", B, B)]
    for use in uses:
        B = torch.load(io.BytesIO(bytes(raw)), weights_only=False)
        with pytest.raises(ValueError, match="out of range"):
            use(B)


class _Tampered:
    """Pickles as a SparseTensor rebuilt from these arguments (a crafted file)."""

    def __init__(self, *args):
        self.args = args

    def __reduce__(self):
        return rebuild_sparse_tensor, self.args


@pytest.mark.parametrize("case", ["negative size", "meta values"])
def test_a_tampered_legacy_file_names_the_problem(case):
    # The legacy loader's unchecked construction raised torch's "numel: integer multiplication overflow" or
    # "Tensor.item() cannot be called on meta tensors".
    A = sb.sparse(D, "csr")
    shape, values = ((-3, 3), A.stored_values) if case == "negative size" else ((3, 3), A.stored_values.to("meta"))
    buf = io.BytesIO()
    torch.save(_Tampered(A.format.canonical, 2, shape, A._buffer_list(), values.detach(), False), buf,
               _use_new_zipfile_serialization=False)
    with pytest.raises(ValueError, match="negative or non-integer size, or data not on the CPU"):
        torch.load(io.BytesIO(buf.getvalue()), weights_only=False)


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("fmt", ["csr", "coo", "csf"])
def test_torch_export_of_a_model_holding_sparse_tensors_raises(strict, fmt):
    # Strict export captured the values as a fake constant: the exported program returned a fake tensor, no
    # error (helper-63). What exports is the model jit.rewrite makes (tests/python/test_deploy*.py).
    W = torch.randn(8, 6) * (torch.rand(8, 6) < 0.3)
    if fmt == "csf":
        W = W.reshape(2, 4, 6)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("W", sb.sparse(W, fmt))

        def forward(self, x):
            return sb.einsum("...j,jk->...k", self.W, x) if fmt == "csf" else self.W @ x

    with pytest.raises(Exception) as raised:
        torch.export.export(M(), (torch.randn(6, 4),), strict=strict)
    if fmt != "csr" and not strict:
        assert "jit.rewrite" in str(raised.value)
