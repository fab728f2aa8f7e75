"""The whole run configuration: ``Config`` (one section per component), TOML in and out, and the
dotted ``--set key=value`` overrides with their type coercion.

A config is built from defaults, then a TOML file, then ``--set`` overrides; every step is
validated so that a bad input fails with one clear ``ConfigError`` before any heavy work.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from thinpipe.config.aliases import rename_deprecated
from thinpipe.config.anchor import AnchorConfig, OptimConfig
from thinpipe.config.boundary import BoundaryConfig, BoundaryKind
from thinpipe.config.dp import DPConfig
from thinpipe.config.elastic import ElasticConfig
from thinpipe.config.errors import ConfigError
from thinpipe.config.log import LogConfig
from thinpipe.config.mesh import LinkConfig, MeshConfig
from thinpipe.config.model_data import DataConfig, ModelConfig
from thinpipe.config.post import OBJECTIVE_DEFAULTS, DPOConfig, RLConfig, check_objective
from thinpipe.config.recipe import recipe_path
from thinpipe.config.train import DiagConfig, EvalConfig, TrainConfig
from thinpipe.config.wire import WireConfig

INT_LIMIT = 2**63  # every integer key ends up in an int64 somewhere (a tensor, a seed, a file offset)


def _finite_numbers(tree: dict, prefix: str = "") -> None:
    """No key takes nan or inf (a range check such as ``lr <= 0`` lets nan through)."""
    for k, v in tree.items():
        if isinstance(v, dict):
            _finite_numbers(v, f"{prefix}{k}.")
        elif isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"{prefix}{k} = {v} is not a finite number: give a number such as 1e-4")


def _int64(tree: dict, prefix: str = "") -> None:
    """No key takes an integer beyond int64 (after the sections' own range checks, which say more)."""
    for k, v in tree.items():
        if isinstance(v, dict):
            _int64(v, f"{prefix}{k}.")
        elif isinstance(v, int) and not -INT_LIMIT < v < INT_LIMIT:
            raise ConfigError(f"{prefix}{k} is an integer of {v.bit_length()} bits, out of range: integers are at most "
                              "2^63 - 1")
        elif isinstance(v, list) and any(isinstance(x, int) and not -INT_LIMIT < x < INT_LIMIT for x in v):
            raise ConfigError(f"{prefix}{k} holds an integer out of range: integers are at most 2^63 - 1")


@dataclass(kw_only=True, slots=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    boundary: BoundaryConfig = field(default_factory=BoundaryConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    dp: DPConfig = field(default_factory=DPConfig)
    anchor: AnchorConfig = field(default_factory=AnchorConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    link: LinkConfig = field(default_factory=LinkConfig)
    diag: DiagConfig = field(default_factory=DiagConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    wire: WireConfig = field(default_factory=WireConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    rl: RLConfig = field(default_factory=RLConfig)

    def validate(self) -> "Config":
        _finite_numbers(self._every_key())
        for f in dataclasses.fields(self):
            getattr(self, f.name).validate()
        _int64(self._every_key())
        if self.boundary.spec().architectural:
            if self.boundary.masked:
                raise ConfigError(f"boundary.kind = {self.boundary.kind} applies to every boundary (its stage "
                                  "offsets chain through them): leave boundary.masked empty")
            if self.mesh.anchor:
                raise ConfigError(f"mesh.anchor = 1 runs dense passes of the model, but boundary.kind = "
                                  f"{self.boundary.kind} is part of the model: use mask/topk with the anchor circuit")
            if self.diag.every:
                raise ConfigError(f"diag.every compares with the unmasked gradient, which boundary.kind = "
                                  f"{self.boundary.kind} (part of the model) does not have: set diag.every = 0")
        if self.boundary.masked and max(self.boundary.masked) >= self.mesh.pp - 1:
            raise ConfigError(
                f"boundary.masked = {self.boundary.masked} names a boundary that does not exist: with mesh.pp = "
                f"{self.mesh.pp} the boundaries are 0..{self.mesh.pp - 2}")
        self.boundary.check_stages(self.mesh.pp)
        self.link.check_boundaries(self.mesh.pp - 1)
        if self.mesh.speeds and len(self.mesh.speeds) != self.mesh.pp:
            raise ConfigError(f"mesh.speeds has {len(self.mesh.speeds)} entries but mesh.pp = {self.mesh.pp}: give one "
                              "relative speed per stage, e.g. [1.0, 0.5] (or leave it empty: equal)")
        if self.elastic.min_replicas > self.mesh.dp:
            raise ConfigError(f"elastic.min_replicas = {self.elastic.min_replicas} exceeds mesh.dp = {self.mesh.dp} "
                              "(the job's replicas): lower it or raise mesh.dp")
        if self.train.model_rank >= self.mesh.dp * self.mesh.pp:
            raise ConfigError(f"train.model_rank = {self.train.model_rank} is not a rank of this job's fast replicas "
                              f"(0..{self.mesh.dp * self.mesh.pp - 1} with mesh.dp x mesh.pp = "
                              f"{self.mesh.dp} x {self.mesh.pp}): name one of them")
        check_objective(self)
        return self

    def to_dict(self) -> dict[str, Any]:
        """Every section's keys, as ``config.toml`` records them (a section with its own ``to_dict``, such as
        ``[boundary]`` and its configured kind's table, says which)."""
        return {f.name: _section_dict(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def _every_key(self) -> dict[str, Any]:
        """``to_dict`` with every boundary kind's table given, for the checks that look at every value."""
        out = self.to_dict()
        out["boundary"] = {**out["boundary"], **{k: dataclasses.asdict(t) for k, t in self.boundary.tables.items()}}
        return out

    def to_toml(self) -> str:
        return tomli_w.dumps(self.to_dict())


def _section_dict(section: Any) -> dict[str, Any]:
    own = getattr(section, "to_dict", None)
    return own() if own is not None else dataclasses.asdict(section)


def _keys(obj: Any) -> dict[str, dataclasses.Field]:
    """A section's keys (its fields, less those that hold sub-tables of their own: ``BoundaryConfig.tables``)."""
    return {f.name: f for f in dataclasses.fields(obj) if not f.metadata.get("tables")}


def _coerce(value: Any, typ: Any, key: str) -> Any:
    """Convert a TOML value or a ``--set`` string to the field's declared type (a string annotation, or the type
    itself where a plug-in's module does not postpone annotations)."""
    typ = typ.__name__ if isinstance(typ, type) else str(typ)
    if typ == "list[int] | str":  # a word (``mesh.split = "auto"``) or a list of counts
        if isinstance(value, str) and value.strip() and not value.strip().startswith("["):
            return value.strip()
        typ = "list[int]"
    if typ == "float | list[float]":  # one number for every boundary, or one per boundary (``link.pp_mbps``)
        listed = isinstance(value, list) or (isinstance(value, str) and value.strip().startswith("["))
        typ = "list[float]" if listed else "float"
    if isinstance(value, str) and typ != "str":
        text = value.strip()
        if typ == "bool":
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ConfigError(f"{key} expects true or false, got {value!r}")
        if typ.startswith("list"):
            text = text.strip("[]")
            value = [v.strip().strip("'\"") for v in text.split(",") if v.strip()]
        else:
            value = text
    try:
        if typ == "int":
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if typ == "float":
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if typ == "bool":
            if not isinstance(value, bool):
                raise ValueError
            return value
        if typ == "str":
            if not isinstance(value, str):
                raise ValueError
            return value
        if typ == "list[int]":
            if any(isinstance(v, bool) or (isinstance(v, float) and not v.is_integer()) for v in value):
                raise ValueError
            return [int(v) for v in value]
        if typ == "list[float]":
            if any(isinstance(v, bool) for v in value):
                raise ValueError
            return [float(v) for v in value]
        if typ == "list[str]":
            return [str(v) for v in value]
    except (TypeError, ValueError):
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:60] + f"... ({len(repr(value))} characters)"
        raise ConfigError(f"{key} expects a value of type {typ}, got {shown}") from None
    raise AssertionError(f"unsupported config type {typ} for {key}")


def _suggest(word: str, options: list[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1)
    return f" (did you mean {close[0]}?)" if close else f" (valid: {', '.join(options)})"


def apply_overrides(cfg: Config, values: dict[str, Any], source: str = "--set",
                    warned: set[str] | None = None, given: set[str] | None = None) -> Config:
    """Apply ``{"section.key": value}`` (flat, dotted, nested sections allowed) overrides in place, type-checked.

    Deprecated keys (``aliases.py``) are renamed, with one warning line each on stderr (once per key
    across calls sharing ``warned``); ``given`` collects the (renamed) keys set."""
    for dotted, value in rename_deprecated(values, source, warned).items():
        if given is not None:
            given.add(dotted)
        if "." not in dotted:
            raise ConfigError(f"{source}: key {dotted!r} must be dotted as section.key, e.g. train.steps")
        obj, parts = cfg, dotted.split(".")
        for i, part in enumerate(parts):
            fields = _keys(obj)
            table = getattr(obj, "table", None)  # a section of named tables: [boundary.<kind>]
            sub = table(part) if table is not None and part not in fields else None
            if sub is not None:
                if i == len(parts) - 1:
                    raise ConfigError(f"{source}: {dotted!r} is a table; set one of its keys: "
                                      f"{', '.join(_keys(sub))}")
                obj = sub
                continue
            if part not in fields:
                where = ".".join(parts[:i])
                if isinstance(obj, BoundaryKind):
                    raise ConfigError(f"{source}: unknown key {dotted!r}: [{where}] has {', '.join(fields)}")
                what = f"key {dotted!r}" if where else f"section {part!r}"
                raise ConfigError(f"{source}: unknown {what}{_suggest(part, list(fields))}")
            if i == len(parts) - 1:
                if dataclasses.is_dataclass(getattr(obj, part)):
                    raise ConfigError(f"{source}: {dotted!r} is a section; set one of its keys, e.g. {dotted}."
                                      f"{dataclasses.fields(getattr(obj, part))[0].name}")
                setattr(obj, part, _coerce(value, fields[part].type, dotted))
            else:
                obj = getattr(obj, part)
                if not dataclasses.is_dataclass(obj):
                    raise ConfigError(f"{source}: {'.'.join(parts[:i + 1])!r} is a value, not a section")
    return cfg


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _read_toml(path: Path) -> dict[str, Any]:
    """A TOML file's keys, flat and dotted; every way it can be unreadable is one line."""
    try:
        return _flatten(tomllib.loads(path.read_bytes().decode("utf-8-sig")))  # a BOM (Notepad) is fine
    except OSError as e:
        raise ConfigError(f"config file {str(path)!r} cannot be read ({e.strerror}): check its "
                          "permissions") from None
    except UnicodeDecodeError as e:  # TOML is UTF-8 (toml.io); e.g. a file saved as Latin-1 or UTF-16
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text (byte {e.start + 1}): save it as "
                          "UTF-8") from None
    except RecursionError:
        raise ConfigError(f"config file {str(path)!r} nests tables or arrays thousands deep: a thinpipe config "
                          "has sections, keys and flat lists") from None
    except ValueError as e:  # TOMLDecodeError, or an integer of more than 4300 digits
        why = (str(e).splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {why}") from None


def parse_sets(sets: list[str] | None) -> dict[str, str]:
    """``--set key=value`` strings as ``{"key": "value"}`` (``apply_overrides`` types them)."""
    overrides: dict[str, str] = {}
    for item in sets or []:
        if "=" not in item:
            raise ConfigError(f"--set {item!r} must look like key=value, e.g. --set train.steps=10")
        k, v = item.split("=", 1)
        overrides[k.strip()] = v
    return overrides


def load_config(path: str | Path | None = None, sets: list[str] | None = None, recipe: str | None = None) -> Config:
    """Defaults <- recipe (``config/recipes/``) <- TOML file <- ``key=value`` strings; validated.

    Then ``train.objective``'s own optimizer defaults (``config/post.py: OBJECTIVE_DEFAULTS``: GSPO's App. D.5,
    DPO's TRL ones) replace every one of their keys that the TOML file and the strings leave unset (a recipe's
    values included: a recipe describes a system, the objective how it is optimised)."""
    cfg, warned, given = Config(), set(), set()
    if recipe is not None:
        if not recipe.strip():
            raise ConfigError("--recipe is empty: give a recipe name (`thinpipe recipes` lists them)")
        file = recipe_path(recipe.strip())
        apply_overrides(cfg, _read_toml(file), source=f"recipe {recipe.strip()}", warned=warned)
    if path is not None:
        if not str(path).strip():  # Path("") is the current folder
            raise ConfigError("--config is empty: give the path of a TOML file, or leave --config out")
        path = Path(path)
        if path.is_dir():
            raise ConfigError(f"config file {str(path)!r} is a folder: give the TOML file in it to --config")
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} not found: check the path given to --config")
        apply_overrides(cfg, _read_toml(path), source=str(path), warned=warned, given=given)
    apply_overrides(cfg, parse_sets(sets), warned=warned, given=given)
    defaults = {k: v for k, v in OBJECTIVE_DEFAULTS.get(cfg.train.objective, {}).items() if k not in given}
    apply_overrides(cfg, defaults, source=f"train.objective = {cfg.train.objective}'s defaults")
    return cfg.validate()
