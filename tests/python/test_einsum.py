"""Named kernels of the compiler against torch on dense copies, plus front-end errors and the JIT cache."""

import os
import subprocess
import sys

import pytest
import torch

import scorch_backend as sb
from conftest import random_dense
from reference import evaluate

DISPATCH_MODES = ("sparse", "auto")  # every test under the forced kernels and the default dispatch (conftest.py)


def dense(x):
    return x.to_dense() if isinstance(x, sb.SparseTensor) else x


def check(out, ref, *, sparse=None, fmt=None, rtol=1e-5, atol=1e-5):
    if sparse is not None:
        assert isinstance(out, sb.SparseTensor) == sparse, type(out)
    if fmt is not None:
        assert str(out.format) == fmt
    torch.testing.assert_close(dense(out), ref.to(dense(out).dtype), rtol=rtol, atol=atol)


A = random_dense((37, 29), 0.1, dtype=torch.float64, seed=1)
B = random_dense((29, 23), 0.2, dtype=torch.float64, seed=2)
x = torch.randn(29, dtype=torch.float64)


@pytest.mark.parametrize("fmt", ["csr", "csc", "coo", "dcsr", "dcsc", "dense", "bsr(1,1)"])
def test_spmv(fmt):
    check(sb.einsum("ij,j->i", sb.sparse(A, fmt), x), A @ x, sparse=False)


@pytest.mark.parametrize("fmt", ["csr", "csc", "coo"])
def test_spmm(fmt):
    Bd = torch.randn(29, 16, dtype=torch.float64)
    check(sb.einsum("ij,jk->ik", sb.sparse(A, fmt), Bd), A @ Bd, sparse=False)


def test_dense_times_csr():
    D = torch.randn(11, 37, dtype=torch.float64)
    check(sb.einsum("ij,jk->ik", D, sb.sparse(A, "csr")), D @ A, sparse=False)


def test_sddmm_keeps_the_sampling_pattern():
    S = sb.sparse(random_dense((37, 23), 0.1, dtype=torch.float64, seed=5), "csr")
    P = torch.randn(37, 8, dtype=torch.float64)
    Q = torch.randn(8, 23, dtype=torch.float64)
    out = sb.einsum("ij,ik,kj->ij", S, P, Q)
    check(out, S.to_dense() * (P @ Q), sparse=True, fmt="csr")
    assert torch.equal(out.level_buffers["crd1"], S.level_buffers["crd1"])


@pytest.mark.parametrize("fa,fb", [("csr", "csr"), ("csr", "csc"), ("csc", "csc"), ("coo", "dcsr")])
def test_spgemm(fa, fb):
    out = sb.einsum("ij,jk->ik", sb.sparse(A, fa), sb.sparse(B, fb))
    check(out, A @ B, sparse=True)
    assert out.nnz <= 37 * 23


@pytest.mark.parametrize("fa,fb", [("csr", "csr"), ("csr", "coo"), ("dcsr", "csc"), ("csf", "dense")])
def test_spadd_and_sub(fa, fb):
    A2 = random_dense((37, 29), 0.15, dtype=torch.float64, seed=9)
    out = sb.compute("C(i,j) = A(i,j) + B(i,j)", A=sb.sparse(A, fa), B=sb.sparse(A2, fb))
    check(out, A + A2, sparse=fb != "dense")
    out = sb.compute("C(i,j) = A(i,j) - 2 * B(i,j)", A=sb.sparse(A, fa), B=sb.sparse(A2, fb))
    check(out, A - 2 * A2)


def test_sparse_times_sparse_and_dense_elementwise():
    A2 = random_dense((37, 29), 0.5, dtype=torch.float64, seed=3)
    # A2 has more nonzeros, so A is the one converted (to CSC), and the output follows the loop order.
    check(sb.einsum("ij,ij->ij", sb.sparse(A, "csr"), sb.sparse(A2, "csc")), A * A2, sparse=True, fmt="csc")
    check(sb.einsum("ij,ij->ij", sb.sparse(A, "coo"), A2), A * A2, sparse=True, fmt="coo")
    check(sb.compute("C(i,j) = A(i,j) + D(i,j)", A=sb.sparse(A, "csr"), D=A2), A + A2, sparse=False)


T = random_dense((7, 6, 5), 0.2, dtype=torch.float64, seed=4)


@pytest.mark.parametrize("fmt", ["csf", "coo"])
def test_ttv_ttm_mttkrp(fmt):
    S = sb.sparse(T, fmt)
    c = torch.randn(5, dtype=torch.float64)
    C = torch.randn(4, 5, dtype=torch.float64)
    check(sb.einsum("ijk,k->ij", S, c), torch.einsum("ijk,k->ij", T, c), sparse=False)
    check(sb.einsum("ijl,kl->ijk", S, C), torch.einsum("ijl,kl->ijk", T, C), sparse=False)
    Bm = torch.randn(6, 3, dtype=torch.float64)
    Cm = torch.randn(5, 3, dtype=torch.float64)
    check(sb.einsum("ikl,kj,lj->ij", S, Bm, Cm), torch.einsum("ikl,kj,lj->ij", T, Bm, Cm), sparse=False)


# The register tile of output columns sits above every reduction loop over T's fibers (k, then l), so each
# output row's tile is written once: widths that take full tiles, each remainder pass and the scalar rest on
# any target; a dense first level (rows written by store, no zero-fill) and a compressed one (added); a row of
# T with no entries, and a fiber (i, k) with none under it.
@pytest.mark.parametrize("fmt", ["csf", "dense(0),compressed(1),compressed(2)", "dense(0),dense(1),compressed(2)"])
@pytest.mark.parametrize("width", [1, 7, 16, 33, 100, 131])
def test_mttkrp_tile_over_two_reductions(fmt, width):
    Td = random_dense((9, 8, 7), 0.25, dtype=torch.float32, seed=width)
    Td[3] = 0
    Td[5, 2] = 0
    g = torch.Generator().manual_seed(width)
    Bm = torch.randn(8, width, generator=g)
    Cm = torch.randn(7, width, generator=g)
    out = sb.einsum("ikl,kj,lj->ij", sb.sparse(Td, fmt), Bm, Cm)
    check(out, torch.einsum("ikl,kj,lj->ij", Td, Bm, Cm), sparse=False, rtol=1e-4, atol=1e-4)
    assert not dense(out)[3].any()


# A union of sparse terms inside a register tile: after the merge, each term's leftover loop decides on its
# own prefetches, with a flag of its own (two flags of one name in one scope failed to compile).
@pytest.mark.parametrize("width", [5, 64, 200])
def test_union_of_sparse_terms_times_dense(width):
    g = torch.Generator().manual_seed(width)
    T1 = random_dense((64, 48), 0.1, dtype=torch.float32, seed=11)
    T2 = random_dense((64, 48), 0.1, dtype=torch.float32, seed=12)
    Bm = torch.randn(48, width, generator=g)
    out = sb.compute("C(i,j) = (A(i,k) + A2(i,k)) * B(k,j)", A=sb.sparse(T1, "csr"), A2=sb.sparse(T2, "csr"), B=Bm)
    check(out, (T1 + T2) @ Bm, sparse=False, rtol=1e-4, atol=1e-4)
    out = sb.compute("C(i,j) = A(i,k) * B(k,j) - A2(i,k) * B(k,j)", A=sb.sparse(T1, "csr"), A2=sb.sparse(T2, "csr"),
                     B=Bm)
    check(out, (T1 - T2) @ Bm, sparse=False, rtol=1e-4, atol=1e-4)
    U1 = random_dense((9, 8, 7), 0.3, dtype=torch.float32, seed=13)
    U2 = random_dense((9, 8, 7), 0.3, dtype=torch.float32, seed=14)
    Bk = torch.randn(8, width, generator=g)
    Cl = torch.randn(7, width, generator=g)
    out = sb.compute("M(i,j) = A(i,k,l) * B(k,j) * D(l,j) + A2(i,k,l) * B(k,j) * D(l,j)",
                     A=sb.sparse(U1, "csf"), A2=sb.sparse(U2, "csf"), B=Bk, D=Cl)
    check(out, torch.einsum("ikl,kj,lj->ij", U1 + U2, Bk, Cl), sparse=False, rtol=1e-4, atol=1e-4)


def test_einsum_with_an_empty_operand_list_names_the_problem():
    for call in (lambda: sb.einsum("ij->", []), lambda: sb.einsum("->", ()), lambda: sb.einsum("ij->")):
        with pytest.raises(ValueError, match="einsum needs at least one operand"):
            call()


# A unique level under a non-unique one with levels below (COO rows over a compressed or dense level): one
# position per distinct (i, k), the entries below grouped under it. Stored once per entry, products of two
# such operands missed each other's entries (all zeros where 4 was due).
@pytest.mark.parametrize("fmt", ["compressed[nonunique](0),singleton(1),compressed(2)",
                                 "compressed[nonunique](0),singleton(1),dense(2)",
                                 "compressed[nonunique](0),dense(1),compressed(2)",
                                 "compressed[nonunique](0),dense(1),dense(2)",
                                 "compressed[nonunique](0),compressed(1),compressed(2)"])
def test_unique_level_under_nonunique_prefix(fmt):
    A = torch.zeros(1, 1, 2)
    A[0, 0, 0], A[0, 0, 1] = 1, 2
    B = torch.zeros(1, 1, 2)
    B[0, 0, 1] = 2
    check(sb.einsum("ikl,ikl->ikl", sb.sparse(A, fmt), sb.sparse(B, fmt)), A * B)
    T1 = random_dense((6, 5, 7), 0.3, dtype=torch.float32, seed=21)
    T2 = random_dense((6, 5, 7), 0.3, dtype=torch.float32, seed=22)
    S1, S2 = sb.sparse(T1, fmt), sb.sparse(T2, fmt)
    # one position per distinct prefix: (i, k) under a singleton, i under a dense or compressed level
    groups = (T1 != 0).any(2).sum() if "singleton" in fmt else (T1 != 0).flatten(1).any(1).sum()
    assert S1.level_buffers["crd0"].numel() == int(groups)
    check(S1, T1)
    check(sb.einsum("ikl,ikl->ikl", S1, S2), T1 * T2)
    Bm, Cm = torch.randn(5, 9), torch.randn(7, 9)
    check(sb.einsum("ikl,kj,lj->ij", S1, Bm, Cm), torch.einsum("ikl,kj,lj->ij", T1, Bm, Cm), rtol=1e-4, atol=1e-4)


# A summed index no sparse operand holds (l in ik,kl,lj->ij with A sparse) is contracted first among the dense
# factors (dense ATen), then the product runs led by the sparse operand: as one loop nest it walked l for
# every stored entry. Same values and gradients; MTTKRP, whose summed indices are all the tensor's, stays one
# kernel.
def test_dense_factors_are_contracted_first():
    from scorch_backend import _C
    A = random_dense((50, 40), 0.05, dtype=torch.float64, seed=31)
    g = torch.Generator().manual_seed(31)
    B = torch.randn(40, 30, dtype=torch.float64, generator=g, requires_grad=True)
    C = torch.randn(30, 200, dtype=torch.float64, generator=g, requires_grad=True)
    S = sb.sparse(A, "csr")
    v = S.stored_values.detach().clone().requires_grad_()
    out = sb.einsum("ik,kl,lj->ij", S.with_values(v), B, C)
    check(out, A @ B.detach() @ C.detach(), sparse=False)
    out.sum().backward()
    Bd, Cd = B.detach().clone().requires_grad_(), C.detach().clone().requires_grad_()
    Ad = A.clone().requires_grad_()
    (Ad @ Bd @ Cd).sum().backward()
    torch.testing.assert_close(B.grad, Bd.grad)
    torch.testing.assert_close(C.grad, Cd.grad)
    torch.testing.assert_close(S.with_values(v.grad).to_dense(), Ad.grad * (A != 0))
    why = _C.einsum("ik,kl,lj->ij", (S, B.detach(), C.detach()), "", 1, True, True)[1]
    assert "dense factors contracted first (kl,lj->" in why, why
    # four factors, two summed indices outside the sparse one; a bfloat16 result stays bfloat16
    D = torch.randn(200, 7, dtype=torch.float64, generator=g)
    check(sb.einsum("ik,kl,lj,jm->im", S, B.detach(), C.detach(), D), A @ B.detach() @ C.detach() @ D, sparse=False)
    # float16: the dense factors' product (2e6 here) is kept in float32, only the result is float16
    Ah = torch.zeros(40, 30)
    Ah[:, :10] = 1e-3
    Bh, Ch = torch.full((30, 20), 100.0), torch.full((20, 30), 100.0)
    got = sb.einsum("ik,kl,lj->ij", sb.sparse(Ah.half(), "csr"), Bh.half(), Ch.half())
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), Ah.half().float() @ Bh @ Ch, rtol=2e-3, atol=1.0)
    Sb = sb.sparse(A.to(torch.bfloat16), "csr")
    got = sb.einsum("ik,kl,lj->ij", Sb, B.detach().bfloat16(), C.detach().bfloat16())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), (A @ B.detach() @ C.detach()).float(), rtol=5e-2, atol=5e-1)
    T = sb.sparse(random_dense((6, 5, 7), 0.3, dtype=torch.float64, seed=32), "csf")
    why = _C.einsum("ikl,kj,lj->ij", (T, torch.randn(5, 9, dtype=torch.float64), torch.randn(7, 9, dtype=torch.float64)),
                    "", 1, True, True)[1]
    assert "contracted first" not in why, why


def test_batched_sparse_attention():
    mask = random_dense((2, 3, 9, 9), 0.3, dtype=torch.float32, seed=6)
    S = sb.sparse(mask, "csr")  # dense batch, head and row levels, compressed columns
    V = torch.randn(2, 3, 9, 4)
    check(sb.einsum("bhij,bhjd->bhid", S, V), torch.einsum("bhij,bhjd->bhid", mask, V), sparse=False)


def test_reductions():
    S = sb.sparse(A, "csr")
    check(sb.einsum("ij->", S), A.sum(), sparse=False)
    check(sb.einsum("ij->i", S), A.sum(1), sparse=False)
    check(sb.einsum("ij->j", S), A.sum(0), sparse=False)
    check(sb.einsum("ij->ji", S), A.t(), sparse=True)
    check(sb.compute("s = A(i,j) * A(i,j)", A=S), (A * A).sum())


@pytest.mark.parametrize("dispatch", ["sparse", "auto"])
@pytest.mark.parametrize("fmt,shape", [("csr", (2048, 2048)), ("coo", (2048, 2048)), ("csf", (64, 64, 512))])
def test_full_reduction_of_many_float32_values_is_accurate(monkeypatch, dispatch, fmt, shape):
    # Two million float32 values summed one after another into one float were off by 13 (relative 1e-5;
    # 8192^2 at 50%: 155 against torch's 1.5, helper-43 F14); each row's sum is now added to the total.
    monkeypatch.setenv("SCORCH_DISPATCH", dispatch)
    g = torch.Generator().manual_seed(3)
    dense = (torch.randn(shape, generator=g) + 0.5) * (torch.rand(shape, generator=g) < 0.5)
    S = sb.sparse(dense, fmt)
    letters = "ijk"[: len(shape)]
    got = sb.einsum(f"{letters}->", S)
    exact = dense.double().sum()
    assert got.dtype == torch.float32
    assert abs(got.double() - exact) <= 1e-6 * dense.double().abs().sum(), (got.item(), exact.item())


@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (1, 1)])
def test_empty_operands(shape):
    Z = torch.zeros(shape, dtype=torch.float64)
    for fmt in ["csr", "coo", "csc"]:
        S = sb.sparse(Z, fmt)
        y = torch.randn(shape[1], 3, dtype=torch.float64)
        check(sb.einsum("ij,jk->ik", S, y), Z @ y)
        check(sb.einsum("ij,ij->ij", S, S), Z * Z)
        check(sb.einsum("ij->", S), Z.sum())
    all_zero = sb.sparse(torch.zeros(4, 4), "csr")
    out = sb.einsum("ij,jk->ik", all_zero, all_zero)
    assert out.nnz == 0


def test_implicit_output_ellipsis_and_constants():
    S = sb.sparse(A, "csr")
    check(sb.einsum("ij,j", S, x), A @ x)
    X = random_dense((2, 37, 29), 0.2, dtype=torch.float64, seed=8)
    Y = torch.randn(2, 29, 3, dtype=torch.float64)
    check(sb.einsum("...ij,...jk->...ik", sb.sparse(X, "csr"), Y), X @ Y)
    b = torch.randn(37, dtype=torch.float64)
    check(sb.compute("y(i) = A(i,j) * x(j) + 2 * b(i)", A=S, x=x, b=b), evaluate(
        "y(i) = A(i,j) * x(j) + 2 * b(i)", {"A": A, "x": x, "b": b}))
    check(sb.compute("y(i) = -(A(i,j) - 0.5) * x(j) * s", A=S, x=x, s=3.0),
          evaluate("y(i) = -(A(i,j) - 0.5) * x(j) * s", {"A": A, "x": x, "s": torch.tensor(3.0)}))


def test_diagonal_and_repeated_operands():
    Sq = random_dense((9, 9), 0.4, dtype=torch.float64, seed=12)
    S = sb.sparse(Sq, "csr")
    check(sb.einsum("ii->i", S), torch.einsum("ii->i", Sq))
    check(sb.einsum("ij,ji->ij", S, S), Sq * Sq.t())


def test_out_format_override_and_dtypes():
    S = sb.sparse(A.float(), "csr")
    out = sb.einsum("ij,jk->ik", S, sb.sparse(B.float(), "csr"), out_format="coo")
    assert str(out.format) == "coo" and out.dtype == torch.float32
    out = sb.einsum("ij,jk->ik", S, sb.sparse(B.float(), "csr"), out_format="dense")
    assert not isinstance(out, sb.SparseTensor)
    out = sb.einsum("ij,ij->ij", S, S, out_format="bsr(1,1)")
    assert str(out.format) == "bsr(1,1)"
    check(out, A.float() ** 2)
    h = sb.einsum("ij,j->i", S.to(torch.bfloat16), x.to(torch.bfloat16))
    assert h.dtype == torch.bfloat16
    check(h, A @ x, rtol=3e-2, atol=3e-2)
    m = sb.einsum("ij,j->i", S, x)  # float32 x float64 promotes to float64
    assert m.dtype == torch.float64


def test_int64_indices(monkeypatch):
    monkeypatch.setenv("SCORCH_DISPATCH", "sparse")  # the kernel's index width; a tiny product would run dense
    S = sb.sparse(A, "csr", index_dtype=torch.int64)
    out = sb.einsum("ij,jk->ik", S, sb.sparse(B, "csr"))
    assert out.index_dtype == torch.int64
    check(out, A @ B)


def test_threads_do_not_change_results():
    big = random_dense((300, 200), 0.05, dtype=torch.float64, seed=13)
    S = sb.sparse(big, "csr")
    D = torch.randn(200, 17, dtype=torch.float64)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = sb.einsum("ij,jk->ik", S, D)
        torch.set_num_threads(2)
        two = sb.einsum("ij,jk->ik", S, D)
        two_sp = sb.einsum("ij,jk->ik", S, sb.sparse(D.t().contiguous(), "csr").t())
    finally:
        torch.set_num_threads(old)
    torch.testing.assert_close(one, two)
    check(two_sp, big @ D)


def test_errors_have_carets():
    S = sb.sparse(A, "csr")
    with pytest.raises(ValueError, match=r"index 'j' has size 30 here but 29 elsewhere\n  ij,jk->ik\n     \^"):
        sb.einsum("ij,jk->ik", S, torch.zeros(30, 3))
    with pytest.raises(ValueError, match="operand 1 has 1 dimensions but 2 subscripts"):
        sb.einsum("ij,jk->ik", S, x)
    with pytest.raises(ValueError, match=r"unknown tensor 'z'"):
        sb.compute("y(i) = A(i,j) * z(j)", A=S, x=x)
    with pytest.raises(ValueError, match=r"expected a tensor access"):
        sb.compute("y(i) = A(i,j) * ", A=S)
    with pytest.raises(ValueError, match="equation has 2 operands but 3 were given"):
        sb.einsum("ij,jk->ik", S, S, S)
    with pytest.raises(TypeError, match="torch.sparse tensor"):
        sb.einsum("ij,j->i", A.to_sparse(), x)
    with pytest.raises(TypeError, match="floating-point"):
        sb.einsum("ij,j->i", S, torch.ones(29, dtype=torch.int64))


def test_kernel_op_checks_inputs_before_running():
    spec = "out(i0) = t0(i0,i1) * t1(i1); t0=dense(0),compressed(1); t1=strided; out=strided; f64; i32"
    S = sb.sparse(A, "csr")
    pos, crd = S.level_buffers["pos1"], S.level_buffers["crd1"]
    with pytest.raises(ValueError, match="crd has 10 entries"):
        sb.ops.kernel(spec, [pos, crd[:10], S.stored_values, x], [37, 29], 1)
    with pytest.raises(TypeError, match="values must be Double, got Float"):
        sb.ops.kernel(spec, [pos, crd, S.stored_values.float(), x], [37, 29], 1)
    with pytest.raises(ValueError, match="operand 1 has shape"):
        sb.ops.kernel(spec, [pos, crd, S.stored_values, x[:5]], [37, 29], 1)


def test_kernel_info_and_debug_output(tmp_path):
    info = sb.kernel_info("out(i0) = t0(i0,i1) * t1(i1); t0=csr; t1=strided; out=strided; f32; i32")
    assert info["schedule"].startswith("order: i0 i1")
    assert os.path.exists(info["source_path"]) and os.path.exists(info["library_path"])
    src = open(info["source_path"]).read()
    assert 'extern "C" int scorch_kernel' in src and "torch" not in src.split("Kernel spec")[1].split("\n", 2)[2]
    code = ("import torch, scorch_backend as sb\n"
            "S = sb.sparse(torch.eye(4), 'csr')\n"
            "sb.einsum('ij,jk->ik', S, torch.ones(4, 2))\n")
    env = dict(os.environ, SCORCH_DEBUG="1", SCORCH_CACHE_DIR=str(tmp_path), SCORCH_DISPATCH="sparse")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    for what in ["einsum ij,jk->ik: out(i,k) = operand 0(i,j) * operand 1(j,k)", "kernel spec: out(i0,i1) =",
                 "index notation: out(i0,i1) = t0(i0,i2) * t1(i2,i1)", "schedule: order: i0 i2 i1",
                 "loop IR:", "compiled in", f"source: {tmp_path}"]:
        assert what in r.stderr, (what, r.stderr)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "loaded from cache" in r.stderr


def test_cache_is_shared_safely_by_processes(tmp_path):
    # Several processes build the same new kernel at once: one compiles, all load a complete library.
    code = ("import torch, scorch_backend as sb\n"
            "S = sb.sparse(torch.eye(5) * 3, 'dcsr')\n"
            "y = sb.compute('y(i) = A(i,j) * x(j) + 7 * x(i)', A=S, x=torch.arange(5.0))\n"
            "assert torch.equal(y, torch.arange(5.0) * 10), y\n")  # A @ x + 7 x: the sum over j is A's only
    env = dict(os.environ, SCORCH_CACHE_DIR=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    libs = [f for f in os.listdir(tmp_path) if f.endswith(".so")]
    # Two kernels (A @ x, then + 7 x), each built once, and no temporary file left behind.
    assert len(libs) == 2 and not [f for f in os.listdir(tmp_path) if ".tmp." in f]


def test_compiler_failure_raises_runtime_error(tmp_path):
    code = ("import torch, scorch_backend as sb\n"
            "S = sb.sparse(torch.eye(3), 'csr')\n"
            "try:\n"
            "    sb.einsum('ij,j->i', S, torch.ones(3))\n"
            "except RuntimeError as e:\n"
            "    print('caught', e)\n")
    # A compiler that does not run at all: named, as a RuntimeError.
    env = dict(os.environ, CXX="false", SCORCH_CACHE_DIR=str(tmp_path), SCORCH_DISPATCH="sparse")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "caught scorch: compiling a kernel failed" in r.stdout and "false" in r.stdout, r.stdout + r.stderr
    # A compiler that runs and fails on the kernel (here at the link): the source is named too.
    env = dict(os.environ, CXX="c++ -Wl,--scorch-no-such-option", SCORCH_CACHE_DIR=str(tmp_path),
               SCORCH_DISPATCH="sparse")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "caught scorch: compiling a kernel failed" in r.stdout and "source:" in r.stdout, r.stdout + r.stderr


def test_real_matrices_spmm(data_dir):
    from scorch_backend.tools import datasets

    found = list(datasets.real_matrices(data_dir, max_per_kind=2))
    if not found:
        idx, vals, shape = datasets.rmat(9, 4)
        mats = [("rmat9", sb.from_coordinates(idx, vals, shape, "csr"))]
    else:
        mats = [(name, sb.sparse(datasets.read_matrix(p), "csr")) for name, p in found]
    g = torch.Generator().manual_seed(0)
    for name, S in mats:
        S = S.to(torch.float64)  # float64 so that summation order cannot matter at this tolerance
        D = torch.randn(S.shape[1], 8, generator=g, dtype=torch.float64)
        ref = S.to_torch(torch.sparse_csr) @ D
        torch.testing.assert_close(sb.einsum("ij,jk->ik", S, D), ref, rtol=1e-9, atol=1e-9, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("width", [64, 130, 200])
def test_vector_paths(dtype, width):
    # Widths past one vector tile exercise the register tiles (SpMM), the four-accumulator reductions (SDDMM)
    # and their scalar remainders.
    S = sb.sparse(random_dense((40, 33), 0.2, dtype=dtype, seed=21), "csr")
    Sd = S.to_dense().double()
    g = torch.Generator().manual_seed(width)
    D = torch.randn(33, width, generator=g, dtype=dtype)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(sb.einsum("ij,jk->ik", S, D).double(), Sd @ D.double(), **tol)
    P = torch.randn(40, width, generator=g, dtype=dtype)
    Q = torch.randn(33, width, generator=g, dtype=dtype)
    out = sb.einsum("ij,ik,jk->ij", S, P, Q)
    torch.testing.assert_close(out.to_dense().double(), Sd * (P.double() @ Q.double().t()), **tol)
    # A dense-output reduction along contiguous operands: y(i) = sum_k P(i,k) * R(i,k)
    torch.testing.assert_close(sb.einsum("ik,ik->i", P, P * 2).double(), (P.double() * P.double() * 2).sum(1), **tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("fmt", ["csr", "coo", None])
def test_scalars_do_not_promote_the_result_dtype(dtype, fmt, scorch_dispatch):
    # torch's rule: operands with dimensions decide the dtype; 0-d tensors only when there are none, Python
    # numbers only when there is no tensor. A named number promoted float16 to float32 where the same number
    # written as a literal did not, and a float64 0-d tensor a float32 product to float64 (helper-53).
    g = torch.Generator().manual_seed(0)
    A = (torch.randn(4, 8, generator=g) * (torch.rand(4, 8, generator=g) < 0.4)).to(dtype)
    S = sb.sparse(A, fmt) if fmt else A
    dense = lambda r: r.to_dense() if isinstance(r, sb.SparseTensor) else r  # noqa: E731
    other = torch.float64 if dtype != torch.float64 else torch.float32
    for s in (2.0, 3, torch.tensor(2.0, dtype=other)):
        want = s * A
        got = sb.compute("C(i,j) = s * A(i,j)", A=S, s=s)
        assert got.dtype == want.dtype == dtype, (s, got.dtype, want.dtype)
        torch.testing.assert_close(dense(got), want)
    assert sb.compute("C(i,j) = 2 * A(i,j)", A=S).dtype == dtype
    assert sb.einsum("ij,->ij", S, torch.tensor(2.0, dtype=other)).dtype == dtype
    # Without a tensor of dimensions: the 0-d tensors decide, then the default dtype.
    c = torch.tensor(1.5, dtype=dtype)
    assert sb.compute("s = c * 2", c=c).dtype == dtype
    assert sb.compute("s = c * d", c=c, d=torch.tensor(1.0, dtype=torch.float64)).dtype == torch.promote_types(
        dtype, torch.float64)


@pytest.mark.parametrize("threads", [1, 2])
def test_scalar_results_are_summed_in_double(threads, scorch_dispatch, monkeypatch):
    # A float32 scalar result was summed in float32 into the output: past 2^24 a thread's sum of ones stopped
    # growing (helper-53: 33554432 for the sum of 41943040 ones on two threads). Here one large value first and
    # 999 ones: summed in float32, each 1 is lost against 2^24.
    monkeypatch.setenv("SCORCH_THREAD_GRAIN", "1")
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.ones(1000)
        x[0] = 2.0**24
        want = 2.0**24 + 999
        ones = torch.ones(1000)
        cases = [("i->", sb.sparse(x, "coo"), (x,)),
                 ("ij->", sb.sparse(x.reshape(10, 100), "csr"), (x.reshape(10, 100),)),
                 ("ij->", sb.sparse(x.reshape(1, 1000), "csr"), (x.reshape(1, 1000),)),
                 ("i,i->", (sb.sparse(x, "coo"), ones), (x, ones))]
        for eq, ops, dense in cases:
            got = sb.einsum(eq, *(ops if isinstance(ops, tuple) else (ops,)))
            # (under "auto" these small sums run as torch's, whose float32 lanes lose up to ~130 here: no worse)
            tol = max(2.0, abs(torch.einsum(eq, *dense).item() - want))
            assert got.dtype == torch.float32 and abs(got.item() - want) <= tol, (eq, got.item(), tol)
        tol = max(2.0, abs(x.sum().item() - want))
        assert abs(sb.compute("s = x(i)", x=sb.sparse(x, "coo")).item() - want) <= tol
    finally:
        torch.set_num_threads(old)
