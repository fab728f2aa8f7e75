"""docs/architecture.md says what the code is: its lists are checked against the code, not only the paths it names
(tests/architecture/test_repo_paths.py does those).

- the layer table names every layer of tests/test_layers.py and nothing else;
- the commands (`cli.py: COMMANDS`, and the command modules in the layer table);
- the members of `Engine` and `Objective` (the run loop's and the objectives' interfaces);
- the plug-in registries: each registry, register function and self-description it names exists, and its built-in
  names are the registry's;
- every reference of the form `` `file.py: Name` `` names something that file defines.
"""

import importlib
import inspect
import re
from pathlib import Path

from tests.architecture.test_comm_protocols import methods
from tests.test_layers import LAYERS
from thinpipe.cli import COMMANDS
from thinpipe.engine.loop import Engine
from thinpipe.objective.base import Objective

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "architecture.md").read_text()


def ticked(text: str) -> list[str]:
    return re.findall(r"`([^`]+)`", text)


def listed(label: str) -> list[str]:
    """The backticked names of the paragraph that starts with ``label``."""
    para = DOC[DOC.index(label):].split("\n\n")[0]
    return ticked(para.split(":", 1)[1] if label.endswith(":") else para[len(label):])


def table(heading: str) -> list[list[str]]:
    """The rows (cells) of the first table after ``heading``."""
    section = DOC[DOC.index(heading):]
    lines = [ln for ln in section.splitlines() if ln.startswith("|")]
    start = section.index(lines[0])
    rows = []
    for ln in section[start:].splitlines():
        if not ln.startswith("|"):
            break
        rows.append([c.strip() for c in ln.strip("|").split("|")])
    return [r for r in rows[2:]]  # no header, no separator


def resolve(ref: str):
    """``file.py: Name`` (a path under thinpipe/, the name possibly dotted) -> the object, or raise."""
    path, name = (x.strip() for x in ref.split(":", 1))
    module = "thinpipe." + path.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def test_the_layer_table_is_the_layers_of_the_layer_test():
    doc = set()
    for row in table("## Layers"):
        for name in ticked(row[1]):
            doc.add("thinpipe." + name.removesuffix("/").removesuffix(".py"))
    code = {p for layer in LAYERS for p in layer} - {"thinpipe"}
    assert doc == code, f"in the doc only: {sorted(doc - code)}; in tests/test_layers.py only: {sorted(code - doc)}"


def test_the_commands_are_the_clis():
    assert listed("Commands (`cli.py: COMMANDS`") [1:] == [c.NAME for c in COMMANDS]  # [0]: the registry's name
    row = next(r for r in table("## Layers") if r[0] == "commands")
    modules = {m for m in ticked(row[2]) if m.endswith(".py") and ":" not in m}
    commands = {Path(inspect.getfile(c)).name for c in COMMANDS}
    assert commands <= modules, f"command modules the layer table does not name: {sorted(commands - modules)}"


def test_the_engine_and_objective_members_are_the_protocols():
    engine = [n for n in Engine.__annotations__ if not n.startswith("_")] + methods(Engine)
    assert listed("Engine members:") == engine
    objective = [n for n in Objective.__annotations__ if not n.startswith("_")] + methods(Objective)
    assert listed("Objective members:") == objective


def test_the_plug_in_registries_are_the_code():
    rows = {r[0]: r for r in table("## Plug-in registries")}
    assert set(rows) == {"boundary kind", "objective", "DP scheme", "model family", "command"}
    for row in rows.values():
        for cell in row[1:]:
            for ref in ticked(cell):
                if ".py: " in ref:
                    resolve(ref)  # every registry, register function and description named exists

    def builtin(registry) -> set[str]:  # a test file may have registered a toy kind in this process
        return {k for k, v in registry.items() if getattr(v, "__module__", "thinpipe").startswith("thinpipe")}

    import thinpipe.boundary  # noqa: F401  (the built-in kinds' implementations register their descriptions)
    for what, registry in (("boundary kind", resolve("plugins.py: BOUNDARY_KINDS")),
                           ("objective", resolve("objective/registry.py: BUILTIN")),
                           ("DP scheme", resolve("dp/registry.py: BUILTIN"))):
        assert set(ticked(rows[what][2])) == builtin(registry), what


def test_every_file_and_name_the_doc_pairs_exists():
    refs = sorted({r for r in ticked(DOC) if re.fullmatch(r"[a-z_/]+\.py: [A-Za-z_][\w.]*", r)
                   and not r.startswith(("tests/", "benchmarks/", "experiments/"))})
    bad = []
    for ref in refs:
        path, name = ref.split(": ")
        # a bare file name (in a row or paragraph about its package) may be any package's file of that name
        paths = [path] if (ROOT / "thinpipe" / path).exists() else \
            [str(p.relative_to(ROOT / "thinpipe")) for p in (ROOT / "thinpipe").rglob(Path(path).name)]
        errors = []
        for candidate in paths:
            try:
                resolve(f"{candidate}: {name}")
                break
            except (ImportError, AttributeError) as e:
                errors.append(str(e))
        else:
            bad.append(f"{ref}: {'; '.join(errors) or 'no such file'}")
    assert len(refs) > 30 and not bad, "\n".join(bad)
