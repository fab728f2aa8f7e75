"""How point-to-point payloads cross a real link: ``[wire]`` (docs/security.md).

Every payload of the dist and elastic engines is authenticated with the job key whatever this
says; the in-process simulation has no wire and ignores the section.
"""

from __future__ import annotations

from dataclasses import dataclass

from thinpipe.config.errors import ConfigError


@dataclass(kw_only=True, slots=True)
class WireConfig:
    encrypt: bool = False
    """Seal every point-to-point payload (activations, gradients, shared parameters, anchor pulls
    and pushes) with ChaCha20-Poly1305 under a key derived from the job key, so a link's traffic
    cannot be read. Without it payloads are authenticated (HMAC-SHA256) but readable. The run is
    bitwise the same either way; the cost per MB is in docs/security.md."""

    def validate(self) -> None:
        if not isinstance(self.encrypt, bool):
            raise ConfigError(f"wire.encrypt must be true or false, got {self.encrypt!r}")
