"""Where a rank computes (thinpipe/placement.py, comm/staging.py), checked on the CPU.

The CUDA side of every promise is in tests/unit/models/test_gpu.py (marker ``gpu``, skipped without CUDA);
here: the device rules (with a faked GPU count), the one-line errors, and that the CPU path is
untouched (no staging copies, fp32, checkpoints that hold host tensors and load anywhere).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.helpers import config
from thinpipe import placement
from thinpipe.comm.staging import StagedWork, to_device, to_host
from thinpipe.config import ConfigError
from thinpipe.engine.sim_engine import train


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this machine has ``n`` CUDA devices (only the counting: nothing is allocated)."""
    def fake(n: int) -> None:
        monkeypatch.setattr(placement, "cuda_count", lambda: n)
    return fake


def test_device_rules(gpus):
    gpus(0)
    assert placement.resolve_device("auto") == torch.device("cpu")
    assert placement.resolve_device("cpu", local_rank=5) == torch.device("cpu")
    with pytest.raises(ConfigError, match="CUDA is not available"):
        placement.resolve_device("cuda")
    gpus(4)
    assert placement.resolve_device("auto") == torch.device("cuda", 0)              # the simulation
    assert placement.resolve_device("cuda", local_rank=6) == torch.device("cuda", 2)  # rank 6 of a host with 4
    assert placement.resolve_device("cuda:3", local_rank=0) == torch.device("cuda", 3)
    with pytest.raises(ConfigError, match="cuda:0..cuda:3"):
        placement.resolve_device("cuda:4")


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_precision_follows_the_device():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert placement.compute_dtype_name("auto", cpu) == "float32"
    assert placement.compute_dtype_name("auto", gpu) == "bfloat16"
    assert placement.compute_dtype_name("float32", gpu) == "float32"
    # autocast takes the device's type: torch.autocast("cpu") would leave CUDA tensors in fp32
    assert placement.autocast(gpu, torch.bfloat16).device == "cuda"
    assert placement.autocast(cpu, torch.bfloat16).device == "cpu"
    assert not isinstance(placement.autocast(gpu, torch.float32), torch.autocast)


@pytest.mark.parametrize("value", ["gpu", "cuda:x", "cuda0", ""])
def test_a_bad_device_is_a_config_error(value):
    with pytest.raises(ConfigError, match="train.device must be"):
        config(train__device=value)


@pytest.mark.slow  # a whole CLI process (torch, thinpipe, a model): 4-9 s here, by load
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error a machine without CUDA gives")
def test_cuda_on_a_machine_without_cuda_is_one_line_and_exit_2(tmp_path):
    r = subprocess.run([sys.executable, "-m", "thinpipe", "train", "--out", str(tmp_path / "r"), "--quiet",
                        "--set", "model.name=tiny-llama", "--set", "data.name=synthetic", "--set", "train.steps=1",
                        "--set", "train.device=cuda"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "train.device = cuda but CUDA is not available" in lines[0], r.stderr


def test_staging_is_the_identity_on_the_cpu():
    t = torch.randn(3, 4)
    assert to_host(t) is t                       # no copy: the CPU path sends what it always sent
    assert to_device(t, torch.device("cpu")) is t
    assert to_device(t, None) is t


def test_staged_work_copies_the_result_back_when_waited_on():
    class Work:
        waited = False

        def wait(self):
            self.waited = True

        def is_completed(self):
            return self.waited

    target, host = torch.zeros(3), torch.zeros(3)
    work = StagedWork(Work(), host, target)
    host += 7.0                                   # the collective's result lands in the host copy
    assert torch.equal(target, torch.zeros(3))    # not before the wait
    work.wait()
    assert torch.equal(target, torch.full((3,), 7.0))


def test_a_run_records_the_precision_it_resolved(tmp_path):
    cfg = config(model__name="tiny-llama", data__name="synthetic", train__steps=2, train__batch_size=2,
                 train__seq_len=32, train__checkpoint_every=1, mesh__pp=2, boundary__kind="mask")
    assert cfg.train.dtype == "auto" and cfg.train.device == "auto"
    train(cfg, tmp_path / "r", progress=False)
    text = (tmp_path / "r" / "config.toml").read_text()
    expected = "bfloat16" if torch.cuda.is_available() else "float32"
    assert f'dtype = "{expected}"' in text          # what the run used, so a resume keeps it
