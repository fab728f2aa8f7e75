"""Built-in model presets.

``tiny-*`` presets are random-init models for tests (vocab 512, hidden 64, 4 layers) that pair with
the byte-level tokenizer. ``small-llama`` (hidden 128, 8 layers, 1.7 M parameters, same tokenizer)
is the from-scratch pretraining model of the MAPL experiments: the largest that trains hundreds of
steps per arm in minutes on two CPU cores. ``tiny-llama`` unties its embeddings, ``tiny-qwen2`` ties them (as
Qwen2-0.5B does) so that both weight layouts are exercised by the equivalence tests; ``tiny-mixtral`` is a mixture
of experts (4 experts, 2 per token) trained with its router loss (``output_router_logits``, coefficient 0.02).

``llama-150m``, ``llama-500m``, ``llama-1b`` are the MAPL paper's model scales (App. E.1: LLaMA-2 architecture,
context 2048, vocabulary 32,000, untied embeddings), random init, each parameter drawn from a generator of its
own (``models/scale_init.py``), so that a rank builds its own stage alone and every split draws the same weights.
They use a 32k byte-level BPE trained on the built-in corpora (``data/bpe_tokenizer.py``), or a user's tokenizer
(``model.tokenizer``).
"""

from __future__ import annotations

from transformers import LlamaConfig, MixtralConfig, Qwen2Config

DEFAULT_MODEL = "smollm2-135m"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def tiny_config(family: str):
    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if family == "small":
        common.update(hidden_size=128, intermediate_size=384, num_hidden_layers=8)
        return LlamaConfig(tie_word_embeddings=False, **common)
    if family == "llama":
        return LlamaConfig(tie_word_embeddings=False, **common)
    if family == "qwen2":
        return Qwen2Config(tie_word_embeddings=True, **common)
    if family == "mixtral":
        return MixtralConfig(tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2,
                             output_router_logits=True, router_aux_loss_coef=0.02, **common)
    raise ValueError(family)


# App. E.1's scales: (d_model, n_layers, n_heads, d_ffn)
SCALES = {"llama-150m": (1024, 9, 8, 2688), "llama-500m": (1536, 18, 12, 4096), "llama-1b": (2048, 20, 16, 5440)}
SCALE_VOCAB = 32_000
SCALE_CONTEXT = 2048


def scale_config(name: str, vocab_size: int = SCALE_VOCAB) -> LlamaConfig:
    """The LLaMA-2 shape of scale preset ``name`` (multi-head attention: as many key/value heads as heads)."""
    hidden, layers, heads, ffn = SCALES[name]
    return LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=SCALE_CONTEXT,
                       rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.02)


PRESETS = ("smollm2-135m", "tiny-llama", "tiny-qwen2", "tiny-mixtral", "small-llama", *SCALES)
