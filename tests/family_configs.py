"""Tiny random configs of every model family thinpipe supports (tests/unit/models/test_families.py): 4 layers,
hidden 64, vocabulary 512, a sliding window of 4 tokens (shorter than the tests' sequences) where the
family has one, alternating full and sliding layers where it mixes them, and each family's own
transforms outside the decoder layers switched on at values that change the logits."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

WINDOW = 4
MIXED = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]

COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
              pad_token_id=None)

# model_type -> its own keys on top of COMMON
FAMILY_KEYS: dict[str, dict] = {
    "llama": {},
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2),
    "qwen3": dict(head_dim=16),
    "qwen3_moe": dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "mistral": dict(sliding_window=WINDOW),
    "gemma": dict(head_dim=16),
    "gemma2": dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW, layer_types=MIXED,
                   final_logit_softcapping=2.0, attn_logit_softcapping=1.5),
    "gemma3_text": dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW, layer_types=MIXED,
                        final_logit_softcapping=2.0, rope_parameters={
                            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    "phi3": dict(),
    "olmo": dict(),
    "olmo2": dict(),
    "stablelm": dict(),
    "smollm3": dict(use_sliding_window=True, sliding_window=WINDOW, layer_types=MIXED),
    "glm": dict(head_dim=16),
    "glm4": dict(head_dim=16),
    "exaone4": dict(sliding_window=WINDOW, layer_types=MIXED),
    "apertus": dict(),
    "arcee": dict(),
    "seed_oss": dict(head_dim=16),
    "granite": dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.3, logits_scaling=4.0),
    "cohere": dict(logit_scale=0.25),
    "cohere2": dict(sliding_window=WINDOW, layer_types=MIXED, logit_scale=0.25),
    "ministral": dict(head_dim=16, sliding_window=WINDOW, layer_types=["sliding_attention"] * 4),
    "hunyuan_v1_dense": dict(head_dim=16),
}


# a family with an optional feature off, tested beside the family as a case of its own (issue 53: a gemma2 config
# without attention soft-capping crashed: its transformers class has no SDPA path)
VARIANTS = {"gemma2 without soft-caps": ("gemma2", dict(attn_logit_softcapping=None, final_logit_softcapping=None))}


def family_config(model_type: str, **extra):
    if model_type in VARIANTS:
        model_type, more = VARIANTS[model_type]
        extra = {**more, **extra}
    keys = {**COMMON, **FAMILY_KEYS.get(model_type, {}), **extra}
    return AutoConfig.for_model(model_type, **keys)


def family_model(model_type: str, seed: int = 0, attn: str | None = None, **extra):
    """A tiny random model of the family, fp32, eval mode; ``attn``: the attention implementation
    (default: the one thinpipe's family seam asks for)."""
    from thinpipe.models.families import family_of

    config = family_config(model_type, **extra)
    config._attn_implementation = attn or family_of(config).attn_implementation(config)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def family_folder(model_type: str, folder, seed: int = 0, **extra):
    """A tiny random model of the family saved as a Hugging Face folder with thinpipe's byte tokenizer
    (what a user's model folder is to ``--set model.name=FOLDER``); returns the folder."""
    from thinpipe.data.byte_tokenizer import ByteTokenizer

    model = family_model(model_type, seed, **extra)
    model.save_pretrained(folder)
    ByteTokenizer().save_pretrained(folder)
    return folder
