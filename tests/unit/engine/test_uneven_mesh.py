"""Uneven machines (issue 54): the split chosen from measurements, a codec and a link per boundary, and where the time
goes (ranks.jsonl, the summary's slowest rank and link, ``thinpipe top``)."""

import json
import math

import pytest
import torch

from tests.helpers import config, tiny_batch, tiny_model
from thinpipe.cli import main
from thinpipe.comm.netns import link_rates_mbps
from thinpipe.comm.shaped import MeshLinks
from thinpipe.config import ConfigError, load_config
from thinpipe.engine.rank_rows import rank_vector, rows_of, slowest
from thinpipe.engine.sim_mesh import SimMesh
from thinpipe.layout import MeshLayout
from thinpipe.models.auto_split import Measure, choose_split, stage_measures

INF = float("inf")


def m(layer_s: float, ends_s: float = 0.0, free: float = INF, layer_bytes: float = 1.0) -> Measure:
    return Measure(layer_s, ends_s, free, layer_bytes, 0.0)


def test_the_split_minimises_the_slowest_stage_by_hand():
    # 8 layers, the third stage at half speed: [2, 3, 1, 2], [3, 2, 1, 2] and [2, 2, 1, 3] all reach 3 units, each 2
    # away from the balanced [2, 2, 2, 2]; the tie goes to fewer layers on the end stages
    assert choose_split(8, [m(1), m(1), m(2), m(1)]) == [2, 3, 1, 2]
    assert choose_split(8, [m(1)] * 4) == [2, 2, 2, 2]  # even machines: the balanced split
    # the last stage's head costs 2 layers: it takes fewer
    assert choose_split(8, [m(1), m(1), m(1), m(1, ends_s=2.0)]) == [2, 2, 3, 1]
    # memory: stage 1 holds at most one layer, so the others take the rest
    assert choose_split(8, [m(1), m(1, free=1.5), m(1), m(1)]) == [2, 1, 3, 2]


def test_a_model_the_memory_cannot_hold_is_one_line():
    with pytest.raises(ConfigError, match="free memory holds 4 of the model's 8 layers"):
        choose_split(8, [m(1, free=1.0)] * 4)


def test_a_stage_is_as_slow_as_its_slowest_replica():
    measures = {(0, 0): m(1), (0, 1): m(1), (1, 0): m(1), (1, 1): m(3, free=2.5)}
    per_stage = stage_measures(measures, 2)
    assert per_stage[1].layer_s == 3 and per_stage[1].free_bytes == 2.5
    assert choose_split(4, per_stage) == [3, 1]


@pytest.mark.slow  # two runs, each measuring a layer and both ends (~6 s on an idle machine)
def test_an_auto_split_run_records_its_measurements_and_keeps_its_split_on_resume(tmp_path):
    """The simulation measures, chooses, and writes the split into config.toml (the measurements in the summary give
    it back through the function real ranks use); ranks.jsonl has a row per rank; --resume keeps the split."""
    out = tmp_path / "run"
    base = ["--set", "data.name=synthetic", "--set", "train.batch_size=2", "--set", "train.seq_len=32",
            "--set", "model.name=tiny-llama", "--set", "mesh.pp=2", "--set", "mesh.split=auto",
            "--set", "mesh.speeds=[1.0, 0.4]", "--set", "train.checkpoint_every=1"]
    assert main(["train", "--out", str(out), "--quiet", "--set", "train.steps=1", *base]) == 0
    s = json.loads((out / "summary.json").read_text())
    split = load_config(out / "config.toml").mesh.split
    assert isinstance(split, list) and split == s["split_auto"]["split"] and sum(split) == 4
    measures = {(r["replica"], r["stage"]): Measure(r["layer_s"], r["ends_s"], INF if r["free_bytes"] is None
                                                    else r["free_bytes"], r["layer_bytes"], r["ends_bytes"])
                for r in s["split_auto"]["measures"]}
    assert choose_split(4, stage_measures(measures, 2)) == split
    rows = [json.loads(x) for x in (out / "ranks.jsonl").read_text().splitlines()]
    assert sorted(r["rank"] for r in rows) == [0, 1] and all(r["compute_s"] > 0 for r in rows)
    assert main(["train", "--out", str(out), "--quiet", "--resume", "--set", "train.steps=2", *base]) == 0
    assert load_config(out / "config.toml").mesh.split == split


def test_the_simulation_divides_one_measurement_by_the_declared_speeds(monkeypatch):
    """Timing-free: the simulation's one measurement (here fixed) over mesh.speeds gives the half-speed stage the
    fewest layers, as real ranks measuring those times would (the test above runs the real measurement)."""
    from thinpipe.models.presets import tiny_config
    from thinpipe.rank import split_measure

    monkeypatch.setattr(split_measure, "measure", lambda cfg, c, stage, device, free: Measure(
        1e-3, 1e-4 if stage in (0, cfg.mesh.pp - 1) else 0.0, free, 1.0, 0.0))
    cfg = load_config(None, ["model.name=small-llama", "mesh.pp=4", "mesh.split=auto", "mesh.speeds=[1, 1, 0.5, 1]"])
    got = split_measure.simulated_split(cfg, tiny_config("small"), torch.device("cpu"))
    assert got["split"] == cfg.mesh.split == [2, 3, 1, 2]
    assert [x["layer_s"] for x in got["measures"]] == [1e-3, 1e-3, 2e-3, 1e-3]


def test_split_and_link_settings_are_checked():
    with pytest.raises(ConfigError, match='mesh.split must be a list of layer counts or "auto"'):
        load_config(None, ["mesh.split=fast"])
    with pytest.raises(ConfigError, match="mesh.speeds has 2 entries but mesh.pp = 3"):
        load_config(None, ["mesh.pp=3", "mesh.speeds=[1, 2]"])
    with pytest.raises(ConfigError, match="link.pp_mbps lists 3 values but the pipeline has 2 boundaries"):
        load_config(None, ["mesh.pp=3", "link.pp_mbps=[100, 50, 20]"])
    with pytest.raises(ConfigError, match="boundary.kinds lists 1 kinds but the pipeline has 2 boundaries"):
        load_config(None, ["mesh.pp=3", "boundary.kinds=[quant4]"])
    with pytest.raises(ConfigError, match="boundary.kinds lists mapl, which is part of the model"):
        load_config(None, ["mesh.pp=3", "boundary.kinds=[mapl, quant4]"])
    cfg = load_config(None, ["mesh.pp=3", "link.pp_mbps=[200, 40]", "link.pp_latency_ms=5", "mesh.split=[1, 2, 1]"])
    assert cfg.link.pp_mbps_at(1) == 40 and cfg.link.pp_latency_ms_at(1) == 5 and cfg.mesh.fixed_split == [1, 2, 1]


def test_a_link_takes_its_boundarys_rate():
    cfg = load_config(None, ["mesh.pp=3", "mesh.dp=2", "link.pp_mbps=[200, 40]", "link.pp_latency_ms=[1, 7]"])
    layout = MeshLayout(2, 3)
    stage = lambda r: layout.role(r).stage  # noqa: E731
    middle = MeshLinks(cfg.link, stage, 4)  # replica 1, stage 1
    assert middle.pp_rate(3) == (200, 1) and middle.pp_rate(5) == (40, 7)
    assert middle.pp("pp_fwd", 5).rate_mbps == 40 and middle.pp("dp", 5) is None
    rates = link_rates_mbps(layout, [200, 40], 0, tied=True)
    assert rates[(0, 1)] == 200 and rates[(2, 1)] == 40 and rates[(0, 2)] == 40  # the tied pair: the slowest


def test_two_kinds_in_one_pipeline_send_each_kinds_bytes():
    """boundary.kinds = [quant4, outlier] on 3 stages: each boundary's bytes are its own kind's formula."""
    cfg = config(model__name="tiny-llama", mesh__pp=3, train__batch_size=2, boundary__kinds=["quant4", "outlier"],
                 boundary__quant_group=16)
    mesh = SimMesh(tiny_model("llama"), cfg)
    assert [b.kind for b in mesh.boundaries] == ["quant4", "outlier"]
    batch = tiny_batch(2, 16)
    mesh.forward_backward([batch])
    tokens = batch["input_ids"].numel()
    want = [b.expected_bytes(tokens, 4) for b in mesh.boundaries]
    got = mesh.meter.snapshot()
    assert got["pp_fwd"] == sum(f for f, _ in want) and got["pp_bwd"] == sum(b for _, b in want)
    assert want[0] != want[1]


def test_rank_rows_name_the_slowest_rank_and_link():
    grid = {0: [0, 1, 2]}
    vectors = {0: rank_vector((1.0, 0.0, 0.5), {1: (1e6, 0.1)}, None, 1),
               1: rank_vector((3.0, 0.2, 0.1), {0: (1e6, 0.1), 2: (1e6, 1.0)}, 0, 2),
               2: rank_vector((1.0, 0.3, 0.0), {}, 1, None)}
    rows = rows_of(4, vectors, grid)
    assert rows[1] == {"step": 4, "rank": 1, "replica": 0, "stage": 1, "compute_s": 3.0, "wait_s": {"0": 0.2, "2": 0.1},
                       "send_mbps": {"0": 80.0, "1": 8.0}}
    assert rows[2]["send_mbps"] == {"1": None} and math.isclose(rows[0]["send_mbps"]["0"], 80.0)
    assert slowest(rows) == {"slowest_rank": 1, "slowest_link": 1}
    assert slowest([{**r, "send_mbps": {k: None for k in r["send_mbps"]}} for r in rows])["slowest_link"] is None


def test_top_prints_a_finished_run_once_and_refuses_a_folder_without_rows(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--quiet", "--set", "data.name=synthetic", "--set", "train.steps=2",
                 "--set", "train.batch_size=2", "--set", "train.seq_len=32", "--set", "model.name=tiny-llama",
                 "--set", "mesh.pp=2", "--set", "train.checkpoint_every=0"]) == 0
    capsys.readouterr()
    assert main(["top", str(out)]) == 0
    text = capsys.readouterr().out
    assert "step 2 (2 steps recorded)" in text and "slowest rank:" in text and "<- slowest" in text
    (tmp_path / "empty").mkdir()
    assert main(["top", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no ranks.jsonl" in err[0]


def test_measuring_leaves_the_runs_random_draws_alone():
    from thinpipe.models.presets import tiny_config
    from thinpipe.rank.split_measure import measure

    torch.manual_seed(3)
    before = torch.random.get_rng_state()
    measure(load_config(None, ["model.name=tiny-llama", "mesh.pp=2"]), tiny_config("llama"), 1, torch.device("cpu"),
            INF)
    assert torch.equal(torch.random.get_rng_state(), before)


def test_a_mask_ratio_per_boundary():
    cfg = config(model__name="tiny-llama", mesh__pp=3, boundary__kind="mask", boundary__p=[0.5, 0.9])
    mesh = SimMesh(tiny_model("llama"), cfg)
    assert [b.p for b in mesh.boundaries] == [0.5, 0.9]
    with pytest.raises(ConfigError, match="boundary.p lists 1 ratios but the pipeline has 2 boundaries"):
        config(mesh__pp=3, boundary__kind="mask", boundary__p=[0.5])


def test_top_follows_a_running_job_until_its_summary(tmp_path, capsys):
    """A running job (config.toml, rows arriving, no summary yet): the table is drawn again at each new step, and top
    exits 0 once summary.json appears."""
    import threading
    import time

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text("")

    def row(step: int, rank: int) -> str:
        return json.dumps({"step": step, "rank": rank, "replica": 0, "stage": rank, "compute_s": 0.1 * (rank + 1),
                           "wait_s": {str(1 - rank): 0.01}, "send_mbps": {"0": 50.0 + rank}}) + "\n"

    def job() -> None:
        with open(run / "ranks.jsonl", "a") as f:
            for step in range(3):
                f.write(row(step, 0) + row(step, 1))
                f.flush()
                time.sleep(0.3)
        (run / "summary.json").write_text(json.dumps({"slowest_rank": 1, "slowest_link": 0}))

    t = threading.Thread(target=job)
    t.start()
    assert main(["top", str(run), "--interval", "0.05"]) == 0
    t.join()
    out = capsys.readouterr().out
    assert "step 1 (" in out and "step 3 (3 steps recorded)" in out
    assert "finished: slowest rank 1, slowest link 0" in out
