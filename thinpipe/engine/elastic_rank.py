"""Elastic replicas on torchft: machines leave and join a running mesh (docs/elastic.md).

A *replica* is one pipeline row (``mesh.pp`` stage processes) and is its own torch.distributed
world: its stages talk to each other exactly as in ``--engine dist`` (the same ``DistEngine``,
transport and run loop). Replicas talk to each other only through torchft: each stage's DP
traffic goes through a ``torchft.Manager``'s reconfigurable process group (``comm/managed.py``),
the managers agree on a *quorum* (the replicas present) through torchft's lighthouse before every
step, and a step counts only if every rank of the replica ``should_commit``.

Per step (``ElasticEngine``):
  ``before_step`` the quorum (the first one of a new job waits for all ``mesh.dp`` replicas, up to
                  ``elastic.start_timeout_s``); a replica behind the job's step *heals*: a live peer's
                  stage sends its whole state (weights, optimizer, DP state, the job's counters) over
                  ``comm/recovery.py`` and the run loop goes on at the job's step; then a snapshot of
                  this rank's training state.
  the objective's step, as ``--engine dist`` runs it with the quorum as the DP group (averages over
                  the replicas present);
  ``commit_step`` one collective that tells every replica who took part and their losses and bytes,
                  then ``should_commit``.
                  Not committed (a replica died mid-step, a collective timed out): the snapshot comes
                  back, the run loop redoes the step with the next quorum.

With every replica present from start to end nothing differs from ``--engine dist``: the same
sums over the same members in the same order, the same divisions (replica 0's folder equals that
run's files, tested bitwise). A stage that dies takes its replica out (its own stages then fail in
their torch.distributed world and exit); the launcher (``launch_elastic.py``) restarts it, and it
heals in. Each replica writes its own run folder ``OUT/replica{r}`` (``-restart{n}`` for its n-th
restart); quorum changes, rollbacks and recoveries go to ``OUT/events.jsonl``.

A whole job that stopped (every replica gone, the launcher killed) continues with ``thinpipe
launch --elastic --resume``: each replica from the newest checkpoint of its newest folder that has
one (``load``), the ones behind healing from the one ahead at the first quorum. Not yet: an anchor
circuit and ``train.on_divergence = rollback``.
"""

from __future__ import annotations

import copy
import datetime
import os
import signal
import time
from pathlib import Path
from typing import TypedDict

import torch
import torch.distributed as dist
from torchft import Manager, ProcessGroupGloo

from thinpipe.comm.bind import bind_address, point_gloo_at
from thinpipe.comm.jobkey import job_key
from thinpipe.comm.managed import ManagedGroup
from thinpipe.comm.meter import AXES
from thinpipe.comm.orphan import exit_with_launcher
from thinpipe.comm.recovery import SafeTransport
from thinpipe.comm.rendezvous import init_gloo
from thinpipe.comm.shaped import MeshLinks
from thinpipe.config import Config, ConfigError
from thinpipe.config.env import dist_timeout_s, env_int
from thinpipe.console import say
from thinpipe.engine.dist_engine import DistEngine
from thinpipe.engine.dist_setup import RankSetup, held_state
from thinpipe.engine.elastic_setup import (
    LIGHTHOUSE_ENV,
    REPLICA_ENV,
    RESTART_ENV,
    RESUME_ENV,
    advertised,
    check_elastic,
    check_lighthouse,
    manager_binds_to,
    quiet_torchft,
    replica_folder,
    replica_id,
)
from thinpipe.engine.loop import resolve_resume, run
from thinpipe.engine.rank_rows import VECTOR, rows_of
from thinpipe.events import append_event
from thinpipe.faults import elastic_kill_step
from thinpipe.layout import MeshLayout

START_POLL_S = 0.5
RECOVERY_CAP = 16                          # a peer's state is at most this many times this stage's own tensors
RECOVERY_SLACK = 64 << 20                  # (weights, optimizer moments, DP copies, fragments in flight) + this


def _to_host(tree):
    """A copy of a state tree with every tensor copied to host memory."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: _to_host(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_to_host(v) for v in tree)
    return copy.deepcopy(tree)


def _tree_bytes(tree) -> int:
    """The bytes of every tensor in a state tree."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(_tree_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_tree_bytes(v) for v in tree)
    return 0


class ElasticStats(TypedDict):
    """What the summary reports of a replica's elastic life (``summary_extras``)."""

    rollbacks: int                 # its steps that did not commit
    recovered_at_step: int | None  # a restarted replica: the step it healed at from a live peer
    recovery_s: float | None       # and how long healing took


class ElasticEngine(DistEngine):
    """One stage of one elastic replica, as an engine of the run loop (``engine/loop.py``)."""

    def __init__(self, r: RankSetup, replica: int, job: Path, restart: int, resuming: bool = False):
        e = r.cfg.elastic
        timeout = datetime.timedelta(seconds=e.timeout_s)
        addr = bind_address()  # every listener of this rank on the job's address (docs/security.md)
        point_gloo_at(addr)    # torchft's process group among replicas: gloo's pairs on that interface
        self.pg = ProcessGroupGloo(timeout=timeout)
        # a peer's state: signed with the job key, at most RECOVERY_CAP times this stage's own tensors, and
        # all of it within elastic.quorum_timeout_s (a heal is part of waiting for the quorum)
        own = _tree_bytes([r.stage.state_dict(), *(b.state_dict() for b in r.bounds)])
        transport = SafeTransport(timeout, job_key("--engine elastic"), max_bytes=RECOVERY_CAP * own + RECOVERY_SLACK,
                                  deadline=datetime.timedelta(seconds=max(e.quorum_timeout_s, e.timeout_s)))
        with manager_binds_to(addr):
            self.manager = Manager(
                pg=self.pg, load_state_dict=None, state_dict=None, min_replica_size=e.min_replicas,
                use_async_quorum=False, timeout=timeout, quorum_timeout=datetime.timedelta(seconds=e.quorum_timeout_s),
                connect_timeout=datetime.timedelta(seconds=max(60.0, e.timeout_s)), rank=r.role.stage,
                world_size=r.layout.pp, replica_id=replica_id(replica), checkpoint_transport=transport,
                hostname=advertised(addr),
                init_sync=False)  # every replica builds the same initial weights: nothing to copy at step 0
        links = MeshLinks(r.cfg.link)
        super().__init__(r, data_replica=replica,
                         make_dp_group=lambda meter: ManagedGroup(self.manager, self.pg, meter, "dp", links.dp_mbps,
                                                                  links.dp_latency_ms))
        self.manager.register_state_dict_fn("thinpipe", self._stash_peer_state, self._peer_state)
        self.replica, self.job, self.restart = replica, job, restart
        self.logs = self.role.stage == 0  # one process per replica writes events
        self._members: list[int] = []           # the replicas of the last committed step
        self._job_bytes = {a: 0 for a in AXES}  # the whole job's bytes (replicas present), committed steps
        self._job_tokens = 0
        self._reported = {a: 0 for a in AXES}   # this replica's bytes already in the job's totals
        self._reported_tokens = 0               # and its trained tokens
        self._restore: dict | None = None       # a rolled-back step's snapshot, applied after the next quorum
        self._peer: dict | None = None          # a live peer's state, received while healing
        self._quorum_id = None
        self._snapshot: dict | None = None      # the state the step in progress started from (before_step)
        # a restarted replica first needs a live peer (_wait_for_peer); one resuming from its checkpoint does not
        self._joined = restart == 0 or resuming
        self._resuming = resuming
        self.stats: ElasticStats = {"rollbacks": 0, "recovered_at_step": None, "recovery_s": None}
        self._kill_at = elastic_kill_step(replica, self.role.stage) if restart == 0 else -1

    # the quorum ---------------------------------------------------------------------------------
    def before_step(self, step: int) -> int:
        """The quorum of the step (healing from a peer, or a rolled-back step's snapshot applied), then a snapshot
        of the state the step starts from, to go back to if it does not commit."""
        at = self._quorum(step)
        # in host memory (a GPU rank keeps no second copy on its device); restored as a resume is
        self._snapshot = _to_host(self._state())
        if at == self._fault_at:
            raise RuntimeError(f"THINPIPE_FAULT_AT_STEP: injected fault at step {at}")
        return at

    def _quorum(self, step: int) -> int:
        t0 = time.perf_counter()
        self.manager.start_quorum()
        if self._quorum_id is None and self._joined and (self._resuming or self.manager.current_step() == 0):
            # a new or resumed job: wait for every replica (each rank of a replica sees the same quorums,
            # so all of them make the same number of attempts)
            for _ in range(int(self.cfg.elastic.start_timeout_s / START_POLL_S)):
                if self.manager.num_participants() >= self.cfg.mesh.dp:
                    break
                time.sleep(START_POLL_S)
                self.manager.start_quorum()
        if not self._joined:
            self._wait_for_peer()
            self._joined = True
        quorum_id = getattr(self.manager, "_quorum_id", None)  # torchft 0.2: bumped when the members change
        changed, self._quorum_id = quorum_id != self._quorum_id, quorum_id
        if self._peer is not None:
            self._apply(self._peer)
            self._peer, self._restore = None, None
            joined = self.manager.current_step()
            self.stats["recovered_at_step"] = joined
            self.stats["recovery_s"] = round(time.perf_counter() - t0, 3)
            self._event("recovered", joined, replica=self.replica, restart=self.restart,
                        recovery_s=self.stats["recovery_s"])
        elif self._restore is not None:
            self._apply(self._restore)  # the rolled-back step's snapshot (its data stream restarts at the step too)
            self._restore = None
        elif changed:
            self._repost()  # the process group was rebuilt: what the DP scheme has in flight starts again on it
        return self.manager.current_step()

    def _wait_for_peer(self) -> None:
        """A restarted replica trains only with the job: until a live peer is in its quorum (it heals
        from one ahead of it, or they are all still at step 0), it asks again, up to
        ``elastic.quorum_timeout_s`` (every rank of the replica sees the same quorums)."""
        for _ in range(int(self.cfg.elastic.quorum_timeout_s / START_POLL_S)):
            if self._peer is not None or self.manager.num_participants() >= 2:
                return
            time.sleep(START_POLL_S)
            self.manager.start_quorum()
        raise RuntimeError(f"replica {self.replica} restarted but found no live replica to recover the job's state "
                           f"from in {self.cfg.elastic.quorum_timeout_s:g} s (elastic.quorum_timeout_s)")

    def _event(self, event: str, step: int, **fields) -> None:
        if self.logs:
            append_event(self.job, event, step=step, **fields)

    # a step -------------------------------------------------------------------------------------
    def after_schedule(self, step: int) -> None:
        if step == self._kill_at:  # the measured failure: a real SIGKILL, mid-step (nothing of ours runs after it)
            os.kill(os.getpid(), signal.SIGKILL)

    def commit_step(self, step: int, loss: float) -> float | None:
        """After this replica's step (``loss``: its own; its Pipe sums over its own stages, its world): the job's
        loss, bytes and tokens over the replicas that committed it, or None when the step does not commit (torchft:
        a replica was lost), with the step's snapshot to apply at the next quorum."""
        snapshot, self._snapshot = self._snapshot, None
        mine = self.meter.snapshot()
        rows = self.gather([self.rk.last_grad_norm, *self.my_vector(), *(mine[a] for a in AXES)])  # this replica's
        first = 1 + VECTOR                                                                             # stages
        sent = {a: int(sum(float(r[first + i]) for r in rows)) for i, a in enumerate(AXES)}
        if self.lead:  # this replica's ranks.jsonl rows, in its own folder; ranks numbered as in the job's grid
            ranks = [self.replica * len(rows) + s for s in range(len(rows))]
            self._rank_rows = rows_of(step, {ranks[s]: r[1:first].tolist() for s, r in enumerate(rows)},
                                      {self.replica: ranks})
        dp, tokens = self.cfg.mesh.dp, 3 + len(AXES)
        table = torch.zeros(dp, tokens + 1, dtype=torch.float64)  # one row per replica slot, theirs only
        table[self.replica] = torch.tensor([1.0, loss, float(rows[0][0]),
                                            *(float(sent[a] - self._reported[a]) for a in AXES),
                                            float(self.objective.tokens - self._reported_tokens)], dtype=torch.float64)
        self.manager.allreduce(table, reduce_op=dist.ReduceOp.SUM).wait()
        if not self.manager.should_commit():
            self._restore = snapshot
            self.step_index = step
            self.stats["rollbacks"] += 1
            why = str(self.manager.errored() or "fewer replicas than elastic.min_replicas").strip().splitlines()[0]
            self._event("rolled_back", step, replica=self.replica, why=why[:200])
            return None
        members = [i for i in range(dp) if table[i, 0] == 1.0]
        if members != self._members:
            left, joined = sorted(set(self._members) - set(members)), sorted(set(members) - set(self._members))
            if self.replica == members[0]:  # one replica reports the change
                self._event("quorum", step, members=members, left=left, joined=joined)
            self._members = members
        self._reported, self._reported_tokens = sent, self.objective.tokens
        for i, a in enumerate(AXES):
            self._job_bytes[a] += int(sum(float(table[r, 3 + i]) for r in members))
        self._job_tokens += int(sum(float(table[r, tokens]) for r in members))
        self._bytes = dict(self._job_bytes)
        self._grad_norm = float(table[members[0], 2])  # the first replica's, as --engine dist reports replica 0's
        self.step_index = step + 1
        losses = [float(table[r, 1]) for r in members]
        return sum(losses) / len(losses)

    def tokens_seen(self) -> int:
        return self._job_tokens

    # state: a snapshot to roll back to, and what a joining peer receives ---------------------------
    def _state(self) -> dict:
        return {"rank": self.rk.state_dict(), "objective": self.objective.state_dict(),
                "boundaries": {b.index: held_state(b.state_dict()) for b in (self.in_b, self.out_b) if b is not None}}

    def _peer_state(self) -> dict:
        """What this rank sends a replica that joins (torchft calls it while the quorum forms): its committed
        state. After a step that did not commit, that is the snapshot taken before it, which this rank applies
        only once the quorum has formed (``before_step``): its live weights hold the uncommitted update."""
        committed = self._restore if self._restore is not None else self._state()
        return {**committed, "members": list(self._members), "job_bytes": dict(self._job_bytes),
                "job_tokens": self._job_tokens}

    def _stash_peer_state(self, state: dict) -> None:
        self._peer = state  # applied in before_step, after the quorum (re-posting syncs talks to the group)

    def _apply(self, state: dict) -> None:
        """Load a snapshot or a peer's state; syncs in flight in it are posted again (on this quorum's group)."""
        for b in (self.in_b, self.out_b):
            if b is not None:
                b.load_state_dict(state["boundaries"][b.index], strict=False)
        for work in self.rk.load_state_dict(state["rank"]):
            work.wait()
        # its data streams restart at the step it trains next
        self.objective.load_state_dict(state["objective"], self.manager.current_step())
        self._reported_tokens = self.objective.tokens
        if "job_bytes" in state:
            self._members = [int(m) for m in state["members"]]
            self._job_bytes = {a: int(state["job_bytes"][a]) for a in AXES}
            self._job_tokens = int(state["job_tokens"])

    def _repost(self) -> None:
        for work in self.rk.dp_scheme.repost():  # dp/scheme.py: DPScheme.repost (a no-op with nothing in flight)
            work.wait()

    # checkpoints: this replica's own, in its folder; torchft's step goes with them -----------------
    def save(self, folder: Path, extra: dict) -> None:
        super().save(folder, {**extra, "elastic": {"manager": self.manager.state_dict(), "members": self._members,
                                                   "job_bytes": self._job_bytes, "job_tokens": self._job_tokens}})

    def load(self, folder: Path) -> tuple[int, dict]:
        """``thinpipe launch --elastic --resume``: this replica's newest checkpoint; torchft's step comes
        with it, so at the first quorum a replica whose checkpoint is older heals from one ahead."""
        step, extra = super().load(folder)
        self._reported = dict(self._bytes)  # this replica's own bytes so far (super().load summed them)
        self._reported_tokens = self.objective.tokens
        e = extra["elastic"]
        self.manager.load_state_dict(e["manager"])
        self._members = [int(m) for m in e["members"]]
        self._job_bytes = {a: int(e["job_bytes"][a]) for a in AXES}
        self._job_tokens = int(e["job_tokens"])
        self._bytes = dict(self._job_bytes)
        return step, extra

    def load_rank(self, state: dict) -> None:
        # applied after the first quorum: re-posting syncs in flight needs the DP group, and a peer's
        # newer state may replace it (before_step)
        self._restore = {"rank": state["rank"], "boundaries": state["boundaries"],
                         "objective": self.objective.state_dict()}

    def write_model(self, dest: Path) -> dict:
        """None here: the launcher writes the job's ``OUT/model/`` once every replica has ended, from the replica
        folders (``commands/launch_elastic.py``: ``engine/run_folder.py: write_run_model``)."""
        return {}

    def summary_extras(self) -> dict:
        return {**super().summary_extras(), "engine": "elastic", "replica": self.replica, "restart": self.restart,
                "members_at_end": self._members, **self.stats}

    def close(self) -> None:
        try:
            self.manager.shutdown(wait=False)
        finally:
            super().close()


def train_elastic(cfg: Config, out: str | Path, progress: bool = True) -> dict | None:
    """Run this process's stage of elastic replica ``$REPLICA_GROUP_ID`` (started by ``thinpipe launch
    --elastic`` or by torchrun with ``--nproc-per-node mesh.pp``, the lighthouse at ``$TORCHFT_LIGHTHOUSE``);
    its replica's stage 0 returns the replica's summary."""
    check_elastic(cfg)
    exit_with_launcher()
    quiet_torchft()
    for name in (REPLICA_ENV, LIGHTHOUSE_ENV, "RANK"):
        if name not in os.environ:
            raise ConfigError(f"--engine elastic needs ${name}: start it with `thinpipe launch --elastic -- train ...` "
                              "or as docs/elastic.md shows")
    # restarted by thinpipe launch --elastic, or by torchrun --max-restarts (which counts its own restarts);
    # resumed (in the folder of that restart) by thinpipe launch --elastic --resume
    resume = os.environ.get(RESUME_ENV) == "1"
    replica = env_int(REPLICA_ENV, None, 0, cfg.mesh.dp - 1)  # a replica of mesh.dp
    if replica is None:  # set, but empty
        raise ConfigError(f"${REPLICA_ENV} is empty: give this replica's index, 0 to {cfg.mesh.dp - 1} (mesh.dp)")
    restart = env_int(RESTART_ENV, None, 0, 10**6)
    restart = env_int("TORCHELASTIC_RESTART_COUNT", 0, 0, 10**6) if restart is None else restart
    timeout_s = dist_timeout_s()
    check_lighthouse(os.environ[LIGHTHOUSE_ENV])
    job_key("--engine elastic")  # before anything starts: a rank without the key says so in one line
    job = Path(out)
    folder = replica_folder(job, replica, restart)
    if resume:
        cfg = resolve_resume(cfg, folder, True)
    if not dist.is_initialized():
        init_gloo(timeout_s)  # this replica's own world, listening on the job's address only
    engine = None
    try:
        setup = RankSetup.build(cfg, MeshLayout(1, cfg.mesh.pp, 0))  # this replica's world: its stages
        st = setup.stage
        say(f"[thinpipe replica {replica} stage {setup.role.stage}] layers {st.first_layer}-"
            f"{st.first_layer + len(st.layers) - 1}{f', restart {restart}' if restart else ''}")
        engine = ElasticEngine(setup, replica, job, restart, resuming=resume)
        return run(engine, cfg, folder, resume=resume, progress=progress)
    finally:
        if engine is not None:
            engine.close()
        dist.destroy_process_group()
