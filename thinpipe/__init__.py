"""thinpipe: train and adapt LLMs over thin pipes (masked PP, anchor priors, compressed DP)."""

__version__ = "0.1.0"
