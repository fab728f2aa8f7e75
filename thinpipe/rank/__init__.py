"""One rank, with no transport of its own (docs/architecture.md: layers).

What a process of the mesh computes for its (replica, stage), written once for the simulation and a real rank:
the microbatch context every stage derives from the shared batch (``context.py``), pipeline schedules as data and
their one executor (``schedule.py``), the stage worker that runs a stage between its two boundaries
(``worker.py``), the stage rank and its step phases (``stage_rank.py``), passes through a pipeline (the held-out
loss, residuals: ``passes.py``), one rank's part of a decode pass (``generation.py``) and what every engine derives
from a config (``from_config.py``). Objectives (``objective/``) and engines (``engine/``) sit above it.
"""
