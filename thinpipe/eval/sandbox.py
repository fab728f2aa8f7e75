"""Run model-generated code (HumanEval, MBPP) where it can do little harm (docs/security.md: the sandbox).

The risk: a model's completion is arbitrary Python. It may loop forever, exhaust memory, fork, read
or overwrite files, talk to the network, or try to undo the isolation itself. The program runs:

- **with no privilege**: no capabilities (effective, permitted, inheritable, ambient and bounding
  sets all empty) and ``no_new_privs`` (setuid binaries and file capabilities give nothing). Run as
  root, it runs under a dedicated unprivileged uid/gid (a random one from a high range, no
  supplementary groups), so root-only files stay unreadable and its process count is its own;
- **in its own namespaces**: mount, PID (a fresh ``/proc`` that shows only the sandbox's
  processes, so no ``setns`` through ``/proc/<host pid>/ns``), network (no interface but its own
  loopback: neither the internet nor the host's 127.0.0.1, nor the host's abstract unix sockets),
  IPC, UTS and user (unprivileged callers);
- **on a file system built for it**: an empty read-only root holding read-only binds of ``/usr``,
  ``/bin``/``/lib*``, ``/etc/ld.so.cache`` and the interpreter's prefixes (``sys.prefix``,
  ``sys.base_prefix``: the venv and its base Python), the null/zero/random devices, a fresh
  ``/proc``, and one writable directory, ``/scratch`` (its cwd, HOME and TMPDIR; deleted
  afterwards). Everything else (``/root``, ``/home``, ``/tmp``, ``/run``, ``/var``, the rest of
  ``/etc``, the caller's own files) is not there at all;
- **within limits**: a wall-clock timeout (the whole sandbox is SIGKILLed), RLIMIT_CPU as a backstop,
  RLIMIT_AS ``memory_mb`` per process, RLIMIT_FSIZE ``file_mb`` (its output too: stdout goes to a
  file, not to the caller's memory), RLIMIT_NPROC ``MAX_PROCESSES`` (a fork bomb stops there),
  no core dumps, no standard input, ``python -I`` in a minimal environment.

Two backends, the same layout: **bubblewrap** (``bwrap``, Debian's ``bubblewrap``), preferred where
it is installed; else **util-linux** ``unshare`` (namespaces; ``--map-root-user`` only for the setup
when unprivileged) + a small setup in ``python -I -S`` (the root, with mount(2) and pivot_root(2)) +
``setpriv`` (drop the uid and every capability, ``no_new_privs``) + ``prlimit`` (the process limit,
set inside the program's own user namespace so the caller's other processes do not count). Every
setup step fails loudly: if any mount, namespace or privilege drop is refused, the program is not run
and ``SandboxUnavailable`` says which step failed. Mounts made ro stay ro: the program has no
CAP_SYS_ADMIN over its mount namespace, and a user namespace it creates itself (bubblewrap forbids
them; the fallback lets the kernel lock every inherited mount in it) cannot remount them read-write.

Not covered: kernel exploits (the program can make any system call; no seccomp filter); memory is
limited per process, so the total is up to ``MAX_PROCESSES`` x ``memory_mb`` (no cgroup); the disk
in ``/scratch`` is limited per file, not in total; CPU time is bounded by the timeout, not shared
fairly. Run evaluations on a machine you are prepared to lose. tests/unit/eval/test_sandbox.py tries each
escape, as root and as an unprivileged user, under each backend installed.
"""

from __future__ import annotations

# the standard library only: tests run this file alone, as an unprivileged user who cannot import thinpipe
import json
import os
import resource
import secrets
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

READY = "__thinpipe_sandbox_ready__"  # printed inside the finished sandbox, just before the program
SCRATCH = "/scratch"  # the program's cwd, HOME and TMPDIR, the one writable place
MAX_PROCESSES = 32    # RLIMIT_NPROC: the program's tasks (processes and threads) in its user namespace
BACKENDS = ("bwrap", "unshare")
_UID_BASE, _UID_SPAN = 1_900_000_000, 1 << 20  # dedicated uids when run as root: far above any real account's
_TOOL_PATH = "/usr/bin:/bin:/usr/sbin:/sbin"
_DEVICES = ("null", "zero", "full", "random", "urandom")
_ENV = {"PATH": "/usr/bin:/bin", "HOME": SCRATCH, "TMPDIR": SCRATCH, "LANG": "C.UTF-8"}


class SandboxUnavailable(RuntimeError):
    """This machine cannot isolate generated code (no tool, or a namespace, mount or drop was refused)."""


@dataclass
class SandboxResult:
    status: str          # "passed" (exit 0), "failed" (non-zero exit), "timeout"
    returncode: int | None
    output_tail: str


def _tool(name: str) -> str | None:
    return shutil.which(name, path=_TOOL_PATH)


def available_backends() -> list[str]:
    """The backends whose tools are installed here, preferred first."""
    core = all(_tool(t) for t in ("setpriv", "prlimit", "unshare", "sh"))  # util-linux, and a shell
    found = []
    if core and _tool("bwrap"):
        found.append("bwrap")
    if core:
        found.append("unshare")
    return found


@lru_cache(maxsize=1)
def _bwrap_options() -> list[str]:
    """Newer bubblewraps' options, where this one has them: forbid the program user namespaces of its own
    (>= 0.8), and no reaper, so the program is PID 1 and the namespace dies with it (>= 0.5)."""
    out = subprocess.run([_tool("bwrap"), "--help"], capture_output=True, text=True).stdout
    return [opt for opt in ("--disable-userns", "--as-pid-1") if opt in out]


def _ids_mapped(path: str, first: int, count: int) -> bool:
    try:
        rows = [tuple(map(int, line.split())) for line in Path(path).read_text().splitlines() if line.strip()]
    except OSError:
        return False
    return any(inner <= first and first + count <= inner + n for inner, _outer, n in rows)


def _dedicated_id() -> int:
    """A uid (used as the gid too) that owns nothing and runs nothing else: RLIMIT_NPROC counts per uid."""
    if all(_ids_mapped(f"/proc/self/{m}_map", _UID_BASE, _UID_SPAN) for m in ("uid", "gid")):
        return _UID_BASE + secrets.randbelow(_UID_SPAN)
    return 65534  # a container that maps few ids: nobody, shared with other nobody processes


def _layout() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(read-only binds as (source, destination), symlinks as (target, link)): what Python needs, no more."""
    binds, links = [("/usr", "/usr")], []
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            links.append((os.readlink(top), top))
        elif os.path.isdir(top):
            binds.append((top, top))
    if os.path.isfile("/etc/ld.so.cache"):
        binds.append(("/etc/ld.so.cache", "/etc/ld.so.cache"))
    covered = [dest for _, dest in binds] + [link for _, link in links]
    for prefix in (sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix):
        p = os.path.abspath(prefix)
        if not any(p == c or p.startswith(c.rstrip("/") + "/") for c in covered):
            binds.append((p, p))
            covered.append(p)
    return binds, links


def _reachable_by_others(path: str) -> bool:
    """Whether a uid that is neither the owner nor in the group can walk to ``path`` (x on it and each parent)."""
    p = Path(os.path.realpath(path))
    for d in [*reversed(p.parents), p]:
        try:
            st = os.stat(d)
        except OSError:
            return False
        if stat.S_ISDIR(st.st_mode) and not st.st_mode & stat.S_IXOTH:
            return False
    return True


def _limits(memory_mb: int, cpu_s: int, file_mb: int):
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_mb << 20, file_mb << 20))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


def _program(python: str) -> list[str]:
    """The last step, inside the finished sandbox: the process limit, the marker, the program."""
    n = MAX_PROCESSES
    marker_then_exec = f'echo {READY} && exec "$0" -I prog.py'
    return [_tool("prlimit"), f"--nproc={n}:{n}", "--", "/bin/sh", "-c", marker_then_exec, python]


def _bwrap_argv(base: Path, scratch: Path, uid: int | None) -> list[str]:
    """bubblewrap, run as the dedicated uid when we are root (so it builds the sandbox in a user namespace of
    that uid's, as it does for any unprivileged caller); it drops every capability and sets no_new_privs."""
    binds, links = _layout()
    argv = [_tool("bwrap"), "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session", *_bwrap_options()]
    stage: list[tuple[str, str]] = []  # root: what the dedicated uid cannot walk to is bound where it can first
    sources = {}
    for src in [s for s, _ in binds] + [str(scratch)]:
        if uid is not None and not _reachable_by_others(src):
            sources[src] = str(base / f"stage{len(stage)}")
            stage.append((src, sources[src]))
        else:
            sources[src] = src
    for target, link in links:
        argv += ["--symlink", target, link]
    for src, dest in binds:
        argv += ["--ro-bind", sources[src], dest]
    argv += ["--bind", sources[str(scratch)], SCRATCH, "--proc", "/proc", "--dev", "/dev",
             "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", SCRATCH, "--clearenv"]
    for k, v in _ENV.items():
        argv += ["--setenv", k, v]
    argv += ["--", *_program(sys.executable)]
    if uid is None:
        return argv
    argv = [_tool("setpriv"), f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
            "--bounding-set=-all", "--", *argv]
    if not stage:
        return argv
    base.chmod(0o711)
    for src, dest in stage:
        Path(dest).mkdir() if os.path.isdir(src) else Path(dest).touch()
    binds_sh = "; ".join(f"mount --bind {shlex.quote(s)} {shlex.quote(d)}" for s, d in stage)
    return [_tool("unshare"), "--mount", "--propagation", "private", "--", "/bin/sh", "-c",
            f'set -eu; {binds_sh}; exec "$@"', "sh", *argv]


# Builds the root inside the new namespaces (as root, or as the root of a new user namespace) with mount(2) and
# pivot_root(2) directly: one process instead of a shell and some twenty mount commands. Any refused step exits
# non-zero with the step's name before the marker is printed, so the program is not run.
_SETUP = r"""
import ctypes, json, os, sys
spec = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
RDONLY, NOSUID, NODEV, NOEXEC, REMOUNT, BIND = 1, 2, 4, 8, 32, 4096
def check(ok, what):
    if not ok:
        sys.exit("sandbox setup: %s: %s" % (what, os.strerror(ctypes.get_errno())))
def mount(src, dst, fstype, flags, data=None):
    enc = lambda s: s.encode() if s is not None else None
    check(libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)) == 0, "mount %s on %s" % (src, dst))
def bind(src, dst, flags):
    mount(src, dst, None, BIND)
    mount(None, dst, None, REMOUNT | BIND | flags)
root = spec["root"]
mount("thinpipe-sandbox", root, "tmpfs", NOSUID | NODEV, "mode=0755,size=1m")
for d in spec["dirs"]:
    os.makedirs(root + d, exist_ok=True)
for f in spec["files"]:
    os.makedirs(os.path.dirname(root + f), exist_ok=True)
    open(root + f, "w").close()
for target, link in spec["links"]:
    os.symlink(target, root + link)
for src, dst in spec["binds"]:
    bind(src, root + dst, RDONLY | NOSUID | NODEV)
for dev in spec["devices"]:
    mount(dev, root + dev, None, BIND)
mount("proc", root + "/proc", "proc", NOSUID | NODEV | NOEXEC)
bind(spec["scratch"], root + spec["scratch_at"], NOSUID | NODEV)
os.mkdir(root + "/.old")
check(libc.syscall(spec["nr_pivot_root"], root.encode(), (root + "/.old").encode()) == 0, "pivot_root")
os.chdir("/")
check(libc.umount2(b"/.old", 2) == 0, "detach the old root")
os.rmdir("/.old")
mount(None, "/", None, REMOUNT | BIND | RDONLY | NOSUID | NODEV)
os.chdir(spec["scratch_at"])
os.execv(spec["argv"][0], spec["argv"])
"""
_NR_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "arm64": 41, "riscv64": 41, "ppc64le": 203, "ppc64": 203,
                  "s390x": 217, "i686": 217, "i386": 217, "armv7l": 218, "loongarch64": 41}


def _unshare_argv(base: Path, scratch: Path, uid: int | None) -> list[str]:
    """util-linux ``unshare`` (the namespaces), the setup above (the root), then ``setpriv`` (drop the uid when
    root, every capability, no_new_privs) and ``prlimit`` (the process limit) before the program."""
    nr = _NR_PIVOT_ROOT.get(os.uname().machine)
    if nr is None:
        raise SandboxUnavailable(f"the unshare backend does not know pivot_root's number on {os.uname().machine}: "
                                 "install bubblewrap (apt-get install bubblewrap)")
    binds, links = _layout()
    root = base / "root"
    root.mkdir()
    drop = [_tool("setpriv")]
    if uid is not None:
        drop += [f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    drop += ["--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
    spec = {"root": str(root), "binds": binds, "links": links, "scratch": str(scratch), "scratch_at": SCRATCH,
            "dirs": [d for s, d in binds if os.path.isdir(s)] + ["/dev", "/proc", SCRATCH],
            "files": [d for s, d in binds if not os.path.isdir(s)] + [f"/dev/{n}" for n in _DEVICES],
            "devices": [f"/dev/{n}" for n in _DEVICES], "nr_pivot_root": nr,
            "argv": drop + _program(sys.executable)}
    namespaces = ["--mount", "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child", "--propagation", "private"]
    if uid is None:  # unprivileged: a user namespace, whose root only builds the sandbox
        namespaces = ["--user", "--map-root-user"] + namespaces
    return [_tool("unshare"), *namespaces, "--", sys.executable, "-I", "-S", "-c", _SETUP, json.dumps(spec)]


def _run_once(backend: str, code: str, timeout_s: float, memory_mb: int, file_mb: int) -> SandboxResult | str:
    """The program's result, or why the sandbox could not be set up (the program was then not run)."""
    with tempfile.TemporaryDirectory(prefix="thinpipe-sandbox-") as tmp:
        base = Path(tmp)
        scratch = base / "scratch"
        scratch.mkdir()
        (scratch / "prog.py").write_text(code)
        uid = _dedicated_id() if os.geteuid() == 0 else None
        if uid is not None:
            os.chown(scratch, uid, uid)
            os.chown(scratch / "prog.py", uid, uid)
        argv = (_bwrap_argv if backend == "bwrap" else _unshare_argv)(base, scratch, uid)
        with open(base / "output", "w+b") as out:
            proc = subprocess.Popen(argv, cwd="/", env=dict(_ENV, PATH=_TOOL_PATH), stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                    preexec_fn=_limits(memory_mb, int(timeout_s) + 2, file_mb))
            try:
                proc.wait(timeout=timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the namespaces' init dies with it, and the PID namespace
                proc.wait()
                timed_out = True
            out.seek(0)
            text = out.read().decode(errors="replace")
    if timed_out:
        return SandboxResult("timeout", None, text.split(READY + "\n", 1)[-1][-2000:])
    if READY + "\n" not in text:
        return f"setup failed (exit {proc.returncode}): " + " ".join(text.split())[-300:]
    text = text.split(READY + "\n", 1)[1]
    return SandboxResult("passed" if proc.returncode == 0 else "failed", proc.returncode, text[-2000:])


def run_sandboxed(code: str, timeout_s: float = 10.0, memory_mb: int = 2048, file_mb: int = 16, *,
                  _backend: str | None = None) -> SandboxResult:
    """Run ``code`` as a Python program in the sandbox; "passed" iff it exits 0 in time.

    ``_backend`` ("bwrap" or "unshare") is for tests; by default bubblewrap, else unshare + setpriv."""
    if _backend is not None and _backend not in BACKENDS:
        raise ValueError(f"unknown sandbox backend {_backend!r}: one of {', '.join(BACKENDS)}")
    found = available_backends()
    backends = [b for b in found if _backend in (None, b)]
    if not backends:
        want = f"the {_backend} backend" if _backend else "bubblewrap (bwrap) or util-linux (unshare, setpriv, prlimit)"
        raise SandboxUnavailable(f"cannot isolate generated code here: {want} is not installed; install it "
                                 "(apt-get install bubblewrap); generated code is never run unprotected")
    reasons = []
    for backend in backends:
        result = _run_once(backend, code, timeout_s, memory_mb, file_mb)
        if isinstance(result, SandboxResult):
            return result
        reasons.append(f"{backend}: {result}")
    raise SandboxUnavailable(
        f"cannot isolate generated code here ({'; '.join(reasons)}): run code evaluation as root or where "
        "unprivileged user namespaces are enabled; generated code is never run unprotected")
