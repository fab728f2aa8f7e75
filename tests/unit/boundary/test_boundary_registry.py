"""One registry of boundary kinds (``plugins.py: BOUNDARY_KINDS``): each kind's description (settings, properties)
names the class that builds it, README lists every kind, and whether a kind is part of the model is what its
description says (``BoundaryKind.architectural``, which the config's checks, export and evaluation read)."""

import re
from pathlib import Path

import pytest

from tests.helpers import config, tiny_model
from thinpipe.boundary import Boundary, build_boundaries
from thinpipe.config import BOUNDARY_KINDS, ConfigError, load_config
from thinpipe.plugins import register_boundary

README = Path(__file__).resolve().parents[3] / "README.md"
BUILT_IN = ["identity", "mask", "topk", "quant4", "quant2", "aqsgd", "tahquant", "bottleneck", "outlier", "klt",
            "klt-dither", "ssn", "mapl", "mapl-vq"]


def test_every_built_in_kind_is_registered_and_built_by_its_own_class():
    assert list(BOUNDARY_KINDS)[:len(BUILT_IN)] == BUILT_IN
    for kind in BUILT_IN:
        spec = BOUNDARY_KINDS[kind]
        assert spec.name == kind and issubclass(spec.implementation, Boundary), kind


def test_a_kind_is_part_of_the_model_exactly_when_its_description_says_so():
    model = tiny_model("llama")
    hidden = model.config.hidden_size
    for kind in BUILT_IN:
        cfg = config(model__name="tiny-llama", mesh__pp=2, boundary__kind=kind, boundary__rank=8,
                     boundary__quant_group=16, boundary__outlier_channels=4)
        (b,) = build_boundaries(cfg.boundary, 2, hidden, 0, None, model)
        assert type(b) is BOUNDARY_KINDS[kind].implementation and b.kind == kind, kind
        assert b.architectural == BOUNDARY_KINDS[kind].architectural == (kind in ("bottleneck", "ssn", "mapl",
                                                                                  "mapl-vq")), kind


def test_readme_lists_every_kind():
    row = next(line for line in README.read_text().splitlines() if line.startswith("| `boundary.kind` |"))
    listed = set(re.findall(r"`([a-z0-9-]+)`", row.split("|")[3]))
    assert set(BUILT_IN) <= listed, sorted(set(BUILT_IN) - listed)


@pytest.fixture
def registry():
    """The registry as it was, after the test."""
    saved = dict(BOUNDARY_KINDS)
    yield BOUNDARY_KINDS
    BOUNDARY_KINDS.clear()
    BOUNDARY_KINDS.update(saved)


def test_the_short_form_of_register_boundary_describes_a_kind_with_keywords(registry):
    def build(cfg, index, hidden, seed, wire, model, shared):
        return Boundary(index, hidden, wire)

    register_boundary("dense2", build, architectural=True, default_bits=(3, 5))
    cfg = load_config(None, ["boundary.kind=dense2", "mesh.pp=2"])
    assert cfg.boundary.bits() == (3, 5) and cfg.boundary.spec().architectural
    (b,) = build_boundaries(cfg.boundary, 2, 8, 0, None)
    assert type(b) is Boundary
    with pytest.raises(ConfigError, match="boundary.kind = dense2 applies to every boundary"):
        load_config(None, ["boundary.kind=dense2", "mesh.pp=3", "boundary.masked=[0]"])
    with pytest.raises(ConfigError, match="unknown key 'boundary.dense2.x'"):  # no settings: no table
        load_config(None, ["boundary.kind=dense2", "boundary.dense2.x=1"])
    with pytest.raises(TypeError, match="unknown properties"):
        register_boundary("dense3", build, architecturall=True)
