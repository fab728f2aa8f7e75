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

    def validate(self) -> None:
        if not self.name:
            raise ConfigError("model.name is empty: give a preset (smollm2-135m, tiny-llama, tiny-qwen2) or a path")
        if self.tied not in ("sync", "untie"):
            raise ConfigError(f"model.tied must be sync or untie, got {self.tied!r}")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    name: str = "math"
    """Training corpus from the registry: ``math``, ``medical`` or ``synthetic``."""
    max_examples: int = 0
    """Read at most this many training examples (0 = all); for quick runs."""
    val_rows: int = 16
    """Packed held-out rows used for validation loss (0 = the whole held-out split)."""

    def validate(self) -> None:
        if self.max_examples < 0:
            raise ConfigError(f"data.max_examples must be >= 0 (0 = all), got {self.max_examples}")
        if self.val_rows < 0:
            raise ConfigError(f"data.val_rows must be >= 0 (0 = all), got {self.val_rows}")
