"""Kernels never read outside their buffers, whatever the buffers hold.

Index buffers written behind the version counter (through numpy or .data), built with validate=False, or
passed straight to torch.ops.scorch.kernel: the generated code checks every coordinate it loads against its
extent and clamps every pos segment to its crd buffer, and the op names the bad buffer in a ValueError. Each
case that used to take the process down runs in a child process, which must exit normally having printed the
error.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import scorch_backend as sb

PRELUDE = """
import os, torch, scorch_backend as sb
torch.manual_seed(0)
def report(f):
    try:
        r = f()
    except ValueError as e:
        print("ValueError:", e)
    else:
        print("RESULT", None if r is None else tuple(r.shape))
"""


def run_child(body: str) -> str:
    env = dict(os.environ, SCORCH_DISPATCH="sparse")
    p = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], capture_output=True, text=True,
                       env=env, timeout=600)
    assert p.returncode >= 0, f"killed by signal {-p.returncode}\n{p.stdout}\n{p.stderr}"
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def errors_of(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(("ValueError:", "RESULT"))]


TAMPER = {
    # name: (format, buffer, position, value, expected words in the message)
    "crd_huge": ("csr", "crd1", 5, 10**8, ["operand 0", "crd1", "100000000", "outside [0, 600)"]),
    "crd_negative": ("csr", "crd1", 5, -1, ["operand 0", "crd1", "-1"]),
    "pos_huge": ("csr", "pos1", 7, 10**6, ["operand 0", "pos1", "1000000"]),
    "pos_decreasing": ("csr", "pos1", 7, 2, ["operand 0", "pos1", "decreases"]),
    "pos_negative": ("csr", "pos1", 3, -5, ["operand 0", "pos1", "-5"]),
    "coo_singleton": ("coo", "crd1", 5, 10**8, ["operand 0", "crd1", "100000000"]),
    "coo_top": ("coo", "crd0", 5, 10**8, ["operand 0", "crd0", "100000000"]),
    "dcsr_rows": ("dcsr", "crd0", 3, 10**8, ["operand 0", "crd0", "100000000"]),
    "dcsr_pos0": ("dcsr", "pos0", 1, 10**6, ["operand 0", "1000000"]),
}

KERNELS = {
    "spmv": 'sb.einsum("ij,j->i", A, torch.randn(600))',
    "spmm": 'sb.einsum("ij,jk->ik", A, torch.randn(600, 24))',
    "spgemm": 'sb.einsum("ij,kj->ik", A, B)',
    "sddmm": 'sb.einsum("ij,ik,jk->ij", A, torch.randn(400, 8), torch.randn(600, 8))',
    "add": 'sb.compute("C(i,j) = A(i,j) + B(i,j)", A=A, B=B)',
    "sum5": 'sb.compute("C(i,j) = A(i,j) + B(i,j) - B(i,j) + 2 * A(i,j) + B(i,j)", A=A, B=B)',
    "rowsum": 'sb.einsum("ij->i", A)',
    "dense_out_add": 'sb.compute("C(i,j) = A(i,j) + D(i,j)", A=A, D=torch.randn(400, 600))',
}


@pytest.mark.parametrize("tamper", sorted(TAMPER))
def test_buffers_written_behind_the_version_counter(tamper):
    fmt, name, at, value, words = TAMPER[tamper]
    # Each kernel runs first on good buffers, then on the same tensor written through numpy (the version
    # counter does not move, so nothing above the kernel notices), then once more after the write is undone.
    body = f"""
    A = sb.sparse(torch.randn(400, 600).relu() * (torch.rand(400, 600) < 0.1), {fmt!r})
    B = sb.sparse(torch.randn(400, 600).relu() * (torch.rand(400, 600) < 0.1), {fmt!r})
    kernels = {KERNELS!r}
    for k, src in kernels.items():
        report(lambda: eval(src))
    buf = A.level_buffers[{name!r}].numpy()
    old = int(buf[{at}])
    buf[{at}] = {value}
    for k, src in kernels.items():
        report(lambda: eval(src))
    buf[{at}] = old
    for k, src in kernels.items():
        report(lambda: eval(src))
    """
    lines = errors_of(run_child(body))
    n = len(KERNELS)
    assert len(lines) == 3 * n, lines
    assert all(line.startswith("RESULT") for line in lines[:n]), lines[:n]
    for line in lines[n:2 * n]:
        assert line.startswith("ValueError:"), lines[n:2 * n]
        for w in words:
            assert w in line, (w, line)
    assert lines[2 * n:] == lines[:n]


def test_unvalidated_construction_raises_everywhere():
    body = """
    pos = torch.tensor([0, 1, 2], dtype=torch.int32)
    crd = torch.tensor([0, 10**8], dtype=torch.int32)
    S = sb.SparseTensor("csr", (2, 3), [pos, crd], torch.ones(2), validate=False)
    report(lambda: sb.einsum("ij,j->i", S, torch.ones(3)))
    report(lambda: sb.einsum("ij,jk->ik", S, torch.ones(3, 5)))
    report(lambda: sb.einsum("ij,ij->ij", S, S))
    report(lambda: sb.einsum("ij->j", S))
    report(lambda: S.to_dense())
    report(lambda: S.to_format("csc").to_dense())
    report(lambda: S.to_format("coo").to_dense())
    # A pos pointing past the crd buffer, and one running backwards.
    P = sb.SparseTensor("csr", (2, 3), [torch.tensor([0, 5, 2], dtype=torch.int32), crd.clone()], torch.ones(2),
                        validate=False)
    report(lambda: sb.einsum("ij,j->i", P, torch.ones(3)))
    report(lambda: P.to_dense())
    """
    lines = errors_of(run_child(body))
    assert len(lines) == 9, lines
    for line in lines:
        assert line.startswith("ValueError:"), line
    for line in lines[:4]:
        assert "operand 0" in line and "crd1" in line and "100000000" in line, line


def test_kernel_op_called_directly():
    body = """
    spec = "out(i0) = t0(i0,i1) * t1(i1); t0=csr; t1=strided; out=strided; f32; i32"
    pos = torch.tensor([0, 2, 3], dtype=torch.int32)
    vals = torch.ones(3)
    x = torch.ones(4)
    for crd in ([0, 3, 1], [0, 10**8, 1], [0, -7, 1], [2**31 - 1, 0, 0]):
        report(lambda: torch.ops.scorch.kernel(spec, [pos, torch.tensor(crd, dtype=torch.int32), vals, x], [2, 4], 2)[0])
    for p in ([0, 4, 3], [0, 1, 3], [0, -1, 3]):
        report(lambda: torch.ops.scorch.kernel(spec, [torch.tensor(p, dtype=torch.int32),
                                                      torch.tensor([0, 1, 2], dtype=torch.int32), vals, x], [2, 4], 2)[0])
    # A level of extent 0 holding a coordinate: no coordinate can stand in for it.
    report(lambda: torch.ops.scorch.kernel(spec, [pos, torch.tensor([0, 0, 0], dtype=torch.int32), vals,
                                                  torch.ones(0)], [2, 0], 1)[0])
    # int64 indices, a coordinate beyond int32.
    spec64 = "out(i0) = t0(i0,i1) * t1(i1); t0=csr; t1=strided; out=strided; f32; i64"
    report(lambda: torch.ops.scorch.kernel(spec64, [pos.long(), torch.tensor([0, 2**40, 1]), vals, x], [2, 4], 2)[0])
    """
    lines = errors_of(run_child(body))
    assert len(lines) == 9, lines
    assert lines[0] == "RESULT (2,)"
    assert lines[5] == "RESULT (2,)"  # a valid pos
    for i in (1, 2, 3, 4, 6, 7, 8):
        assert lines[i].startswith("ValueError: operand 0: index buffer"), lines[i]
    assert "crd1 holds coordinate 100000000 at position 1, outside [0, 4)" in lines[1]
    assert "pos1" in lines[4] and "pos1" in lines[6]
    assert "outside [0, 0)" in lines[7]
    assert str(2**40) in lines[8]


def test_kernel_op_refuses_unsorted_coordinates_a_merge_would_skip():
    # In range but unsorted: the product of two CSR operands dropped entries with no error (helper-49). The
    # buffers are checked in full once per version; a write through torch moves the version and is seen.
    spec = ("out(i0,i1) = t0(i0,i1) * t1(i0,i1); t0=dense(0),compressed(1); t1=dense(0),compressed(1); "
            "out=dense(0),compressed(1); f32; i32")
    pos = torch.tensor([0, 2], dtype=torch.int32)
    b = [pos, torch.tensor([0, 3], dtype=torch.int32), torch.tensor([10.0, 20.0])]
    a = [pos.clone(), torch.tensor([0, 3], dtype=torch.int32), torch.tensor([1.0, 2.0])]
    for _ in range(2):
        vals, (_, crd) = torch.ops.scorch.kernel(spec, a + b, [1, 4], 1)
        assert vals.tolist() == [10.0, 40.0] and crd.tolist() == [0, 3]
    unsorted = [pos.clone(), torch.tensor([3, 0], dtype=torch.int32), torch.tensor([2.0, 1.0])]
    with pytest.raises(ValueError, match="operand 0: .*sorted"):
        torch.ops.scorch.kernel(spec, unsorted + b, [1, 4], 1)
    with pytest.raises(ValueError, match="operand 1: .*sorted"):
        torch.ops.scorch.kernel(spec, b + unsorted, [1, 4], 1)
    a[1].copy_(torch.tensor([3, 0], dtype=torch.int32))  # the checked buffer written in place
    with pytest.raises(ValueError, match="operand 0: .*sorted"):
        torch.ops.scorch.kernel(spec, a + b, [1, 4], 1)


@pytest.mark.parametrize("strided", [False, True])
def test_a_buffer_freed_and_another_made_in_its_place_is_checked_again(strided):
    # The check was remembered by address, length and version: a valid buffer freed and an unsorted one of the
    # same length made at the same address (version 0 both) passed unchecked, 181 times in 200 (helper-50); a
    # strided buffer was remembered by its per-call contiguous copy, which is made anew at every call.
    spec = ("out(i0,i1) = t0(i0,i1) * t1(i0,i1); t0=dense(0),compressed(1); t1=dense(0),compressed(1); "
            "out=dense(0),compressed(1); f32; i32")
    n = 64
    pos = torch.tensor([0, n], dtype=torch.int32)
    b = [pos, torch.arange(n, dtype=torch.int32), torch.ones(n)]
    vals = torch.ones(n)
    good, bad = list(range(n)), list(range(n))
    bad[0], bad[1] = bad[1], bad[0]

    def make(coords):
        if not strided:
            return torch.tensor(coords, dtype=torch.int32)
        big = torch.zeros(2 * n, dtype=torch.int32)
        big[::2] = torch.tensor(coords, dtype=torch.int32)
        return big[::2]

    for _ in range(50):
        g = make(good)
        assert torch.ops.scorch.kernel(spec, [pos, g, vals] + b, [1, n], 1)[0].numel() == n
        del g
        x = make(bad)
        with pytest.raises(ValueError, match="sorted"):
            torch.ops.scorch.kernel(spec, [pos, x, vals] + b, [1, n], 1)
        del x


def test_format_ops_raise_on_bad_buffers():
    body = """
    pos = torch.tensor([0, 1, 2], dtype=torch.int32)
    for crd in ([0, 10**8], [0, -1]):
        c = torch.tensor(crd, dtype=torch.int32)
        report(lambda: torch.ops.scorch.to_dense([pos, c], torch.ones(2), [2, 3], "csr"))
        report(lambda: torch.ops.scorch.unpack([pos, c], torch.ones(2), [2, 3], "csr"))
        report(lambda: torch.ops.scorch.validate([pos, c], torch.ones(2), [2, 3], "csr"))
    for p in ([0, 7, 2], [0, 2, 1]):
        report(lambda: torch.ops.scorch.to_dense([torch.tensor(p, dtype=torch.int32),
                                                  torch.tensor([0, 1], dtype=torch.int32)], torch.ones(2), [2, 3], "csr"))
    report(lambda: torch.ops.scorch.pack(torch.tensor([[0, 1], [0, 10**8]]), torch.ones(2), [2, 3], "csr", torch.int32)[1])
    report(lambda: torch.ops.scorch.to_dense([torch.tensor([0, 2]), torch.tensor([0, 1]), torch.tensor([5, 0])],
                                             torch.ones(2), [2, 3], "coo"))
    # unpack reads only its values' length, but takes them as the other format ops do
    report(lambda: torch.ops.scorch.unpack([pos, torch.tensor([0, 1], dtype=torch.int32)], torch.tensor(1.0),
                                           [2, 3], "csr"))
    report(lambda: torch.ops.scorch.unpack([pos, torch.tensor([0, 1], dtype=torch.int32)], torch.ones(2, 1),
                                           [2, 3], "csr"))
    """
    lines = errors_of(run_child(body))
    assert len(lines) == 12, lines
    assert all(line.startswith("ValueError:") for line in lines), lines
    assert "values must be 1-D" in lines[10] and "values must be 1-D" in lines[11], lines[10:]


def test_unsorted_coordinates_in_a_merge_are_reported():
    # In range but unsorted: a merge would skip entries; the kernel notices and the validator says why.
    pos = torch.tensor([0, 2, 2, 3, 4], dtype=torch.int32)
    crd = torch.tensor([2, 0, 2, 3], dtype=torch.int32)
    S = sb.SparseTensor("csr", (4, 4), [pos, crd], torch.ones(4), validate=False)
    D = torch.randn(4, 4)
    with pytest.raises(ValueError, match="operand 0"):
        sb.compute("C(i,j) = S(i,j) + D(i,j)", S=S, D=D)


def test_checked_kernels_still_compute_correctly():
    torch.manual_seed(1)
    dense = torch.randn(50, 70) * (torch.rand(50, 70) < 0.2)
    x = torch.randn(70)
    B = torch.randn(70, 9)
    for fmt in ("csr", "coo", "dcsr", "csc"):
        A = sb.sparse(dense, fmt)
        torch.testing.assert_close(sb.einsum("ij,j->i", A, x), dense @ x, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(sb.einsum("ij,jk->ik", A, B), dense @ B, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(sb.compute("C(i,j) = A(i,j) + A(i,j)", A=A).to_dense(), 2 * dense)


@pytest.mark.parametrize("target", ["scalar", "x86-64-v2", "x86-64-v3"])
def test_checks_hold_on_every_target(target):
    import platform
    if platform.machine() != "x86_64" and target != "scalar":
        pytest.skip("x86-64 targets")
    body = """
    A = sb.sparse(torch.randn(400, 600).relu() * (torch.rand(400, 600) < 0.1), "csr")
    B = torch.randn(600, 40)
    ok = torch.allclose(sb.einsum("ij,jk->ik", A, B), A.to_dense() @ B, rtol=1e-4, atol=1e-3)
    print("RESULT", ok)
    A.level_buffers["crd1"].numpy()[3] = 600
    report(lambda: sb.einsum("ij,jk->ik", A, B))
    """
    env_target = dict(os.environ, SCORCH_TARGET=target)
    p = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], capture_output=True, text=True,
                       env=dict(env_target, SCORCH_DISPATCH="sparse"), timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = errors_of(p.stdout)
    assert lines[0] == "RESULT True", lines
    assert "crd1 holds coordinate 600" in lines[1], lines


def test_segment_checks_catch_every_position():
    # A unique level's counted loop checks its segment's coordinates all at once before it runs (a vectorized
    # max, then unchecked loads). A bad coordinate must be caught wherever it sits in the segment: in the
    # vector body or the scalar rest of the check, in the first or the last row, in either thread's share,
    # at the extent itself, negative, or beyond the index type's signed range; for SpMV, for SpMM (narrow
    # and register-wide passes) and for int32 and int64 indices.
    body = """
    k = 50
    # Row 1 holds 37 entries (more than a few vectors of int32 and int64, and an odd rest), row 2 one.
    pos = torch.tensor([0, 2, 39, 40], dtype=torch.int32)
    crd = torch.cat([torch.tensor([0, 5]), torch.arange(37), torch.tensor([7])]).to(torch.int32)
    vals = torch.rand(40) + 0.5
    A = torch.zeros(3, k)
    for r in range(3):
        A[r, crd[pos[r]:pos[r + 1]].long()] = vals[pos[r]:pos[r + 1]]
    specs = []
    for it, huge in (("i32", 2**31 - 1), ("i64", 2**40)):
        specs.append((f"out(i0) = t0(i0,i1) * t1(i1); t0=csr; t1=strided; out=strided; f32; {it}",
                      torch.randn(k), [3, k], it, huge))
        for n in (40, 128):
            specs.append((f"out(i0,i1) = t0(i0,i2) * t1(i2,i1); t0=csr; t1=strided; out=strided; f32; {it}",
                          torch.randn(k, n), [3, n, k], it, huge))
    caught = missed = good = 0
    for spec, x, sizes, it, huge in specs:
        dt = torch.int32 if it == "i32" else torch.int64
        p = pos.to(dt)
        got = torch.ops.scorch.kernel(spec, [p, crd.to(dt), vals, x], sizes, 2)[0]
        good += bool(torch.allclose(got, A @ x, rtol=1e-4, atol=1e-4))
        for at in range(len(crd)):
            for bad in (k, -1, huge):
                c = crd.to(dt).clone()
                c[at] = bad
                try:
                    torch.ops.scorch.kernel(spec, [p, c, vals, x], sizes, 2)
                    missed += 1
                except ValueError as e:
                    caught += "crd1" in str(e) and str(bad) in str(e)
    print("RESULT", (good, caught, missed))
    """
    lines = errors_of(run_child(body))
    assert lines == [f"RESULT ({6}, {6 * 40 * 3}, 0)"], lines


def test_checked_rows_of_long_and_short_rows():
    # A CSR operand's rows are checked once per thread before its rows run (rows_in_range), rows of 16
    # vectors or more on average run as vector reductions and rows of 12 entries or more with four partial
    # sums (copies of the row loop of their own). Every copy must compute right and catch a bad coordinate
    # or a bad row pointer anywhere: long rows (mean 200 and 2000, so the vector copy on every target),
    # medium rows (13 and 27 entries: whole steps of four and a rest), short rows, both threads' shares, f32
    # and f64, i32 and i64.
    body = """
    import itertools
    results = []
    for rows, per_row, k in ((6, 200, 300), (4, 2000, 2100), (12, 13, 60), (9, 27, 40), (40, 3, 50)):
        g = torch.Generator().manual_seed(rows)
        crd = torch.cat([torch.randperm(k, generator=g)[:per_row].sort().values for _ in range(rows)])
        pos = torch.arange(rows + 1) * per_row
        for vt, it in itertools.product((torch.float32, torch.float64), ("i32", "i64")):
            dt = torch.int32 if it == "i32" else torch.int64
            ft = "f32" if vt == torch.float32 else "f64"
            spec = f"out(i0) = t0(i0,i1) * t1(i1); t0=csr; t1=strided; out=strided; {ft}; {it}"
            vals = torch.rand(len(crd), dtype=vt, generator=g) - 0.5
            x = torch.randn(k, dtype=vt, generator=g)
            dense = torch.zeros(rows, k, dtype=vt)
            dense[torch.arange(rows).repeat_interleave(per_row), crd] = vals
            got = torch.ops.scorch.kernel(spec, [pos.to(dt), crd.to(dt), vals, x], [rows, k], 2)[0]
            ok = torch.allclose(got, dense @ x, rtol=1e-5, atol=1e-5)
            caught = 0
            tries = [("crd1", at, bad) for at in (0, len(crd) // 2 - 1, len(crd) // 2, len(crd) - 1) for bad in (k, -1)]
            tries += [("pos1", r, v) for r, v in ((1, len(crd) + 1), (rows // 2, 0), (rows, len(crd) + 5))]
            for name, at, bad in tries:
                p, c = pos.to(dt).clone(), crd.to(dt).clone()
                (c if name == "crd1" else p)[at] = bad
                try:
                    torch.ops.scorch.kernel(spec, [p, c, vals, x], [rows, k], 2)
                except ValueError as e:
                    caught += name[:3] in str(e)  # the last row pointer is checked on entry: "pos[-1]"
            results.append((ok, caught == len(tries)))
    print("RESULT", (all(a for a, _ in results), all(b for _, b in results)))
    """
    lines = errors_of(run_child(body))
    assert lines == ["RESULT (True, True)"], lines


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_unzeroed_outputs_get_every_element_written(threads, dtype):
    # A kernel that stores every output element once (kernel_info "overwrites_output": SpMV-like sums under
    # loops over every row, the block kernels) gets its output unzeroed. Memory freed just before, full of
    # NaN, is what the allocator hands out next: an element the kernel skipped would show. Rows and block
    # rows without entries, a matrix with none, one row, odd sizes. SpMM's register tiles store each element
    # once too (every row, every column by full tiles, remainder passes and the array tile); Aᵀ·B (its outer
    # loop is the reduction: threads add into the output) and a column sum are the controls that add.
    import scorch_backend as sb
    from scorch_backend import _C

    g = torch.Generator().manual_seed(threads)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cases = []
        for rows, cols in ((300, 200), (1, 7), (37, 1), (0, 5)):
            a = (torch.rand(rows, cols, generator=g) * (torch.rand(rows, cols, generator=g) < 0.1)).to(dtype)
            if rows > 3:
                a[rows // 2] = 0
                a[-1] = 0
            s = sb.sparse(a, "csr")
            cases += [("ij,j->i", (s, torch.rand(cols, generator=g).to(dtype)), True),
                      ("ij->i", (s,), True),
                      ("ij,jk->ik", (s, torch.rand(cols, 5, generator=g).to(dtype)), True),
                      ("ij,jk->ik", (s, torch.rand(cols, 37, generator=g).to(dtype)), True),
                      ("ij,ik->jk", (s, torch.rand(rows, 5, generator=g).to(dtype)), False),
                      ("ij,jk->k", (s, torch.rand(cols, 5, generator=g).to(dtype)), False)]
        cases.append(("ij,j->i", (sb.sparse(torch.zeros(40, 9, dtype=dtype), "csr"), torch.rand(9).to(dtype)), True))
        blocks = (torch.rand(12, 10, generator=g) < 0.3)
        blocks[3] = False
        b = (torch.rand(48, 40, generator=g) * blocks.repeat_interleave(4, 0).repeat_interleave(4, 1)).to(dtype)
        bsr = sb.sparse(b, "bsr", blocksize=(4, 4))
        cases += [("ij,jk->ik", (bsr, torch.rand(40, 24, generator=g).to(dtype)), True),
                  ("bk,nk->bn", (torch.rand(6, 40, generator=g).to(dtype), bsr), True)]
        for eq, ops, overwrites in cases:
            spec = sb.plan_einsum(eq, *ops)["spec"]
            assert _C.kernel_info(spec)["overwrites_output"] == overwrites, (eq, spec)
            dense = [o.to_dense() if isinstance(o, sb.SparseTensor) else o for o in ops]
            want = torch.einsum(eq, *dense)
            for _ in range(4):
                junk = torch.full(want.shape, float("nan"), dtype=dtype)
                del junk
                got = sb.einsum(eq, *ops)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(old)
