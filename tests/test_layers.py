"""The package's layers import downward only, and no import cycle exists, lazy imports included.

Every ``import``/``from ... import`` of a thinpipe module anywhere in a file (module level or
inside a function) is an edge. Each module belongs to the layer of its longest matching prefix in
``LAYERS``; an edge may go to a lower layer, or stay in the same layer inside the same package.
The whole module graph must be acyclic (so a lazy import can never hide a cycle).
docs/architecture.md describes the layers.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "thinpipe"

LAYERS = [
    ["thinpipe.log", "thinpipe.plugins"],                                                # foundation
    ["thinpipe.config"],
    ["thinpipe.mesh", "thinpipe.placement", "thinpipe.checkpoint",  # the rank grid, where a rank computes, checkpoint files,
     "thinpipe.runlock", "thinpipe.jsonl"],                         # a run folder's lock, rows a crash cut off,
    ["thinpipe.dashboards", "thinpipe.events"],                     # dashboards, an elastic job's events (read as rows)
    ["thinpipe.comm", "thinpipe.optim", "thinpipe.data"],                                # transport, math, data
    ["thinpipe.analysis", "thinpipe.dp", "thinpipe.models", "thinpipe.eval"],
    ["thinpipe.boundary"],                                                               # the boundary contract
    ["thinpipe.engine.context", "thinpipe.engine.schedule", "thinpipe.engine.worker",    # engine core: a rank
     "thinpipe.engine.rank", "thinpipe.engine.diagnostics", "thinpipe.engine.passes", "thinpipe.engine.setup"],
    ["thinpipe.anchor"],                                                                 # the anchor circuit
    ["thinpipe.engine.sim", "thinpipe.engine.sim_engine",  # runners
     "thinpipe.engine.dist", "thinpipe.engine.elastic", "thinpipe.engine.run", "thinpipe.engine"],
    ["thinpipe.runs"],                                                                   # run folders
    ["thinpipe.prune", "thinpipe.analyze", "thinpipe.probe", "thinpipe.plan", "thinpipe.launch", "thinpipe.compare",
     "thinpipe.preflight"],  # commands
    ["thinpipe.launch_elastic"],                                                         # uses launch's helpers
    ["thinpipe.demo"],                                                                   # runs train + compare
    ["thinpipe.bench"],                                                                  # runs plan + launch
    ["thinpipe.cli"],
    ["thinpipe.__main__", "thinpipe"],
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> tuple[int, str]:
    best = None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if module == p or module.startswith(p + "."):
                if best is None or len(p) > len(best[1]):
                    best = (i, p)
    assert best is not None, f"{module} is in no layer: add it to LAYERS (and to docs/architecture.md)"
    return best


def imports(path: Path, module: str) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the package
                base = module.split(".")
                base = base[:len(base) - node.level + (1 if path.name == "__init__.py" else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("thinpipe"):  # ``from pkg import mod`` is an edge to pkg.mod when mod is a module
                out.update(f"{target}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("thinpipe"))
    return out


def graph() -> dict[str, set[str]]:
    return {module_name(f): imports(f, module_name(f)) for f in sorted(PACKAGE.rglob("*.py"))}


def package_of(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_layers_import_downward_only():
    wrong = []
    for mod, targets in graph().items():
        layer, _ = layer_of(mod)
        for t in targets:
            t_layer, _ = layer_of(t)
            if t_layer > layer or (t_layer == layer and package_of(t) != package_of(mod)):
                wrong.append(f"{mod} (layer {layer}) imports {t} (layer {t_layer})")
    assert not wrong, "imports against the layer order:\n" + "\n".join(sorted(wrong))


def test_no_import_cycles_even_through_lazy_imports():
    g = graph()
    modules = set(g)

    def resolve(t: str) -> str | None:  # "thinpipe.comm" -> the package's __init__ module, a name -> its module
        while t and t not in modules:
            t = t.rpartition(".")[0]
        return t or None

    edges = {m: {r for t in ts if (r := resolve(t)) and r != m} for m, ts in g.items()}
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(m: str, path: list[str]) -> bool:
        state[m] = 1
        for n in sorted(edges[m]):
            if state.get(n) == 1:
                cycle.extend(path[path.index(n):] + [m, n] if n in path else [m, n])
                return True
            if state.get(n) is None and visit(n, path + [m]):
                return True
        state[m] = 2
        return False

    for m in sorted(modules):
        if state.get(m) is None and visit(m, []):
            break
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_the_checks_catch_a_violation(tmp_path):
    """The layer rule is not vacuous: an engine module importing the CLI is caught."""
    assert layer_of("thinpipe.engine.rank")[0] < layer_of("thinpipe.cli")[0]
    assert layer_of("thinpipe.comm.dist")[0] < layer_of("thinpipe.boundary.mask")[0]
    f = tmp_path / "x.py"
    f.write_text("def f():\n    from thinpipe.cli import main\n")
    assert imports(f, "thinpipe.x") == {"thinpipe.cli.main"}
    assert layer_of("thinpipe.cli.main") == layer_of("thinpipe.cli")
