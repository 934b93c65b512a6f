"""Pallas Mosaic GPU kernels of twell-jax (Hopper) and their f32 reference.

Importing the package sizes XLA's CPU thread pool for the Mosaic GPU interpreter where the
machine has fewer cores than it needs (`_target.arrange_interpreter_threads`).
"""

from pallas_kernels import _target as target

target.arrange_interpreter_threads()
