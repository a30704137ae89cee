"""Scorch under torch.inference_mode(): tensors made there have no version counter, which the operand checks
and caches read. Eager calls with sparse results (fibers, sampled, assembled), a result used again as an
operand, a buffer written in place (validated again, since no version can show it), torch.sparse inputs and a
compiled model, each against dense torch."""

import pytest
import torch

import scorch_backend as sb


def _csf(seed=0, n=20, nnz=60):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, n, (3, nnz), generator=g)
    return sb.from_coordinates(idx, torch.rand(nnz, generator=g), (n, n, n), "csf")


def test_sparse_results_made_and_reused_in_inference_mode():
    T = _csf()
    U = torch.randn(20, 4)
    V = torch.randn(20, 4)
    A = torch.rand(30, 30) * (torch.rand(30, 30) < 0.2)
    P, Q = torch.randn(30, 8), torch.randn(30, 8)
    with torch.inference_mode():
        Y = sb.einsum("ijk,kr->ijr", T, U)                        # fibers of T
        Z = sb.einsum("ijr,jr->ir", Y, V)                          # the result read again as an operand
        S = sb.sparse(A, "csr")
        D = sb.einsum("ij,ik,jk->ij", S, P, Q)                     # sampled at S
        C = sb.einsum("ij,jk->ik", S, sb.sparse(A.t().contiguous(), "csr"))  # assembled (SpGEMM)
        assert all(v == -1 for v in Y._checked_versions)
    Td = T.to_dense()
    torch.testing.assert_close(Y.to_dense(), torch.einsum("ijk,kr->ijr", Td, U), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(Z, torch.einsum("ijk,kr,jr->ir", Td, U, V), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(D.to_dense(), A * (P @ Q.t()), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(C.to_dense(), A @ A.t(), rtol=1e-4, atol=1e-4)


def test_a_buffer_written_in_inference_mode_is_caught():
    T = _csf(seed=1)
    with torch.inference_mode():
        Y = sb.einsum("ijk,kr->ijr", T, torch.randn(20, 4))
        Y.level_buffers["crd1"][0] = 10**6  # an inference tensor: no version moves
        with pytest.raises(ValueError, match="out of range"):
            sb.einsum("ijr,jr->ir", Y, torch.randn(20, 4))


def test_torch_sparse_inputs_and_a_compiled_model_in_inference_mode():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 16)
    with torch.no_grad():
        lin.weight.mul_(torch.rand_like(lin.weight) < 0.1)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, a, x):
            return self.lin(torch.relu(a @ x))

    model = M()
    compiled = torch.compile(model, backend="scorch")
    with torch.inference_mode():
        a = (torch.rand(32, 32) * (torch.rand(32, 32) < 0.1)).to_sparse_csr()
        x = torch.randn(32, 64)
        for _ in range(2):  # the second call goes through the backend's caches
            torch.testing.assert_close(compiled(a, x), model(a, x), rtol=1e-4, atol=1e-4)


def test_converted_torch_sparse_inputs_in_inference_mode():
    """The backend's cache of converted torch.sparse arguments reads version counters: a tensor made in
    inference mode has none and is converted on every call, not refused."""
    from scorch_backend.tensors import interop

    cache = interop._InputCache()
    dense = torch.rand(16, 16) * (torch.rand(16, 16) < 0.2)
    with torch.inference_mode():
        for layout in ("csr", "coo"):
            x = dense.to_sparse_csr() if layout == "csr" else dense.to_sparse()
            args, _ = interop.convert_inputs((x,), {}, cache)
            torch.testing.assert_close(args[0].to_dense(), dense)


@pytest.mark.parametrize("name", ["pruned_mlp", "relu_mlp_sparse", "moe", "sparse_autoencoder", "gcn"])
def test_compiled_zoo_models_in_inference_mode(name):
    """A compiled model run under inference mode: its activations and inputs are inference tensors, which the
    region op's operand cache cannot track by version (it keeps no entry for them, and validates packed
    operands at every call). Three calls, against the model run eagerly."""
    from scorch_backend.tools import zoo

    case = getattr(zoo, name)("test")
    model = case.model.eval()
    compiled = torch.compile(model, backend="scorch")
    inputs = case.inputs if isinstance(case.inputs, tuple) else (case.inputs,)
    with torch.inference_mode():
        for _ in range(3):
            out = compiled(*inputs)
        ref = model(*inputs)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dispatch", ["auto", "sparse"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_pruned_projection_times_an_input_in_inference_mode(dispatch, dtype, monkeypatch):
    """A pruned linear whose output is multiplied by another input (a gated MLP's up projection): its region
    may run the grouped path, whose products run on OpenMP workers. Those did not inherit the caller's
    InferenceMode, and writing into an inference tensor there raised "Inplace update to inference tensor
    outside InferenceMode" (helper-67: a pruned Llama's up_proj; the zoo's MoE in bfloat16). Three shapes."""
    monkeypatch.setenv("SCORCH_DISPATCH", dispatch)
    torch.manual_seed(0)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.u = torch.nn.Linear(128, 256, bias=False)

        def forward(self, x, y):
            return self.u(x) * y

    model = M().eval().to(dtype)
    sb.prune(model, "magnitude", 0.9)
    compiled = torch.compile(model, backend="scorch")
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    for shape in [(3, 12), (2, 20), (4, 7)]:
        x, y = torch.randn(*shape, 128, dtype=dtype), torch.randn(*shape, 256, dtype=dtype)
        with torch.inference_mode():
            out = compiled(x, y)
            ref = model(x, y)
        torch.testing.assert_close(out, ref, **tol)


@pytest.mark.parametrize("fmt", ["csr", "coo", "csf"])
def test_views_of_a_tensor_made_outside_inference_mode(fmt):
    # A view's result was made an inference tensor, which torch then refused the input's version counter
    # ("Cannot set version_counter for inference tensor"): A.t() and A @ A.t() failed under the mode.
    shape = (6, 5, 4) if fmt == "csf" else (6, 5)
    dense = torch.rand(shape) * (torch.rand(shape) < 0.4)
    A = sb.sparse(dense, fmt)
    with torch.inference_mode():
        views = [A.detach(), A.permute(*reversed(range(A.dim())))]
        if A.dim() == 2:
            views += [A.t(), A.transpose(0, 1), A.T]
            torch.testing.assert_close((A @ A.t()).to_dense(), dense @ dense.t())
    for v in views:
        want = dense if v.shape == dense.shape else dense.permute(*reversed(range(dense.dim())))
        torch.testing.assert_close(v.to_dense(), want)
