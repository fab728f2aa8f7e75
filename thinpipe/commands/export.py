"""``thinpipe export``: a run's weights as a Hugging Face model folder (``engine/run_folder.py``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from thinpipe.commands.preflight import check_run

NAME = "export"
HELP = "write a run's weights as a Hugging Face model folder"


def add_arguments(x: argparse.ArgumentParser) -> None:
    x.add_argument("--run", required=True, action="append",
                   help="a run folder of any engine; a dist job across machines: each machine's --out (--run A "
                        "--run B ...), their ranks' parts put together")
    x.add_argument("--out", required=True, help="a new or empty folder, or an earlier export with --overwrite")
    x.add_argument("--lora-save", choices=("merged", "adapter"),
                   help="a LoRA run: its adapters folded into the model, or peft's adapter files naming the base "
                        "model's folder (default: the run's train.lora.save)")
    x.add_argument("--overwrite", action="store_true", help="replace an earlier export in --out (only its own files; "
                                                            "any other non-empty folder is refused)")


def run(args) -> int:
    from thinpipe.engine.run_folder import export  # the model libraries: loaded for this command only

    runs = [Path(r) for r in args.run]
    check_run(runs)
    out = export(runs if len(runs) > 1 else runs[0], args.out, overwrite=args.overwrite, lora_save=args.lora_save)
    print(f"exported to {out} (load with AutoModelForCausalLM.from_pretrained({str(out)!r}))")
    return 0
