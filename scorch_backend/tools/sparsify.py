"""Sparsifiers: masks that say which weights to keep, and `prune()` to apply them to a model.

    import scorch_backend.tools.sparsify as sp
    mask = sp.magnitude_mask(w, 0.9)          # keep the 10% of entries with the largest |w|
    mask = sp.threshold_mask(w, 1e-3)         # keep |w| > 1e-3
    mask = sp.random_mask(w, 0.9, generator=g)
    mask = sp.nm_mask(w, 2, 4)                # 2:4 along the last dimension
    mask = sp.block_mask(w, 0.75, (4, 4))     # keep the 25% of 4x4 blocks with the largest L2 norm
    masks = sp.prune(model, "magnitude", 0.9)  # {"layer.weight": mask}, weights zeroed in place

Every mask is a bool tensor of the weight's shape and device, True where the entry is kept. Masks are computed
on |w| only and never change w; `prune()` is the one function with side effects. Keep counts are
round((1 - sparsity) * count) with Python's round, where count is the number of entries (or of blocks for
`block_mask`). Ties in |w| are broken by position: the entry (or block) that comes first in row-major order
wins. NaN ranks above every number, so NaN weights are kept (and stay visible) rather than silently pruned.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Union

import torch

__all__ = ["METHODS", "block_mask", "magnitude_mask", "nm_mask", "prune", "random_mask", "threshold_mask"]

METHODS = ("magnitude", "threshold", "random", "n:m", "block")

NameFilter = Union[str, Callable[[str], bool], Iterable[Union[str, Callable[[str], bool]]]]


# ----------------------------------------------------------------------------------------------- checks


def _check_weight(w, what: str = "w") -> torch.Tensor:
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(w).__name__}")
    from ..tensors.sparse_tensor import SparseTensor  # (tools sit above tensors: imported where used)

    if isinstance(w, SparseTensor):  # (an n:m or bitmap one reads as strided)
        raise TypeError(f"{what} must be a dense (strided) tensor, got a SparseTensor in format {w.format.name}: "
                        "prune its dense form (w.to_dense()) and store the result sparse again")
    if w.layout != torch.strided:
        raise TypeError(f"{what} must be a dense (strided) tensor, got layout {w.layout}")
    if not (w.is_floating_point() or w.is_complex()):
        raise TypeError(f"{what} must be a floating-point tensor, got dtype {w.dtype}")
    return w.detach()


def _check_sparsity(sparsity) -> float:
    if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)):
        raise TypeError(f"sparsity must be a number in [0, 1], got {sparsity!r}")
    s = float(sparsity)
    if not 0.0 <= s <= 1.0:  # also rejects NaN
        raise ValueError(f"sparsity must be in [0, 1], got {sparsity!r}")
    return s


def _keep_count(count: int, sparsity: float) -> int:
    # Python's round(): half to even, so 0.5 * 5 keeps 2 entries.
    return min(count, max(0, round((1.0 - sparsity) * count)))


def _top_k_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """True at the k largest scores; ties go to the lower flat index (stable sort)."""
    flat = scores.reshape(-1)
    mask = torch.zeros(flat.numel(), dtype=torch.bool, device=flat.device)
    if k > 0:
        order = torch.sort(flat, descending=True, stable=True).indices
        mask[order[:k]] = True
    return mask.view(scores.shape)


# ------------------------------------------------------------------------------------------------ masks


def magnitude_mask(w: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Keep the round((1 - sparsity) * numel) entries with the largest |w|."""
    w = _check_weight(w)
    s = _check_sparsity(sparsity)
    return _top_k_mask(w.abs(), _keep_count(w.numel(), s))


def threshold_mask(w: torch.Tensor, threshold: float) -> torch.Tensor:
    """Keep the entries with |w| > threshold (strictly greater), and NaNs."""
    w = _check_weight(w)
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or math.isnan(threshold):
        raise TypeError(f"threshold must be a number, got {threshold!r}")
    a = w.abs()
    return (a > threshold) | a.isnan()


def random_mask(w: torch.Tensor, sparsity: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Keep a uniformly random subset of exactly round((1 - sparsity) * numel) entries."""
    w = _check_weight(w)
    s = _check_sparsity(sparsity)
    k = _keep_count(w.numel(), s)
    # randperm draws on the generator's device; the chosen indices then move to w's device.
    gen_device = generator.device if generator is not None else torch.device("cpu")
    picked = torch.randperm(w.numel(), generator=generator, device=gen_device)[:k].to(w.device)
    mask = torch.zeros(w.numel(), dtype=torch.bool, device=w.device)
    mask[picked] = True
    return mask.view(w.shape)


def nm_mask(w: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """In each group of m consecutive entries along the last dimension keep the n with the largest |w|."""
    w = _check_weight(w)
    for name, v in (("n", n), ("m", m)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {v!r}")
    if not 0 <= n <= m or m < 1:
        raise ValueError(f"n:m needs 0 <= n <= m and m >= 1, got {n}:{m}")
    if w.dim() == 0 or w.shape[-1] % m != 0:
        raise ValueError(
            f"n:m pruning with m={m} needs the last dimension divisible by {m}, got shape {tuple(w.shape)}"
        )
    groups = w.abs().reshape(-1, m)
    mask = torch.zeros(groups.shape, dtype=torch.bool, device=w.device)
    if n > 0:
        # Stable sort within each group: equal magnitudes keep the earlier position.
        order = torch.sort(groups, dim=1, descending=True, stable=True).indices[:, :n]
        mask.scatter_(1, order, True)
    return mask.view(w.shape)


def block_mask(w: torch.Tensor, sparsity: float, block: tuple[int, int] = (4, 4)) -> torch.Tensor:
    """Keep the top (1 - sparsity) fraction of bh x bw blocks of the last two dimensions, scored by L2 norm.

    Leading dimensions are a batch of matrices; all their blocks compete in one ranking.
    """
    w = _check_weight(w)
    s = _check_sparsity(sparsity)
    if (
        not isinstance(block, (tuple, list))
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block)
    ):
        raise ValueError(f"block must be a pair of positive ints (bh, bw), got {block!r}")
    bh, bw = block
    if w.dim() < 2:
        raise ValueError(
            f"block pruning needs a tensor with at least 2 dimensions, got shape {tuple(w.shape)}"
        )
    rows, cols = w.shape[-2], w.shape[-1]
    if rows % bh or cols % bw:
        raise ValueError(
            f"block pruning with block {bh}x{bw} needs the last two dimensions divisible by it, "
            f"got shape {tuple(w.shape)}"
        )
    lead = w.shape[:-2]
    tiles = w.reshape(*lead, rows // bh, bh, cols // bw, bw)
    # Squared norms rank like norms and avoid a sqrt; abs() first makes this right for complex weights too.
    scores = tiles.abs().square().sum(dim=(-3, -1))  # (*lead, rows/bh, cols/bw)
    keep = _top_k_mask(scores, _keep_count(scores.numel(), s))
    return keep[..., :, None, :, None].expand(tiles.shape).reshape(w.shape)


# ------------------------------------------------------------------------------------------------ prune


def _name_matcher(spec: NameFilter | None, what: str) -> Callable[[str], bool] | None:
    if spec is None:
        return None
    items = [spec] if isinstance(spec, str) or callable(spec) else list(spec)
    for item in items:
        if not (isinstance(item, str) or callable(item)):
            raise TypeError(
                f"{what} must be a substring, a callable(name) -> bool, or a list of them; got {item!r}"
            )

    def matches(name: str) -> bool:
        return any((item in name) if isinstance(item, str) else bool(item(name)) for item in items)

    return matches


def prune(
    model: torch.nn.Module,
    method: str = "magnitude",
    sparsity: float = 0.9,
    *,
    n: int = 2,
    m: int = 4,
    block: tuple[int, int] = (4, 4),
    threshold: float | None = None,
    types: type | tuple[type, ...] = (torch.nn.Linear,),
    include: NameFilter | None = None,
    exclude: NameFilter | None = None,
    generator: torch.Generator | None = None,
) -> dict[str, torch.Tensor]:
    """Zero the pruned weights of every matching submodule in place; return {qualified weight name: mask}.

    A submodule matches when it is an instance of `types`, its qualified name passes `include` (if given) and
    does not pass `exclude`. A filter is a substring, a callable(name) -> bool, or a list of them (any match).
    Each weight is pruned on its own (the sparsity is per layer, not global). A weight shared by several
    modules is pruned once and reported under each name with the same mask.
    """
    if method not in METHODS:
        raise ValueError(f"unknown pruning method {method!r}; known methods: {', '.join(METHODS)}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if method in ("magnitude", "random", "block"):
        _check_sparsity(sparsity)
    if method == "threshold" and threshold is None:
        raise ValueError('method "threshold" needs threshold=<number>')
    want = _name_matcher(include, "include")
    drop = _name_matcher(exclude, "exclude")

    def make_mask(w: torch.Tensor) -> torch.Tensor:
        if method == "magnitude":
            return magnitude_mask(w, sparsity)
        if method == "threshold":
            return threshold_mask(w, threshold)
        if method == "random":
            return random_mask(w, sparsity, generator=generator)
        if method == "n:m":
            return nm_mask(w, n, m)
        return block_mask(w, sparsity, block)

    masks: dict[str, torch.Tensor] = {}
    done: dict[int, torch.Tensor] = {}  # id(weight) -> mask, for weights tied between modules
    for name, module in model.named_modules(remove_duplicate=False):
        if not isinstance(module, types):
            continue
        if want is not None and not want(name):
            continue
        if drop is not None and drop(name):
            continue
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor):
            continue  # e.g. LayerNorm(elementwise_affine=False)
        key = f"{name}.weight" if name else "weight"
        if id(weight) in done:
            masks[key] = done[id(weight)]
            continue
        try:
            mask = make_mask(weight)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{key}: {e}") from e
        with torch.no_grad():
            # In place: the parameter object (and optimizer state keyed by it) stays, its version moves.
            weight.mul_(mask)
        done[id(weight)] = mask
        masks[key] = mask
    return masks
