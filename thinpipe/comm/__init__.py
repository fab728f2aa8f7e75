"""The narrow communication interface algorithms talk to (never torch.distributed directly): ``protocols.py``.

The package itself imports nothing: ``thinpipe launch`` (which needs ``netns``, ``bind``) and ``thinpipe --help``
stay free of torch; import what you use from its module (``comm/inprocess.py``, ``comm/meter.py``, ...).
"""
