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
    "qwen3_moe": dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      output_router_logits=True, router_aux_loss_coef=0.5),
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
    # issue 53: the paper's Phi-2 and the layouts without model.model, dense families fine-tuned today
    "phi": dict(partial_rotary_factor=0.5),
    "gpt_neox": dict(rotary_pct=0.25),  # Pythia: a quarter of each head rotary, parallel residual
    "falcon": dict(num_kv_heads=1),  # Falcon-7B: multi-query, parallel attention/MLP, rotary
    "olmo3": dict(sliding_window=WINDOW, layer_types=MIXED, rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 5e5},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    "starcoder2": dict(sliding_window=WINDOW),
    "nemotron": dict(partial_rotary_factor=0.5),
    "helium": dict(head_dim=16),
    "internlm3": dict(),
    "ernie4_5": dict(head_dim=16),
    # mixtures of experts, trained with their load-balancing loss (models/router_loss.py)
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW, output_router_logits=True,
                    router_aux_loss_coef=0.5),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32, use_sliding_window=True, sliding_window=WINDOW,
                      max_window_layers=2, output_router_logits=True, router_aux_loss_coef=0.5),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.5),
    "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=3.0, residual_multiplier=0.5,
                       attention_multiplier=0.3, logits_scaling=4.0, output_router_logits=True,
                       router_aux_loss_coef=0.5),
    "phimoe": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW, output_router_logits=True,
                   router_aux_loss_coef=0.5),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=WINDOW, layer_types=MIXED,
                    output_router_logits=True, router_aux_loss_coef=0.5),
    "deepseek_v3": dict(num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=1, topk_group=1),
}


# a family with an optional feature off, tested beside the family as a case of its own (issue 53: a gemma2 config
# without attention soft-capping crashed: its transformers class has no SDPA path)
VARIANTS = {"gemma2 without soft-caps": ("gemma2", dict(attn_logit_softcapping=None, final_logit_softcapping=None)),
            # Falcon-40B's layout: grouped KV heads, two layer norms per block
            "falcon new decoder": ("falcon", dict(new_decoder_architecture=True, num_kv_heads=2)),
            # Pythia's sequential variant, GPT-NeoX's other block
            "gpt_neox sequential": ("gpt_neox", dict(use_parallel_residual=False)),
            # a mixture of experts as transformers fine-tunes it by default: no router loss in the training loss
            "qwen3_moe without router loss": ("qwen3_moe", dict(output_router_logits=False))}


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
