"""Dense reference results for index notation, computed with plain torch on a grid of all the variables.

Semantics match Scorch's: an index absent from the left side is summed over the smallest term (operand of +
or -) that holds all its uses.
"""

import re

import torch

_TOKEN = re.compile(r"\s*(?:(?P<num>\d+\.?\d*(?:[eE][-+]?\d+)?)|(?P<name>[A-Za-z_]\w*)|(?P<op>[-+*()=,]))")


def _tokens(text):
    pos, out = 0, []
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            raise ValueError(f"reference parser: bad text at {pos}: {text!r}")
        pos = m.end()
        out.append(m.group("num") or m.group("name") or m.group("op"))
    return out


class _Parser:
    def __init__(self, toks):
        self.t, self.i = toks, 0

    def peek(self):
        return self.t[self.i] if self.i < len(self.t) else None

    def take(self):
        self.i += 1
        return self.t[self.i - 1]

    def access(self):
        name, idx = self.take(), []
        if self.peek() == "(":
            self.take()
            while self.peek() != ")":
                tok = self.take()
                if tok != ",":
                    idx.append(tok)
            self.take()
        return ("access", name, idx)

    def expr(self):
        node = self.term()
        while self.peek() in ("+", "-"):
            node = (self.take(), node, self.term())
        return node

    def term(self):
        node = self.unary()
        while self.peek() == "*":
            self.take()
            node = ("*", node, self.unary())
        return node

    def unary(self):
        if self.peek() == "-":
            self.take()
            return ("neg", self.unary())
        t = self.peek()
        if t == "(":
            self.take()
            node = self.expr()
            self.take()
            return node
        if re.match(r"\d", t):
            return ("num", float(self.take()))
        return self.access()


def evaluate(text: str, operands: dict, dtype=torch.float64) -> torch.Tensor:
    """Evaluate e.g. "y(i) = A(i,j) * x(j) + b(i)" on dense copies of the operands."""
    p = _Parser(_tokens(text))
    _, _, out_idx = p.access()
    assert p.take() == "="
    root = p.expr()
    dense = {k: (v.to_dense() if hasattr(v, "to_dense") else torch.as_tensor(v)).to(dtype) for k, v in operands.items()}

    sizes, parents, uses = {}, {}, {}

    def walk(node, parent):
        parents[id(node)] = parent
        if node[0] == "access":
            for d, v in enumerate(node[2]):
                sizes[v] = dense[node[1]].shape[d]
                if v not in out_idx:
                    uses.setdefault(v, []).append(node)
        for child in node[1:]:
            if isinstance(child, tuple):
                walk(child, node)

    walk(root, None)
    all_vars = list(out_idx) + sorted(v for v in sizes if v not in out_idx)
    grid = [sizes[v] for v in all_vars]

    def path(node):
        out = []
        while node is not None:
            out.append(node)
            node = parents[id(node)]
        return out[::-1]

    scope = {}  # reduction var -> id of the node it is summed at
    for v, us in uses.items():
        lca = path(us[0])
        for u in us[1:]:
            q = path(u)
            k = 0
            while k < min(len(lca), len(q)) and lca[k] is q[k]:
                k += 1
            lca = lca[:k]
        s = root
        for node in reversed(lca[1:]):
            if parents[id(node)][0] in ("+", "-"):
                s = node
                break
        scope[v] = id(s)

    def reduce_at(node, value):
        dims = [all_vars.index(v) for v, s in scope.items() if s == id(node)]
        return value.sum(dim=dims, keepdim=True) if dims else value

    def ev(node):
        kind = node[0]
        if kind == "num":
            value = torch.tensor(node[1], dtype=dtype).reshape([1] * len(grid))
        elif kind == "access":
            t, idx = dense[node[1]], node[2]
            letters = "abcdefghijklmnopqrstuvwxyz"
            sub = "".join(letters[all_vars.index(v)] for v in idx)
            keep = [v for v in all_vars if v in idx]
            out = "".join(letters[all_vars.index(v)] for v in keep)
            t = torch.einsum(f"{sub}->{out}", t) if idx else t
            value = t.reshape([sizes[v] if v in idx else 1 for v in all_vars])
        elif kind == "neg":
            value = -ev(node[1])
        else:
            a, b = ev(node[1]), ev(node[2])
            value = a * b if kind == "*" else (a + b if kind == "+" else a - b)
        return reduce_at(node, value)

    value = ev(root)
    # Reduction dimensions are summed (size 1) by now; output dimensions may still be broadcast.
    n_out = len(out_idx)
    value = value.expand(grid[:n_out] + list(value.shape[n_out:]))
    return value.reshape(grid[:n_out]).contiguous()
