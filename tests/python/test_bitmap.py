"""Bitmap levels walked natively (csrc/format/bitmap_level.cpp: a cursor over each parent's mask words, asked
through LevelKind::coordinate_cursor by the lowerer): a bitmap operand in any position of an equation, at any
level, next to dense, compressed, singleton and n:m levels and strided operands, is planned with no conversion
and agrees with dense torch across densities (none, a few, some, full), odd shapes (0, 1, not a multiple of 32,
more than one mask word), dtypes and index widths; a bitmap under a non-unique level is still converted; bitmap
outputs; masks that disagree with pos, written behind the version counter, are refused (ValueError naming the
level) or give the right result for what the buffers hold, never a crash or a wrong result.
"""

import random

import pytest
import torch

import scorch_backend as sb
from test_nm import check_word_writes

DENSITIES = [0.0, 0.002, 0.3, 1.0]
SIZES = [0, 1, 5, 31, 33, 70]
# Matrix formats with a bitmap level (row-major, column-major, bitmap at the top) and the others to mix in.
BITMAPS = ["dense(0),bitmap(1)", "dense(1),bitmap(0)", "bitmap(0),bitmap(1)", "bitmap(0),compressed(1)",
           "compressed(0),bitmap(1)"]
OTHERS = ["strided", "csr", "csc", "coo", "dcsr", "nm(2,4)"]


@pytest.fixture(autouse=True)
def kernels_forced(monkeypatch):
    monkeypatch.setenv("SCORCH_DISPATCH", "sparse")


def random_dense(shape, density, dtype, g):
    keep = torch.rand(shape, generator=g) < density
    return ((torch.rand(shape, generator=g, dtype=torch.float64) + 0.5) * keep).to(dtype)


def make(dense, fmt, index_dtype):
    if fmt == "strided":
        return dense
    if fmt.startswith("nm("):
        # Pruned to 2 of every 4 along the rows first.
        keep = (torch.arange(dense.shape[1]) % 4) < 2
        dense.mul_(keep)
    return sb.sparse(dense, fmt, index_dtype=index_dtype)


def close(a, b, dtype):
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    return a.shape == b.shape and torch.allclose(a, b, atol=tol, rtol=tol)


def as_dense(x):
    return x.to_dense() if isinstance(x, sb.SparseTensor) else x


EQUATIONS = ["ij,jk->ik", "ij,kj->ik", "ji,jk->ik", "ij,ij->ij", "ij,ij->", "ij,j->i", "ji,j->i", "ij->i", "ij->j",
             "ij,jk,kl->il", "ik,kj,ij->ij", "ij,ik->jk", "ij->ji"]


@pytest.mark.parametrize("eq", EQUATIONS)
def test_bitmap_in_every_position_matches_dense(eq):
    rng = random.Random(hash(eq) % 1000)
    subs = eq.split("->")[0].split(",")
    for case in range(24):
        g = torch.Generator().manual_seed(case)
        sizes = {c: rng.choice(SIZES) for c in sorted(set("".join(subs)))}
        dtype = rng.choice([torch.float32, torch.float64])
        index_dtype = rng.choice([torch.int32, torch.int64])
        where = rng.randrange(len(subs))  # the operand that is certainly a bitmap
        ops, dense, fmts = [], [], []
        for t, s in enumerate(subs):
            shape = tuple(sizes[c] for c in s)
            d = random_dense(shape, rng.choice(DENSITIES), dtype, g)
            if len(shape) == 1:
                f = rng.choice(["strided", "bitmap(0)", "compressed(0)"])
            elif t == where:
                f = rng.choice(BITMAPS)
            else:
                f = rng.choice(OTHERS + BITMAPS)
            ops.append(make(d, f, index_dtype))
            dense.append(d)
            fmts.append(f)
        p = sb.plan_einsum(eq, *ops)
        # No operand converted because the compiler cannot walk it (a bitmap may still be transposed or
        # densified when the cost model prefers another storage order).
        walked = [r for r in p["reasons"] if "the compiler walks" in r]
        for t, f in enumerate(fmts):
            if "bitmap" in f:
                assert not any(r.startswith(f"operand {t} (") for r in walked), (eq, fmts, p)
        got = as_dense(sb.einsum(eq, *ops))
        want = torch.einsum(eq, *dense)
        assert close(got, want, dtype), (eq, case, fmts, sizes)


def test_plan_keeps_bitmap_and_converts_it_under_a_nonunique_level():
    a = sb.sparse(torch.eye(40)[:, :37], "bitmap")
    p = sb.plan_einsum("ij,jk->ik", a, torch.randn(37, 3))
    assert p["convert"] == ["", ""] and "bitmap(1)" in p["spec"], p
    # Under a non-unique level, the cursor would span several parents' masks: converted.
    x = torch.randn(6, 40) * (torch.rand(6, 40) < 0.3)
    b = sb.sparse(x, "compressed[nonunique](0),bitmap(1)")
    p = sb.plan_einsum("ij,j->i", b, torch.randn(40))
    assert p["convert"][0] not in ("", "strided") and "bitmap" not in p["convert"][0], p
    assert close(sb.einsum("ij,j->i", b, torch.ones(40)), x.sum(1), torch.float32)


def test_three_dimensional_and_mixed_levels():
    g = torch.Generator().manual_seed(3)
    x = random_dense((5, 33, 7), 0.2, torch.float64, g)
    y = torch.randn(7, 4, dtype=torch.float64)
    for fmt in ["dense(0),bitmap(1),compressed(2)", "compressed(0),bitmap(1),bitmap(2)", "bitmap(0),dense(1),bitmap(2)",
                "dense(0),dense(1),bitmap(2)", "dense(2),bitmap(0),bitmap(1)"]:
        a = sb.sparse(x, fmt)
        p = sb.plan_einsum("ijk,kl->ijl", a, y)
        assert close(as_dense(sb.einsum("ijk,kl->ijl", a, y)), torch.einsum("ijk,kl->ijl", x, y), torch.float64), (fmt, p)
        assert close(as_dense(sb.einsum("ijk->ik", a)), x.sum(1), torch.float64), fmt


def test_bitmap_outputs():
    g = torch.Generator().manual_seed(4)
    x, y = random_dense((9, 45), 0.3, torch.float32, g), random_dense((9, 45), 0.3, torch.float32, g)
    a, b = sb.sparse(x, "bitmap"), sb.sparse(y, "csr")
    got = sb.einsum("ij,ij->ij", a, b, out_format="dense(0),bitmap(1)")
    assert isinstance(got, sb.SparseTensor) and "bitmap" in got.format.canonical
    assert close(got.to_dense(), x * y, torch.float32)
    # Unasked, the output that takes the bitmap operand's format stores that level compressed.
    got = sb.einsum("ij,ij->ij", a, b)
    assert got.format.canonical == "dense(0),compressed(1)" and close(got.to_dense(), x * y, torch.float32)
    # Outputs sharing the bitmap operand's levels (dense below them), transposed, and copied.
    z = torch.randn(4)
    for eq, ops, fmt, want in [("ij,k->ijk", (a, z), "dense(0),bitmap(1),dense(2)", torch.einsum("ij,k->ijk", x, z)),
                               ("ij->ji", (a,), "dense(0),bitmap(1)", x.T), ("ij->ij", (a,), "dense(0),bitmap(1)", x)]:
        got = sb.einsum(eq, *ops, out_format=fmt)
        assert got.format.canonical == fmt and close(got.to_dense(), want, torch.float32), eq
    s = sb.compute("y(i,j) = A(i,j) + B(i,j)", A=a, B=b)
    assert close(as_dense(s), x + y, torch.float32)


def test_automatic_dispatch_agrees(monkeypatch):
    monkeypatch.delenv("SCORCH_DISPATCH", raising=False)
    g = torch.Generator().manual_seed(5)
    x = random_dense((64, 100), 0.1, torch.float32, g)
    w = torch.randn(100, 16)
    a = sb.sparse(x, "bitmap")
    assert close(sb.einsum("ij,jk->ik", a, w), x @ w, torch.float32)
    assert close(as_dense(sb.einsum("ij,ij->ij", a, sb.sparse(x, "csr"))), x * x, torch.float32)


def test_masks_that_disagree_with_pos_are_refused_never_a_crash():
    # Mask words rewritten behind the version counter (extra bits, missing bits, bits past the size, whole
    # words): the kernel reads only the parent's row of words, stops at pos's segment and flags a mask with
    # bits left over or too few; the op then names the level (ValueError). A word that happens to keep the
    # counts gives the result for what the buffers hold.
    body = """
    import random, torch, scorch_backend as sb
    rng = random.Random(11)
    torch.manual_seed(11)
    for rows, cols in [(7, 45), (40, 64), (3, 5)]:
        x = torch.randn(rows, cols) * (torch.rand(rows, cols) < 0.4)
        A = sb.sparse(x, "bitmap")
        B = sb.sparse(torch.randn(rows, cols) * (torch.rand(rows, cols) < 0.4), "csr")
        w = torch.randn(cols, 6)
        buf = A.level_buffers["mask1"].numpy()
        for trial in range(30):
            at = rng.randrange(buf.size)
            old = int(buf[at])
            r = rng.random()
            word = rng.randrange(2**32) if r < 0.4 else (old & 0xFFFFFFFF) ^ (1 << rng.randrange(32)) if r < 0.9 else old & 0xFFFFFFFF
            new = word - 2**32 if word >= 2**31 else word  # the same low 32 bits in an int32 or int64 buffer
            buf[at] = new
            for f, ref in [(lambda: sb.einsum("ij,jk->ik", A, w), lambda: A.to_dense() @ w),
                           (lambda: sb.einsum("ij,ij->ij", A, B).to_dense(), lambda: A.to_dense() * B.to_dense()),
                           (lambda: sb.einsum("ij,ij->ij", A, x), lambda: A.to_dense() * x)]:
                try:
                    got = f()
                    print("OK" if torch.allclose(got, ref(), atol=1e-4) else "WRONG", new == old)
                except ValueError as e:
                    print("ValueError", new == old, "bitmap" in str(e))
            buf[at] = old
    """
    check_word_writes(body, 3 * 30 * 3)
