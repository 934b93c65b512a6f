"""twell-jax: sparse (TwELL / hybrid ELL) feed-forward layers for transformer LMs in JAX.

Importing it before the first JAX computation gives the Mosaic GPU interpreter (interpret=True)
the XLA CPU threads it needs on machines with few cores (`pallas_kernels` does this).
"""

import importlib

import pallas_kernels  # noqa: F401  (sizes XLA's CPU thread pool for the interpreter)
from twell_jax.dense import reference_ffn
from twell_jax.api import ffn, resolve_implementation
from twell_jax.features import hot_feature_count, permute_features, sort_features
from twell_jax.formats import Hybrid, TwELL, to_dense, to_hybrid, to_twell
from twell_jax.stats import FFNStats
from twell_jax import sharded

__version__ = "0.1.0"

__all__ = ["ffn", "resolve_implementation", "sharded", "FFNStats", "TwELL", "Hybrid",
           "to_twell", "to_hybrid", "to_dense", "reference_ffn", "FeedForward", "layers",
           "sort_features", "permute_features", "hot_feature_count"]


def __getattr__(name):
  # The Flax layers are imported lazily so `import twell_jax` stays light.
  if name in ("FeedForward", "layers"):
    layers = importlib.import_module("twell_jax.layers")
    return layers if name == "layers" else layers.FeedForward
  raise AttributeError(f"module 'twell_jax' has no attribute {name!r}")
