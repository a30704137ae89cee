"""Bad input raises ValueError or TypeError naming the problem, never a crash or a wrong result."""

import re

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


# --- environment variables (scorch_backend/config.py): strict, with the variable and its accepted values named
@pytest.mark.parametrize("name,value,accepted", [
    ("SCORCH_DEBUG", "yes", "non-negative integer"), ("SCORCH_DEBUG", "-1", "non-negative integer"),
    ("SCORCH_DEBUG", "1.5", "non-negative integer"),
    # Python's int() and float() take more than the C++ side did; each side refused what the other ran with
    # (helper-55): now one grammar for both
    ("SCORCH_DEBUG", "+1", "non-negative integer"), ("SCORCH_DEBUG", "1_0", "non-negative integer"),
    ("SCORCH_DEBUG", "\u0663", "non-negative integer"),
    ("SCORCH_DENSE_CROSSOVER", "0x0.8", "greater than 0 and at most 1"),
    ("SCORCH_DENSE_CROSSOVER", "0.2_5", "greater than 0 and at most 1"),
    ("SCORCH_DENSE_CROSSOVER", "inf", "greater than 0 and at most 1"),
    ("SCORCH_DISPATCH", "Sparse", "auto, sparse, dense"), ("SCORCH_DISPATCH", "kernel", "auto, sparse, dense"),
    ("SCORCH_DENSE_CROSSOVER", "abc", "greater than 0 and at most 1"),
    ("SCORCH_DENSE_CROSSOVER", "nan", "greater than 0 and at most 1"),
    ("SCORCH_DENSE_CROSSOVER", "0", "greater than 0 and at most 1"),
    ("SCORCH_DENSE_CROSSOVER", "1.5", "greater than 0 and at most 1"),
])
def test_malformed_environment_variables_are_named(monkeypatch, name, value, accepted):
    from scorch_backend import config

    monkeypatch.setenv(name, value)
    read = {"SCORCH_DEBUG": config.debug_level, "SCORCH_DISPATCH": config.dispatch_mode,
            "SCORCH_DENSE_CROSSOVER": config.dense_crossover_override}[name]
    with pytest.raises(ValueError, match=f"{name}={re.escape(repr(value))}.*{accepted}"):
        read()
    if name != "SCORCH_DENSE_CROSSOVER" or value != "1.5":  # the einsum front end reads it too
        if name == "SCORCH_DENSE_CROSSOVER":
            monkeypatch.setenv("SCORCH_DISPATCH", "auto")  # the crossover is read only when the cost model decides
        with pytest.raises(ValueError, match=name):
            sb.einsum("ij,jk->ik", sb.sparse(torch.eye(90), "csr"), torch.ones(90, 90))


def test_environment_variables_parse(monkeypatch):
    from scorch_backend import config

    for name in ("SCORCH_DEBUG", "SCORCH_DISPATCH", "SCORCH_DENSE_CROSSOVER", "SCORCH_DATA"):
        monkeypatch.delenv(name, raising=False)
    assert (config.debug_level(), config.dispatch_mode(), config.dense_crossover_override(),
            config.data_dir_override()) == (0, "auto", None, None)
    monkeypatch.setenv("SCORCH_DEBUG", " 2 ")
    monkeypatch.setenv("SCORCH_DISPATCH", "dense")
    monkeypatch.setenv("SCORCH_DENSE_CROSSOVER", "0.25")
    monkeypatch.setenv("SCORCH_DATA", "/somewhere")
    assert (config.debug_level(), config.dispatch_mode(), config.dense_crossover_override(),
            config.data_dir_override()) == (2, "dense", 0.25, "/somewhere")
    monkeypatch.setenv("SCORCH_DEBUG", "")
    monkeypatch.setenv("SCORCH_DISPATCH", "")
    assert (config.debug_level(), config.dispatch_mode()) == (0, "auto")
    monkeypatch.setenv("SCORCH_DISPATCH", "auto")
    for text, value in (("5e-1", 0.5), (".5", 0.5), ("1E0", 1.0), ("0.25e+0", 0.25)):  # both sides take these
        monkeypatch.setenv("SCORCH_DENSE_CROSSOVER", text)
        assert config.dense_crossover_override() == value
        torch.testing.assert_close(sb.einsum("ij,jk->ik", sb.sparse(torch.eye(90), "csr"), torch.ones(90, 90)),
                                   torch.ones(90, 90))


# --- expressions: bounded depth and size, finite constants
@pytest.mark.parametrize("text,message", [
    ("y(i) = " + "(" * 1001 + "x(i)" + ")" * 1001, "nested too deeply"),
    ("y(i) = " + "-" * 1001 + "x(i)", "nested too deeply"),
    ("y(i) = " + " + ".join(["x(i)"] * 1001), "nested too deeply"),
    ("y(i) = " + " * ".join(["x(i)"] * 1001), "nested too deeply"),
    ("y(i) = 1e999 * x(i)", "'1e999' is out of range: constants must be finite"),
    ("y(i) = x(i) - 2.5e308", "out of range"),
    ("s = 2", "the right side reads no operand"),  # (torch's dispatcher error before: helper-53)
    ("s = 2 * 3 - 1", "the right side reads no operand"),
])
def test_expression_limits(text, message):
    with pytest.raises(ValueError, match=message) as e:
        sb.compute(text, x=torch.ones(3))
    assert len(str(e.value)) < 600  # a long source is shown as a window around the caret
    assert "^" in str(e.value)


def test_expressions_at_the_limit_still_run():
    x = torch.arange(3.0)
    torch.testing.assert_close(sb.compute("y(i) = " + "(" * 999 + "x(i)" + ")" * 999, x=x), x)
    torch.testing.assert_close(sb.compute("y(i) = " + "-" * 998 + "x(i)", x=x), x)
    torch.testing.assert_close(sb.compute("y(i) = " + " + ".join(["x(i)"] * 1000), x=x), 1000 * x)
    torch.testing.assert_close(sb.compute("y(i) = 1e-999 * x(i) + 1.5e308 * x(i)", x=x.double()), 1.5e308 * x.double())


def test_huge_sparse_dimension_gets_a_compressed_output_level():
    n = 2**31
    A = sb.from_coordinates(torch.tensor([[5, n - 3], [1, 2]]), torch.tensor([2.0, 3.0]), (n, 4), "dcsr")
    B = sb.sparse(torch.eye(4), "csr")
    plan = sb.plan_einsum("ij,jk->ik", A, B)
    assert sb.Format(plan["out_format"], 2).name == "dcsr", plan
    assert any("dense level would hold far more positions" in r for r in plan["reasons"]), plan["reasons"]
    # Sizes where a dense row level is cheap keep CSR.
    small = sb.sparse(torch.eye(300)[:, :4].contiguous(), "dcsr")
    assert sb.Format(sb.plan_einsum("ij,jk->ik", small, B)["out_format"], 2).name == "csr"
    # The operands' own format is kept where it has the output's indices.
    assert sb.Format(sb.plan_einsum("ij,ij->ij", A, A)["out_format"], 2).name == "dcsr"


# --- arguments of the wrong kind name themselves (no pybind signature dumps, no silent truncation) -----------

def test_equation_that_is_not_a_string():
    A = sb.sparse(torch.eye(4), "csr")
    with pytest.raises(TypeError, match="equation must be a str.*got int"):
        sb.einsum(123, A, torch.ones(4, 3))
    with pytest.raises(TypeError, match="equation must be a str.*got NoneType"):
        sb.plan_einsum(None, A, torch.ones(4, 3))


@pytest.mark.parametrize("equation,message", [
    ("i\u00e9,\u00e9j->ij", "non-ASCII"),        # a letter outside a-z/A-Z, not a miscounted operand
    ("i+j,jk->ik", "found '\\+'"),
    ("i\x01,jk->ik", "found '\\\\x01'"),
    ("ij,jk->i_k", "found '_'"),
])
def test_equation_characters_that_are_not_subscripts(equation, message):
    A = sb.sparse(torch.eye(4), "csr")
    with pytest.raises(ValueError, match=message):
        sb.einsum(equation, A, torch.ones(4, 3))


def test_spaces_in_an_equation_are_still_fine():
    A = sb.sparse(torch.eye(4), "csr")
    B = torch.rand(4, 3)
    assert torch.allclose(sb.einsum(" ij , jk -> i k ", A, B), B)
    assert torch.allclose(sb.einsum("i\tj,jk->ik", A, B), B)
    # The dense path too (torch.einsum itself refuses a tab), whatever the dispatch configuration.
    assert torch.allclose(sb.einsum("i\tj,jk ->\nik", A.to_dense(), B), B)


def test_precompile_arguments():
    spec = sb.plan_einsum("ij,jk->ik", sb.sparse(torch.eye(4), "csr"), torch.ones(4, 3))["spec"]
    sb.precompile(spec)                      # one spec on its own, not its characters
    sb.precompile([spec], workers=1)
    with pytest.raises(ValueError, match="workers must be an int >= 1, got None"):
        sb.precompile([spec], None)
    with pytest.raises(TypeError, match="kernel specs.*got NoneType"):
        sb.precompile([None])


@pytest.mark.parametrize("shape", [(3.7, 4.2), (3, "4"), (3, None)])
def test_sizes_that_are_not_integers(shape):
    idx = torch.tensor([[0, 1], [1, 2]])
    with pytest.raises(TypeError, match="sizes must be integers"):
        sb.from_coordinates(idx, torch.tensor([1.0, 2.0]), shape, "csr")
    with pytest.raises(TypeError, match="sizes must be integers"):
        sb.SparseTensor("csr", shape, [torch.tensor([0, 1, 2, 2], dtype=i32), torch.tensor([1, 2], dtype=i32)],
                        torch.tensor([1.0, 2.0]))


def test_integer_like_sizes_are_accepted():
    import numpy as np
    idx = torch.tensor([[0, 1], [1, 2]])
    A = sb.from_coordinates(idx, torch.tensor([1.0, 2.0]), (np.int64(3), torch.tensor(4)), "csr")
    assert A.shape == (3, 4) and torch.equal(A.to_dense()[1], torch.tensor([0, 0, 2.0, 0]))


def test_int64_indices_past_int32_are_refused_not_wrapped():
    import numpy as np
    import scipy.sparse as sp
    cols = 2**32 + 3
    x = torch.sparse_csr_tensor(torch.tensor([0, 1]), torch.tensor([2**32 + 1]), torch.tensor([1.0]), (1, cols))
    with pytest.raises(ValueError, match="4294967297.*does not fit in int32.*int64"):
        sb.sparse(x, "csr")
    A = sb.sparse(x, "csr", index_dtype=torch.int64)
    assert A.coordinates().tolist() == [[0], [2**32 + 1]]
    m = sp.csr_matrix((np.array([1.0]), np.array([2**31 + 1], dtype=np.int64), np.array([0, 1], dtype=np.int64)),
                      shape=(1, 2**31 + 5))
    with pytest.raises(ValueError, match="2147483649.*does not fit in int32"):
        sb.sparse(m, "csr")
    assert sb.sparse(m, "csr", index_dtype=torch.int64).coordinates().tolist() == [[0], [2**31 + 1]]


@pytest.mark.parametrize("where", ["values", "buffer"])
def test_tensors_on_the_meta_device_are_refused(where):
    pos, crd, vals = torch.tensor([0, 1, 2]), torch.tensor([0, 1]), torch.ones(2)
    if where == "values":
        vals = vals.to("meta")
    else:
        crd = crd.to("meta")
    with pytest.raises(ValueError, match="meta device"):
        sb.SparseTensor("csr", (2, 3), [pos, crd], vals)


def test_sizes_past_64_bits_and_dense_levels_past_memory_are_named():
    idx = torch.tensor([[0], [1]])
    with pytest.raises(ValueError, match="fit in 64 bits"):
        sb.from_coordinates(idx, torch.tensor([1.0]), (2**63, 2), "csr")
    with pytest.raises(ValueError, match="element count must fit in 64 bits"):  # (no torch tensor has that shape)
        sb.from_coordinates(idx, torch.tensor([1.0]), (2**62, 2**62), "csr", index_dtype=torch.int64)
    with pytest.raises(ValueError, match="GiB for the index arrays"):
        sb.from_coordinates(idx, torch.tensor([1.0]), (2**40, 2**20), "csr", index_dtype=torch.int64)


@pytest.mark.parametrize("ndim", [10**12, -1, 2.5, True, "2"])
def test_a_format_for_an_impossible_number_of_dimensions(ndim):
    from scorch_backend.tensors.format import Format
    with pytest.raises(ValueError, match="number of dimensions must be an int"):
        Format("csr", ndim)


@pytest.mark.parametrize("expr", ["A @ i", "i2 @ A", "A * i2", "i2 * A"])
def test_operators_name_a_bad_dtype(expr):
    # torch.Tensor's operators turn a TypeError into NotImplemented, which would lose the message.
    A = sb.sparse(torch.eye(4), "csr")
    i, i2 = torch.ones(4, dtype=torch.int64), torch.ones(4, 4, dtype=torch.int64)
    with pytest.raises(TypeError, match="dtype torch.int64"):
        eval(expr, {"A": A, "i": i, "i2": i2})


@pytest.mark.parametrize("size", [-6, -2**62 - 5, -2**63])
@pytest.mark.parametrize("grad", [False, True])
def test_format_ops_refuse_negative_sizes_by_name(size, grad):
    """The format ops' sizes are SymInt[]: a size below -2^62 is held as a heap SymInt, and to_dense (whose
    autograd kernel passes its sizes on as SymInts) failed with the dispatcher's "SymIntArrayRef expected to
    contain only concrete integers" instead of Scorch's message (helper-66)."""
    A = sb.sparse(torch.eye(6, 5), "csr")
    values = A.stored_values.clone().requires_grad_(grad)
    for op in (torch.ops.scorch.to_dense, torch.ops.scorch.unpack, torch.ops.scorch.validate):
        with pytest.raises(ValueError, match="sizes must be non-negative"):
            op(list(A.level_buffers.values()), values, [6, size], A.format.canonical)


@pytest.mark.parametrize("op", ["+", "-", "*", "@"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64])
@pytest.mark.parametrize("side", ["left", "right"])
def test_operators_with_a_tensor_scorch_cannot_compute_name_its_dtype(op, dtype, side):
    # + and - fell back to Python's "unsupported operand type(s) for +" (torch.Tensor's operators turn the
    # TypeError into NotImplemented); * and @ already named the dtype.
    A = sb.sparse(torch.eye(3), "csr")
    t = torch.ones(3, 3, dtype=dtype)
    named = str(dtype) if dtype != torch.bool or op != "-" else "bool"  # torch's own message for bool - ...
    with pytest.raises((TypeError, RuntimeError), match=named):
        eval(f"A {op} t" if side == "left" else f"t {op} A")
