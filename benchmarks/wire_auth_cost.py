"""What the authenticated and the sealed wire cost per MB on this CPU, next to a 200 Mbit/s link.

Every point-to-point payload of the dist and elastic engines is authenticated (HMAC-SHA256 over
header + data, ``comm/wire_auth.py``); with ``wire.encrypt = true`` it is sealed instead
(ChaCha20-Poly1305). This times both ends of one message (sender's ``seal`` + receiver's
``open_header``/``open_body``) on payloads of a PP activation's size (bf16, 4 x 128 tokens x 576:
SmolLM2-135M's hidden size), interleaving the modes, and reports the median milliseconds per MB
and the fraction of a 200 Mbit/s link's time per MB (40 ms) it adds. Writes
``benchmarks/results/wire_auth.json``.

    .venv/bin/python benchmarks/wire_auth_cost.py [--repeats 30] [--tokens 512] [--hidden 576]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from thinpipe.comm.header import encode_header
from thinpipe.comm.payload import Payload
from thinpipe.comm.wire_auth import LinkAuth
from thinpipe.provenance import code_stamp

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "wire_auth.json"
LINK_MBPS = 200.0


def one_message(sender: LinkAuth, receiver: LinkAuth, payload: Payload) -> float:
    parts = [t.reshape(-1).view(torch.uint8) for t in payload.tensors.values()]
    t0 = time.perf_counter()
    frame, body = sender.seal(1, 1, encode_header(payload), parts)
    _, ticket = receiver.open_header(0, 1, frame)
    receiver.open_body(0, 1, ticket, body, [p.numel() for p in parts])
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--hidden", type=int, default=576)
    args = p.parse_args()
    key = bytes(range(32))
    payload = Payload({"x": torch.randn(args.tokens, args.hidden).to(torch.bfloat16)})
    mb = payload.nbytes / 1e6
    ends = {"authenticated": (LinkAuth(key, "pp", 0), LinkAuth(key, "pp", 1)),
            "sealed": (LinkAuth(key, "pp", 0, encrypt=True), LinkAuth(key, "pp", 1, encrypt=True))}
    times: dict[str, list[float]] = {k: [] for k in ends}
    for _ in range(args.repeats):  # interleaved: the machine's noise falls on every mode alike
        for mode, (a, b) in ends.items():
            times[mode].append(one_message(a, b, payload))
    link_ms_per_mb = 8 / LINK_MBPS * 1e3
    rows = {}
    print(f"payload {payload.nbytes} B ({args.tokens} tokens x {args.hidden} bf16), median of {args.repeats}")
    print(f"{'mode':<15} {'ms/MB':>8} {'MB/s':>9} {'of a 200 Mbit/s link':>22}")
    for mode, ts in times.items():
        ms = statistics.median(ts) * 1e3 / mb
        rows[mode] = {"ms_per_mb": round(ms, 3), "mb_per_s": round(1e3 / ms, 1),
                      "fraction_of_link_time": round(ms / link_ms_per_mb, 4)}
        print(f"{mode:<15} {ms:8.3f} {1e3 / ms:9.1f} {ms / link_ms_per_mb:21.1%}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"payload_bytes": payload.nbytes, "repeats": args.repeats, "link_mbps": LINK_MBPS,
                                   "link_ms_per_mb": link_ms_per_mb, "modes": rows, **code_stamp()}, indent=2) + "\n")
    print(f"-> {RESULTS}")


if __name__ == "__main__":
    main()
