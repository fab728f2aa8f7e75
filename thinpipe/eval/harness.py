"""lm-evaluation-harness through thinpipe's stages (``thinpipe eval --harness TASKS``, issue 39).

``MeshLM`` is an lm-eval ``TemplateLM``: the harness renders its tasks (prompts, few-shot, filters, metrics)
and asks it for log-likelihoods, rolling log-likelihoods and greedy generations, which it computes on
thinpipe's stages: the logits of a model split by ``--set mesh.pp=N`` or of a run folder (through the run's
boundaries where they are part of its model, ``SimMesh.logits``) and the KV-cached generation of the mesh
(``engine/sim_generate.py``). Each request is built exactly as lm-eval's own ``hf`` backend (``HFLM``) builds
it, so that the same task on the same model gives the same numbers through either (tests/integration/test_harness.py):

- tokens: ``tok_encode`` with the tokenizer's own special tokens unless the string already starts with BOS;
  an empty context is the prefix token (BOS, else EOS); ``TemplateLM._encode_pair`` splits context and
  continuation;
- log-likelihood: ``(context + continuation)[-(max_length + 1):][:-1]``, the continuation's log-probs summed,
  greedy when every continuation token is the argmax (``eval/loglik.py: score_token_pairs``);
- rolling log-likelihood: lm-eval's disjoint windows of ``max_length`` tokens (``get_rolling_token_windows``);
- generation: greedy; the context left-truncated to ``max_length - max_gen_toks``; stop at any ``until``
  string or EOS; the new tokens decoded without special tokens and cut at the first stop string.

``max_length`` is resolved from the model's config as HFLM resolves it. Sampled generation (``do_sample``)
is refused in one line: the harness's numbers here are greedy.
"""

from __future__ import annotations

import math
from typing import Callable

from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import (
    handle_stop_sequences,
    has_bos_prefix,
    normalize_gen_kwargs,
    postprocess_generated_text,
    resolve_max_length,
)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from thinpipe.config import ConfigError
from thinpipe.eval.loglik import LogitsFn, score_token_pairs

# ids per prompt, stop strings, max new tokens -> the generated ids per prompt (greedy)
GenerateIds = Callable[[list[list[int]], list[str], int], list[list[int]]]
DEFAULT_MAX_GEN_TOKS = 256  # HFLM.max_gen_toks


class MeshLM(TemplateLM):
    """An lm-eval model whose forward passes and generation run on thinpipe's stages."""

    def __init__(self, logits_fn: LogitsFn, tokenizer, generate_ids: GenerateIds, model_config=None,
                 batch_size: int = 16, gen_batch_size: int = 8, max_length: int | None = None):
        super().__init__()
        self.logits_fn, self.tokenizer, self.generate_ids = logits_fn, tokenizer, generate_ids
        self.batch_size, self.gen_batch_size = batch_size, gen_batch_size
        self.max_length = max_length or resolve_max_length(model_config, tokenizer)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = getattr(self.tokenizer, "bos_token_id", None)
        return self.eot_token_id if bos is None else bos

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "name_or_path", "thinpipe").replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs) -> list[int]:
        kw = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode([self.prefix_token_id])):
            kw = {"add_special_tokens": False}  # HFLM: a string that starts with BOS gets no second one
        ids = list(self.tokenizer.encode(string, **kw))
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def _pad_id(self) -> int:
        pad = getattr(self.tokenizer, "pad_token_id", None)
        return int(pad if pad is not None else self.eot_token_id)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        pairs = [(ctx, cont) for _, ctx, cont in requests]
        return score_token_pairs(self.logits_fn, pairs, self.batch_size, self.max_length, progress=not disable_tqdm,
                                 pad_token_id=self._pad_id(), desc="loglikelihood (mesh)")

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for k, (string,) in enumerate(req.args for req in requests):
            for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((ctx, cont))
                owner.append(k)
        scores = score_token_pairs(self.logits_fn, windows, self.batch_size, self.max_length,
                                   progress=not disable_tqdm, pad_token_id=self._pad_id(), desc="rolling (mesh)")
        totals = [0.0] * len(requests)
        for k, (logprob, _) in zip(owner, scores):
            totals[k] += logprob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos = self.tokenizer.decode([self.eot_token_id], skip_special_tokens=False)
        out: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for k, req in enumerate(requests):
            groups.setdefault(repr(sorted(req.args[1].items())), []).append(k)
        bar = tqdm(total=len(requests), desc="generate_until (mesh)", disable=disable_tqdm)
        for members in groups.values():
            kwargs = normalize_gen_kwargs(requests[members[0]].args[1], DEFAULT_MAX_GEN_TOKS)
            if kwargs.get("do_sample") or kwargs.get("temperature", 0.0) > 0:
                raise ConfigError(f"task {requests[members[0]].task_name} samples its generations (do_sample / "
                                  "temperature > 0): thinpipe eval --harness decodes greedily; give the task "
                                  "do_sample: false in its generation_kwargs")
            until = [u for u in handle_stop_sequences(kwargs.pop("until", None), eos=eos) if u]  # "" stops nothing
            max_gen = kwargs.pop("max_gen_toks")
            if max_gen >= self.max_length:
                raise ConfigError(f"max_gen_toks = {max_gen} leaves no room for a prompt in the model's "
                                  f"{self.max_length} positions: lower the task's max_gen_toks")
            ids = [self.tok_encode(requests[k].args[0], left_truncate_len=self.max_length - max_gen) for k in members]
            for start in range(0, len(members), self.gen_batch_size):
                part = members[start:start + self.gen_batch_size]
                news = self.generate_ids(ids[start:start + len(part)], until, max_gen)
                for k, new in zip(part, news):
                    text = self.tokenizer.decode(new, skip_special_tokens=True)
                    out[k] = postprocess_generated_text(text, until, None)
                bar.update(len(part))
        bar.close()
        return out  # type: ignore[return-value]


def finite(tree):
    """lm-eval's results with every non-finite float as None (one valid JSON object on stdout)."""
    if isinstance(tree, dict):
        return {k: finite(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [finite(v) for v in tree]
    if isinstance(tree, float) and not math.isfinite(tree):
        return None
    return tree
