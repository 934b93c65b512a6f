"""The Mosaic GPU interpreter from a user's own process on a machine with few cores.

Each test runs a fresh Python on two of this machine's cores (`os.sched_setaffinity`), with
neither PJRT_NPROC nor NPROC set (the conftest's settings are not inherited): XLA then sizes
its CPU thread pool to 2, too few for the interpreter's warpgroup threads, unless
`twell_jax` (through `pallas_kernels`) arranged a larger one before JAX's CPU client started.
"""

import os
import subprocess
import sys
import textwrap

from absl.testing import absltest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TWO_CORES = "import os; os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])\n"


def _run(code: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
  env = {k: v for k, v in os.environ.items() if k not in ("NPROC", "PJRT_NPROC")}
  env.update(PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, *(["-c", TWO_CORES + textwrap.dedent(code)]
                                           if code else args)],
                        env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)


FFN = """
    import jax, jax.numpy as jnp
    from twell_jax.testing import ffn_inputs
    x, wg, wu, wd = ffn_inputs(jax.random.key(0), 32, 128, 256, active_fraction=0.05)
    y = twell_jax.ffn(x, wg, wu, wd, implementation="mosaic_gpu", interpret=True)
    ref = twell_jax.ffn(x, wg, wu, wd, implementation="dense")
    print("max_abs_diff", float(jnp.max(jnp.abs(y.astype(float) - ref.astype(float)))))
"""


@absltest.skipUnless(hasattr(os, "sched_setaffinity"), "needs os.sched_setaffinity")
class InterpreterThreadsTest(absltest.TestCase):

  def test_plain_script_finishes(self):
    out = _run("import twell_jax\n" + textwrap.dedent(FFN))
    self.assertEqual(out.returncode, 0, out.stderr[-2000:])
    self.assertIn("max_abs_diff", out.stdout)
    self.assertLess(float(out.stdout.split()[-1]), 1e-2)

  def test_client_started_first_is_an_error_not_a_hang(self):
    out = _run("import jax.numpy as jnp\njnp.zeros(1).block_until_ready()\n"
               "import twell_jax\n" + textwrap.dedent(FFN))
    self.assertNotEqual(out.returncode, 0)
    self.assertIn("PJRT_NPROC", out.stderr)
    self.assertIn("Import twell_jax", out.stderr)

  def test_cli_trains_on_the_interpreted_kernels(self):
    import train_test_util as tu  # pylint: disable=import-outside-toplevel
    wd = self.create_tempdir().full_path
    cli = ("import sys, runpy; sys.argv = ['train.main'] + sys.argv[1:]; "
           "runpy.run_module('train.main', run_name='__main__')")
    out = _run(None, "-c", TWO_CORES + cli, *tu.main_cmd(wd)[3:],
               "--config.model.ffn_implementation=mosaic_gpu", "--config.model.interpret=True",
               "--config.model.dtype=bfloat16", "--config.model.n_layers=1",
               "--config.batch_size=2", "--config.data.seq_len=16",
               "--config.num_train_steps=1", "--config.eval_every=0",
               "--config.checkpoint_every=0", "--config.log_every=1")
    self.assertEqual(out.returncode, 0, out.stderr[-2000:])
    self.assertIn("FFN implementation: mosaic_gpu", out.stderr)
    self.assertRegex(out.stderr, r"step 1/1 .* loss \d+\.\d+")


if __name__ == "__main__":
  absltest.main()
