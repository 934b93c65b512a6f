"""docs/layer.md and README.md's "Using the layer" section run as written.

Their unmarked ```python blocks run in order in one subprocess with 2 host devices (so the
mesh example splits the batch). A block marked `<!-- docs-test: gpu -->` or `id=NAME` is
left to its own runner.
"""

import os
import subprocess
import sys

import docs_blocks


def _layer_blocks() -> list[docs_blocks.Block]:
  readme = docs_blocks.ROOT / "README.md"
  lines = readme.read_text().splitlines()
  start = lines.index("## Using the layer") + 1
  end = next(i for i in range(start, len(lines)) if lines[i].startswith("## "))
  in_section = [b for b in docs_blocks.blocks(readme) if start < b.line <= end]
  page = docs_blocks.blocks(docs_blocks.ROOT / "docs" / "layer.md")
  return [b for b in in_section + page if b.lang == "python" and not b.gpu and b.id is None]


def test_layer_docs_python_blocks_run_in_order():
  blocks = _layer_blocks()
  assert len(blocks) >= 6, [b.where for b in blocks]
  # Each block runs in a fresh namespace, as a reader who copies one block would run it.
  script = "\n".join(
      f"print('BLOCK {b.where}', flush=True)\nexec(compile({b.code!r}, {b.where!r}, 'exec'), {{}})"
      for b in blocks)
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
  proc = subprocess.run([sys.executable, "-c", "import twell_jax\n" + script], env=env,
                        cwd=docs_blocks.ROOT, capture_output=True, text=True, timeout=600,
                        check=False)
  ran = [l for l in proc.stdout.splitlines() if l.startswith("BLOCK ")]
  assert proc.returncode == 0, f"{ran[-1:]} failed:\n{proc.stderr[-3000:]}"
  assert len(ran) == len(blocks)
