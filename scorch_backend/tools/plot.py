"""Pictures of where the nonzeros are.

    from scorch_backend.tools.plot import plot_patterns
    plot_patterns({"fc1": model.fc1.weight, "A": A}, "patterns.png")

One PNG, one spy-style panel per tensor (black = nonzero), each titled with its name, shape and density.
Tensors are drawn as matrices the way `scorch_backend.compiler.measure` sees them (leading dimensions
flattened into rows, 0-D and 1-D as one row). A matrix larger than max_pixels on a side is shown max-pooled:
a pixel is black when any entry it covers is nonzero, so isolated nonzeros never vanish. Only this module
needs matplotlib.
"""

from __future__ import annotations

import math
import os
import tempfile

import torch
import torch.nn.functional as F

from ..compiler.measure import as_matrix

__all__ = ["plot_patterns"]

_PANEL_INCHES = 3.6
_MAX_COLUMNS = 4


def _pooled_indicator(x: torch.Tensor, max_pixels: int) -> tuple[torch.Tensor, int, int]:
    """The nonzero indicator of a 2-D tensor max-pooled to at most max_pixels a side, and the pool factors."""
    rows, cols = x.shape
    nz = x != 0
    fr = max(1, math.ceil(rows / max_pixels))
    fc = max(1, math.ceil(cols / max_pixels))
    if fr > 1 or fc > 1:
        # Pad with zeros to whole pooling windows; zeros cannot turn a pixel on.
        pr, pc = (-rows) % fr, (-cols) % fc
        u8 = F.pad(nz.view(torch.uint8), (0, pc, 0, pr))
        nz = u8.view(u8.shape[0] // fr, fr, u8.shape[1] // fc, fc).amax(dim=(1, 3)).bool()
    return nz.cpu(), fr, fc


def plot_patterns(tensors: dict, path: str | os.PathLike, max_pixels: int = 512) -> str:
    """Draw the nonzero pattern of each named tensor into one PNG at `path`; return the path.

    Values may be torch tensors or anything with `to_dense()` (SparseTensor, torch sparse tensors). The PNG is
    written to a temporary file in the same directory and renamed into place: readers never see half a file.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError as e:
        raise ImportError(
            "scorch_backend.tools.plot needs matplotlib: install it with `pip install matplotlib`"
        ) from e

    if not isinstance(tensors, dict) or not tensors:
        raise ValueError("tensors must be a non-empty dict {name: tensor}")
    if isinstance(max_pixels, bool) or not isinstance(max_pixels, int) or max_pixels < 1:
        raise ValueError(f"max_pixels must be a positive int, got {max_pixels!r}")
    path = os.fspath(path)

    panels = []
    for name, t in tensors.items():
        x = as_matrix(t)
        shape = tuple(t.shape) if hasattr(t, "shape") else tuple(x.shape)
        numel = x.numel()
        density = int(torch.count_nonzero(x).item()) / numel if numel else 0.0
        img, fr, fc = _pooled_indicator(x, max_pixels) if numel else (None, 1, 1)
        panels.append((str(name), shape, x.shape, density, img, fr, fc))

    ncols = min(_MAX_COLUMNS, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    # A Figure with an explicit Agg canvas: no pyplot, so no global backend switch and no figure registry.
    fig = Figure(figsize=(_PANEL_INCHES * ncols, _PANEL_INCHES * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_axis_off()
    for ax, (name, shape, (rows, cols), density, img, fr, fc) in zip(axes.flat, panels):
        title = f"{name}\n{shape}  density {density:.3g}"
        if fr > 1 or fc > 1:
            title += f"\n(max-pooled {fr}x{fc})"
        ax.set_title(title, fontsize=9)
        if img is None:
            ax.text(0.5, 0.5, "no entries", ha="center", va="center", transform=ax.transAxes)
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        # extent in entry coordinates, so the axis ticks are row and column indices even when pooled.
        ax.imshow(
            img.to(torch.uint8).numpy(),
            cmap="Greys",
            vmin=0,
            vmax=1,
            interpolation="nearest",
            aspect="auto",
            extent=(-0.5, cols - 0.5, rows - 0.5, -0.5),
        )
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        if rows == 1:
            ax.set_yticks([])
        ax.tick_params(labelsize=7)

    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".plot-", suffix=".png", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format="png", dpi=100)
        os.chmod(tmp, 0o644)  # mkstemp makes the file owner-only; a picture is for everyone to read
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path
