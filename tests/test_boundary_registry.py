"""One registry of boundary kinds (``boundary/__init__.py: BUILTIN``): the config's lists of names and README's
list agree with it, and whether a kind is part of the model is what its class says (``Boundary.architectural``,
which export and evaluation read)."""

import re
from pathlib import Path

from tests.helpers import config, tiny_model
from thinpipe.boundary import BUILTIN, build_boundaries
from thinpipe.config import ARCHITECTURAL_KINDS, BOUNDARY_KINDS

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_config_names_every_registered_kind_and_nothing_else():
    assert set(BOUNDARY_KINDS) == {"identity", *BUILTIN}


def test_a_kind_is_part_of_the_model_exactly_when_its_class_says_so():
    model = tiny_model("llama")
    hidden = model.config.hidden_size
    for kind in BUILTIN:
        cfg = config(model__name="tiny-llama", mesh__pp=2, boundary__kind=kind, boundary__rank=8,
                     boundary__quant_group=16, boundary__outlier_channels=4)
        (b,) = build_boundaries(cfg.boundary, 2, hidden, 0, None, model)
        assert b.architectural == (kind in ARCHITECTURAL_KINDS), kind


def test_readme_lists_every_kind():
    row = next(line for line in README.read_text().splitlines() if line.startswith("| `boundary.kind` |"))
    listed = set(re.findall(r"`([a-z0-9-]+)`", row.split("|")[3]))
    assert set(BOUNDARY_KINDS) <= listed, sorted(set(BOUNDARY_KINDS) - listed)
