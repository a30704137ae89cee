"""Bad input raises ValueError or TypeError naming the problem, never a crash or a wrong result."""

import pytest
import torch

import scorch_backend as sb

i32 = torch.int32


def csr(pos, crd, vals, shape=(2, 3)):
    return sb.SparseTensor("csr", shape, [torch.tensor(pos, dtype=i32), torch.tensor(crd, dtype=i32)],
                           torch.tensor(vals, dtype=torch.float32))


def test_valid_buffers_are_accepted():
    A = csr([0, 1, 2], [2, 0], [1.0, 2.0])
    assert torch.equal(A.to_dense(), torch.tensor([[0, 0, 1.0], [2, 0, 0]]))


@pytest.mark.parametrize("pos,crd,vals,message", [
    ([0, 1, 2], [3, 0], [1.0, 2.0], "out of range"),
    ([0, 1, 2], [-1, 0], [1.0, 2.0], "out of range"),
    ([0, 2, 2], [2, 1], [1.0, 2.0], "sorted and unique"),
    ([0, 2, 2], [1, 1], [1.0, 2.0], "repeats"),
    ([0, 2, 1], [1], [1.0], "non-decreasing"),
    ([1, 1, 2], [1], [1.0], "pos[0] must be 0"),
    ([0, 1], [1], [1.0], "pos has 2 entries, expected 3"),
    ([0, 1, 2], [1], [1.0], "crd has 1 entries"),
    ([0, 1, 2], [1, 2], [1.0], "values has 1 entries"),
])
def test_broken_csr_buffers(pos, crd, vals, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        csr(pos, crd, vals)


def test_broken_coo_order_and_duplicates():
    def coo(r, c):
        return sb.SparseTensor("coo", (3, 3), [torch.tensor([0, len(r)]), torch.tensor(r), torch.tensor(c)],
                               torch.ones(len(r)))

    coo([0, 1], [2, 0])
    with pytest.raises(ValueError, match="not sorted"):
        coo([0, 0], [2, 1])
    with pytest.raises(ValueError, match="duplicated"):
        coo([1, 1], [2, 2])
    with pytest.raises(ValueError, match="must be sorted"):
        coo([1, 0], [0, 0])


def test_wrong_dtypes():
    with pytest.raises(TypeError, match="index buffer 'pos1' must be int32 or int64, got torch.float32"):
        sb.SparseTensor("csr", (2, 3), [torch.tensor([0.0, 1, 1]), torch.tensor([0])], torch.ones(1))
    with pytest.raises(TypeError, match="values must be float32, float64, bfloat16 or float16"):
        csr([0, 1, 1], [0], [1.0]).__class__("csr", (2, 3), [torch.tensor([0, 1, 1]), torch.tensor([0])],
                                             torch.ones(1, dtype=torch.int64))
    with pytest.raises(TypeError, match="stores float32, float64, bfloat16 or float16 values, got torch.int64"):
        sb.sparse(torch.ones(2, 2, dtype=torch.int64))
    with pytest.raises(TypeError, match="index_dtype must be"):
        sb.sparse(torch.ones(2, 2), index_dtype=torch.int16)
    with pytest.raises(TypeError, match="cannot make a SparseTensor from list"):
        sb.sparse([[1.0]])


def test_wrong_shapes_and_counts():
    with pytest.raises(ValueError, match="sizes must be non-negative"):
        sb.from_coordinates(torch.zeros(2, 0, dtype=torch.long), torch.zeros(0), (-1, 3), "csr")
    with pytest.raises(ValueError, match="stores 2 index buffers"):
        sb.SparseTensor("csr", (2, 3), [torch.tensor([0, 1, 1])], torch.ones(1))
    with pytest.raises(ValueError, match="indices describe 2 nonzeros but values has 3"):
        sb.from_coordinates(torch.tensor([[0, 1], [0, 1]]), torch.ones(3), (2, 2))
    with pytest.raises(ValueError, match=r"indices must have shape \(ndim=2, nnz\)"):
        sb.from_coordinates(torch.tensor([[0, 1]]), torch.ones(2), (2, 2))
    with pytest.raises(ValueError, match="format 'bsr' needs blocksize"):
        sb.sparse(torch.ones(4, 4), "bsr")
    with pytest.raises(ValueError, match="not divisible by its block size"):
        sb.sparse(torch.ones(5, 4), "bsr", blocksize=(2, 2))
    with pytest.raises(ValueError, match="'csc' is for 2-dimensional"):
        sb.sparse(torch.ones(2, 2, 2), "csc")


def test_coordinates_out_of_range():
    with pytest.raises(ValueError, match="index out of range: nonzero 1 has coordinate 5 in dimension 0 of size 3"):
        sb.from_coordinates(torch.tensor([[0, 5], [0, 0]]), torch.ones(2), (3, 3), "csr")
    with pytest.raises(ValueError, match="coordinate -2 in dimension 1"):
        sb.from_coordinates(torch.tensor([[0, 1], [0, -2]]), torch.ones(2), (3, 3), "coo")


def test_bad_format_text_shows_a_caret():
    with pytest.raises(ValueError) as e:
        sb.sparse(torch.ones(2, 2), "dense(0),compressed(1")
    assert "expected ')'" in str(e.value) and str(e.value).rstrip().endswith("^")
    with pytest.raises(ValueError, match="unknown format 'csx'"):
        sb.sparse(torch.ones(2, 2), "csx")
    with pytest.raises(ValueError, match="mode_order must be a permutation"):
        sb.sparse(torch.ones(2, 2), ["dense", "compressed"], mode_order=[0, 0])
    with pytest.raises(ValueError, match="one kind per dimension"):
        sb.sparse(torch.ones(2, 2), ["dense"])


def test_int32_overflow_is_refused():
    # 2^31 columns fit in the shape but a value position beyond int32 cannot be stored with int32 indices.
    n = 2**31 + 5
    A = sb.from_coordinates(torch.tensor([[0], [n - 1]]), torch.ones(1), (1, n), "coo", index_dtype=torch.int64)
    assert A.level_buffers["crd1"].tolist() == [n - 1]
    with pytest.raises(ValueError, match="does not fit in int32"):
        sb.from_coordinates(torch.tensor([[0], [n - 1]]), torch.ones(1), (1, n), "coo", index_dtype=torch.int32)


def test_tampered_buffers_are_caught_before_a_kernel_runs():
    A = sb.sparse(torch.eye(4), "csr")
    A.level_buffers["crd1"][2] = 7  # in place: out of range for 4 columns
    with pytest.raises(ValueError, match="out of range"):
        sb.einsum("ij,j->i", A, torch.ones(4))
    B = sb.sparse(torch.eye(4), "csr")
    B.level_buffers["crd1"][1] = 0  # in place: row 1 now holds column 0 ... still valid, and still runs
    assert torch.equal(sb.einsum("ij,j->i", B, torch.arange(4.0)), torch.tensor([0.0, 0.0, 2.0, 3.0]))
