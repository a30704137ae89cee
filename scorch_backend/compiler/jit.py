"""TorchScript rewriting: a model's sparse regions as calls of the C++ scorch ops, its weights stored compressed.

    rewritten = scorch_backend.compiler.jit.rewrite(model, (x,))      # an nn.Module (a torch.fx.GraphModule)
    scripted = torch.jit.script(rewritten)                    # or torch.jit.trace(rewritten, (x,))
    torch.jit.save(scripted, "model.pt")

`rewrite` runs the torch.compile backend's own passes (discover, propagate, partition, fuse, rewrite) on the
graph Dynamo captures from the model, then:
- each sparse weight a region reads is stored compressed: the region's operand becomes "packed" (format and
  size in the program; the stored values and index buffers are buffers of the new module), and the dense
  weight is dropped when nothing else reads it;
- parameters and buffers the graph still reads become attributes of the new module; sizes Dynamo made
  symbolic are read from the inputs (`x.size(d)`), so the module runs on new batch sizes and shapes;
- the masked-attention idiom becomes a `torch.ops.scorch.masked_attention` call (its mask stays a buffer or
  an input; the op compresses its pattern once per version);
- the result is an ordinary `nn.Module` whose code is plain torch calls plus `torch.ops.scorch.region` and
  `torch.ops.scorch.masked_attention`, which `torch.jit.script`, `torch.jit.trace`, `torch.export.export` and a
  C++ program with `libscorch_ops` can run.

Each region still chooses dense or sparse per call (SCORCH_DISPATCH, the measured crossover), so a deployed
model runs dense where its data is not sparse enough. Products whose sparse operand is not a parameter or
buffer (activations, inputs) are regions that compress it at run time, as under torch.compile.
"""

from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from .. import _C
from .. import log as _log
from ..custom_ops import aot, attention
from ..custom_ops.region import Operand, Program, parse_program
from ..tensors.sparse_tensor import SparseTensor
from .backend import _options, transform

_logger = _log.get("jit")


@dataclass
class PackedWeight:
    """A weight a region reads compressed: where it came from and what it costs."""

    name: str           # the parameter's or buffer's qualified name in the model
    format: str         # the format's text
    shape: tuple
    nnz: int
    bytes: int          # stored values and index buffers
    dense_bytes: int    # the dense tensor it replaces


@dataclass
class RewriteReport:
    regions: list = field(default_factory=list)   # the regions' titles
    packed: list = field(default_factory=list)    # PackedWeight, one per packed weight
    left_dense: list = field(default_factory=list)  # decisions: what stayed dense and why

    @property
    def packed_ratio(self) -> float:
        """Bytes of the packed weights over the bytes of the dense weights they replace."""
        dense = sum(p.dense_bytes for p in self.packed)
        return sum(p.bytes for p in self.packed) / dense if dense else 1.0


class RewriteError(RuntimeError):
    """The model cannot be rewritten (the message says why)."""


# --- capture ----------------------------------------------------------------------------------------------

def _capture(model: torch.nn.Module, example_inputs: tuple, dynamic: bool):
    """The FX graph Dynamo makes of `model(*example_inputs)` (one graph: no graph breaks allowed) and the real
    values of its placeholders."""
    import torch._dynamo

    graphs = []

    def backend(gm, example):
        graphs.append((gm, list(example)))
        return gm.forward

    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=dynamic)
    try:
        # Float settings of the model (an attention's scale) stay constants: a symbolic float would hide the
        # masked-attention idiom from the partition (its scale must be a number) and cost a tensor per call.
        with torch.no_grad(), torch._dynamo.config.patch(specialize_float=True):
            compiled(*example_inputs)
    except torch._dynamo.exc.TorchDynamoException as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RewriteError(f"the model cannot be captured as one graph (a graph break or data-dependent control "
                           f"flow): {first}") from e
    if len(graphs) != 1:
        raise RewriteError(f"expected one captured graph, got {len(graphs)}")
    return graphs[0]


def _expr(s) -> str:
    return str(s.node.expr) if isinstance(s, torch.SymInt) else str(s)


def _classify(gm: fx.GraphModule, values: list, model: torch.nn.Module, example_inputs: tuple):
    """Each placeholder as ("input", position), ("state", qualified name, is_parameter) or ("size", input
    position, dimension)."""
    state = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        state.setdefault(id(p), (name, True))
    for name, b in model.named_buffers(remove_duplicate=False):
        state.setdefault(id(b), (name, False))
    inputs = {id(x): i for i, x in enumerate(example_inputs) if isinstance(x, torch.Tensor)}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    kinds = {}
    for node, value in zip(placeholders, values):
        if isinstance(value, torch.Tensor) and id(value) in state:
            kinds[node] = ("state",) + state[id(value)]
        elif isinstance(value, torch.Tensor) and id(value) in inputs:
            kinds[node] = ("input", inputs[id(value)])
        elif isinstance(value, (torch.SymInt, int)) and not isinstance(value, bool):
            kinds[node] = ("size",)
        elif isinstance(value, torch.Tensor) and "_modules_" in str(node.target) or \
                isinstance(value, torch.Tensor) and value.dim() == 0:
            # A module attribute Dynamo lifted as a tensor (a float setting such as Embedding.norm_type): its
            # value now is part of the model.
            kinds[node] = ("constant", value.detach().clone())
        else:
            raise RewriteError(f"graph input {node.target} is neither a model input, a parameter nor a buffer "
                               f"({type(value).__name__}); pass every tensor the model reads as an input or keep "
                               "it on the module")
    # A symbolic size: the first input dimension that carries the same symbol.
    for node, kind in list(kinds.items()):
        if kind[0] != "size":
            continue
        want = _expr(node.meta.get("example_value"))
        found = None
        for other, k in kinds.items():
            if k[0] != "input" or found:
                continue
            ev = other.meta.get("example_value")
            for d, s in enumerate(getattr(ev, "shape", ())):
                if _expr(s) == want:
                    found = ("size", other, d)
                    break
        if found is None and not node.users:
            found = ("unused",)  # e.g. a sparse input's number of stored entries, which nothing reads
        if found is None:
            raise RewriteError(f"the symbolic size {node.target} ({want}) is no input's dimension")
        kinds[node] = found
    return kinds


# --- packing ----------------------------------------------------------------------------------------------

def _safe(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


def _region_nodes(gm: fx.GraphModule):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in
            (torch.ops.scorch.region.default, torch.ops.scorch.region)]


def _region_dtype(program: Program, values: list) -> torch.dtype:
    dtype = None
    for o, v in zip(program.operands, values):
        if o.kind != "pattern" and isinstance(v, torch.Tensor) and v.is_floating_point():
            dtype = v.dtype if dtype is None else torch.promote_types(dtype, v.dtype)
    return dtype or torch.float32


def _pack(gm, kinds, real: dict, new_attrs: dict, report: RewriteReport) -> None:
    """Rewrite each region whose sparse operand is a weight to read it packed; register the packed tensors in
    `new_attrs` (attribute name -> tensor) and read them with get_attr nodes."""

    packed_cache: dict = {}  # (weight name, format key) -> attribute names
    for node in _region_nodes(gm):
        text, leaves = node.args
        program = parse_program(text)
        report.regions.append(program.title)
        leaf_values = [real.get(leaf) for leaf in leaves]
        dtype = _region_dtype(program, [v if v is not None else torch.empty(0) for v in leaf_values])
        operands, slots, extra = [], [], []
        for o, leaf, value in zip(program.operands, leaves, leaf_values):
            kind = kinds.get(leaf)
            if o.kind != "sparse" or o.expand or kind is None or kind[0] != "state" or value is None:
                operands.append(o)
                slots.append(leaf)
                continue
            name = kind[1]
            key = (name, o.letters, str(dtype))
            if key not in packed_cache:
                _, st = _C.region_compressed(value.detach(), o.letters, "sparse", 0, [], dtype, True)
                base = "scorch_packed_" + _safe(name)
                attr_values = base + "_values"
                new_attrs[attr_values] = st.stored_values.contiguous()
                attr_buffers = []
                for bname, b in st.level_buffers.items():
                    attr_buffers.append(f"{base}_{bname}")
                    new_attrs[attr_buffers[-1]] = b.contiguous()
                fmt = st.format.canonical
                nbytes = sum(t.numel() * t.element_size() for t in [st.stored_values, *st.level_buffers.values()])
                report.packed.append(PackedWeight(name, fmt, tuple(value.shape), st.nnz, nbytes,
                                                  value.numel() * value.element_size()))
                packed_cache[key] = (attr_values, attr_buffers, fmt)
                owner = gm.graph.owning_module or gm  # so that get_attr finds them (FX checks)
                for attr in [attr_values, *attr_buffers]:
                    owner.register_buffer(attr, new_attrs[attr])
            attr_values, attr_buffers, fmt = packed_cache[key]
            with gm.graph.inserting_before(node):
                slots.append(gm.graph.get_attr(attr_values))
                extra += [gm.graph.get_attr(b) for b in attr_buffers]
            operands.append(type(o)(o.letters, "sparse", cached=False, grad=False, expand=0, weight=False,
                                    packed=(fmt, tuple(int(d) for d in value.shape))))
        new_program = Program(tuple(operands), program.out, program.coef, program.frozen, program.name,
                              program.label, requested_order=program.requested_order)
        node.target = torch.ops.scorch.region.default
        node.args = (new_program.text(), slots + extra)


# --- sparse inputs ----------------------------------------------------------------------------------------
# A model that takes a sparse operand as an input (a GCN's adjacency: a new graph per call) takes it in the
# rewritten module as a torch.sparse CSR tensor, which TorchScript, C++ (torch::sparse_csr_tensor) and Python
# can all pass. Its products become region calls that read it packed: the stored values in the slot, the row
# pointers and column indices after the slots, and a size the region takes from the call (-1: the rows from
# the row pointers, the columns from the other operand), so every new graph runs without recompiling.

_SPARSE_PRODUCTS = {("call_function", operator.matmul), ("call_function", torch.matmul),
                    ("call_function", torch.mm), ("call_function", torch.sparse.mm),
                    ("call_method", "matmul"), ("call_method", "mm"), ("call_method", "__matmul__")}


def _sparse_input_formats(example_inputs, names) -> dict:
    """{input position: the SparseTensor's canonical format} for the sparse inputs (CSR only); RewriteError for
    any other sparse input."""

    found = {}
    for i, x in enumerate(example_inputs):
        if isinstance(x, SparseTensor):
            if x.format.name != "csr" or x.dim() != 2:
                raise RewriteError(f"input {names[i]} is a {x.format.name} SparseTensor: a rewritten module "
                                   "takes a sparse input as a torch.sparse CSR matrix (convert it: "
                                   "x.to_format('csr')), or keep it on the module as a buffer")
            found[i] = x.format.canonical
        elif isinstance(x, torch.Tensor) and x.layout != torch.strided:
            raise RewriteError(f"input {names[i]} is a torch.sparse tensor ({x.layout}): pass it as a Scorch "
                               "SparseTensor for the rewrite (scorch_backend.sparse(x, 'csr')); the rewritten "
                               "module then takes the torch.sparse CSR form")
    return found


def _route_sparse_inputs(gm, kinds, formats: dict, names, report: RewriteReport) -> None:
    """Each product of a sparse input becomes a region call reading it packed (see above)."""

    count = 0
    for node in [n for n in gm.graph.nodes if n.op == "placeholder"]:
        kind = kinds.get(node)
        if kind is None or kind[0] != "input" or kind[1] not in formats:
            continue
        name = names[kind[1]]
        for user in list(node.users):
            other = user.args[1] if len(user.args) == 2 else None
            ev = getattr(other, "meta", {}).get("example_value") if isinstance(other, fx.Node) else None
            if ((user.op, user.target) not in _SPARSE_PRODUCTS or user.kwargs or other is None or
                    user.args[0] is not node or other is node or not isinstance(ev, torch.Tensor) or
                    ev.dim() not in (1, 2)):
                what = user.target if user.op != "call_method" else f".{user.target}()"
                raise RewriteError(f"the sparse input {name} is used by {what}: a rewritten module runs only its "
                                   "products with dense matrices or vectors (input @ x); keep the rest in the "
                                   "model's own code before the sparse input reaches it, or use torch.compile")
            dense_letters, out = ("jk", "ik") if ev.dim() == 2 else ("j", "i")
            program = Program((Operand("ij", "sparse", grad=False, packed=(formats[kind[1]], (-1, -1))),
                               Operand(dense_letters, "dense")), out, name=f"sparse_input{count}",
                              label=f"{name} @ {other.name}")
            count += 1
            with gm.graph.inserting_before(user):
                # The region reads the sparse input's rows from its pointer array and its columns from the dense
                # operand: check that they agree with the sizes the input declares, as eager's product does.
                g = gm.graph
                pos = g.call_method("crow_indices", (node,))
                g.call_function(torch._assert, (g.call_function(operator.eq, (
                    g.call_method("size", (node, 1)), g.call_method("size", (other, 0)))),
                    f"the sparse input {name} has a different number of columns than {other.name} has rows"))
                g.call_function(torch._assert, (g.call_function(operator.eq, (
                    g.call_method("size", (node, 0)),
                    g.call_function(operator.sub, (g.call_method("numel", (pos,)), 1)))),
                    f"the sparse input {name}'s crow_indices do not match its number of rows"))
                crd = gm.graph.call_method("col_indices", (node,))
                values = gm.graph.call_method("values", (node,))
                region = gm.graph.call_function(torch.ops.scorch.region.default,
                                                (program.text(), [values, other, pos, crd]))
            region.meta.update(user.meta)
            user.replace_all_uses_with(region)
            gm.graph.erase_node(user)
            report.regions.append(f"{program.title} (sparse input)")


# --- the new module ---------------------------------------------------------------------------------------

def _input_names(model, count: int) -> list[str]:
    try:
        params = [p for p in inspect.signature(model.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        names = [p.name for p in params][:count]
    except (TypeError, ValueError):
        names = []
    names += [f"input{i}" for i in range(len(names), count)]
    return names


def _check_static_sizes(graph: fx.Graph, x: fx.Node, captured: fx.Node, name: str) -> None:
    """Sizes Dynamo fixed (sizes 0 and 1, and any size when not dynamic) are asserted at the top of the new
    forward, so another size fails with a clear message instead of deep inside a region."""
    ev = captured.meta.get("example_value")
    if isinstance(ev, torch.Tensor):
        # The rank first: the graph is traced for it (a region's letters, an attention's batch dimensions), and
        # another one failed deep inside (helper-41: "list index out of range").
        ok = graph.call_function(operator.eq, (graph.call_method("dim", (x,)), ev.dim()))
        graph.call_function(torch._assert, (ok, f"input {name} must have {ev.dim()} dimensions, as in the example "
                                                "inputs (the rewrite fixed the rank; rewrite with an example of "
                                                "this rank)"))
    for d, size in enumerate(getattr(ev, "shape", ())):
        if isinstance(size, int):
            ok = graph.call_function(operator.eq, (graph.call_method("size", (x, d)), size))
            graph.call_function(torch._assert, (ok, f"input {name}: dimension {d} must be {size}, the size in the "
                                                    "example inputs (the rewrite fixed it; rewrite with an "
                                                    "example of another size, 2 or more, to keep it variable)"))


def _build(gm, kinds, model, example_inputs, new_attrs: dict) -> fx.GraphModule:
    graph = fx.Graph()
    root = torch.nn.Module()
    names = _input_names(model, len(example_inputs))
    val_map = {}
    inputs = {}
    for i, x in enumerate(example_inputs):
        if isinstance(x, torch.Tensor):
            inputs[i] = graph.placeholder(names[i], type_expr=torch.Tensor)
        else:
            raise RewriteError(f"input {i} ({names[i]}) is a {type(x).__name__}; only tensor inputs are supported")
    used_state = {}
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        kind = kinds[node]
        if kind[0] == "input":
            val_map[node] = inputs[kind[1]]
            _check_static_sizes(graph, inputs[kind[1]], node, names[kind[1]])
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        kind = kinds[node]
        if kind[0] == "state":
            attr = "w_" + _safe(kind[1])
            used_state[attr] = (kind[1], kind[2])
            val_map[node] = graph.get_attr(attr)
        elif kind[0] == "size":
            val_map[node] = graph.call_method("size", (val_map[kind[1]], kind[2]))
        elif kind[0] == "constant":
            attr = "c_" + _safe(str(node.target))
            new_attrs[attr] = kind[1]
            val_map[node] = graph.get_attr(attr)
    out = graph.graph_copy(gm.graph, val_map)
    graph.output(out)
    # Attributes: model state still read, packed weights, and constants Dynamo lifted onto the graph module.
    state = dict(model.named_parameters(remove_duplicate=False))
    state.update(model.named_buffers(remove_duplicate=False))
    for node in graph.nodes:
        if node.op != "get_attr":
            continue
        target = node.target
        if target in used_state:
            name, is_param = used_state[target]
            t = state[name].detach()
            if is_param:
                root.register_parameter(target, torch.nn.Parameter(t, requires_grad=False))
            else:
                root.register_buffer(target, t)
        elif target in new_attrs:
            root.register_buffer(target, new_attrs[target])
        elif hasattr(gm, target):
            v = getattr(gm, target)
            if isinstance(v, torch.Tensor):
                root.register_buffer(target, v.detach())
            else:
                setattr(root, target, v)
    # Plain calls TorchScript understands: the op packets, not their overloads.
    for node in graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.scorch.region.default:
            node.target = torch.ops.scorch.region
        elif node.op == "call_function" and node.target is torch.ops.scorch.masked_attention.default:
            node.target = torch.ops.scorch.masked_attention
    graph.eliminate_dead_code()
    graph.lint()
    return fx.GraphModule(root, graph, class_name="ScorchRewritten")


def _flat(out) -> list:
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def _fix_output(new: fx.GraphModule, eager_out) -> None:
    """Dynamo's graph returns a flat tuple; give back what the model returns: one tensor, or a tuple of the
    tensors of a tuple, list, dict or ModelOutput (in its order)."""
    out_node = next(n for n in new.graph.nodes if n.op == "output")
    values = out_node.args[0]
    values = list(values) if isinstance(values, (tuple, list)) else [values]
    flat = _flat(eager_out)
    if len(values) != len(flat):
        raise RewriteError(f"the captured graph returns {len(values)} tensors, the model {len(flat)}")
    out_node.args = (values[0] if isinstance(eager_out, torch.Tensor) else tuple(values),)
    new.recompile()


def rewrite(model: torch.nn.Module, example_inputs, *, options: dict | None = None, dynamic: bool = True,
            report: RewriteReport | None = None) -> fx.GraphModule:
    """The model with its sparse regions as `torch.ops.scorch.region` calls and the sparse weights they read
    stored compressed; scriptable (`torch.jit.script`/`trace`), exportable (`torch.export.export`).

    example_inputs: a tuple of tensors, as the model is called (`model(*example_inputs)`); sizes other than 0
    and 1 may change later when `dynamic` (a batch of 1 fixes that size: give a batch of 2 or more).
    options: the backend's options (scorch_backend/compiler/backend.py), e.g. {"sparse_threshold": 0.2}.
    report: filled with the regions found and the weights packed (sizes in bytes)."""

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"rewrite takes an nn.Module, got {type(model).__name__}")
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    example_inputs = tuple(example_inputs)
    sparse_formats = _sparse_input_formats(example_inputs, _input_names(model, len(example_inputs)))
    report = report if report is not None else RewriteReport()
    opts = _options(dict(options or {}, frozen_weights=True))
    with torch.no_grad():
        eager_out = model(*example_inputs)
    gm, values = _capture(model, example_inputs, dynamic)
    kinds = _classify(gm, values, model, example_inputs)
    hints = [int(v.node.hint) if isinstance(v, torch.SymInt) else v for v in values]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    real = dict(zip(placeholders, hints))
    with torch.no_grad():
        result = transform(gm, hints, opts, chains=False)
    report.left_dense = [f"{d.node} = {d.op}: {d.reason}" for d in result.decisions]
    new_attrs: dict = {}
    _pack(gm, kinds, real, new_attrs, report)
    _route_sparse_inputs(gm, kinds, sparse_formats, _input_names(model, len(example_inputs)), report)
    for node, kind in kinds.items():
        if kind[0] == "unused":
            gm.graph.erase_node(node)
    report.regions += [f"{r.name} (masked attention)" for r in result.regions if r.attention is not None]
    new = _build(gm, kinds, model, example_inputs, new_attrs)
    _fix_output(new, eager_out)
    new.scorch_report = report
    _logger.info("rewrite: %d region(s), %d weight(s) packed (%.1f%% of their dense bytes)", len(report.regions),
                 len(report.packed), 100 * report.packed_ratio)
    return new


# --- deployment: the kernels a rewritten model needs, saved with it ----------------------------------------

def kernel_specs(module: fx.GraphModule, example_inputs) -> list[str]:
    """The specs of the kernels the module's regions run on their sparse path, found by running the module on
    `example_inputs` and asking the region op, at each region, what it would run (the same planner as the
    run-time path: specs do not depend on sizes, only on formats and dtypes), and those of masked attention's
    sparse path (`attention.kernel_specs`). Gradient kernels are not included: a deployed model runs
    inference."""

    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    specs: list[str] = []

    class Recorder(fx.Interpreter):
        def call_function(self, target, args, kwargs):
            if target in (torch.ops.scorch.region, torch.ops.scorch.region.default):
                text, operands = args
                # A sparse input (a packed size the call gives) may come with int32 or int64 indices (torch's
                # default): both kernels.
                dynamic = any(-1 in o.packed[1] for o in parse_program(text).operands if o.packed)
                # The program's own call and those of its variants that read an operand dense when its
                # density comes out high (a ReLU that is not sparse on some input): the density decides per
                # call, so a deployed model may run any of them.
                for eq, ops in _C.region_sparse_calls(text, list(operands)):
                    descs, f64 = [], False
                    for o in ops:
                        if isinstance(o, SparseTensor):
                            descs.append((o.format.canonical, list(o.shape), o.nnz))
                        else:
                            descs.append(("strided", list(o.shape), o.numel()))
                        f64 = f64 or o.dtype == torch.float64
                    idx64 = any(isinstance(o, SparseTensor) and o.index_dtype == torch.int64 for o in ops)
                    for wide in ((idx64, not idx64) if dynamic else (idx64,)):
                        spec = _C.plan_einsum(eq, descs, "strided", f64, wide)["spec"]
                        if spec not in specs:
                            specs.append(spec)
            elif target in (torch.ops.scorch.masked_attention, torch.ops.scorch.masked_attention.default):
                q, k, v = args[:3]
                for spec in attention.kernel_specs(tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, False):
                    if spec not in specs:
                        specs.append(spec)
            return super().call_function(target, args, kwargs)

    with torch.no_grad():
        Recorder(module).run(*example_inputs)
    return specs


def _bundle_path(path: str) -> str:
    return path + ".kernels"


def save(module: torch.nn.Module, path, example_inputs, *, target: str | None = None) -> dict:
    """Script `module` (a rewritten model), save it at `path`, and compile the kernels it needs into a bundle
    saved next to it (`path + ".kernels"`), so that it runs where there is no compiler (`load`, or a C++
    program calling `scorch::load_kernels`; examples/cpp). `target`: the instruction set to compile for
    (docs/targets.md); choose the oldest CPU the deployment will meet. Returns what was written."""
    import json
    import os

    path = os.fspath(path)
    specs = kernel_specs(module, example_inputs) if isinstance(module, fx.GraphModule) else []
    scripted = module if isinstance(module, torch.jit.ScriptModule) else torch.jit.script(module)
    if not isinstance(module, fx.GraphModule) and "scorch::" in str(scripted.inlined_graph):
        # The kernels are found by running the rewritten GraphModule's regions (kernel_specs); a scripted or
        # traced copy hides them, and a model saved without its bundle fails where there is no compiler.
        raise ValueError("jit.save needs the GraphModule jit.rewrite returned, not a scripted or traced copy of "
                         "it (nor a module holding one): the kernels its Scorch ops run are found by running the "
                         "GraphModule, and save scripts it itself. A model jit.load gave back is saved again with "
                         "torch.jit.save, its .kernels bundle copied next to it")
    extra = {"scorch.json": json.dumps({"kernels": specs, "bundle": os.path.basename(_bundle_path(path))})}
    torch.jit.save(scripted, path, _extra_files=extra)
    info = {"model": path, "kernels": specs, "bundle": None}
    if specs:
        aot.build_bundle(specs, _bundle_path(path), target=target)
        info["bundle"] = _bundle_path(path)
    elif os.path.exists(_bundle_path(path)):
        os.unlink(_bundle_path(path))  # a stale bundle of an earlier save
    return info


def load(path) -> torch.jit.ScriptModule:
    """Load a model saved by `save`: its kernel bundle first (when it has one), then the TorchScript module."""
    import json
    import os

    path = os.fspath(path)
    extra = {"scorch.json": ""}
    module = torch.jit.load(path, _extra_files=extra)
    try:
        meta = json.loads(extra["scorch.json"]) if extra["scorch.json"] else {}
        if not isinstance(meta, dict) or (meta.get("kernels") and not isinstance(meta.get("bundle"), str)):
            raise ValueError("expected an object with the kernel bundle's file name under 'bundle'")
        if meta.get("kernels") and (os.path.basename(meta["bundle"]) != meta["bundle"] or
                                    meta["bundle"] in ("", ".", "..")):
            raise ValueError(f"the bundle's name {meta['bundle']!r} is not a file name next to the model")
    except ValueError as e:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"{path}: its scorch.json (written by scorch_backend.compiler.jit.save) is damaged: {e}") \
            from None
    if meta.get("kernels"):
        bundle = os.path.join(os.path.dirname(path), meta["bundle"])
        if not os.path.exists(bundle):
            raise FileNotFoundError(f"{path} needs its kernel bundle {bundle} (written by scorch_backend.compiler.jit.save)")
        # Checked as loading checks it, then against the model's list: another model's bundle loads as well,
        # and would fail only at the first call that needs a kernel it lacks.
        held = {spec for spec, _ in aot.bundle_info(bundle)["kernels"]}
        missing = [k for k in meta["kernels"] if k not in held]
        if missing:
            raise ValueError(f"{bundle} lacks {len(missing)} of the {len(meta['kernels'])} kernels {path} needs "
                             f"(is it another model's bundle?), first: {missing[0]}")
        aot.load_bundle(bundle)
    return module


__all__ = ["rewrite", "RewriteError", "RewriteReport", "PackedWeight", "kernel_specs", "save", "load"]
