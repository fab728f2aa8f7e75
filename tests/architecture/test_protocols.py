"""Every objective, pipe and engine keeps to its interface (``objective/base.py: Objective``, ``objective/pipe.py:
Pipe``, ``engine/loop.py: Engine``), and every built-in objective describes itself with an ``ObjectiveSpec``, as
tests/architecture/test_comm_protocols.py checks the transports: a member a class lacks, a method that falls back on
the Protocol's empty body or takes other parameters fails here, not in the middle of a run.

The engines and pipes are checked as classes (building a real rank needs a process group): each method is the
class's own with the Protocol's parameters, each attribute a class attribute or assigned in ``__init__``. The objectives
are also built over the simulation (a tiny model) and checked with ``isinstance`` against the runtime Protocol.
"""

import inspect
import re

import pytest

from tests.architecture.test_comm_protocols import check_signatures, methods
from tests.helpers import config
from thinpipe.engine.dist_engine import DistEngine
from thinpipe.engine.dist_pipe import DistPipe
from thinpipe.engine.elastic_rank import ElasticEngine
from thinpipe.engine.loop import Engine
from thinpipe.engine.sim_engine import SimEngine
from thinpipe.engine.sim_pipe import SimPipe
from thinpipe.objective import dpo, gspo, sft
from thinpipe.objective.base import Objective
from thinpipe.objective.pipe import Pipe
from thinpipe.objective.registry import BUILTIN
from thinpipe.objective.spec import ObjectiveSpec


def attributes(proto) -> list[str]:
    return [n for n in proto.__annotations__ if not n.startswith("_")]


def assigned(cls: type, name: str) -> bool:
    """``name`` is a class attribute of ``cls`` or assigned as ``self.name`` in an ``__init__`` of its classes."""
    if any(name in vars(c) for c in cls.__mro__):
        return True
    pattern = re.compile(rf"self\.{name}\b[^=\n]*=(?!=)|self\.{name}, [^=\n]*=(?!=)|, self\.{name}\b[^=\n]*=(?!=)")
    return any(pattern.search(inspect.getsource(c.__init__)) for c in cls.__mro__ if "__init__" in vars(c))


IMPLEMENTATIONS = {
    Objective: [sft.Sft, dpo.Dpo, gspo.Gspo],
    Pipe: [SimPipe, DistPipe],
    Engine: [SimEngine, DistEngine, ElasticEngine],
}


def test_the_interfaces_are_what_the_loop_and_the_objectives_call():
    assert methods(Engine) == ["residual_start", "before_step", "commit_step", "tokens_seen", "grad_norm",
                               "rank_rows", "router_aux_loss",
                               "bytes_total", "captured_energy", "diagnostics", "weights_finite", "save", "load",
                               "finish", "write_model", "summary_extras"]
    assert attributes(Engine) == ["lead", "world_size", "objective"]
    assert methods(Objective) == ["start", "residual_batches", "step", "anchor_rows", "validation",
                                  "validation_metrics", "metrics", "state_dict", "load_state_dict"]
    assert attributes(Objective) == ["tokens", "anchor_local"]
    assert methods(Pipe) == ["generate", "forward", "update", "heldout", "sum_stats"]
    assert attributes(Pipe) == ["replicas", "holds_last", "measures", "lead", "device"]


@pytest.mark.parametrize("proto,impl", [(p, c) for p, impls in IMPLEMENTATIONS.items() for c in impls],
                         ids=lambda x: x.__name__)
def test_every_implementation_has_every_member(proto, impl):
    check_signatures(impl, proto, returns=False)
    missing = [a for a in attributes(proto) if not assigned(impl, a)]
    assert not missing, f"{impl.__name__} has no {missing} of {proto.__name__}"


def test_every_builtin_objective_describes_itself_and_builds_an_objective(tmp_path):
    assert list(BUILTIN) == ["sft", "dpo", "gspo"]
    for name, spec in BUILTIN.items():
        assert isinstance(spec, ObjectiveSpec) and spec.name == name
    engine = SimEngine(config(model__name="tiny-llama", data__name="synthetic", train__steps=1, train__batch_size=2,
                              train__seq_len=32, mesh__pp=2))
    assert isinstance(engine.objective, Objective) and isinstance(engine.objective.pipe, Pipe)
