"""Data-parallel synchronisation of a stage's replicas (docs/dp.md): one ``DPScheme`` class per ``dp.kind``
(``scheme.py``; built by ``registry.py``; described without torch in ``kinds.py``) over plain algorithms with
explicit state that talk to a group only (``allreduce.py``, ``powersgd.py``, ``diloco.py``, ``streaming.py``:
generators over one rank's tensors that yield the ``Work`` of every collective they post).

This package's own module imports nothing heavy: the planner reads ``kinds.py`` without loading torch.
"""
