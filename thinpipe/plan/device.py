"""Device profiles for the planner: vendor presets, and ``cpu`` / ``cuda``, measured on this machine.

A profile is the compute rate the closed form divides 6 N S FLOPs by (App. J.1). For the GPU presets
that is the data-sheet bf16 dense peak x an assumed MFU of 0.5 (the paper's App. J). For ``cpu`` and
``cuda`` nothing is assumed: one decoder layer of the planned architecture (transformers' own Llama
layer, random weights) runs forward + backward on this machine's CPU (this process's torch threads)
or current CUDA GPU, and the achieved rate 6 x (layer parameters) x tokens / time is the profile
(MFU 1: the measurement already includes everything the layer wastes). The result is cached per
architecture, dtype, token count and processor (CPU: its name and thread count; GPU: its name) and
torch version in ``~/.cache/thinpipe/device_profiles.json``, since it takes seconds.

The CPU measures one 256-token sequence, as it always has. A GPU measures 8 x 1024 tokens: at 256
tokens one SmolLM2 layer is a few microseconds of tensor-core work and the time would be kernel
launches alone, far from what a training step (thousands of tokens per microbatch) achieves.

torch is imported only when measuring: ``thinpipe plan`` on a data-sheet device starts without it.
"""

from __future__ import annotations

import json
import platform
import re
import time
from dataclasses import asdict, dataclass

from thinpipe.config import ConfigError

MEASURE_TOKENS = 256            # CPU: one sequence of this many tokens
MEASURE_REPEATS = 3             # best of this many timed windows
CUDA_SHAPE = (8, 1024)          # GPU: (sequences, tokens each) per forward + backward
CUDA_STEPS_PER_WINDOW = 10      # GPU: steps between two synchronisations (one step is ~1 ms: too short to time alone)


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
MEASURED = ("cpu", "cuda")


def device_names() -> list[str]:
    return sorted(DEVICES) + list(MEASURED)


def _cache_key(arch, dtype: str, device, batch: int, tokens: int) -> str:
    """What a measured rate depends on: the layer's shape, precision, the token count, the
    processor and torch (a new torch can pick other kernels)."""
    import torch

    if device.type == "cuda":
        where = f"gpu={torch.cuda.get_device_name(device)}|cuda={torch.version.cuda}"
    else:
        where = f"threads={torch.get_num_threads()}|{platform.processor() or platform.machine()}"
    # the CPU's default shape keeps the key it had before shapes were part of it (profiles cached then stay valid)
    shape = "" if device.type == "cpu" and (batch, tokens) == (1, MEASURE_TOKENS) else f"|tokens={batch}x{tokens}"
    return (f"{arch.layers}x{arch.hidden}x{arch.intermediate}x{arch.heads}x{arch.kv_heads}|{dtype}|"
            f"{where}|torch={torch.__version__}{shape}")


def measure(device, arch, dtype: str = "float32", remeasure: bool = False, shape: tuple[int, int] | None = None,
            steps_per_window: int = 1) -> Device:
    """This machine's rate on one decoder layer of ``arch`` (a ``planner.Architecture``) on the
    torch ``device`` (CPU or CUDA), forward + backward on ``shape`` = (sequences, tokens) in ``dtype``
    (bf16: autocast of the device's type, fp32 weights, as training runs); cached unless
    ``remeasure`` (measure on an otherwise idle machine: other load lowers the rate).

    The two devices differ only in where tensors live, the autocast's device type and the
    synchronisation around each timed window (CUDA kernels run asynchronously: without it the
    clock would stop when the kernels are queued, not done)."""
    import torch  # only when measuring: `thinpipe plan` on a data-sheet device starts without torch

    from thinpipe.models.loading import cache_root

    batch, tokens = shape or ((1, MEASURE_TOKENS) if device.type == "cpu" else CUDA_SHAPE)
    key = _cache_key(arch, dtype, device, batch, tokens)
    path = cache_root() / "device_profiles.json"
    cached = json.loads(path.read_text()) if path.is_file() else {}
    if key in cached and not remeasure:
        return Device(**cached[key])
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=arch.hidden, intermediate_size=arch.intermediate,
                         num_attention_heads=arch.heads, num_key_value_heads=arch.kv_heads, num_hidden_layers=1,
                         vocab_size=arch.vocab, max_position_embeddings=tokens)
    config._attn_implementation = "sdpa"
    layer = LlamaDecoderLayer(config, 0).to(device)
    rope = LlamaRotaryEmbedding(config).to(device)
    params = sum(p.numel() for p in layer.parameters())
    x = torch.randn(batch, tokens, arch.hidden, device=device, requires_grad=True)
    pos = torch.arange(tokens, device=device)[None].expand(batch, tokens)
    cast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bfloat16")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step() -> None:
        with cast:
            out = layer(x, position_embeddings=rope(x, pos), position_ids=pos)
        out = out[0] if isinstance(out, tuple) else out
        out.float().sum().backward()

    for _ in range(steps_per_window):  # warm-up: allocation, kernel selection (cuBLAS heuristics, SDPA backend)
        step()
    sync()
    times = []
    for _ in range(MEASURE_REPEATS):
        t0 = time.perf_counter()
        for _ in range(steps_per_window):
            step()
        sync()
        times.append((time.perf_counter() - t0) / steps_per_window)
    rate = 6 * params * batch * tokens / min(times)
    if device.type == "cuda":
        where = f"on {torch.cuda.get_device_name(device)}, {batch}x{tokens} tokens"
    else:
        where = f"{batch * tokens} tokens, {torch.get_num_threads()} threads"
    result = Device(rate, 1.0, f"measured: one {arch.hidden}-wide decoder layer, {where}, {dtype}, "
                               f"best of {MEASURE_REPEATS}")
    cached[key] = asdict(result)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cached, indent=2))
    tmp.replace(path)
    return result


def measure_cpu(arch, dtype: str = "float32", remeasure: bool = False) -> Device:
    """This CPU's rate on one decoder layer of ``arch`` (see ``measure``)."""
    import torch

    return measure(torch.device("cpu"), arch, dtype, remeasure)


def measure_cuda(name: str, arch, dtype: str = "bfloat16", remeasure: bool = False) -> Device:
    """``name`` (``cuda`` or ``cuda:N``)'s rate on one decoder layer of ``arch`` (see ``measure``);
    a one-line ConfigError where this machine has no such GPU."""
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(name.split(":", 1)[1]) if ":" in name else None
    if not n:
        raise ConfigError(f"--device {name} needs a CUDA GPU here (torch {torch.__version__}, cuda "
                          f"{torch.version.cuda}, no GPU visible); use a data-sheet device: "
                          f"{', '.join(sorted(DEVICES))}")
    if index is not None and index >= n:
        raise ConfigError(f"--device {name}: this machine has {n} CUDA device(s): use cuda:0..cuda:{n - 1}")
    device = torch.device("cuda", torch.cuda.current_device() if index is None else index)
    return measure(device, arch, dtype, remeasure, steps_per_window=CUDA_STEPS_PER_WINDOW)


def resolve_device(name: str, arch, dtype: str, remeasure: bool = False) -> Device:
    if name in DEVICES:
        return DEVICES[name]
    if name == "cpu":
        return measure_cpu(arch, dtype, remeasure)
    if re.fullmatch(r"cuda(:\d+)?", name):
        return measure_cuda(name, arch, dtype, remeasure)
    raise ConfigError(f"unknown device {name!r}: choose one of {', '.join(device_names())}")
