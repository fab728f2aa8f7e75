"""Tiny tokenizers (and model folders) of three chat families, built locally (no hub): Llama-3,
Qwen2 and Mistral, each with its family's special tokens and published chat template."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
QWEN2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == "
    "'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant roles are "
    "supported!') }}{% endif %}{% endfor %}")

FAMILIES = {
    # family: (special tokens, bos, eos, pad, chat template, BOS added by encode, end of an assistant turn)
    "llama3": (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
               "<|begin_of_text|>", "<|eot_id|>", "<|end_of_text|>", LLAMA3_TEMPLATE, True, "<|eot_id|>"),
    "qwen2": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>", "<|endoftext|>", QWEN2_TEMPLATE,
              False, "<|im_end|>\n"),
    "mistral": (["<unk>", "<s>", "</s>"], "<s>", "</s>", None, MISTRAL_TEMPLATE, True, "</s>"),
}
CORPUS = ["The quick brown fox jumps over the lazy dog.", "What is 2+2? It is 4.", "Solve for x: x + 3 = 5.",
          "[INST] Hello there [/INST] Hi! How can I help you today?", "system user assistant helpful"] * 20


def tokenizer(family: str) -> PreTrainedTokenizerFast:
    specials, bos, eos, pad, template, adds_bos, _ = FAMILIES[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if adds_bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    kw = {k: v for k, v in {"bos_token": bos, "eos_token": eos, "pad_token": pad}.items() if v}
    t = PreTrainedTokenizerFast(tokenizer_object=tok, **kw)
    t.chat_template = template
    return t


def model_folder(family: str, path: Path) -> Path:
    """A Hugging Face folder: this family's tiny tokenizer and a tiny random model of its architecture."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

    tok = tokenizer(family)
    cls = {"llama3": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[family]
    cfg = cls(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
              bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    tok.save_pretrained(path)
    return path
