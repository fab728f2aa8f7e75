"""The job's model on one machine at the end of training: ``OUT/model/``, a Hugging Face folder (docs/data.md,
"A run's model").

Every engine writes it the same way: each stage of replica 0 gives its share of the model, its weights under
their Hugging Face names with the DP scheme's synchronised ones in place of its own (``model_share``:
``DPScheme.synchronised``, DiLoCo's outer weights; the rule ``engine/run_folder.py: synchronise`` reads back),
and one process puts the shares into the whole model (LoRA merged) and writes it. In the simulation they are in
one process; in a dist job (one machine or several) the other stages send theirs to global rank 0 over the job's
own authenticated point-to-point wire (``comm/tags.py: ModelShare``, checked against the shape rank 0 expects
before anything is allocated), counted apart from training's bytes (``model_bytes`` in ``summary.json``). So a
job across machines ends with its model on rank 0's machine, nothing to collect by hand; ``thinpipe export
--run OUT`` of the same run writes the same tensors.

Boundary kinds that are part of the model (MAPL, SSN, bottleneck) write no ``OUT/model/``: a plain Hugging Face
model would drop them (one line says so; ``thinpipe eval --model OUT`` evaluates the run through them).
"""

from __future__ import annotations

import copy
import shutil
import tempfile
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from thinpipe.boundary.base import Payload
from thinpipe.comm.header import Expect
from thinpipe.config import Config
from thinpipe.models.loading import model_folder, save_weights
from thinpipe.models.lora import merge_lora
from thinpipe.models.stages import Stage, build_stages, merge_state
from thinpipe.rank.from_config import load_empty

MODEL_DIR = "model"


def model_share(stage: Stage, scheme, copy: bool = True) -> dict[str, torch.Tensor]:
    """Stage ``stage``'s part of the job's model: its weights under their Hugging Face names, the DP scheme's
    synchronised weights (``DPScheme.synchronised``: the ones every replica holds alike) in place of its own, on the
    CPU. ``copy``: tensors of their own (the writer's share, which the model's LoRA merge changes in place); without
    it a sender's share may be the stage's own tensors, which ``flat`` copies once for the wire."""
    share = {k: v.detach().to("cpu", copy=copy) for k, v in stage.hf_state_dict().items()}
    for name, w in (scheme.synchronised() or {}).items():
        share[stage.hf_name(name)] = w.detach().to("cpu", copy=copy)
    return share


def architectural_line(cfg: Config) -> str:
    return (f"[thinpipe] no {MODEL_DIR}/ for this run: boundary.kind = {cfg.boundary.kind} is part of the model, which "
            "a plain Hugging Face model would drop; `thinpipe eval --model OUT` evaluates it through its boundaries")


def skeleton(cfg: Config):
    """(the whole model as ``load`` builds it, its parameters on the meta device where it can be
    (``load_empty``): the shares are assigned into it, so the writer holds the model once; its stages on the meta
    device: the names, shapes and dtypes each share has, no memory); the global RNG is left as it was (``load``
    seeds it)."""
    with torch.random.fork_rng(devices=[]):
        loaded = load_empty(cfg)
    return loaded, build_stages(_meta_copy(loaded.model), cfg.mesh.fixed_split, cfg.mesh.pp)


def _meta_copy(model):
    """``model``'s structure with every parameter and buffer on the meta device (a deep copy costs no memory)."""
    memo: dict[int, torch.Tensor] = {id(b): torch.empty_like(b, device="meta") for b in model.buffers()}
    memo.update({id(p): torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
                 for p in model.parameters()})  # tied matrices: one object, one entry, still tied
    return copy.deepcopy(model, memo)


def flat(share: dict[str, torch.Tensor]) -> Payload:
    """A share as one wire payload: its tensors in name order, one flat tensor per dtype (the wire's header holds at
    most 8 named tensors; the receiver knows the names and shapes)."""
    out: dict[str, list[torch.Tensor]] = {}
    for name in sorted(share):
        out.setdefault(str(share[name].dtype).removeprefix("torch."), []).append(share[name].reshape(-1))
    return Payload({dt: torch.cat(ts) for dt, ts in sorted(out.items())})


def flat_expect(stage: Stage) -> Expect:
    """Exactly the payload ``flat`` makes of ``stage``'s share (from the receiver's own copy of the stage)."""
    sizes: dict[str, tuple[int, torch.dtype]] = {}
    for t in stage.hf_state_dict().values():
        key = str(t.dtype).removeprefix("torch.")
        sizes[key] = (sizes.get(key, (0, t.dtype))[0] + t.numel(), t.dtype)
    return Expect.exactly({k: ((n,), dt) for k, (n, dt) in sorted(sizes.items())})


def unflat(payload: Payload, stage: Stage) -> dict[str, torch.Tensor]:
    """The inverse of ``flat``, by the names and shapes of the receiver's copy of ``stage``."""
    ref = stage.hf_state_dict()
    at = {k: 0 for k in payload.tensors}
    out = {}
    for name in sorted(ref):
        key = str(ref[name].dtype).removeprefix("torch.")
        n = ref[name].numel()
        out[name] = payload.tensors[key][at[key]:at[key] + n].reshape(ref[name].shape).clone()
        at[key] += n
    return out


def share_bytes(share: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in share.values())


def write_model(loaded, shares: list[dict[str, torch.Tensor]], dest: Path, cfg: Config) -> None:
    """The shares put into the whole model and written to ``dest`` (``save_model``)."""
    state: dict[str, torch.Tensor] = {}
    for share in shares:
        state.update(share)
    save_model(merge_state(loaded.model, state, in_place=True), loaded.tokenizer, dest, cfg)


def adapter_only(cfg: Config) -> bool:
    """A LoRA run whose model is written as peft's adapter (``train.lora.save``) rather than merged."""
    return bool(cfg.train.lora.rank) and cfg.train.lora.save == "adapter"


def write_into(folder: Path, model, tokenizer, cfg: Config) -> None:
    """``model`` (a LoRA run's adapters not yet merged) into the existing ``folder``: the whole model with the
    adapters folded in, or (``train.lora.save = adapter``) peft's adapter files naming the base model's folder,
    which ``PeftModel.from_pretrained(base, folder)`` loads; the tokenizer and generation config beside either."""
    if adapter_only(cfg):
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        base = model_folder(cfg.model.name)
        assert base is not None, "validate_names refuses an adapter of a random preset"
        adapters = get_peft_model_state_dict(model)  # peft's own names: adapter name dropped
        # PeftModel's parameters sit under base_model.model.: the names its from_pretrained reads back
        save_file({f"base_model.model.{k}": v.detach().to("cpu").contiguous() for k, v in adapters.items()},
                  str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
        config = copy.copy(model.peft_config["default"])
        config.base_model_name_or_path = str(base.resolve())
        config.save_pretrained(str(folder))
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(folder)
    else:
        save_weights(merge_lora(model), folder)
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(folder)


def save_model(model, tokenizer, dest: Path, cfg: Config) -> None:
    """``model`` written to ``dest`` (``write_into``): into a new folder beside it, then in its place (the job's
    earlier one, on --resume, is replaced only once the new one is complete)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}-"))
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # the end of a run: its own lines say where the model went
    try:
        write_into(tmp, model, tokenizer, cfg)
        if dest.exists():
            old = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}-old-"))
            dest.rename(old / dest.name)
            tmp.rename(dest)
            shutil.rmtree(old)  # this job's earlier model (OUT is the job's own folder), moved aside above
        else:
            tmp.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # ours: absent once renamed
        if bars:
            hf_logging.enable_progress_bar()


def sent_bytes(shares: list[dict[str, torch.Tensor]], writer: int) -> int:
    """What replica 0's stages send to global rank ``writer`` (``train.model_rank``; rank = replica x pp + stage):
    every share but the writer's own, when it is one of them."""
    return sum(share_bytes(x) for s, x in enumerate(shares) if s != writer)


def model_summary(dest: Path, gathered: int, writer: int, cfg: Config) -> dict:
    """``summary.json``'s fields of the job's model: its folder (in the writer's ``--out``), its format
    (``transformers``, or ``peft``: an adapter, ``train.lora.save``), the bytes gathered to write it (apart from
    training's axes) and the global rank that wrote it."""
    return {"model": dest.name, "model_format": "peft" if adapter_only(cfg) else "transformers",
            "model_bytes": gathered, "model_rank": writer}
