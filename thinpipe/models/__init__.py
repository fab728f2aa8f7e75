"""Load Hugging Face decoder-only causal LMs and split them into pipeline stages."""

from thinpipe.models.loading import LoadedModel, load_model, resolve_model_name
from thinpipe.models.stages import Stage, balanced_split, build_stages, merge_stages

__all__ = ["LoadedModel", "Stage", "balanced_split", "build_stages", "load_model", "merge_stages",
           "resolve_model_name"]
