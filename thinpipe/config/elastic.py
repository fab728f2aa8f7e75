"""How a job with elastic replicas (``thinpipe launch --elastic``, torchft) forms and keeps its quorum: ``[elastic]``.

Read only by the elastic engine (``engine/elastic_rank.py``) and its launcher; an ordinary run ignores it.
"""

from __future__ import annotations

from dataclasses import dataclass

from thinpipe.config.errors import ConfigError


@dataclass(kw_only=True, slots=True)
class ElasticConfig:
    min_replicas: int = 1
    """A step commits only when at least this many replicas took part in it (torchft's
    ``min_replica_size``); with fewer the survivors wait for a replica to (re)join."""
    start_timeout_s: float = 120.0
    """At step 0 of a new job every replica of ``mesh.dp`` is waited for this long (so a job with no
    failure averages over all of them from its first step, as ``--engine dist`` does); after it the
    job starts with those present and the late ones join by recovery."""
    join_timeout_s: float = 30.0
    """The lighthouse waits this long for a replica that is alive (heartbeating) but late to a step
    before it forms a quorum without it (torchft's ``join_timeout_ms``)."""
    heartbeat_timeout_s: float = 5.0
    """A replica whose heartbeat the lighthouse has not heard for this long is gone: the next quorum
    is formed without it."""
    timeout_s: float = 10.0
    """A collective among replicas (a DP all-reduce) that takes longer has failed: the step is not
    committed, rolled back and retried with the replicas still present. Larger than a step's longest
    DP sync on the slowest link."""
    quorum_timeout_s: float = 600.0
    """How long a replica waits for a quorum (for peers to arrive) before it gives up with an error."""

    def validate(self) -> None:
        if self.min_replicas < 1:
            raise ConfigError(f"elastic.min_replicas must be >= 1, got {self.min_replicas}")
        for name in ("start_timeout_s", "join_timeout_s", "heartbeat_timeout_s", "timeout_s", "quorum_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"elastic.{name} must be > 0 seconds, got {getattr(self, name)}")
