"""The runners (docs/architecture.md: one run loop, two engines).

The one run loop (``loop.py``) over an ``Engine``: the simulated mesh in one process (``sim_mesh.py``,
``sim_engine.py``), a rank of the real mesh on torch.distributed (``dist_setup.py``, ``dist_engine.py``) and a
rank of an elastic replica on torchft (``elastic_setup.py``, ``elastic_rank.py``). Each engine has one ``Pipe``
(``sim_pipe.py``, ``dist_pipe.py``): the one place it assembles an update for every objective (``objective/``),
and a generation driver (``sim_generate.py``, ``dist_generate.py``). The simulation's gradient diagnostic
(``sim_diagnostics.py``) and run folders (``run_folder.py``) live here too.
"""
