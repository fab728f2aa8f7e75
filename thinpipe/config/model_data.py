"""What is trained on what: the ``[model]`` and ``[data]`` sections."""

from __future__ import annotations

from dataclasses import dataclass

from thinpipe.config.errors import ConfigError


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    name: str = "smollm2-135m"
    """Model: a preset (``smollm2-135m``, ``tiny-llama``, ``tiny-qwen2``), a folder with a Hugging
    Face ``config.json`` + safetensors, or a ``.gguf`` file."""

    tied: str = "sync"
    """Tied input/output embeddings split over stages: ``sync`` sums the two copies' gradients every
    step (exact; costs V x H values each way on the ``tied`` axis), ``untie`` lets them drift apart."""

    tokenizer: str = ""
    """The tokenizer of a scale preset (``llama-150m``, ``llama-500m``, ``llama-1b``): empty = the 32k byte-level
    BPE trained on the built-in corpora (``data/bpe_tokenizer.py``, cached); or a Hugging Face tokenizer folder or
    a ``tokenizer.json`` (the embedding grows to its vocabulary when that exceeds 32,000). Other models bring
    their own."""

    attention: str = "packed"
    """How packed documents attend: ``packed`` (each document's causal attention by the fused kernels, no T x T mask:
    ``models/packed_attention.py``) or ``mask`` (a dense (B, 1, T, T) boolean mask, the path before issue 51, for
    comparison). Families whose attention needs eager (Gemma 2's soft-cap) take the mask either way."""

    init_from: str = ""
    """Where this run's starting weights came from (``train --init-from``: a run folder or a Hugging
    Face folder; weights only, fresh optimizer and schedule). Recorded for the record: ``name``
    then points at the weights' folder (a run folder's are exported into ``OUT/init``)."""

    def validate(self) -> None:
        if not self.name:
            raise ConfigError("model.name is empty: give a preset (smollm2-135m, tiny-llama, tiny-qwen2) or a path")
        if self.tokenizer and not self.name.startswith("llama-"):
            raise ConfigError(f"model.tokenizer = {self.tokenizer!r} applies to the random scale presets (llama-150m, "
                              f"llama-500m, llama-1b); model {self.name!r} brings its own tokenizer: unset it")
        if self.attention not in ("packed", "mask"):
            raise ConfigError(f"model.attention must be packed or mask, got {self.attention!r}")
        if self.tied not in ("sync", "untie"):
            raise ConfigError(f"model.tied must be sync or untie, got {self.tied!r}")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    name: str = "math"
    """Training data: a built-in corpus (``math``, ``medical``, ``synthetic``) or a path to a user's
    files: a ``.jsonl`` or ``.parquet`` file or a folder of them, with rows ``{"messages": [...]}``
    (chat, loss on assistant turns), ``{"prompt", "response"}`` or ``{"text"}`` (continual
    pretraining, loss on every token); docs/data.md."""
    max_examples: int = 0
    """Read at most this many training examples (0 = all); for quick runs. A user's files: the first rows."""
    val_rows: int = 16
    """Packed held-out rows used for validation loss (0 = the whole held-out split)."""
    val_name: str = ""
    """A user's files: held-out rows from this file or folder (same formats); empty = ``val_fraction``."""
    val_fraction: float = 0.05
    """A user's files without ``val_name``: each row is held out with this probability (a fixed
    per-row coin: the same rows for every run and seed). Ignored for built-in corpora (fixed splits)."""
    chat_format: str = "auto"
    """How chat rows become tokens: ``template`` (the tokenizer's own chat template), ``chatml``
    (ChatML markers, no injected system prompt), ``none`` (no markers), ``auto`` (the template,
    except for ChatML models and tokenizers without one: chatml); docs/data.md."""
    skip_bad_rows: bool = False
    """A malformed row of a user's file is an error naming the file and line; true leaves such rows
    out instead, counted and listed (the run prints how many)."""

    def validate(self) -> None:
        if not self.name:
            raise ConfigError("data.name is empty: give a corpus (math, medical, synthetic) or a .jsonl/.parquet path")
        if self.chat_format not in ("auto", "template", "chatml", "none"):
            raise ConfigError(f"data.chat_format must be auto, template, chatml or none, got {self.chat_format!r}")
        if not 0 <= self.val_fraction < 1:
            raise ConfigError(f"data.val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.max_examples < 0:
            raise ConfigError(f"data.max_examples must be >= 0 (0 = all), got {self.max_examples}")
        if self.val_rows < 0:
            raise ConfigError(f"data.val_rows must be >= 0 (0 = all), got {self.val_rows}")
