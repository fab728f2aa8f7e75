"""Planning a deployment: predicted step time, throughput, bytes and anchor staleness."""

from thinpipe.plan.planner import ARCHITECTURES, DEVICES, PRESETS, plan

__all__ = ["ARCHITECTURES", "DEVICES", "PRESETS", "plan"]
