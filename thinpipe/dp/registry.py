"""A stage rank's DP scheme, built by its ``dp.kind``: the built-in schemes and those plugins registered
(``plugins.py: register_dp_scheme``, modules named in ``$THINPIPE_PLUGINS``). What a scheme says of itself
without torch is ``dp/kinds.py: describe``. docs/dp.md.
"""

from __future__ import annotations

from thinpipe.comm.protocols import Group
from thinpipe.config.dp import DPConfig
from thinpipe.dp.allreduce import AllReduce
from thinpipe.dp.diloco import DiLoCo
from thinpipe.dp.powersgd import PowerSGD
from thinpipe.dp.scheme import DPScheme, Trained
from thinpipe.dp.streaming import StreamingDiLoCo
from thinpipe.plugins import PLUGIN_DP_SCHEMES

# each the implementation of its description in dp/kinds.py: BUILTIN_KINDS (tests/unit/dp/test_scheme.py)
BUILTIN: dict[str, type[DPScheme]] = {s.kind: s for s in (AllReduce, PowerSGD, DiLoCo, StreamingDiLoCo)}


def scheme_class(kind: str) -> type[DPScheme]:
    found = {**BUILTIN, **PLUGIN_DP_SCHEMES}.get(kind)
    if found is None:
        raise ValueError(f"dp.kind = {kind!r} is unknown: choose one of {', '.join({**BUILTIN, **PLUGIN_DP_SCHEMES})}")
    return found


def build_scheme(cfg: DPConfig, trained: Trained, group: Group, member: int, seed: int) -> DPScheme:
    """The configured scheme of one stage rank (``DPScheme``'s arguments)."""
    return scheme_class(cfg.kind)(cfg, trained, group, member, seed)
