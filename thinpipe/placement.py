"""Where a rank computes, and in which precision: the one place that resolves ``train.device`` and
``train.dtype`` and moves a batch (docs/gpu.md).

Placement rules (docs/gpu.md):
  ``cpu``            every stage on the CPU (the path every test runs; bitwise what it always was).
  ``cuda``           a dist rank on ``cuda:(LOCAL_RANK mod device_count)``, so that ``torchrun
                     --nproc-per-node G`` on a machine with G GPUs gives each process its own GPU; the
                     simulation on ``cuda:0``.
  ``cuda:N``         that GPU, for every process of this machine.
  ``auto``           ``cuda`` when CUDA is available, else ``cpu``.
The simulation holds both ends of a boundary (and every replica's copy of its state) in one
object, so it computes on one device; several GPUs of one machine are used by the dist engine
(one process per stage and replica).

Precision: ``train.dtype = auto`` is bf16 autocast on CUDA (fp32 master weights, fp32 loss and
optimizer; what GPU trainers of this size run: tensor cores, half the activation memory and, through
``boundary.dtype = auto``, half the PP bytes) and fp32 on the CPU (CPU bf16 autocast is slower than
fp32 on most CPUs, and the CPU path stays bitwise what it was). Autocast always follows the
device's type: ``torch.autocast("cpu")`` around CUDA tensors would silently run fp32.
"""

from __future__ import annotations

import contextlib
import os

import torch

from thinpipe.config import ConfigError
from thinpipe.config.env import env_int

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(spec: str, local_rank: int | None = None) -> torch.device:
    """``train.device`` -> the torch device this process computes on (see the module docstring);
    ``local_rank``: this process's index on its machine (dist), None in the simulation."""
    n = cuda_count()
    if spec == "auto":
        spec = "cuda" if n else "cpu"
    if spec == "cpu":
        return torch.device("cpu")
    if not n:
        raise ConfigError(f"train.device = {spec} but CUDA is not available here (torch {torch.__version__}, "
                          f"cuda {torch.version.cuda}): use train.device=cpu or auto, or install a CUDA torch wheel")
    if spec == "cuda":
        return torch.device("cuda", (local_rank or 0) % n)
    index = int(spec.split(":", 1)[1])
    if index >= n:
        raise ConfigError(f"train.device = {spec} but this machine has {n} CUDA device(s): use cuda:0..cuda:{n - 1}")
    return torch.device("cuda", index)


def local_rank() -> int:
    """This process's index on its machine (torchrun's LOCAL_RANK), 0 outside torchrun."""
    return env_int("LOCAL_RANK", 0, 0, 1 << 16)


def compute_dtype_name(dtype: str, device: torch.device) -> str:
    """``train.dtype`` resolved on ``device``: ``auto`` is bf16 on CUDA, fp32 elsewhere."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device.type == "cuda" else "float32"


def autocast(device: torch.device, dtype: torch.dtype):
    """Mixed precision for a stage's compute, following the device's type (nothing for fp32)."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def device_of(module: torch.nn.Module) -> torch.device:
    """The device a module computes on (its first parameter's or buffer's; the CPU for an empty one)."""
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return torch.device("cpu")


def move(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``module.to(device)`` for every tensor that holds data; meta tensors stay where they are. A dist
    rank's boundaries reference modules of the neighbouring stage, which on that rank is a placeholder
    without weights (``models/stage_loading.py``): those are never computed with here."""
    return module._apply(lambda t: t if t.is_meta else t.to(device))


def to_device(batch: dict, device: torch.device) -> dict:
    """A batch of tensors on ``device`` (the same dict back on the CPU: no copy)."""
    if device.type == "cpu":
        return batch
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def use_deterministic(on: bool, device: torch.device) -> None:
    """``train.deterministic``: CUDA kernels without a deterministic implementation raise instead of
    running (index_add / scatter_add backward, some SDPA backward kernels); cuBLAS needs its
    workspace fixed. The CPU kernels thinpipe uses are deterministic already, so nothing changes there."""
    if not on or device.type != "cuda":
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
