"""The DP scheme interface is enough: a scheme defined only in this file (local SGD, as torchft's ``LocalSGD``:
no gradient average, the replicas average their weights every 2nd step) trains in the simulation and on real
processes with equal run files, its checkpointed state goes with the rank's, the replicas agree right after its
syncs and not between them, and the planner plans it from what it says of itself. No engine, rank or planner
code knows it (tests/unit/dp/test_scheme.py: the built-in schemes; this file: a plugin's).
"""

from pathlib import Path

import pytest
import torch

from tests.helpers import assert_same_run_files, config, launch_with_plugin, run_files
from thinpipe.checkpoint import load_part, step_dir
from thinpipe.cli import main
from thinpipe.dp.scheme import DPScheme
from thinpipe.plan.planner import DEVICES, plan
from thinpipe.plugins import register_dp_scheme

ROOT = Path(__file__).resolve().parents[2]
EVERY = 2


class ToyLocalSGD(DPScheme):
    """Each replica trains alone; after every ``EVERY``-th step the replicas' trained weights are averaged
    (one all-reduce of their concatenation: the scheme talks only to its group)."""

    kind = "toy-local-sgd"
    replicas_agree_every_step = False

    def __init__(self, cfg, trained, group, member, seed):
        super().__init__(cfg, trained, group, member, seed)
        self.syncs = 0  # checkpointed: the rank's state carries a plugin's keys too

    def after_step(self, step):
        if not self.agree_after(step):
            return
        params = [p for _, p in self.trained()]
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        yield self.group.all_reduce(self.member, flat)  # a sum, in place
        flat /= self.group.size
        with torch.no_grad():
            offset = 0
            for p in params:
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        self.syncs += 1

    def agree_after(self, step):
        return (step + 1) % EVERY == 0

    def state_dict(self):
        return {"toy_syncs": self.syncs}

    def load_state_dict(self, state):
        self.syncs = state.get("toy_syncs", 0)
        yield from ()

    @classmethod
    def sync_interval(cls, cfg):
        return EVERY


register_dp_scheme(ToyLocalSGD.kind, ToyLocalSGD)

ARGS = ["--set", "model.name=tiny-llama", "--set", "data.name=synthetic", "--set", "train.steps=4",
        "--set", "train.batch_size=2", "--set", "train.seq_len=32", "--set", "train.microbatches=2",
        "--set", "train.lr=1e-3", "--set", "train.checkpoint_every=1", "--set", "eval.every=2", "--set", "mesh.pp=2",
        "--set", "mesh.dp=2", "--set", "dp.kind=toy-local-sgd"]


def stage_states(folder: Path, step: int) -> list[list[dict]]:
    """[replica][stage] -> the rank's checkpointed state after ``step`` steps (the simulation's part or the ranks')."""
    at = step_dir(folder / "checkpoint", step)
    if (at / "mesh.json").exists():
        return load_part(at, "mesh")["mesh"]["ranks"]
    return [[load_part(at, f"rank{r * 2 + s}")["rank"] for s in range(2)] for r in range(2)]


def assert_synchronised_after_its_syncs(folder: Path) -> None:
    for step, synced in ((3, False), (4, True)):  # 3 steps: one local step since the sync after step 1
        ranks = stage_states(folder, step)
        for s in range(2):
            a, b = ranks[0][s]["stage"], ranks[1][s]["stage"]
            assert all(torch.equal(a[k], b[k]) for k in a) == synced, (step, s)
            assert ranks[0][s]["toy_syncs"] == ranks[1][s]["toy_syncs"] == step // EVERY


def launch(nproc: int, out: Path, args: list[str]):
    return launch_with_plugin("tests.architecture.test_toy_dp", nproc, out, args)


def test_toy_scheme_trains_in_the_simulation_and_syncs_every_2nd_step(tmp_path):
    assert main(["train", "--out", str(tmp_path / "sim"), "--quiet", *ARGS]) == 0
    rows, summary = run_files(tmp_path / "sim")
    dp = [row["dp_bytes"] for row in rows]
    assert dp[0] == 0 and dp[1] > 0 and dp[2] == dp[1] and dp[3] == 2 * dp[1]  # after steps 1 and 3 only
    assert summary["dp_bytes"] == dp[3] and rows[-1]["loss"] < rows[0]["loss"]
    assert_synchronised_after_its_syncs(tmp_path / "sim")


def test_the_planner_plans_the_toy_scheme_from_what_it_says():
    sets = dict(model__name="smollm2-135m", mesh__pp=2, mesh__dp=4, link__pp_mbps=100, link__dp_mbps=100)
    toy = plan(config(**sets, dp__kind="toy-local-sgd"), DEVICES["h100"])
    exact = plan(config(**sets), DEVICES["h100"])
    assert (toy["tau"], toy["rho_dp"]) == (EVERY, 1.0)
    assert toy["t_dp_s"] == pytest.approx(exact["t_dp_s"] / EVERY)


@pytest.mark.dist
def test_toy_scheme_in_dist_equals_the_simulation_file_by_file(tmp_path, one_thread):
    assert main(["train", "--out", str(tmp_path / "sim"), "--quiet", *ARGS]) == 0
    r = launch(4, tmp_path / "dist", ARGS)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_run_files(tmp_path / "sim", tmp_path / "dist")
    assert_synchronised_after_its_syncs(tmp_path / "dist")
