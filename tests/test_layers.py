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
    ["thinpipe.console", "thinpipe.plugins",                          # one-line output, boundary kinds of plugins,
     "thinpipe.provenance"],                                          # the code stamp (version, commit) of results
    ["thinpipe.config"],
    ["thinpipe.faults"],                                              # the tests' fault injection, read once
    ["thinpipe.layout", "thinpipe.placement", "thinpipe.checkpoint",  # the rank grid, where a rank computes,
     "thinpipe.runlock", "thinpipe.jsonl"],                           # checkpoint files, a run folder's lock, rows
    ["thinpipe.dashboards", "thinpipe.events"],                       # dashboards, an elastic job's events
    ["thinpipe.comm", "thinpipe.optim", "thinpipe.data"],             # transport, math, data
    ["thinpipe.analysis", "thinpipe.dp", "thinpipe.models", "thinpipe.eval"],
    ["thinpipe.boundary"],                                            # the boundary contract
    ["thinpipe.rank"],                                                # one rank, transport-free
    ["thinpipe.objective"],                                           # SFT, DPO, GSPO: math and steps over a Pipe
    ["thinpipe.anchor"],                                              # the anchor circuit
    ["thinpipe.engine"],                                              # runners: the loop, sim, dist, elastic
    ["thinpipe.plan"],                                                # the planner (closed form, DES, advice)
    ["thinpipe.commands"],                                            # one module per command
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
    assert layer_of("thinpipe.rank.stage_rank")[0] < layer_of("thinpipe.cli")[0]
    assert layer_of("thinpipe.comm.dist_transport")[0] < layer_of("thinpipe.boundary.mask")[0]
    f = tmp_path / "x.py"
    f.write_text("def f():\n    from thinpipe.cli import main\n")
    assert imports(f, "thinpipe.x") == {"thinpipe.cli.main"}
    assert layer_of("thinpipe.cli.main") == layer_of("thinpipe.cli")


def package_cycle(edges: dict[str, set[str]]) -> list[str]:
    """A cycle of the package graph (``edges``: package -> packages it imports), or []."""
    done: set[str] = set()

    def visit(n: str, path: list[str]) -> list[str]:
        if n in path:
            return path[path.index(n):] + [n]
        if n in done:
            return []
        for t in sorted(edges.get(n, ())):
            if found := visit(t, path + [n]):
                return found
        done.add(n)
        return []

    for n in sorted(edges):
        if found := visit(n, []):
            return found
    return []


def test_no_cycles_between_packages():
    """Packages as nodes (``thinpipe.rank``, ``thinpipe.engine``; a root module is its own node): the
    graph is acyclic, so every package is one layer and the folder list is the layer table."""
    g = graph()
    modules = set(g)

    def node(t: str) -> str:
        while t and t not in modules:
            t = t.rpartition(".")[0]
        return package_of(t)

    edges: dict[str, set[str]] = {}
    for m, ts in g.items():
        edges.setdefault(package_of(m), set()).update(node(t) for t in ts if node(t) != package_of(m))
    edges.pop("thinpipe", None)  # the package itself (``__init__``/``__main__``) sits on top
    cycle = package_cycle(edges)
    assert not cycle, "package cycle: " + " -> ".join(cycle)
    # the check is not vacuous: a cycle such as engine -> anchor -> engine is found
    assert package_cycle({"e": {"a"}, "a": {"e"}, "c": {"e"}}) == ["a", "e", "a"]


def test_the_tree_keeps_its_shape():
    """Small files with one idea each: no module over 400 lines, the CLI a registry (at most 120), and the
    package root holds foundation modules only (at most 12 besides ``__init__`` and ``__main__``)."""
    long = [f"{p.relative_to(PACKAGE.parent)}: {n} lines" for p in sorted(PACKAGE.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > 400]
    assert not long, "modules over 400 lines (split them along an idea):\n" + "\n".join(long)
    assert len((PACKAGE / "cli.py").read_text().splitlines()) <= 120, "cli.py is a registry: commands go in commands/"
    root = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "__main__"))
    assert len(root) <= 12, f"the package root holds {len(root)} modules: {root}"
    foundation = {p for layer in LAYERS[:layer_of("thinpipe.comm")[0]] for p in layer}
    assert {f"thinpipe.{m}" for m in root} - foundation == {"thinpipe.cli"}, "the root holds foundation modules only"
