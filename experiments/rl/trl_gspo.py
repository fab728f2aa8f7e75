"""The GSPO-gain run through TRL's own trainer (issue 40, item 2): the same start, data, prompts, reward and
hyperparameters as ``gain.py``'s thinpipe runs, trained by ``trl.GRPOTrainer`` with
``importance_sampling_level = "sequence"`` (GSPO), on one CPU process.

What is matched, setting by setting (thinpipe key -> GRPOConfig field):

- start: the SFT run's weights (``thinpipe export`` of the run folder, the same HF folder ``--init-from`` writes);
- prompts: ``data/rl_train.jsonl`` rendered as thinpipe renders them (``thinpipe.data.chat.prompt_text``: ChatML,
  no system turn, assistant header open); the script checks that TRL's token ids equal thinpipe's;
- reward: ``thinpipe.objective.rewards.math_reward`` (1 for the right final number), no overlong shaping;
- ``rl.group_size`` -> ``num_generations``; ``rl.prompts_per_step`` x ``rl.group_size`` sequences per generation,
  ``rl.minibatches`` updates on them -> ``gradient_accumulation_steps`` = a minibatch's sequences / ``--micro``
  (``per_device_train_batch_size``), ``steps_per_generation`` = minibatches x that; TRL's "grpo" loss divides by the
  accumulation, as thinpipe weighs each sequence 1 / (an update's sequences); thinpipe's ``train.steps``
  generations -> ``max_steps`` = steps x minibatches updates;
- ``rl.clip_low`` / ``rl.clip_high`` -> ``epsilon`` / ``epsilon_high``; ``rl.ratio_level = sequence`` ->
  ``importance_sampling_level = "sequence"``; seq-mean-token-mean -> ``loss_type = "grpo"``; GRPO advantages with
  the group's unbiased std -> ``scale_rewards = "group"``; no KL -> ``beta = 0``;
- ``rl.temperature`` 1.0, top-p 1, top-k off; ``rl.max_response_tokens`` -> ``max_completion_length``; rollouts
  stop at ``<|im_end|>`` (the tokenizer's EOS) in both;
- AdamW (0.9, 0.999, eps 1e-8), ``train.lr``, ``train.weight_decay``, ``train.grad_clip`` -> ``max_grad_norm``,
  constant lr without warm-up in both (``train.warmup_ratio = 0``, ``train.min_lr_ratio = 1``).

What differs by construction: TRL draws prompts with its own sampler and shuffles a generation's sequences before
cutting it into minibatches (thinpipe: its own seeded prompt stream, minibatches in order), and samples with
``generate``'s RNG; the two runs see different draws of the same distribution, so they are compared as two seeds
would be, not step by step.

Held-out accuracy before and after: greedy decoding (``eval_heldout.generate``, HF ``generate``) of the 300 held-out
problems, scored by ``math_reward`` as thinpipe's ``val_accuracy`` is.

    OMP_NUM_THREADS=1 .venv/bin/python experiments/rl/trl_gspo.py --init /work/rl_runs/sft_Dense \\
        --out /work/rl_runs/trl_gspo_s0 --seed 0 --steps 40 --lr 1e-5
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from thinpipe.provenance import code_stamp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from eval_heldout import generate, stderr  # noqa: E402

from thinpipe.data.chat import prompt_text  # noqa: E402
from thinpipe.objective.rewards import math_reward  # noqa: E402


def rows_of(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def heldout_accuracy(model, tok, rows: list[dict], max_new: int) -> dict:
    comps = generate(model, tok, [r["prompt"] for r in rows], max_new, batch=50)
    ok = [math_reward(c, r["answer"]) for c, r in zip(comps, rows)]
    p, n = sum(ok) / len(ok), len(ok)
    return {"accuracy": p, "stderr": stderr(p, n), "n": n,
            "format_rate": sum("The answer is" in c for c in comps) / n}


def check_prompt_ids(tok, rows: list[dict]) -> None:
    """TRL tokenizes the rendered prompt text; thinpipe's GSPO tokenizes the user turn plus an empty assistant
    turn (``thinpipe.data.prompts.prompt_tokens``): the two must be the same ids, or the runs differ at the start."""
    from thinpipe.data.chat import resolve_chat_format
    from thinpipe.data.prompts import prompt_tokens

    fmt = resolve_chat_format(tok, "auto")
    for r in rows[:50]:
        mine = prompt_tokens(tok, [{"role": "user", "content": r["prompt"]}], fmt)
        if tok(prompt_text(r["prompt"]), add_special_tokens=False)["input_ids"] != mine:
            raise SystemExit(f"prompt ids differ between TRL and thinpipe for {r['prompt'][:40]!r}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--init", required=True, help="the SFT run folder (or an HF model folder) to start from")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=40, help="generations (thinpipe steps)")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--minibatches", type=int, default=2)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--micro", type=int, default=16,
                    help="rollouts per forward; an update's rollouts are accumulated over several (memory: a "
                         "forward of 64 rollouts needs ~10 GB here for its logits over a 49k vocabulary)")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--data", default=str(HERE / "data"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--heldout-limit", type=int, default=0, help="score only the first N held-out rows (smoke test)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from thinpipe.engine.run_folder import load_run

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    train_rows, held = rows_of(Path(a.data) / "rl_train.jsonl"), rows_of(Path(a.data) / "heldout.jsonl")
    held = held[:a.heldout_limit] if a.heldout_limit else held
    _, model, tok = load_run(a.init)
    model.float()
    check_prompt_ids(tok, train_rows)
    t0 = time.time()
    before = heldout_accuracy(model, tok, held, a.max_new)
    print(f"held-out before: {before['accuracy']:.3f} +- {before['stderr']:.3f} ({time.time() - t0:.0f} s)",
          flush=True)

    ds = Dataset.from_list([{"prompt": prompt_text(r["prompt"]), "answer": r["answer"]} for r in train_rows])

    def reward(completions, answer, **_):
        return [math_reward(c, x) for c, x in zip(completions, answer)]

    sequences = a.prompts * a.group
    per_update = sequences // a.minibatches
    if per_update % a.micro:
        raise SystemExit(f"--micro {a.micro} must divide an update's {per_update} rollouts")
    accumulate = per_update // a.micro  # one optimizer update per rl minibatch, as thinpipe's chunks accumulate
    cfg = GRPOConfig(
        output_dir=str(out / "trainer"), seed=a.seed, data_seed=a.seed, use_cpu=True, bf16=False,
        per_device_train_batch_size=a.micro, steps_per_generation=a.minibatches * accumulate,
        gradient_accumulation_steps=accumulate, num_generations=a.group, num_iterations=1,
        max_steps=a.steps * a.minibatches, max_completion_length=a.max_new,
        temperature=1.0, top_p=1.0, top_k=0, beta=0.0, epsilon=3e-4, epsilon_high=4e-4,
        importance_sampling_level="sequence", loss_type="grpo", scale_rewards="group",
        mask_truncated_completions=False, learning_rate=a.lr, weight_decay=a.weight_decay, adam_beta1=0.9,
        adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0, lr_scheduler_type="constant", warmup_steps=0,
        logging_steps=1, save_strategy="no", report_to="none", disable_dropout=True, dataloader_num_workers=0,
        gradient_checkpointing=False,  # TRL's default recomputes activations: slower, same numbers
    )
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=ds, processing_class=tok)
    t1 = time.time()
    trainer.train()
    train_s = time.time() - t1
    rows = [{k: v for k, v in h.items() if isinstance(v, (int, float))} for h in trainer.state.log_history]
    after = heldout_accuracy(trainer.model, tok, held, a.max_new)
    print(f"held-out after: {after['accuracy']:.3f} +- {after['stderr']:.3f}", flush=True)
    result = {"trainer": "trl", "seed": a.seed, "init": str(a.init), "steps": a.steps, "lr": a.lr,
              "group_size": a.group, "prompts_per_step": a.prompts, "minibatches": a.minibatches,
              "max_response_tokens": a.max_new, "before": before, "after": after, "train_s": train_s,
              "log": rows, **code_stamp()}
    (out / "result.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
