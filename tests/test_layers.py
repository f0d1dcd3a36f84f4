"""The layers of README's Layout section, checked: every import points down (or stays in its
layer), and no two modules import each other (ops <-> tensor, micrograd's way of attaching
operators to Tensor, is the one exception)."""
import ast
import re
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hpcdist")

# bottom to top; a module belongs to the first entry that is its name or a package above it
LAYERS = [
    ["device", "host"],                                                # services
    ["autograd"],                                                      # Tensor, ops
    ["nn", "optim", "data", "checkpoint"],                             # models, state
    ["comm"],                                                          # raw arrays, MPI
    ["parallel"],                                                      # Tensors meet comms
    ["run", "preflight", "plan"],                                      # a run's plumbing
    ["train", "bench", "cluster", "sample", "evaluate"],               # entry points
]
MUTUAL_OK = {frozenset({"hpcdist.autograd.ops", "hpcdist.autograd.tensor"})}


def _modules():
    mods = {}
    for folder, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                mods[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return mods


def _imports(mods):
    """module -> the hpcdist modules it imports (at any depth of the file)."""
    edges = {}
    for name, path in mods.items():
        package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
        found = set()
        for node in ast.walk(ast.parse(open(path).read())):
            targets = []
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                           for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            found.update(t for t in targets if t in mods and t != name)
        edges[name] = found
    return edges


def _layer(module: str) -> int:
    parts = module.split(".")[1:]
    for i, names in enumerate(LAYERS):
        if parts and parts[0] in names:
            return i
    raise AssertionError(f"{module} is in no layer of tests/test_layers.py: add it where it "
                         "belongs (and to README's Layout section)")


MODS = _modules()
EDGES = _imports(MODS)


@pytest.mark.parametrize("module", sorted(m for m in MODS if m != "hpcdist"))
def test_imports_point_down(module):
    mine = _layer(module)
    up = sorted(t for t in EDGES[module] if t != "hpcdist" and _layer(t) > mine)
    assert not up, f"{module} (layer {mine}) imports from a layer above it: {up}"


def test_no_two_modules_import_each_other():
    pairs = {frozenset({a, b}) for a in EDGES for b in EDGES[a] if a in EDGES.get(b, ())}
    assert pairs <= MUTUAL_OK, sorted(tuple(sorted(p)) for p in pairs - MUTUAL_OK)


def _circles(edges) -> list:
    """The import circles of any length: strongly connected groups of two or more modules."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(frozenset(group))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_circle_of_imports_but_the_engines():
    """A registry its members do not import (comm/registry.py), an engine handed what it
    calls (backend's CPU kernels installed by kernels/__init__.py): the one circle left is the
    autograd's (a Tensor's methods are its ops; its ops make Tensors)."""
    allowed = {m for pair in MUTUAL_OK for m in pair}
    bad = [sorted(c) for c in _circles(EDGES) if not c <= {m for m in c if m in allowed or
                                                           m.startswith("hpcdist.autograd.ops")}]
    assert not bad, bad
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [
        frozenset({"a", "b", "c"})]                      # the finder finds a long circle


def test_the_top_holds_entry_points_and_packages_only():
    """Modules are grouped by layer in packages (device, host, autograd, nn, checkpoint,
    comm, parallel, run, ...); what stays at the top is a command (train, sample, evaluate,
    cluster, preflight) or the optimizers, beside nn."""
    loose = sorted(f[:-3] for f in os.listdir(ROOT) if f.endswith(".py"))
    assert loose == ["__init__", "cluster", "evaluate", "optim", "preflight", "sample",
                     "train"], loose


def test_sizes_a_newcomer_can_read():
    """No module over 400 lines, no function over 60 outside bench/ (benchmarks print
    tables), no module docstring over 12 lines (the rest of a design lives in docs/)."""
    too_long = []
    for name, path in MODS.items():
        src = open(path).read()
        tree = ast.parse(src)
        if len(src.split("\n")) > 400:
            too_long.append(f"{name}: {len(src.split(chr(10)))} lines")
        doc = ast.get_docstring(tree, clean=False)
        if doc and len(doc.strip("\n").split("\n")) > 12:
            too_long.append(f"{name}: a {len(doc.strip().split(chr(10)))}-line docstring")
        if ".bench" in name:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 60:
                    too_long.append(f"{name}.{node.name}: {lines} lines")
    assert not too_long, too_long


def test_no_function_takes_more_than_six_positional_arguments():
    """Past six, a function's arguments are named at the call (keyword-only) or grouped in an
    object (a layout, a config): outside the kernels' launchers (device/kernels/), whose
    arguments are the kernel's own."""
    found = []
    for name, path in MODS.items():
        if name.startswith("hpcdist.device.kernels"):
            continue
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = [a.arg for a in node.args.posonlyargs + node.args.args]
                n = len(args) - (1 if args and args[0] in ("self", "cls") else 0)
                if n > 6:
                    found.append(f"{name}.{node.name}: {n} positional")
    assert not found, found


def test_the_parallel_layer_reads_declarations_not_a_familys_names():
    """parallel/ cuts any family by what it declares (nn/family.py: parts by role, projections
    by their roles, one attention shape): no GPT-2 attribute name and no q|k|v arithmetic of
    its own (the packed split lives in nn.family.AttentionShape)."""
    gpt2 = re.compile(r"\b(c_attn|c_proj|wte|wpe|ln_f|lm_head|ln_1|ln_2)\b|mlp\.layers|"
                      r"\.attn\.|// 3 // ")
    found = []
    for name, path in MODS.items():
        if name.startswith("hpcdist.parallel"):
            for i, line in enumerate(open(path), 1):
                code = line.split("#", 1)[0]
                if gpt2.search(code):
                    found.append(f"{path}:{i}: {line.strip()}")
    assert not found, found
