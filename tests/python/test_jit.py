"""TorchScript rewriting (scorch_backend/compiler/jit.py) and regions over packed operands (csrc/torch/region.cpp).

A rewritten model must match eager for new batch sizes, script, trace, save and load, and export; its sparse
weights are stored compressed. Every test runs under the forced kernels and under the default dispatch, where
small products take the dense path (for a packed weight: densified from its buffers)."""

from __future__ import annotations

import io
import json
import os

import pytest
import torch
import torch.nn as nn

import scorch_backend as sb
from conftest import random_dense
from scorch_backend.compiler import jit
from scorch_backend.tools import zoo

DISPATCH_MODES = ("sparse", "auto")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _crossover_of_a_typical_cpu(monkeypatch):
    # Which values count as sparse follows the machine's calibrated dense/sparse crossover (0.70-0.79 on the
    # Zen 5 these tests were written on): with a measured crossover of 0.4 or below, up to 18 of these tests
    # failed, their models' ReLU outputs then counting as dense. The subject here is rewriting and saving, not
    # the calibration (test_cost_model.py's): the crossover is pinned.
    monkeypatch.setenv("SCORCH_DENSE_CROSSOVER", "0.7")


def _rewrite(model, inputs, **kw):
    """Rewrite with the kernels forced while the passes decide (test models are small: the cost model would
    leave them dense), whatever the test's dispatch mode is for running."""
    mode = os.environ.get("SCORCH_DISPATCH")
    os.environ["SCORCH_DISPATCH"] = "sparse"
    try:
        report = jit.RewriteReport()
        return jit.rewrite(model, inputs, report=report, **kw), report
    finally:
        os.environ["SCORCH_DISPATCH"] = mode


def _mlp(seed=0):
    case = zoo.make("pruned_mlp", "test", seed=seed)
    return case.model.eval(), case


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_mlp_regions_packed_and_dense_weights_dropped():
    model, case = _mlp()
    x = case.make_inputs(6)[0]
    new, report = _rewrite(model, (x,))
    assert report.regions, "the pruned MLP should give regions"
    assert report.packed and all(p.format == "dense(0),compressed(1)" for p in report.packed)
    names = dict(new.named_buffers())
    params = dict(new.named_parameters())
    for p in report.packed:
        assert "w_" + p.name.replace(".", "_") not in params, f"the dense {p.name} is still stored"
        assert any(k.startswith("scorch_packed_" + p.name.replace(".", "_")) for k in names)
    # 90% pruned, float32 values and int32 indices: about a fifth of the dense bytes.
    assert report.packed_ratio < 0.22, report.packed_ratio
    assert "torch.ops.scorch.region" in new.code


@pytest.mark.parametrize("batch", [1, 5, 6, 33])
def test_mlp_new_batch_sizes_match_eager(batch):
    model, case = _mlp()
    new, _ = _rewrite(model, case.make_inputs(6))
    x = case.make_inputs(batch)[0]
    with torch.no_grad():
        _close(new(x), model(x))


def test_script_save_load_trace_roundtrip(tmp_path):
    model, case = _mlp()
    new, _ = _rewrite(model, case.make_inputs(6))
    scripted = torch.jit.script(new)
    path = tmp_path / "model.pt"
    torch.jit.save(scripted, str(path))
    loaded = torch.jit.load(str(path))
    traced = torch.jit.trace(new, case.make_inputs(6))
    for batch in (2, 7):
        x = case.make_inputs(batch)[0]
        with torch.no_grad():
            want = model(x)
        _close(scripted(x), want)
        _close(loaded(x), want)
        _close(traced(x), want)
    # The saved archive holds the packed weight, not the dense one.
    assert any("scorch_packed" in k for k in loaded.state_dict())


def test_export_runs_with_a_dynamic_batch():
    model, case = _mlp()
    x = case.make_inputs(6)[0]
    new, _ = _rewrite(model, (x,))
    batch = torch.export.Dim("batch", min=2)
    ep = torch.export.export(new, (x,), dynamic_shapes=({0: batch},))
    assert any("scorch.region" in str(n.target) for n in ep.graph.nodes)
    for b in (3, 9):
        x2 = case.make_inputs(b)[0]
        with torch.no_grad():
            _close(ep.module()(x2), model(x2))


def test_a_size_fixed_by_the_example_is_asserted():
    model, case = _mlp()
    new, _ = _rewrite(model, case.make_inputs(1))  # Dynamo specializes a size of 1
    with pytest.raises(Exception, match="dimension 0 must be 1"):
        new(case.make_inputs(3)[0])


def test_an_input_of_another_rank_is_a_clear_error(tmp_path):
    # The rewrite traces one rank; another failed inside a region (or with "list index out of range" in the
    # attention's) instead of naming the input (helper-41). Checked in the rewritten module and once saved.
    model, case = _mlp()
    x = case.make_inputs(6)[0]
    new, _ = _rewrite(model, (x,))
    for bad in (x[0], x[None]):
        with pytest.raises(Exception, match="must have 2 dimensions, as in the example inputs"):
            new(bad)
    jit.save(new, tmp_path / "model.pt", (x,))
    loaded = jit.load(tmp_path / "model.pt")
    with pytest.raises(Exception, match="must have 2 dimensions"):
        loaded(x[0])
    _close(loaded(x), model(x))


def test_graph_break_is_a_clear_error():
    class Breaks(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            if x.sum().item() > 0:  # data-dependent control flow: a graph break
                return self.fc(x)
            return x

    with pytest.raises(jit.RewriteError, match="one graph"):
        jit.rewrite(Breaks(), (torch.ones(3, 8),))


def test_tuple_outputs_and_untouched_dense_model():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(16, 4)

        def forward(self, x):
            y = self.a(x)
            return y, y.relu()

    m = Two().eval()
    x = torch.randn(5, 16)
    new, report = _rewrite(m, (x,))
    assert not report.packed  # nothing sparse: the model's own code, unchanged in meaning
    out = new(torch.randn(3, 16))
    assert isinstance(out, tuple) and len(out) == 2
    x2 = torch.randn(4, 16)
    with torch.no_grad():
        for a, b in zip(new(x2), m(x2)):
            _close(a, b)


def test_rewritten_model_gradients_to_inputs():
    model, case = _mlp()
    new, _ = _rewrite(model, case.make_inputs(6))
    x = case.make_inputs(4)[0].requires_grad_(True)
    x_ref = x.detach().clone().requires_grad_(True)
    new(x).sum().backward()
    model(x_ref).sum().backward()
    _close(x.grad, x_ref.grad)


# --- the region op over packed operands ------------------------------------------------------------------

def _program(packed_size, fmt="dense(0),compressed(1)"):
    return json.dumps({"operands": [["ac", "dense", False, True, 0, False],
                                    ["bc", "sparse", False, False, 0, False, {"format": fmt, "size": packed_size}]],
                       "out": "ab", "coef": 1.0, "frozen": True, "name": "r", "label": "test"})


def _packed(w):
    from scorch_backend import _C

    _, st = _C.region_compressed(w, "bc", "sparse", 0, [], torch.float32, True)
    return st.stored_values, list(st.level_buffers.values())


@pytest.mark.parametrize("density", [0.0, 0.05, 0.5, 1.0])
@pytest.mark.parametrize("shape", [(7, 13, 5), (1, 1, 1), (0, 4, 3), (4, 0, 3)])
def test_packed_region_matches_dense(shape, density):
    a_, b_, c_ = shape
    x = torch.randn(a_, c_)
    w = random_dense((b_, c_), density, seed=a_ + b_)
    values, buffers = _packed(w)
    out = torch.ops.scorch.region(_program([b_, c_]), [x, values, *buffers])
    _close(out, x @ w.t())


def test_packed_region_gradient_to_the_dense_operand():
    x = torch.randn(6, 9, dtype=torch.float32, requires_grad=True)
    w = random_dense((5, 9), 0.3, seed=3)
    values, buffers = _packed(w)
    out = torch.ops.scorch.region(_program([5, 9]), [x, values, *buffers])
    g = torch.randn_like(out)
    out.backward(g)
    _close(x.grad, g @ w)


def test_packed_region_bad_inputs_are_clear_errors():
    x = torch.randn(3, 4)
    w = random_dense((5, 4), 0.5, seed=1)
    values, (pos, crd) = _packed(w)
    with pytest.raises(Exception, match="operands expected"):
        torch.ops.scorch.region(_program([5, 4]), [x, values, pos])
    bad = crd.clone()
    if bad.numel():
        bad[0] = 99  # outside the 4 columns
    with pytest.raises(ValueError):
        torch.ops.scorch.region(_program([5, 4]), [x, values, pos, bad])
    with pytest.raises(ValueError, match="packed"):
        torch.ops.scorch.region(_program([5, 4, 2]), [x, values, pos, crd])
    with pytest.raises(ValueError, match="format"):
        torch.ops.scorch.region(_program([5, 4], "nonsense(0)"), [x, values, pos, crd])
    with pytest.raises(Exception, match="1-D"):
        torch.ops.scorch.region(_program([5, 4]), [x, values.view(1, -1), pos, crd])


def test_packed_region_after_an_in_place_write_is_checked_again():
    x = torch.randn(3, 4)
    w = random_dense((5, 4), 0.5, seed=2)
    values, (pos, crd) = _packed(w)
    crd = crd.clone()
    out = torch.ops.scorch.region(_program([5, 4]), [x, values, pos, crd])
    _close(out, x @ w.t())
    if crd.numel():
        crd[0] = 1000  # a write the version counter sees
        with pytest.raises(ValueError):
            torch.ops.scorch.region(_program([5, 4]), [x, values, pos, crd])


# --- deployment: save with the kernel bundle, load with no compiler -------------------------------------

_RUN_SAVED = """
import sys, torch
from scorch_backend.compiler import jit
m = jit.load(sys.argv[1])
x = torch.load(sys.argv[2])["x"]
torch.save({"y": m(*x)}, sys.argv[3])
"""


def _run_saved(tmp_path, model_path, inputs, script_text=_RUN_SAVED, dispatch="sparse"):
    """Run a saved model on `inputs` in a child process with no compiler, no JIT and an empty kernel cache
    (and SCORCH_DISPATCH=`dispatch`); its output goes to tmp_path/out.pt ("y")."""
    import subprocess
    import sys

    torch.save({"x": tuple(inputs)}, tmp_path / "in.pt")
    script = tmp_path / "run.py"
    script.write_text(script_text)
    env = dict(os.environ, CXX="/nonexistent/c++", SCORCH_JIT="0", SCORCH_CACHE_DIR=str(tmp_path / "empty-cache"),
               SCORCH_DISPATCH=dispatch)
    return subprocess.run([sys.executable, str(script), str(model_path), str(tmp_path / "in.pt"),
                           str(tmp_path / "out.pt")], env=env, capture_output=True, text=True, timeout=300)


def test_saved_model_runs_without_a_compiler(tmp_path):
    model, case = _mlp()
    x = case.make_inputs(6)[0]
    new, _ = _rewrite(model, (x,))
    info = jit.save(new, tmp_path / "model.pt", (x,))
    assert info["kernels"] and info["bundle"]
    x2 = case.make_inputs(5)[0]
    r = _run_saved(tmp_path, tmp_path / "model.pt", (x2,))
    assert r.returncode == 0, r.stderr[-2000:]
    with torch.no_grad():
        _close(torch.load(tmp_path / "out.pt")["y"], model(x2))
    # Without its bundle, the model names the kernel it misses.
    os.unlink(info["bundle"])
    r = _run_saved(tmp_path, tmp_path / "model.pt", (x2,))
    assert r.returncode != 0 and "kernel bundle" in r.stderr
    # Loaded by torch.jit.load alone (no bundle), the region's first call names the missing kernel's spec.
    r = _run_saved(tmp_path, tmp_path / "model.pt", (x2,),
                   _RUN_SAVED.replace("jit.load(sys.argv[1])", "torch.jit.load(sys.argv[1])"))
    assert r.returncode != 0 and info["kernels"][0] in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("dispatch", ["sparse", "auto"])  # the child's
def test_saved_model_has_the_kernels_of_its_dense_variants(tmp_path, dispatch):
    # fc1 unpruned (no sparse operand: left to ATen), fc2's region reads fc1's ReLU output compressed; on an
    # input where that output is about half nonzero (above kDemoteDensity, 0.25), the region reads it dense (a
    # variant of its program, chosen per call by density, whatever the dispatch mode). The bundle must hold that
    # variant's kernel too: it once held only the program's own, and the saved model failed every such call
    # where no compiler is. (This test once rewrote under the default dispatch, which left fc1 to ATen by the
    # cost model's estimate, 0.5x here; fc2's was 0.8-1.0x, so on CI's CPU no region was made at all.)
    model, case = _mlp()
    with torch.no_grad():
        model.fc1.weight.copy_(torch.randn(model.fc1.weight.shape, generator=torch.Generator().manual_seed(1)) * 0.1)
    x = case.make_inputs(4)[0]
    new, report = _rewrite(model, (x,))
    assert [r.split()[1] for r in report.regions] == ["fc2", "fc3"], report.regions
    info = jit.save(new, tmp_path / "model.pt", (x,))
    x2 = torch.randn(8, x.shape[1])
    with torch.no_grad():
        density = (torch.relu(model.fc1(x2)) != 0).float().mean().item()
    assert 0.3 < density < 0.7  # read dense by the variant
    r = _run_saved(tmp_path, tmp_path / "model.pt", (x2,), dispatch=dispatch)
    assert r.returncode == 0, r.stderr[-2000:]
    with torch.no_grad():
        _close(torch.load(tmp_path / "out.pt")["y"], model(x2))
    assert len(info["kernels"]) == 3  # fc2's own, its variant's (fc1's output read dense), fc3's


def test_a_bundle_that_lacks_the_models_kernels_is_refused_at_load(tmp_path):
    # Another model's bundle in its place loaded as well, and failed only at the first call that needed a kernel
    # it lacks (helper-41): now named at load.
    from scorch_backend.custom_ops import aot

    model, case = _mlp()
    x = case.make_inputs(6)[0]
    new, _ = _rewrite(model, (x,))
    info = jit.save(new, tmp_path / "model.pt", (x,))
    assert len(info["kernels"]) >= 2
    aot.build_bundle(info["kernels"][:1], info["bundle"])  # only the first, under the model's bundle name
    with pytest.raises(ValueError, match=r"lacks \d+ of the \d+ kernels .* needs \(is it another model.s bundle"):
        jit.load(tmp_path / "model.pt")


def test_saving_a_scripted_copy_is_refused(tmp_path):
    # Its kernels cannot be found without the GraphModule: once it saved no bundle (and deleted an earlier one),
    # and the model failed at its first call where there is no compiler (helper-41).
    model, case = _mlp()
    x = case.make_inputs(6)[0]
    new, _ = _rewrite(model, (x,))
    info = jit.save(new, tmp_path / "model.pt", (x,))
    for copy in (torch.jit.script(new), torch.jit.trace(new, (x,))):
        with pytest.raises(ValueError, match="needs the GraphModule jit.rewrite returned"):
            jit.save(copy, tmp_path / "model.pt", (x,))
    assert os.path.exists(info["bundle"])
    # A model without Scorch ops still saves, with no bundle.
    plain = jit.save(torch.jit.script(nn.Linear(4, 2)), tmp_path / "plain.pt", (torch.randn(1, 4),))
    assert plain["bundle"] is None and plain["kernels"] == []


@pytest.mark.parametrize("text", ["[1, 2]", "{\"kernels\": [\"x\"]}", "{not json", "{\"kernels\": [1], \"bundle\": 5}",
                                  "{\"kernels\": [\"x\"], \"bundle\": \"../model.pt.kernels\"}",
                                  "{\"kernels\": [\"x\"], \"bundle\": \"/etc/passwd\"}"])
def test_a_damaged_scorch_json_is_named(tmp_path, text):
    model, case = _mlp()
    x = case.make_inputs(6)[0]
    new, _ = _rewrite(model, (x,))
    jit.save(new, tmp_path / "model.pt", (x,))
    module = torch.jit.load(str(tmp_path / "model.pt"))
    torch.jit.save(module, str(tmp_path / "edited.pt"), _extra_files={"scorch.json": text})
    with pytest.raises(ValueError, match="scorch.json .* is damaged"):
        jit.load(tmp_path / "edited.pt")


def test_block_sparse_attention_rewrites_to_the_scorch_op(tmp_path):
    """The block-sparse attention's idiom becomes one scorch::masked_attention call (the mask stays a buffer);
    the module matches eager on new batch sizes, scripts, saves with a bundle holding attention's kernels,
    loads, and runs from a fresh process with no compiler and no JIT."""
    from scorch_backend.custom_ops import attention

    case = zoo.make("block_sparse_attention", "test")
    model = case.model.eval()
    new, report = _rewrite(model, case.inputs)
    assert "torch.ops.scorch.masked_attention(" in new.code
    assert "softmax" not in new.code and "masked_fill" not in new.code
    assert any("attention" in r for r in report.regions), report.regions
    assert torch.equal(new.w_mask, model.mask)
    scripted = torch.jit.script(new)
    assert "scorch.masked_attention" in scripted.code
    x = case.inputs[0]
    before = attention.stats()
    with torch.no_grad():
        want = model(x)
        _close(new(x), want)
        _close(scripted(x), want)
        for batch in (1, 3):
            x2 = case.make_inputs(batch)[0]
            _close(scripted(x2), model(x2))
    if os.environ["SCORCH_DISPATCH"] == "sparse":
        assert attention.stats()["sparse_runs"] >= before["sparse_runs"] + 4
    # Saved with its bundle: attention's forward kernels are in it.
    info = jit.save(new, tmp_path / "model.pt", (x,))
    want_specs = attention.kernel_specs((2, 2, 256, 16), (2, 2, 256, 16), (2, 2, 256, 16), torch.float32, False)
    assert set(want_specs) <= set(info["kernels"]) and info["bundle"]
    loaded = jit.load(tmp_path / "model.pt")
    x2 = case.make_inputs(3)[0]
    with torch.no_grad():
        _close(loaded(x2), model(x2))
    r = _run_saved(tmp_path, tmp_path / "model.pt", (x2,))
    assert r.returncode == 0, r.stderr[-2000:]
    with torch.no_grad():
        _close(torch.load(tmp_path / "out.pt")["y"], model(x2))


def test_rewritten_attention_trains_through_the_op():
    """A rewritten model's masked attention differentiates through the C++ op (gradients to the input)."""
    case = zoo.make("block_sparse_attention", "test", seq=64, block=8)
    model = case.model.eval()
    new, _ = _rewrite(model, case.inputs)
    assert "torch.ops.scorch.masked_attention(" in new.code
    x = case.inputs[0].clone().requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    new(x).sum().backward()
    model(x_ref).sum().backward()
    _close(x.grad, x_ref.grad)


def test_hf_bert_rewrites_scripts_and_packs(tmp_path):
    pytest.importorskip("transformers")
    case = zoo.make("bert_encoder", "test", sparsity=0.9)
    model = case.model
    x = case.inputs[0]
    new, report = _rewrite(model, (x,))
    assert len(report.regions) >= 4 and report.packed
    assert report.packed_ratio < 0.22, report.packed_ratio
    scripted = torch.jit.script(new)
    torch.jit.save(scripted, str(tmp_path / "bert.pt"))
    loaded = torch.jit.load(str(tmp_path / "bert.pt"))
    for seq in (x.shape[1], 7):
        ids = torch.randint(0, 1000, (1, seq), generator=torch.Generator().manual_seed(seq))
        with torch.no_grad():
            want = model(ids).last_hidden_state
        _close(new(ids)[0], want)
        _close(loaded(ids)[0], want)


def test_export_and_aoti_package(tmp_path):
    """torch.export of a rewritten model, packaged by AOTInductor: the package calls scorch::region through
    its schema (the op's C++ kernel), and runs on a new batch size."""
    model, case = _mlp()
    x = case.make_inputs(6)[0]
    new, _ = _rewrite(model, (x,))
    ep = torch.export.export(new, (x,), dynamic_shapes=({0: torch.export.Dim("batch", min=2)},))
    path = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "model.pt2"))
    loaded = torch._inductor.aoti_load_package(path)
    x2 = case.make_inputs(5)[0]
    with torch.no_grad():
        _close(loaded(x2), model(x2))


def _torch_csr(adj, index_dtype):
    """A Scorch CSR SparseTensor as the torch.sparse CSR tensor a deployed model is handed."""
    t = adj.to_torch(torch.sparse_csr)
    return torch.sparse_csr_tensor(t.crow_indices().to(index_dtype), t.col_indices().to(index_dtype), t.values(),
                                   t.shape)


def test_gcn_with_a_sparse_input_rewrites_and_takes_new_graphs(tmp_path):
    """The zoo GCN takes its adjacency as a SparseTensor input: the rewritten module takes it as a torch.sparse
    CSR tensor (int32 or int64 indices), its products are regions reading it packed with the size of each
    call, and a graph of another size runs without a new rewrite, scripted and after save/load."""
    case = zoo.make("gcn", "test")
    other = zoo.make("gcn", "test", nodes=411, edges=5000, seed=3)
    model = case.model.eval()
    new, report = _rewrite(model, case.inputs)
    assert sum("(sparse input)" in r for r in report.regions) == 2, report.regions
    assert "scorch.region" in new.code and "crow_indices" in new.code
    scripted = torch.jit.script(new)
    torch.jit.save(scripted, str(tmp_path / "gcn.pt"))
    loaded = torch.jit.load(str(tmp_path / "gcn.pt"))
    for c in (case, other, case):
        x, adj = c.inputs
        with torch.no_grad():
            want = model(x, adj)
        for index_dtype in (torch.int32, torch.int64):
            a = _torch_csr(adj, index_dtype)
            _close(new(x, a), want)
            _close(loaded(x, a), want)
    # An empty graph (no edges): every output row is the bias path.
    x, adj = other.inputs
    empty = torch.sparse_csr_tensor(torch.zeros(x.shape[0] + 1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                                    torch.zeros(0), (x.shape[0], x.shape[0]))
    with torch.no_grad():
        _close(loaded(x, empty), model(x, sb_sparse(torch.zeros(x.shape[0], x.shape[0]))))


class _AdjLinear(torch.nn.Module):
    """A graph layer taking its adjacency as a sparse input: adj @ lin(h)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 8)

    def forward(self, adj, h):
        return adj @ self.lin(h)


def test_a_sparse_input_of_the_wrong_size_is_refused_as_eager_refuses_it(tmp_path):
    """The region reads rows from crow_indices and columns from the dense operand; the rewritten module checks
    the input's declared size against both, scripted and after save/load, instead of returning a result of
    another shape."""
    model = _AdjLinear().eval()
    new, _ = _rewrite(model, (sb_sparse((torch.rand(10, 10) < 0.3).float()), torch.randn(10, 16)))
    scripted = torch.jit.script(new)
    torch.jit.save(scripted, str(tmp_path / "g.pt"))
    loaded = torch.jit.load(str(tmp_path / "g.pt"))
    good = torch.sparse_csr_tensor(torch.tensor([0, 1, 2, 2, 3]), torch.tensor([0, 1, 2]), torch.ones(3), (4, 6))
    h = torch.randn(6, 16)
    for m in (new, loaded):
        with torch.no_grad():
            _close(m(good, h), good.to_dense() @ model.lin(h))
    for cols in (3, 12):
        bad = torch.sparse_csr_tensor(torch.tensor([0, 1, 2, 2, 3]), torch.tensor([0, 1, 2]), torch.ones(3), (4, cols))
        with pytest.raises(RuntimeError):
            model(bad, h)  # eager refuses it
        for m in (new, loaded):
            with pytest.raises((RuntimeError, AssertionError, torch.jit.Error), match="columns"):
                m(bad, h)


@pytest.mark.parametrize("shape", [(10, 10), (7, 13), (1, 5)])
def test_gradients_through_a_sparse_input_of_the_rewritten_module(tmp_path, shape):
    """The gradient program of the dense operand kept the packed input, whose column count the call gives;
    without the letter that gave it, every backward raised "packed operand 1 has no size for its letter"."""
    torch.manual_seed(0)
    model = _AdjLinear()
    new, _ = _rewrite(model, (sb_sparse((torch.rand(10, 10) < 0.3).float()), torch.randn(10, 16)))
    adj_d = (torch.rand(*shape) < 0.4).float()
    for m in (new, torch.jit.script(new)):
        h, g = torch.randn(shape[1], 16, requires_grad=True), torch.randn(shape[0], 8)
        (m(adj_d.to_sparse_csr(), h) * g).sum().backward()
        h2 = h.detach().clone().requires_grad_()
        (adj_d @ model.lin(h2) * g).sum().backward()
        _close(h.grad, h2.grad)


def test_training_over_graphs_of_many_sizes_parses_no_program_per_size(tmp_path):
    """The gradient program of the dense operand gets the sparse input's sizes from the call. It had a text of
    its own per graph size, so the program cache (never freed) grew by one entry per new size: without bound in
    training over mini-batches of graphs. Twice differentiable as well (the gradient program's own backward)."""
    from scorch_backend import _C

    class G(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(6, 4)

        def forward(self, adj, h):
            return adj @ self.lin(h)

    torch.manual_seed(1)
    model = G()
    new, _ = _rewrite(model, (sb_sparse((torch.rand(9, 9) < 0.3).float()), torch.randn(9, 6)))

    def step(n, create_graph=False):
        adj_d = (torch.rand(n, n + 2) < 0.4).float()
        h = torch.randn(n + 2, 6, requires_grad=True)
        g = torch.randn(n, 4)
        (gh,) = torch.autograd.grad((new(adj_d.to_sparse_csr(), h) * g).sum(), h, create_graph=create_graph)
        h2 = h.detach().clone().requires_grad_()
        (gh2,) = torch.autograd.grad((adj_d @ model.lin(h2) * g).sum(), h2, create_graph=create_graph)
        _close(gh, gh2)
        return gh, h, gh2, h2

    step(5)
    before = _C.region_cache_sizes()["programs"]
    for n in range(6, 30):
        step(n)
    assert _C.region_cache_sizes()["programs"] == before


def test_second_order_through_a_gradient_program_with_a_sparse_input_of_the_call():
    """adj(i,j) x(j,k) y(k,l) with adj packed at a size the call gives: x's gradient program lacks x, the only
    other operand with j, and gets adj's size from the call; its own backward (y's gradient of |d/dx|^2) runs
    too, at several sizes."""
    program = json.dumps({"operands": [["ij", "sparse", False, False, 0, False,
                                        {"format": "dense(0),compressed(1)", "size": [-1, -1]}],
                                       ["jk", "dense", False, True, 0, False],
                                       ["kl", "dense", False, True, 0, False]],
                          "out": "il", "coef": 1.0, "frozen": False, "name": "second_order"})
    torch.manual_seed(3)
    for n, m in [(4, 6), (7, 3), (1, 5)]:
        adj = (torch.rand(n, m) < 0.5).float()
        csr = adj.to_sparse_csr()
        x = torch.randn(m, 3, requires_grad=True)
        y = torch.randn(3, 2, requires_grad=True)
        g = torch.randn(n, 2)
        out = torch.ops.scorch.region(program, [csr.values(), x, y, csr.crow_indices(), csr.col_indices()])
        (gx,) = torch.autograd.grad((out * g).sum(), x, create_graph=True)
        (gy,) = torch.autograd.grad((gx ** 2).sum(), y)
        x2, y2 = x.detach().requires_grad_(), y.detach().requires_grad_()
        (gx2,) = torch.autograd.grad((adj @ x2 @ y2 * g).sum(), x2, create_graph=True)
        (gy2,) = torch.autograd.grad((gx2 ** 2).sum(), y2)
        _close(gx, gx2)
        _close(gy, gy2)


def sb_sparse(dense):
    import scorch_backend as sb

    return sb.sparse(dense, "csr")


def test_saved_gcn_with_a_sparse_input_runs_without_a_compiler(tmp_path):
    case = zoo.make("gcn", "test")
    model = case.model.eval()
    new, _ = _rewrite(model, case.inputs)
    x, adj = zoo.make("gcn", "test", nodes=257, edges=2000, seed=5).inputs
    info = jit.save(new, tmp_path / "gcn.pt", (case.inputs[0], _torch_csr(case.inputs[1], torch.int32)))
    assert any("i64" in k for k in info["kernels"]) and any("i32" in k for k in info["kernels"]), info["kernels"]
    r = _run_saved(tmp_path, tmp_path / "gcn.pt", (x, _torch_csr(adj, torch.int64)))
    assert r.returncode == 0, r.stderr[-2000:]
    with torch.no_grad():
        _close(torch.load(tmp_path / "out.pt")["y"], model(x, adj))


class _SparseInputMisuse(nn.Module):
    def forward(self, x, adj):
        return adj.to_dense() @ x


def test_sparse_inputs_the_rewrite_cannot_take_are_clear_errors():
    case = zoo.make("gcn", "test")
    x, adj = case.inputs
    with pytest.raises(jit.RewriteError, match="torch.sparse CSR"):
        jit.rewrite(case.model.eval(), (x, adj.to_format("coo")))
    with pytest.raises(jit.RewriteError, match="torch.sparse tensor"):
        jit.rewrite(case.model.eval(), (x, adj.to_torch(torch.sparse_csr)))
    with pytest.raises(jit.RewriteError, match="sparse input adj is used by"):
        _rewrite(_SparseInputMisuse(), (torch.randn(x.shape[0], 4), adj))


def test_packed_sizes_given_by_the_call_are_checked():
    """A region program whose packed size is -1 takes it from the call; a letter no operand gives is a clear
    error, and row pointers that disagree with the other operand are caught by the validation."""
    a = random_dense((5, 7), 0.4)
    t = _torch_csr(sb_sparse(a), torch.int32)
    b = torch.randn(7, 3)
    program = ('{"operands":[["ij","sparse",false,false,0,false,{"format":"dense(0),compressed(1)","size":[-1,-1]}],'
               '["jk","dense",false,true,0,false]],"out":"ik","coef":1.0,"frozen":false,"name":"t"}')
    _close(torch.ops.scorch.region(program, [t.values(), b, t.crow_indices(), t.col_indices()]), a @ b)
    lonely = program.replace('["jk","dense",false,true,0,false]],"out":"ik"', '["kl","dense",false,true,0,false]],"out":"il"')
    with pytest.raises(ValueError, match="no size for its letter 'j'"):
        torch.ops.scorch.region(lonely, [t.values(), b, t.crow_indices(), t.col_indices()])
    with pytest.raises(ValueError):
        torch.ops.scorch.region(program, [t.values(), torch.randn(4, 3), t.crow_indices(), t.col_indices()])


class _BufferGCN(nn.Module):
    """The zoo GCN with its normalized adjacency held by the module (a fixed graph, as deployed)."""

    def __init__(self, gcn, adj):
        super().__init__()
        self.gcn = gcn
        self.register_buffer("adj", adj.to_dense())

    def forward(self, x):
        return self.gcn(x, self.adj)


def test_gcn_with_its_graph_as_a_buffer_rewrites_packed(tmp_path):
    case = zoo.make("gcn", "test")
    x, adj = case.inputs
    model = _BufferGCN(case.model.eval(), adj)
    new, report = _rewrite(model, (x,))
    packed = {p.name: p for p in report.packed}
    assert "adj" in packed and packed["adj"].bytes < 0.2 * packed["adj"].dense_bytes
    assert "w_adj" not in dict(new.named_buffers())  # every product reads the packed graph
    scripted = torch.jit.script(new)
    torch.jit.save(scripted, str(tmp_path / "gcn.pt"))
    loaded = torch.jit.load(str(tmp_path / "gcn.pt"))
    x2 = torch.rand_like(x)
    with torch.no_grad():
        want = model(x2)
        _close(new(x2), want)
        _close(loaded(x2), want)


def test_trace_through_sparse_tensor_to_dense_and_coordinates():
    """torch.jit.trace through SparseTensor.to_dense() and coordinates(): the format ops take SymInt[] sizes,
    which torch's tracer cannot record from traced sizes (an internal assert); SparseTensor passes plain ints
    while tracing (the sizes are constants of the trace, as before)."""
    dense = torch.tensor([[1.0, 0, 2], [0, 0, 3]])
    A = sb.sparse(dense, "csr")
    traced = torch.jit.trace(lambda v: A.with_values(v).to_dense() * 2, (A.stored_values,))
    torch.testing.assert_close(traced(A.stored_values), dense * 2)
    torch.testing.assert_close(traced(A.stored_values + 1), (dense + (dense != 0)) * 2)
    coords = torch.jit.trace(lambda v: A.with_values(v).coordinates().to(v.dtype) * v, (A.stored_values,))
    torch.testing.assert_close(coords(A.stored_values), A.coordinates().to(torch.float32) * A.stored_values)
