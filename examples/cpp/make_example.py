"""Makes what examples/cpp/scorch_deploy runs: a TorchScript model calling Scorch ops, the kernel bundle it
needs, its inputs, and Python's outputs to compare with.

    python examples/cpp/make_example.py OUT_DIR [--target x86-64-v3]

writes OUT_DIR/model.pt, model.kernels, model_with_kernels.pt (the same model with the bundle inside),
inputs.pt and expected.pt. The model is written by hand: one
`scorch::kernel` call (a CSR weight stored as buffers) and one `scorch::region` call (a pruned dense weight
the region compresses at run time), with a ReLU between them. Models rewritten by scorch_backend.compiler.jit take its
place the same way: run them once, then bundle `aot.used_kernel_specs()`.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib

os.environ.setdefault("SCORCH_DISPATCH", "sparse")  # run the kernels (small sizes would otherwise go dense)

import torch  # noqa: E402

import scorch_backend as sb  # noqa: E402
from scorch_backend.custom_ops import aot  # noqa: E402

SPMM = "out(i0,i1) = t0(i0,i2) * t1(i2,i1); t0=dense(0),compressed(1); t1=strided; out=strided; f32; i32"


class Net(torch.nn.Module):
    """y = W2 relu(W1 x): W1 as CSR buffers through scorch::kernel, W2 dense (pruned) through scorch::region."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor):
        super().__init__()
        s = sb.sparse(w1, "csr")
        self.register_buffer("pos", s.level_buffers["pos1"])
        self.register_buffer("crd", s.level_buffers["crd1"])
        self.register_buffer("vals", s.stored_values)
        self.register_buffer("w2", w2)
        self.rows = w1.shape[0]
        self.cols = w1.shape[1]
        self.spec = SPMM
        # One region: out(b,o) = w2(o,h) * h(b,h), w2 compressed once and cached (a weight).
        self.program = json.dumps({"operands": [["oh", "sparse", True, True, 0, True],
                                                ["bh", "dense", False, True, 0, False]],
                                   "out": "bo", "coef": 1.0, "frozen": False, "name": "region0",
                                   "label": "example"}, separators=(",", ":"))

    def forward(self, x: torch.Tensor):
        ht, _ = torch.ops.scorch.kernel(self.spec, [self.pos, self.crd, self.vals, x.t().contiguous()],
                                        [self.rows, x.size(0), self.cols], 1)
        h = torch.relu(ht.t())
        y = torch.ops.scorch.region(self.program, [self.w2, h])
        return y, h.sum(dim=1)


def make(out: pathlib.Path, target: str | None = None, batch: int = 5, seed: int = 0) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(24, 16, generator=g) * (torch.rand(24, 16, generator=g) < 0.2)
    w2 = torch.randn(8, 24, generator=g) * (torch.rand(8, 24, generator=g) < 0.3)
    x = torch.randn(batch, 16, generator=g)
    model = torch.jit.script(Net(w1, w2))
    expected = model(x)
    dense = (torch.relu(x @ w1.t()) @ w2.t(), torch.relu(x @ w1.t()).sum(dim=1))
    for a, b in zip(expected, dense):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    model.save(str(out / "model.pt"))
    torch.save((x,), out / "inputs.pt")
    torch.save(expected, out / "expected.pt")
    info = aot.build_bundle(aot.used_kernel_specs(), out / "model.kernels", target=target)
    aot.save_model(model, out / "model_with_kernels.pt", out / "model.kernels")  # the bundle inside the archive
    return {"kernels": [k[0] for k in info["kernels"]], "target": info["target"], "isa": info["isa"]}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=pathlib.Path)
    ap.add_argument("--target", default=None, help="Scorch target of the bundle (default: the current one)")
    ap.add_argument("--batch", type=int, default=5)
    args = ap.parse_args()
    print(json.dumps(make(args.out, args.target, args.batch), indent=1))
