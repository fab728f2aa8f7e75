"""The config package: its public names, the deprecated ``boundary.anchor`` alias of ``boundary.offset``, and the
boundary kinds' own tables ``[boundary.<kind>]`` with their flat aliases (``boundary.klt_bits``)."""

import re

import pytest

import thinpipe.config
from thinpipe.config import Config, ConfigError, apply_overrides, load_config

WARNING = ('[thinpipe] warning: boundary.anchor is deprecated: use boundary.offset '
           '(MAPL\'s per-stage offset; "anchor" is the anchor circuit)')


def warnings(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if "warning" in line]


def test_every_name_of_the_old_module_is_exported():
    # ARCHITECTURAL_KINDS and QUANT_BITS are gone: each kind says (BOUNDARY_KINDS[kind].architectural, .default_bits)
    for name in ("BOUNDARY_KINDS", "DP_KINDS", "LORA_TARGETS", "AnchorConfig", "BoundaryKind",
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


# An old run folder's [boundary] (before issue 49: every kind's settings flat, here a KLT run's).
OLD_BOUNDARY = """[boundary]
kind = "klt"
p = 0.95
rescale = true
masked = []
p_warmup = 0
dtype = "auto"
rank = 64
projector_optim = "spel"
projector_lr_scale = 0.1
projector_beta = 0.9
offset = "factorized"
init = "random"
pca_batches = 16
vq_codes = 256
vq_rounds = 2
vq_group_size = 2
vq_sync_codes = 1
vq_decay = 0.95
fwd_bits = 0
bwd_bits = 1
quant_group = 64
tah_high_fraction = 0.25
tah_outlier_ratio = 4.0
outlier_channels = 16
outlier_scale_group = 0
outlier_dtype = "wire"
outlier_grid = "minmax"
outlier_fwd_bits = []
outlier_bwd_scale_group = 0
outlier_bwd_tokens = 1.0
compress = "both"
klt_bits = 2.5
klt_context_bits = 1.0
klt_channels = 4
klt_scale = "width"
klt_bwd_tokens = 0.7
klt_basis_dtype = "int8"
klt_refresh_every = 0
ssn_refresh_every = 500
ssn_refresh_lr = 0.01
"""
NEW = ["boundary.kind=klt", "boundary.pca_batches=16", "boundary.bwd_bits=1", "boundary.klt.bits=2.5",
       "boundary.klt.bwd_tokens=0.7", "boundary.klt.basis_dtype=int8"]


def test_a_kind_table_a_flat_alias_and_a_toml_table_set_the_same_key(tmp_path, capsys):
    path = tmp_path / "c.toml"
    path.write_text('[mesh]\npp = 2\n\n[boundary]\nkind = "outlier"\n\n[boundary.outlier]\nchannels = 8\n'
                    'fwd_bits = [3]\n')
    cfgs = [load_config(path), load_config(None, ["mesh.pp=2", "boundary.kind=outlier", "boundary.outlier.channels=8",
                                                  "boundary.outlier.fwd_bits=[3]"]),
            load_config(None, ["mesh.pp=2", "boundary.kind=outlier", "boundary.outlier_channels=8",
                               "boundary.outlier_fwd_bits=[3]"])]
    assert all(c.boundary.settings().channels == 8 and c.boundary.settings().fwd_bits == [3] for c in cfgs)
    assert cfgs[0].to_dict() == cfgs[1].to_dict() == cfgs[2].to_dict()
    assert capsys.readouterr().err == ""  # the flat keys are aliases, not deprecated
    # config.toml records the kind's table, and not the flat keys nor the other kinds' tables
    written = cfgs[2].to_dict()["boundary"]
    assert written["outlier"]["channels"] == 8 and "outlier_channels" not in written and "klt" not in written
    assert "[boundary.outlier]" in cfgs[2].to_toml()


def test_an_old_run_folders_flat_config_loads_resumes_and_round_trips_exactly(tmp_path, capsys):
    (tmp_path / "config.toml").write_text(OLD_BOUNDARY)
    old = load_config(tmp_path / "config.toml")
    new = load_config(None, NEW)
    assert old.to_dict() == new.to_dict()  # what --resume compares (engine/loop.py: resolve_resume)
    assert old.boundary.settings().bits == 2.5 and old.boundary.settings().basis_dtype == "int8"
    again = tmp_path / "again.toml"
    again.write_text(old.to_toml())
    assert load_config(again).to_dict() == old.to_dict()  # what a resumed run writes reads back the same
    assert capsys.readouterr().err == ""


def test_kind_table_errors_are_one_line():
    with pytest.raises(ConfigError, match=r"unknown key 'boundary.klt.bitz': \[boundary.klt\] has bits, context_bits"):
        load_config(None, ["boundary.klt.bitz=3"])
    with pytest.raises(ConfigError, match="'boundary.klt' is a table; set one of its keys: bits, context_bits"):
        load_config(None, ["boundary.klt=3"])
    with pytest.raises(ConfigError, match="boundary.klt_bits = '3' and boundary.klt.bits = '4' disagree"):
        load_config(None, ["boundary.klt_bits=3", "boundary.klt.bits=4"])
    with pytest.raises(ConfigError, match="unknown key 'boundary.mask.p'"):  # a kind without settings has no table
        load_config(None, ["boundary.mask.p=0.5"])
    with pytest.raises(ConfigError, match=r"boundary.klt.bits and boundary.klt.context_bits must be in \(0, 8\]"):
        load_config(None, ["boundary.kind=mask", "boundary.klt.bits=9"])  # a table given is checked, kind or not
    with pytest.raises(ConfigError, match="boundary.kind = 'nope' is unknown: choose one of identity, mask, topk"):
        load_config(None, ["boundary.kind=nope"])


def test_the_kinds_properties_come_from_their_descriptions():
    from thinpipe.config import BOUNDARY_KINDS

    assert [k for k, spec in BOUNDARY_KINDS.items() if spec.architectural][:4] == ["bottleneck", "ssn", "mapl",
                                                                                  "mapl-vq"]
    assert load_config(None, ["boundary.kind=aqsgd"]).boundary.bits() == (2, 8)
    assert load_config(None, ["boundary.kind=quant2", "boundary.bwd_bits=8"]).boundary.bits() == (2, 8)
    assert load_config(None, ["boundary.kind=mask"]).boundary.bits() == (0, 0)
    with pytest.raises(ConfigError, match="boundary.masked"):  # an architectural kind applies to every boundary
        load_config(None, ["boundary.kind=bottleneck", "mesh.pp=3", "boundary.masked=[0]"])
    with pytest.raises(ConfigError, match="boundary.compress = fwd is an outlier setting; boundary.kind is klt"):
        load_config(None, ["boundary.kind=klt", "boundary.compress=fwd"])
