"""BSR operands run natively (csrc/lower/blocked.cpp): SpMM "ij,jk->ik" and the linear form "bk,nk->bn" walk the
block structure with no conversion to CSR, and agree with dense torch across dtypes, index widths, block shapes,
densities (none, one block, all) and sizes (empty, 1, odd, not a multiple of the register tile). Other
statements with a BSR operand still convert it, and a mix of BSR with other formats in one equation agrees too.
Index buffers written behind the version counter give a ValueError naming the buffer, never a crash.
"""

import os
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import scorch_backend as sb
from scorch_backend import _C


@pytest.fixture(autouse=True)
def kernels_forced(monkeypatch):
    monkeypatch.setenv("SCORCH_DISPATCH", "sparse")


def block_pruned(m, k, bh, bw, keep, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(m, k, generator=g, dtype=torch.float64).to(dtype)
    mask = (torch.rand(max(m // bh, 0), max(k // bw, 0), generator=g) < keep).to(dtype)
    return w * mask.repeat_interleave(bh, 0).repeat_interleave(bw, 1)


def close(a, b, dtype):
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    return a.shape == b.shape and torch.allclose(a, b, atol=tol, rtol=tol)


BLOCKS = [(1, 1), (2, 2), (4, 4), (16, 16), (1, 8), (8, 1), (2, 3), (3, 5)]
# (block rows, block columns, dense columns)
SHAPES = [(0, 3, 5), (3, 0, 5), (2, 3, 0), (1, 1, 1), (5, 7, 13), (7, 3, 33), (4, 4, 128), (3, 2, 17)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("block", BLOCKS)
def test_spmm_and_linear_match_dense(dtype, index_dtype, block):
    bh, bw = block
    for mb, kb, n in SHAPES:
        for keep in (0.0, 0.2, 1.0):
            m, k = mb * bh, kb * bw
            w = block_pruned(m, k, bh, bw, keep, dtype, seed=mb * 100 + kb * 10 + n)
            a = sb.sparse(w, "bsr", blocksize=(bh, bw), index_dtype=index_dtype)
            b = torch.randn(k, n, dtype=dtype)
            assert close(sb.einsum("ij,jk->ik", a, b), w @ b, dtype), (block, m, k, n, keep)
            x = torch.randn(n, k, dtype=dtype)
            assert close(sb.einsum("...k,nk->...n", x, a), x @ w.T, dtype), (block, m, k, n, keep)
            assert close(torch.nn.functional.linear(x, a), x @ w.T, dtype), (block, m, k, n, keep)


# Block heights whose register tile takes a different number of the block's rows at once (the largest divisor
# of the height the tile holds: all of 2, 5, 7 and 8, 6 of 12, 3 of 9, 8 of 16) with widths that are not.
TALL_BLOCKS = [(5, 2), (7, 3), (8, 8), (9, 2), (12, 4), (16, 1), (16, 16)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dispatch", ["sparse", "auto"])
def test_tall_blocks_match_dense_under_both_dispatch_modes(monkeypatch, dtype, index_dtype, dispatch):
    monkeypatch.setenv("SCORCH_DISPATCH", dispatch)
    for bh, bw in TALL_BLOCKS:
        # (block rows, block columns, dense columns): empty, one block row, odd, wider than every register tile
        for mb, kb, n in [(0, 2, 7), (1, 1, 1), (1, 3, 19), (3, 5, 33), (6, 4, 131), (2, 0, 8)]:
            for keep in (0.0, 0.4, 1.0):
                m, k = mb * bh, kb * bw
                w = block_pruned(m, k, bh, bw, keep, dtype, seed=bh * 1000 + mb * 100 + kb * 10 + n)
                a = sb.sparse(w, "bsr", blocksize=(bh, bw), index_dtype=index_dtype)
                b = torch.randn(k, n, dtype=dtype)
                assert close(sb.einsum("ij,jk->ik", a, b), w @ b, dtype), (bh, bw, m, k, n, keep, dispatch)
                x = torch.randn(n, k, dtype=dtype)
                assert close(torch.nn.functional.linear(x, a), x @ w.T, dtype), (bh, bw, m, k, n, keep, dispatch)


def test_tall_blocks_take_more_rows_per_register_tile():
    # A 16-row block keeps more of its rows in the register tile than a 4-row one, and never more than 16.
    for bh in (4, 16):
        bsr = f"dense(0/{bh}),compressed(1/{bh}),dense(0%{bh}),dense(1%{bh})"
        src = _C.kernel_source(plan("ij,jk->ik", [bsr, "strided"], [(64, 64), (64, 128)])["spec"])
        line = next(l for l in src.splitlines() if "blocked kernel (spmm)" in l)
        rows = int(line.split(" rows x ")[0].split()[-1])
        assert bh % rows == 0 and (rows == 4 if bh == 4 else rows > 4), line


def tile_of(src):
    line = next(l for l in src.splitlines() if "blocked kernel (spmm)" in l)
    words = line.split()
    return int(words[words.index("rows") - 1]), int(words[words.index("vectors") - 1])


@pytest.mark.parametrize("target", ["", "x86-64-v3", "x86-64-v4", "scalar"])
def test_register_tile_fits_the_targets_registers(target):
    # The tile is sized by the target's register count: RT x NV accumulators, the NV dense vectors shared by
    # the rows, one broadcast value and a spare fit, and no more than the target's tile accumulators per row
    # or rows per tile. 32 registers hold more vectors of 4-row blocks than 16 do.
    if target.startswith("x86-64") and os.uname().machine != "x86_64":
        pytest.skip("x86-64 target")
    try:
        _C.set_target(target)
    except Exception as e:  # a target beyond this CPU (x86-64-v4 without AVX-512) is refused
        pytest.skip(str(e))
    finally:
        _C.set_target("")
    info = _C.target_info(target)
    regs = info["vector_registers"] if info["vector_bytes"] else 16
    cap = info["tile_vectors"] if info["vector_bytes"] else 8
    vectors = {}
    for bh in (1, 4, 16):
        bsr = f"dense(0/{bh}),compressed(1/{bh}),dense(0%{bh}),dense(1%{bh})"
        spec = plan("ij,jk->ik", [bsr, "strided"], [(64, 64), (64, 128)])["spec"]
        _C.set_target(target)
        try:
            rows, nv = tile_of(_C.kernel_source(spec))
        finally:
            _C.set_target("")
        assert bh % rows == 0 and rows <= cap and nv <= cap, (target, bh, rows, nv)
        assert rows * nv + (nv if rows > 1 else 0) + 2 <= regs, (target, bh, rows, nv, regs)
        vectors[bh] = nv
    if info["vector_registers"] == 32 and info["vector_bytes"]:
        assert vectors[4] > 2, vectors
    elif info["vector_registers"] == 16 and info["vector_bytes"]:
        assert vectors[4] == 2, vectors


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("block", [(4, 4), (16, 16), (1, 4)])
def test_every_column_tail_of_the_register_tile(dtype, block):
    # After the full register tiles the columns left run in passes of fewer vectors (powers of two below the
    # tile's), then scalars: every count of dense columns up to past two full tiles of the widest target.
    bh, bw = block
    w = block_pruned(3 * bh, 5 * bw, bh, bw, 0.5, dtype, seed=bh)
    a = sb.sparse(w, "bsr", blocksize=(bh, bw))
    for n in range(0, 260, 1 if dtype == torch.float32 else 3):
        b = torch.randn(5 * bw, n, dtype=dtype)
        assert close(sb.einsum("ij,jk->ik", a, b), w @ b, dtype), (block, n)
        x = torch.randn(n, 5 * bw, dtype=dtype)
        assert close(torch.nn.functional.linear(x, a), x @ w.T, dtype), (block, n)


def test_one_stored_block_and_a_single_entry():
    w = torch.zeros(64, 48)
    w[16:20, 8:12] = torch.arange(16.0).reshape(4, 4)
    a = sb.sparse(w, "bsr", blocksize=(4, 4))
    assert a.stored_values.numel() == 16
    b = torch.randn(48, 40)
    assert torch.allclose(sb.einsum("ij,jk->ik", a, b), w @ b, atol=1e-5)
    w = torch.zeros(5, 7)
    w[4, 6] = 3.0
    a = sb.sparse(w, "bsr", blocksize=(1, 1))
    assert torch.allclose(sb.einsum("ij,jk->ik", a, torch.ones(7, 9)), w @ torch.ones(7, 9))


def plan(eq, formats, shapes, f64=False):
    ops = [(f, list(s), 1) for f, s in zip(formats, shapes)]
    return _C.plan_einsum(eq, ops, "", f64, False)


def test_plan_keeps_bsr_for_the_native_forms_and_converts_otherwise():
    bsr = "dense(0/4),compressed(1/4),dense(0%4),dense(1%4)"
    p = plan("ij,jk->ik", [bsr, "strided"], [(8, 8), (8, 5)])
    assert p["convert"] == ["", ""], p
    assert any("walked natively" in r for r in p["reasons"]), p["reasons"]
    p = plan("bk,nk->bn", ["strided", bsr], [(3, 8), (8, 8)])
    assert p["convert"] == ["", ""], p
    src = _C.kernel_source(p["spec"])
    assert "blocked kernel (linear)" in src and "coords_in_range" in src
    # Not a native form: converted to CSR as before.
    p = plan("ij,j->i", [bsr, "strided"], [(8, 8), (8,)])
    assert p["convert"][0] == "dense(0),compressed(1)", p
    p = plan("ij,jk->ik", [bsr, "csr"], [(8, 8), (8, 8)])
    assert p["convert"][0] != "", p


def test_mixed_formats_random_equations():
    """BSR mixed with the other formats in two- and three-operand equations, in every operand position."""
    rng = random.Random(1234)
    formats = ["strided", "csr", "coo", "csc", "dcsr", "bsr"]
    equations = ["ij,jk->ik", "ij,kj->ik", "ji,jk->ik", "ij,jk->ki", "bk,nk->bn", "ij,jk,kl->il", "ij,ij->ij",
                 "ij,jk->i", "ij,j->i", "ij,ik->jk", "ij,jk->", "ik,kj,ij->ij"]
    for case in range(120):
        eq = rng.choice(equations)
        subs = eq.split("->")[0].split(",")
        letters = sorted(set("".join(subs)))
        sizes = {c: rng.choice([1, 2, 4, 6, 8, 12]) for c in letters}
        dtype = rng.choice([torch.float32, torch.float64])
        ops, dense = [], []
        for s in subs:
            shape = tuple(sizes[c] for c in s)
            f = rng.choice(formats) if len(shape) == 2 else "strided"
            d = torch.randn(shape, dtype=dtype) * (torch.rand(shape) < rng.choice([0.0, 0.3, 1.0]))
            if f == "bsr":
                bh = rng.choice([x for x in (1, 2, 3, 4) if shape[0] % x == 0])
                bw = rng.choice([x for x in (1, 2, 3, 4) if shape[1] % x == 0])
                ops.append(sb.sparse(d, "bsr", blocksize=(bh, bw)))
                d = ops[-1].to_dense()
            elif f == "strided":
                ops.append(d)
            else:
                ops.append(sb.sparse(d, f))
            dense.append(d)
        got = sb.einsum(eq, *ops)
        got = got.to_dense() if isinstance(got, sb.SparseTensor) else got
        ref = torch.einsum(eq, *dense)
        assert close(got, ref, dtype), (case, eq, [getattr(o, "format", "strided") for o in ops])


def test_x86_64_v3_and_scalar_targets_agree():
    w = block_pruned(32, 24, 4, 4, 0.3, torch.float32)
    a = sb.sparse(w, "bsr", blocksize=(4, 4))
    b = torch.randn(24, 21)
    env = dict(os.environ, SCORCH_DISPATCH="sparse")
    code = textwrap.dedent("""
        import sys, torch, scorch_backend as sb
        torch.manual_seed(0)
        w = torch.load(sys.argv[1]); b = torch.load(sys.argv[2])
        a = sb.sparse(w, "bsr", blocksize=(4, 4))
        print(float((sb.einsum("ij,jk->ik", a, b) - w @ b).abs().max()))
        x = torch.randn(7, 24)
        print(float((sb.einsum("...k,nk->...n", x, a) - x @ w.T).abs().max()))
    """)
    d = os.environ.get("TMPDIR", "/tmp")
    pw, pb = os.path.join(d, f"blk_w_{os.getpid()}.pt"), os.path.join(d, f"blk_b_{os.getpid()}.pt")
    torch.save(w, pw)
    torch.save(b, pb)
    try:
        for target in ("x86-64-v3", "scalar"):
            if target == "x86-64-v3" and os.uname().machine != "x86_64":
                continue
            p = subprocess.run([sys.executable, "-c", code, pw, pb], env=dict(env, SCORCH_TARGET=target),
                               capture_output=True, text=True, timeout=600)
            assert p.returncode == 0, p.stderr
            assert all(float(v) < 1e-4 for v in p.stdout.split()), (target, p.stdout)
    finally:
        os.unlink(pw)
        os.unlink(pb)


def test_block_coordinates_written_behind_the_version_counter():
    # The block column indices written through numpy (the version counter does not move): the kernel checks
    # them per segment and the op names the buffer; after the write is undone the same call works again.
    body = """
    import torch, scorch_backend as sb
    w = torch.randn(64, 64) * (torch.rand(16, 16) < 0.3).float().repeat_interleave(4, 0).repeat_interleave(4, 1)
    A = sb.sparse(w, "bsr", blocksize=(4, 4))
    x = torch.randn(64, 24)
    def report(f):
        try:
            f()
            print("OK")
        except ValueError as e:
            print("ValueError:", e)
    calls = [lambda: sb.einsum("ij,jk->ik", A, x), lambda: sb.einsum("bk,nk->bn", x.T.contiguous(), A)]
    for c in calls: report(c)
    buf = A.level_buffers["crd1"].numpy()
    for value in (10**8, -1, 16):
        old = int(buf[2]); buf[2] = value
        for c in calls: report(c)
        buf[2] = old
    for c in calls: report(c)
    """
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(body)], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, SCORCH_DISPATCH="sparse"))
    assert p.returncode == 0, p.stdout + p.stderr
    lines = [l for l in p.stdout.splitlines() if l.startswith(("OK", "ValueError"))]
    assert len(lines) == 10, lines
    assert lines[:2] == ["OK", "OK"] and lines[-2:] == ["OK", "OK"], lines
    for line in lines[2:8]:
        assert line.startswith("ValueError:") and "crd1" in line, line


@pytest.mark.parametrize("fmt", ["bsr(2,2)", "nm(2,4)"])
def test_padded_zeros_count_as_stored_whatever_the_statement_or_gradient(fmt):
    """The zeros a format pads its blocks or groups with are stored entries: a non-finite dense value met
    there gives NaN (0 * inf), as in torch's BSR product. A converted operand dropped them only when no
    gradient was recorded, so a BSR SpMV gave [1, 2] without requires_grad and [nan, nan] with it, and SpMV
    disagreed with SpMM on the same operand (helper-68)."""
    x = torch.tensor([[1.0, 0, 0, 0], [0, 0, 0, 2]])
    A = sb.sparse(x, fmt)
    v = torch.ones(4)
    v[1] = float("inf")
    W = v[:, None].repeat(1, 3)
    with_grad = A.with_values(A.stored_values.clone().requires_grad_())
    results = [sb.einsum("ij,j->i", B, v).detach() for B in (A, with_grad)]
    results += [sb.einsum("ij,jk->ik", B, W)[:, 0].detach() for B in (A, with_grad)]
    for r in results[1:]:
        torch.testing.assert_close(r, results[0], equal_nan=True)
    assert results[0][0].isnan(), results[0]  # row 0 stores a zero at the inf's column


@pytest.mark.parametrize("blocksize", [(2.0, 2), (True, 2), (2, False), ("2", 2)])
def test_a_blocksize_that_is_not_two_integers_is_refused(blocksize):
    # int() took 2.0 as 2 and True as 1: bsr(2,2) and bsr(1,2) without a word (helper-72).
    with pytest.raises(TypeError, match="blocksize must be two integers"):
        sb.sparse(torch.eye(4), "bsr", blocksize=blocksize)
    assert sb.sparse(torch.eye(4), "bsr", blocksize=(np.int64(2), torch.tensor(2))).format.blocksize == (2, 2)
