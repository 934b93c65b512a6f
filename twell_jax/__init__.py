"""twell-jax: sparse (TwELL / hybrid ELL) feed-forward layers for transformer LMs in JAX."""

from twell_jax.dense import reference_ffn
from twell_jax.api import ffn
from twell_jax.formats import Hybrid, TwELL, to_dense, to_hybrid, to_twell
from twell_jax.stats import FFNStats

__version__ = "0.1.0"

__all__ = ["ffn", "FFNStats", "TwELL", "Hybrid", "to_twell", "to_hybrid", "to_dense",
           "reference_ffn", "FeedForward"]


def __getattr__(name):
  # The Flax layer is imported lazily so `import twell_jax` stays light.
  if name == "FeedForward":
    from twell_jax.layers import FeedForward  # pylint: disable=import-outside-toplevel
    return FeedForward
  raise AttributeError(f"module 'twell_jax' has no attribute {name!r}")
