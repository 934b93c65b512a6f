"""Stage-by-stage GPU diagnostic: each stage runs in a subprocess with its own timeout.

    python3 -m pallas_kernels.gpu_diag STAGE...   (no args: run the default list)
"""
import subprocess
import sys
import time


def stage(name, m):
  import functools
  import statistics
  import jax
  import jax.numpy as jnp
  from pallas_kernels import benchmark as bm
  from pallas_kernels import gate_pack_mgpu as gp
  from pallas_kernels import sparse_down_mgpu as sd
  x, wg, wu, wd = bm.make_inputs(bm.Spec(m))

  def timeit(f, *a, n=20):
    t0 = time.time(); jax.block_until_ready(f(*a)); c = time.time() - t0
    ts = []
    for _ in range(n):
      t = time.perf_counter(); jax.block_until_ready(f(*a)); ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts), c

  if name == "gate":
    f = jax.jit(gp.gate_pack)
    ms, c = timeit(f, x, wg)
    words, counts = f(x, wg)
    g = jnp.dot(x, wg, preferred_element_type=jnp.float32)
    w2, c2 = gp.pack_reference(g)
    print(f"gate M={m}: {ms:.3f} ms (first call {c:.1f}s) counts_eq_frac="
          f"{float(jnp.mean(counts == c2)):.6f} words_eq_frac={float(jnp.mean(words == w2)):.6f}")
  elif name.startswith("down"):
    grp = int(name[4:] or 4)
    g = jnp.dot(x, wg, preferred_element_type=jnp.float32)
    words, counts = jax.jit(gp.pack_reference)(g)
    f = jax.jit(functools.partial(sd.sparse_down, group=grp))
    row_ok = jnp.ones((m,), jnp.int32)
    ms, c = timeit(f, x, words, counts, row_ok, wu.T, wd)
    print(f"down group={grp} M={m}: {ms:.3f} ms (first call {c:.1f}s)")
  elif name == "xla_gate":
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    ms, c = timeit(f, x, wg)
    print(f"xla gate GEMM M={m}: {ms:.3f} ms")


if __name__ == "__main__":
  if len(sys.argv) > 2 and sys.argv[1] == "--one":
    stage(sys.argv[2], int(sys.argv[3]))
    sys.exit(0)
  plan = sys.argv[1:] or ["gate:4096:90", "down1:4096:90", "down4:4096:60", "gate:16384:60",
                          "down4:16384:60", "xla_gate:16384:30"]
  for item in plan:
    name, m, to = item.split(":")
    t0 = time.time()
    try:
      r = subprocess.run([sys.executable, "-m", "pallas_kernels.gpu_diag", "--one", name, m],
                         timeout=int(to), capture_output=True, text=True)
      out = (r.stdout + r.stderr).strip().splitlines()
      keep = [l for l in out if not l.startswith("  File") and "xla_bridge" not in l]
      print(f"[{name} M={m}] rc={r.returncode} {time.time() - t0:.0f}s :: " + " | ".join(keep[-6:]), flush=True)
    except subprocess.TimeoutExpired:
      print(f"[{name} M={m}] TIMEOUT after {to}s", flush=True)
