"""Model families: what a pipeline stage must do that a Hugging Face model does outside its decoder layers.

A stage runs the model's own decoder layers (``models/stages.py``), so everything *inside* a layer
(Granite's residual and attention multipliers, Gemma 2's attention soft-capping, Cohere's parallel
block, Exaone 4's rotary on sliding layers only) is the model's own code. What the model's forward
does *around* the layers is not, and a stage must redo it or compute another function in silence:

- **the embedding scale**: Granite multiplies the embeddings by ``embedding_multiplier`` in
  ``GraniteModel.forward`` (Gemma's ``sqrt(hidden)`` lives in its scaled-embedding module: nothing to do);
- **the attention kind of each layer**: full causal, or causal within a sliding window, from the
  config's ``layer_types`` (``ATTENTION_FROM_LAYER_TYPES``) or from ``sliding_window`` on every layer
  (``ATTENTION_ALL_SLIDING``: Mistral, Phi-3, Qwen3-MoE build ``create_sliding_window_causal_mask``
  whenever it is set); ``sliding_window_mask`` is transformers' ``sliding_window_overlay``
  (``kv_idx > q_idx - sliding_window``) on the packed-document mask;
- **rotary embeddings per layer type** (Gemma 3: a local and a global base, ``rotary_emb(h, pos, layer_type)``);
- **the head's transform** of the logits: ``final_logit_softcapping`` (Gemma 2 and 3:
  ``cap * tanh(logits / cap)``), ``logits_scaling`` (Granite: ``logits / s``), ``logit_scale``
  (Cohere: ``logits * s``);
- **the attention implementation**: Gemma 2's ``attn_logit_softcapping`` is applied by eager attention
  only (SDPA has no hook for it), so such a model runs eager, with an additive float mask; without the soft-cap
  its stages pack as every other family's, though transformers builds Gemma 2 eager (its class has no SDPA path).

The registry is keyed on ``config.model_type``, never on which attributes happen to exist; each entry
is a few fields. A ``model_type`` not listed is refused in one line before any weights load
(``check_model_type``); so is an option of a listed family that the seam cannot honour (``refuse``).
docs/models.md lists the families, and a test keeps that list and this registry equal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM

from thinpipe.config import ConfigError

ATTENTION_FULL = "full"                       # every layer full causal (the model has no sliding window)
ATTENTION_ALL_SLIDING = "sliding_window"      # every layer sliding when config.sliding_window is set
ATTENTION_FROM_LAYER_TYPES = "layer_types"    # config.layer_types[i]: "full_attention" | "sliding_attention"
LLAMA_LORA = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Family:
    """One ``model_type``'s forward outside its decoder layers (see the module docstring)."""

    model_type: str
    attention: str = ATTENTION_FULL
    """How each layer's attention kind is read from the config (``ATTENTION_*``)."""
    embedding_multiplier: str | None = None
    """Config attribute the token embeddings are multiplied by before the first layer (Granite)."""
    rotary_per_layer_type: bool = False
    """The rotary module takes the layer type and gives each type its own embeddings (Gemma 3)."""
    logit_softcap: str | None = None
    """Config attribute c of the head's soft-cap ``c * tanh(logits / c)`` (None in the config: off)."""
    logit_divisor: str | None = None
    """Config attribute the logits are divided by (Granite's ``logits_scaling``)."""
    logit_multiplier: str | None = None
    """Config attribute the logits are multiplied by (Cohere's ``logit_scale``)."""
    eager_attention_if: str | None = None
    """Config attribute that, when not None, only eager attention honours (Gemma 2's attention soft-cap)."""
    lora_targets: tuple[str, ...] = LLAMA_LORA
    """``train.lora.target_modules``'s default for the family: every linear map of a decoder layer."""
    refuse: Callable[[object], str | None] | None = None
    """An option of this family the seam cannot honour: the reason, or None."""

    # ------------------------------------------------------------------ what a stage asks
    def packs(self, config) -> bool:
        """Whether a stage may run thinpipe's packed-document attention (``models/packed_attention.py``, SDPA
        underneath): False where an option only eager attention honours is set (Gemma 2's attention soft-cap)."""
        return not (self.eager_attention_if and getattr(config, self.eager_attention_if, None) is not None)

    def attn_implementation(self, config) -> str:
        """What the model is built with: ``sdpa`` where the family packs and its transformers class has an SDPA path,
        else ``eager`` (transformers refuses ``sdpa`` for a class without one: Gemma 2's, even with its soft-cap
        off; its stages still pack, ``packs``)."""
        if not self.packs(config):
            return "eager"
        cls = AutoModelForCausalLM._model_mapping.get(type(config), None)
        return "sdpa" if cls is None or getattr(cls, "_supports_sdpa", True) else "eager"

    def layer_types(self, config) -> list[str]:
        """Each decoder layer's attention kind, "full_attention" or "sliding_attention"."""
        n = config.num_hidden_layers
        if self.attention == ATTENTION_FROM_LAYER_TYPES and getattr(config, "layer_types", None):
            return list(config.layer_types)
        if self.attention == ATTENTION_ALL_SLIDING and getattr(config, "sliding_window", None) is not None:
            return ["sliding_attention"] * n
        return ["full_attention"] * n

    def layer_windows(self, config) -> list[int | None]:
        """Each decoder layer's sliding window in tokens (None: full causal attention)."""
        window = getattr(config, "sliding_window", None)
        return [window if t == "sliding_attention" else None for t in self.layer_types(config)]

    def embed_scale(self, config) -> float | None:
        return None if self.embedding_multiplier is None else float(getattr(config, self.embedding_multiplier))

    def head(self, logits: torch.Tensor, config) -> torch.Tensor:
        """The model's own transform of ``lm_head``'s output, in the order its ``ForCausalLM.forward`` applies it."""
        cap = getattr(config, self.logit_softcap, None) if self.logit_softcap else None
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        if self.logit_divisor:
            logits = logits / getattr(config, self.logit_divisor)
        if self.logit_multiplier:
            logits = logits * getattr(config, self.logit_multiplier)
        return logits


def _gemma3_refuse(config) -> str | None:
    if getattr(config, "use_bidirectional_attention", False):
        return "use_bidirectional_attention = true (an encoder's bidirectional window) is not causal language modelling"
    return None


def _moe_refuse(config) -> str | None:
    if getattr(config, "output_router_logits", False):
        return ("output_router_logits = true adds the router's load-balancing loss to the training loss, which "
                "thinpipe's stages do not compute: set it to false in the model's config.json")
    return None


_FAMILIES = [
    Family("llama"),
    Family("qwen2", attention=ATTENTION_FROM_LAYER_TYPES),
    Family("qwen3", attention=ATTENTION_FROM_LAYER_TYPES),
    Family("qwen3_moe", attention=ATTENTION_ALL_SLIDING, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"),
           refuse=_moe_refuse),
    Family("mistral", attention=ATTENTION_ALL_SLIDING),
    Family("ministral", attention=ATTENTION_FROM_LAYER_TYPES),
    Family("gemma"),
    Family("gemma2", attention=ATTENTION_FROM_LAYER_TYPES, logit_softcap="final_logit_softcapping",
           eager_attention_if="attn_logit_softcapping"),
    Family("gemma3_text", attention=ATTENTION_FROM_LAYER_TYPES, rotary_per_layer_type=True,
           logit_softcap="final_logit_softcapping", eager_attention_if="attn_logit_softcapping",
           refuse=_gemma3_refuse),
    Family("phi3", attention=ATTENTION_ALL_SLIDING, lora_targets=("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),
    Family("olmo"),
    Family("olmo2"),
    Family("stablelm"),
    Family("smollm3", attention=ATTENTION_FROM_LAYER_TYPES),
    Family("glm", lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj")),
    Family("glm4", lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj")),
    Family("exaone4", attention=ATTENTION_FROM_LAYER_TYPES),
    Family("apertus", lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj")),
    Family("arcee", lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj")),
    Family("seed_oss"),
    Family("hunyuan_v1_dense"),
    Family("granite", embedding_multiplier="embedding_multiplier", logit_divisor="logits_scaling"),
    Family("cohere", logit_multiplier="logit_scale"),
    Family("cohere2", attention=ATTENTION_FROM_LAYER_TYPES, logit_multiplier="logit_scale"),
]
FAMILIES: dict[str, Family] = {f.model_type: f for f in _FAMILIES}

# Families thinpipe refuses, and why: their layout is not ``model.embed_tokens / model.layers / model.norm``.
REFUSED: dict[str, str] = {
    "gpt_neox": "its decoder is gpt_neox.layers with a parallel attention/MLP block and no model.model",
    "falcon": "its decoder is transformer.h (no model.model) with alibi or parallel attention variants",
    "phi": "its final norm is final_layernorm and its block runs attention and MLP in parallel",
}

# A GGUF file names its architecture the llama.cpp way; the Hugging Face model_type it loads as.
GGUF_ARCHITECTURES = {"gemma3": "gemma3_text"}


def supported() -> str:
    return ", ".join(sorted(FAMILIES))


def check_model_type(model_type: str | None, where: str) -> Family:
    """The family of ``model_type``, or one ConfigError line naming it and what is supported."""
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    why = f" ({REFUSED[model_type]})" if model_type in REFUSED else ""
    raise ConfigError(f"{where}: model family {model_type!r} is not supported{why}; thinpipe splits these exactly: "
                      f"{supported()} (docs/models.md)")


def family_of(config, where: str = "model") -> Family:
    """The family of a Hugging Face config, after refusing an option it cannot honour."""
    family = check_model_type(getattr(config, "model_type", None), where)
    reason = family.refuse(config) if family.refuse else None
    if reason:
        raise ConfigError(f"{where}: {family.model_type} with {reason}")
    return family


def sliding_window_mask(mask: torch.Tensor, window: int) -> torch.Tensor:
    """``mask`` (B, 1, q, kv) bool, its queries the last q of the kv columns, restricted to keys fewer than
    ``window`` columns back: transformers' ``sliding_window_overlay`` (``kv_idx > q_idx - window``) over
    column indices, as its masks index the cache. Packed documents and left padding are contiguous runs of
    columns, so a column distance is a position distance within a document."""
    q, kv = mask.shape[-2:]
    q_col = torch.arange(kv - q, kv, device=mask.device).view(q, 1)
    kv_col = torch.arange(kv, device=mask.device).view(1, kv)
    return mask & (kv_col > q_col - window)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask as eager attention adds it: 0 where allowed, the dtype's minimum elsewhere (as
    transformers' ``eager_mask`` builds it; a bool mask would be added as 0 / 1 in silence)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
