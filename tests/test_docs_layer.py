"""docs/layer.md's mesh example (`id=layer_mesh`) on two host devices, so that its batch
really splits over the mesh; the page's other blocks run in tests/test_docs.py."""

import os
import subprocess
import sys

import docs_blocks


def test_mesh_example_splits_over_two_devices():
  block = docs_blocks.find("layer_mesh")
  assert block.lang == "python" and "jax.make_mesh" in block.code, block.where
  script = ("import twell_jax\n"
            f"exec(compile({block.code!r}, {block.where!r}, 'exec'), globals())\n"
            "assert mesh.devices.size == 2, mesh\n")
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
             JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=docs_blocks.ROOT,
                        capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 0, f"{block.where} failed:\n{proc.stderr[-3000:]}"
  assert "(8, 16, 64)" in proc.stdout, proc.stdout
