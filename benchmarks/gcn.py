"""Forward+backward of the 2-layer GCN of examples/train_gcn.py: Scorch against torch.sparse COO and CSR.

Same model, weights and thread count for all; median of repeats after warm-ups; ratios are contender time /
Scorch time (>1: Scorch faster). Data: Cora and CiteSeer from --data (a generated graph when absent).

    python benchmarks/gcn.py [--threads 2] [--repeats 20] [--target x86-64-v3] [--out benchmarks/results/gcn.json]

--target picks the kernels' target (default: SCORCH_TARGET or native); torch's contenders are held to the
same instruction set unless --baseline-isa machine (docs/targets.md).
"""

import argparse
import json
import os
import pathlib
import sys

import numpy as np
import scipy.sparse as sp
import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))

import scorch_backend as sb  # noqa: E402
import train_gcn as gcn  # noqa: E402
from scorch_backend.tools import datasets  # noqa: E402
from scorch_backend.tools.timing import add_baseline_isa_argument, hold_baseline_isa  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--hidden", type=int, default=16)
    ap.add_argument("--target", default=None, help="kernel target (default: SCORCH_TARGET or native)")
    ap.add_argument("--out", default=None, help="JSON file for the results (default benchmarks/results/gcn_<target>.json)")
    add_baseline_isa_argument(ap)
    args = ap.parse_args(argv)
    baseline_isa = hold_baseline_isa(args.target, args.baseline_isa, reexec=argv is None)
    torch.set_num_threads(args.threads)
    if args.target:
        sb.set_target(args.target)
    print(sb.describe_machine(args.threads))
    print(baseline_isa)
    root = datasets.data_dir(args.data)
    graphs = []
    for name in ("cora", "citeseer"):
        loaded = gcn.load_planetoid(root, name)
        if loaded is not None:
            graphs.append((name, loaded))
    if not graphs:
        graphs.append(("generated SBM", gcn.generated_graph()))
    print(f"GCN forward+backward, {args.threads} threads for every contender, median of {args.repeats} "
          "after 3 warm-ups; ratio = contender / Scorch")
    results = []
    for name, (adj, feats, labels, train_idx, _, _) in graphs:
        a = sb.sparse(gcn.normalized_adjacency(adj), "csr")
        rows = np.asarray(feats.sum(1)).ravel()
        rows[rows == 0] = 1
        x = sb.sparse((sp.diags(1.0 / rows) @ feats).tocsr().astype(np.float32), "csr")
        nclass = int(labels.max()) + 1
        models = {"scorch": gcn.ScorchGCN(a, x.shape[1], args.hidden, nclass),
                  "torch.sparse COO": gcn.TorchSparseGCN(a, x.shape[1], args.hidden, nclass, torch.sparse_coo),
                  "torch.sparse CSR": gcn.TorchSparseGCN(a, x.shape[1], args.hidden, nclass, torch.sparse_csr)}
        x_of = {"scorch": x, "torch.sparse COO": x.to_torch(torch.sparse_coo),
                "torch.sparse CSR": x.to_torch(torch.sparse_csr)}
        labels = labels.clamp(min=0)
        times = gcn.bench(models, x_of, labels, train_idx, repeats=args.repeats)
        row = {"graph": name, "nodes": a.shape[0], "edges": a.nnz, "seconds": times,
               "ratio_vs_scorch": {k: t / times["scorch"] for k, t in times.items() if k != "scorch"}}
        results.append(row)
        print(f"{name:14s} {a.shape[0]:6d} nodes {a.nnz:7d} entries  scorch {times['scorch'] * 1e3:7.2f} ms  " +
              "  ".join(f"{k} {t * 1e3:7.2f} ms ({t / times['scorch']:.2f}x)" for k, t in times.items() if k != "scorch"))
    out = pathlib.Path(args.out or HERE / "results" / f"gcn_{args.target or sb.target_info()['name']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": sb.describe_machine(args.threads), "baseline_isa": baseline_isa,
                               "threads": args.threads, "torch": torch.__version__, "cpus": os.cpu_count(),
                               "results": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
