"""Hostile and careless input, each case in a child process: it must end with a clear Python exception or a
correct result, never a signal (a segmentation fault, a bus error, an abort) or a hang.

A case is Python run after `import torch, scorch_backend as sb` in a fresh interpreter (sys.executable). It
either checks its own result against dense torch (and the test expects "ok"), or is expected to raise one of
the listed exception types with a message matching a pattern. The child reports what happened on stdout; the
test first asserts that the child exited normally (a negative return code is a signal).

The cases follow issue 10: buffers changed behind the version counter (1), unvalidated construction and the
op called directly (2), deep nesting (3), the smaller ones (6: non-finite literals, malformed environment
variables, a huge sparse dimension), and semantics that must not depend on dispatch (7). Sums of many sparse
terms (4) and damaged cache entries (5) are tested elsewhere.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

_PRELUDE = """
import os, sys, traceback
import numpy as np
import torch, scorch_backend as sb

def _report(kind, detail=""):
    sys.stdout.write("\\nHOSTILE-RESULT " + kind + " " + detail.replace("\\n", " | ") + "\\n")
    sys.stdout.flush()

try:
    exec(compile(CASE, "<case>", "exec"), {"torch": torch, "sb": sb, "np": np, "os": os})
except BaseException as e:
    traceback.print_exc()
    _report("raised", type(e).__name__ + ": " + str(e)[:2000])
else:
    _report("ok")
"""

CORRUPT = (ValueError, RuntimeError, IndexError)  # a corrupted buffer: any clear error
A_400 = """
A = sb.sparse(torch.randn(400, 600).relu(), "csr")
x = torch.randn(600)
"""


# A thread writes out-of-range values into one index buffer of A (and puts the original back) while this one
# calls an op on A: every call must raise a clear error or answer, never fault ({make}, {call}: the operand
# and the call; {buffers}: the buffers written, one after the other).
_RACING_WRITER = """
import threading, time
torch.manual_seed(0)
N = 768
D = torch.randn(N, N) * (torch.rand(N, N) < 0.03)
D4 = (torch.rand(N // 4, N // 4) < 0.05).float().repeat_interleave(4, 0).repeat_interleave(4, 1) * torch.randn(N, N)
T = torch.randn(48, 48, 48) * (torch.rand(48, 48, 48) < 0.05)
v, X, W = torch.randn(N), torch.randn(N, 32), torch.randn(48, 16)
A = {make}
B = sb.sparse(torch.randn(N, N) * (torch.rand(N, N) < 0.03), "csr")
call = lambda: {call}
call()
outcomes = {{}}
for name in {buffers}:
    buf = A.level_buffers[name]
    orig = buf.clone()
    stop = time.time() + 1.0
    def writer():  # through numpy: no GIL released, no version bump; each bad value held about 20 us
        c, o, i = buf.numpy(), orig.numpy(), 0
        while time.time() < stop:
            i += 1
            j = (i * 7919) % (c.size - 2) + 1
            c[j] = (10**9, -10**9, 0)[i % 3]
            until = time.perf_counter() + 2e-5
            while time.perf_counter() < until:
                pass
            c[j] = o[j]
    t = threading.Thread(target=writer)
    t.start()
    while time.time() < stop:
        try:
            call()
            outcomes["ok"] = outcomes.get("ok", 0) + 1
        except ValueError:
            outcomes["ValueError"] = outcomes.get("ValueError", 0) + 1
    t.join()
    buf.copy_(orig)
assert outcomes.get("ValueError", 0) > 0, outcomes  # the writer did land inside calls
"""


def case(code: str, expect="ok", match: str = "", env: dict | None = None, timeout: float = 300):
    return pytest.param(textwrap.dedent(code), expect, match, env or {}, timeout)


CASES = {
    # --- 1. buffers changed behind the version counter ------------------------------------------------------
    "crd_numpy_write_spmv": case(A_400 + """
A.level_buffers["crd1"].numpy()[5] = 10**8
sb.einsum("ij,j->i", A, x)
""", CORRUPT),
    "crd_data_write_spmv": case(A_400 + """
A.level_buffers["crd1"].data[5] = 10**8
sb.einsum("ij,j->i", A, x)
""", CORRUPT),
    "crd_negative_spmv": case(A_400 + """
A.level_buffers["crd1"].numpy()[7] = -5
sb.einsum("ij,j->i", A, x)
""", CORRUPT),
    "pos_numpy_write_spmv": case(A_400 + """
A.level_buffers["pos1"].numpy()[3] = 10**8
sb.einsum("ij,j->i", A, x)
""", CORRUPT),
    "pos_numpy_write_spmm": case(A_400 + """
A.level_buffers["pos1"].numpy()[-1] = 10**8
sb.einsum("ij,jk->ik", A, torch.randn(600, 8))
""", CORRUPT),
    "crd_numpy_write_sddmm": case(A_400 + """
A.level_buffers["crd1"].numpy()[5] = 10**8
sb.einsum("ij,ik,jk->ij", A, torch.randn(400, 4), torch.randn(600, 4))
""", CORRUPT),
    "crd_numpy_write_spgemm": case(A_400 + """
A.level_buffers["crd1"].numpy()[5] = 10**8
sb.einsum("ij,jk->ik", A, sb.sparse(torch.randn(600, 30).relu(), "csr"))
""", CORRUPT),
    "crd_numpy_write_default_dispatch": case(A_400 + """
A.level_buffers["crd1"].numpy()[5] = 10**8
sb.einsum("ij,j->i", A, x)
""", CORRUPT, env={"SCORCH_DISPATCH": "auto"}),
    "crd_numpy_write_to_dense": case(A_400 + """
A.level_buffers["crd1"].numpy()[5] = 10**8
A.to_dense()
""", CORRUPT),
    "crd_numpy_write_to_format": case(A_400 + """
A.level_buffers["crd1"].numpy()[5] = 10**8
A.to_format("coo").to_dense()
""", CORRUPT),
    "coo_crd_numpy_write": case("""
A = sb.sparse(torch.randn(50, 60).relu(), "coo")
A.level_buffers["crd1"].numpy()[3] = 10**8
sb.einsum("ij,j->i", A, torch.randn(60))
""", CORRUPT),
    # A write through torch moves the version counter: caught by validation (already before issue 10).
    "crd_torch_write_is_validated": case(A_400 + """
A.level_buffers["crd1"][5] = 10**8
sb.einsum("ij,j->i", A, x)
""", ValueError),

    # --- 2. unvalidated construction, the op called directly ------------------------------------------------
    "unvalidated_crd_out_of_range": case("""
pos, crd = torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([0, 10**8], dtype=torch.int32)
A = sb.SparseTensor("csr", (2, 3), [pos, crd], torch.ones(2), validate=False)
sb.einsum("ij,j->i", A, torch.ones(3))
""", CORRUPT),
    "unvalidated_crd_int64_huge": case("""
pos, crd = torch.tensor([0, 1, 2]), torch.tensor([0, 2**40])
A = sb.SparseTensor("csr", (2, 3), [pos, crd], torch.ones(2), validate=False)
sb.einsum("ij,jk->ik", A, torch.ones(3, 4))
""", CORRUPT),
    "unvalidated_pos_out_of_range": case("""
pos, crd = torch.tensor([0, 1, 10**8], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
A = sb.SparseTensor("csr", (2, 3), [pos, crd], torch.ones(2), validate=False)
sb.einsum("ij,j->i", A, torch.ones(3))
""", CORRUPT),
    "unvalidated_pos_decreasing": case("""
pos, crd = torch.tensor([0, 2, 1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
A = sb.SparseTensor("csr", (2, 3), [pos, crd], torch.ones(2), validate=False)
sb.einsum("ij,j->i", A, torch.ones(3))
""", CORRUPT),
    "unvalidated_pos_not_monotone": case("""
pos, crd = torch.tensor([0, 3, 1, 3], dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32)
A = sb.SparseTensor("csr", (3, 3), [pos, crd], torch.ones(3), validate=False)
sb.einsum("ij,jk->ik", A, torch.ones(3, 2))
""", CORRUPT),
    "unvalidated_to_dense": case("""
pos, crd = torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([0, 10**8], dtype=torch.int32)
sb.SparseTensor("csr", (2, 3), [pos, crd], torch.ones(2), validate=False).to_dense()
""", CORRUPT),
    "unvalidated_to_format": case("""
pos, crd = torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([0, 10**8], dtype=torch.int32)
sb.SparseTensor("csr", (2, 3), [pos, crd], torch.ones(2), validate=False).to_format("csc").to_dense()
""", CORRUPT),
    "unvalidated_sparse_times_sparse": case("""
pos, crd = torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([0, 10**8], dtype=torch.int32)
A = sb.SparseTensor("csr", (2, 3), [pos, crd], torch.ones(2), validate=False)
B = sb.sparse(torch.ones(2, 3), "csr")
sb.einsum("ij,ij->ij", A, B).to_dense()
""", CORRUPT),
    "kernel_op_bad_crd": case("""
A = sb.sparse(torch.tensor([[1.0, 0, 2], [0, 3, 0]]), "csr")
x = torch.ones(3)
plan = sb.plan_einsum("ij,j->i", A, x)
pos, crd = A.level_buffers["pos1"], A.level_buffers["crd1"].clone()
crd[1] = 10**8
torch.ops.scorch.kernel(plan["spec"], [pos, crd, A.stored_values, x], plan["var_sizes"], 1)
""", CORRUPT),
    "kernel_op_bad_pos": case("""
A = sb.sparse(torch.tensor([[1.0, 0, 2], [0, 3, 0]]), "csr")
x = torch.ones(3)
plan = sb.plan_einsum("ij,j->i", A, x)
pos = A.level_buffers["pos1"].clone()
pos[1] = -7
torch.ops.scorch.kernel(plan["spec"], [pos, A.level_buffers["crd1"], A.stored_values, x], plan["var_sizes"], 1)
""", CORRUPT),
    "kernel_op_good_buffers_still_work": case("""
A = sb.sparse(torch.tensor([[1.0, 0, 2], [0, 3, 0]]), "csr")
x = torch.tensor([1.0, 2.0, 3.0])
plan = sb.plan_einsum("ij,j->i", A, x)
inputs = [*A.level_buffers.values(), A.stored_values, x]
y, _ = torch.ops.scorch.kernel(plan["spec"], inputs, plan["var_sizes"], 1)
assert torch.equal(y, torch.tensor([7.0, 6.0])), y
"""),

    # --- 3. deep nesting and oversized expressions ----------------------------------------------------------
    "deep_parentheses": case("""
sb.compute("y(i) = " + "(" * 25000 + "x(i)" + ")" * 25000, x=torch.ones(3))
""", ValueError, "nested too deeply"),
    "long_flat_sum": case("""
sb.compute("y(i) = " + " + ".join(["x(i)"] * 100000), x=torch.ones(3))
""", ValueError, "nested too deeply"),
    "long_flat_product": case("""
sb.compute("y(i) = " + " * ".join(["x(i)"] * 100000), x=torch.ones(3))
""", ValueError, "nested too deeply"),
    "many_signs": case("""
sb.compute("y(i) = " + "-" * 25000 + "x(i)", x=torch.ones(3))
""", ValueError, "nested too deeply"),
    "wide_balanced_expression": case("""
term = "x(i)"
for _ in range(16):  # 65536 accesses, 17 levels: too large, not too deep
    term = "(" + term + " + " + term + ")"
sb.compute("y(i) = " + term, x=torch.ones(3))
""", ValueError, "too large"),
    "long_einsum_equation": case("""
sb.einsum("i" * 100000 + "->i", torch.ones(3))
""", ValueError),
    "deep_nesting_below_the_limit_works": case("""
x = torch.randn(3, dtype=torch.float64, requires_grad=True)
y = sb.compute("y(i) = " + "(" * 900 + "2 * x(i)" + ")" * 900 + " + " + " + ".join(["x(i)"] * 500), x=x)
torch.testing.assert_close(y, 502 * x)
y.sum().backward()
torch.testing.assert_close(x.grad, torch.full((3,), 502.0, dtype=torch.float64))
"""),

    # --- 6. the smaller ones --------------------------------------------------------------------------------
    # A sparse result of 10^9 entries (28 GB) with 4 GB of address space left: a MemoryError in seconds. The
    # kernel's output stream once retried its failed growth at every entry, a system call each: minutes.
    "sparse_result_larger_than_memory": case("""
import resource
vm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmSize:")) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (4 << 30), resource.RLIM_INFINITY))
sb.einsum("ij,k->ijk", sb.sparse(torch.eye(1000), "csr"), torch.rand(10**6))
""", MemoryError, "ran out of memory building its result", timeout=120),
    "literal_overflow": case("""
sb.compute("y(i) = 1e999 * x(i)", x=torch.ones(3))
""", ValueError, "out of range.*finite"),
    "literal_overflow_in_a_sum": case("""
sb.compute("y(i) = x(i) + 12e400", x=torch.ones(3))
""", ValueError, "finite"),
    "literal_underflow_is_zero": case("""
y = sb.compute("y(i) = 1e-999 * x(i) + 1e308 * x(i)", x=torch.ones(3, dtype=torch.float64))
assert torch.equal(y, torch.full((3,), 1e308, dtype=torch.float64)), y
"""),
    "debug_yes": case("""
A = sb.sparse(torch.eye(3), "csr")
sb.einsum("ij,j->i", A, torch.ones(3))
""", ValueError, "SCORCH_DEBUG", env={"SCORCH_DEBUG": "yes"}),
    "dispatch_misspelt": case("""
A = sb.sparse(torch.eye(3), "csr")
sb.einsum("ij,j->i", A, torch.ones(3))
""", ValueError, "SCORCH_DISPATCH.*auto.*sparse.*dense", env={"SCORCH_DISPATCH": "Sparse"}),
    "dense_crossover_not_a_number": case("""
A = sb.sparse(torch.eye(80), "csr")
sb.einsum("ij,jk->ik", A, torch.ones(80, 80))
""", ValueError, "SCORCH_DENSE_CROSSOVER", env={"SCORCH_DISPATCH": "auto", "SCORCH_DENSE_CROSSOVER": "abc"}),
    "huge_dcsr_spgemm": case("""
import resource
n = 2**31
A = sb.from_coordinates(torch.tensor([[5, n - 3], [1, 2]]), torch.tensor([2.0, 3.0]), (n, 4), "dcsr")
B = sb.sparse(torch.tensor([[0.0, 1, 0, 0], [0, 0, 4, 0], [0, 0, 0, 5], [1, 0, 0, 0]]), "csr")
C = sb.einsum("ij,jk->ik", A, B)
assert C.format.name == "dcsr", C.format
assert torch.equal(C.coordinates(), torch.tensor([[5, n - 3], [2, 3]])), C.coordinates()
assert torch.equal(C.stored_values, torch.tensor([8.0, 15.0])), C.stored_values
peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
assert peak_mb < 2000, f"peak memory {peak_mb:.0f} MB: a dense level of 2^31 rows was allocated"
""", env={"SCORCH_DISPATCH": "auto"}),
    "huge_dcsr_elementwise": case("""
n = 2**31
A = sb.from_coordinates(torch.tensor([[5, n - 3], [1, 2]]), torch.tensor([2.0, 3.0]), (n, 4), "dcsr")
C = sb.einsum("ij,ij->ij", A, A)
assert C.format.name == "dcsr", C.format
assert torch.equal(C.stored_values, torch.tensor([4.0, 9.0])), C.stored_values
"""),
    "huge_dense_level_refused_before_packing": case("""
import resource
resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))  # if the check let it through: an error, not an OOM kill
n = 2**40
sb.from_coordinates(torch.tensor([[5], [1]]), torch.tensor([2.0]), (n, 2**20), "csr")
""", ValueError, r"needs about \d+ GiB for the index arrays of its leading dense levels.*dcsr, coo"),
    # Below a compressed level too: what a bitmap, n:m or dense level stores under each stored row (helper-45:
    # std::bad_alloc here, the OOM killer without a limit).
    **{f"huge_level_under_a_compressed_one_refused_{k}": case(f"""
import resource
resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))
sb.from_coordinates(torch.tensor([[0, 3], [0, 2**38 - 1]]), torch.tensor([1.0, 2.0]), (4, 2**38), "{fmt}")
""", ValueError, r"needs about \d+ GiB for what level 1 .* stores under each of its 2 parents") for k, fmt in enumerate(
        ["compressed(0),bitmap(1)", "compressed(0),nm[2:4](1)", "compressed(0),dense(1)"])},
    # The process's own limit (ulimit -v) counts as well as the machine's memory: 8 GiB of index arrays in a
    # process allowed 2 GiB more than it has was a bare std::bad_alloc (helper-60).
    "huge_dense_level_refused_under_the_process_limit": case("""
import resource
vm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmSize:")) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (2 << 30), resource.RLIM_INFINITY))
sb.from_coordinates(torch.tensor([[0, 1], [0, 1], [0, 1]]), torch.tensor([1.0, 2.0]), (2**14, 2**14, 4),
                    ["dense", "dense", "compressed"])
""", ValueError, r"needs about 8 GiB for the index arrays .* more than the \d+ GiB of memory this process may use"),
    # Element counts past int64 (two 2^31 x 2^31 operands): the sum of the two wrapped negative and read as a
    # tiny problem, which the default dispatch sent to the dense path (2^62 elements) (helper-60).
    "huge_sparse_operands_stay_on_the_kernel": case("""
def mk(shape, rows, cols):
    return sb.from_coordinates(torch.tensor([rows, cols]), torch.tensor([1.0, 2.0, 3.0])[:len(rows)], shape, "dcsr",
                               index_dtype=torch.int64)
n = 2**31
A = mk((n, n), [0, 3, n - 1], [n - 1, 5, 0])
assert float(sb.einsum("ij,ij->", A, A)) == 14.0
C = sb.einsum("ij,jk->ik", A, A)
assert torch.equal(C.coordinates(), torch.tensor([[0, n - 1], [0, n - 1]])), C.coordinates()
assert torch.equal(C.stored_values, torch.tensor([3.0, 3.0])), C.stored_values
B = mk((2**61, 2), [0, 7], [0, 1])
assert torch.equal(sb.einsum("ij,ik->jk", B, B).to_dense(), torch.tensor([[1.0, 0], [0, 4]]))
""", env={"SCORCH_DISPATCH": "auto"}),
    # A sparse result's dense workspace over a 2^50 extent does not fit; the message named only the result
    # (3 entries here), not the workspace (helper-60).
    "huge_workspace_is_named": case("""
K = 2**50
C = sb.from_coordinates(torch.tensor([[0, 5, K - 1], [1, 0, 1]]), torch.tensor([1.0, 2.0, 3.0]), (K, 2), "dcsc",
                        index_dtype=torch.int64)
sb.einsum("ij->i", C, out_format="coo")
""", MemoryError, r"dense workspace it keeps per thread over the output's last index \(1125899906842624 entries"),
    "element_count_past_int64_refused": case("""
n = 2**40
sb.from_coordinates(torch.tensor([[0, n - 1], [n - 1, 0]]), torch.tensor([1.0, 2.0]), (n, n), "coo",
                    index_dtype=torch.int64)
""", ValueError, "element count must fit in 64 bits"),
    "kernel_op_asks_for_100000_threads": case("""
torch.manual_seed(0)
A = sb.sparse(torch.randn(300, 300).relu(), "csr")
B = torch.randn(300, 16)
p = sb.plan_einsum("ij,jk->ik", A, B)
out, _ = torch.ops.scorch.kernel(p["spec"], [*A.level_buffers.values(), A.stored_values, B], p["var_sizes"], 100000)
# 150 float32 products a row, summed in another order than MKL's: float32 rounding, not 1e-5 absolute
torch.testing.assert_close(out, A.to_dense() @ B, rtol=1e-4, atol=1e-4)
"""),
    "calibration_file_is_a_fifo": case("""
import pathlib, tempfile
from scorch_backend import cost_model
root = pathlib.Path(tempfile.mkdtemp())
os.environ["SCORCH_CACHE_DIR"] = str(root)
key = cost_model.machine_key(torch.get_num_threads())["key"]
path = cost_model._calibration_path(key)
path.parent.mkdir(parents=True, exist_ok=True)
os.mkfifo(path)  # a reader that opens it blocking waits for a writer forever
A = sb.sparse(torch.randn(200, 200).relu(), "csr")
torch.testing.assert_close(sb.einsum("ij,jk->ik", A, torch.ones(200, 8)), A.to_dense() @ torch.ones(200, 8))
""", env={"SCORCH_DISPATCH": "auto"}, timeout=240),
    "transpose_dimension_out_of_range": case("""
A = sb.sparse(torch.eye(4, 6), "csr")
A.transpose(0, 5)
""", IndexError, "Dimension out of range"),
    "transpose_negative_dimension_out_of_range": case("""
A = sb.sparse(torch.eye(4, 6), "csr")
A.transpose(0, -3)
""", IndexError, "Dimension out of range"),
    "permute_not_a_permutation": case("""
A = sb.sparse(torch.eye(4, 6), "csr")
A.permute(0, 0)
""", RuntimeError, "not a permutation"),
    "permute_too_few_dimensions": case("""
A = sb.sparse(torch.eye(4, 6), "csr")
A.permute(1)
""", RuntimeError, "not a permutation"),
    "sum_dimension_out_of_range": case("""
A = sb.sparse(torch.eye(4, 6), "csr")
A.sum(dim=5)
""", IndexError, "Dimension out of range"),
    "transpose_and_permute_in_range": case("""
A = sb.sparse(torch.randn(4, 6).relu(), "csr")
assert torch.equal(A.transpose(-1, 0).to_dense(), A.to_dense().t())
assert torch.equal(A.permute(-1, -2).to_dense(), A.to_dense().t())
assert torch.equal(A.transpose(1, 1).to_dense(), A.to_dense())
"""),

    # A thread writing an index buffer in place (out-of-range values, then the original back) while this one
    # densifies and unpacks the matrix, or runs a generated kernel on it: each call must raise or answer,
    # never read or scatter out of bounds. The format ops' validation read pos and crd again after checking
    # them (helper-61); the kernels checked a chunk's positions and coordinates and then read them again. Now
    # the format ops work on copies, a kernel checks and reads a private copy of each chunk (rows_snapshot)
    # or keeps a re-read value in range (kept_in), a kernel that assembles a sparse result gets a copy of the
    # buffers, and the report of a bad index validates a copy. Each case died of SIGSEGV before.
    **{f"racing_index_writes_to_{name}": case(_RACING_WRITER.format(make=make, call=call, buffers=buffers))
       for name, (make, call, buffers) in {
           "dense_and_coordinates": ('sb.sparse(D, "csr")', '(A.to_dense(), A.coordinates())', ("crd1", "pos1")),
           "spmv_kernel": ('sb.sparse(D, "csr")', 'sb.einsum("ij,j->i", A, v)', ("crd1", "pos1")),
           "spmm_kernel": ('sb.sparse(D, "csr")', 'sb.einsum("ij,jk->ik", A, X)', ("crd1", "pos1")),
           "transposed_spmv_kernel": ('sb.sparse(D, "csr")', 'sb.einsum("ji,j->i", A, v)', ("crd1", "pos1")),
           "sddmm_kernel": ('sb.sparse(D, "csr")', 'sb.einsum("ij,ik,kj->ij", A, X, X.t().contiguous())', ("crd1", "pos1")),
           "bsr_kernel": ('sb.sparse(D4, "bsr(4,4)")', 'sb.einsum("ij,jk->ik", A, X)', ("crd1", "pos1")),
           "spadd_kernel": ('sb.sparse(D, "csr")', 'A + B', ("crd1", "pos1")),
           "csf_ttm_kernel": ('sb.sparse(T, "csf")', 'sb.einsum("ijk,kr->ijr", A, W)', ("crd2", "pos2")),
       }.items()},

    # --- 7. semantics that must not depend on dispatch ------------------------------------------------------
    **{f"inf_in_dense_operand_{mode}": case("""
A = sb.sparse(torch.tensor([[1.0, 0, 0], [1, 1, 0]]), "csr")  # its third column is empty
x = torch.tensor([1.0, 1.0, float("inf")])
y = sb.einsum("ij,j->i", A, x)
ref = torch.sparse.mm(A.to_torch(torch.sparse_csr), x[:, None]).ravel()
assert torch.equal(ref, torch.tensor([1.0, 2.0])), ref
assert torch.equal(y, ref), y
""", env={"SCORCH_DISPATCH": mode}) for mode in ("auto", "dense", "sparse")},
    "nan_in_dense_operand_default_dispatch": case("""
A = sb.sparse(torch.tensor([[1.0, 0, 0], [0, 2, 0]]), "csr")
B = torch.ones(3, 4)
B[2, 1] = float("nan")
B[2, 3] = -float("inf")
Y = sb.einsum("ij,jk->ik", A, B)
assert torch.equal(Y, torch.tensor([[1.0] * 4, [2.0] * 4])), Y
""", env={"SCORCH_DISPATCH": "auto"}),
    "inf_in_stored_values_times_unstored_default_dispatch": case("""
A = sb.sparse(torch.tensor([[float("inf"), 0], [1, 2]]), "csr")
B = sb.sparse(torch.tensor([[0.0, 3], [4, 0]]), "csr")
C = sb.einsum("ij,ij->ij", A, B).to_dense()
ref = (A.to_torch(torch.sparse_coo) * B.to_torch(torch.sparse_coo)).to_dense()
assert torch.equal(C, ref), (C, ref)
assert torch.equal(C, torch.tensor([[0.0, 0], [4, 0]])), C
""", env={"SCORCH_DISPATCH": "auto"}),
}


@pytest.mark.parametrize("code,expect,match,env,timeout", list(CASES.values()), ids=list(CASES))
def test_hostile(code, expect, match, env, timeout):
    child_env = dict(os.environ)
    child_env.update(env)
    child_env.setdefault("SCORCH_DISPATCH", "sparse")
    script = f"CASE = {code!r}\n" + _PRELUDE
    try:
        proc = subprocess.run([sys.executable, "-c", script], env=child_env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the case did not finish in {timeout} s:\n{code}")
    tail = (proc.stdout[-1500:] + "\n--- stderr ---\n" + proc.stderr[-3000:]).strip()
    assert proc.returncode >= 0, f"the child died of signal {-proc.returncode}:\n{code}\n{tail}"
    assert proc.returncode == 0, f"the child exited with {proc.returncode} outside the case:\n{tail}"
    results = [line for line in proc.stdout.splitlines() if line.startswith("HOSTILE-RESULT ")]
    assert len(results) == 1, f"no result reported:\n{tail}"
    kind, _, detail = results[0][len("HOSTILE-RESULT "):].partition(" ")
    if expect == "ok":
        assert kind == "ok", f"expected a correct result, got {detail}\n{tail}"
        return
    names = {e.__name__ for e in (expect if isinstance(expect, tuple) else (expect,))}
    assert kind == "raised", f"expected {' or '.join(sorted(names))}, but the case returned normally:\n{code}"
    name, _, message = detail.partition(": ")
    assert name in names, f"expected {' or '.join(sorted(names))}, got {detail}\n{tail}"
    assert message.strip(), f"{name} without a message"
    if match:
        assert re.search(match, message, re.S), f"message does not match {match!r}: {message}"
