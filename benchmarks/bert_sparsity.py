"""Hugging Face BertModel (base, random weights, eval) with every encoder Linear magnitude-pruned to each
sparsity in a sweep: torch.compile(backend="scorch") against dense Inductor, batch 1, sequence 128.

    .venv/bin/python benchmarks/bert_sparsity.py                       # default target, 2 threads
    .venv/bin/python benchmarks/bert_sparsity.py --target x86-64-v3 --sparsities 0,0.9

What it checks (issue "real users' models"): Scorch is never below Inductor beyond noise at any sparsity
(regions that lose are run dense, decided by measurement), and >= 1.5x at 90%. Every contender runs with the
same thread count in this process, after warm-up calls; times are medians. Prints the CPU and the target.
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch

import scorch_backend as sb
from scorch_backend.tools.timing import add_baseline_isa_argument, hold_baseline_isa
from scorch_backend.tools import zoo
from scorch_backend.tools.timing import measure
from scorch_backend.tools.timing import fmt_ratio, fmt_time, save_json


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sparsities", default="0,0.5,0.7,0.8,0.9,0.95,0.99")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--target", default=None, help="kernel target (default: native or SCORCH_TARGET)")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--out", default="bert_sparsity.json")
    add_baseline_isa_argument(ap)
    args = ap.parse_args(argv)
    baseline_isa = hold_baseline_isa(args.target, args.baseline_isa, reexec=argv is None)
    torch.set_num_threads(args.threads)
    if args.target:
        sb.set_target(args.target)
    cpu, target = sb.target.cpu_model(), sb.target.target_name()
    print(f"CPU: {cpu}; target: {target}; threads: {args.threads}; BertModel base, batch 1, seq {args.seq}")
    print(baseline_isa)
    rows = []
    for s in (float(x) for x in args.sparsities.split(",")):
        case = zoo.make("bert_encoder", "bench", sparsity=s, seq=args.seq)
        model, x = case.model, case.inputs[0]
        with torch.no_grad():
            want = model(x).last_hidden_state
            times = {}
            for name, backend in (("inductor", "inductor"), ("scorch", "scorch")):
                torch._dynamo.reset()
                compiled = torch.compile(copy.deepcopy(model), backend=backend)
                got = compiled(x).last_hidden_state
                err = (got - want).abs().max().item()
                times[name] = measure(lambda: compiled(x), warmup=args.warmup, repeat=args.repeat).median
                times[name + "_err"] = err
        ratio = times["inductor"] / times["scorch"]
        rows.append({"sparsity": s, **times, "speedup": ratio})
        print(f"  sparsity {s:5.2f}: inductor {fmt_time(times['inductor'])}, scorch {fmt_time(times['scorch'])} "
              f"({fmt_ratio(ratio)} Inductor; max error {times['scorch_err']:.1e})", flush=True)
    worst = min(r["speedup"] for r in rows)
    at90 = [r["speedup"] for r in rows if abs(r["sparsity"] - 0.9) < 1e-9]
    print(f"worst speedup over the sweep: {fmt_ratio(worst)} (target: never below 1.0x beyond noise)")
    if at90:
        print(f"at 90%: {fmt_ratio(at90[0])} (target >= 1.5x)")
    save_json(args.out, {"cpu": cpu, "target": target, "baseline_isa": baseline_isa, "threads": args.threads,
                         "seq": args.seq, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
