"""Chain regions (issue 13): products joined by elementwise ops, run grouped by one sparse 2-D factor as one
call of `scorch::chain`, their intermediates never made dense. Each fusion: the graph before, the graph
expected after; the op against the steps run densely; gradients against eager (check_model); explain."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import scorch_backend as sb
from scorch_backend.compiler.backend import _options, transform
from scorch_backend.custom_ops import chain as Ch
from scorch_backend.custom_ops import region as R
from scorch_backend.tools import zoo
from model_check import check_model
from test_backend_passes import MoE, capture, regions_of

CHAIN = torch.ops.scorch.chain.default


@pytest.fixture(autouse=True)
def _kernel_path_partitions(monkeypatch):
    monkeypatch.setenv("SCORCH_DISPATCH", "sparse")  # small models: regions even where they would not pay


def _calls(gm) -> list:
    """The rewritten graph as (what each call does, the names it reads): a structural form to compare."""
    out = []
    for n in gm.graph.nodes:
        if n.op in ("call_function", "call_method"):
            target = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
            reads = [a.name for a in n.args if isinstance(a, torch.fx.Node)]
            for a in n.args:
                if isinstance(a, (list, tuple)):
                    reads += [x.name for x in a if isinstance(x, torch.fx.Node)]
            out.append((str(target), reads))
    return out


def test_moe_graph_before_and_after_one_chain():
    gm, ex = capture(MoE(), torch.randn(10, 8))
    before = _calls(gm)
    assert [t for t, _ in before] == ["linear", "argmax", "one_hot", "to", "softmax", "mul", "unsqueeze",
                                      "unsqueeze", "mul", "einsum", "relu", "einsum", "einsum"]
    with torch.no_grad():
        expected = gm(*ex)
        report = transform(gm, ex, _options(None))
        got = gm(*ex)
    # After: the router stays (dense), the dispatch, ReLU, expert and combine are one chain call.
    assert _calls(gm) == [
        ("linear", ["l_x_", "l_self_modules_router_parameters_weight_", "l_self_modules_router_parameters_bias_"]),
        ("argmax", ["logits"]), ("one_hot", ["argmax"]), ("to", ["one_hot"]), ("softmax", ["logits"]),
        ("chain.default", ["mask", "l_x_", "l_self_parameters_w1_", "l_self_parameters_w2_", "one_hot", "softmax"]),
    ]
    (r,) = report.regions
    assert r.kind == "chain" and r.chain.program.name == "region0"
    steps = r.chain.program.steps
    assert [R.parse_program(st.program).equation for st in steps] == ["ab,ad,bdc->abc", "abd,bdc,ab->abc",
                                                                      "acb,ac,ac->ab"]
    assert [st.inputs for st in steps] == [(0, 1, 2), (-1, 3, 4), (-2, 0, 5)]  # each step reads the one before
    assert [st.then for st in steps] == [("aten.relu",), (), ()]
    assert {m.name for m in r.members} == {"gates", "unsqueeze", "unsqueeze_1", "xe", "einsum", "hid", "y", "einsum_2"}
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-6)


class EscapingHidden(MoE):
    """The activation is returned too: it must exist whole, so the products stay separate regions."""

    def forward(self, x):
        logits = self.router(x)
        mask = F.one_hot(logits.argmax(-1), self.n).to(x.dtype)
        xe = mask.unsqueeze(-1) * x.unsqueeze(1)
        hid = torch.relu(torch.einsum("bnd,ndh->bnh", xe, self.w1))
        return torch.einsum("bnh,nhd->bnd", hid, self.w2), hid


class SigmoidBetween(MoE):
    """sigmoid(0) != 0: the hidden values are not zero outside the dispatch, no chain (and no pattern)."""

    def forward(self, x):
        logits = self.router(x)
        mask = F.one_hot(logits.argmax(-1), self.n).to(x.dtype)
        xe = mask.unsqueeze(-1) * x.unsqueeze(1)
        hid = torch.sigmoid(torch.einsum("bnd,ndh->bnh", xe, self.w1))
        return torch.einsum("bnh,nhd->bnd", hid, self.w2)


class TanhGelu(MoE):
    """gelu(approximate="tanh") keeps zeros, but the chain applies ops without arguments: not chained."""

    def forward(self, x):
        logits = self.router(x)
        mask = F.one_hot(logits.argmax(-1), self.n).to(x.dtype)
        xe = mask.unsqueeze(-1) * x.unsqueeze(1)
        hid = F.gelu(torch.einsum("bnd,ndh->bnh", xe, self.w1), approximate="tanh")
        return torch.einsum("bnh,nhd->bnd", hid * mask.unsqueeze(-1), self.w2)


@pytest.mark.parametrize("model", [EscapingHidden, SigmoidBetween, TanhGelu])
def test_no_chain_where_the_structure_does_not_carry(model):
    regions, _ = regions_of(model(), torch.randn(10, 8))
    assert regions and all(r.kind == "product" for r in regions)


class GeluMoE(MoE):
    """The MoE with a GELU between the experts' products: a chain, but not one of plain grouped products."""

    act = staticmethod(F.gelu)


def _kinds(model, grad: bool, options) -> list:
    gm, ex = capture(model, torch.randn(10, 8))
    with torch.set_grad_enabled(grad):
        return [r.kind for r in transform(gm, ex, _options(options)).regions]


def test_chains_in_training_where_the_gradient_is_direct_and_on_request():
    """Default ("direct"): chains in inference graphs, and in training graphs when every chain's gradient runs
    as grouped products (the MoE); a GELU between the products takes autograd's recomputation, so its training
    graph keeps the products separate. "inference": none in training; "always"; "never"."""
    assert _kinds(MoE(), False, None) == ["chain"]
    assert _kinds(MoE(), True, None) == ["chain"]
    assert _kinds(GeluMoE(), False, None) == ["chain"]
    assert set(_kinds(GeluMoE(), True, None)) == {"product"}
    assert set(_kinds(MoE(), True, {"chains": "inference"})) == {"product"}
    assert _kinds(GeluMoE(), True, {"chains": "always"}) == ["chain"]
    assert set(_kinds(MoE(), False, {"chains": "never"})) == {"product"}


def test_gelu_moe_trains_like_eager_by_default():
    check_model(GeluMoE(), (torch.randn(10, 8),))


# --- the op --------------------------------------------------------------------------------------------------

def _moe_chain(n=3, skewed=False, gates_kind="sparse", b=24, d=5, h=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    experts = torch.randint(0, n, (b,), generator=g)
    if skewed:
        experts[: b - 3] = 0  # one group holds nearly every row: each group runs on its own
    mask = F.one_hot(experts, n).double()
    soft = torch.rand(b, n, dtype=torch.float64, generator=g)
    x = torch.randn(b, d, dtype=torch.float64, generator=g)
    w1 = torch.randn(n, d, h, dtype=torch.float64, generator=g)
    w2 = torch.randn(n, h, d, dtype=torch.float64, generator=g)
    P = R.Program
    O = R.Operand
    steps = (Ch.ChainStep(P((O("pq", gates_kind), O("pd"), O("qdh")), "pqh").text(), (0, 1, 2), ("aten.relu",)),
             Ch.ChainStep(P((O("abh"), O("bhd"), O("ab", "pattern")), "abd").text(), (-1, 3, 0)),
             Ch.ChainStep(P((O("xyz"), O("xy", "sparse"), O("xy")), "xz", coef=0.5).text(), (-2, 0, 4)))
    return Ch.ChainProgram(steps, "c").text(), [mask, x, w1, w2, soft]


@pytest.mark.parametrize("skewed", [False, True])  # padded blocks, one block per group
@pytest.mark.parametrize("gates_kind", ["sparse", "pattern"])
def test_chain_op_matches_the_steps_run_densely_with_gradients(skewed, gates_kind):
    text, ops = _moe_chain(skewed=skewed, gates_kind=gates_kind)
    want = Ch.run_chain_dense(text, ops)
    torch.testing.assert_close(torch.ops.scorch.chain(text, ops), want)
    x, w1, w2, soft = (t.clone().requires_grad_() for t in ops[1:])
    assert torch.autograd.gradcheck(lambda *a: torch.ops.scorch.chain(text, [ops[0], *a]), (x, w1, w2, soft))


def test_chain_op_top2_dispatch_and_empty_groups_match_dense_with_gradients():
    """Rows in two groups each (summed back), a group with no rows, and a last step that keeps the group letter
    but sums the rows away (one result per group, zero for the empty one); forward and recorded gradient."""
    g = torch.Generator().manual_seed(3)
    b, n, d, h = 20, 4, 5, 6
    mask = torch.zeros(b, n, dtype=torch.float64)
    first = torch.randint(0, 2, (b,), generator=g)
    mask[torch.arange(b), first] = 1
    mask[torch.arange(b), 2] = 1  # every row in group 2 as well; group 3 has none
    vals = mask * torch.rand(b, n, dtype=torch.float64, generator=g)
    x = torch.randn(b, d, dtype=torch.float64, generator=g)
    w1 = torch.randn(n, d, h, dtype=torch.float64, generator=g)
    w2 = torch.randn(n, h, d, dtype=torch.float64, generator=g)
    P, O = R.Program, R.Operand
    s0 = Ch.ChainStep(P((O("pq", "sparse"), O("pd"), O("qdh")), "pqh").text(), (0, 1, 2), ("aten.tanh",))
    rows_back = Ch.ChainStep(P((O("abh"), O("bhd")), "ad").text(), (-1, 3))  # rows summed over groups
    per_group = Ch.ChainStep(P((O("abh"), O("bhd")), "bd").text(), (-1, 3))  # rows summed within groups
    for last in (rows_back, per_group):
        text = Ch.ChainProgram((s0, last), "t").text()
        ops = [vals, x, w1, w2]
        torch.testing.assert_close(torch.ops.scorch.chain(text, ops), Ch.run_chain_dense(text, ops))
        args = [t.clone().requires_grad_() for t in ops[1:]]
        assert torch.autograd.gradcheck(lambda *a: torch.ops.scorch.chain(text, [vals, *a]), args)


def test_chain_op_passes_opcheck_and_rejects_bad_programs():
    text, ops = _moe_chain()
    torch.library.opcheck(CHAIN, (text, [ops[0]] + [t.clone().requires_grad_() for t in ops[1:]]))
    step = Ch.ChainStep(R.Program((R.Operand("pd"), R.Operand("dh")), "ph").text(), (1, 2))
    with pytest.raises(ValueError, match="no sparse 2-D factor"):
        torch.ops.scorch.chain(Ch.ChainProgram((step,)).text(), ops)
    first = Ch.ChainStep(R.Program((R.Operand("pq", "sparse"), R.Operand("pd"), R.Operand("qdh")), "pqh").text(),
                        (0, 1, 2), ("aten.sigmoid",))
    with pytest.raises(ValueError, match="not supported"):
        torch.ops.scorch.chain(Ch.ChainProgram((first,)).text(), ops)
    last_drops_q = Ch.ChainStep(R.Program((R.Operand("pq", "sparse"), R.Operand("pd"), R.Operand("qdh")), "ph").text(),
                               (0, 1, 2))
    reads = Ch.ChainStep(R.Program((R.Operand("ah"), R.Operand("bhd")), "abd").text(), (-1, 3))
    with pytest.raises(ValueError, match="must keep the group letters"):
        torch.ops.scorch.chain(Ch.ChainProgram((last_drops_q, reads)).text(), ops)


def test_chain_backward_checks_the_gradient_and_the_expert_count():
    # A gradient of the wrong shape was taken (extra rows ignored) or failed deep in ATen (helper-49); a gating
    # mask with fewer columns than experts gave a message naming neither.
    text, ops = _moe_chain()
    out = torch.ops.scorch.chain(text, ops)
    ok = torch.ops.scorch.chain_backward(text, ops, torch.ones_like(out), [0, 1, 1, 1, 1])
    assert ok[1].shape == ops[1].shape
    for shape in [(2 * out.shape[0], out.shape[1]), (out.shape[0], 1), (out.shape[1],), (1, out.shape[1])]:
        with pytest.raises(ValueError, match=r"the gradient has shape .* the chain's output has shape"):
            torch.ops.scorch.chain_backward(text, ops, torch.ones(shape, dtype=out.dtype), [0, 1, 1, 1, 1])
    meta = [o.to("meta") for o in ops]  # (fake tensors while tracing reach the same check)
    with pytest.raises(ValueError, match=r"the gradient has shape"):
        torch.ops.scorch.chain_backward(text, meta, torch.ones(1, out.shape[1], device="meta", dtype=out.dtype),
                                        [0, 1, 1, 1, 1])
    with pytest.raises(ValueError, match="gating mask has 2 columns .* 3 experts"):
        torch.ops.scorch.chain(text, [ops[0][:, :2].contiguous(), *ops[1:]])


# --- gradients of whole models against eager, and explain ----------------------------------------------------

def test_moe_chain_gradients_match_eager():
    torch.manual_seed(0)
    check_model(MoE(), (torch.randn(10, 8),), options={"chains": "always"})
    check_model(MoE(), (torch.randn(10, 8),), train=False)


@pytest.mark.parametrize("name", ["moe", "moe16"])
def test_zoo_moe_runs_as_one_chain(name):
    case = zoo.make(name)
    check_model(case, options={"chains": "always"})
    rep = sb.explain(case.model, *case.inputs, repeat=2)
    (r,) = rep.regions
    assert r.equation == "chain: ab,ad,bdc->abc -> relu => abd,bdc,ab->abc => acb,ac,ac->ab"
    assert r.path == "grouped" and r.measured_speedup is not None and r.measured_speedup > 0
    ops = "; ".join(r.ops)
    assert ops.count("einsum(") == 3 and "relu(einsum)" in ops and "mul(mask, softmax)" in ops
    assert "chain:" in str(rep) and "3 products in one call" in str(rep)


# --- sequences: linear -> bias -> ReLU -> linear with a measured-sparse activation -----------------------------

def test_relu_mlp_graph_before_and_after_one_sequence_chain():
    case = zoo.make("relu_mlp_sparse")  # about 90% of the ReLU output is zero
    gm, ex = capture(case.model, *case.inputs)
    assert [t for t, _ in _calls(gm)] == ["linear", "relu", "linear"]
    with torch.no_grad():
        expected = gm(*ex)
        report = transform(gm, ex, _options({"sequences": True}))
        got = gm(*ex)
    # After: one chain call reading the input, fc1's weight and bias, fc2's weight and bias.
    assert _calls(gm) == [("chain.default", ["l_x_", "l_self_modules_fc1_parameters_weight_",
                                             "l_self_modules_fc1_parameters_bias_",
                                             "l_self_modules_fc2_parameters_weight_",
                                             "l_self_modules_fc2_parameters_bias_"])]
    (r,) = report.regions
    assert r.kind == "chain" and r.chain.program.kind == "sequence"
    steps = r.chain.program.steps
    assert [R.parse_program(st.program).equation for st in steps] == ["ac,bc->ab + b", "ac,bc->ab + b"]
    assert [[o.kind for o in R.parse_program(st.program).operands] for st in steps] == [
        ["dense", "dense", "add"], ["sparse", "dense", "add"]]  # the ReLU output read compressed
    assert [st.inputs for st in steps] == [(0, 1, 2), (-1, 3, 4)] and [st.then for st in steps] == [("aten.relu",), ()]
    assert [op.split("(")[0] for op in r.ops] == ["linear", "relu", "linear"]
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-6)
    # without sequences (and without chains): fc1 stays a linear for the fallback, fc2 a region of its own that takes
    # fc1's output and applies the ReLU in its compression (partition.py: _fold_relus, inference only)
    for opts in ({"sequences": False}, {"chains": "never", "sequences": True}):
        gm, ex = capture(case.model, *case.inputs)
        with torch.no_grad():
            transform(gm, ex, _options(opts))
            assert [t for t, _ in _calls(gm)] == ["linear", "region.default"]
            torch.testing.assert_close(gm(*ex)[0], expected[0], rtol=1e-5, atol=1e-6)


def test_relu_mlp_sequence_not_built_in_training_nor_where_the_activation_escapes():
    case = zoo.make("relu_mlp_sparse")
    gm, ex = capture(case.model, *case.inputs)
    with torch.enable_grad():  # training: fc1 is a region of its own (its output gradient is sparse)
        assert [r.kind for r in transform(gm, ex, _options({"sequences": True})).regions] == ["product", "product"]

    class Escapes(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x):
            h = torch.relu(self.m.fc1(x))
            return self.m.fc2(h), h  # the activation is returned: it must exist whole

    gm, ex = capture(Escapes(case.model), *case.inputs)
    with torch.no_grad():
        assert all(r.kind == "product" for r in transform(gm, ex, _options({"sequences": True})).regions)


def test_training_graph_with_a_relu_mlp_keeps_the_moe_chain():
    """Under the default "direct", a training graph holding both the MoE and a ReLU MLP forms no sequence (it has
    no direct gradient, and forming one sent the whole graph back to separate products, the MoE's chain too)."""
    case = zoo.make("relu_mlp_sparse")

    class Both(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.moe, self.mlp = MoE(), case.model

        def forward(self, x, y):
            return self.moe(x), self.mlp(y)

    model = Both()
    for grad, kinds in ((True, ["chain", "product", "product"]), (False, ["chain", "chain"])):
        gm, ex = capture(model, torch.randn(10, 8), *case.inputs)  # (transform rewrites the graph it is given)
        with torch.set_grad_enabled(grad):
            assert sorted(r.kind for r in transform(gm, ex, _options(None)).regions) == kinds


def _sequence(then=("aten.relu",)):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, dtype=torch.float64, generator=g)
    w1, b1 = torch.randn(8, 5, dtype=torch.float64, generator=g), torch.randn(8, dtype=torch.float64, generator=g)
    w2, b2 = torch.randn(3, 8, dtype=torch.float64, generator=g), torch.randn(3, dtype=torch.float64, generator=g)
    O, P = R.Operand, R.Program
    s0 = Ch.ChainStep(P((O("ac"), O("bc"), O("b", "add")), "ab").text(), (0, 1, 2), then)
    s1 = Ch.ChainStep(P((O("ab", "sparse", masked_grad=True), O("cb"), O("c", "add")), "ac", coef=0.5).text(),
                      (-1, 3, 4))
    return Ch.ChainProgram((s0, s1), "s", kind="sequence").text(), [x, w1, b1, w2, b2]


@pytest.mark.parametrize("then", [("aten.relu",), ("aten.tanh",), ("aten.neg", "aten.relu")])
def test_sequence_op_matches_eager_with_gradients(then):
    text, ops = _sequence(then)
    x, w1, b1, w2, b2 = ops
    h = x @ w1.t() + b1
    for f in then:
        h = Ch.CHAIN_ELEMENTWISE[f](h)
    want = 0.5 * (h @ w2.t()) + b2
    torch.testing.assert_close(torch.ops.scorch.chain(text, ops), want)
    torch.testing.assert_close(Ch.run_chain_dense(text, ops), want)
    args = [t.clone().requires_grad_() for t in ops]
    assert torch.autograd.gradcheck(lambda *a: torch.ops.scorch.chain(text, list(a)), args)
    torch.library.opcheck(CHAIN, (text, args))


def test_sequence_op_rejects_bad_programs():
    text, ops = _sequence()
    d = __import__("json").loads(text)
    d["steps"][0]["then"] = ["aten.gelu"]  # its derivative is not a function of its output
    with pytest.raises(ValueError, match="not supported in a sequence"):
        torch.ops.scorch.chain(__import__("json").dumps(d), ops)
    d = __import__("json").loads(text)
    d["steps"][1]["inputs"] = [0, 3, 4]  # reads no earlier step
    with pytest.raises(ValueError, match="must read the step before"):
        torch.ops.scorch.chain(__import__("json").dumps(d), ops)
    d["kind"] = "zigzag"
    with pytest.raises(ValueError, match="unknown chain kind"):
        torch.ops.scorch.chain(__import__("json").dumps(d), ops)
    with pytest.raises(ValueError, match="'sequences'"):
        _options({"sequences": "yes"})


def test_relu_mlp_sequence_values_match_eager_and_explain_shows_one_region():
    case = zoo.make("relu_mlp_sparse")
    check_model(case, options={"sequences": True}, train=False, extra_inputs=[case.make_inputs(5)])
    rep = sb.explain(case.model, *case.inputs, repeat=2, options={"sequences": True})
    (r,) = rep.regions
    assert r.equation == "chain: ac,bc->ab + b -> relu => ac,bc->ab + b" and r.path == "sequence"
    assert [op.split("(")[0] for op in r.ops] == ["linear", "relu", "linear"]
    assert r.measured_speedup is not None and "2 products in one call" in str(rep)
