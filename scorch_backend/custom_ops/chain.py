"""`scorch::chain`: products joined by elementwise ops, in one op call. Two kinds:

- "grouped": run grouped by one sparse 2-D factor (the mixture of experts' dispatch -> activation -> expert ->
  combine), the intermediates kept per group, never dense;
- "sequence": each step a region call on the one before, through elementwise ops applied in place (a
  linear -> bias -> ReLU -> linear whose ReLU output is measured sparse: the first product dense, its bias
  added by BLAS, the ReLU in place, the second product reading the activation compressed, its bias added
  in the same call).

Each step is a region program (region.py). The op, its Meta kernel, its gradient and the grouped runner are
C++ (csrc/torch/chain.h, chain_op.cpp, grouped.cpp); this module holds the chain's program classes, which the
compiler passes build, and a dense reference for comparisons."""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from .. import _C
from .region import run

# --- chains: products joined by elementwise ops, grouped by one sparse 2-D factor ----------------------------
# A chain is a short sequence of region programs (steps) where each later step reads an earlier step's result,
# after elementwise ops with f(0) = 0 (a ReLU), and every intermediate is zero outside one sparse factor
# S(p, q) of the first step (one-hot expert dispatch: S = mask(b, n)). It runs grouped (csrc/torch/grouped.cpp):
# the nonzeros of S are sorted by q, the rows p of each group are gathered and every step runs on them; an
# intermediate is kept as the rows of its groups only, never as the dense (p, q, rest) tensor. The last step's
# result is scattered back (or summed over groups).
#
# Gradients: `scorch::chain_backward` returns the gradients of the operands asked for: directly as grouped
# products for chains of plain grouped products (csrc/torch/grouped_backward.cpp; `keep`: a training graph's
# forward hands it its intermediates), else by running the chain again under ATen's autograd (chain_op.cpp).

CHAIN_ELEMENTWISE = {"aten.relu": torch.relu, "aten.gelu": torch.nn.functional.gelu, "aten.tanh": torch.tanh,
                     "aten.abs": torch.abs, "aten.neg": torch.neg}


@dataclass(frozen=True)
class ChainStep:
    program: str  # a region program's text
    inputs: tuple  # per operand: >= 0 an operand of the chain, < 0 the result of step -(k + 1)
    then: tuple = ()  # elementwise ops applied to the result ("aten.relu", ...)


@dataclass(frozen=True)
class ChainProgram:
    steps: tuple
    name: str = ""
    label: str = ""
    kind: str = "grouped"  # "grouped" | "sequence" (see the module's docstring)
    keep: bool = False  # a training graph's chain: the forward keeps what the direct gradient reads again

    def text(self) -> str:
        d = {"steps": [{"program": s.program, "inputs": list(s.inputs), "then": list(s.then)} for s in self.steps],
             "name": self.name}
        if self.label:
            d["label"] = self.label
        if self.kind != "grouped":
            d["kind"] = self.kind
        if self.keep:
            d["keep"] = True
        return json.dumps(d, separators=(",", ":"))

    @property
    def title(self) -> str:
        return f"{self.name} {self.label}".strip() or "chain"


def parse_chain(text: str) -> ChainProgram:
    """The chain of a program text, checked by the op's own parser (ValueError naming the problem)."""
    _C.chain_check(text)
    d = json.loads(text)
    steps = tuple(ChainStep(st["program"], tuple(int(i) for i in st["inputs"]), tuple(st.get("then", ())))
                  for st in d["steps"])
    return ChainProgram(steps, d.get("name", ""), d.get("label", ""), d.get("kind", "grouped"), bool(d.get("keep", False)))


chain = torch.ops.scorch.chain


def run_chain(text: str, operands) -> torch.Tensor:
    """Run a chain program (the op, without recording a gradient)."""
    with torch.no_grad():
        return chain(text, list(operands))


def run_chain_dense(text: str, operands) -> torch.Tensor:
    """The same chain step by step as dense einsums (each step's result made whole): for comparisons."""
    results = []
    for st in parse_chain(text).steps:
        args = [operands[i] if i >= 0 else results[-i - 1] for i in st.inputs]
        r = run(st.program, args, force="dense")
        for f in st.then:
            r = CHAIN_ELEMENTWISE[f](r)
        results.append(r)
    return results[-1]


__all__ = ["ChainProgram", "ChainStep", "chain", "parse_chain", "run_chain", "run_chain_dense"]
