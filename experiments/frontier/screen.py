"""The probe's screen of candidate settings on the frontier recipe, before any is trained.

``thinpipe probe``'s measurement (forward damage at the pretrained weights, the gradient's cosine with
the clean one, metered bytes) over the outlier settings that could reach the milestone (<= 691
B/token) or the goal (<= 345), next to the best trained arm before the new codecs (``Outlier 4b-1b tok``; README.md).

    .venv/bin/python experiments/frontier/screen.py [--batches 2]   # -> results/screen.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from thinpipe.commands.probe_lib import format_table, probe
from thinpipe.config import Config, apply_overrides
from thinpipe.provenance import code_stamp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import ARMS, FRONTIER_BASE  # noqa: E402

PROBE_KEYS = ("model.", "data.", "mesh.pp", "train.batch_size", "train.seq_len", "model.tied")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=2)
    ap.add_argument("--only", default="", help="comma-separated arm names (default: every outlier arm)")
    ap.add_argument("--boundaries", default="", help="compress only these boundaries, e.g. 0 (per-boundary damage)")
    ap.add_argument("--out", default="experiments/frontier/results/screen.json")
    args = ap.parse_args()
    cfg = Config()
    apply_overrides(cfg, {k: v for k, v in FRONTIER_BASE.items() if k.startswith(PROBE_KEYS)})
    cfg.validate()
    names = [a.strip() for a in args.only.split(",") if a.strip()] or [a for a, s in ARMS.items()
                                                                        if s.get("boundary.kind") in ("outlier", "klt")]
    grid = [("dense", {"boundary.kind": "identity"})] + [(a, ARMS[a]) for a in names]
    only = [int(b) for b in args.boundaries.split(",") if b.strip()] or None
    result = probe(cfg, grid, args.batches, only)
    Path(args.out).write_text(json.dumps({**result, **code_stamp()}, indent=2))
    print(format_table(result))


if __name__ == "__main__":
    main()
