"""One line for every bad input (issue 25, point 6): each case of docs/reliability.md's table "Bad input is one
line" runs here through ``thinpipe.cli.main`` in this process, and must end with exit code 2, exactly one
non-empty line on stderr that starts with ``error:`` and says what is wrong, and no traceback.

Cases cover the commands, data files (JSONL, Parquet), config files, environment variables and run folders.
``{tmp}`` in a case is the test's folder; ``{run}`` a copy of one tiny trained run (built once per module), edited
by the case's ``edit``. No case loads SmolLM2; the ones that load a model load the 0.3M-parameter tiny-llama.
``test_docs_table_lists_every_case`` keeps the docs' table and this file the same set of cases.
"""

from __future__ import annotations

import errno
import hashlib
import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from thinpipe.cli import main

TINY = ["--set", "model.name=tiny-llama", "--set", "data.name=synthetic", "--set", "train.seq_len=32",
        "--set", "train.batch_size=2", "--set", "train.lr=1e-3", "--set", "data.val_rows=4", "--quiet"]
TRAIN = ["train", "--out", "{tmp}/out", *TINY]
CFG = ["train", "--out", "{tmp}/out", "--config", "{tmp}/c.toml"]   # a config file's case: fails before any model
DATA = [*TRAIN, "--set", "train.steps=1", "--set", "data.name={tmp}/d.jsonl"]
PARQUET = [*TRAIN, "--set", "train.steps=1", "--set", "data.name={tmp}/d.parquet"]
PART = "checkpoint/step00000002/mesh"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "reliability.md"
# what the environment of the machine running the tests must not decide
CLEARED = ("THINPIPE_PLUGINS", "THINPIPE_DIST_TIMEOUT_S", "REPLICA_GROUP_ID", "THINPIPE_ELASTIC_RESTART",
           "TORCHELASTIC_RESTART_COUNT", "TORCHFT_LIGHTHOUSE", "RANK", "THINPIPE_RANK_ERRORS", "THINPIPE_JOB_KEY_FILE",
           "THINPIPE_BIND_ADDR", "MASTER_ADDR")


@dataclass
class Case:
    id: str
    what: str                               # the input, as the docs' table names it
    args: list[str]
    message: str                            # a part of the one line
    files: dict[str, bytes | str] = field(default_factory=dict)   # written under {tmp} first
    env: dict[str, str] = field(default_factory=dict)
    edit: Callable[[Path], None] | None = None                    # applied to the copy of the tiny run at {run}
    patch: Callable | None = None                                 # patch(monkeypatch) before the command
    slow: bool = False                      # trains a tiny model (seconds): `make test`, not `make test-fast`


def _jsonl(*rows) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)


def _parquet(table: dict) -> bytes:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.table(table), buf)
    return buf.getvalue()


def _redigest(run: Path) -> None:
    """Recompute the part's digests, as someone who edits a checkpoint by hand on purpose would."""
    part = run / PART
    digests = {f"mesh.{s}": hashlib.sha256(Path(f"{part}.{s}").read_bytes()).hexdigest() for s in ("safetensors",
        "json")}
    Path(f"{part}.sha256").write_text(json.dumps(digests))


def _edit_json(change: Callable[[str], str], redigest: bool = True) -> Callable[[Path], None]:
    def edit(run: Path) -> None:
        path = Path(f"{run / PART}.json")
        path.write_text(change(path.read_text()))
        if redigest:
            _redigest(run)
    return edit


def _write(name: str, data: bytes | str) -> Callable[[Path], None]:
    def edit(run: Path) -> None:
        p = run / name
        p.write_bytes(data) if isinstance(data, bytes) else p.write_text(data)
    return edit


def _summary(change: Callable[[dict], object]) -> Callable[[Path], None]:
    def edit(run: Path) -> None:
        p = run / "summary.json"
        p.write_text(json.dumps(change(json.loads(p.read_text()))))
    return edit


def _truncate(name: str, keep: float = 0.5, redigest: bool = False) -> Callable[[Path], None]:
    def edit(run: Path) -> None:
        p = run / name
        data = p.read_bytes()
        p.write_bytes(data[:int(len(data) * keep)])
        if redigest:
            _redigest(run)
    return edit


def _no_summary_and(change: Callable[[Path], None]) -> Callable[[Path], None]:
    def edit(run: Path) -> None:
        (run / "summary.json").unlink()
        change(run)
    return edit


def _enospc(monkeypatch) -> None:
    import thinpipe.checkpoint as ck

    def full(path, write):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(ck, "_write_atomic", full)


def _erofs(monkeypatch) -> None:
    import thinpipe.checkpoint as ck

    def read_only(path, write):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(ck, "_write_atomic", read_only)


DEEP = "[" * 200_000 + "]" * 200_000
STEP = '"step": 2'
Q = '"/mesh/ranks/0/0/stage/layers.0.self_attn.q_proj.weight"}'
GATE = '"/mesh/ranks/0/0/stage/layers.0.mlp.gate_proj.weight"}'
TIMEOUT_DIST = {"RANK": "0", "WORLD_SIZE": "1"}
ELASTIC = ["train", "--out", "{tmp}/out", "--engine", "elastic", *TINY, "--set", "mesh.dp=2"]
ELASTIC_ENV = {"RANK": "0", "WORLD_SIZE": "1", "TORCHFT_LIGHTHOUSE": "http://127.0.0.1:9", "REPLICA_GROUP_ID": "0"}

CASES = [
    # ------------------------------------------------------------------ config files (--config)
    Case("cfg-latin1", "config file that is not UTF-8 (Latin-1)", CFG, "is not UTF-8 text (byte",
         {"c.toml": "[train]\n# d\xe9j\xe0 vu\nsteps = 3\n".encode("latin-1")}),
    Case("cfg-utf16", "config file saved as UTF-16", CFG, "is not UTF-8 text",
         {"c.toml": "[train]\nsteps = 3\n".encode("utf-16")}),
    Case("cfg-syntax", "TOML syntax error (a key without a value)", CFG, "is not valid TOML",
         {"c.toml": "[train]\nsteps =\n"}),
    Case("cfg-header", "TOML table header not closed", CFG, "is not valid TOML", {"c.toml": "[train\nsteps = 3\n"}),
    Case("cfg-dupkey", "TOML key given twice", CFG, "is not valid TOML", {"c.toml": "[train]\nsteps = 3\nsteps = 4\n"}),
    Case("cfg-bom-bad", "a UTF-8 config with a BOM (accepted) and a bad value", CFG, "train.steps must be >= 1",
         {"c.toml": "\ufeff[train]\nsteps = 0\n".encode("utf-8")}),
    Case("cfg-binary", "config file of binary bytes", CFG, "is not UTF-8 text", {"c.toml": bytes(range(128, 256))}),
    Case("cfg-dir", "--config names a folder", ["train", "--out", "{tmp}/out", "--config", "{tmp}"], "is a folder"),
    Case("cfg-empty-arg", "--config ''", ["train", "--out", "{tmp}/out", "--config", ""], "--config is empty"),
    Case("cfg-section", "unknown section in the file", CFG, "unknown section 'trian'",
         {"c.toml": "[trian]\nsteps = 3\n"}),
    Case("cfg-key", "unknown key in the file", CFG, "(did you mean steps?)", {"c.toml": "[train]\nstepz = 3\n"}),
    Case("cfg-str-for-int", "a string for an integer key", CFG, "train.steps expects a value of type int",
         {"c.toml": '[train]\nsteps = "ten"\n'}),
    Case("cfg-float-for-int", "a fraction for an integer key", CFG, "train.steps expects a value of type int",
         {"c.toml": "[train]\nsteps = 2.5\n"}),
    Case("cfg-bool-for-int", "true for an integer key", CFG, "train.steps expects a value of type int",
         {"c.toml": "[train]\nsteps = true\n"}),
    Case("cfg-str-for-bool", "a word for a boolean key", CFG, "data.skip_bad_rows expects true or false",
         {"c.toml": '[data]\nskip_bad_rows = "maybe"\n'}),
    Case("cfg-list-for-int", "a list for an integer key", CFG, "train.steps expects a value of type int",
         {"c.toml": "[train]\nsteps = [1]\n"}),
    Case("cfg-date", "a date for an integer key", CFG, "train.steps expects a value of type int",
         {"c.toml": "[train]\nsteps = 1979-05-27\n"}),
    Case("cfg-section-value", "a value where a section is", CFG, "key 'train' must be dotted as section.key",
         {"c.toml": "train = 3\n"}),
    Case("cfg-value-section", "a section where a value is", CFG, "'train.steps' is a value, not a section",
         {"c.toml": "[train.steps]\nx = 1\n"}),
    Case("cfg-array-of-tables", "an array of tables ([[train]])", CFG, "key 'train' must be dotted as section.key",
         {"c.toml": "[[train]]\nsteps = 3\n"}),
    Case("cfg-deep", "arrays nested 200k deep", CFG, "nests tables or arrays thousands deep",
         {"c.toml": "[train]\nsteps = " + DEEP + "\n"}),
    Case("cfg-5000-digits", "an integer of 5000 digits", CFG, "is not valid TOML",
         {"c.toml": "[train]\nsteps = " + "9" * 5000}),
    Case("cfg-int64", "an integer beyond int64", CFG, "train.seed is an integer of 67 bits, out of range",
         {"c.toml": "[train]\nseed = 99999999999999999999\n"}),
    Case("cfg-inf", "lr = inf in the file", CFG, "train.lr = inf is not a finite number",
         {"c.toml": "[train]\nlr = inf\n"}),
    Case("cfg-nan", "lr = nan in the file", CFG, "train.lr = nan is not a finite number",
         {"c.toml": "[train]\nlr = nan\n"}),
    Case("cfg-steps-int64-max", "train.steps = 2^63 - 1 in the file", CFG, "is more than 10^7 steps",
         {"c.toml": "[train]\nsteps = 9223372036854775807\n"}),
    Case("cfg-negative", "a negative batch size", CFG, "train.batch_size must be >= 1",
         {"c.toml": "[train]\nbatch_size = -1\n"}),
    Case("cfg-list-strings", "words in a list of integers", CFG, "boundary.masked expects a value of type list[int]",
         {"c.toml": '[boundary]\nmasked = ["a"]\n'}),
    # ------------------------------------------------------------------ absurd or wrong --set values
    Case("steps-1e30", "train.steps = 10^30", [*TRAIN, "--set", "train.steps=" + "1" + "0" * 30],
         "is more than 10^7 steps"),
    Case("steps-over-1e7", "train.steps = 10^7 + 1", [*TRAIN, "--set", "train.steps=10000001"],
         "is more than 10^7 steps"),
    Case("seq-len-1e9", "train.seq_len = 10^9", [*TRAIN, "--set", "train.seq_len=1000000000"],
         "is more than 2^20 tokens per sequence"),
    Case("lr-underflow", "train.lr = 1e-40 (rounds to zero)", [*TRAIN, "--set", "train.lr=1e-40"],
         "rounds to zero in float32"),
    Case("lr-zero", "train.lr = 0", [*TRAIN, "--set", "train.lr=0"], "train.lr must be > 0"),
    Case("lr-negative", "train.lr = -1", [*TRAIN, "--set", "train.lr=-1"], "train.lr must be > 0"),
    Case("seed-2e64", "train.seed = 2^64", [*TRAIN, "--set", f"train.seed={2**64}"], "out of range"),
    Case("steps-1e3", "train.steps = 1e3 (not an integer literal)", [*TRAIN, "--set", "train.steps=1e3"],
         "train.steps expects a value of type int"),
    Case("steps-5000-digits", "train.steps of 5000 digits", [*TRAIN, "--set", "train.steps=" + "9" * 5000],
         "(5002 characters)"),
    Case("set-no-equals", "--set without =", [*TRAIN, "--set", "train.steps"], "must look like key=value"),
    Case("set-no-key", "--set =3", [*TRAIN, "--set", "=3"], "must be dotted as section.key"),
    Case("warmup-1", "train.warmup_ratio = 1", [*TRAIN, "--set", "train.warmup_ratio=1"],
         "train.warmup_ratio must be in [0, 1)"),
    Case("min-lr-2", "train.min_lr_ratio = 2", [*TRAIN, "--set", "train.min_lr_ratio=2"],
         "train.min_lr_ratio must be in [0, 1]"),
    Case("clip-negative", "train.grad_clip = -1", [*TRAIN, "--set", "train.grad_clip=-1"],
         "train.grad_clip must be >= 0"),
    Case("schedule", "train.schedule = zigzag", [*TRAIN, "--set", "train.schedule=zigzag"],
         "train.schedule must be gpipe or 1f1b"),
    Case("optimizer", "train.optimizer = sgd", [*TRAIN, "--set", "train.optimizer=sgd"],
         "train.optimizer must be adamw or muon"),
    Case("on-divergence", "train.on_divergence = ignore", [*TRAIN, "--set", "train.on_divergence=ignore"],
         "train.on_divergence must be stop or rollback"),
    Case("rollback-factor", "train.rollback_lr_factor = 1", [*TRAIN, "--set", "train.rollback_lr_factor=1"],
         "train.rollback_lr_factor must be in (0, 1)"),
    Case("checkpoint-every", "train.checkpoint_every = -1", [*TRAIN, "--set", "train.checkpoint_every=-1"],
         "train.checkpoint_every must be >= 0"),
    Case("batch-zero", "train.batch_size = 0", [*TRAIN, "--set", "train.batch_size=0"],
         "train.batch_size must be >= 1"),
    Case("val-fraction", "data.val_fraction = 1", [*TRAIN, "--set", "data.val_fraction=1"],
         "data.val_fraction must be in [0, 1)"),
    Case("max-examples", "data.max_examples = -1", [*TRAIN, "--set", "data.max_examples=-1"],
         "data.max_examples must be >= 0"),
    Case("chat-format", "data.chat_format = xml", [*TRAIN, "--set", "data.chat_format=xml"],
         "data.chat_format must be auto"),
    Case("tied", "model.tied = maybe", [*TRAIN, "--set", "model.tied=maybe"], "model.tied must be sync or untie"),
    Case("model-empty", "model.name = ''", [*TRAIN, "--set", "model.name="], "model.name is empty"),
    Case("data-empty", "data.name = ''", [*TRAIN, "--set", "data.name="], "data.name is empty"),
    Case("lora-rank", "train.lora.rank = -1", [*TRAIN, "--set", "train.lora.rank=-1"], "train.lora needs rank >= 0"),
    Case("lora-dropout", "train.lora.dropout = 1", [*TRAIN, "--set", "train.lora.dropout=1"], "0 <= dropout < 1"),
    Case("eval-limit", "eval.limit = 0", [*TRAIN, "--set", "eval.limit=0"], "eval.limit must be >= 1"),
    Case("lora-save-preset", "train.lora.save = adapter of a random preset",
         [*TRAIN, "--set", "train.lora.rank=4", "--set", "train.lora.save=adapter"],
         "a random preset with none on disk"),
    Case("model-rank", "train.model_rank = 5 of a 1-stage job", [*TRAIN, "--set", "train.model_rank=5"],
         "is not a rank of this job's fast replicas"),
    Case("eval-tasks-train", "eval.tasks = [arc_eazy] (not a task)", [*TRAIN, "--set", "eval.tasks=[\"arc_eazy\"]"],
         "unknown task(s) arc_eazy"),
    Case("diag-every", "diag.every = -1", [*TRAIN, "--set", "diag.every=-1"], "diag.every must be >= 0"),
    Case("bool-word", "train.deterministic = perhaps", [*TRAIN, "--set", "train.deterministic=perhaps"],
         "train.deterministic expects true or false"),
    Case("masked-words", "boundary.masked = [a]", [*TRAIN, "--set", "boundary.masked=[a]"],
         "expects a value of type list[int]"),
    # ------------------------------------------------------------------ data files (JSONL, Parquet, folders)
    Case("jsonl-empty", "an empty JSONL file", DATA, "no train rows with a loss token", {"d.jsonl": ""}),
    Case("jsonl-binary", "a JSONL file of binary bytes", DATA, "not UTF-8 text", {"d.jsonl": bytes(range(128,
         256)) + b"\n"}),
    Case("jsonl-array", "a row that is a JSON array", DATA, "a row must be a JSON object, got list",
         {"d.jsonl": "[1, 2]\n"}),
    Case("jsonl-deep", "a row nested 200k deep", DATA, "values nested thousands deep",
         {"d.jsonl": '{"text": ' + DEEP + "}\n"}),
    Case("jsonl-5000-digits", "a row with an integer of 5000 digits", DATA, "not a row of training data",
         {"d.jsonl": '{"text": "a", "n": ' + "9" * 5000 + "}\n"}),
    Case("jsonl-huge-float", "text = 1e999 (a number, infinite)", DATA, '"text" must be a non-empty string',
         {"d.jsonl": '{"text": 1e999}\n'}),
    Case("jsonl-missing", "a row without text, messages or prompt", DATA, 'a row needs "messages"',
         {"d.jsonl": _jsonl({"title": "x"})}),
    Case("jsonl-messages-str", "messages that is a string", DATA, '"messages" must be a non-empty list',
         {"d.jsonl": _jsonl({"messages": "hi"})}),
    Case("jsonl-role", "a message of an unknown role", DATA, "has role 'bot'",
         {"d.jsonl": _jsonl({"messages": [{"role": "bot", "content": "x"}]})}),
    Case("jsonl-content-int", "a message whose content is a number", DATA, 'string "role" and "content"',
         {"d.jsonl": _jsonl({"messages": [{"role": "user", "content": 3}]})}),
    Case("jsonl-no-assistant", "a conversation without an assistant turn", DATA, "has no assistant turn",
         {"d.jsonl": _jsonl({"messages": [{"role": "user", "content": "hi"}]})}),
    Case("jsonl-prompt-only", "a prompt without a response", DATA, 'a prompt row needs string "prompt" and "response"',
         {"d.jsonl": _jsonl({"prompt": "2+2?"})}),
    Case("jsonl-not-json", "a line that is not JSON", DATA, "not valid JSON", {"d.jsonl": "{oops\n"}),
    Case("jsonl-text-empty", 'text = ""', DATA, '"text" must be a non-empty string', {"d.jsonl": _jsonl({"text": ""})}),
    Case("jsonl-text-null", "text = null", DATA, 'a row needs "messages"', {"d.jsonl": _jsonl({"text": None})}),
    Case("data-csv", "a .csv file as data", [*TRAIN, "--set", "data.name={tmp}/d.csv"], "not a .jsonl or .parquet file",
         {"d.csv": "a,b\n"}),
    Case("data-empty-dir", "a folder with no data files", [*TRAIN, "--set", "data.name={tmp}/empty"],
         "holds no .jsonl or .parquet files", {"empty/.keep": ""}),
    Case("parquet-text", "a .parquet file that is text", PARQUET, "not a readable Parquet file",
         {"d.parquet": "hello\n"}),
    Case("parquet-empty", "an empty .parquet file", PARQUET, "not a readable Parquet file", {"d.parquet": b""}),
    Case("parquet-int-text", "a Parquet text column of integers", PARQUET, '"text" must be a non-empty string',
         {"d.parquet": _parquet({"text": [1, 2]})}),
    Case("parquet-missing", "a Parquet file without a known column", PARQUET, 'a row needs "messages"',
         {"d.parquet": _parquet({"title": ["a", "b"]})}),
    Case("val-name-missing", "data.val_name that does not exist", [*DATA, "--set", "data.val_name={tmp}/nope.jsonl"],
         "is neither a built-in corpus", {"d.jsonl": _jsonl({"text": "hello"})}),
    Case("val-name-same", "data.val_name = data.name", [*DATA, "--set", "data.val_name={tmp}/d.jsonl"],
         "every file there is also the held-out data", {"d.jsonl": _jsonl({"text": "hello"})}),
    # ------------------------------------------------------------------ environment variables
    Case("plugins-missing", "THINPIPE_PLUGINS names a module that is not installed", ["plan"],
         "names module 'no_such_plugin_mod', which is not installed", env={"THINPIPE_PLUGINS": "no_such_plugin_mod"}),
    Case("plugins-path", "THINPIPE_PLUGINS names a file path", ["plan"], "which is not a module name",
         env={"THINPIPE_PLUGINS": "./plugins/x.py"}),
    Case("plugins-dots", "THINPIPE_PLUGINS = a..b", ["plan"], "which is not a module name",
         env={"THINPIPE_PLUGINS": "a..b"}),
    Case("plugins-raises", "a plugin that raises when imported", ["plan"],
         "plugin 'tp_plugin_raises' failed to import: "
         "RuntimeError: boom", {"tp_plugin_raises.py": "raise RuntimeError('boom')\n"},
         env={"THINPIPE_PLUGINS": "tp_plugin_raises"}),
    Case("plugins-syntax", "a plugin with a syntax error", ["plan"],
         "plugin 'tp_plugin_syntax' failed to import: SyntaxError",
         {"tp_plugin_syntax.py": "def (:\n"}, env={"THINPIPE_PLUGINS": "tp_plugin_syntax"}),
    Case("plugins-imports-missing", "a plugin that imports a missing module", ["plan"],
         "plugin 'tp_plugin_dep' failed to import: No module named 'no_such_dep_mod'",
         {"tp_plugin_dep.py": "import no_such_dep_mod\n"}, env={"THINPIPE_PLUGINS": "tp_plugin_dep"}),
    Case("cache-file", "THINPIPE_CACHE names a file", DATA, "$THINPIPE_CACHE = ", {"d.jsonl": _jsonl({"text": "hi"}),
         "afile": "x"}, env={"THINPIPE_CACHE": "{tmp}/afile"}),
    Case("cache-under-file", "THINPIPE_CACHE under a file", DATA, "cannot create the cache folder",
         {"d.jsonl": _jsonl({"text": "hi"}), "afile": "x"}, env={"THINPIPE_CACHE": "{tmp}/afile/cache"}),
    Case("dist-timeout-word", "THINPIPE_DIST_TIMEOUT_S = abc", [*TRAIN, "--engine", "dist"],
         "$THINPIPE_DIST_TIMEOUT_S = 'abc': give a number from 1 to", env={**TIMEOUT_DIST,
             "THINPIPE_DIST_TIMEOUT_S": "abc"}),
    Case("dist-timeout-zero", "THINPIPE_DIST_TIMEOUT_S = 0", [*TRAIN, "--engine", "dist"],
         "$THINPIPE_DIST_TIMEOUT_S = '0'",
         env={**TIMEOUT_DIST, "THINPIPE_DIST_TIMEOUT_S": "0"}),
    Case("dist-timeout-nan", "THINPIPE_DIST_TIMEOUT_S = nan", [*TRAIN, "--engine", "dist"],
         "$THINPIPE_DIST_TIMEOUT_S = 'nan'",
         env={**TIMEOUT_DIST, "THINPIPE_DIST_TIMEOUT_S": "nan"}),
    Case("dist-no-rank", "--engine dist outside a launcher (no RANK)", [*TRAIN, "--engine", "dist"],
         "--engine dist must be started by torchrun"),
    # ------------------------------------------------------------------ the job key (docs/security.md)
    Case("dist-no-key", "--engine dist without a job key", [*TRAIN, "--engine", "dist"],
         "--engine dist needs a job key so that peers can prove they belong", env=TIMEOUT_DIST),
    Case("dist-key-missing", "THINPIPE_JOB_KEY_FILE names no file", [*TRAIN, "--engine", "dist"],
         "cannot read the job key file", env={**TIMEOUT_DIST, "THINPIPE_JOB_KEY_FILE": "{tmp}/nope.key"}),
    Case("dist-key-readable", "a job key file others can read (0644)", [*TRAIN, "--engine", "dist"],
         "can be read by other users: chmod 600", {"job.key": "ab" * 32 + "\n"},
         env={**TIMEOUT_DIST, "THINPIPE_JOB_KEY_FILE": "{tmp}/job.key"}),
    Case("keygen-exists", "keygen over an existing file", ["keygen", "{tmp}/k.key"], "is never overwritten",
         {"k.key": "mine\n"}),
    Case("keygen-no-dir", "keygen into a missing folder", ["keygen", "{tmp}/no/k.key"],
         "cannot create the job key file"),
    Case("elastic-timeout", "THINPIPE_DIST_TIMEOUT_S = -5 (elastic)", ELASTIC, "$THINPIPE_DIST_TIMEOUT_S = '-5'",
         env={**ELASTIC_ENV, "THINPIPE_DIST_TIMEOUT_S": "-5"}),
    Case("replica-word", "REPLICA_GROUP_ID = abc", ELASTIC, "$REPLICA_GROUP_ID = 'abc': give an integer from 0 to 1",
         env={**ELASTIC_ENV, "REPLICA_GROUP_ID": "abc"}),
    Case("replica-range", "REPLICA_GROUP_ID = 5 with mesh.dp = 2", ELASTIC, "$REPLICA_GROUP_ID = '5': give an integer "
         "from 0 to 1", env={**ELASTIC_ENV, "REPLICA_GROUP_ID": "5"}),
    Case("elastic-restart", "THINPIPE_ELASTIC_RESTART = -1", ELASTIC, "$THINPIPE_ELASTIC_RESTART = '-1'",
         env={**ELASTIC_ENV, "THINPIPE_ELASTIC_RESTART": "-1"}),
    # ------------------------------------------------------------------ run folders
    Case("compare-truncated", "compare: summary.json cut off", ["compare", "{run}"],
         "summary.json is cut off or not JSON",
         edit=_truncate("summary.json")),
    Case("compare-summary-list", "compare: summary.json a JSON list", ["compare", "{run}"],
         "is not a summary thinpipe wrote (a JSON list", edit=_summary(lambda s: [1, 2])),
    Case("compare-no-points", "compare: summary.json without val_points", ["compare", "{run}"],
         "(no 'val_points')", edit=_summary(lambda s: {k: v for k, v in s.items() if k != "val_points"})),
    Case("compare-points-str", "compare: val_points a string", ["compare", "{run}"], "is not a summary thinpipe wrote",
         edit=_summary(lambda s: {**s, "val_points": "x"})),
    Case("compare-tokens-str", "compare: tokens a word", ["compare", "{run}"], "is not a summary thinpipe wrote",
         edit=_summary(lambda s: {**s, "tokens": "many"})),
    Case("compare-huge-int", "compare: a 400-digit integer in summary.json", ["compare", "{run}"],
         "is not a summary thinpipe wrote", edit=_summary(lambda s: {**s, "tokens_per_s": 10**400})),
    Case("compare-summary-deep", "compare: summary.json nested 200k deep", ["compare", "{run}"],
         "nests values thousands deep",
         edit=_write("summary.json", DEEP)),
    Case("compare-summary-binary", "compare: summary.json not UTF-8", ["compare", "{run}"], "summary.json is not UTF-8",
         edit=_write("summary.json", b"\xff\xfe{}")),
    Case("compare-config-binary", "compare: config.toml not UTF-8", ["compare", "{run}"], "config.toml is not UTF-8",
         edit=_write("config.toml", b"\xff\xfe")),
    Case("compare-config-truncated", "compare: config.toml cut off", ["compare", "{run}"],
         "config.toml is cut off or not TOML",
         edit=_write("config.toml", '[model]\nname = "tiny')),
    Case("compare-no-boundary", "compare: config.toml without [boundary]", ["compare", "{run}"],
         "has no [boundary] kind", edit=_write("config.toml", '[model]\nname = "tiny-llama"\n')),
    Case("compare-not-run", "compare: a folder that is not a run", ["compare", "{tmp}"],
         "is not a thinpipe run folder"),
    Case("compare-row-types", "compare (running run): a metrics row with step = 'x'", ["compare", "{run}"],
         "a row is not one thinpipe wrote", edit=_no_summary_and(_write("metrics.jsonl", '{"step": "x", "tokens": 1}\n'
                                                                       '{"step": 1, "tokens": 1}\n'))),
    Case("compare-no-metrics", "compare (running run): no metrics rows", ["compare", "{run}"], "has no metrics yet",
         edit=_no_summary_and(_write("metrics.jsonl", ""))),
    Case("export-adapter-no-lora", "export --lora-save adapter of a run without LoRA",
         ["export", "--run", "{run}", "--out", "{tmp}/hf", "--lora-save", "adapter"],
         "train.lora.rank = 0 trains none"),
    Case("ckpt-edited", "a checkpoint JSON edited by hand", ["export", "--run", "{run}", "--out", "{tmp}/hf"],
         "mesh.json does not match its SHA-256", edit=_edit_json(lambda s: s.replace(STEP, '"step": 3', 1), False)),
    Case("ckpt-no-step", "a checkpoint JSON edited, digests recomputed: a key removed",
         ["export", "--run", "{run}", "--out", "{tmp}/hf"], "does not hold the state thinpipe saves (no key 'step')",
         edit=_edit_json(lambda s: s.replace(STEP + ", ", "", 1))),
    Case("ckpt-tuple", "a checkpoint JSON edited, digests recomputed: a foreign marker",
         ["export", "--run", "{run}", "--out", "{tmp}/hf"], "holds a value thinpipe did not write (TypeError",
         edit=_edit_json(lambda s: s.replace(STEP, '"step": {"__tuple__": 5}', 1))),
    Case("ckpt-float", "a checkpoint JSON edited, digests recomputed: __float__ of a word",
         ["export", "--run", "{run}", "--out", "{tmp}/hf"], "holds a value thinpipe did not write (ValueError",
         edit=_edit_json(lambda s: s.replace(STEP, '"step": {"__float__": "x"}', 1))),
    Case("ckpt-deep", "a checkpoint JSON edited, digests recomputed: nested 200k deep",
         ["export", "--run", "{run}", "--out", "{tmp}/hf"], "nests values thousands deep",
         edit=_edit_json(lambda s: s.replace(STEP, '"step": ' + DEEP, 1))),
    Case("ckpt-swapped", "a checkpoint JSON edited, digests recomputed: a tensor of another shape",
         ["export", "--run", "{run}", "--out", "{tmp}/hf"], "Error(s) in loading state_dict",
         edit=_edit_json(lambda s: s.replace(Q, GATE, 1))),
    Case("ckpt-list", "a checkpoint JSON that is a list", ["export", "--run", "{run}", "--out", "{tmp}/hf"],
         "checkpoint format ? is not 1", edit=_edit_json(lambda s: "[1, 2]")),
    Case("ckpt-digests", "a damaged digest file", ["export", "--run", "{run}", "--out", "{tmp}/hf"],
         "damaged digest file", edit=_write(PART + ".sha256", "{not json")),
    Case("ckpt-tensors-cut", "a cut-off tensor file, digests recomputed", ["export", "--run", "{run}", "--out",
         "{tmp}/hf"],
         "unreadable checkpoint part", edit=_truncate(PART + ".safetensors", redigest=True)),
    Case("run-config-binary", "export: the run's config.toml not UTF-8", ["export", "--run", "{run}", "--out",
         "{tmp}/hf"],
         "config.toml' is not UTF-8 text", edit=_write("config.toml", b"\xff\xfe")),
    Case("eval-edited", "eval --model RUN: checkpoint edited, digests recomputed",
         ["eval", "--model", "{run}", "--tasks", "arc_easy"], "does not hold the state thinpipe saves",
         edit=_edit_json(lambda s: s.replace(STEP + ", ", "", 1))),
    Case("analyze-digests", "analyze: a damaged digest file", ["analyze", "--run", "{run}"], "damaged digest file",
         edit=_write(PART + ".sha256", "[]")),
    Case("prune-cut", "prune: the checkpoint JSON cut off, digests recomputed", ["prune", "--run", "{run}"],
         "unreadable checkpoint part", edit=_edit_json(lambda s: s[:len(s) // 2])),
    Case("resume-step-word", "train --resume: step edited to a word, digests recomputed",
         ["train", "--out", "{run}", "--resume", "--quiet", "--config", "{run}/config.toml"],
         "does not hold the state thinpipe saves", edit=_edit_json(lambda s: s.replace(STEP, '"step": "two"', 1)),
         slow=True),
    Case("disk-full", "a full disk at a checkpoint (ENOSPC)", [*TRAIN, "--set", "train.steps=1"],
         "no space left on device while writing the checkpoint in", patch=_enospc),
    Case("read-only", "a read-only file system at a checkpoint", [*TRAIN, "--set", "train.steps=1"],
         "cannot write the checkpoint in", patch=_erofs, slow=True),
    # ------------------------------------------------------------------ commands and their options
    Case("plan-probe-alone", "plan --probe FILE without --target-tps/--max-mbps", ["plan", "--probe", "{tmp}/p.json"],
         "bounds the advice's quality", {"p.json": "{}"}),
    Case("plan-probe-missing", "plan --probe of a missing file", ["plan", "--probe", "{tmp}/no.json", "--max-mbps",
         "100"],
         "no such file"),
    Case("plan-probe-truncated", "plan --probe of a cut-off probe.json", ["plan", "--probe", "{tmp}/p.json",
         "--max-mbps", "100"], "is not a thinpipe probe result", {"p.json": '{"arms": [{"arm": '}),
    Case("plan-probe-deep", "plan --probe of a probe.json nested 200k deep", ["plan", "--probe", "{tmp}/p.json",
         "--max-mbps", "100"], "is not a thinpipe probe result", {"p.json": DEEP}),
    Case("plan-max-damage", "plan --max-damage -1", ["plan", "--probe", "{tmp}/p.json", "--max-mbps", "100",
         "--max-damage", "-1"], "--max-damage must be >= 0", {"p.json": "{}"}),
    Case("plan-mtbf", "plan --replica-mtbf-h 0", ["plan", "--replica-mtbf-h", "0"], "--replica-mtbf-h must be > 0"),
    Case("plan-restart", "plan --restart-s -1", ["plan", "--restart-s", "-1"], "--restart-s must be >= 0"),
    Case("plan-preset", "plan --preset nope", ["plan", "--preset", "nope"], "unknown preset 'nope'"),
    Case("plan-arch", "plan of a model it has no architecture for", ["plan", "--set", "model.name=tiny-qwen2"],
         "thinpipe plan knows no architecture"),
    Case("plan-number", "plan --target-tps abc", ["plan", "--target-tps", "abc"], "invalid float value: 'abc'"),
    Case("probe-batches", "probe --batches 0", ["probe", "--model", "tiny-llama", "--set", "data.name=synthetic",
         "--batches", "0"], "--batches must be >= 1"),
    Case("probe-kinds", "probe --kinds nope", ["probe", "--model", "tiny-llama", "--set", "data.name=synthetic",
         "--kinds", "nope"], "--kinds: no probe arms for nope"),
    Case("probe-boundaries", "probe --boundaries 7 with mesh.pp = 2", ["probe", "--model", "tiny-llama", "--set",
         "data.name=synthetic", "--set", "mesh.pp=2", "--boundaries", "7"], "--boundaries [7]: boundaries are 0..0"),
    Case("eval-tasks-empty", "eval --tasks ' , '", ["eval", "--tasks", " , "], "--tasks is empty"),
    Case("eval-timeout", "eval --timeout 0", ["eval", "--tasks", "gsm8k", "--timeout", "0"], "--timeout > 0"),
    Case("prune-sparsity-1", "prune --sparsity 1", ["prune", "--run", "{run}", "--sparsity", "1"],
         "--sparsity values must be fractions in [0, 1)"),
    Case("prune-sparsity-word", "prune --sparsity abc", ["prune", "--run", "{run}", "--sparsity", "abc"],
         "--sparsity takes comma-separated fractions"),
    Case("prune-limit", "prune --limit 0", ["prune", "--run", "{run}", "--tasks", "arc_easy", "--limit", "0"],
         "--limit must be >= 1"),
    Case("analyze-batches", "analyze --batches -1", ["analyze", "--run", "{run}", "--batches", "-1"],
         "--batches must be >= 1"),
    Case("compare-out-file", "compare --out FILE", ["compare", "{run}", "--out", "{tmp}/afile"],
         "is a file, not a folder", {"afile": "x"}),
    Case("compare-out-under-file", "compare --out under a file", ["compare", "{run}", "--out", "{tmp}/afile/x"],
         "which is a file", {"afile": "x"}),
    Case("prune-out-file", "prune --out FILE", ["prune", "--run", "{run}", "--out", "{tmp}/afile"],
         "is a file, not a folder", {"afile": "x"}),
    Case("probe-out-file", "probe --out FILE", ["probe", "--model", "tiny-llama", "--set", "data.name=synthetic",
         "--set",
         "mesh.pp=2", "--out", "{tmp}/afile"], "is a file, not a folder", {"afile": "x"}),
    Case("eval-samples-dir", "eval --samples FOLDER", ["eval", "--tasks", "gsm8k", "--samples", "{tmp}"],
         "--samples {tmp} is a folder"),
    Case("eval-samples-under-file", "eval --samples under a file", ["eval", "--tasks", "gsm8k", "--samples",
         "{tmp}/afile/s.json"], "afile is a file, not a folder", {"afile": "x"}),
    Case("compare-nothing", "compare without a run", ["compare"], "the following arguments are required: RUN"),
    Case("export-no-out", "export without --out", ["export", "--run", "{run}"],
         "the following arguments are required: --out"),
    Case("launch-not-train", "launch -- eval", ["launch", "--nproc", "1", "--", "eval", "--tasks", "piqa"],
         "thinpipe launch runs a training job"),
    Case("launch-world", "launch --nproc 3 for a mesh of 2 ranks", ["launch", "--nproc", "3", "--", "train", "--out",
         "{tmp}/out", "--set", "mesh.pp=2"], "needs 2 processes, but 3 were started"),
    Case("launch-bad-option", "launch -- train --bogus (the ranks' arguments)", ["launch", "--nproc", "2", "--",
         "train",
         "--out", "{tmp}/out", "--bogus"], "unrecognized arguments: --bogus"),
    Case("launch-nproc-word", "launch --nproc two", ["launch", "--nproc", "two"], "invalid int value: 'two'"),
    Case("bench-out-dir", "bench --out FOLDER (a JSON file is written there)", ["bench", "--out", "{tmp}"],
         "--out {tmp} is a folder"),
    Case("bench-option", "bench --bogus", ["bench", "--bogus"], "thinpipe bench: unrecognized arguments: --bogus"),
    Case("demo-option", "demo --bogus", ["demo", "--bogus"], "unrecognized arguments: --bogus"),
    Case("train-engine", "train --engine tpu", [*TRAIN, "--engine", "tpu"], "invalid choice: 'tpu'"),
    Case("train-device", "train.device = cuda:x", [*TRAIN, "--set", "train.device=cuda:x"],
         "train.device must be auto"),
    Case("eval-device", "eval --device cuda:x", ["eval", "--tasks", "piqa", "--device", "cuda:x"],
         "'cuda:x' is not a device"),
    # issue 26's boundary settings
    Case("outlier-grid", "boundary.outlier_grid = e8", [*TRAIN, "--set", "boundary.kind=outlier",
                                                        "--set", "boundary.outlier_grid=e8"],
         "boundary.outlier.grid must be minmax or lloyd-max"),
    Case("outlier-fwd-bits", "boundary.outlier_fwd_bits with the wrong number of boundaries",
         [*TRAIN, "--set", "mesh.pp=2", "--set", "boundary.kind=outlier", "--set", "boundary.outlier_fwd_bits=[2,4]"],
         "needs one entry per boundary: 1 with mesh.pp = 2"),
    Case("outlier-bwd-tokens", "boundary.outlier_bwd_tokens = 0", [*TRAIN, "--set", "boundary.kind=outlier",
                                                                 "--set", "boundary.outlier_bwd_tokens=0"],
         "boundary.outlier.bwd_tokens must be in (0, 1]"),
    Case("outlier-bwd-select", "boundary.outlier_bwd_select = random", [*TRAIN, "--set", "boundary.kind=outlier",
                                                                      "--set", "boundary.outlier_bwd_select=random"],
         "bwd_select one of ('top', 'sample')"),
    Case("compress-mask", "boundary.compress = fwd on a mask boundary", [*TRAIN, "--set", "boundary.kind=mask",
                                                                       "--set", "boundary.compress=fwd"],
         "boundary.compress = fwd is an outlier setting"),
    # after SFT (docs/rl.md)
    Case("gspo-corpus", "train.objective = gspo on a built-in corpus", [*TRAIN, "--set", "train.objective=gspo",
                                                                     "--set", "rl.max_response_tokens=8"],
         "reads a user's files"),
    Case("gspo-no-answer", "a GSPO prompt row without an answer", [*DATA, "--set", "train.objective=gspo",
                                                                 "--set", "rl.max_response_tokens=8"],
         'needs "prompt" (or "messages") and "answer"', files={"d.jsonl": _jsonl({"prompt": "2+2="})}),
    Case("dpo-no-rejected", "a DPO row without rejected", [*DATA, "--set", "train.objective=dpo"],
         'needs "prompt", "chosen" and "rejected"', files={"d.jsonl": _jsonl({"prompt": "2+2=", "chosen": "4"})}),
    Case("gspo-aqsgd", "train.objective = gspo with boundary.kind = aqsgd",
         [*DATA, "--set", "train.objective=gspo", "--set", "rl.max_response_tokens=8", "--set", "mesh.pp=2",
          "--set", "boundary.kind=aqsgd", "--set", "data.val_fraction=0.5"], "changes its state in every forward",
         files={"d.jsonl": _jsonl(*[{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(8)])}),
    Case("rl-group", "rl.group_size = 1", [*TRAIN, "--set", "train.objective=gspo", "--set", "rl.group_size=1"],
         "a group needs at least 2 rollouts"),
    Case("generate-temperature", "generate --temperature -1", ["generate", "--model", "tiny-llama", "--prompt", "x",
                                                               "--temperature", "-1"], "temperature"),
    Case("family-refused", "a model folder of an unsupported family (jamba: attention and state-space layers)",
         ["train", "--out", "{tmp}/out", "--set", "model.name={tmp}/jamba"], "model family 'jamba' is not supported "
         "(a hybrid of attention and state-space layers",
         files={"jamba/config.json": json.dumps({"model_type": "jamba", "num_hidden_layers": 2})}),
    Case("family-option", "a Falcon folder with ALiBi (its bias rides on the whole batch's mask)",
         ["train", "--out", "{tmp}/out", "--set", "model.name={tmp}/falcon"], "falcon with alibi = true",
         files={"falcon/config.json": json.dumps({"model_type": "falcon", "num_hidden_layers": 2, "alibi": True})}),
    Case("ppl-missing", "eval --perplexity of a missing file",
         ["eval", "--model", "tiny-llama", "--perplexity", "{tmp}/none.jsonl"], "no such file"),
    Case("ppl-no-text", "an eval --perplexity row without text",
         ["eval", "--model", "tiny-llama", "--perplexity", "{tmp}/p.jsonl"], 'line 2: each line is an object with a '
         'non-empty "text"', files={"p.jsonl": _jsonl({"text": "fine"}, {"prompt": "no text"})}),
    Case("eval-nothing", "eval with neither --tasks nor --perplexity", ["eval", "--model", "tiny-llama"],
         "give --tasks"),
    Case("eval-run-set", "eval --set mesh.pp=2 on a run folder", ["eval", "--model", "{run}", "--perplexity",
                                                                  "{tmp}/p.jsonl", "--set", "mesh.pp=2"],
         "--set takes only train.device there", files={"p.jsonl": _jsonl({"text": "fine"})}, slow=True),
]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """A tiny run, 2 steps on 2 stages (a few seconds), that each run-folder case copies and damages."""
    out = tmp_path_factory.mktemp("tiny") / "run"
    assert main(["train", "--out", str(out), *TINY, "--set", "train.steps=2", "--set", "mesh.pp=2"]) == 0
    assert Path(f"{out / PART}.json").is_file()
    return out


def _fill(text: str, tmp: Path, run: Path | None) -> str:
    return text.replace("{tmp}", str(tmp)).replace("{run}", str(run))


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=[pytest.mark.slow] if c.slow else []) for c in CASES])
def test_bad_input_is_one_line_exit_2(case: Case, request, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # the plugin cases' modules
    for name in CLEARED:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("THINPIPE_CACHE", str(tmp_path / "cache"))
    run = None
    if any("{run}" in a for a in case.args):
        run = tmp_path / "run"
        shutil.copytree(request.getfixturevalue("tiny_run"), run)
        if case.edit is not None:
            case.edit(run)
    for name, data in case.files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data) if isinstance(data, bytes) else path.write_text(data)
    for k, v in case.env.items():
        monkeypatch.setenv(k, _fill(v, tmp_path, run))
    if case.patch is not None:
        case.patch(monkeypatch)
    capsys.readouterr()  # the fixture's training output is not the case's
    code = main([_fill(a, tmp_path, run) for a in case.args])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err, err
    assert code == 2 and len(lines) == 1, (code, err)
    assert lines[0].startswith("error: ") and _fill(case.message, tmp_path, run) in lines[0], lines[0]


@pytest.mark.slow  # three tiny runs (~10 s)
def test_a_full_disk_at_a_checkpoint_loses_nothing(tmp_path, monkeypatch, capsys):
    """ENOSPC at the checkpoint of step 2: one line, and --resume (space freed) continues from the checkpoint
    of step 1 to the same losses as a run that never ran out of space."""
    import thinpipe.checkpoint as ck

    args = [*TINY, "--set", "train.steps=3", "--set", "train.checkpoint_every=1"]
    assert main(["train", "--out", str(tmp_path / "full"), *args]) == 0
    real = ck._write_atomic

    def full_at_step_2(path, write):
        if path.parent.name == "step00000002":
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, write)

    monkeypatch.setattr(ck, "_write_atomic", full_at_step_2)
    out = tmp_path / "part"
    assert main(["train", "--out", str(out), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: no space left on device while writing the checkpoint in ") and "\n" not in err
    monkeypatch.setattr(ck, "_write_atomic", real)
    assert main(["train", "--out", str(out), "--resume", "--quiet", "--config", str(out / "config.toml")]) == 0
    losses = [[json.loads(x)["loss"] for x in (d / "metrics.jsonl").read_text().splitlines()]
              for d in (tmp_path / "full", out)]
    assert losses[0] == losses[1] and len(losses[0]) == 3


def test_a_schedule_whose_lr_rounds_to_zero_is_refused_and_a_small_one_is_not():
    from thinpipe.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="rounds to zero in float32"):
        load_config(None, ["train.lr=1e-39"])
    assert load_config(None, ["train.lr=1e-30", "train.steps=10000000"]).train.steps == 10**7  # the limits themselves


@pytest.mark.parametrize("command", ["train", "eval", "generate", "export", "prune", "analyze", "plan", "probe",
                                     "compare", "bench", "launch", "demo"])
def test_every_command_has_help(command, capsys):
    assert main([command, "--help"]) == 0
    out = capsys.readouterr()
    assert "usage:" in out.out and "Traceback" not in out.err


def test_docs_table_lists_every_case():
    """docs/reliability.md's table and CASES are the same cases: each row names its test id."""
    section = DOCS.read_text().split("## Bad input is one line", 1)[1].split("\n## ", 1)[0]
    documented = re.findall(r"^\| \d+ \| .* \| `([a-z0-9-]+)` \|$", section, flags=re.M)
    assert sorted(documented) == sorted(c.id for c in CASES)
    assert len(CASES) == len({c.id for c in CASES}) >= 100


# ---------------------------------------------------------------------- thinpipe launch: once per job, not per rank

def _launch(tmp_path, *sets: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "thinpipe", "launch", "--nproc", "2", "--", "train", "--out",
                           str(tmp_path / "job"), "--set", "model.name=tiny-llama", "--set", "data.name=synthetic",
                           "--set", "mesh.pp=2", *sets], capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in __import__("os").environ.items() if k not in CLEARED})


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("sets, message", [
    # found by every rank once its stage of the model is loaded (the launcher cannot see it before)
    (["--set", "boundary.kind=mapl", "--set", "boundary.rank=100"], "boundary.rank must be in [1, 64], got 100"),
    # found by every rank before it joins the job
    (["--set", "data.val_name=/no/such.jsonl"], "is neither a built-in corpus"),
])
def test_launch_prints_a_bad_input_once_not_once_per_rank(tmp_path, sets, message):
    r = _launch(tmp_path, *sets)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr
