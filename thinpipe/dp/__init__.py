"""Data-parallel synchronisation algorithms (math + explicit state; talk to a group only)."""

from thinpipe.dp.allreduce import AllReduceDP

__all__ = ["AllReduceDP"]
