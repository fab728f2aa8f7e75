"""What the frontier's codecs cost to encode and decode on this CPU, next to what they save on the link.

For each setting (experiments/frontier/run.py: ARMS) one boundary of SmolLM2-135M's hidden size
(576) codes a microbatch of 2 x 128 tokens both ways: the sender's ``encode`` + the receiver's
``decode`` for the activation, the receiver's ``encode_grad`` + the sender's ``decode_grad`` for its
gradient, on random data (the time does not depend on the values; the ``klt`` kind's basis is fitted
on Gaussian data with a decaying spectrum, and half of the tokens are scored), modes interleaved,
median of ``--repeats``. Reports microseconds per token per boundary each way and both together, the
tokens/s one CPU thread codes at, and the link time the setting saves per token at 200 Mbit/s against
the bf16 Dense wire (2 x 576 x 2 B per token per boundary). Also: today's Hadamard butterfly
(``tahquant.hadamard``) against the same transform as one matmul, and whether the matmul gives the
same Lloyd-Max codes bitwise (issue 36, item 6). Writes ``benchmarks/results/codec_cost.json``.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/codec_cost.py [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from thinpipe.boundary import build_boundaries
from thinpipe.boundary.lloyd_max import quantize_rms
from thinpipe.boundary.tahquant import hadamard_butterfly
from thinpipe.config import Config, apply_overrides
from thinpipe.provenance import code_stamp
from thinpipe.rank.context import make_contexts

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments" / "frontier"))
from run import ARMS  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "codec_cost.json"
HIDDEN, BATCH, SEQ, LINK_MBPS = 576, 2, 128, 200.0
SETTINGS = ["Dense", "Outlier 4b-1b tok", "LM 4b-1b tok", "LM 2b-1b tok", "LM 2b-1b tok T50", "LM 2b-1b tok T25",
            "KLT 3-1b-1b T50", "KLTw 3-1b-1b T50", "KLTw 3-1b-1b T75"]


def boundary_of(arm: str):
    cfg = Config()
    apply_overrides(cfg, {k: v for k, v in ARMS[arm].items() if k.startswith("boundary.")} or
                    {"boundary.kind": "identity"}, source="codec_cost")
    b = build_boundaries(cfg.validate().boundary, 2, HIDDEN, 0, torch.bfloat16)[0]
    if b.wants_residual_init:
        spectrum = torch.logspace(0, -3, HIDDEN).sqrt()
        b.load_init(b.init_from_residuals(torch.randn(4096, HIDDEN) * spectrum))
    return b


def one_round(b, x, g, ctx) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    _, fwd = b.encode(x, ctx)
    b.decode(fwd, ctx)
    t1 = time.perf_counter()
    bwd = b.encode_grad(g, ctx)
    b.decode_grad(bwd, ctx)
    return t1 - t0, time.perf_counter() - t1, fwd.nbytes + bwd.nbytes


def hadamard_as_matmul(x: torch.Tensor, repeats: int) -> dict:
    """The outlier kind's rotation (64-dim tiles) as the butterfly and as one matmul (what ``hadamard`` is
    now): time, and whether the 4-bit and 1-bit Lloyd-Max codes of both are equal bitwise."""
    tiles = x.reshape(-1, 64)
    h = hadamard_butterfly(torch.eye(64))  # H / sqrt(64), symmetric: the butterfly applied to the identity
    times = {"butterfly": [], "matmul": []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        a = hadamard_butterfly(tiles)
        t1 = time.perf_counter()
        b = tiles @ h
        times["butterfly"].append(t1 - t0)
        times["matmul"].append(time.perf_counter() - t1)
    same = {bits: bool(torch.equal(quantize_rms(a.reshape(-1, HIDDEN), bits, HIDDEN)[0],
                                   quantize_rms(b.reshape(-1, HIDDEN), bits, HIDDEN)[0])) for bits in (1, 4)}
    return {"butterfly_us_per_token": statistics.median(times["butterfly"]) / x.shape[0] * 1e6,
            "matmul_us_per_token": statistics.median(times["matmul"]) / x.shape[0] * 1e6,
            "max_abs_difference": float((a - b).abs().max()), "codes_equal_bitwise": same}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    torch.manual_seed(0)
    x, g = torch.randn(BATCH, SEQ, HIDDEN), torch.randn(BATCH, SEQ, HIDDEN)
    labels = torch.full((BATCH, SEQ), -100)
    labels[:, SEQ // 2:] = 1  # half of the tokens scored (the klt kind's loss tokens)
    ctx = make_contexts({"input_ids": torch.zeros(BATCH, SEQ, dtype=torch.long), "labels": labels,
                         "segment_ids": torch.zeros(BATCH, SEQ, dtype=torch.long)}, 1, 0, 0)[0]
    boundaries = {a: boundary_of(a) for a in SETTINGS}
    times = {a: ([], []) for a in SETTINGS}
    sizes = {}
    for _ in range(args.repeats):
        for a, b in boundaries.items():
            f, w, sizes[a] = one_round(b, x, g, ctx)
            times[a][0].append(f)
            times[a][1].append(w)
    tokens = BATCH * SEQ
    link_s_per_byte = 8 / (LINK_MBPS * 1e6)
    dense = sizes["Dense"] / tokens
    rows = []
    print(f"{'setting':<20}{'B/tok/boundary':>15}{'fwd us/tok':>11}{'bwd us/tok':>11}{'us/tok':>9}{'ktok/s':>9}"
          f"{'link us saved/tok':>19}")
    for a in SETTINGS:
        fwd, bwd = (statistics.median(t) / tokens * 1e6 for t in times[a])
        us = fwd + bwd
        saved = (dense - sizes[a] / tokens) * link_s_per_byte * 1e6
        rows.append({"setting": a, "bytes_per_token_per_boundary": sizes[a] / tokens, "fwd_us_per_token": fwd,
                     "bwd_us_per_token": bwd, "us_per_token": us, "tokens_per_s": 1e6 / us,
                     "link_us_saved_per_token": saved})
        print(f"{a:<20}{sizes[a] / tokens:>15.1f}{fwd:>11.2f}{bwd:>11.2f}{us:>9.2f}{1e6 / us / 1e3:>9.1f}"
              f"{saved:>19.2f}")
    rot = hadamard_as_matmul(x.reshape(-1, HIDDEN), args.repeats)
    print(f"Hadamard, 64-dim tiles: butterfly {rot['butterfly_us_per_token']:.2f} us/token, one matmul "
          f"{rot['matmul_us_per_token']:.2f} us/token; codes equal bitwise: {rot['codes_equal_bitwise']} "
          f"(max |difference| {rot['max_abs_difference']:.2e})")
    RESULTS.write_text(json.dumps({"hidden": HIDDEN, "tokens": tokens, "wire": "bfloat16", "link_mbps": LINK_MBPS,
                                   "threads": torch.get_num_threads(), "repeats": args.repeats, "rows": rows,
                                   "hadamard": rot, **code_stamp()}, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
