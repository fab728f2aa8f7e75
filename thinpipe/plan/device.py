"""Device profiles for the planner: vendor presets, and ``cpu``, measured on this machine.

A profile is the compute rate the closed form divides 6 N S FLOPs by (App. J.1). For the GPU presets
that is the data-sheet bf16 dense peak x an assumed MFU of 0.5 (the paper's App. J). For ``cpu``
nothing is assumed: one decoder layer of the planned architecture (transformers' own Llama layer,
random weights) runs forward + backward on ``MEASURE_TOKENS`` tokens with this process's torch
threads, and the achieved rate 6 x (layer parameters) x tokens / time is the profile (MFU 1: the
measurement already includes everything the layer wastes). The result is cached per architecture,
dtype, thread count and CPU in ``~/.cache/thinpipe/device_profiles.json``, since it takes seconds.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass

from thinpipe.config import ConfigError

MEASURE_TOKENS = 256
MEASURE_REPEATS = 3


@dataclass(frozen=True)
class Device:
    peak_flops: float
    """Compute rate, FLOP/s: a data sheet's bf16 dense peak, or the rate measured here."""
    mfu: float = 0.5
    """Model FLOPs utilisation assumed (the paper's App. J: ~50%); 1 for a measured profile."""
    source: str = "vendor data sheet, MFU assumed 0.5 (App. J)"


DEVICES = {
    "a100-40gb": Device(312e12),
    "h100": Device(989e12),
    "rtx-4090": Device(165e12),
}
MEASURED = ("cpu",)


def device_names() -> list[str]:
    return sorted(DEVICES) + list(MEASURED)


def measure_cpu(arch, dtype: str = "float32", remeasure: bool = False) -> Device:
    """This CPU's rate on one decoder layer of ``arch`` (a ``planner.Architecture``); cached
    unless ``remeasure`` (measure on an otherwise idle machine: other load lowers the rate)."""
    import torch  # only when measuring: `thinpipe plan` on a data-sheet device starts without torch

    from thinpipe.models.loading import cache_root

    key = (f"{arch.layers}x{arch.hidden}x{arch.intermediate}x{arch.heads}x{arch.kv_heads}|{dtype}|"
           f"threads={torch.get_num_threads()}|{platform.processor() or platform.machine()}|torch={torch.__version__}")
    path = cache_root() / "device_profiles.json"
    cached = json.loads(path.read_text()) if path.is_file() else {}
    if key in cached and not remeasure:
        return Device(**cached[key])
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=arch.hidden, intermediate_size=arch.intermediate,
                         num_attention_heads=arch.heads, num_key_value_heads=arch.kv_heads, num_hidden_layers=1,
                         vocab_size=arch.vocab, max_position_embeddings=MEASURE_TOKENS)
    config._attn_implementation = "sdpa"
    layer = LlamaDecoderLayer(config, 0)
    rope = LlamaRotaryEmbedding(config)
    params = sum(p.numel() for p in layer.parameters())
    x = torch.randn(1, MEASURE_TOKENS, arch.hidden, requires_grad=True)
    pos = torch.arange(MEASURE_TOKENS)[None]
    cast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16")

    def step() -> None:
        with cast:
            out = layer(x, position_embeddings=rope(x, pos), position_ids=pos)
        out = out[0] if isinstance(out, tuple) else out
        out.float().sum().backward()

    step()  # warm-up: allocation, kernel selection
    times = []
    for _ in range(MEASURE_REPEATS):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    rate = 6 * params * MEASURE_TOKENS / min(times)
    device = Device(rate, 1.0, f"measured: one {arch.hidden}-wide decoder layer, {MEASURE_TOKENS} tokens, {dtype}, "
                                f"{torch.get_num_threads()} threads, best of {MEASURE_REPEATS}")
    cached[key] = asdict(device)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cached, indent=2))
    tmp.replace(path)
    return device


def resolve_device(name: str, arch, dtype: str, remeasure: bool = False) -> Device:
    if name in DEVICES:
        return DEVICES[name]
    if name == "cpu":
        return measure_cpu(arch, dtype, remeasure)
    raise ConfigError(f"unknown device {name!r}: choose one of {', '.join(device_names())}")
