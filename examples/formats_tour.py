"""A tour of Scorch's sparse tensors: build them, look inside them, convert them between formats, and compute with
them through the sparse compiler (einsum and index notation).

    python examples/formats_tour.py                 # on generated data
    python examples/formats_tour.py --real          # also on a real matrix from --data (default ../shared/data)
"""

import argparse
import time

import torch

import scorch_backend as sb
from scorch_backend.tools import datasets


def show(title, A):
    print(f"\n{title}: {A}")
    print(f"  format levels: {A.format.canonical}")
    for name, buf in A.level_buffers.items():
        print(f"  {name:5s} = {buf.tolist()}")
    print(f"  values = {A.stored_values.tolist()}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=None, help="folder of real data sets (default ../shared/data)")
    ap.add_argument("--real", action="store_true", help="also convert a real matrix from the data folder")
    args = ap.parse_args()

    x = torch.tensor([[0.0, 1.5, 0.0, 0.0, 2.0, 0.0],
                      [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
                      [3.0, 0.0, 0.0, 4.0, 0.0, 0.0],
                      [0.0, 0.0, 5.0, 0.0, 0.0, 6.0]])
    print("A dense 4 x 6 matrix:\n", x)

    for fmt in ["csr", "csc", "coo", "dcsr", "bsr(2,2)"]:
        A = sb.sparse(x, fmt)
        show(f"as {fmt}", A)
        assert torch.equal(A.to_dense(), x)

    # Any list of level kinds, in any mode order: column-major, doubly compressed.
    A = sb.sparse(x, ["compressed", "compressed"], mode_order=[1, 0])
    show("levels [compressed, compressed], mode order (1, 0)", A)

    # A 3-D tensor in CSF, and the same data as COO.
    t = torch.zeros(2, 3, 4)
    t[0, 1, 2], t[1, 0, 0], t[1, 2, 3] = 1.0, 2.0, 3.0
    show("3-D CSF", sb.sparse(t, "csf"))
    show("3-D COO", sb.sparse(t, "coo"))

    # Conversions: between formats, to torch.sparse, to scipy.
    A = sb.sparse(x, "coo").to_format("csr")
    print("\nCOO -> CSR gives", A.format, "; transposed:", A.t().format)
    print("to torch.sparse_csr:", A.to_torch(torch.sparse_csr))
    print("to scipy:", repr(A.to_scipy()))

    # Duplicates are summed, unsorted input is sorted.
    B = sb.from_coordinates(torch.tensor([[2, 0, 2], [1, 3, 1]]), torch.tensor([1.0, 2.0, 3.0]), (3, 4), "csr")
    show("from unsorted coordinates with a duplicate (2,1)", B)

    # SparseTensors cross torch.compile with their format intact.
    @torch.compile(fullgraph=True)
    def scale(s):
        return s * 0.5

    out = scale(sb.sparse(x, "csr"))
    print("\ntorch.compile'd scale(csr) returns", out)

    # The compiler: any einsum over any mix of sparse and dense operands, compiled to a C++ kernel.
    A = sb.sparse(x, "csr")
    v = torch.arange(6.0)
    y = sb.einsum("ij,j->i", A, v)
    print("\nSpMV einsum('ij,j->i', csr, dense):", y.tolist(), "(torch:", (x @ v).tolist(), ")")
    C = sb.einsum("ij,kj->ik", A, A)  # A @ A^T with both operands in CSR: inner products of rows
    print("SpGEMM A @ A^T ->", C, "max error", (C.to_dense() - x @ x.t()).abs().max().item())
    D = sb.compute("D(i,j) = A(i,j) + 2 * B(i,j)", A=A, B=sb.sparse(x.flip(0), "coo"))
    print("compute('D(i,j) = A(i,j) + 2 * B(i,j)') ->", D)
    plan = sb.plan_einsum("ij,kj->ik", A, A)
    print("its kernel:", plan["spec"])
    for reason in plan["reasons"]:
        print("   -", reason)
    info = sb.kernel_info(plan["spec"])
    print("schedule:", info["schedule"], "| source:", info["source_path"])

    if args.real:
        found = next(datasets.real_matrices(args.data, kinds=("graphs",)), None)
        if found is None:
            print("\nno data folder found; generating an R-MAT graph instead")
            idx, vals, shape = datasets.rmat(14, 16)
            name = "rmat(2^14)"
            t0 = time.perf_counter()
            G = sb.from_coordinates(idx, vals, shape, "csr")
        else:
            name, path = found
            m = datasets.read_matrix(path)
            t0 = time.perf_counter()
            G = sb.sparse(m, "csr")
        t1 = time.perf_counter()
        H = G.to_format("dcsc")
        t2 = time.perf_counter()
        print(f"\n{name}: {G}\n  density {G.density:.2e}; packed in {1e3 * (t1 - t0):.1f} ms, "
              f"CSR -> DCSC in {1e3 * (t2 - t1):.1f} ms -> {H}")


if __name__ == "__main__":
    main()
