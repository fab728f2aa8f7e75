"""Tokens/s of real processes over shaped links, measured next to the planner's prediction.

The arms and the method live in the library (``thinpipe/commands/bench.py``, also ``thinpipe bench``); this
script is the benchmark's entry point and writes ``benchmarks/results/shaped_pipeline.json``.

    .venv/bin/python benchmarks/shaped_pipeline.py [--steps 120] [--pp-mbps 4] [--dp-mbps 4] [--only "Dense;M95"]
"""

import sys

from thinpipe.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
