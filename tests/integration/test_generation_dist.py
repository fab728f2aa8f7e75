"""Generation on real processes (torchrun, gloo, 2 ranks = 2 stages) == the simulation == Hugging Face.

Each rank builds its own stage as ``--engine dist`` does (``RankSetup`` + ``DistEngine``) and runs its
part of the pass (``engine/dist_generate.py``); every rank must return the ids the simulation's lockstep
pass returns for the same config, greedy ids must equal ``model.generate`` on the whole model, and the
bytes the ranks meter must equal the simulation's.

Each rank writes its result to its own file (``result_rank{r}.json``, via a temporary file and a rename),
never to stdout: torchrun merges the ranks' stdout, and two ranks' lines can interleave there."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.unit.engine.test_generation import PROMPTS, TOK, hf_generate
from thinpipe.commands.launching import free_port, job_key_env
from thinpipe.config import load_config
from thinpipe.engine.sim_generate import generate_on_mesh
from thinpipe.engine.sim_mesh import SimMesh
from thinpipe.rank.from_config import load
from thinpipe.rank.generation import Sampling

RANK = textwrap.dedent("""
    import json, os, sys
    import torch.distributed as dist
    from thinpipe.comm.rendezvous import init_gloo
    from thinpipe.config import load_config
    from thinpipe.data.byte_tokenizer import ByteTokenizer
    from thinpipe.engine.dist_engine import DistEngine
    from thinpipe.engine.dist_generate import generate_on_rank
    from thinpipe.engine.dist_setup import RankSetup
    from thinpipe.rank.generation import Sampling
    job = json.loads(sys.argv[1])
    init_gloo(120)
    engine = DistEngine(RankSetup.build(load_config(None, job["sets"])))
    tok, out = ByteTokenizer(), {"rank": dist.get_rank()}
    for name, kw in job["samplings"].items():
        out[name] = generate_on_rank(engine, job["prompts"], Sampling(**kw), tok, batch_size=2,
                                     axis=job["axis"].get(name))
    out["rollout"] = engine.meter.totals["rollout"]
    path = os.path.join(job["out"], f"result_rank{dist.get_rank()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(out, f)
    os.replace(path + ".tmp", path)
    engine.close()
    dist.destroy_process_group()
""")

SAMPLINGS = {"greedy": {"max_new_tokens": 10, "temperature": 0},
             "sampled": {"max_new_tokens": 10, "temperature": 0.8, "top_p": 0.9, "top_k": 40, "seed": 5,
                         "eos_ids": [TOK.eos_token_id]}}
CASES = {"dense": ["mesh.pp=2"], "mapl": ["mesh.pp=2", "boundary.kind=mapl", "boundary.rank=8"]}


def torchrun(tmp_path, job: dict) -> list[dict]:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    job = {**job, "out": str(tmp_path)}
    with job_key_env() as key_env:
        env = {**os.environ, "OMP_NUM_THREADS": "1", **key_env}
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                            "127.0.0.1", "--master-port", str(free_port()), str(script), json.dumps(job)],
                           env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(f.read_text()) for f in sorted(tmp_path.glob("result_rank*.json"))]
    return sorted(rows, key=lambda row: row["rank"])


@pytest.mark.dist
@pytest.mark.parametrize("case", list(CASES))
def test_dist_generation_equals_the_simulation_and_hugging_face(case, tmp_path, one_thread):  # noqa: F811
    sets = ["model.name=tiny-llama", "data.name=synthetic", "train.batch_size=2", "train.seq_len=32",
            "data.val_rows=2", *CASES[case]]
    axis = {"sampled": "rollout"}
    ranks = torchrun(tmp_path, {"sets": sets, "prompts": PROMPTS, "samplings": SAMPLINGS, "axis": axis})
    assert len(ranks) == 2
    cfg = load_config(None, sets)
    loaded = load(cfg)
    mesh = SimMesh(loaded.model, cfg)
    for name, kw in SAMPLINGS.items():
        sim = generate_on_mesh(mesh, PROMPTS, Sampling(**kw), TOK, batch_size=2, axis=axis.get(name))
        assert ranks[0][name] == ranks[1][name] == sim, name
    if case == "dense":
        assert ranks[0]["greedy"] == hf_generate(loaded.model.eval(), PROMPTS, 10, TOK.pad_token_id)
    # each rank meters what it sends: stage 0 the activations, stage 1 the token messages
    assert ranks[0]["rollout"] + ranks[1]["rollout"] == mesh.meter.totals["rollout"] > 0
    assert ranks[0]["rollout"] > 0 and ranks[1]["rollout"] > 0
