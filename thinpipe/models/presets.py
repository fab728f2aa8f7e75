"""Built-in model presets.

``tiny-*`` presets are random-init models for tests (vocab 512, hidden 64, 4 layers) that pair with
the byte-level tokenizer. ``small-llama`` (hidden 128, 8 layers, 1.7 M parameters, same tokenizer)
is the from-scratch pretraining model of the MAPL experiments: the largest that trains hundreds of
steps per arm in minutes on two CPU cores. ``tiny-llama`` unties its embeddings, ``tiny-qwen2`` ties them (as
Qwen2-0.5B does) so that both weight layouts are exercised by the equivalence tests.
"""

from __future__ import annotations

from transformers import LlamaConfig, Qwen2Config

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
    raise ValueError(family)


PRESETS = ("smollm2-135m", "tiny-llama", "tiny-qwen2", "small-llama")
