"""Rewrite a pruned model for deployment: its sparse regions become scorch::region calls with the weights stored
compressed, saved as TorchScript with the bundle of kernels it needs, ready for examples/cpp (no Python, no
compiler).

    python examples/rewrite_and_save.py out/                 # the zoo's pruned MLP (256-512-512-10, 90%)
    python examples/rewrite_and_save.py out/ --model bert    # HF BertModel base, linears pruned 90% (transformers)

Writes out/model.pt, out/model.pt.kernels, out/inputs.pt (a batch of another size than the example's) and
out/expected.pt (the eager model's output on it), and prints what was packed.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch

from scorch_backend.compiler import jit
from scorch_backend.tools import zoo


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=pathlib.Path)
    ap.add_argument("--model", choices=["mlp", "bert"], default="mlp")
    ap.add_argument("--target", default=None, help="instruction set the kernels are compiled for (docs/targets.md)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.model == "mlp":
        case = zoo.make("pruned_mlp", "bench")
        model = case.model.eval()
        example, run = case.make_inputs(64), case.make_inputs(48)
    else:
        case = zoo.make("bert_encoder", "bench")
        model = case.model
        example, run = case.inputs, (torch.randint(0, 30522, (1, 96), generator=torch.Generator().manual_seed(7)),)
    report = jit.RewriteReport()
    new = jit.rewrite(model, example, report=report)
    info = jit.save(new, args.out / "model.pt", example, target=args.target)
    with torch.no_grad():
        expected = model(*run)
    expected = expected if isinstance(expected, torch.Tensor) else expected[0]
    torch.save(run, args.out / "inputs.pt")
    torch.save(expected, args.out / "expected.pt")
    dense = sum(p.dense_bytes for p in report.packed)
    print(f"{len(report.regions)} region(s); {len(report.packed)} weight(s) stored compressed: "
          f"{sum(p.bytes for p in report.packed) / 1e6:.2f} MB for {dense / 1e6:.2f} MB dense "
          f"({100 * report.packed_ratio:.1f}%); {len(info['kernels'])} kernel(s) in {info['bundle']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
