"""The op table (scorch_backend/compiler/ops_table.py) is the one place an ATen op is described to the passes."""

from __future__ import annotations

import torch
import torch.nn as nn

from scorch_backend.compiler import ops_table as T
from scorch_backend.compiler.passes import partition
from test_backend_passes import THRESHOLD, attrs_of, pruned_linear


def test_every_spelling_names_an_op_of_the_table():
    for fn, name in T.FUNCTIONS.items():
        assert name in T.OPS and fn in T.OPS[name].functions
    for m, name in T.METHODS.items():
        assert name in T.OPS and m in T.OPS[name].methods
    for spec in T.OPS.values():
        # an op that may join a region must say how it is written as einsum factors
        if spec.fusible is not False or spec.on_result:
            assert spec.index is not None, spec.name
        if spec.inplace_flag:
            assert spec.params, spec.name


class SinhOfPruned(nn.Module):
    """sinh(0) = 0: the pruned product's zeros survive it, if the backend knows sinh."""

    def __init__(self):
        super().__init__()
        self.a = pruned_linear(16, 24, density=0.05)
        with torch.no_grad():
            self.a.bias.fill_(-0.5)  # most of relu(a(x)) is zero
        self.b = nn.Linear(24, 8, bias=False)

    def forward(self, x):
        return self.b(torch.sinh(torch.relu(self.a(x))) * 2.0)


def test_one_entry_teaches_every_pass_a_new_op(monkeypatch):
    # The partition is the subject, not the cost model: a region this small pays only when the sparse path is
    # forced (under automatic dispatch it is left dense as too small to pay).
    monkeypatch.setenv("SCORCH_DISPATCH", "sparse")
    x = torch.randn(6, 16)
    _, _, attrs = attrs_of(SinhOfPruned(), x)
    assert not attrs["sinh"].sparse and attrs["sinh"].origin == "dense"  # unknown: opaque, dense
    # One entry: its spellings, its sparsity rule (zero-preserving), fusibility and index form.
    monkeypatch.setitem(T.OPS, "aten.sinh", T.OpSpec("aten.sinh", ("input|self",), (torch.sinh,), ("sinh",),
                                                     rule=T.OPS["aten.tanh"].rule))
    monkeypatch.setitem(T.FUNCTIONS, torch.sinh, "aten.sinh")
    gm, _, attrs = attrs_of(SinhOfPruned(), x)
    relu = attrs["relu"]
    assert attrs["sinh"].sparse and attrs["sinh"].density == relu.density
    assert attrs["mul"].sparse  # and onward through the scalar factor
    # The second product reads sinh(...) * 2 as a scaled sparse factor: the scalar joins the region (it is
    # fusible), sinh is the region's compressed input.
    regions, _ = partition(gm, attrs, THRESHOLD, frozen=False)
    (r,) = [r for r in regions if "mul" in [m.name for m in r.members]]
    k = [n.name for n in r.fused.leaves].index("sinh")
    assert r.fused.program.operands[k].kind == "sparse" and r.fused.program.coef == 2.0
