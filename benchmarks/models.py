#!/usr/bin/env python
"""Whole models from the zoo (scorch_backend/tools/zoo.py): torch.compile(backend="scorch") against eager,
Inductor, torch.sparse and PyG.

    .venv/bin/python benchmarks/models.py --quick      # smoke run: the zoo's test sizes, GCN on Cora only
    .venv/bin/python benchmarks/models.py              # benchmark sizes; JSON: benchmarks/results/models.json
    .venv/bin/python benchmarks/models.py --models gcn,moe --modes inference --repeat 20

For every model (bench sizes) and mode, inference (forward under torch.no_grad, eval mode) and training
(forward, loss = sum of the outputs, backward; train mode except for eval-only models), the contenders are:

    eager             the model as written (dense)
    inductor          torch.compile(model), PyTorch's default backend (dense)
    torch_sparse_csr  GCN: the adjacency as torch.sparse_csr through torch.sparse.mm;
                      pruned MLP and BERT: pruned Linear weights as torch.sparse CSR (F.linear), inference
                      only
    torch_sparse_coo  GCN: the adjacency as torch.sparse_coo through torch.sparse.mm
    pyg               GCN: two torch_geometric GCNConv layers (normalize=False, same weights), when
                      torch_geometric imports

The pyg_gcn row is PyG's own model: two GCNConv layers (normalize=False) on Cora. There "eager" is eager
PyG on (edge_index, edge_weight), "inductor" the same compiled by Inductor, torch_sparse_csr eager PyG on a
torch.sparse CSR adj_t, and "scorch" the PyG model compiled with backend="scorch" on a Scorch CSR adj_t;
its target is Scorch >= 1.5x eager PyG (forward + backward).
    scorch            torch.compile(model, backend="scorch"); a failure is recorded in the table, not fatal

All contenders run in one process with the same torch.set_num_threads(--threads). Every model copy is called
once before timing (that first call, which compiles, is reported as first_call_s); the time is the median of
--repeat calls after --warmup calls, the contenders' calls alternated so that load from another process falls on
all of them alike (scorch_backend.tools.timing.measure_interleaved). Speedups are Inductor's time / the
contender's time (>1: faster than Inductor), and for GCN also the faster torch.sparse layout's time / the
contender's time. Each contender's inference output is checked against eager's (largest difference relative
to the largest |output|).
"""

from __future__ import annotations

import argparse
import copy
import gc
import math
import os
import pathlib
import platform
import sys
import time
import traceback
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import scorch_backend as sb
from scorch_backend.tools.timing import add_baseline_isa_argument, hold_baseline_isa
from scorch_backend.tools import zoo
from scorch_backend.tools.timing import contention_probe, measure_interleaved
from scorch_backend.tools.timing import OtherLoad, fmt_ratio, fmt_time, save_json

HERE = pathlib.Path(__file__).resolve().parent
MODELS = tuple(zoo.CASES) + ("pyg_gcn",)
GCN_DATASETS = ("cora", "citeseer", "pubmed")
CONTENDERS = ("eager", "inductor", "torch_sparse_csr", "torch_sparse_coo", "pyg", "scorch")
MODES = ("inference", "training")
CHECK_RTOL = 1e-3  # allowed max|diff| / max|eager output| for a contender's inference output


def log(*a):
    print(*a, flush=True)


def one_line(e: BaseException, limit: int = 300) -> str:
    text = f"{type(e).__name__}: {e}".strip().replace("\n", " | ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ----------------------------------------------------------------------------------------------------------
# contenders


class SparseMMGCN(zoo.GCN):
    """zoo.GCN with every adjacency product written as torch.sparse.mm (for a torch.sparse adjacency)."""

    def forward(self, x, adj):
        h = torch.relu(torch.sparse.mm(adj, x @ self.w1) + self.b1)
        return torch.sparse.mm(adj, h @ self.w2) + self.b2


class CSRLinear(nn.Module):
    """A Linear whose (pruned) weight is stored as torch.sparse CSR; F.linear multiplies with it."""

    def __init__(self, lin: nn.Linear):
        super().__init__()
        self.register_buffer("weight", lin.weight.detach().to_sparse_csr())
        self.register_buffer("bias", None if lin.bias is None else lin.bias.detach().clone())

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


def with_csr_linears(model: nn.Module, min_sparsity: float = 0.5) -> tuple[nn.Module, int]:
    """A copy of `model` with each nn.Linear whose weight is at least `min_sparsity` zeros replaced by a
    CSRLinear; also returns how many were replaced."""
    model = copy.deepcopy(model)
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and float((child.weight == 0).float().mean()) >= min_sparsity:
                setattr(parent, name, CSRLinear(child))
                swapped += 1
    return model, swapped


class PygGCN(nn.Module):
    """The zoo GCN as two torch_geometric GCNConv layers on (edge_index, edge_weight), the same weights."""

    def __init__(self, ref: zoo.GCN):
        super().__init__()
        from torch_geometric.nn import GCNConv

        nfeat, nhid = ref.w1.shape
        nclass = ref.w2.shape[1]
        self.conv1 = GCNConv(nfeat, nhid, normalize=False, add_self_loops=False)
        self.conv2 = GCNConv(nhid, nclass, normalize=False, add_self_loops=False)
        with torch.no_grad():
            self.conv1.lin.weight.copy_(ref.w1.t())
            self.conv1.bias.copy_(ref.b1)
            self.conv2.lin.weight.copy_(ref.w2.t())
            self.conv2.bias.copy_(ref.b2)

    def forward(self, x, edge_index, edge_weight):
        h = torch.relu(self.conv1(x, edge_index, edge_weight))
        return self.conv2(h, edge_index, edge_weight)


class PygAdjGCN(PygGCN):
    """PygGCN with the adjacency as one sparse argument, PyG's adj_t (torch.sparse or a Scorch SparseTensor)."""

    def forward(self, x, adj_t):
        h = torch.relu(self.conv1(x, adj_t))
        return self.conv2(h, adj_t)


def pyg_gcn_case(data) -> zoo.Case:
    """The pyg_gcn row: the zoo's GCN on Cora (weights, features, normalized adjacency), run as PyG's model."""
    why = pyg_available()
    if why is not None:
        raise RuntimeError(why)
    case = zoo.make("gcn", "bench", dataset="cora", data=data)
    return zoo.Case("pyg_gcn/cora", case.model, case.inputs, None, True,
                    "two torch_geometric GCNConv layers (normalize=False); " + case.notes, case.size,
                    dict(case.info))


def pyg_available() -> str | None:
    """None when torch_geometric's GCNConv imports, else why not."""
    try:
        from torch_geometric.nn import GCNConv  # noqa: F401
    except Exception as e:  # ImportError, or a missing optional dependency of torch_geometric
        return f"torch_geometric not usable: {one_line(e, 160)}"
    return None


def build_contenders(case: zoo.Case, mode: str) -> tuple[dict, dict]:
    """({contender: (model, inputs)}, {contender: why skipped}) for one case and mode. Model objects are new
    copies (compiled ones wrapped by torch.compile), so no compiled state is shared between modes."""
    c: dict = {}
    skipped: dict = {}
    base = case.model
    inputs = case.inputs
    c["eager"] = (copy.deepcopy(base), inputs)
    c["inductor"] = (torch.compile(copy.deepcopy(base)), inputs)
    kind = case.name.split("/")[0]
    if kind == "pyg_gcn":
        x, A = inputs
        coo = A.to_torch(torch.sparse_coo).coalesce()
        # adj_t[i, j] is the edge j -> i; clones, since Dynamo cannot take views of a sparse tensor's members
        edge_index, edge_weight = coo.indices().flip(0).clone(), coo.values().clone()
        c["eager"] = (PygGCN(base), (x, edge_index, edge_weight))
        c["inductor"] = (torch.compile(PygGCN(base)), (x, edge_index, edge_weight))
        c["torch_sparse_csr"] = (PygAdjGCN(base), (x, A.to_torch(torch.sparse_csr)))
        c["scorch"] = (torch.compile(PygAdjGCN(base), backend="scorch"), (x, A))
        return c, skipped
    if kind == "gcn":
        x, A = inputs
        for layout, key in ((torch.sparse_csr, "torch_sparse_csr"), (torch.sparse_coo, "torch_sparse_coo")):
            m = SparseMMGCN(base.w1.shape[0], base.w1.shape[1], base.w2.shape[1], torch.Generator())
            m.load_state_dict(base.state_dict())
            c[key] = (m, (x, A.to_torch(layout)))
        why = pyg_available()
        if why is None:
            coo = A.to_torch(torch.sparse_coo).coalesce()
            c["pyg"] = (PygGCN(base), (x, coo.indices(), coo.values()))
        else:
            skipped["pyg"] = why
    elif kind in ("pruned_mlp", "bert_encoder"):
        if mode == "inference":
            m, n = with_csr_linears(base)
            c["torch_sparse_csr"] = (m, inputs)
            if n == 0:
                skipped["torch_sparse_csr"] = "no pruned Linear found"
                del c["torch_sparse_csr"]
        else:
            skipped["torch_sparse_csr"] = "inference only (CSR weights are buffers: no training path)"
    try:
        c["scorch"] = (torch.compile(copy.deepcopy(base), backend="scorch"), inputs)
    except Exception as e:  # e.g. the backend is not registered yet
        skipped["scorch"] = f"FAILED: {one_line(e)}"
    return c, skipped


# ----------------------------------------------------------------------------------------------------------
# running


def outputs_of(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in outputs_of(v)]
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in outputs_of(v)]
    return []


def dense(t: torch.Tensor) -> torch.Tensor:
    if type(t) is not torch.Tensor or t.layout != torch.strided:
        t = t.to_dense()
    return t.detach()


def attached_dense(t: torch.Tensor) -> torch.Tensor:
    """A sparse output as a dense tensor that stays in the autograd graph."""
    return t.to_dense() if type(t) is not torch.Tensor or t.layout != torch.strided else t


def make_step(model: nn.Module, inputs: tuple, mode: str, eval_only: bool):
    if mode == "inference":
        model.eval()

        def step():
            with torch.no_grad():
                return model(*inputs)
    else:
        model.train(not eval_only)
        params = [p for p in model.parameters() if p.requires_grad]

        def step():
            for p in params:
                p.grad = None
            out = model(*inputs)
            loss = sum(attached_dense(t).float().sum() for t in outputs_of(out) if t.is_floating_point())
            loss.backward()
            return out
    return step


def compare(out, ref) -> tuple[float, bool, str]:
    """(max|diff| / max|ref| over all outputs, ok, detail)."""
    got, want = outputs_of(out), outputs_of(ref)
    if len(got) != len(want):
        return math.inf, False, f"{len(got)} outputs vs eager's {len(want)}"
    worst = 0.0
    for g, r in zip(got, want):
        g, r = dense(g).double(), dense(r).double()
        if g.shape != r.shape:
            return math.inf, False, f"shape {tuple(g.shape)} vs eager's {tuple(r.shape)}"
        scale = float(r.abs().max()) if r.numel() else 0.0
        err = float((g - r).abs().max()) if r.numel() else 0.0
        if not math.isfinite(err):
            return math.inf, False, "non-finite difference"
        worst = max(worst, err / max(scale, 1e-12))
    return worst, worst <= CHECK_RTOL, f"max|diff|/max|eager| {worst:.2e}"


def run_mode(case: zoo.Case, mode: str, args) -> dict:
    """One case in one mode: every contender's first call (which compiles; checked against eager's output at
    inference), then all contenders timed in alternation (`measure_interleaved`), so that load from another
    process on a shared machine falls on every contender alike."""
    eval_only = bool(case.info.get("eval"))
    row = {"model": case.name, "mode": mode, "size": case.size, "info": case.info, "notes": case.notes,
           "contenders": {}, "skipped": {}}
    contenders, skipped = build_contenders(case, mode)
    row["skipped"].update(skipped)
    ref = None
    steps, keep = {}, []
    for name in CONTENDERS:
        if name not in contenders:
            continue
        model, inputs = contenders.pop(name)
        res = {}
        try:
            step = make_step(model, inputs, mode, eval_only)
            t = time.perf_counter()
            out = step()
            res["first_call_s"] = time.perf_counter() - t
            if mode == "inference":
                if name == "eager":
                    ref = out
                elif ref is not None:
                    err, ok, detail = compare(out, ref)
                    res["check"] = {"ok": ok, "rel_err": err, "detail": detail}
            del out
            steps[name] = step
            keep.append((model, inputs))
            row["contenders"][name] = res
        except Exception as e:  # a failing contender is a result, not the end of the run
            row["skipped"][name] = f"FAILED: {one_line(e)}"
            if args.verbose:
                traceback.print_exc()
        del model, inputs
    ref = None
    gc.collect()
    # Fast steps get extra samples (up to 50 x repeat, for a twentieth of the budget).
    timings, failed = measure_interleaved(steps, warmup=args.warmup, repeat=args.repeat, budget=args.budget,
                                          min_time=args.budget / 20)
    for name, e in failed.items():
        row["contenders"].pop(name, None)
        row["skipped"][name] = f"FAILED: {one_line(e)}"
    for name, timing in timings.items():
        row["contenders"][name].update(timing.to_dict(with_samples=True))
    del steps, keep
    gc.collect()
    add_ratios(row)
    return row


def add_ratios(row: dict) -> None:
    times = {k: v["median_s"] for k, v in row["contenders"].items()}
    ind = times.get("inductor")
    sparse = [times[k] for k in ("torch_sparse_csr", "torch_sparse_coo") if k in times]
    best_sparse = min(sparse) if sparse else None
    eager = times.get("eager")
    for v in row["contenders"].values():
        v["speedup_vs_inductor"] = ind / v["median_s"] if ind else None
        if row["model"].startswith("pyg_gcn") and eager:
            v["speedup_vs_eager"] = eager / v["median_s"]
        if row["model"].startswith("gcn") and best_sparse:
            v["speedup_vs_torch_sparse"] = best_sparse / v["median_s"]


# ----------------------------------------------------------------------------------------------------------
# targets (from the issue): what Scorch must reach


def targets_for(row: dict) -> list[dict]:
    """The targets that apply to a row, each with Scorch's value and whether it is reached."""
    kind = row["model"].split("/")[0]
    s = row["contenders"].get("scorch")
    out = []

    def add(text, value, goal):
        out.append({"model": row["model"], "mode": row["mode"], "target": text, "goal": goal, "value": value,
                    "reached": None if value is None else bool(value >= goal)})

    if kind == "pyg_gcn" and row["mode"] == "training":
        add("PyG GCNConv on Cora, forward + backward: Scorch >= 1.5x eager PyG",
            s.get("speedup_vs_eager") if s else None, 1.5)
    if kind == "gcn":
        add(f"{row['model']}: Scorch >= 2x the faster torch.sparse layout",
            s.get("speedup_vs_torch_sparse") if s else None, 2.0)
    elif kind in ("moe", "moe16"):
        n = row["info"].get("n_experts", 1)
        add(f"MoE ({n} experts): Scorch >= 0.5 x n_experts = {0.5 * n:g}x dense Inductor",
            s.get("speedup_vs_inductor") if s else None, 0.5 * n)
    elif kind == "bert_encoder" and row["mode"] == "inference":
        add(f"BERT 90% pruned, batch {row['info'].get('batch')}, seq {row['info'].get('seq')}: Scorch >= "
            "1.5x dense Inductor", s.get("speedup_vs_inductor") if s else None, 1.5)
    elif kind == "relu_mlp_sparse":
        add(f"MLP with {row['info'].get('activation_zeros', 0):.0%} zeros in its ReLU output, batch "
            f"{row['info'].get('batch')}: Scorch >= 1.5x dense Inductor", s.get("speedup_vs_inductor") if s else None,
            1.5)
    elif kind == "sparse_autoencoder" and row["mode"] == "training":
        add("sparse autoencoder, training: Scorch >= 2x dense Inductor", s.get("speedup_vs_inductor") if s else None,
            2.0)
    elif kind == "block_sparse_attention":
        add(f"block-sparse attention ({row['info'].get('mask_sparsity', 0):.0%} masked): Scorch >= 3x dense "
            "masked attention (Inductor)", s.get("speedup_vs_inductor") if s else None, 3.0)
    return out


# ----------------------------------------------------------------------------------------------------------
# report


def print_table(rows: list[dict]) -> None:
    cols = CONTENDERS
    hdr = f"{'model':<24} {'mode':<9} " + " ".join(f"{c:>19}" for c in cols)
    log(hdr)
    log("-" * len(hdr))
    for r in rows:
        cells = []
        for c in cols:
            v = r["contenders"].get(c)
            if v is None:
                why = r["skipped"].get(c, "")
                cells.append("FAILED" if why.startswith("FAILED") else "-")
                continue
            mark = "" if v.get("check", {}).get("ok", True) else "!"
            cells.append(f"{fmt_time(v['median_s'])} ({fmt_ratio(v['speedup_vs_inductor'])}){mark}")
        log(f"{r['model']:<24} {r['mode']:<9} " + " ".join(f"{x:>19}" for x in cells)
            + ("  *contended" if r.get("contended") else ""))
    log("(time, and in parentheses Inductor's time / this time; ! = output differs from eager's; "
        "- = no such contender; *contended = another process used the cores meanwhile)")
    notes = []
    for r in rows:
        for c, why in r["skipped"].items():
            if why.startswith("FAILED") or c == "pyg":
                notes.append(f"  {r['model']} {r['mode']} {c}: {why}")
        for c, v in r["contenders"].items():
            if v.get("check", {}).get("ok") is False:
                notes.append(f"  {r['model']} {r['mode']} {c}: output differs from eager "
                             f"({v['check']['detail']})")
    if notes:
        log("\nFailures, mismatches and skipped PyG:")
        for n in dict.fromkeys(notes):
            log(n)
    gcn = [r for r in rows if r["model"].startswith("gcn")]
    if gcn:
        log("\nGCN against torch.sparse (the faster of CSR and COO): that time / this time")
        for r in gcn:
            parts = [f"{c} {fmt_ratio(v.get('speedup_vs_torch_sparse'))}" for c, v in r["contenders"].items()]
            log(f"  {r['model']:<14} {r['mode']:<9} " + ", ".join(parts))


def machine_info(threads: int) -> dict:
    cpu = None
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    except OSError:
        pass
    versions = {}
    for mod in ("transformers", "torch_geometric"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:
            versions[mod] = None
    return {"threads": threads, "torch_num_threads": torch.get_num_threads(), "torch": torch.__version__,
            "scorch": sb.__version__, "cpu_model": cpu, "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "platform": platform.platform(), **versions,
            "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


# ----------------------------------------------------------------------------------------------------------
# main


def cases(args):
    """(name, factory) pairs, built lazily so one failing model does not stop the others."""
    size = "test" if args.quick else "bench"
    for name in args.models:
        if name == "pyg_gcn":
            yield "pyg_gcn/cora", (lambda: pyg_gcn_case(args.data))
        elif name == "gcn":
            for ds in args.datasets:
                yield f"gcn/{ds}", (lambda ds=ds: zoo.make("gcn", "bench", dataset=ds, data=args.data))
        else:
            yield name, (lambda name=name: zoo.make(name, size))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="See the module docstring and benchmarks/README.md.")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {','.join(MODELS)}")
    p.add_argument("--modes", default=",".join(MODES), help="inference, training or both (default both)")
    p.add_argument("--datasets", default=None,
                   help="GCN graphs, comma-separated from cora,citeseer,pubmed (default all three; "
                        "quick: cora)")
    p.add_argument("--target", default=None,
                   help="instruction-set target of the kernels: native (default, or SCORCH_TARGET), x86-64-v3, ...")
    p.add_argument("--threads", type=int, default=2,
                   help="torch.set_num_threads for every contender (default 2)")
    p.add_argument("--repeat", type=int, default=None,
                   help="timed calls per measurement (default 10, quick 3)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed calls after the first (default 3, quick 1)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds after which a measurement stops early, once 3 calls were timed "
                        "(default 10, quick 1)")
    p.add_argument("--data", default=None,
                   help="data folder with planetoid/ (default $SCORCH_DATA, else ../shared/data; a generated graph when absent)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: the zoo's test sizes (GCN: Cora), fewer repeats; the targets do not "
                        "apply")
    p.add_argument("--out", default=str(HERE / "results" / "models.json"), help="JSON output path")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failures")
    add_baseline_isa_argument(p)
    a = p.parse_args(argv)
    a.baseline_isa_note = hold_baseline_isa(a.target, a.baseline_isa, reexec=argv is None)
    a.models = [m.strip() for m in a.models.split(",") if m.strip()]
    bad = [m for m in a.models if m not in MODELS]
    if bad:
        p.error(f"unknown models {bad}; choose from {','.join(MODELS)}")
    a.modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if any(m not in MODES for m in a.modes):
        p.error(f"--modes takes {','.join(MODES)}")
    chosen = a.datasets or ("cora" if a.quick else ",".join(GCN_DATASETS))
    a.datasets = [d.strip().lower() for d in chosen.split(",") if d.strip()]
    if any(d not in GCN_DATASETS for d in a.datasets):
        p.error(f"--datasets takes {','.join(GCN_DATASETS)}")
    a.repeat = a.repeat if a.repeat is not None else (3 if a.quick else 10)
    a.warmup = a.warmup if a.warmup is not None else (1 if a.quick else 3)
    a.budget = a.budget if a.budget is not None else (1.0 if a.quick else 10.0)
    if a.threads < 1 or a.repeat < 1 or a.warmup < 0:
        p.error("--threads and --repeat must be >= 1, --warmup >= 0")
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state")
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    torch.set_num_threads(args.threads)
    if args.target:
        sb.set_target(args.target)
    t_start = time.perf_counter()
    load = OtherLoad()
    info = machine_info(args.threads)
    info["kernel_target"] = sb.target_info()
    log(f"Scorch model benchmark: torch {info['torch']}, {info['cpu_model']}, {info['cpu_count']} CPUs, "
        f"{args.threads} threads for every contender; median of {args.repeat} after {args.warmup} warm-ups"
        + (" (QUICK: test sizes, the targets do not apply)" if args.quick else ""))
    log(sb.describe_machine(args.threads))
    log(args.baseline_isa_note)
    info["baseline_isa"] = args.baseline_isa_note
    probe = contention_probe()
    info["contention_probe_start"] = probe
    if probe["contended"]:
        log(f"WARNING: CPU contention: a small parallel torch add takes {fmt_time(probe['median_s'])} (tens "
            "of us when idle). Another process is using the cores; rerun on an idle machine for meaningful "
            "numbers.")
    rows, targets = [], []
    for name, factory in cases(args):
        try:
            t = time.perf_counter()
            case = factory()
            log(f"\n{case.name} ({case.size}, built in {time.perf_counter() - t:.1f} s): {case.notes}")
        except Exception as e:
            log(f"\n{name}: cannot build: {one_line(e)}")
            rows.append({"model": name, "mode": "-", "error": one_line(e), "contenders": {},
                         "skipped": {c: f"FAILED: cannot build the model: {one_line(e)}"
                                     for c in CONTENDERS}})
            continue
        for mode in args.modes:
            if mode == "training" and not case.trainable:
                continue
            torch._dynamo.reset()
            before = contention_probe()
            row = run_mode(case, mode, args)
            after = contention_probe()
            row["contention_probe_s"] = [before["median_s"], after["median_s"]]
            row["contended"] = before["contended"] or after["contended"]
            rows.append(row)
            targets += targets_for(row)
            parts = []
            for c in CONTENDERS:
                if c in row["contenders"]:
                    v = row["contenders"][c]
                    parts.append(f"{c} {fmt_time(v['median_s'])} ({fmt_ratio(v['speedup_vs_inductor'])})")
                elif row["skipped"].get(c, "").startswith("FAILED"):
                    parts.append(f"{c} FAILED")
            log(f"  {mode:<9} " + ", ".join(parts))
            if row["contended"]:
                log(f"  WARNING: CPU contention around this measurement (a small parallel add took "
                    f"{fmt_time(max(row['contention_probe_s']))}; tens of us when idle): its times are not "
                    "reliable")
        del case
        gc.collect()

    log("\n" + "=" * 100)
    log(f"Results ({args.threads} threads)")
    print_table(rows)
    quick_note = " -- QUICK run at test sizes: for the record only" if args.quick else ""
    log("\nTargets (Scorch's speedup)" + quick_note)
    for t in targets:
        state = "not measured" if t["value"] is None else "REACHED" if t["reached"] else "not reached"
        log(f"  [{t['mode']}] {t['target']}: {fmt_ratio(t['value'])} ({state})")
    if not targets:
        log("  none of the selected models has a target")

    contended = [f"{r['model']} {r['mode']}" for r in rows if r.get("contended")]
    if contended:
        log(f"\nWARNING: CPU contention during {len(contended)} measurements ({', '.join(contended)}); rerun "
            "them on an idle machine.")
    info["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    doc = {"benchmark": "scorch zoo models: eager, Inductor, torch.sparse, PyG, Scorch",
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "args": vars(args), "machine": info,
           "settings": {"speedup": "Inductor median time / contender median time (>1: faster than Inductor)",
                        "gcn_speedup_vs_torch_sparse": "faster torch.sparse layout's time / contender's time",
                        "training_loss": "sum of the floating outputs", "check_rtol": CHECK_RTOL},
           "results": rows, "targets": targets, "total_seconds": time.perf_counter() - t_start,
           "other_load": load.to_dict()}
    log(load.report())
    out = save_json(args.out, doc)
    log(f"\nwrote {out} ({time.perf_counter() - t_start:.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
