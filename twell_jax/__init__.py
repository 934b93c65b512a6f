"""twell-jax: sparse (TwELL / hybrid ELL) feed-forward layers for transformer LMs in JAX.

Importing it before the first JAX computation gives the Mosaic GPU interpreter (interpret=True)
the XLA CPU threads it needs on machines with few cores (`pallas_kernels` does this).
"""

import pallas_kernels  # noqa: F401  (sizes XLA's CPU thread pool for the interpreter)
from twell_jax.dense import reference_ffn
from twell_jax.api import ffn
from twell_jax.features import hot_feature_count, permute_features, sort_features
from twell_jax.formats import Hybrid, TwELL, to_dense, to_hybrid, to_twell
from twell_jax.stats import FFNStats

__version__ = "0.1.0"

__all__ = ["ffn", "FFNStats", "TwELL", "Hybrid", "to_twell", "to_hybrid", "to_dense",
           "reference_ffn", "FeedForward", "sort_features", "permute_features",
           "hot_feature_count"]


def __getattr__(name):
  # The Flax layer is imported lazily so `import twell_jax` stays light.
  if name == "FeedForward":
    from twell_jax.layers import FeedForward  # pylint: disable=import-outside-toplevel
    return FeedForward
  raise AttributeError(f"module 'twell_jax' has no attribute {name!r}")
