"""The sandbox for generated code holds (issue 25 point 1, docs/security.md): each escape that got out of the old
one fails, under each backend installed here, run as root and as an unprivileged user, while a correct program
still passes.

Each (backend, identity) pair runs every program below once (a module-scoped fixture); the tests then read their
results. "user" runs the sandbox's own caller as uid 65534 with no capabilities (``setpriv``), in a subprocess, when
the test process is root; when it is not root, the test process itself is the user.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from thinpipe.eval import sandbox
from thinpipe.eval.sandbox import MAX_PROCESSES, SandboxUnavailable, run_sandboxed

USER = 65534  # nobody: the unprivileged caller
TOKEN = uuid.uuid4().hex[:12]  # names of the files an escape would leave on the host
PREFIX = os.path.abspath(sys.base_prefix)  # bound read-only into every sandbox

# Runs the programs below with a given run_sandboxed: in this process ("root"), or in a subprocess as USER
# ("user", fed JSON on stdin). It plants the files that no program may read (owned by whoever calls the
# sandbox: readable by it, so only the sandbox can hide them) in a temporary directory outside the scratch one.
HARNESS = r'''
import json, os, sys, tempfile, time, types

def plant():
    d = tempfile.mkdtemp(prefix="thinpipe-planted-")
    os.chmod(d, 0o755)
    for name, mode in (("secret600", 0o600), ("secret644", 0o644)):
        p = os.path.join(d, name)
        with open(p, "w") as f:
            f.write("PLANTED-" + name)
        os.chmod(p, mode)
    return d

def run_cases(mod, programs, backend, timeout_s):
    """Each program's [status, returncode, output, seconds]; "owner": the host uid that owns what it wrote."""
    planted = plant()
    out = {"planted": planted, "results": {}}
    real = mod.tempfile

    class Watched(real.TemporaryDirectory):  # sees the scratch directory before the sandbox deletes it
        def cleanup(self):
            p = os.path.join(self.name, "scratch", "owned.txt")
            if os.path.exists(p):
                out["owner"] = os.stat(p).st_uid
            super().cleanup()

    mod.tempfile = type("tempfile", (), {"TemporaryDirectory": Watched})
    try:
        for name, code in programs.items():
            t0 = time.perf_counter()
            r = mod.run_sandboxed(code.replace("@PLANTED@", planted), timeout_s=timeout_s, _backend=backend)
            out["results"][name] = [r.status, r.returncode, r.output_tail, time.perf_counter() - t0]
    finally:
        mod.tempfile = real
    return out

if __name__ == "__main__":
    job = json.load(sys.stdin)
    mod = types.ModuleType("sandbox_under_test")
    sys.modules[mod.__name__] = mod  # dataclasses look their module up
    exec(compile(job["source"], "sandbox.py", "exec"), mod.__dict__)
    try:
        print(json.dumps(run_cases(mod, job["programs"], job["backend"], job["timeout_s"])))
    except mod.SandboxUnavailable as e:
        print(json.dumps({"unavailable": str(e)}))
'''

COMMON = r'''
import ctypes, errno, json, os, socket
libc = ctypes.CDLL(None, use_errno=True)
def err():
    return errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
def attempt(f):
    try:
        f()
        return "ok"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))
def write(path):
    def f():
        with open(path, "w") as fh:
            fh.write("escaped")
    return attempt(f)
'''


def _programs(port: int, abstract: str) -> dict[str, str]:
    escape = f"thinpipe-escape-{TOKEN}"
    outside = [f"/usr/{escape}", f"{PREFIX}/{escape}", f"/{escape}", f"/etc/{escape}", f"/dev/{escape}",
               f"/dev/shm/{escape}", f"/tmp/{escape}", f"/proc/{escape}", f"@PLANTED@/{escape}"]
    connect = f'''
def connect():
    res = {{}}
    res["tcp"] = attempt(lambda: socket.create_connection(("127.0.0.1", {port}), timeout=2).close())
    def unix():
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(2)
        s.connect("\\0{abstract}")
    res["abstract_unix"] = attempt(unix)
    return res
'''
    return {
        "correct": COMMON + '''
with open("note.txt", "w") as f:
    f.write("hello from scratch")
print(json.dumps({"read": open("note.txt").read(), "cwd": os.getcwd(), "listed": sorted(os.listdir("."))}))
''',
        "privileges": COMMON + '''
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
open("owned.txt", "w").write("whose?")  # the harness reads its owner on the host
print(json.dumps({k: status[k].strip() for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs")}
                 | {"groups": os.getgroups()}))
''',
        "remount": COMMON + f'''
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND = 1, 2, 4, 32, 4096
targets = ["/", "/usr", {PREFIX!r}, "/proc"]
def remount_rw():
    res = {{}}
    for t in targets:
        for extra in (0, MS_NOSUID | MS_NODEV):  # with the flags the kernel may have locked kept as they are
            r = libc.mount(b"none", t.encode(), None, MS_REMOUNT | MS_BIND | extra, None)
            res[f"{{t}}:{{extra}}"] = "ok" if r == 0 else err()
    r = libc.mount(b"none", b"/", b"tmpfs", MS_REMOUNT, None)  # the root's superblock itself
    res["/:superblock"] = "ok" if r == 0 else err()
    res["umount /usr"] = "ok" if libc.umount2(b"/usr", 2) == 0 else err()
    return res
def writes():
    return {{p: write(p) for p in {outside!r}}}
out = {{"remount": remount_rw(), "writes": writes()}}
# the same again from a user namespace of its own (with every capability in it), if it may create one
CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000
out["userns"] = "ok" if libc.unshare(CLONE_NEWUSER | CLONE_NEWNS) == 0 else err()
if out["userns"] == "ok":
    out["remount_in_userns"] = remount_rw()
    out["writes_in_userns"] = writes()
mounts = [line.split() for line in open("/proc/self/mounts")]
out["rw_mounts"] = [m[1] for m in mounts if "rw" in m[3].split(",")]
print(json.dumps(out))
''',
        "setns": COMMON + connect + '''
pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
seen, entered, reached = set(), {}, []
for pid in pids + [1]:
    try:
        seen.add(os.readlink(f"/proc/{pid}/ns/net"))
        fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
    except OSError as e:
        entered[pid] = errno.errorcode.get(e.errno, str(e.errno))
        continue
    entered[pid] = "ok" if libc.setns(fd, 0x40000000) == 0 else err()
    if entered[pid] == "ok":  # whichever namespace it is now in: can it reach the host from there?
        reached.append(connect())
print(json.dumps({"pids": pids, "netns_seen": sorted(seen), "setns": entered, "reached": reached,
                  "connect": connect(), "mine": os.readlink("/proc/self/ns/net")}))
''',
        "forkbomb": COMMON + '''
import time
forked, failure = 0, None
for _ in range(200):
    try:
        pid = os.fork()
    except OSError as e:
        failure = errno.errorcode.get(e.errno, str(e.errno))
        break
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    forked += 1
print(json.dumps({"forked": forked, "failure": failure}))
''',
        "read_planted": COMMON + '''
def read(path):
    got = []
    r = attempt(lambda: got.append(open(path).read()))
    return r if r != "ok" else "ok:" + got[0]
out = {p: read(p) for p in ("@PLANTED@/secret600", "@PLANTED@/secret644", "/etc/shadow", "/etc/passwd",
                            "/proc/1/root@PLANTED@/secret644")}
out["list_planted"] = attempt(lambda: os.listdir("@PLANTED@"))
out["list_root"] = os.listdir("/root") if os.path.isdir("/root") else []
out["list_tmp"] = os.listdir("/tmp") if os.path.isdir("/tmp") else []
out["fds"] = sorted(os.listdir("/proc/self/fd"))
print(json.dumps(out))
''',
        "network": COMMON + connect + '''
print(json.dumps(connect() | {"interfaces": [name for _, name in socket.if_nameindex()]}))
''',
    }


def _unprivileged_userns_refusal() -> str | None:
    """Why the kernel refuses an unprivileged user namespace here, or None if it allows one."""
    r = subprocess.run(["setpriv", f"--reuid={USER}", f"--regid={USER}", "--clear-groups", "--inh-caps=-all",
                        "--bounding-set=-all", "unshare", "--user", "--map-root-user", "true"],
                       capture_output=True, text=True)
    return None if r.returncode == 0 else (r.stderr.strip() or f"exit {r.returncode}")


def _namespaces_refusal() -> str | None:
    """Why this (root) process may not create mount, PID and network namespaces here, or None if it may."""
    r = subprocess.run(["unshare", "--mount", "--pid", "--net", "--fork", "true"], capture_output=True, text=True)
    return None if r.returncode == 0 else (r.stderr.strip() or f"exit {r.returncode}")


def _as_user(job: dict) -> dict:
    """Run HARNESS as USER: the base interpreter, made reachable (a private mount namespace lays a tmpfs over
    the first directory on its path that others cannot walk, e.g. /root, with only the interpreter in it)."""
    python = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    prefix = os.path.realpath(sys.base_prefix)
    blocked = next((str(p) for p in [*reversed(Path(prefix).parents), Path(prefix)]
                    if not os.stat(p).st_mode & 0o001), None)
    drop = ["setpriv", f"--reuid={USER}", f"--regid={USER}", "--clear-groups", "--inh-caps=-all",
            "--bounding-set=-all", python, "-I", "-c", HARNESS]
    argv = drop
    if blocked is not None:
        stage = Path(job["stage"])
        script = (f'set -eu; mount --bind "{prefix}" "{stage}"; mount -t tmpfs -o mode=0755 none "{blocked}"; '
                  f'mkdir -p "{prefix}"; mount --move "{stage}" "{prefix}"; exec "$@"')
        argv = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, "sh", *drop]
    r = subprocess.run(argv, input=json.dumps(job), capture_output=True, text=True, cwd="/",
                       env={"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "TMPDIR": "/tmp", "LANG": "C.UTF-8"},
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def listener():
    """What a program that escaped the network namespace would reach: a TCP port on the host's loopback and an
    abstract unix socket (abstract names are per network namespace)."""
    tcp = socket.create_server(("127.0.0.1", 0))
    abstract = f"thinpipe-test-{TOKEN}"
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind("\0" + abstract)
    unix.listen(8)
    yield tcp.getsockname()[1], abstract
    tcp.close()
    unix.close()


COMBOS = [(b, who) for b in sandbox.BACKENDS for who in ("root", "user")]


@pytest.fixture(scope="module", params=COMBOS, ids=[f"{b}-{who}" for b, who in COMBOS])
def outcome(request, listener, tmp_path_factory):
    backend, who = request.param
    if backend not in sandbox.available_backends():
        pytest.skip(f"the {backend} backend's tools are not installed here"
                    + (" (apt-get install bubblewrap)" if backend == "bwrap" else ""))
    root = os.geteuid() == 0
    if who == "root" and not root:
        pytest.skip("the test process is not root")
    programs = _programs(*listener)
    timeout_s = 20.0
    if who == "user" and root:
        refused = _unprivileged_userns_refusal()
        if refused:
            pytest.skip(f"the kernel refuses unprivileged user namespaces here: {refused}")
        stage = tmp_path_factory.mktemp("stage")
        job = {"source": Path(sandbox.__file__).read_text(), "programs": programs, "backend": backend,
               "timeout_s": timeout_s, "stage": str(stage)}
        got = _as_user(job)
        assert "unavailable" not in got, got  # unprivileged user namespaces work here (checked above)
    else:
        refused = _namespaces_refusal() if root else None
        if refused:  # a container without CAP_SYS_ADMIN: nothing can be isolated, so nothing may run
            pytest.skip(f"this machine refuses root namespaces: {refused}")
        ns: dict = {"__name__": "harness"}
        exec(compile(HARNESS, "harness", "exec"), ns)
        try:
            got = ns["run_cases"](sandbox, programs, backend, timeout_s)
        except SandboxUnavailable as e:
            pytest.fail(f"{backend} as {who}: {e}")
    yield backend, who, got
    shutil.rmtree(got["planted"], ignore_errors=True)
    for d in ("/usr", PREFIX, "/", "/etc", "/tmp"):  # only there if an escape got out (and the test failed)
        Path(d, f"thinpipe-escape-{TOKEN}").unlink(missing_ok=True)


def result(outcome, name):
    backend, who, got = outcome
    status, rc, out, seconds = got["results"][name]
    try:
        data = json.loads(out.strip().splitlines()[-1])
    except (IndexError, ValueError):
        data = None
    return status, data, out, seconds


def test_a_correct_program_writes_and_reads_its_scratch_directory_and_passes(outcome):
    status, data, out, _ = result(outcome, "correct")
    assert status == "passed", out
    assert data == {"read": "hello from scratch", "cwd": "/scratch", "listed": ["note.txt", "prog.py"]}


def test_the_program_has_no_capabilities_no_new_privileges_and_is_never_root(outcome):
    status, data, out, _ = result(outcome, "privileges")
    assert status == "passed", out
    for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(data[cap], 16) == 0, (cap, data)
    assert data["NoNewPrivs"] == "1"
    assert 0 not in data["groups"] and len(data["groups"]) <= 1, data  # at most its own gid
    owner = outcome[2]["owner"]  # on the host, what it writes belongs to...
    if outcome[1] == "root":
        assert owner not in (0, USER)  # ...a dedicated uid: not root, not one that other processes share
    else:
        assert owner == (USER if os.geteuid() == 0 else os.geteuid())  # ...the caller, never root


def test_remounting_read_write_fails_and_nothing_is_written_outside_scratch(outcome):
    status, data, out, _ = result(outcome, "remount")
    assert status == "passed", out
    assert set(data["remount"].values()) <= {"EPERM", "EACCES", "EINVAL"}, data["remount"]
    assert "ok" not in data["writes"].values(), data["writes"]
    assert data["userns"] == "ok" or outcome[0] == "bwrap", data  # only bubblewrap forbids them
    if data["userns"] == "ok":  # every capability in a namespace of its own, and still the mounts hold
        assert set(data["remount_in_userns"].values()) <= {"EPERM", "EACCES", "EINVAL"}, data["remount_in_userns"]
        assert "ok" not in data["writes_in_userns"].values(), data["writes_in_userns"]
    # the only writable mounts: the scratch directory, /proc, and the device nodes bound in /dev
    assert all(m in ("/scratch", "/proc") or m.startswith(("/dev/", "/proc/")) for m in data["rw_mounts"]), data
    for p in (Path("/usr"), Path(PREFIX), Path(outcome[2]["planted"])):
        assert not (p / f"thinpipe-escape-{TOKEN}").exists()


def test_proc_shows_only_the_sandbox_so_setns_cannot_reach_the_host_network(outcome, listener):
    status, data, out, _ = result(outcome, "setns")
    assert status == "passed", out
    assert len(data["pids"]) <= 2, data["pids"]  # the host's processes are not there to enter
    assert os.readlink("/proc/self/ns/net") not in data["netns_seen"], data
    assert data["mine"] != os.readlink("/proc/self/ns/net")
    assert "ok" not in data["connect"].values(), data["connect"]
    assert all("ok" not in r.values() for r in data["reached"]), data["reached"]


def test_a_fork_bomb_stops_at_the_process_limit_and_the_sandbox_returns(outcome):
    status, data, out, seconds = result(outcome, "forkbomb")
    assert status == "passed", out
    assert 0 < data["forked"] < MAX_PROCESSES and data["failure"] == "EAGAIN", data
    assert seconds < 15  # its 60 s sleepers died with it


def test_a_planted_file_outside_the_allowed_paths_cannot_be_read(outcome):
    status, data, out, _ = result(outcome, "read_planted")
    assert status == "passed", out
    assert "PLANTED-" not in out
    assert not any(v.startswith("ok") for k, v in data.items() if k not in ("fds", "list_root", "list_tmp")), data
    # /root and /tmp are there only when an interpreter prefix is under them (a venv in a clone under
    # /tmp, say), and then hold nothing but the way to it
    prefixes = {os.path.abspath(p) for p in (sys.prefix, sys.base_prefix)}
    for top in ("root", "tmp"):
        assert all(any(p.startswith(f"/{top}/{name}/") for p in prefixes) for name in data[f"list_{top}"]), data
    assert data["fds"] == ["0", "1", "2", "3"], data["fds"]  # nothing of the caller's is inherited (3: listdir's)


def test_the_program_cannot_open_a_connection_to_the_host_or_the_network(outcome):
    status, data, out, _ = result(outcome, "network")
    assert status == "passed", out
    assert data["interfaces"] == ["lo"], data  # no route anywhere (nothing here tries a non-loopback address)
    assert data["tcp"] != "ok" and data["abstract_unix"] != "ok", data


def test_the_listener_is_reachable_outside_the_sandbox(listener):
    """The control for the two tests above: the same connections from here succeed."""
    port, abstract = listener
    socket.create_connection(("127.0.0.1", port), timeout=2).close()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect("\0" + abstract)
    s.close()


def test_each_backend_is_selectable_and_an_unknown_one_is_refused():
    with pytest.raises(ValueError, match="unknown sandbox backend"):
        run_sandboxed("pass", _backend="chroot")
    for b in sandbox.available_backends():
        t0 = time.perf_counter()
        assert run_sandboxed("print('hi')", _backend=b).output_tail == "hi\n"
        assert time.perf_counter() - t0 < 5


def test_a_failed_setup_step_means_the_program_is_not_run(monkeypatch):
    """A bind that fails is not skipped: the program is never run (no result) and SandboxUnavailable says why."""
    backends = sandbox.available_backends()
    if not backends:
        pytest.skip("no sandbox backend installed")
    binds, links = sandbox._layout()
    monkeypatch.setattr(sandbox, "_layout", lambda: ([*binds, ("/nonexistent-thinpipe-path", "/opt/x")], links))
    for b in backends:
        with pytest.raises(SandboxUnavailable, match=f"{b}: setup failed .*nonexistent-thinpipe-path"):
            run_sandboxed("print('ran')", _backend=b)
