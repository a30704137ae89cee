"""Sparsifiers: exact keep counts, the n:m and block properties, tie-breaking, prune() on models, errors."""

import math
import re

import pytest
import torch

from scorch_backend.tools import sparsify as sp


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------------------------- magnitude


@pytest.mark.parametrize("sparsity", [0.0, 0.1, 0.25, 0.5, 0.7, 0.9, 0.99, 1.0])
def test_magnitude_keep_count_and_choice(sparsity):
    w = _randn(10, 30)
    mask = sp.magnitude_mask(w, sparsity)
    assert mask.dtype == torch.bool and mask.shape == w.shape
    k = round((1 - sparsity) * w.numel())
    assert int(mask.sum()) == k
    if 0 < k < w.numel():
        # Every kept magnitude is at least every dropped one.
        assert w.abs()[mask].min() >= w.abs()[~mask].max()


def test_magnitude_uses_absolute_value():
    w = torch.tensor([0.1, -5.0, 0.3, 4.0, -0.2, 0.0])
    assert sp.magnitude_mask(w, 4 / 6).tolist() == [False, True, False, True, False, False]


def test_magnitude_ties_go_to_the_earlier_entry():
    w = torch.tensor([[1.0, -1.0, 1.0], [1.0, 2.0, -1.0]])
    # 2 survives by size; of the five tied 1s, the first two in row-major order survive.
    assert sp.magnitude_mask(w, 0.5).tolist() == [[True, True, False], [False, True, False]]
    assert torch.equal(sp.magnitude_mask(torch.ones(7), 0.5), torch.tensor([True] * 4 + [False] * 3))


def test_magnitude_does_not_modify_input_and_keeps_nan():
    w = torch.tensor([1.0, float("nan"), 3.0, 0.5])
    before = w.clone()
    mask = sp.magnitude_mask(w, 0.5)
    assert mask.tolist() == [False, True, True, False]
    assert torch.equal(w.isnan(), before.isnan()) and torch.equal(w.nan_to_num(), before.nan_to_num())


# ------------------------------------------------------------------------------------- threshold, random


def test_threshold_is_strict():
    w = torch.tensor([-2.0, 1.0, 0.5, -0.5, 3.0, 0.0])
    assert sp.threshold_mask(w, 0.5).tolist() == [True, True, False, False, True, False]
    assert sp.threshold_mask(w, 0).tolist() == [True, True, True, True, True, False]


@pytest.mark.parametrize("shape,sparsity", [((100,), 0.9), ((7, 13), 0.5), ((3, 4, 5), 0.25), ((9,), 1.0)])
def test_random_exact_count_and_reproducible(shape, sparsity):
    w = _randn(*shape)
    m1 = sp.random_mask(w, sparsity, generator=torch.Generator().manual_seed(1))
    m2 = sp.random_mask(w, sparsity, generator=torch.Generator().manual_seed(1))
    assert m1.shape == w.shape
    assert int(m1.sum()) == round((1 - sparsity) * w.numel())
    assert torch.equal(m1, m2)


def test_random_is_spread_over_all_positions():
    w = torch.ones(64)
    g = torch.Generator().manual_seed(0)
    hits = sum(sp.random_mask(w, 0.5, generator=g).int() for _ in range(400))
    # Each position is kept in about half of the draws; a mask biased to low indices would fail this.
    assert hits.min() > 140 and hits.max() < 260
    assert not torch.equal(
        sp.random_mask(w, 0.5, generator=torch.Generator().manual_seed(1)),
        sp.random_mask(w, 0.5, generator=torch.Generator().manual_seed(2)),
    )


# ---------------------------------------------------------------------------------------------------- n:m


@pytest.mark.parametrize("n,m", [(2, 4), (1, 4), (1, 2), (4, 8), (0, 4), (4, 4)])
def test_nm_property(n, m):
    w = _randn(6, 5, 16, seed=3)
    mask = sp.nm_mask(w, n, m)
    groups = mask.reshape(-1, m)
    assert (groups.sum(1) == n).all()
    mags = w.abs().reshape(-1, m)
    if 0 < n < m:
        kept_min = torch.where(groups, mags, torch.inf).amin(1)
        dropped_max = torch.where(groups, -torch.inf, mags).amax(1)
        assert (kept_min >= dropped_max).all()


def test_nm_exact_and_ties():
    w = torch.tensor([[0.1, -0.9, 0.5, 0.2, 1.0, 1.0, 1.0, 1.0]])
    assert sp.nm_mask(w, 2, 4).tolist() == [[False, True, True, False, True, True, False, False]]


def test_nm_needs_divisible_last_dim():
    with pytest.raises(ValueError, match=r"\(3, 6\)"):
        sp.nm_mask(torch.ones(3, 6), 2, 4)
    with pytest.raises(ValueError):
        sp.nm_mask(torch.ones(4), 5, 4)


# -------------------------------------------------------------------------------------------------- block


@pytest.mark.parametrize("block,sparsity", [((4, 4), 0.75), ((2, 8), 0.5), ((1, 4), 0.9), ((8, 8), 0.0)])
def test_block_property(block, sparsity):
    bh, bw = block
    w = _randn(16, 32, seed=5)
    mask = sp.block_mask(w, sparsity, block)
    tiles = mask.reshape(16 // bh, bh, 32 // bw, bw)
    per_block = tiles.sum(dim=(1, 3))
    assert ((per_block == 0) | (per_block == bh * bw)).all(), "a block is partly kept"
    n_blocks = per_block.numel()
    assert int((per_block > 0).sum()) == round((1 - sparsity) * n_blocks)
    norms = w.reshape(16 // bh, bh, 32 // bw, bw).norm(dim=(1, 3))
    kept = per_block > 0
    if kept.any() and (~kept).any():
        assert norms[kept].min() >= norms[~kept].max()


def test_block_chooses_heaviest_block():
    w = torch.full((4, 4), 0.1)
    w[2:, :2] = torch.tensor([[3.0, -3.0], [0.0, 0.0]])  # largest L2 norm, not largest entry count
    w[0, 2] = 4.0  # single big entry: norm 4.0 vs sqrt(18) = 4.24
    mask = sp.block_mask(w, 0.75, (2, 2))
    expected = torch.zeros(4, 4, dtype=torch.bool)
    expected[2:, :2] = True
    assert torch.equal(mask, expected)


def test_block_batched_over_leading_dims():
    w = _randn(3, 8, 8, seed=7)
    mask = sp.block_mask(w, 0.5, (4, 4))
    assert mask.shape == w.shape
    assert int(mask.sum()) == 6 * 16  # 12 blocks in all, 6 kept, ranked together


def test_block_errors():
    with pytest.raises(ValueError, match=r"\(6, 8\)"):
        sp.block_mask(torch.ones(6, 8), 0.5, (4, 4))
    with pytest.raises(ValueError):
        sp.block_mask(torch.ones(16), 0.5, (4, 4))
    with pytest.raises(ValueError):
        sp.block_mask(torch.ones(8, 8), 0.5, (0, 4))


# ------------------------------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan")])
def test_bad_sparsity(bad):
    for fn in (sp.magnitude_mask, sp.random_mask):
        with pytest.raises(ValueError, match="sparsity"):
            fn(torch.ones(4), bad)
    with pytest.raises(ValueError, match="sparsity"):
        sp.block_mask(torch.ones(4, 4), bad, (2, 2))


def test_non_float_and_non_tensor_inputs():
    with pytest.raises(TypeError, match="floating"):
        sp.magnitude_mask(torch.ones(4, dtype=torch.int64), 0.5)
    with pytest.raises(TypeError, match="floating"):
        sp.nm_mask(torch.ones(4, dtype=torch.bool), 2, 4)
    with pytest.raises(TypeError):
        sp.threshold_mask([1.0, 2.0], 0.5)
    with pytest.raises(TypeError):
        sp.magnitude_mask(torch.ones(4), "0.5")


@pytest.mark.parametrize("fmt", ["csr", "nm(2,4)", "bitmap"])
def test_an_already_sparse_weight_is_named(fmt):
    # n:m and bitmap SparseTensors read as strided: their pruning ended in a generic in-place error (helper-64).
    import scorch_backend as sb

    lin = torch.nn.Linear(8, 4)
    lin.weight = torch.nn.Parameter(sb.sparse(sp.nm_mask(lin.weight.detach(), 2, 4) * lin.weight.detach(), fmt))
    with pytest.raises(TypeError, match=f"got a SparseTensor in format {re.escape(fmt)}.*prune its dense form"):
        sb.prune(lin, "magnitude", 0.9)


# -------------------------------------------------------------------------------------------------- prune


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32),
        torch.nn.ReLU(),
        torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.LayerNorm(32)),
        torch.nn.Linear(32, 8),
    )


def test_prune_zeroes_in_place_and_bumps_version():
    model = _model()
    lin = model[0]
    weight_obj = lin.weight
    versions = {n: p._version for n, p in model.named_parameters()}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    masks = sp.prune(model, "magnitude", 0.75)
    assert set(masks) == {"0.weight", "2.0.weight", "3.weight"}
    assert lin.weight is weight_obj and lin.weight.requires_grad
    for name, p in model.named_parameters():
        if name in masks:
            assert p._version > versions[name]
            assert torch.equal(p.detach(), before[name] * masks[name])
            assert int((p != 0).sum()) == round(0.25 * p.numel())
            assert torch.equal(masks[name], sp.magnitude_mask(before[name], 0.75))
        else:  # biases and the LayerNorm are untouched
            assert p._version == versions[name] and torch.equal(p.detach(), before[name])


@pytest.mark.parametrize(
    "method,kwargs,per_weight_check",
    [
        ("threshold", {"threshold": 0.1}, lambda w, m: torch.equal(m, w.abs() > 0.1)),
        (
            "random",
            {"sparsity": 0.5, "generator": torch.Generator().manual_seed(0)},
            lambda w, m: int(m.sum()) == w.numel() // 2,
        ),
        ("n:m", {"n": 1, "m": 4}, lambda w, m: (m.reshape(-1, 4).sum(1) == 1).all()),
        ("block", {"sparsity": 0.5, "block": (8, 8)}, lambda w, m: int(m.sum()) == w.numel() // 2),
    ],
)
def test_prune_methods(method, kwargs, per_weight_check):
    model = _model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    masks = sp.prune(model, method, **kwargs)
    assert set(masks) == {"0.weight", "2.0.weight", "3.weight"}
    for name, mask in masks.items():
        assert per_weight_check(before[name], mask)
        assert torch.equal(model.get_parameter(name).detach(), before[name] * mask)


def test_prune_include_exclude_and_types():
    assert set(sp.prune(_model(), include="2.")) == {"2.0.weight"}
    assert set(sp.prune(_model(), include=["0", "3"])) == {"0.weight", "2.0.weight", "3.weight"}
    assert set(sp.prune(_model(), exclude=lambda name: name.startswith("2"))) == {"0.weight", "3.weight"}
    assert set(sp.prune(_model(), include=lambda n: n != "3", exclude="0")) == set()
    assert set(sp.prune(_model(), types=(torch.nn.LayerNorm,))) == {"2.1.weight"}
    model = _model()
    before = model[3].weight.detach().clone()
    version = model[3].weight._version
    sp.prune(model, exclude="3")
    assert model[3].weight._version == version and torch.equal(model[3].weight.detach(), before)


def test_prune_root_module_and_tied_weights():
    lin = torch.nn.Linear(8, 8)
    assert set(sp.prune(lin, sparsity=0.5)) == {"weight"}
    a, b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    b.weight = a.weight
    model = torch.nn.Sequential(a, b)
    g = torch.Generator().manual_seed(0)
    masks = sp.prune(model, "random", 0.5, generator=g)
    # Pruned once, not twice: half of the entries survive and both names report the same mask.
    assert masks["0.weight"] is masks["1.weight"]
    assert int((a.weight != 0).sum()) == 32


def test_prune_errors():
    with pytest.raises(ValueError, match="magnitude.*threshold.*random.*n:m.*block"):
        sp.prune(_model(), "movement")
    with pytest.raises(ValueError, match="threshold"):
        sp.prune(_model(), "threshold")
    with pytest.raises(ValueError, match="sparsity"):
        sp.prune(_model(), "magnitude", 1.2)
    with pytest.raises(ValueError, match="0.weight"):
        sp.prune(_model(), "n:m", n=2, m=5)  # 16 input features are not divisible by 5
    with pytest.raises(TypeError):
        sp.prune(torch.ones(3))
    model = _model()
    model[0].weight.data = model[0].weight.data.to(torch.float64)
    sp.prune(model, sparsity=0.5)  # float64 is fine
    assert math.isclose(float((model[0].weight == 0).double().mean()), 0.5)
