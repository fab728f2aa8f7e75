"""The scale presets' tokenizer: a 32k byte-level BPE trained on the built-in corpora, cached like a model.

The MAPL paper's models use the LLaMA tokenizer (App. E.1: vocabulary 32,000), which is not obtainable here.
The scale presets (``models/presets.py: SCALES``) use instead a byte-level BPE (the ``tokenizers`` library's,
as GPT-2 and Llama 3 use) with a 32,000-token budget, trained once on the training splits of the built-in text
corpora (``math``: MATH problems and solutions; ``medical``: MedMCQA questions and explanations) and cached under
``$THINPIPE_CACHE/tokenizers/`` (a file lock makes concurrent ranks on a fresh machine train it once). Special
tokens follow LLaMA's ids: ``<unk>`` 0, ``<s>`` 1 (BOS), ``</s>`` 2 (EOS), and ``<pad>`` 3. The embedding keeps
32,000 rows whatever the trained vocabulary holds (a small corpus may stop short of 32k merges). A user swaps in
their own with ``model.tokenizer = FOLDER`` (a Hugging Face tokenizer folder or a ``tokenizer.json``).
"""

from __future__ import annotations

import fcntl
import json
from pathlib import Path

from thinpipe.data.corpora import load_examples
from thinpipe.data.fetch import cache_dir

SPECIAL = ("<unk>", "<s>", "</s>", "<pad>")
CORPORA = ("math", "medical")
VERSION = 1  # bump when the training recipe changes: a new cache folder


def texts() -> list[str]:
    """The training text: every training example of the built-in corpora, prompt and response."""
    out = []
    for name in CORPORA:
        out += [f"{ex['prompt']}\n{ex['response']}" for ex in load_examples(name, "train")]
    return out


def train_bpe(lines: list[str], vocab_size: int):
    """A byte-level BPE of at most ``vocab_size`` tokens (special tokens first) trained on ``lines``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(lines, trainer=trainer)
    return tok


def scale_tokenizer(vocab_size: int = 32_000):
    """The cached BPE as a transformers tokenizer (trained on first use, once per machine)."""
    from transformers import PreTrainedTokenizerFast

    folder = cache_dir() / "tokenizers" / f"bpe{vocab_size}-v{VERSION}"
    path = folder / "tokenizer.json"
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
            if not path.is_file():
                tmp = folder / "tokenizer.json.tmp"
                train_bpe(texts(), vocab_size).save(str(tmp))
                tmp.replace(path)
                (folder / "meta.json").write_text(json.dumps({"corpora": CORPORA, "vocab_budget": vocab_size,
                                                              "version": VERSION}) + "\n")
    return PreTrainedTokenizerFast(tokenizer_file=str(path), unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")


def user_tokenizer(spec: str):
    """``model.tokenizer``: a Hugging Face tokenizer folder, or a ``tokenizer.json`` file."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = Path(spec)
    if path.is_file() and path.suffix == ".json":
        return PreTrainedTokenizerFast(tokenizer_file=str(path))
    return AutoTokenizer.from_pretrained(path)
