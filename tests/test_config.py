"""The config package: its public names, and the deprecated ``boundary.anchor`` alias of ``boundary.offset``."""

import re

import pytest

import thinpipe.config
from thinpipe.config import Config, ConfigError, apply_overrides, load_config

WARNING = ('[thinpipe] warning: boundary.anchor is deprecated: use boundary.offset '
           '(MAPL\'s per-stage offset; "anchor" is the anchor circuit)')


def warnings(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if "warning" in line]


def test_every_name_of_the_old_module_is_exported():
    for name in ("ARCHITECTURAL_KINDS", "BOUNDARY_KINDS", "DP_KINDS", "LORA_TARGETS", "QUANT_BITS", "AnchorConfig",
                 "BoundaryConfig", "Config", "ConfigError", "DPConfig", "DataConfig", "DiagConfig", "EvalConfig",
                 "LinkConfig", "LoraConfig", "MeshConfig", "ModelConfig", "MuonConfig", "OptimConfig",
                 "SpectralConfig", "TrainConfig", "apply_overrides", "load_config"):
        assert hasattr(thinpipe.config, name) and name in thinpipe.config.__all__, name


def test_offset_default_and_check():
    assert Config().boundary.offset == "factorized"
    with pytest.raises(ConfigError, match="boundary.offset must be factorized, full, static or none"):
        load_config(None, ["boundary.offset=half"])


def test_boundary_anchor_in_a_toml_file_warns_once_and_sets_offset(tmp_path, capsys):
    """An old run folder's config.toml (``[boundary] anchor = ...``) still loads; the resolved config says offset."""
    path = tmp_path / "config.toml"
    path.write_text('[mesh]\nanchor = 0\n\n[boundary]\nkind = "mapl"\nanchor = "full"\n\n[anchor]\nstaleness = 3\n')
    cfg = load_config(path)
    assert warnings(capsys) == [WARNING]
    assert cfg.boundary.offset == "full" and cfg.mesh.anchor == 0 and cfg.anchor.staleness == 3
    written = cfg.to_dict()["boundary"]
    assert written["offset"] == "full" and "anchor" not in written
    assert 'offset = "full"' in cfg.to_toml()
    # the same file given again with --set boundary.anchor too: still one line per load
    assert load_config(path, ["boundary.anchor=static"]).boundary.offset == "static"
    assert warnings(capsys) == [WARNING]


def test_boundary_anchor_with_set_warns_once_and_sets_offset(capsys):
    cfg = load_config(None, ["boundary.kind=mapl", "boundary.anchor=static"])
    assert cfg.boundary.offset == "static" and warnings(capsys) == [WARNING]
    cfg = apply_overrides(Config(), {"boundary.anchor": "none"})
    assert cfg.boundary.offset == "none" and warnings(capsys) == [WARNING]
    # the new key warns about nothing
    assert load_config(None, ["boundary.offset=full"]).boundary.offset == "full" and warnings(capsys) == []


def test_boundary_anchor_keeps_the_offset_checks(capsys):
    with pytest.raises(ConfigError, match="boundary.offset must be factorized, full, static or none, got 'half'"):
        load_config(None, ["boundary.anchor=half"])


def test_both_keys_with_different_values_are_an_error(tmp_path, capsys):
    with pytest.raises(ConfigError, match="boundary.anchor = 'full' and boundary.offset = 'static' disagree"):
        load_config(None, ["boundary.anchor=full", "boundary.offset=static"])
    path = tmp_path / "both.toml"
    path.write_text('[boundary]\noffset = "none"\nanchor = "full"\n')
    with pytest.raises(ConfigError, match=re.escape(f"{path}: boundary.anchor = 'full' and boundary.offset = 'none'")):
        load_config(path)
    # equal values are fine (one warning); a later layer overrides an earlier one as usual
    assert load_config(None, ["boundary.offset=full", "boundary.anchor= full"]).boundary.offset == "full"
    path.write_text('[boundary]\nanchor = "full"\n')
    assert load_config(path, ["boundary.offset=static"]).boundary.offset == "static"
