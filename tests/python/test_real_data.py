"""Round trips on real matrices from the data folder (--data), and on generated ones when it is absent."""

import pytest
import torch

import scorch_backend as sb
from scorch_backend.tools import datasets


def matrices(data_dir):
    found = list(datasets.real_matrices(data_dir, max_per_kind=3))
    if found:
        return [(name, datasets.read_matrix(p)) for name, p in found]
    import scipy.sparse as sp

    idx, vals, shape = datasets.rmat(10, 8, seed=1)
    return [("generated/rmat10", sp.csr_array((vals.numpy(), (idx[0].numpy(), idx[1].numpy())), shape=shape))]


@pytest.mark.parametrize("fmt", ["csr", "csc", "coo", "dcsr", "bsr(1,1)"])
def test_real_matrices_round_trip(data_dir, fmt):
    pytest.importorskip("scipy")
    for name, m in matrices(data_dir):
        A = sb.sparse(m, fmt)
        assert A.shape == m.shape, name
        if not fmt.startswith("bsr"):
            assert A.nnz == m.nnz, name
        back = A.to_scipy().tocsr()
        back.sum_duplicates()
        assert (back != m).nnz == 0, name
        t = A.to_torch(torch.sparse_csr)  # compared buffer by buffer: some matrices are too big to densify
        if fmt.startswith("bsr"):  # zeros a dense level stores are dropped on the way out, explicit ones too
            m = m.copy()
            m.eliminate_zeros()
        assert torch.equal(t.crow_indices().long(), torch.from_numpy(m.indptr).long()), name
        assert torch.equal(t.col_indices().long(), torch.from_numpy(m.indices).long()), name
        assert torch.equal(t.values(), torch.from_numpy(m.data)), name


def test_generators_are_seeded():
    a = datasets.rmat(8, 4, seed=3)
    b = datasets.rmat(8, 4, seed=3)
    assert torch.equal(a[0], b[0]) and a[2] == (256, 256)
    A = sb.from_coordinates(a[0], a[1], a[2], "csr")
    assert A.nnz == a[0].shape[1]
