"""check_model: does a torch.compile backend compute what eager PyTorch computes, forward and backward?

    from model_check import check_model
    check_model(zoo.make("moe"), backend="scorch")                      # a zoo Case: its model and inputs
    check_model(model, (x,), backend="inductor", extra_inputs=[(x2,)])  # any module and inputs

The model is deep-copied twice: one copy runs eagerly, the other through torch.compile(copy, backend=...,
options=...). Both get the same inputs (inputs that require grad are cloned per copy, so their gradients can
be compared). Outputs are compared tensor by tensor (any nesting of tuples, lists and dicts, transformers'
output objects included). With train=True the loss is sum(out * w) over every floating output, w a fixed
random tensor per output, and the gradients of every parameter and of every input that requires grad are
compared too. Each entry of extra_inputs (another batch size, say) is then run through the same two copies
and compared again.

Tolerances depend on the dtype (float32: rtol 1e-4, atol 1e-5 times the larger of 1 and the reference's
largest magnitude); rtol/atol given explicitly are used as they are. A mismatch raises AssertionError naming
the tensor and giving the largest absolute difference.
"""

from __future__ import annotations

import contextlib
import copy
import math
from typing import Any, Iterable

import torch

# (rtol, atol) per dtype; atol is scaled by max(1, max|reference|) unless the caller gives one.
DEFAULT_TOLERANCES = {
    torch.float64: (1e-7, 1e-9),
    torch.float32: (1e-4, 1e-5),
    torch.bfloat16: (2e-2, 1e-2),
    torch.float16: (2e-3, 1e-3),
}


def _flatten(obj: Any, prefix: str = "out") -> list[tuple[str, Any]]:
    """(path, leaf) pairs of a nested output, in a fixed order."""
    if isinstance(obj, torch.Tensor):
        return [(prefix, obj)]
    if isinstance(obj, dict):  # also transformers' ModelOutput (an OrderedDict subclass)
        out = []
        for k, v in obj.items():
            out += _flatten(v, f"{prefix}.{k}")
        return out
    if isinstance(obj, (list, tuple)):
        out = []
        for i, v in enumerate(obj):
            out += _flatten(v, f"{prefix}[{i}]")
        return out
    return [(prefix, obj)]


def _dense(t: torch.Tensor) -> torch.Tensor:
    """A plain strided tensor with the same values (SparseTensors and torch sparse layouts densified)."""
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter and hasattr(t, "to_dense"):
        t = t.to_dense()
    elif t.layout != torch.strided:
        t = t.to_dense()
    return t.detach()


def _compare(name: str, ref: Any, got: Any, rtol: float | None, atol: float | None) -> float:
    """Assert that `got` matches `ref`; return the largest absolute difference (0 for non-tensors)."""
    if not isinstance(ref, torch.Tensor):
        assert not isinstance(got, torch.Tensor) and (ref == got or ref is got), \
            f"{name}: eager gave {ref!r}, compiled gave {got!r}"
        return 0.0
    assert isinstance(got, torch.Tensor), f"{name}: eager gave a tensor, compiled gave {type(got).__name__}"
    r, g = _dense(ref), _dense(got)
    assert tuple(r.shape) == tuple(g.shape), \
        f"{name}: shape {tuple(g.shape)} compiled vs {tuple(r.shape)} eager"
    assert r.dtype == g.dtype, f"{name}: dtype {g.dtype} compiled vs {r.dtype} eager"
    if not (r.is_floating_point() or r.is_complex()):
        bad = int((r != g).sum())
        assert bad == 0, f"{name}: {bad} of {r.numel()} entries differ ({r.dtype})"
        return 0.0
    if r.numel() == 0:
        return 0.0
    d_rtol, d_atol = DEFAULT_TOLERANCES.get(r.dtype, (1e-4, 1e-5))
    finite = torch.isfinite(r)
    scale = float(r[finite].abs().max()) if bool(finite.any()) else 1.0
    rt = d_rtol if rtol is None else rtol
    at = d_atol * max(1.0, scale) if atol is None else atol
    r64, g64 = r.double(), g.double()
    # NaN and +-inf must sit at the same places (nan_to_num maps each kind to its own stand-in value).
    nonfinite_r, nonfinite_g = ~finite, ~torch.isfinite(g64)
    same_nonfinite = torch.equal(nonfinite_r, nonfinite_g) and torch.equal(
        r64[nonfinite_r].nan_to_num(0.0), g64[nonfinite_g].nan_to_num(0.0))
    both = finite & torch.isfinite(g64)
    diff = (r64 - g64).abs()[both]
    max_diff = float(diff.max()) if diff.numel() else 0.0
    ok = same_nonfinite and bool(torch.allclose(g64, r64, rtol=rt, atol=at, equal_nan=True))
    if not ok:
        where = int((r64 - g64).abs().nan_to_num(math.inf).argmax())
        raise AssertionError(
            f"{name}: compiled differs from eager: max abs difference {max_diff:.3g} (largest at flat index "
            f"{where}: eager {float(r64.reshape(-1)[where]):.6g}, "
            f"compiled {float(g64.reshape(-1)[where]):.6g}); "
            f"rtol {rt:g}, atol {at:.3g}, max |eager| {scale:.3g}, shape {tuple(r.shape)}, {r.dtype}"
            + ("" if same_nonfinite else "; NaN/inf positions differ"))
    return max_diff


def _prepare(inputs: tuple) -> tuple:
    """Per-copy inputs: tensors that require grad become fresh leaves (same values), the rest are shared."""
    out = []
    for x in inputs:
        if isinstance(x, torch.Tensor) and x.requires_grad:
            x = x.detach().clone().requires_grad_(True)
        out.append(x)
    return tuple(out)


def _loss(out: Any, seed: int = 1234) -> torch.Tensor | None:
    """sum over floating outputs of (out * w).sum(), w a fixed random tensor of the output's shape."""
    g = torch.Generator().manual_seed(seed)
    total = None
    for _, t in _flatten(out):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or not t.requires_grad:
            continue
        w = torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.dtype)
        term = (_dense_keep_grad(t) * w).sum()
        total = term if total is None else total + term
    return total


def _dense_keep_grad(t: torch.Tensor) -> torch.Tensor:
    """A sparse output (a SparseTensor or a torch sparse layout) as dense, still attached to the graph."""
    if (type(t) is not torch.Tensor and hasattr(t, "to_dense")) or t.layout != torch.strided:
        return t.to_dense()
    return t


def _run_and_compare(eager, compiled, inputs: tuple, train: bool, rtol, atol, tag: str) -> dict:
    report = {}
    ins_e, ins_c = _prepare(inputs), _prepare(inputs)
    if train:
        for m in (eager, compiled):
            m.zero_grad(set_to_none=True)
    out_e = eager(*ins_e)
    out_c = compiled(*ins_c)
    flat_e, flat_c = _flatten(out_e), _flatten(out_c)
    assert [p for p, _ in flat_e] == [p for p, _ in flat_c], \
        f"{tag}: output structure differs: eager {[p for p, _ in flat_e]}, compiled {[p for p, _ in flat_c]}"
    for (path, r), (_, g) in zip(flat_e, flat_c):
        report[f"{tag}:{path}"] = _compare(f"{tag}: {path}", r, g, rtol, atol)
    if not train:
        return report
    loss_e, loss_c = _loss(out_e), _loss(out_c)
    assert (loss_e is None) == (loss_c is None), f"{tag}: only one of eager/compiled outputs requires grad"
    if loss_e is None:
        raise AssertionError(f"{tag}: train=True but no floating output requires grad")
    loss_e.backward()
    loss_c.backward()
    params_e = dict(eager.named_parameters())
    params_c = dict(_module_of(compiled).named_parameters())
    assert params_e.keys() == params_c.keys(), f"{tag}: parameter names differ"
    for name, pe in params_e.items():
        pc = params_c[name]
        if pe.grad is None:
            assert pc.grad is None or not bool(_dense(pc.grad).any()), \
                f"{tag}: grad of {name}: eager has none, compiled has a nonzero one"
            continue
        assert pc.grad is not None, f"{tag}: grad of {name}: compiled has none, eager has one"
        report[f"{tag}:grad {name}"] = _compare(f"{tag}: grad of parameter {name}", pe.grad, pc.grad,
                                                rtol, atol)
    for i, (xe, xc) in enumerate(zip(ins_e, ins_c)):
        if isinstance(xe, torch.Tensor) and xe.requires_grad:
            assert (xe.grad is None) == (xc.grad is None), f"{tag}: grad of input {i} missing on one side"
            if xe.grad is not None:
                report[f"{tag}:grad input {i}"] = _compare(f"{tag}: grad of input {i}", xe.grad, xc.grad,
                                                           rtol, atol)
    return report


def _module_of(compiled) -> torch.nn.Module:
    return getattr(compiled, "_orig_mod", compiled)


def check_model(case_or_model, inputs: tuple | None = None, *, backend: Any = "scorch",
                options: dict | None = None, train: bool | None = None, rtol: float | None = None,
                atol: float | None = None, extra_inputs: Iterable[tuple] = ()) -> dict:
    """Compare `torch.compile(model, backend=backend, options=options)` with eager on `inputs`, then on each
    of `extra_inputs`; return {what: max abs difference}. `case_or_model` is a zoo Case (its inputs and
    `trainable` are the defaults) or an nn.Module. train=None means the Case's `trainable` (True for a
    module).
    Resets torch._dynamo first, so compiled code of an earlier model cannot be reused by accident."""
    if hasattr(case_or_model, "model") and hasattr(case_or_model, "inputs"):
        model = case_or_model.model
        if inputs is None:
            inputs = case_or_model.inputs
        if train is None:
            train = bool(case_or_model.trainable)
    else:
        model = case_or_model
        if train is None:
            train = True
    if inputs is None:
        raise TypeError("check_model needs inputs (or a zoo Case that has them)")
    if not isinstance(inputs, tuple):
        inputs = tuple(inputs) if isinstance(inputs, list) else (inputs,)
    if train and not torch.is_grad_enabled():
        raise ValueError("check_model(train=True) under torch.no_grad(): pass train=False")
    torch._dynamo.reset()
    eager = copy.deepcopy(model)
    kwargs = {"backend": backend}
    if options is not None:
        kwargs["options"] = options
    compiled = torch.compile(copy.deepcopy(model), **kwargs)
    report = _run_and_compare(eager, compiled, inputs, train, rtol, atol, "inputs")
    for k, extra in enumerate(extra_inputs):
        if not isinstance(extra, tuple):
            extra = tuple(extra) if isinstance(extra, list) else (extra,)
        report.update(_run_and_compare(eager, compiled, extra, train, rtol, atol, f"extra_inputs[{k}]"))
    return report


@contextlib.contextmanager
def recorded_reports():
    """The backend's GraphReports of the graphs compiled inside the block (regions, decisions), in a list."""
    from scorch_backend.compiler import backend

    reports: list = []
    backend._recorders.append(reports)
    try:
        yield reports
    finally:
        backend._recorders.remove(reports)
