"""Scorch quickstart: prune a model, compile it with backend="scorch", check it, time it.

    python examples/quickstart.py                  # a 90%-pruned MLP (transformer feed-forward sizes)
    python examples/quickstart.py --sparsity 0.95 --batch 32 --no-inductor
    python examples/quickstart.py --target x86-64-v3   # the kernels an AVX2 machine gets

The model is ordinary PyTorch. After `scorch_backend.prune` zeroes 90% of its weights, torch.compile with
the "scorch" backend finds the sparse weights by measuring them, runs those layers as generated sparse kernels
and leaves the rest to Inductor. `scorch_backend.tools.explain` says what it did. Every contender uses the same
number of threads; times are medians after warm-ups.
"""

import argparse
import time

import torch
import torch.nn as nn

import scorch_backend as sb
from scorch_backend.tools.timing import add_baseline_isa_argument, hold_baseline_isa
from scorch_backend.tools.timing import measure


def make_model(d: int, hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                         nn.Linear(hidden, d))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--sparsity", type=float, default=0.9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-inductor", action="store_true", help="skip the dense Inductor contender")
    ap.add_argument("--target", default=None,
                    help="instruction set of the kernels: native (default, or SCORCH_TARGET), x86-64-v3 (AVX2), ...")
    add_baseline_isa_argument(ap)
    args = ap.parse_args()
    baseline_isa = hold_baseline_isa(args.target, args.baseline_isa, reexec=True)
    torch.set_num_threads(args.threads)
    if args.target:
        sb.set_target(args.target)
    print(sb.describe_machine(args.threads))
    print(baseline_isa)
    torch.manual_seed(0)
    t0 = time.perf_counter()

    model = make_model(args.d, args.hidden).eval()
    masks = sb.prune(model, "magnitude", args.sparsity)
    kept = sum(int(m.sum()) for m in masks.values()) / sum(m.numel() for m in masks.values())
    print(f"pruned {len(masks)} Linear weights by magnitude: {kept:.1%} of their entries left")
    x = torch.randn(args.batch, args.d)

    fast = torch.compile(model, backend="scorch")
    with torch.no_grad():
        want = model(x)
        got = fast(x)
    err = (got - want).abs().max().item()
    print(f"largest difference from eager: {err:.2e} (outputs up to {want.abs().max().item():.2f})")

    print("\n" + str(sb.explain(model, x, repeat=3)).split("\nOther ops")[0])

    with torch.no_grad():
        times = {"eager dense": measure(lambda: model(x)).median}
        if not args.no_inductor:
            plain = make_model(args.d, args.hidden).eval()
            plain.load_state_dict(model.state_dict())
            dense = torch.compile(plain)
            times["Inductor dense"] = measure(lambda: dense(x)).median
        times["Scorch"] = measure(lambda: fast(x)).median
    print(f"\nbatch {args.batch}, {args.threads} threads, median of 7 after 2 warm-ups:")
    for name, t in times.items():
        print(f"  {name:15s} {t * 1e3:8.2f} ms   {times['Scorch'] and t / times['Scorch']:5.2f}x Scorch's time")
    best_dense = min(t for n, t in times.items() if n != "Scorch")
    print(f"speedup of Scorch over the best dense contender: {best_dense / times['Scorch']:.2f}x")
    print(f"(quickstart took {time.perf_counter() - t0:.0f} s)")
    if err > 1e-3 * max(1.0, want.abs().max().item()):
        raise SystemExit("the compiled model disagrees with eager")


if __name__ == "__main__":
    main()
