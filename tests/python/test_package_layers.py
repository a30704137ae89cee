"""The package's stages import only downward and no module imports itself back through others.

Reads the import statements of every module (at any depth, including imports inside functions) without running
them, so a new upward import or cycle fails here before it becomes a hidden import inside a function."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "scorch_backend"
# Stage of each top-level part, lowest first; a module may import its own stage or lower ones.
STAGES = {"config": 0, "log": 0, "target": 0, "_native": 0, "_C": 0, "cost_model": 0,
          "tensors": 1, "custom_ops": 2, "compiler": 3, "tools": 4}


def _modules() -> dict:
    out = {}
    for f in PACKAGE.rglob("*.py"):
        parts = list(f.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (f, is_pkg)
    return out


def _imports(mods: dict) -> dict:
    edges = {m: set() for m in mods}
    for m, (f, is_pkg) in mods.items():
        pkg = m if is_pkg else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(f.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    name = ".".join(base + ([node.module] if node.module else []))
                else:
                    name = node.module or ""
                for a in node.names:  # a submodule (or the native module _C), else a name of the module
                    sub = f"{name}.{a.name}"
                    targets.append(sub if sub in mods or (name == "scorch_backend" and a.name == "_C") else name)
            elif isinstance(node, ast.Import):
                targets += [a.name for a in node.names]
            for t in targets:
                if t.startswith("scorch_backend") and t != m and not (is_pkg and t.startswith(m + ".")):
                    edges[m].add(t)
    return edges


def _stage(module: str) -> int | None:
    parts = module.split(".")
    return STAGES.get(parts[1]) if len(parts) > 1 else None


def test_every_part_has_a_stage():
    for m in _modules():
        if m != "scorch_backend":
            assert _stage(m) is not None, f"{m} is in no stage: add it to STAGES (and to docs/package.md)"


def test_imports_go_down():
    mods = _modules()
    upward = []
    for m, targets in _imports(mods).items():
        if m == "scorch_backend":  # the package root is the user API: it gathers every stage
            continue
        for t in targets:
            if t == "scorch_backend" or (_stage(t) is not None and _stage(t) > _stage(m)):
                upward.append(f"{m} -> {t}")
    assert not upward, "imports going up a stage:\n" + "\n".join(sorted(upward))


def test_no_import_cycles():
    mods = _modules()
    edges = _imports(mods)
    state: dict = {}

    def visit(m, path):
        state[m] = "open"
        for t in sorted(edges.get(m, ())):
            if t not in mods:
                continue
            if state.get(t) == "open":
                pytest.fail("import cycle: " + " -> ".join(path[path.index(t):] + [t]))
            if t not in state:
                visit(t, path + [t])
        state[m] = "done"

    for m in sorted(mods):
        if m not in state:
            visit(m, [m])


def test_default_data_folder_is_the_checkouts_sibling():
    # Data sets are read from ../shared/data next to the checkout (moving tools/ once pointed it elsewhere).
    from scorch_backend.tools import datasets

    assert datasets.DEFAULT_DATA.resolve() == (PACKAGE.parent.parent / "shared" / "data").resolve()
