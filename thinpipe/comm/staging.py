"""Host staging of what crosses the wire: the wire is gloo over TCP, which moves CPU tensors only.

What crosses a thin pipe is small next to what the link takes to carry it (a device-to-host copy
costs ~1 ms per 10 MB, the 200 Mbit/s link ~0.4 s for the same 10 MB), so a GPU rank stages each
payload tensor to pinned host memory before the send and moves what it receives to its device.
Message order, tags and headers are those of a CPU rank: nothing on the wire depends on the device.
On the CPU both functions return their argument (no copy), so the CPU path is unchanged.
"""

from __future__ import annotations

import torch

from thinpipe.comm.protocols import Work


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU (pinned, for the fast copy); ``t`` itself when it is there already."""
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.device.type == "cuda")
    host.copy_(t.detach())  # synchronous: the transport's sender thread may read it at once
    return host


def to_device(t: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """A received (host) tensor on the rank's device; unchanged for the CPU or ``device`` None."""
    if device is None or device.type == "cpu" or t.device == device:
        return t
    return t.to(device)


class StagedWork(Work):
    """A collective posted on a host copy: waiting copies the result back into the device tensor."""

    def __init__(self, work: Work, host: torch.Tensor, target: torch.Tensor):
        self.work, self.host, self.target = work, host, target

    def wait(self) -> None:
        self.work.wait()
        self.target.copy_(self.host)

    def is_completed(self) -> bool:
        return self.work.is_completed()
