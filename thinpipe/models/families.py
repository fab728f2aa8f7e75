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
class Layout:
    """Where a family's modules live in its ``...ForCausalLM``: a stage holds them under its own names
    (``embed_tokens``, ``layers``, ``norm``, ``rotary_emb``, ``lm_head``, so the engines never see a family) and
    ``hf_name`` gives each parameter back its name in the checkpoint."""

    decoder: str = "model"
    """The decoder module's attribute on the causal LM (``model``; GPT-NeoX ``gpt_neox``; Falcon ``transformer``)."""
    embed: str = "embed_tokens"
    """The token embedding's attribute on the decoder (GPT-NeoX ``embed_in``; Falcon ``word_embeddings``)."""
    layers: str = "layers"
    """The decoder layers' list (Falcon ``h``)."""
    norm: str = "norm"
    """The final norm (Phi ``final_layernorm``; GPT-NeoX ``final_layer_norm``; Falcon ``ln_f``)."""
    head: str = "lm_head"
    """The vocabulary projection's attribute on the causal LM."""

    def hf_name(self, stage_name: str) -> str:
        """A stage's parameter name -> its name in the Hugging Face model (``layers.3.mlp.up_proj.weight`` is
        ``model.layers.3.mlp.up_proj.weight`` in the Llama layout, ``transformer.h.3.mlp...`` in Falcon's)."""
        first, _, rest = stage_name.partition(".")
        if first == "lm_head":
            return f"{self.head}.{rest}"
        inner = {"embed_tokens": self.embed, "layers": self.layers, "norm": self.norm}.get(first, first)
        return f"{self.decoder}.{inner}.{rest}"

    @property
    def embedding_weight(self) -> str:
        """The token embedding's name in the checkpoint (a tied head is stored as it)."""
        return f"{self.decoder}.{self.embed}.weight"

    @property
    def head_weight(self) -> str:
        return f"{self.head}.weight"


LLAMA_LAYOUT = Layout()


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
    layout: Layout = LLAMA_LAYOUT
    """Where its embedding, layers, final norm and head live (``Layout``)."""
    eager_only: str | None = None
    """Why the family's attention is eager whatever its options (GPT-OSS's attention sinks), or None."""
    own_attention: str | None = None
    """Why its layers call SDPA themselves rather than transformers' attention functions (Falcon), so they take the
    dense mask and never thinpipe's packed documents; None where they go through the attention functions."""
    cache_argument: str = "past_key_values"
    """The keyword a decoder layer takes its KV cache by (GPT-NeoX and Falcon: ``layer_past``)."""
    layer_arguments: tuple[tuple[str, object], ...] = ()
    """Further keyword arguments its model passes every layer (Falcon: ``alibi = None`` with rotary embeddings)."""
    layer_returns_tuple: bool = False
    """A layer returns (hidden states, attention weights) rather than the hidden states (Falcon)."""
    experts: bool = False
    """A mixture of experts: its runs report ``router_aux_loss`` (0 where the family computes none: DeepSeek-V3's
    bias-balanced router), and ``thinpipe plan`` counts only the active experts' compute."""

    # ------------------------------------------------------------------ what a stage asks
    def needs_eager(self, config) -> str | None:
        """Why the model must attend eagerly (an option only eager attention honours: Gemma 2's attention soft-cap,
        GPT-OSS's sinks), or None."""
        if self.eager_only:
            return self.eager_only
        if self.eager_attention_if and getattr(config, self.eager_attention_if, None) is not None:
            return f"its {self.eager_attention_if}"
        return None

    def packs(self, config) -> bool:
        """Whether a stage may run thinpipe's packed-document attention (``models/packed_attention.py``, SDPA
        underneath): False where only eager attention is exact (``needs_eager``) or the layers call SDPA themselves."""
        return self.needs_eager(config) is None and self.own_attention is None

    def why_not_packed(self, config) -> str:
        """One phrase for the line that says a stage takes the dense mask."""
        eager = self.needs_eager(config)
        return f"runs eager attention ({eager})" if eager else f"runs its own attention ({self.own_attention})"

    def attn_implementation(self, config) -> str:
        """What the model is built with: ``sdpa`` unless only eager attention is exact or its transformers class has no
        SDPA path (transformers refuses ``sdpa`` for it: Gemma 2's, even with its soft-cap off; its stages still
        pack, ``packs``)."""
        if self.needs_eager(config):
            return "eager"
        cls = AutoModelForCausalLM._model_mapping.get(type(config), None)
        return "sdpa" if cls is None or getattr(cls, "_supports_sdpa", True) else "eager"

    def stage_attention(self, config, packed: str) -> str:
        """The attention implementation a stage's layers read from their config: ``packed`` (thinpipe's packed
        documents, SDPA underneath) where the family packs, else what the model is built with."""
        return packed if self.packs(config) else self.attn_implementation(config)

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


def _falcon_refuse(config) -> str | None:
    if getattr(config, "alibi", False):
        return ("alibi = true: its ALiBi bias rides on the attention mask the model's forward builds for the whole "
                "batch, which a stage's per-document masks do not carry (docs/models.md)")
    return None


# A mixture of experts' default LoRA targets: its experts are fused 3-d tensors, not nn.Linear (peft's target_modules
# names Linear layers), so the attention, and a shared expert's MLP or dense layers where it has them; never a router
# gate (ROUTER_GATES: an adapter there would move the routing, which peft's MoE recipes leave frozen).
_MOE_LORA = ("q_proj", "k_proj", "v_proj", "o_proj")
ROUTER_GATES = ("router", "shared_expert_gate")
_FAMILIES = [
    Family("llama"),
    Family("qwen2", attention=ATTENTION_FROM_LAYER_TYPES),
    Family("qwen3", attention=ATTENTION_FROM_LAYER_TYPES),
    Family("mistral", attention=ATTENTION_ALL_SLIDING),
    Family("ministral", attention=ATTENTION_FROM_LAYER_TYPES),
    Family("gemma"),
    Family("gemma2", attention=ATTENTION_FROM_LAYER_TYPES, logit_softcap="final_logit_softcapping",
           eager_attention_if="attn_logit_softcapping"),
    Family("gemma3_text", attention=ATTENTION_FROM_LAYER_TYPES, rotary_per_layer_type=True,
           logit_softcap="final_logit_softcapping", eager_attention_if="attn_logit_softcapping",
           refuse=_gemma3_refuse),
    Family("phi3", attention=ATTENTION_ALL_SLIDING, lora_targets=("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),
    Family("phi", layout=Layout(norm="final_layernorm"),
           lora_targets=("q_proj", "k_proj", "v_proj", "dense", "fc1", "fc2")),
    Family("gpt_neox", layout=Layout(decoder="gpt_neox", embed="embed_in", norm="final_layer_norm"),
           cache_argument="layer_past", lora_targets=("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h")),
    Family("falcon", layout=Layout(decoder="transformer", embed="word_embeddings", layers="h", norm="ln_f"),
           own_attention="its layers call SDPA with the dense mask themselves", cache_argument="layer_past",
           layer_arguments=(("alibi", None),), layer_returns_tuple=True, refuse=_falcon_refuse,
           lora_targets=("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h")),
    Family("olmo"),
    Family("olmo2"),
    Family("olmo3", attention=ATTENTION_FROM_LAYER_TYPES, rotary_per_layer_type=True),
    Family("stablelm"),
    Family("starcoder2", attention=ATTENTION_ALL_SLIDING, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "c_fc",
                                                                        "c_proj")),
    Family("nemotron", lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj")),
    Family("helium"),
    Family("internlm3"),
    Family("ernie4_5"),
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
    # mixtures of experts (models/router_loss.py: the load-balancing loss of each stage's routers)
    Family("qwen3_moe", attention=ATTENTION_ALL_SLIDING, lora_targets=_MOE_LORA, experts=True),
    Family("mixtral", attention=ATTENTION_ALL_SLIDING, lora_targets=_MOE_LORA, experts=True),
    Family("qwen2_moe", attention=ATTENTION_FROM_LAYER_TYPES, experts=True,
           lora_targets=(*_MOE_LORA, "gate_proj", "up_proj", "down_proj")),  # its shared expert's MLP
    Family("olmoe", lora_targets=_MOE_LORA, experts=True),
    Family("granitemoe", embedding_multiplier="embedding_multiplier", logit_divisor="logits_scaling",
           lora_targets=_MOE_LORA, experts=True),
    Family("phimoe", attention=ATTENTION_ALL_SLIDING, lora_targets=_MOE_LORA, experts=True),
    Family("gpt_oss", attention=ATTENTION_FROM_LAYER_TYPES, eager_only="its attention sinks", lora_targets=_MOE_LORA,
           experts=True),
    Family("deepseek_v3", experts=True, lora_targets=("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                                                      "o_proj", "gate_proj", "up_proj", "down_proj")),
]
FAMILIES: dict[str, Family] = {f.model_type: f for f in _FAMILIES}

# Families thinpipe refuses, and why (docs/models.md says more).
_HYBRID = ("a hybrid of attention and state-space layers: their recurrent state is a cache of another kind, which a "
           "stage's KV-cached generation does not carry yet")
REFUSED: dict[str, str] = {
    "falcon_h1": _HYBRID,
    "lfm2": _HYBRID,
    "jamba": _HYBRID,
    "gpt2": "learned absolute position embeddings (wpe) are added to the token embeddings outside the layers, and its "
            "projections are Conv1D, not Linear: use a rotary family",
}

# A GGUF file names its architecture the llama.cpp way; the Hugging Face model_type it loads as.
GGUF_ARCHITECTURES = {"gemma3": "gemma3_text", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss"}


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
