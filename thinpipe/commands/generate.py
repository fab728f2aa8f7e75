"""``thinpipe generate``: sample completions from a model split over pipeline stages, on the simulated mesh
with a KV cache per stage (``engine/sim_generate.py``, docs/generation.md).

Completions go to stdout, one per prompt (``--json``: one record per prompt); progress lines to stderr.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from thinpipe.config import ConfigError

NAME = "generate"
HELP = "sample completions from a model split over pipeline stages (simulated mesh, KV cache per stage)"


def add_arguments(g: argparse.ArgumentParser) -> None:
    g.add_argument("--model", help="preset | Hugging Face folder | .gguf (default: the default model)")
    g.add_argument("--run", metavar="DIR", help="sample from a trained run folder (its mesh: weights and boundaries)")
    g.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                   help="a prompt, tokenized as given: no chat template, no special tokens (repeatable)")
    g.add_argument("--prompts", metavar="FILE", help="a text file with one prompt per line, or .jsonl with \"prompt\"")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (1 = off)")
    g.add_argument("--top-k", type=int, default=0, help="keep the K most likely tokens (0 = off)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    g.add_argument("--batch-size", type=int, default=8, help="prompts per generation pass")
    g.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override as in train, e.g. mesh.pp=2, boundary.kind=mapl, train.device=cpu")
    g.add_argument("--chat", action="store_true",
                   help="wrap each prompt in the model's chat template with a generation prompt")
    g.add_argument("--json", action="store_true",
                   help="one JSON record per prompt: prompt, completion, tokens, finish_reason")


def read_prompts(args) -> list[str]:
    """--prompt texts, then --prompts FILE's; one line if there are none or the file is unreadable."""
    texts = list(args.prompt)
    if args.prompts:
        path = Path(args.prompts)
        if not path.is_file():
            raise ConfigError(f"--prompts {path}: no such file; give a text file (one prompt per line) or a .jsonl "
                              "file with a \"prompt\" field per line")
        try:
            lines = path.read_text(encoding="utf-8-sig").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--prompts {path} cannot be read as UTF-8 text ({type(e).__name__})") from None
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            if path.suffix != ".jsonl":
                texts.append(line)
                continue
            try:
                row = json.loads(line)
            except ValueError:
                raise ConfigError(f"--prompts {path}, line {n}: not a JSON object") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise ConfigError(f"--prompts {path}, line {n}: a .jsonl line is an object with a \"prompt\" string")
            texts.append(row["prompt"])
    if not texts:
        raise ConfigError("no prompt: give --prompt TEXT or --prompts FILE")
    if any(not t for t in texts):
        raise ConfigError("a prompt is empty: every prompt needs at least one character")
    return texts


def encode(tokenizer, text: str, chat: bool) -> list[int]:
    """The prompt's ids: as given, or (``chat``) in the model's chat template with a generation prompt
    (ChatML, the format thinpipe trains in, when the tokenizer has no template)."""
    if chat:
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
        else:
            from thinpipe.data.chat import prompt_text

            text = prompt_text(text)
    return list(tokenizer.encode(text, add_special_tokens=False))


def run(args) -> int:
    from thinpipe.rank.generation import Sampling

    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_p, args.top_k, args.seed, list(args.stop))
    sampling.validate()
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {args.batch_size}")
    texts = read_prompts(args)
    import torch

    from thinpipe.commands.mesh_source import build_mesh
    from thinpipe.console import say
    from thinpipe.engine.sim_generate import generate_on_mesh
    from thinpipe.rank.generation import finish_reason, truncate_completion

    mesh, loaded = build_mesh(args.run, args.model, args.set)
    tokenizer = loaded.tokenizer
    eos = getattr(tokenizer, "eos_token_id", None)
    sampling.eos_ids = [int(eos)] if eos is not None else []
    prompts = [encode(tokenizer, t, args.chat) for t in texts]
    if any(not p for p in prompts):
        raise ConfigError("a prompt encodes to no tokens: give it some text")
    say(f"[thinpipe] generating {len(prompts)} completion(s) of up to {sampling.max_new_tokens} tokens on "
        f"{mesh.cfg.mesh.pp} stage(s), {mesh.device}")
    with torch.no_grad():
        outs = generate_on_mesh(mesh, prompts, sampling, tokenizer, batch_size=args.batch_size)
    for text, tokens in zip(texts, outs):
        completion = truncate_completion(tokens, tokenizer, sampling)
        if args.json:
            print(json.dumps({"prompt": text, "completion": completion, "tokens": tokens,
                              "finish_reason": finish_reason(tokens, tokenizer, sampling)}))
        else:
            print(completion)
    return 0
