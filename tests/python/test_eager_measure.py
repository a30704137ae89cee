"""Eager einsum under automatic dispatch: a call whose density is near the crossover is settled by timing both
paths once per size bucket (executor.cpp, measured_choice). What is checked here is which calls measure and that
every path gives torch's result; which path wins is the machine's business, so no test asserts it."""

import pytest
import torch

import scorch_backend as sb
from scorch_backend import _C
from conftest import random_dense


def nm_weight(rows, cols, n=2, m=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols // m, m, generator=g)
    keep = w.abs().topk(n, dim=-1).indices
    return (w * torch.zeros_like(w).scatter_(-1, keep, 1.0)).reshape(rows, cols)


def measured():
    return _C.executor_stats()["measured"]


@pytest.fixture
def auto(monkeypatch):
    monkeypatch.setenv("SCORCH_DISPATCH", "auto")
    monkeypatch.setenv("SCORCH_MEASURE", "1")
    # A fixed crossover, so which calls are "near" it does not depend on this machine's calibration.
    monkeypatch.setenv("SCORCH_DENSE_CROSSOVER", "0.3")


@pytest.mark.parametrize("fmt", ["nm(2,4)", "csr", "bsr(2,2)"])
def test_near_the_crossover_measures_once_per_bucket(auto, fmt):
    # 2:4 and these random/blocked patterns at ~50% are above the crossover (0.3) but within its window: the
    # density rule alone would densify on every call.
    w = nm_weight(96, 64, seed=1) if fmt.startswith("nm") else random_dense((96, 64), 0.5, seed=1)
    if fmt.startswith("bsr"):
        w = w.reshape(48, 2, 32, 2).abs().amax(dim=(1, 3)).gt(0.6).repeat_interleave(2, 0).repeat_interleave(2, 1) * w
    S = sb.sparse(w, fmt)
    B = torch.randn(64, 48)
    before = measured()
    out = sb.einsum("ij,jk->ik", S, B)
    torch.testing.assert_close(out, w @ B, rtol=1e-4, atol=1e-4)
    assert measured() == before + 1
    for _ in range(3):  # same bucket: the kept decision, no new measurement
        torch.testing.assert_close(sb.einsum("ij,jk->ik", S, B), w @ B, rtol=1e-4, atol=1e-4)
    assert measured() == before + 1
    # Another size bucket measures again.
    B2 = torch.randn(64, 200)
    torch.testing.assert_close(sb.einsum("ij,jk->ik", S, B2), w @ B2, rtol=1e-4, atol=1e-4)
    assert measured() == before + 2


def test_another_matrix_of_the_same_size_and_density_uses_the_kept_decision(auto):
    # A graph's next batch, a weight re-pruned: same shape and density bucket, another pattern and entry count.
    # Measured once, not once per matrix (helper-43 F6: the decision was keyed by the plan, whose key holds the
    # exact entry count: 74-138 ms again on each new matrix).
    B = torch.randn(80, 40)
    ws = [random_dense((96, 80), 0.45, seed=s) for s in (11, 12, 13)]
    mats = [sb.sparse(w, "csr") for w in ws]
    assert len({m.nnz for m in mats}) == 3
    before = measured()
    for w, S in zip(ws, mats):
        torch.testing.assert_close(sb.einsum("ij,jk->ik", S, B), w @ B, rtol=1e-4, atol=1e-4)
    assert measured() == before + 1
    # Another format of the same matrix is another decision.
    torch.testing.assert_close(sb.einsum("ij,jk->ik", sb.sparse(ws[0], "csc"), B), ws[0] @ B, rtol=1e-4, atol=1e-4)
    assert measured() == before + 2


def test_far_from_the_crossover_trusts_the_rule(auto):
    S = sb.sparse(random_dense((128, 128), 0.02, seed=2), "csr")  # 0.02 < 0.3 / 3: clearly sparse
    B = torch.randn(128, 32)
    before = measured()
    torch.testing.assert_close(sb.einsum("ij,jk->ik", S, B), S.to_dense() @ B, rtol=1e-4, atol=1e-4)
    assert measured() == before


def test_measure_off(auto, monkeypatch):
    monkeypatch.setenv("SCORCH_MEASURE", "0")
    w = nm_weight(64, 64, seed=3)
    S = sb.sparse(w, "nm(2,4)")
    B = torch.randn(64, 40)
    before = measured()
    torch.testing.assert_close(sb.einsum("ij,jk->ik", S, B), w @ B, rtol=1e-4, atol=1e-4)
    assert measured() == before


def test_forced_dispatch_never_measures(monkeypatch):
    monkeypatch.setenv("SCORCH_DENSE_CROSSOVER", "0.3")
    w = nm_weight(64, 64, seed=4)
    S = sb.sparse(w, "nm(2,4)")
    B = torch.randn(64, 24)
    before = measured()
    for mode in ("sparse", "dense"):
        monkeypatch.setenv("SCORCH_DISPATCH", mode)
        torch.testing.assert_close(sb.einsum("ij,jk->ik", S, B), w @ B, rtol=1e-4, atol=1e-4)
    assert measured() == before


def test_nonfinite_values_keep_the_kernels_semantics_whatever_was_kept(auto):
    # Whichever path the bucket kept, a NaN in a row of B that S never reads must not reach the result: the
    # kernel never multiplies unstored entries, a dense product would give 0 * NaN = NaN in every row.
    w = nm_weight(64, 64, seed=5)
    w[:, 7] = 0
    S = sb.sparse(w, "nm(2,4)")
    B = torch.randn(64, 16)
    sb.einsum("ij,jk->ik", S, B)  # settles the bucket's decision
    Bn = B.clone()
    Bn[7] = float("nan")
    out = sb.einsum("ij,jk->ik", S, Bn)
    assert not out.isnan().any()
    torch.testing.assert_close(out, w @ torch.nan_to_num(Bn, nan=0.0), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dtypes_and_shapes(auto, dtype):
    for rows, cols, n in [(1, 8, 1), (17, 12, 5), (33, 40, 64)]:
        w = nm_weight(rows, cols, seed=rows).to(dtype)
        S = sb.sparse(w, "nm(2,4)")
        B = torch.randn(cols, n, dtype=dtype)
        tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else {}
        torch.testing.assert_close(sb.einsum("ij,jk->ik", S, B), w @ B, **tol)


def test_a_sparse_result_with_a_summed_index_is_measured_and_its_choice_followed(auto, monkeypatch):
    # SpGEMM: the density rule multiplies densities as for an SpMM; at 0.5-0.8 the kernel ran 2.4-5.5x slower
    # than the dense product and its compression (helper-43 F9). Such calls are measured now, and a dense choice
    # is run dense by Python, which converts the result (it decided again by the rule alone, undoing it).
    from scorch_backend.tensors import frontend

    a, b = random_dense((96, 80), 0.5, seed=41), random_dense((80, 72), 0.5, seed=42)
    A, B = sb.sparse(a, "csr"), sb.sparse(b, "csr")
    stats = _C.executor_stats
    before = stats()
    out = sb.einsum("ij,jk->ik", A, B)
    assert isinstance(out, sb.SparseTensor)
    torch.testing.assert_close(out.to_dense(), a @ b, rtol=1e-4, atol=1e-4)
    after = stats()
    assert after["measured"] == before["measured"] + 1
    kept_dense = after["measured_dense"] > before["measured_dense"]
    ran_dense = []
    real = frontend._run_dense
    monkeypatch.setattr(frontend, "_run_dense", lambda *args: ran_dense.append(1) or real(*args))
    monkeypatch.setattr(frontend.cost_model, "choose_dense", lambda *a, **k: (False, "the rule says sparse"))
    for _ in range(3):  # the kept decision, whichever it is, and no new measurement
        torch.testing.assert_close(sb.einsum("ij,jk->ik", A, B).to_dense(), a @ b, rtol=1e-4, atol=1e-4)
    assert stats()["measured"] == after["measured"]
    assert len(ran_dense) == (3 if kept_dense else 0)
    # An elementwise product with a sparse result is never measured: the kernel visits only stored entries.
    sb.einsum("ij,ij->ij", A, sb.sparse(random_dense((96, 80), 0.5, seed=43), "csr"))
    assert stats()["measured"] == after["measured"]


def test_a_sparse_result_is_measured_from_well_below_the_crossover(auto):
    # The product of the densities says nothing of how full an SpGEMM's result comes out: at 0.3 each (0.09,
    # under 0.3 / 3, where an SpMM trusts the rule) its result is nearly full and the kernel assembled it at
    # 39 ms against 22 for the dense product and its compression (helper-75, 1000^3). Such calls are measured
    # from crossover / 40 on; an SpMM of the same density is not.
    a, b = random_dense((90, 70), 0.3, seed=51), random_dense((70, 60), 0.3, seed=52)
    A, B = sb.sparse(a, "csr"), sb.sparse(b, "csr")
    before = measured()
    out = sb.einsum("ij,jk->ik", A, B)
    assert isinstance(out, sb.SparseTensor)
    torch.testing.assert_close(out.to_dense(), a @ b, rtol=1e-4, atol=1e-4)
    assert measured() == before + 1
    S = sb.sparse(random_dense((90, 70), 0.09, seed=53), "csr")
    torch.testing.assert_close(sb.einsum("ij,jk->ik", S, b), S.to_dense() @ b, rtol=1e-4, atol=1e-4)
    assert measured() == before + 1
    # Far below even that window (0.05 x 0.05 against 0.3 / 40): the rule's kernel, unmeasured.
    c, d = random_dense((90, 70), 0.05, seed=54), random_dense((70, 60), 0.05, seed=55)
    got = sb.einsum("ij,jk->ik", sb.sparse(c, "csr"), sb.sparse(d, "csr"))
    torch.testing.assert_close(got.to_dense(), c @ d, rtol=1e-4, atol=1e-4)
    assert measured() == before + 1
