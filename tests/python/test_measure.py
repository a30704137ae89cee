"""measure(): each pattern on constructed examples, the fields, speed; plot_patterns() writes real PNGs."""

import dataclasses
import os
import sys
import time

import pytest
import torch

import scorch_backend as sb
from scorch_backend.tools import sparsify as sp
from scorch_backend.tools.plot import plot_patterns
from scorch_backend.compiler.measure import Measurement, measure

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _reference_zero_lines(t):
    x = t.reshape(-1, t.shape[-1]) if t.dim() >= 2 else t.reshape(1, -1)
    nz = x != 0
    return float((~nz.any(1)).float().mean()), float((~nz.any(0)).float().mean())


# ---------------------------------------------------------------------------------------------- patterns


@pytest.mark.parametrize("sparsity", [0.6, 0.9, 0.99])
def test_magnitude_pruned_is_unstructured(sparsity):
    w = _randn(256, 512)
    m = measure(w * sp.magnitude_mask(w, sparsity))
    assert m.pattern == "unstructured"
    assert m.block is None and m.nm is None
    assert m.density == round((1 - sparsity) * w.numel()) / w.numel()


@pytest.mark.parametrize("block", [(32, 32), (16, 16), (8, 8), (4, 4), (2, 2), (1, 8), (8, 1), (4, 8)])
def test_block_pruned_is_block(block):
    w = _randn(256, 256, seed=1)
    m = measure(w * sp.block_mask(w, 0.8, block))
    assert m.pattern == "block"
    assert m.block == block
    assert m.nm is None
    assert m.density == pytest.approx(0.2, abs=0.01)
    assert m.describe() == f"density 0.20, block {block[0]}x{block[1]}"


def test_block_in_a_batched_tensor():
    w = _randn(4, 64, 96, seed=2)
    m = measure(w * sp.block_mask(w, 0.9, (16, 16)))
    assert (m.pattern, m.block) == ("block", (16, 16))


def test_partly_filled_blocks_are_not_block():
    # Block structure, but each kept 8x8 block then magnitude-pruned to half: too sparse inside to be "block".
    w = _randn(128, 128, seed=3)
    x = w * sp.block_mask(w, 0.8, (8, 8))
    x = x * sp.magnitude_mask(x, 0.9)
    assert measure(x).pattern == "unstructured"


@pytest.mark.parametrize("n,m", [(1, 4), (2, 8), (1, 2), (2, 4), (4, 8)])
def test_nm_pruned_is_nm(n, m):
    w = _randn(128, 256, seed=4)
    x = w * sp.nm_mask(w, n, m)
    # n/m = 0.5 is "dense" under the default threshold of 0.5, so ask with a higher one.
    got = measure(x, dense_threshold=0.6)
    assert (got.pattern, got.nm) == ("n:m", (n, m))
    assert got.density == pytest.approx(n / m)
    assert got.describe() == f"density {n / m:.2f}, {n}:{m}"


def test_two_four_at_default_threshold_is_dense_with_nm():
    w = _randn(64, 64, seed=5)
    got = measure(w * sp.nm_mask(w, 2, 4))
    assert (got.pattern, got.nm, got.density) == ("dense", (2, 4), 0.5)
    assert "2:4" in got.describe()


def test_nm_needs_density_close_to_n_over_m():
    # Every group of 4 holds at most one nonzero, but far fewer than one on average: not called 1:4.
    x = torch.zeros(64, 64)
    x[:, ::4] = 1.0
    x[torch.rand(64, 64, generator=torch.Generator().manual_seed(0)) < 0.7] = 0
    got = measure(x)
    assert got.nm is None and got.pattern != "n:m"


def test_nm_is_checked_along_the_last_dim():
    w = _randn(64, 32, seed=6)
    got = measure((w * sp.nm_mask(w, 1, 4)).t())  # the 1:4 structure is now along the first dim
    assert got.nm is None and got.pattern != "n:m"


def test_zero_rows_is_rows():
    w = _randn(300, 64, seed=7)
    zero = torch.rand(300, generator=torch.Generator().manual_seed(1)) < 0.7
    w[zero] = 0
    got = measure(w)
    assert got.pattern == "rows"
    assert got.zero_rows == pytest.approx(float(zero.float().mean()))
    assert got.zero_cols == 0.0
    assert got.describe().endswith("of rows zero)")


def test_zero_cols_is_cols():
    w = _randn(64, 300, seed=8)
    zero = torch.rand(300, generator=torch.Generator().manual_seed(2)) < 0.6
    w[:, zero] = 0
    got = measure(w)
    assert got.pattern == "cols"
    assert got.zero_cols == pytest.approx(float(zero.float().mean()))
    assert got.zero_rows == 0.0


def test_rows_that_are_themselves_sparse_are_not_rows():
    w = _randn(200, 64, seed=9)
    w[100:] = 0
    w = w * sp.magnitude_mask(w, 0.75)  # the nonzero rows end up about half full
    got = measure(w)
    assert got.zero_rows == 0.5 and got.pattern == "unstructured"


def test_empty_and_dense():
    got = measure(torch.zeros(37, 41))
    assert got == Measurement(0.0, "empty", None, None, 1.0, 1.0)
    assert got.describe() == "density 0.00, empty"
    dense = measure(_randn(37, 41))
    assert (dense.pattern, dense.density, dense.zero_rows, dense.zero_cols) == ("dense", 1.0, 0.0, 0.0)
    assert dense.describe() == "density 1.00, dense"


def test_dense_threshold_and_other_fields_still_filled():
    x = _randn(100, 100, seed=10)
    x[:30] = 0  # density 0.7, 30% zero rows
    got = measure(x)
    assert (got.pattern, got.density, got.zero_rows) == ("dense", pytest.approx(0.7), pytest.approx(0.3))
    assert measure(x, dense_threshold=0.8).pattern == "unstructured"
    assert measure(x, dense_threshold=2.0).pattern == "unstructured"
    with pytest.raises(ValueError):
        measure(x, dense_threshold=float("nan"))


def test_vectors_scalars_and_views():
    v = torch.zeros(64)
    v[:8] = 1.0
    got = measure(v)
    assert got.pattern == "block" and got.block == (1, 8)  # one row: never "cols"
    scattered = torch.tensor([1.0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 0, 5, 0, 0, 0, 0])
    assert measure(scattered).pattern == "unstructured"
    assert measure(torch.tensor(3.0)).pattern == "dense"
    assert measure(torch.tensor(0.0)).pattern == "empty"
    assert measure(torch.zeros(0, 5)).pattern == "empty"
    assert measure(torch.zeros(5, 0)).pattern == "empty"
    col = torch.zeros(64, 1)
    col[::3] = 1.0
    assert measure(col).pattern == "unstructured"  # one column: never "rows"
    w = _randn(8, 16, 32, seed=11)
    w = w * sp.magnitude_mask(w, 0.9)
    assert measure(w) == measure(w.reshape(128, 32))


@pytest.mark.parametrize("seed", range(6))
def test_fields_match_a_plain_reference(seed):
    g = torch.Generator().manual_seed(seed)
    shape = [(17, 23), (64, 48), (3, 5, 8), (1, 40), (40,)][seed % 5]
    x = torch.randn(*shape, generator=g)
    x[torch.rand(*shape, generator=g) < 0.3 + 0.1 * seed] = 0
    x[..., 0] = 0
    got = measure(x)
    zr, zc = _reference_zero_lines(x)
    assert got.density == pytest.approx(float((x != 0).float().mean()))
    assert (got.zero_rows, got.zero_cols) == (pytest.approx(zr), pytest.approx(zc))
    assert got.pattern in ("dense", "empty", "unstructured", "block", "n:m", "rows", "cols")


def test_sparse_tensor_input_and_nan():
    d = torch.zeros(64, 64)
    d[8:16, 16:24] = 1.0
    d[40:48, 0:8] = 2.0
    got = measure(sb.sparse(d, format="csr"))
    assert (got.pattern, got.block) == ("block", (8, 8))
    assert measure(d.to_sparse()).block == (8, 8)
    assert measure(torch.tensor([float("nan"), 0.0])).density == 0.5


def test_measurement_is_frozen():
    got = measure(torch.ones(4, 4))
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.density = 0.0


def test_measure_is_fast_on_4096_square():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(4096, 4096, generator=g)
    x[x < 0.9] = 0
    measure(x[:64, :64])  # warm up
    t = time.perf_counter()
    got = measure(x)
    elapsed = time.perf_counter() - t
    assert got.pattern == "unstructured"
    # Typically well under 0.1 s; the bound leaves room for a busy machine but catches a Python loop.
    assert elapsed < 2.0, elapsed


# -------------------------------------------------------------------------------------------------- plots


def _assert_png(path):
    with open(path, "rb") as f:
        head = f.read(8)
    assert head == PNG_SIGNATURE
    assert os.path.getsize(path) > 1000


def test_plot_dense_large_sparse_and_vector(tmp_path):
    g = torch.Generator().manual_seed(0)
    big = torch.rand(3000, 5000, generator=g)
    big[big < 0.999] = 0
    out = tmp_path / "patterns.png"
    tensors = {"dense": _randn(20, 30), "big": big, "vector": torch.tensor([1.0, 0, 2, 0])}
    got = plot_patterns(tensors, str(out))
    assert got == str(out)
    _assert_png(out)
    assert os.listdir(tmp_path) == ["patterns.png"]  # the temporary file was renamed, not left behind


@pytest.mark.parametrize("name", ["dense", "big", "vector"])
def test_plot_each_kind_alone(tmp_path, name):
    g = torch.Generator().manual_seed(1)
    t = {
        "dense": lambda: _randn(50, 40),
        "big": lambda: torch.rand(3000, 5000, generator=g).lt(0.001).float(),
        "vector": lambda: torch.tensor([0.0, 3.0, 0.0, 0.0, 1.0]),
    }[name]()
    out = plot_patterns({name: t}, tmp_path / "one.png", max_pixels=256)
    _assert_png(out)


def test_plot_overwrites_and_takes_sparse_tensors(tmp_path):
    out = tmp_path / "p.png"
    out.write_bytes(b"old")
    A = sb.sparse(torch.eye(40), format="csr")
    plot_patterns({"A": A, "empty": torch.zeros(0, 3), "scalar": torch.tensor(2.0)}, out)
    _assert_png(out)


def test_plot_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError):
        plot_patterns({}, tmp_path / "x.png")
    with pytest.raises(ValueError):
        plot_patterns({"a": torch.ones(2, 2)}, tmp_path / "x.png", max_pixels=0)
    with pytest.raises(TypeError):
        plot_patterns({"a": [[1.0]]}, tmp_path / "x.png")
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    with pytest.raises(ImportError, match="needs matplotlib"):
        plot_patterns({"a": torch.ones(2, 2)}, tmp_path / "x.png")
    assert os.listdir(tmp_path) == []
