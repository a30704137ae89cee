"""`scorch::chain`: products joined by elementwise ops, in one op call. Two kinds:

- "grouped": run grouped by one sparse 2-D factor (the mixture of experts' dispatch -> activation -> expert ->
  combine), the intermediates kept per group, never dense;
- "sequence": each step a region call on the one before, through elementwise ops applied in place (a
  linear -> bias -> ReLU -> linear whose ReLU output is measured sparse: the first product dense, its bias
  added by BLAS, the ReLU in place, the second product reading the activation compressed, its bias added
  in the same call).

Each step is a region program (region.py); this module holds the chain's program, its execution, its dense
reference and its gradient."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import torch

from .. import _C
from .region import Program, _capture_hook, _captures, gradient_program, grouped_plan, parse_program, run

# --- chains: products joined by elementwise ops, grouped by one sparse 2-D factor ----------------------------
# A chain is a short sequence of region programs (steps) where each later step reads an earlier step's result,
# after elementwise ops with f(0) = 0 (a ReLU), and every intermediate is zero outside one sparse factor
# S(p, q) of the first step (one-hot expert dispatch: S = mask(b, n)). It runs grouped: the nonzeros of S are
# sorted by q, the rows p of each group are gathered into a block (groups, rows) and every step runs on those
# blocks. An intermediate is kept as (q, slot, rest...), the rows of its groups only: the dense (p, q, rest)
# tensor, zero outside S, is never made. The last step's result is scattered back (or summed over groups).
#
# Padding: with the groups padded to the largest, a padding slot reads row 0, but the first step multiplies by
# S's value there (0), every later step multiplies by an intermediate, and the elementwise ops keep 0: padding
# slots stay zero. When padding would waste more than half again the work, each group runs on its own.
#
# Gradients: `scorch::chain_backward` runs the chain again under autograd and returns every operand's gradient
# (a recomputation: the intermediates are not kept between the passes).

CHAIN_MAX_PADDING = 2.5

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

    def text(self) -> str:
        d = {"steps": [{"program": s.program, "inputs": list(s.inputs), "then": list(s.then)} for s in self.steps],
             "name": self.name}
        if self.label:
            d["label"] = self.label
        if self.kind != "grouped":
            d["kind"] = self.kind
        return json.dumps(d, separators=(",", ":"))

    @property
    def title(self) -> str:
        return f"{self.name} {self.label}".strip() or "chain"


@dataclass(frozen=True)
class _StepPlan:
    prog: Program
    inputs: tuple
    then: tuple
    p: str  # the group letters in this step's own letters
    q: str


@functools.lru_cache(maxsize=1024)
def parse_chain(text: str) -> tuple:
    """(ChainProgram, per step a _StepPlan, the index of the grouping factor S in step 0); checks the chain's
    shape and raises ValueError when it cannot run grouped."""
    d = json.loads(text)
    steps = tuple(ChainStep(s["program"], tuple(int(i) for i in s["inputs"]), tuple(s.get("then", ())))
                  for s in d["steps"])
    chain = ChainProgram(steps, d.get("name", ""), d.get("label", ""), d.get("kind", "grouped"))
    if not steps:
        raise ValueError("scorch::chain: no steps")
    if chain.kind == "sequence":
        return chain, _sequence_plans(steps), None
    if chain.kind != "grouped":
        raise ValueError(f"scorch::chain: unknown chain kind {chain.kind!r}")
    plan = grouped_plan(steps[0].program)
    if plan is None:
        raise ValueError("scorch::chain: the first step has no sparse 2-D factor to group by")
    s, pl, ql = plan
    plans = []
    for j, st in enumerate(steps):
        prog = parse_program(st.program)
        if len(st.inputs) != len(prog.operands):
            raise ValueError(f"scorch::chain: step {j} has {len(prog.operands)} operands, {len(st.inputs)} inputs")
        if any(f not in CHAIN_ELEMENTWISE for f in st.then):
            raise ValueError(f"scorch::chain: elementwise ops {st.then} not supported")
        if j == 0:
            p, q = pl, ql
            if any(i < 0 for i in st.inputs):
                raise ValueError("scorch::chain: the first step reads no earlier step")
        else:
            p = q = None
            for i, o in zip(st.inputs, prog.operands):
                if i >= 0:
                    continue
                k = -i - 1
                if k >= j:
                    raise ValueError(f"scorch::chain: step {j} reads step {k}, not before it")
                src = plans[k]
                if o.expand or len(o.letters) != len(src.prog.out):
                    raise ValueError("scorch::chain: an intermediate must be read whole")
                pk, qk = o.letters[src.prog.out.index(src.p)], o.letters[src.prog.out.index(src.q)]
                if p is not None and (p, q) != (pk, qk):
                    raise ValueError("scorch::chain: intermediates disagree on the group letters")
                p, q = pk, qk
            if p is None:
                raise ValueError(f"scorch::chain: step {j} reads no earlier step")
        if j < len(steps) - 1 and not (p in prog.out and q in prog.out):
            raise ValueError(f"scorch::chain: step {j}'s result must keep the group letters")
        plans.append(_StepPlan(prog, st.inputs, st.then, p, q))
    # every intermediate is read by exactly one later step (it lives only in grouped form)
    reads = [i for st in steps for i in st.inputs if i < 0]
    if sorted(reads) != sorted(-(k + 1) for k in range(len(steps) - 1)):
        raise ValueError("scorch::chain: each step but the last must be read once by a later one")
    return chain, tuple(plans), s


def _sequence_plans(steps) -> tuple:
    """A sequence's steps checked: step k + 1 reads step k's result, whole, exactly once; no other reads."""
    plans = []
    for j, st in enumerate(steps):
        prog = parse_program(st.program)
        if len(st.inputs) != len(prog.operands):
            raise ValueError(f"scorch::chain: step {j} has {len(prog.operands)} operands, {len(st.inputs)} inputs")
        if any(f not in _FROM_OUTPUT for f in st.then):
            raise ValueError(f"scorch::chain: elementwise ops {st.then} not supported in a sequence")
        reads = [k for k, i in enumerate(st.inputs) if i < 0]
        if [st.inputs[k] for k in reads] != ([-j] if j else []):
            raise ValueError(f"scorch::chain: step {j} of a sequence must read the step before it, once")
        for k in reads:
            o, src = prog.operands[k], parse_program(steps[j - 1].program)
            if o.kind == "add" or o.expand or len(o.letters) != len(src.out):
                raise ValueError("scorch::chain: an intermediate must be read whole, as a factor")
        plans.append(_StepPlan(prog, st.inputs, st.then, "", ""))
    return tuple(plans)


_IN_PLACE = {"aten.relu": torch.relu_, "aten.tanh": torch.tanh_, "aten.abs": torch.abs_, "aten.neg": torch.neg_}


def _run_sequence(plans, operands, differentiable: bool) -> torch.Tensor:
    """Each step a region call (the op's own choice of path), its elementwise ops applied in place on the
    step's fresh result; `differentiable`: through the autograd op and out-of-place ops (the gradient)."""
    r = None
    for pl, text in plans:
        args = [operands[i] if i >= 0 else r for i in pl.inputs]
        r = torch.ops.scorch.region(text, args) if differentiable else _C.region_run(text, args, "")
        for f in pl.then:
            r = CHAIN_ELEMENTWISE[f](r) if differentiable or f not in _IN_PLACE else _IN_PLACE[f](r)
    return r


def _chain_dtype(plans, operands) -> torch.dtype:
    dtype = None
    for pl in plans:
        for o, i in zip(pl.prog.operands, pl.inputs):
            if i >= 0 and o.kind != "pattern" and operands[i].is_floating_point():
                t = operands[i].dtype
                dtype = t if dtype is None else torch.promote_types(dtype, t)
    return dtype or torch.float32


def _chain_sizes(plans, operands) -> list:
    """Per step, the size of each of its letters."""
    out = []
    for j, pl in enumerate(plans):
        sizes = {}
        for o, i in zip(pl.prog.operands, pl.inputs):
            if i >= 0:
                sizes.update(zip(o.tensor_letters, operands[i].shape))
            else:
                src, k = plans[-i - 1], -i - 1
                sizes.update((c, out[k][src.prog.out[n]]) for n, c in enumerate(o.letters))
        out.append(sizes)
    return out


def chain_output_shape(text: str, operands) -> list:
    _, plans, _ = parse_chain(text)
    sizes = _chain_sizes(plans, operands)
    return [sizes[-1][c] for c in plans[-1].prog.out]


def _chain_block(plans, s, operands, dtype, groups, idx, w, real_q, real_slot, real_p, out):
    """Run every step on the rows of `groups` gathered into a block: idx (G, most) row numbers, w (G, most)
    S's values (0 on padding); (real_q, real_slot) the block position of each stored entry, real_p its row.
    Adds the last step's result into `out` (out-of-place: returns the new tensor, for autograd)."""
    G = idx.shape[0]
    all_groups = groups is None
    gcol = (torch.arange(G) if all_groups else groups).unsqueeze(1)
    results = []
    for j, pl in enumerate(plans):
        p, q, prog = pl.p, pl.q, pl.prog
        args, letters = [], []
        for k, (o, i) in enumerate(zip(prog.operands, pl.inputs)):
            lt = o.tensor_letters
            if i < 0:  # an earlier step's result, kept as (group, slot, rest in that step's output order)
                src = plans[-i - 1]
                t = results[-i - 1]
                lt = q + p + "".join(o.letters[n] for n, c in enumerate(src.prog.out) if c not in (src.p, src.q))
            elif j == 0 and k == s:
                t, lt = w, q + p
            else:
                t = operands[i]
                t = (t != 0).to(dtype) if o.kind == "pattern" else (t if t.dtype == dtype else t.to(dtype))
                rest = "".join(c for c in lt if c not in (p, q))
                if p in lt and q in lt:
                    t = t.movedim((lt.index(p), lt.index(q)), (0, 1))[idx, gcol]
                    lt = q + p + rest
                elif p in lt:
                    t = t.movedim(lt.index(p), 0)[idx]
                    lt = q + p + rest
                elif q in lt and not all_groups:
                    t = t.movedim(lt.index(q), 0).index_select(0, groups)
                    lt = q + rest
            args.append(t)
            letters.append(lt)
        rest_out = "".join(c for c in prog.out if c not in (p, q))
        last = j == len(plans) - 1
        if not last:
            target = q + p + rest_out
            r = torch.einsum(",".join(letters) + "->" + target, *args)
            if prog.coef != 1.0:
                r = r * prog.coef
            for f in pl.then:
                r = CHAIN_ELEMENTWISE[f](r)
            results.append(r)
            continue
        if p in prog.out:
            r = torch.einsum(",".join(letters) + "->" + q + p + rest_out, *args)[real_q, real_slot]
            if prog.coef != 1.0:
                r = r * prog.coef
            for f in pl.then:
                r = CHAIN_ELEMENTWISE[f](r)
            if q in prog.out:  # each (p, q) is one stored entry of S
                view_letters = p + q + rest_out
                full = torch.zeros([out.shape[prog.out.index(c)] for c in view_letters], dtype=dtype)
                gq = real_q if all_groups else groups[real_q]
                full = full.index_put((real_p, gq), r)
                return out + full.permute([view_letters.index(c) for c in prog.out])
            moved = out.movedim(prog.out.index(p), 0)
            return moved.index_add(0, real_p, r).movedim(0, prog.out.index(p))
        tl = (q if q in prog.out else "") + rest_out
        r = torch.einsum(",".join(letters) + "->" + tl, *args)
        if q in prog.out and not all_groups:
            r = torch.zeros([out.shape[prog.out.index(q)]] + list(r.shape[1:]), dtype=dtype).index_add(0, groups, r)
        if prog.coef != 1.0:
            r = r * prog.coef
        for f in pl.then:
            r = CHAIN_ELEMENTWISE[f](r)
        return out + r.permute([tl.index(c) for c in prog.out])
    raise AssertionError("unreachable")


def run_chain(text: str, operands, differentiable: bool = True) -> torch.Tensor:
    """Run a chain program (differentiable torch ops: `chain_backward` runs it under autograd; a sequence's
    steps in place only when not `differentiable`)."""
    chain, plans, s = parse_chain(text)
    if chain.kind == "sequence":
        return _run_sequence(tuple(zip(plans, (st.program for st in chain.steps))), operands, differentiable)
    dtype = _chain_dtype(plans, operands)
    p0 = plans[0]
    so, src = p0.prog.operands[s], operands[p0.inputs[s]]
    S = src if so.letters == p0.p + p0.q else src.t()
    S = (S != 0).to(dtype) if so.kind == "pattern" else S.to(dtype)
    nz = S.detach().t().nonzero()  # (q, p) pairs sorted by q
    qs, ps = nz[:, 0], nz[:, 1]
    Q = S.shape[1]
    counts = torch.bincount(qs, minlength=Q)
    out = torch.zeros(chain_output_shape(text, operands), dtype=dtype)
    if len(ps) == 0:
        return out
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(len(ps)) - starts[qs]
    vals = S[ps, qs]
    most = int(counts.max())
    # One block when padding to the largest group at most about doubles the work (a batched product on padded
    # blocks runs as fast as one product per group at that waste, and pays the per-call costs once).
    if Q * most <= CHAIN_MAX_PADDING * len(ps) + Q:
        idx = torch.zeros(Q, most, dtype=torch.long)
        idx[qs, slot] = ps
        w = torch.zeros(Q, most, dtype=dtype).index_put((qs, slot), vals)
        return _chain_block(plans, s, operands, dtype, None, idx, w, qs, slot, ps, out)
    for q, n in enumerate(counts.tolist()):  # one block per group
        if n == 0:
            continue
        lo = int(starts[q])
        rows = ps[lo:lo + n]
        zeros = torch.zeros(n, dtype=torch.long)
        out = _chain_block(plans, s, operands, dtype, torch.tensor([q]), rows.unsqueeze(0),
                           vals[lo:lo + n].unsqueeze(0), zeros, torch.arange(n), rows, out)
    return out


def run_chain_dense(text: str, operands) -> torch.Tensor:
    """The same chain step by step as dense einsums (each step's result made whole): for comparisons."""
    _, plans, _ = parse_chain(text)
    results = []
    for pl in plans:
        args = [operands[i] if i >= 0 else results[-i - 1] for i in pl.inputs]
        r = run(pl.prog.text(), args, force="dense")
        for f in pl.then:
            r = CHAIN_ELEMENTWISE[f](r)
        results.append(r)
    return results[-1]


# The derivative of an elementwise op between steps, from its output y (all a sequence allows).
_FROM_OUTPUT = {"aten.relu": lambda g, y: g * (y > 0), "aten.neg": lambda g, y: -g,
                "aten.tanh": lambda g, y: g * (1 - y * y)}


def _sequence_backward(plans, operands, grad, need) -> list:
    """A sequence's gradients, step by step from the last: each step's results recomputed (region calls), its
    elementwise ops differentiated from their outputs, its operands' gradients by the region's own gradient
    programs (sparse where the forward was: a ReLU output's gradient sampled at its nonzeros), an addend's
    by summing. The C++ region op cannot run under torch.func's transforms, hence no vjp here."""
    outs = []  # per step: the outputs of its elementwise ops, in order (the product's result first)
    r = None
    for pl in plans:
        args = [operands[i] if i >= 0 else r for i in pl.inputs]
        ys = [run(pl.prog.text(), args)]
        for f in pl.then:
            ys.append(CHAIN_ELEMENTWISE[f](ys[-1]))
        outs.append(ys)
        r = ys[-1]
    grads = [None] * len(operands)
    g = grad
    for j in reversed(range(len(plans))):
        pl = plans[j]
        for f, y in zip(reversed(pl.then), reversed(outs[j][1:])):
            g = _FROM_OUTPUT[f](g, y)
        text = pl.prog.text()
        args = [operands[i] if i >= 0 else outs[j - 1][-1] for i in pl.inputs]
        g_before = None
        for k, (o, i) in enumerate(zip(pl.prog.operands, pl.inputs)):
            if o.kind == "pattern" or not o.grad or (i >= 0 and not need[i]):
                continue
            if o.kind == "add":
                lacking = [d for d, c in enumerate(pl.prog.out) if c not in o.letters]
                gk = g.sum(lacking) if lacking else g
                kept = "".join(c for c in pl.prog.out if c in o.letters)
                gk = gk.permute([kept.index(c) for c in o.letters])
            else:
                gt, which, produced = gradient_program(text, k)
                gk = run(gt, [g if w < 0 else args[w] for w in which])
                if produced != o.letters:
                    gk = _expand_to(gk, produced, o.letters, args[k].shape)
            if i < 0:
                g_before = gk
            else:
                gk = gk.to(operands[i].dtype)
                grads[i] = gk if grads[i] is None else grads[i] + gk
        g = g_before
    return grads


def _expand_to(g, produced: str, letters: str, shape) -> torch.Tensor:
    """A gradient over `produced` letters as a tensor of `letters` (constant along the ones it lacks)."""
    g = g.permute([produced.index(c) for c in letters if c in produced])
    for d, c in enumerate(letters):
        if c not in produced:
            g = g.unsqueeze(d)
    return g.expand(shape)


def _chain_needs_grad(plans, n: int) -> list:
    """Per chain operand: does any step read it as a factor with a gradient (not only as a 0/1 pattern)?"""
    need = [False] * n
    for pl in plans:
        for o, i in zip(pl.prog.operands, pl.inputs):
            if i >= 0 and o.kind != "pattern" and o.grad:
                need[i] = True
    return need


@torch.library.custom_op("scorch::chain", mutates_args=())
def chain(program: str, operands: list[torch.Tensor]) -> torch.Tensor:
    """A chain of region programs run grouped (see above); `program` is ChainProgram.text()."""
    if _captures:
        _capture_hook(program, operands)
    with torch.no_grad():
        return run_chain(program, [t.detach() for t in operands], differentiable=False)


@chain.register_fake
def _(program, operands):
    _, plans, _ = parse_chain(program)
    return operands[0].new_empty(chain_output_shape(program, operands), dtype=_chain_dtype(plans, operands))


@torch.library.custom_op("scorch::chain_backward", mutates_args=())
def chain_backward(program: str, operands: list[torch.Tensor], grad: torch.Tensor) -> list[torch.Tensor]:
    """The gradient of every operand of a chain (an empty tensor for those read only as patterns)."""
    chain_prog, plans, _ = parse_chain(program)
    need = [n and t.is_floating_point() for n, t in zip(_chain_needs_grad(plans, len(operands)), operands)]
    if chain_prog.kind == "sequence":
        grads = _sequence_backward(plans, [t.detach() for t in operands], grad, need)
        return [g if g is not None else t.new_empty(0) for g, t in zip(grads, operands)]
    # The op runs below autograd (the dispatcher excludes its keys here): torch.func's vjp records the
    # recomputation with a transform of its own.
    wanted = [k for k, n in enumerate(need) if n]
    if not wanted:
        return [t.new_empty(0) for t in operands]
    base = [t.detach() for t in operands]

    def f(*xs):
        args = list(base)
        for k, x in zip(wanted, xs):
            args[k] = x
        return run_chain(program, args)

    _, vjp = torch.func.vjp(f, *[base[k] for k in wanted])
    grads = dict(zip(wanted, vjp(grad)))
    return [grads[k] if k in grads else t.new_empty(0) for k, t in enumerate(operands)]


@chain_backward.register_fake
def _(program, operands, grad):
    _, plans, _ = parse_chain(program)
    need = _chain_needs_grad(plans, len(operands))
    return [torch.empty_like(t) if n and t.is_floating_point() else t.new_empty(0) for t, n in zip(operands, need)]


def _chain_setup(ctx, inputs, output):
    ctx.program = inputs[0]
    ctx.save_for_backward(*inputs[1])


def _chain_grad(ctx, grad):
    operands = list(ctx.saved_tensors)
    grads = torch.ops.scorch.chain_backward(ctx.program, operands, grad)
    return None, [g if g.numel() or not t.numel() else None for g, t in zip(grads, operands)]


chain.register_autograd(_chain_grad, setup_context=_chain_setup)


__all__ = ["ChainProgram", "ChainStep", "chain", "parse_chain", "run_chain", "run_chain_dense"]
