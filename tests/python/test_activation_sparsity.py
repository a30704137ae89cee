"""Activation sparsity: a ReLU (or top-k) output measured mostly zero makes the next product sparse in it, and in
training the product before it takes its output gradient compressed and the product after it samples the
ReLU output's gradient at its nonzeros. Pass tests (the graph before, the graph expected after), the region
programs' gradients, and whole models against eager under both dispatch modes."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from model_check import check_model
from scorch_backend import _C
from scorch_backend.custom_ops import region as R
from scorch_backend.compiler.backend import _options, transform
from scorch_backend.tools import zoo
from scorch_backend.compiler import region_cost
from scorch_backend.compiler.passes import partition
from test_backend_passes import THRESHOLD, attrs_of, capture

DISPATCH_MODES = ("sparse", "auto")  # model tests run under the forced kernels and the default dispatch
# The pass tests check which regions are cut from small models: under the automatic dispatch the cost model
# leaves such small products dense, so they ask for the kernel path (as test_backend_passes.py does).
kernel_path = pytest.mark.parametrize("scorch_dispatch", ["sparse"], indirect=True)


class ReluMLP(nn.Module):
    """fc1 -> ReLU -> fc2, fc1's bias shifted so that about 90% of the ReLU output is zero."""

    def __init__(self, d=24, h=96, o=12):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(d, h), nn.Linear(h, o)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
            self.fc1.bias.sub_(1.3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _x(n=32, d=24, seed=1):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed))


def calls(gm):
    """The rewritten graph as a list of (op, operand kinds, program flags), one per call: the structure the
    tests compare. A region is ("region", kinds, grad_out, masked operand indices); other ops by name."""
    out = []
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "call_method"):
            continue
        if n.target is torch.ops.scorch.region.default:
            p = json.loads(n.args[0])
            out.append(("region", tuple(o[1] for o in p["operands"]), p.get("grad_out", "dense"),
                        tuple(p.get("masked_grads", ()))))
        else:
            name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
            out.append((name,))
    return out


def rewritten(model, *inputs, training=True, options=None):
    gm, ex = capture(model, *inputs)
    before = calls(gm)
    with torch.set_grad_enabled(training):
        transform(gm, ex, _options({"sparse_threshold": THRESHOLD, **(options or {})}))
    return before, calls(gm), gm, ex


# --- pass tests: the graph before, the graph expected after ---------------------------------------------

@kernel_path
def test_relu_mlp_training_graph_before_and_after():
    before, after, _, _ = rewritten(ReluMLP(), _x())
    assert before == [("linear",), ("relu",), ("linear",)]
    assert after == [
        ("region", ("dense", "dense", "add"), "sparse", ()),  # fc1: dense forward, output gradient compressed;
        ("relu",),                                            # its bias added in the region
        ("region", ("sparse", "dense", "add"), "dense", (0,)),  # fc2: the ReLU output compressed, its gradient
    ]                                                           # sampled, its bias added in the region


@kernel_path
def test_relu_mlp_inference_graph_before_and_after():
    before, after, _, _ = rewritten(ReluMLP(), _x(), training=False)
    assert before == [("linear",), ("relu",), ("linear",)]
    # by default (the option "sequences") fc1 joins fc2's region as the first step of a chain, its product
    # through the grouped product kernel (test_chains.py, test_sequence_kernel.py)
    assert after == [("chain.default",)]
    # without sequences fc1 has nothing sparse of its own: it stays a linear for Inductor; the ReLU read only
    # by fc2's region joins it (the region takes fc1's output and applies the ReLU as it compresses it)
    _, after, gm, _ = rewritten(ReluMLP(), _x(), training=False, options={"sequences": False})
    assert after == [("linear",), ("region", ("sparse", "dense", "add"), "dense", (0,))]
    region = next(n for n in gm.graph.nodes if n.target is torch.ops.scorch.region.default)
    linear = next(n for n in gm.graph.nodes if getattr(n.target, "__name__", "") == "linear")
    assert json.loads(region.args[0])["relu"] == [0] and region.args[1][0] is linear


@kernel_path
def test_topk_autoencoder_training_graph_before_and_after():
    case = zoo.make("sparse_autoencoder")
    before, after, _, _ = rewritten(case.model, *case.inputs)
    assert before == [("linear",), ("topk",), ("getitem",), ("getitem",), ("zeros_like",), ("relu",),
                      ("scatter",), ("linear",)]
    assert after == [("region", ("dense", "dense", "add"), "sparse", ()), ("topk",), ("getitem",),
                     ("getitem",), ("zeros_like",), ("relu",), ("scatter",),
                     ("region", ("sparse", "dense", "add"), "dense", (0,))]


@kernel_path
def test_dense_relu_output_changes_nothing():
    model = ReluMLP()
    with torch.no_grad():
        model.fc1.bias.add_(1.3)  # about half of the ReLU output is zero now: not sparse
    before, after, _, _ = rewritten(model, _x())
    assert after == before


@kernel_path
def test_one_hot_supports_are_left_to_their_pattern_factors():
    """The MoE's ReLU is zero where the one-hot dispatch is: its regions already read that pattern, and do
    not take a compressed output gradient (that would make two compressed factors of the same zeros)."""
    from test_backend_passes import MoE

    gm, ex, attrs = attrs_of(MoE(), torch.randn(10, 8))
    regions, _ = partition(gm, attrs, THRESHOLD, frozen=False, training=True)
    assert regions and not any(r.fused.program.sparse_grad_out for r in regions)


@kernel_path
def test_grad_density_bounds():
    from scorch_backend.compiler.passes.partition import grad_density

    gm, ex, attrs = attrs_of(ReluMLP(), _x())
    linear = next(n for n in gm.graph.nodes if n.name == "linear")
    relu = next(n for n in gm.graph.nodes if n.name == "relu")
    assert grad_density(linear, attrs) == pytest.approx(attrs["relu"].measured) and grad_density(linear, attrs) < 0.3
    assert grad_density(relu, attrs) == 1.0  # read by a product: its gradient is dense
    case = zoo.make("sparse_autoencoder")
    gm, ex, attrs = attrs_of(case.model, *case.inputs)
    pre = next(n for n in gm.graph.nodes if n.name == "pre")
    assert grad_density(pre, attrs) == pytest.approx(16 / 512)  # top-16 of 512; zeros_like adds none


# --- the programs' gradients -----------------------------------------------------------------------------

@kernel_path
def test_gradient_programs_of_masked_and_sparse_output_gradient():
    prog = R.Program((R.Operand("ac", "sparse", cached=True, masked_grad=True), R.Operand("bc", cached=True)), "ab",
                     sparse_grad_out=True).text()
    assert R.parse_program(prog).operands[0].masked_grad and R.parse_program(prog).sparse_grad_out
    g0, which0, produced0 = R.gradient_program(prog, 0)
    p0 = R.parse_program(g0)
    assert which0 == [-1, 1, 0] and produced0 == "ac"
    assert [(o.letters, o.kind) for o in p0.operands] == [("ab", "sparse"), ("bc", "dense"), ("ac", "pattern")]
    assert not any(o.masked_grad for o in p0.operands) and not p0.sparse_grad_out
    g1, which1, _ = R.gradient_program(prog, 1)
    assert which1 == [-1, 0] and [o.kind for o in R.parse_program(g1).operands] == ["sparse", "sparse"]
    with pytest.raises(ValueError, match="masked_grads"):
        R.region(json.dumps(dict(json.loads(prog), masked_grads=[5])), [torch.ones(2, 3), torch.ones(4, 3)])


@kernel_path
@pytest.mark.parametrize("path", ["sparse", "dense"])
def test_masked_gradient_is_the_gradient_at_the_nonzeros(path):
    g = torch.Generator().manual_seed(0)
    pre = torch.randn(9, 20, dtype=torch.float64, generator=g) - 1.0
    w = torch.randn(7, 20, dtype=torch.float64, generator=g, requires_grad=True)
    prog = R.Program((R.Operand("ac", "sparse", cached=True, masked_grad=True), R.Operand("bc")), "ab").text()
    h = torch.relu(pre).requires_grad_()
    up = torch.randn(9, 7, dtype=torch.float64, generator=g)
    text, which, _ = R.gradient_program(prog, 0)
    got = R.run(text, [up if j < 0 else [h, w][j].detach() for j in which], force=path)
    full = up @ w.detach()
    torch.testing.assert_close(got, full * (h != 0))  # sampled where h is nonzero, zero elsewhere
    # through the ReLU, the masked gradient is the true one
    pre_a = pre.clone().requires_grad_()
    torch.ops.scorch.region(prog, [torch.relu(pre_a), w]).backward(up)
    pre_b = pre.clone().requires_grad_()
    (torch.relu(pre_b) @ w.detach().t()).backward(up)
    torch.testing.assert_close(pre_a.grad, pre_b.grad)


@kernel_path
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compressed_rows_match_dense(dtype):
    """Activations are compressed row by row (contiguous float/double, rank >= 2); other layouts take the
    general path. Both give the dense product."""
    g = torch.Generator().manual_seed(3)
    a = torch.relu(torch.randn(3, 5, 33, generator=g, dtype=dtype) - 1)
    a[1, 2] = 0  # an empty row
    w = torch.randn(33, 6, generator=g, dtype=dtype)
    prog = R.Program((R.Operand("abc", "sparse"), R.Operand("cd")), "abd").text()
    torch.testing.assert_close(R.run(prog, [a, w], force="sparse"), torch.einsum("abc,cd->abd", a, w))
    t = a.transpose(0, 1)  # not contiguous
    torch.testing.assert_close(R.run(prog, [t, w], force="sparse"), torch.einsum("abc,cd->abd", t, w))
    nan = a.clone()
    nan[0, 0, 0] = float("nan")  # NaN is stored (it is not zero)
    assert R.run(prog, [nan, w], force="sparse")[0, 0].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("relu", [False, True])
def test_compressed_rows_store_exactly_the_kept_entries(dtype, relu):
    """The row compression tests entries a word of 32 at a time: rows shorter than, equal to and a little
    longer than words hold exactly the kept entries in order (NaN kept, -0.0 not, and under a ReLU nothing
    <= 0), whatever column of a word they fall in."""
    g = torch.Generator().manual_seed(11)
    for cols in (1, 5, 31, 32, 33, 64, 95, 130):
        x = torch.randn(7, cols, generator=g, dtype=dtype) * (torch.rand(7, cols, generator=g) < 0.3)
        x[0] = 0.0  # an empty row
        x[1, ::3] = -0.0
        x[2, -1] = float("nan")
        x[3, ::4] = -1.5
        x[4] = 2.0  # a full row
        text = R.Program((R.Operand("ac", "sparse", relu=relu), R.Operand("bc")), "ab").text()
        _, args = _C.region_sparse_call(text, [x, torch.ones(2, cols, dtype=dtype)])
        a = args[0]
        kept = (~(x <= 0)) if relu else (x != 0)
        rows, cols_kept = kept.nonzero(as_tuple=True)
        assert a.pos1.tolist() == [0] + kept.sum(1).cumsum(0).tolist(), cols
        assert a.crd1.tolist() == cols_kept.tolist(), cols
        torch.testing.assert_close(a.stored_values, x[rows, cols_kept], equal_nan=True)


@kernel_path
def test_relu_read_elsewhere_stays_in_the_graph():
    """A ReLU whose output something else reads too (here the model returns it) is not folded: the region
    takes its output as before."""
    class Both(ReluMLP):
        def forward(self, x):
            h = torch.relu(self.fc1(x))
            return self.fc2(h), h

    before, after, gm, _ = rewritten(Both(), _x(), training=False)
    assert before == [("linear",), ("relu",), ("linear",)]
    assert after == [("linear",), ("relu",), ("region", ("sparse", "dense", "add"), "dense", (0,))]
    region = next(n for n in gm.graph.nodes if n.target is torch.ops.scorch.region.default)
    assert "relu" not in json.loads(region.args[0])


# --- an operand the op applies a ReLU to -------------------------------------------------------------------

def _relu_program(*more, addend=False):
    ops = (R.Operand("ac", "sparse", relu=True), R.Operand("bc"), *more)
    return R.Program(ops + ((R.Operand("b", "add"),) if addend else ()), "ab").text()


@kernel_path
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("path", ["sparse", "dense", None])
def test_relu_operand_is_the_relu_of_its_tensor(dtype, path):
    """The op gives relu(pre) w^T on every path: compressed with the ReLU applied in the same passes (row by
    row for contiguous rows, the general path for others), or the ReLU applied for the dense product. A NaN
    stays (relu(NaN) is NaN), -0.0 and negatives go, an empty row is a row of zeros."""
    g = torch.Generator().manual_seed(4)
    pre = torch.randn(9, 40, dtype=dtype, generator=g) - 1.0
    pre[3] = -1.0  # an empty row
    pre[4, :5] = -0.0
    w = torch.randn(7, 40, dtype=dtype, generator=g)
    b = torch.randn(7, dtype=dtype, generator=g)
    for text, extra, want in ((_relu_program(), [], torch.relu(pre) @ w.t()),
                              (_relu_program(addend=True), [b], torch.relu(pre) @ w.t() + b)):
        torch.testing.assert_close(R.run(text, [pre, w, *extra], force=path), want)
        t = pre.t().contiguous().t()  # not contiguous: the general path
        torch.testing.assert_close(R.run(text, [t, w, *extra], force=path), want)
    nan = pre.clone()
    nan[0, 0] = float("nan")
    got = R.run(_relu_program(), [nan, w], force=path)
    assert got[0].isnan().all() and not got[1:].isnan().any()
    # a 3-D operand and a vector (the general compression) too
    pre3 = pre.reshape(3, 3, 40)
    text3 = R.Program((R.Operand("xac", "sparse", relu=True), R.Operand("bc")), "xab").text()
    torch.testing.assert_close(R.run(text3, [pre3, w], force=path), torch.relu(pre3) @ w.t())
    text1 = R.Program((R.Operand("c", "sparse", relu=True), R.Operand("bc")), "b").text()
    torch.testing.assert_close(R.run(text1, [pre[0], w], force=path), w @ torch.relu(pre[0]))


@kernel_path
def test_relu_operand_read_dense_beside_a_sparser_one():
    """Beside a much sparser compressed operand the ReLU's output is read dense (the demoted variant): the
    ReLU is still applied."""
    g = torch.Generator().manual_seed(5)
    pre = torch.randn(16, 64, dtype=torch.float64, generator=g)  # about half positive
    w = torch.randn(8, 64, dtype=torch.float64, generator=g) * (torch.rand(8, 64, generator=g) < 0.05)
    text = R.Program((R.Operand("ac", "sparse", relu=True), R.Operand("bc", "sparse")), "ab").text()
    demoted = R.stats["demoted"]
    torch.testing.assert_close(R.run(text, [pre, w], force="sparse"), torch.relu(pre) @ w.t())
    assert R.stats["demoted"] == demoted + 1


@kernel_path
def test_relu_operand_gradients_are_those_through_the_relu():
    g = torch.Generator().manual_seed(6)
    pre = (torch.randn(9, 30, dtype=torch.float64, generator=g) - 1.0).requires_grad_()
    w = torch.randn(5, 30, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(5, dtype=torch.float64, generator=g, requires_grad=True)
    up = torch.randn(9, 5, dtype=torch.float64, generator=g)
    torch.ops.scorch.region(_relu_program(addend=True), [pre, w, b]).backward(up)
    got = [t.grad.clone() for t in (pre, w, b)]
    for t in (pre, w, b):
        t.grad = None
    (torch.relu(pre) @ w.t() + b).backward(up)
    for a, e in zip(got, (pre.grad, w.grad, b.grad)):
        torch.testing.assert_close(a, e)


def test_relu_flag_only_on_plain_operands():
    for bad in (R.Operand("ac", "sparse", cached=True, relu=True), R.Operand("ac", "pattern", grad=False, relu=True)):
        text = R.Program((bad, R.Operand("bc")), "ab").text()
        with pytest.raises(ValueError, match="ReLU"):
            R.parse_program(text)
        with pytest.raises(ValueError, match="ReLU"):
            torch.ops.scorch.region(text, [torch.ones(2, 3), torch.ones(4, 3)])
    with pytest.raises(ValueError, match="relu names no operand"):
        torch.ops.scorch.region(json.dumps(dict(json.loads(_relu_program()), relu=[7])),
                                [torch.ones(2, 3), torch.ones(4, 3)])


# --- whole models against eager ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["relu_mlp_sparse", "sparse_autoencoder"])
def test_zoo_models_infer_like_eager(name, scorch_dispatch):
    """Inference graphs fold the ReLU into the region that reads it (relu_mlp_sparse; the autoencoder's
    ReLU feeds a scatter, which stays)."""
    torch._dynamo.reset()
    case = zoo.make(name)
    compiled = torch.compile(case.model, backend="scorch")
    with torch.no_grad():
        for x in (case.inputs, (case.make_inputs(5)[0],) if name == "relu_mlp_sparse" else case.inputs):
            torch.testing.assert_close(compiled(*x), case.model(*x), rtol=1e-4, atol=1e-5)
    torch._dynamo.reset()


def _with_input_grads(inputs):
    return tuple(x.detach().clone().requires_grad_(True) if type(x) is torch.Tensor and x.is_floating_point() else x
                 for x in inputs)


@pytest.mark.parametrize("name", ["relu_mlp_sparse", "sparse_autoencoder"])
def test_zoo_models_train_like_eager(name, scorch_dispatch):
    case = zoo.make(name)
    check_model(case, _with_input_grads(case.inputs), extra_inputs=[case.make_inputs(5)])


def test_relu_mlp_sparse_bench_size_trains_like_eager(scorch_dispatch):
    case = zoo.make("relu_mlp_sparse", "bench", batch=64, d_in=128, hidden=512, d_out=64)
    check_model(case, _with_input_grads(case.inputs))


@kernel_path  # switches to "auto" itself
def test_activation_that_turns_out_dense_runs_dense(monkeypatch):
    """Compiled while the ReLU output is 90% zeros; then the activation is dense: the run-time choice runs
    the products dense, and the values stay right."""
    monkeypatch.setenv("SCORCH_DISPATCH", "auto")
    # The compile-time estimate of whether fc2's region pays rests on timings taken once per process (the
    # region's fixed cost, the dense rate, the crossover); on a loaded machine they can say it does not, and
    # no region is cut. This test is about the run-time choice, so the estimate gets typical figures.
    monkeypatch.setattr(region_cost, "region_overhead_s", lambda: 20e-6)
    monkeypatch.setattr(region_cost, "dense_rate", lambda threads: 50e9)
    monkeypatch.setattr(region_cost, "crossover_density", lambda: 0.3)
    torch._dynamo.reset()
    case = zoo.make("relu_mlp_sparse", "bench", batch=256, d_in=256, hidden=1024, d_out=256)
    model = case.model
    compiled = torch.compile(model, backend="scorch")
    x = case.inputs[0]
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
        sparse_before, dense_before = R.stats["sparse_runs"], R.stats["dense_runs"]
        model.fc1.bias.add_(5.0)  # most pre-activations positive now: the ReLU output is dense
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-3)
        assert R.stats["dense_runs"] == dense_before + 1 and R.stats["sparse_runs"] == sparse_before
    torch._dynamo.reset()


@kernel_path
def test_explain_in_training_shows_the_gradient_regions():
    import scorch_backend as sb

    rep = sb.explain(ReluMLP(), _x(), repeat=1, train=True)
    assert [r.label for r in rep.regions] == ["fc1 (Linear): linear", "fc2 (Linear): linear"]
    fc1, fc2 = rep.regions
    assert fc1.path == "dense" and fc1.measured_speedup is None and "compressed" in fc1.gradients[0]
    assert fc2.path == "sparse" and "only where relu is nonzero" in fc2.gradients[0]
    # the biases are added inside the regions: the equations and operand lists show them, nothing comes after
    assert all(r.equation == "ac,bc->ab + b" and r.after == "" for r in rep.regions)
    assert all([o["kind"] for o in r.operands][-1] == "add" and "bias" in r.operands[-1]["input"]
               for r in rep.regions)
    text = str(rep)
    assert "gradient:  its output's gradient is mostly zeros" in text and "then:      + " not in text
    # inference: fc1 has nothing sparse, and no gradients; by default it is the first step of fc2's sequence
    rep = sb.explain(ReluMLP(), _x(), repeat=1, options={"sequences": False})
    assert [r.label for r in rep.regions] == ["fc2 (Linear): linear"] and len(rep.regions[0].gradients) == 1
    rep = sb.explain(ReluMLP(), _x(), repeat=1)
    assert [(r.label, r.path) for r in rep.regions] == [("fc2 (Linear): linear, relu", "sequence")]
