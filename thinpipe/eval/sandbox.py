"""Run model-generated code (HumanEval, MBPP) where it can do little harm.

The risk: a model's completion is arbitrary Python. It may loop forever, exhaust memory, fork,
delete or overwrite files, or talk to the network. The safeguards, each enforced by the kernel
rather than by Python:

- **namespaces** (``unshare``): a new mount namespace in which every mount is re-mounted read-only
  except a fresh scratch directory (the program's cwd and HOME, deleted afterwards); a new network
  namespace with no interfaces (no network at all); a new PID namespace, so the program sees only
  itself and everything in it dies with it;
- **time**: a wall-clock timeout, after which the whole process group is SIGKILLed (and the PID
  namespace with it), plus an RLIMIT_CPU backstop;
- **resources**: RLIMIT_AS (memory), RLIMIT_FSIZE (largest file it may write), RLIMIT_CORE 0;
- **interpreter**: ``python -I`` (no user site-packages, no PYTHON* variables) with a minimal
  environment.

Namespaces need root, or unprivileged user namespaces (then ``--map-root-user`` is used). Where
neither is available generated code is not run at all: ``SandboxUnavailable`` says so, rather than
running it unprotected. Not covered: kernel exploits, and reading files the user can read (the file
system is read-only to it, not invisible); run evaluations on a machine you are prepared to lose.
"""

from __future__ import annotations

import os
import resource
import shlex
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

READY = "__thinpipe_sandbox_ready__"  # printed once the namespaces are set up, just before the program


class SandboxUnavailable(RuntimeError):
    """This machine cannot isolate generated code (no root, no unprivileged user namespaces)."""


@dataclass
class SandboxResult:
    status: str          # "passed" (exit 0), "failed" (non-zero exit), "timeout"
    returncode: int | None
    output_tail: str


def _wrapper(scratch: str, python: str) -> str:
    q = shlex.quote(scratch)
    return (
        "mount --make-rprivate / || exit 1; "
        # every mount read-only (deepest first), then the scratch directory as the one writable mount
        "for m in $(awk '{print $2}' /proc/self/mounts | sort -r); do mount -o remount,bind,ro \"$m\" 2>/dev/null; done; "
        f"mount --bind {q} {q} && mount -o remount,bind,rw {q} || exit 1; "
        f"cd {q} && echo {READY} && exec {shlex.quote(python)} -I prog.py"
    )


def _limits(memory_mb: int, cpu_s: int, file_mb: int):
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_mb << 20, file_mb << 20))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


def run_sandboxed(code: str, timeout_s: float = 10.0, memory_mb: int = 2048, file_mb: int = 16) -> SandboxResult:
    """Run ``code`` as a Python program in the sandbox; "passed" iff it exits 0 in time."""
    base = ["unshare", "--mount", "--net", "--pid", "--fork", "--kill-child"]
    attempts = [base] if os.geteuid() == 0 else [base + ["--map-root-user"]]
    with tempfile.TemporaryDirectory(prefix="thinpipe-sandbox-") as scratch:
        Path(scratch, "prog.py").write_text(code)
        env = {"PATH": "/usr/bin:/bin", "HOME": scratch, "LANG": "C.UTF-8", "TMPDIR": scratch}
        for cmd in attempts:
            proc = subprocess.Popen(cmd + ["sh", "-c", _wrapper(scratch, sys.executable)], cwd=scratch, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                                    preexec_fn=_limits(memory_mb, int(timeout_s) + 2, file_mb))
            try:
                out, _ = proc.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, _ = proc.communicate()
                return SandboxResult("timeout", None, out.decode(errors="replace").replace(READY + "\n", "")[-2000:])
            text = out.decode(errors="replace")
            if READY not in text:  # the namespaces were refused: never run the program without them
                continue
            text = text.split(READY + "\n", 1)[-1]
            return SandboxResult("passed" if proc.returncode == 0 else "failed", proc.returncode, text[-2000:])
    raise SandboxUnavailable(
        "cannot isolate generated code here (unshare of mount/net/pid namespaces was refused): run code "
        "evaluation as root or where unprivileged user namespaces are enabled; it is never run unprotected")
