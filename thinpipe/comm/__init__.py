"""The narrow communication interface algorithms talk to (never torch.distributed directly): ``protocols.py``."""

from thinpipe.comm.inprocess import InProcessGroup, LocalGroup, Mailbox, Work, drive_lockstep
from thinpipe.comm.meter import AXES, ByteMeter

__all__ = ["AXES", "ByteMeter", "InProcessGroup", "LocalGroup", "Mailbox", "Work", "drive_lockstep"]
