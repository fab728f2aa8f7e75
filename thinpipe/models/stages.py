"""Split a decoder-only causal LM into pipeline stages by contiguous layer ranges.

Stage 0 holds the token embeddings, the last stage the final norm, the LM head and the loss. Each
stage holds its own rotary module (buffers only), so it computes position embeddings locally from
position ids instead of receiving them. The decoder layers are the model's own; what its forward does
around them (embedding multiplier, each layer's attention kind and sliding window, rotary per layer
type, the head's soft-cap or logit scale, eager attention where only it is exact) comes from the
model's family (``models/families.py``), and a family thinpipe has no entry for is refused. The layout
is ``model.embed_tokens / model.layers / model.norm / model.rotary_emb / lm_head``. Submodules keep
their Hugging Face names, so ``hf_state_dict`` of all stages reassembles the original checkpoint.

Tied embeddings: with more than one stage, the first and last stage each hold a copy of the tied
matrix; the engine sums their gradients every step (``model.tied = "sync"``), which keeps them equal,
or lets them drift apart (``"untie"``).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from thinpipe.config import ConfigError
from thinpipe.console import say
from thinpipe.models.families import Family, additive_mask, family_of, sliding_window_mask
from thinpipe.models.heap import release_freed_heap
from thinpipe.models.packed_attention import ATTENTION, Documents, register
from thinpipe.models.router_loss import RouterLoss, attach


def balanced_split(num_layers: int, num_stages: int) -> list[int]:
    """Layers per stage, as equal as possible, the extra layers going to the middle stages
    (the first stage also embeds and the last computes the vocabulary projection)."""
    if num_stages > num_layers:
        raise ConfigError(f"mesh.pp = {num_stages} stages but the model has only {num_layers} decoder layers: "
                          f"use mesh.pp <= {num_layers}")
    base, extra = divmod(num_layers, num_stages)
    counts = [base] * num_stages
    order = sorted(range(num_stages), key=lambda s: (s in (0, num_stages - 1), s))
    for s in order[:extra]:
        counts[s] += 1
    return counts


# Boundary modules renamed since: old name -> new name. Checkpoints written before MAPL's per-stage
# "anchor" became its "offset" hold ``boundary_modules.in_anchor.*``.
LEGACY_BOUNDARY_MODULES = {"in_anchor": "in_offset"}


def _rename_legacy_boundary_keys(module, state_dict, prefix, *args) -> None:
    """Load-state-dict pre-hook of ``Stage.boundary_modules``: old checkpoints' keys under their new names."""
    for old, new in LEGACY_BOUNDARY_MODULES.items():
        for key in [k for k in state_dict if k.startswith(f"{prefix}{old}.")]:
            state_dict[f"{prefix}{new}.{key[len(prefix) + len(old) + 1:]}"] = state_dict.pop(key)



def chunked_next_token_loss(h: torch.Tensor, labels: torch.Tensor, head, chunk_tokens: int) -> torch.Tensor:
    """``next_token_loss(head(h), labels)`` over at most ``chunk_tokens`` tokens of logits at a time: each chunk's
    head and cross-entropy run under activation checkpointing, so neither the (B, T, V) logits nor their gradient
    exist at once (the memory of Liger's fused linear cross-entropy, by recomputation). Position t's target is
    ``labels[:, t + 1]`` as in ``next_token_loss``; the sum's order differs, so it equals to float rounding."""
    b, t, _ = h.shape
    span = max(1, chunk_tokens // b)
    targets = F.pad(labels[:, 1:], (0, 1), value=-100)  # position t's target; the last position has none

    def part(hc: torch.Tensor, tc: torch.Tensor) -> torch.Tensor:
        logits = head(hc).float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tc.reshape(-1), ignore_index=-100,
                               reduction="sum")

    grad = torch.is_grad_enabled()
    total = h.new_zeros((), dtype=torch.float32)
    for a in range(0, t, span):
        hc, tc = h[:, a:a + span], targets[:, a:a + span]
        total = total + (checkpoint(part, hc, tc, use_reentrant=False) if grad else part(hc, tc))
    return total


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum over positions of -log p(labels[t + 1] | ..t), labels -100 ignored: ``cross_entropy`` of the
    shifted logits, bitwise, without copying them.

    ``cross_entropy`` is ``log_softmax`` then ``nll_loss``. Slicing the logits to ``[:, :-1]`` first copies
    a (B, T-1, V) tensor forward and fills a zero (B, T, V) one backward (the largest temporaries of a
    step: vocabulary-sized). ``log_softmax`` is row-wise, so it runs on the unsliced view; the picked
    log-probabilities then enter ``nll_loss`` as the same rows, in the same order, with the same ignored
    ones, so its sum (and every gradient) is what the sliced call gives.
    """
    b, t, v = logits.shape
    logp = F.log_softmax(logits.reshape(-1, v), dim=-1)
    targets = labels[:, 1:]
    nxt = F.pad(targets, (0, 1), value=-100).reshape(-1, 1)
    picked = logp.gather(1, nxt.clamp(min=0)).view(b, t)[:, :-1].reshape(-1, 1)
    keep = torch.where(targets == -100, -100, 0).reshape(-1)
    return F.nll_loss(picked, keep, ignore_index=-100, reduction="sum")

TRIM_MIN_BYTES = 1 << 20  # a layer's input below this (a tiny model's) leaves nothing worth a trim (~1 ms each)


class Stage(nn.Module):
    """One pipeline stage: (embed?) -> layers[first:first+n] -> (norm, head, loss)?

    How it computes, set from the run's config (``rank/from_config.py: configure_stage``): ``packed_attention``
    (``model.attention``: packed documents without a T x T mask, or the dense mask), ``checkpoint_layers``
    (``train.activation_checkpointing``: each decoder layer's activations recomputed in the backward) and
    ``loss_chunk_tokens`` (``train.loss_chunk_tokens``: the head and loss over at most that many tokens at once) and
    ``trim_heap`` (``train.cpu_heap_trim``: on the CPU, the heap's free pages returned after each layer's forward)."""

    packed_attention = True
    checkpoint_layers = False
    loss_chunk_tokens = 0
    trim_heap = False

    def __init__(self, index: int, num_stages: int, first_layer: int, layers: list[nn.Module], rotary: nn.Module,
                 embed_tokens: nn.Module | None, norm: nn.Module | None, lm_head: nn.Module | None,
                 family: Family, config, router: RouterLoss | None = None):
        super().__init__()
        self.index, self.num_stages, self.first_layer = index, num_stages, first_layer
        self.layers = nn.ModuleDict({str(first_layer + i): layer for i, layer in enumerate(layers)})
        # The model's forward around its layers (models/families.py); the config is the model's own, shared
        # with its layers (which read their attention implementation from it).
        self.family, self.model_config = family, config
        span = slice(first_layer, first_layer + len(layers))
        self.layer_types = family.layer_types(config)[span]
        self.windows = family.layer_windows(config)[span]
        self.embed_scale = family.embed_scale(config) if embed_tokens is not None else None
        self.rotary_emb = rotary
        self.embed_tokens, self.norm, self.lm_head = embed_tokens, norm, lm_head
        self.tied_embeddings = False
        # a mixture of experts' load-balancing loss over this stage's routers (models/router_loss.py); the sum of its
        # values since the engine last read it (``take_router_aux``), weighted by each microbatch's share of its step
        self.router, self._router_aux = router, 0.0
        # Parameters of the boundaries this stage owns (a MAPL projector, a MAPL stage offset, the SSN
        # basis): they train, sync and checkpoint with the stage but are not part of the HF model.
        self.boundary_modules = nn.ModuleDict()
        self.boundary_modules.register_load_state_dict_pre_hook(_rename_legacy_boundary_keys)

    def parameters_in_model_order(self) -> list[nn.Parameter]:
        """This stage's parameters in the unsplit Hugging Face model's order (the embedding before the layers; the
        module registers it after them): concatenated over the stages, every split gives the same sequence, so a
        reduction over it (the global gradient norm) is the unsplit model's, bitwise, whatever the split."""
        first = [] if self.embed_tokens is None else list(self.embed_tokens.parameters())
        ids = {id(p) for p in first}
        return first + [p for p in self.parameters() if id(p) not in ids]

    @property
    def eager(self) -> bool:
        """Whether the layers run eager attention (read from the config they read it from): it adds its mask."""
        return self.model_config._attn_implementation == "eager"

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        """x: token ids (B, T) on stage 0, else hidden states (B, T, H).
        Returns hidden states (B, T, H), or on the last stage the scaled loss (a scalar)."""
        aux = []
        h = self.hidden_states(x, ctx, router_aux=aux)
        if self.is_last:
            h = self.loss(h, ctx)
        if aux:  # this stage's router loss: into the backward, not into what it returns
            h = attach(h, aux[0])
        return h

    def loss(self, h: torch.Tensor, ctx) -> torch.Tensor:
        """Last stage: the objective's loss of the hidden states, scaled by ``ctx.loss_scale``."""
        if getattr(ctx, "loss_fn", None) is not None:  # an objective after SFT (thinpipe/objective/)
            return ctx.loss_fn(self.logits(h).float(), ctx)
        if self.loss_chunk_tokens and h.shape[0] * h.shape[1] > self.loss_chunk_tokens:
            return chunked_next_token_loss(h, ctx.labels, self.logits, self.loss_chunk_tokens) * ctx.loss_scale
        return next_token_loss(self.logits(h).float(), ctx.labels) * ctx.loss_scale

    def take_router_aux(self) -> float:
        """The router loss's values since the last call (each microbatch's weighted by its share of the step's loss
        tokens: one step's sum is the step's value), and start again."""
        value, self._router_aux = self._router_aux, 0.0
        return value

    def hidden_states(self, x: torch.Tensor, ctx, cache=None, router_aux: list | None = None) -> torch.Tensor:
        """(embed?) -> this stage's layers: hidden states (B, T, H).

        ``cache``: the keys and values of this stage's layers so far (incremental decoding,
        ``rank/generation.py``), which Hugging Face attention extends by each layer's own ``layer_idx``
        (the global layer number, so one stage's cache holds its layers alone); ``ctx.attn_mask`` is
        then (B, 1, T, cached + T) and ``ctx.position_ids`` the new tokens' positions.

        ``router_aux``: a list to append this stage's router loss term to (a training forward of a mixture of experts,
        ``models/router_loss.py``), already multiplied by ``router_aux_loss_coef`` and the microbatch's share of the
        step (``ctx.share``)."""
        router = self.router if router_aux is not None and cache is None and torch.is_grad_enabled() else None
        if router is None:
            return self._layers(x, ctx, cache)
        with router.capture(self.layers.values()) as captured:
            h = self._layers(x, ctx, cache)
        docs = ctx.attn_mask if isinstance(ctx.attn_mask, Documents) else None
        aux = captured.loss(None if docs is None or docs.segment_ids is None else docs.segment_ids < 0)
        if aux is not None:
            share = getattr(ctx, "share", 1.0)  # the microbatch's share of its step (rank/context.py)
            self._router_aux += float(aux.detach()) * share
            if router.train:
                router_aux.append(aux * (router.coef * share))
        return h

    def _layers(self, x: torch.Tensor, ctx, cache) -> torch.Tensor:
        h = self.embed_tokens(x) if self.is_first else x
        if self.embed_scale is not None:
            h = h * self.embed_scale
        pos = self.position_embeddings(h, ctx.position_ids)
        masks = self.layer_masks(ctx.attn_mask)
        kv = dict(self.family.layer_arguments)  # (Falcon's alibi = None), and the cache where there is one
        if cache is not None:
            kv[self.family.cache_argument] = cache
        recompute = self.checkpoint_layers and cache is None and torch.is_grad_enabled()
        trim = self.trim_heap and h.device.type == "cpu" and h.numel() * h.element_size() >= TRIM_MIN_BYTES
        for layer, kind, window in zip(self.layers.values(), self.layer_types, self.windows):
            if trim and h.requires_grad:  # once this layer's backward is done, its freed blocks go back too
                h.register_hook(_trim_after_backward)
            if recompute:  # only the layer's input is kept; its activations are recomputed in the backward
                h = checkpoint(layer, h, use_reentrant=False, attention_mask=masks[window],
                               position_ids=ctx.position_ids, position_embeddings=pos[kind], **kv)
            else:
                h = layer(h, attention_mask=masks[window], position_ids=ctx.position_ids,
                          position_embeddings=pos[kind], **kv)
            if self.family.layer_returns_tuple:  # (hidden states, attention weights)
                h = h[0]
            if trim:  # the layer's freed temporaries: back to the system
                release_freed_heap()
        return h

    def position_embeddings(self, h: torch.Tensor, position_ids: torch.Tensor) -> dict:
        """Rotary (cos, sin) per layer type of this stage (one for all, unless the family has one per type)."""
        if self.family.rotary_per_layer_type:
            return {kind: self.rotary_emb(h, position_ids, kind) for kind in dict.fromkeys(self.layer_types)}
        pos = self.rotary_emb(h, position_ids)
        return dict.fromkeys(self.layer_types, pos)

    def layer_masks(self, mask: Documents | torch.Tensor) -> dict:
        """The attention mask per sliding window of this stage's layers (None: full): packed documents' spans
        with the window (``models/packed_attention.py``), or the packed-document causal ``mask`` (B, 1, q, kv)
        restricted to each window, additive floats for eager attention."""
        if isinstance(mask, Documents):
            if self.packed_attention and self.model_config._attn_implementation == ATTENTION:
                return {window: mask.with_window(window) for window in dict.fromkeys(self.windows)}
            if self.packed_attention:
                _say_once(f"[thinpipe] {self.family.model_type} {self.family.why_not_packed(self.model_config)}: "
                          "packed documents take the dense T x T mask")
            mask = mask.dense()
        out = {}
        for window in dict.fromkeys(self.windows):
            m = mask if window is None else sliding_window_mask(mask, window)
            out[window] = additive_mask(m, torch.float32) if self.eager else m
        return out

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Last stage: vocabulary logits (B, T, V) of hidden states, with the family's head transform."""
        return self.family.head(self.lm_head(self.norm(h)), self.model_config)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's parameters under their names in the original Hugging Face model."""
        out = {}
        for name, t in self.state_dict().items():
            if name.startswith(("rotary_emb.", "boundary_modules.")):
                continue
            out[self.hf_name(name)] = t
        return out

    def hf_name(self, stage_name: str) -> str:
        """A parameter's name here -> its name in the Hugging Face model (the family's ``Layout``)."""
        return self.family.layout.hf_name(stage_name)


def _trim_after_backward(grad: torch.Tensor) -> torch.Tensor:
    """A gradient hook on a layer's input (``Stage.trim_heap``): the layer's backward is done, return the heap's free
    pages (its freed activations and temporaries); the gradient passes unchanged."""
    release_freed_heap()
    return grad


_SAID: set[str] = set()


def _say_once(line: str) -> None:
    if line not in _SAID:
        _SAID.add(line)
        say(line)


def build_stages(model: nn.Module, split: list[int] | None, num_stages: int) -> list[Stage]:
    """Deep-copy ``model`` once and carve it into stages (a fresh, independent set of modules)."""
    model = copy.deepcopy(model)
    family = family_of(model.config)
    # the attention the family is exact with (eager for Gemma 2's attention soft-cap): on the copy, whose
    # layers read it from their config at every call
    # (thinpipe's packed-document attention where it would be SDPA: it hands every other mask to SDPA unchanged)
    register()
    model.config._attn_implementation = family.stage_attention(model.config, ATTENTION)
    names = family.layout
    inner = getattr(model, names.decoder)
    layers = list(getattr(inner, names.layers))
    embed, norm, lm_head = getattr(inner, names.embed), getattr(inner, names.norm), getattr(model, names.head)
    router = RouterLoss.of_model(model)
    split = list(split) if split else balanced_split(len(layers), num_stages)
    if sum(split) != len(layers):
        raise ConfigError(f"mesh.split = {split} covers {sum(split)} layers but the model has {len(layers)}")
    stages, start = [], 0
    for s, n in enumerate(split):
        first, last = s == 0, s == num_stages - 1
        head = lm_head if last else None
        if last and first is False and model.config.tie_word_embeddings:
            # Separate copy of the tied matrix on the last stage (one code path for sim and dist:
            # in a real mesh the two ends live in different processes).
            head = copy.deepcopy(lm_head)
            head.weight = nn.Parameter(lm_head.weight.detach().clone(),
                                       requires_grad=lm_head.weight.requires_grad)  # frozen under LoRA
        stages.append(Stage(s, num_stages, start, layers[start:start + n],
                            copy.deepcopy(inner.rotary_emb) if s else inner.rotary_emb,
                            embed if first else None, norm if last else None, head,
                            family, model.config, router))
        stages[-1].tied_embeddings = bool(model.config.tie_word_embeddings)
        start += n
    return stages


def tied_pair(stages: list[Stage]) -> tuple[nn.Parameter, nn.Parameter] | None:
    """(embedding on stage 0, head on the last stage) when they are tied copies in different stages."""
    first, last = stages[0], stages[-1]
    if first is last or not first.tied_embeddings:
        return None
    return first.embed_tokens.weight, last.lm_head.weight


def merge_stages(template: nn.Module, stages: list[Stage]) -> nn.Module:
    """A standalone Hugging Face model holding the stages' current weights (for eval and export)."""
    state = {}
    for stage in stages:
        state.update({k: v.detach().clone() for k, v in stage.hf_state_dict().items()})
    return merge_state(template, state)


def merge_state(template: nn.Module, state: dict[str, torch.Tensor], in_place: bool = False) -> nn.Module:
    """A standalone Hugging Face model: a copy of ``template`` (or ``template`` itself, ``in_place``: one copy of the
    model less) holding ``state`` (every stage's ``hf_state_dict`` together, which must cover the model). A template
    whose parameters are on the meta device (``rank/from_config.py: load_empty``) takes ``state``'s tensors
    themselves (``assign``: no second copy of the model); a tied head is tied again to the assigned embedding."""
    model = template if in_place else copy.deepcopy(template)
    assign = any(p.is_meta for p in model.parameters())
    names = family_of(model.config).layout
    head_w, embed_w = names.head_weight, names.embedding_weight
    if model.config.tie_word_embeddings and head_w in state and embed_w in state:
        if not torch.equal(state[head_w], state[embed_w]):
            model.config.tie_word_embeddings = False
            getattr(model, names.head).weight = nn.Parameter(state[head_w].clone())
        elif assign:  # the head is the embedding: assigning both would untie them
            state = {k: v for k, v in state.items() if k != head_w}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=assign)
    missing = [m for m in missing if not (m == head_w and model.config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"stage weights do not cover the model: missing {missing}, unexpected {unexpected}")
    if assign:
        if model.config.tie_word_embeddings:
            model.tie_weights()
        left = [n for n, p in model.named_parameters() if p.is_meta]
        if left:
            raise RuntimeError(f"stage weights do not cover the model: {left[:5]} left on the meta device")
    return model
