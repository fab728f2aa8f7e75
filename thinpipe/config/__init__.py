"""Typed, validated run configuration.

One dataclass per component, each field documented by the string literal below it. A config is
built from defaults, then a TOML file, then dotted ``--set key=value`` overrides; every step is
validated so that a bad input fails with one clear ``ConfigError`` before any heavy work.

One file per idea: ``errors`` (ConfigError, and a job's ranks reporting one line), ``env`` (environment
variables read as checked values: ``thinpipe.config.env``), ``model_data`` ([model], [data]), ``mesh`` ([mesh],
[link]), ``boundary`` ([boundary]), ``boundary_kinds`` (the built-in kinds' tables, [boundary.<kind>]), ``train``
([train], [train.lora], [eval], [diag]), ``dp`` ([dp]), ``anchor`` ([anchor], [optim]), ``log`` ([log]), ``elastic``
([elastic]), ``aliases`` (deprecated keys, the kinds' flat keys) and ``root`` (Config, TOML, overrides). Import
from ``thinpipe.config``: every name is re-exported here.
"""

from thinpipe.config.aliases import DEPRECATED_KEYS
from thinpipe.config.anchor import AnchorConfig, MuonConfig, OptimConfig, SpectralConfig
from thinpipe.config.boundary import BOUNDARY_KINDS, BoundaryConfig, BoundaryKind
from thinpipe.config.dp import DP_KINDS, DPConfig
from thinpipe.config.elastic import ElasticConfig
from thinpipe.config.errors import ConfigError, Diverged
from thinpipe.config.log import LogConfig
from thinpipe.config.mesh import LinkConfig, MeshConfig
from thinpipe.config.model_data import DataConfig, ModelConfig
from thinpipe.config.root import Config, apply_overrides, load_config, parse_sets
from thinpipe.config.train import LORA_TARGETS, DiagConfig, EvalConfig, LoraConfig, TrainConfig

__all__ = [
    "BOUNDARY_KINDS", "DEPRECATED_KEYS", "DP_KINDS", "LORA_TARGETS", "AnchorConfig", "BoundaryConfig", "BoundaryKind",
    "Config", "ConfigError", "DPConfig", "DataConfig", "DiagConfig", "Diverged",
    "ElasticConfig", "EvalConfig", "LinkConfig", "LogConfig", "LoraConfig", "MeshConfig", "ModelConfig", "MuonConfig",
    "OptimConfig", "SpectralConfig", "TrainConfig", "apply_overrides", "load_config", "parse_sets",
]
