"""The job key: a secret every rank of one job holds, so a peer proves it belongs (docs/security.md).

A key is 32 random bytes, written as 64 hex characters in a file only its owner can read.
``thinpipe launch`` makes one for each job in a private temporary folder and passes its path to its
ranks in ``$THINPIPE_JOB_KEY_FILE`` (never the key itself: environments and logs get copied around);
a job across machines makes one with ``thinpipe keygen FILE``, copies it to every machine, and sets
the variable there. The key never enters a config file, a run folder or a log line.

From the key each use derives its own sub-key (``derive``), so a MAC of one kind of message can
never be replayed as another: point-to-point payloads (``comm/wire_auth.py``) and the recovery
states that healing replicas receive (``comm/recovery.py``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

from thinpipe.config import ConfigError

KEY_ENV = "THINPIPE_JOB_KEY_FILE"
KEY_BYTES = 32
MAC_BYTES = 32  # HMAC-SHA256


def write_key_file(path: str | Path) -> Path:
    """A new random key in ``path`` (created with mode 0600; an existing file is never replaced)."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ConfigError(f"{path} exists: a job key is never overwritten; choose another file") from None
    except OSError as e:
        raise ConfigError(f"cannot create the job key file {path}: {e.strerror}") from None
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(KEY_BYTES) + "\n")
    return path


def read_key_file(path: str | Path) -> bytes:
    """The key in ``path``; one line if the file is missing, readable by others, or not a key."""
    path = Path(path)
    try:
        st = path.stat()
        text = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read the job key file {path} (${KEY_ENV}): "
                          f"{getattr(e, 'strerror', None) or 'not a key file'}") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"the job key file {path} can be read by other users: chmod 600 {path}")
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise ConfigError(f"{path} is not a job key ({2 * KEY_BYTES} hex characters): make one with "
                          "`thinpipe keygen FILE`")
    return key


def job_key(where: str) -> bytes:
    """This process's job key (from ``$THINPIPE_JOB_KEY_FILE``); ``where`` names what needs it."""
    path = os.environ.get(KEY_ENV)
    if not path:
        raise ConfigError(f"{where} needs a job key so that peers can prove they belong: `thinpipe launch` makes one; "
                          f"across machines run `thinpipe keygen KEYFILE`, copy KEYFILE to every machine and set "
                          f"{KEY_ENV}=KEYFILE for each rank (docs/security.md)")
    return read_key_file(path)


def derive(key: bytes, purpose: str) -> bytes:
    """The sub-key of ``key`` for one ``purpose`` (HKDF-style: an HMAC of the purpose's name)."""
    return hmac.new(key, b"thinpipe/" + purpose.encode(), hashlib.sha256).digest()


def mac(key: bytes, *parts) -> bytes:
    """HMAC-SHA256 over ``parts`` (bytes-like objects, each prefixed with its length so that no two
    different sequences of parts give the same input)."""
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        m = memoryview(p).cast("B")
        h.update(len(m).to_bytes(8, "little"))
        h.update(m)
    return h.digest()


def same(a: bytes, b: bytes) -> bool:
    """Constant-time comparison of two MACs."""
    return hmac.compare_digest(a, b)
