"""What the frontier's codecs cost to encode and decode on this CPU, next to what they save on the link.

For each setting (experiments/frontier/run.py: ARMS) one boundary of SmolLM2-135M's hidden size
(576) codes a microbatch of 2 x 128 tokens both ways: the sender's ``encode`` + the receiver's
``decode`` for the activation, the receiver's ``encode_grad`` + the sender's ``decode_grad`` for its
gradient, on random data (the time does not depend on the values), modes interleaved, median of
``--repeats``. Reports microseconds per token per boundary (both ways together), the tokens/s one
CPU thread codes at, and the link time the setting saves per token at 200 Mbit/s against the bf16
Dense wire (2 x 576 x 2 B per token per boundary). Writes ``benchmarks/results/codec_cost.json``.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/codec_cost.py [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from thinpipe.boundary import build_boundaries
from thinpipe.config import Config, apply_overrides

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments" / "frontier"))
from run import ARMS  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "codec_cost.json"
HIDDEN, BATCH, SEQ, LINK_MBPS = 576, 2, 128, 200.0
SETTINGS = ["Dense", "Outlier 4b-1b tok", "LM 4b-1b tok", "LM 2b-1b tok", "LM 2b-1b tok T50", "LM 2b-1b tok T25"]


def boundary_of(arm: str):
    cfg = Config()
    apply_overrides(cfg, {k: v for k, v in ARMS[arm].items() if k.startswith("boundary.")} or
                    {"boundary.kind": "identity"}, source="codec_cost")
    b = build_boundaries(cfg.validate().boundary, 2, HIDDEN, 0, torch.bfloat16)[0]
    if b.wants_residual_init:
        b.load_init(b.init_from_residuals(torch.randn(512, HIDDEN)))
    return b


def one_round(b, x, g, ctx) -> tuple[float, int]:
    t0 = time.perf_counter()
    _, fwd = b.encode(x, ctx)
    b.decode(fwd, ctx)
    bwd = b.encode_grad(g, ctx)
    b.decode_grad(bwd, ctx)
    return time.perf_counter() - t0, fwd.nbytes + bwd.nbytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    torch.manual_seed(0)
    x, g = torch.randn(BATCH, SEQ, HIDDEN), torch.randn(BATCH, SEQ, HIDDEN)
    ctx = SimpleNamespace(input_ids=torch.zeros(BATCH, SEQ, dtype=torch.long))
    boundaries = {a: boundary_of(a) for a in SETTINGS}
    times = {a: [] for a in SETTINGS}
    sizes = {}
    for _ in range(args.repeats):
        for a, b in boundaries.items():
            dt, sizes[a] = one_round(b, x, g, ctx)
            times[a].append(dt)
    tokens = BATCH * SEQ
    link_s_per_byte = 8 / (LINK_MBPS * 1e6)
    dense = sizes["Dense"] / tokens
    rows = []
    print(f"{'setting':<20}{'B/tok/boundary':>15}{'us/tok':>9}{'ktok/s':>9}{'link us saved/tok':>19}")
    for a in SETTINGS:
        us = statistics.median(times[a]) / tokens * 1e6
        saved = (dense - sizes[a] / tokens) * link_s_per_byte * 1e6
        rows.append({"setting": a, "bytes_per_token_per_boundary": sizes[a] / tokens, "us_per_token": us,
                     "tokens_per_s": 1e6 / us, "link_us_saved_per_token": saved})
        print(f"{a:<20}{sizes[a] / tokens:>15.1f}{us:>9.2f}{1e6 / us / 1e3:>9.1f}{saved:>19.2f}")
    RESULTS.write_text(json.dumps({"hidden": HIDDEN, "tokens": tokens, "wire": "bfloat16", "link_mbps": LINK_MBPS,
                                   "threads": torch.get_num_threads(), "repeats": args.repeats, "rows": rows},
                                  indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
