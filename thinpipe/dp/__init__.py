"""Data-parallel synchronisation algorithms (math + explicit state; talk to a group only).

Each is a generator over one rank's tensors that yields the ``Work`` of every collective it posts.
"""

from thinpipe.dp.allreduce import allreduce_average
from thinpipe.dp.diloco import DiLoCoState, outer_step
from thinpipe.dp.powersgd import PowerSGDState, powersgd_average

__all__ = ["DiLoCoState", "PowerSGDState", "allreduce_average", "outer_step", "powersgd_average"]
