"""A rewritten model deployed from C++ against the same model compiled with backend="scorch" in Python.

    .venv/bin/python benchmarks/deploy.py                      # HF BERT base, 90% pruned, batch 1, seq 128
    .venv/bin/python benchmarks/deploy.py --target x86-64-v3 --model mlp

Rewrites the model (scorch_backend.compiler.jit), saves it with its kernel bundle compiled for the target, builds
examples/cpp (build/deploy-example), then alternates: the compiled model's median latency in this process,
and the C++ program's median (no Python, SCORCH_JIT=0, CXX pointing nowhere, OMP threads = --threads).
Prints both, their ratio (target: C++ within 10% of Python), and the packed weights' share of their dense
bytes (target: at most 22%). Names the CPU and the target.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile

import torch

import scorch_backend as sb
from scorch_backend.compiler import jit
from scorch_backend.tools.timing import add_baseline_isa_argument, hold_baseline_isa
from scorch_backend.tools import zoo
from scorch_backend.tools.timing import measure
from scorch_backend.tools.timing import save_json

ROOT = pathlib.Path(__file__).resolve().parents[1]


def build_example() -> pathlib.Path:
    build = ROOT / "build" / "deploy-example"
    cmd = ["cmake", "-S", str(ROOT / "examples" / "cpp"), "-B", str(build), "-G", "Ninja",
           f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}", f"-DSCORCH_OPS_LIBRARY={sb.ops_library_path()}"]
    subprocess.run(cmd, check=True, capture_output=True)
    subprocess.run(["cmake", "--build", str(build)], check=True, capture_output=True)
    return build / "scorch_deploy"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["bert", "mlp"], default="bert")
    ap.add_argument("--target", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="deploy.json")
    add_baseline_isa_argument(ap)
    args = ap.parse_args(argv)
    baseline_isa = hold_baseline_isa(args.target, args.baseline_isa, reexec=argv is None)
    torch.set_num_threads(args.threads)
    if args.target:
        sb.set_target(args.target)
    cpu, target = sb.target.cpu_model(), sb.target.target_name()
    if args.model == "bert":
        case = zoo.make("bert_encoder", "bench")
        model, example = case.model, case.inputs
    else:
        case = zoo.make("pruned_mlp", "bench")
        model, example = case.model.eval(), case.inputs
    print(f"CPU: {cpu}; target: {target}; threads: {args.threads}; {case.notes}", flush=True)
    print(baseline_isa)
    binary = build_example()
    work = pathlib.Path(tempfile.mkdtemp(prefix="scorch-deploy-"))
    report = jit.RewriteReport()
    new = jit.rewrite(model, example, report=report)
    info = jit.save(new, work / "model.pt", example, target=args.target)
    torch.save(tuple(example), work / "inputs.pt")
    env = {"OMP_NUM_THREADS": str(args.threads), "SCORCH_JIT": "0", "CXX": "/nonexistent",
           "SCORCH_CACHE_DIR": str(work / "cache"), "PATH": os.environ.get("PATH", "")}
    # The C++ program's libtorch runs the instruction set the Python side was held to (--baseline-isa).
    env.update({k: os.environ[k] for k in sb.target.TORCH_ISA_VARIABLES if k in os.environ})

    def cpp() -> float:
        r = subprocess.run([str(binary), str(work / "model.pt"), info["bundle"] or "-", str(work / "inputs.pt"),
                            str(work / "out.pt"), "--repeat", "30"], capture_output=True, text=True, env=env)
        if r.returncode:
            raise RuntimeError(r.stderr)
        return float(re.search(r"median latency: ([0-9.]+)", r.stdout).group(1)) / 1e3

    with torch.no_grad():
        compiled = torch.compile(model, backend="scorch")
        compiled(*example)
        py, cc = [], []
        for _ in range(args.rounds):
            py.append(measure(lambda: compiled(*example), warmup=3, repeat=30).median)
            cc.append(cpp())
        want = model(*example)
    got = torch.load(work / "out.pt")
    want = want if isinstance(want, torch.Tensor) else want[0]
    got = got if isinstance(got, torch.Tensor) else got[0]
    err = (got - want).abs().max().item()
    ratio = statistics.median(cc) / statistics.median(py)
    print(f"compiled (Python) {[round(t * 1e3, 2) for t in py]} ms; C++ {[round(t * 1e3, 2) for t in cc]} ms; "
          f"C++ / Python {ratio:.3f} (target <= 1.10); max error vs eager {err:.1e}")
    print(f"packed weights: {100 * report.packed_ratio:.1f}% of their dense bytes (target <= 22%), "
          f"{len(report.packed)} weights, {len(report.regions)} regions, {len(info['kernels'])} kernels")
    save_json(args.out, {"cpu": cpu, "target": target, "baseline_isa": baseline_isa,
                         "threads": args.threads, "model": args.model,
                         "python_s": py, "cpp_s": cc, "ratio": ratio, "packed_ratio": report.packed_ratio,
                         "error": err})
    return 0


if __name__ == "__main__":
    sys.exit(main())
