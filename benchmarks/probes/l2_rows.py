"""How fast can an H100 stream random D-long weight rows out of its L2? (the gathers' ceiling)

Every sparse kernel of this package is a row gather: per active entry it reads one or two
contiguous D-long bf16 rows (4 KiB at D=2048) of a weight table that fits in the L2 (W_up^T +
W_down at the paper shape: 46 MB), with 16-byte vector loads from GMEM into registers. This
probe measures the ceiling of that access pattern with nothing else in the kernel: no index
loads (the row numbers are a hash of the step), no reductions, no stores but one row per CTA.

    probe kernel: CTA c, step i, row u of `unroll`:  j = hash(c, i, u) mod R
                  acc += table[j, :]            (f32, 16-byte loads, D/128 values per thread)
    bytes read = n_ctas * steps * unroll * D * 2;  rate = bytes / CUPTI kernel time

Also a "sequential" variant (rows in order, each CTA its own contiguous range, wrapping) to
tell random-row costs from L2 bandwidth.

``probe_tma`` reads the same rows (same sums) through TMA instead: per step, ``unroll`` rows
copied into SMEM (each as D / ``chunk`` copies of [1, chunk]), two slots so that step i + 1's
copies are in flight while step i's rows are added from SMEM. It measures what a tensor-core
design would pay to gather rows one TMA copy each (a TMA-fed tensor-core SDDMM), with
nothing else in the kernel. Run on the GPU machine:

    python -m benchmarks.probes.l2_rows            (prints a table; --out writes JSON)
    python -m benchmarks.probes.l2_rows --variants=tma     (the TMA gathers only)
    python -m benchmarks.probes.l2_rows --row_elems=2048,4096   (4 KiB against 8 KiB rows)
"""

from __future__ import annotations

import functools
import json

from absl import app
from absl import flags
import jax
from jax import lax
from jax.experimental import pallas as pl
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu
import numpy as np

from benchmarks.common import timing
from pallas_kernels import _target as target
from pallas_kernels import _row_loops as row_loops


def _define_flags():
  """The command line (defined when run as a program, so tests can import this module)."""
  flags.DEFINE_string("out", "", "write the table as JSON here")
  flags.DEFINE_list("variants", ["registers"], "registers (GMEM loads into registers, "
                    "``probe``) and / or tma (``probe_tma``)")
  flags.DEFINE_list("row_elems", ["2048"], "row lengths D of the register probe's tables "
                    "(bf16 elements; 2048 = 4 KiB, the paper's rows); each length gets tables "
                    "of the same bytes as D=2048's")
  flags.DEFINE_float("total_gb", 4.0, "bytes each probe reads (GB), the forward fused "
                     "kernel's 4.03 GB by default")


_HASH = np.int32(np.uint32(2654435761).view(np.int32))  # Knuth's multiplicative hash, as int32


def _row_index(c, i, u, *, steps: int, unroll: int, n_rows: int, order: str):
  lin = (c * steps + i) * unroll + u
  if order == "sequential":
    return lax.rem(lin, n_rows)
  return lax.rem((lin * _HASH) & 0x7FFFFFFF, n_rows)


def _probe_kernel(table_gmem, out_gmem, *, steps: int, unroll: int, order: str):
  n_rows = table_gmem.shape[0]
  c = lax.axis_index("c")
  acc0 = row_loops.zeros_like_row(table_gmem[0, :])

  def body(i, acc):
    rows = [table_gmem[_row_index(c, i, u, steps=steps, unroll=unroll, n_rows=n_rows,
                                  order=order), :] for u in range(unroll)]
    for row in rows:
      acc = acc + row.astype(jnp.float32)
    return acc

  out_gmem[c, :] = lax.fori_loop(0, steps, body, acc0)


def probe(table, *, n_ctas: int, steps: int, unroll: int, order: str = "random",
          interpret=False):
  """[n_ctas, D] f32: each CTA's sum of the rows it read (see the module docstring)."""
  d = table.shape[1]
  with target.interpret_context(bool(interpret)):
    return plgpu.kernel(
        functools.partial(_probe_kernel, steps=steps, unroll=unroll, order=order),
        out_type=jax.ShapeDtypeStruct((n_ctas, d), jnp.float32),
        grid=(n_ctas,),
        grid_names=("c",),
        compiler_params=row_loops.gather_kernel_params(),
        interpret=target.interpret_params(interpret),
        kernel_name="l2_probe",
    )(table)


def _tma_probe_kernel(table_gmem, out_gmem, rows_smem, ready, *, steps: int, unroll: int,
                      order: str, chunk: int):
  n_rows, d = table_gmem.shape
  c = lax.axis_index("c")

  def issue(i, slot):
    for u in range(unroll):
      j = _row_index(c, i, u, steps=steps, unroll=unroll, n_rows=n_rows, order=order)
      for k in range(d // chunk):
        plgpu.copy_gmem_to_smem(table_gmem.at[pl.ds(j, 1), pl.ds(k * chunk, chunk)],
                                rows_smem.at[slot, pl.ds(u, 1), pl.ds(k * chunk, chunk)],
                                ready.at[slot])

  def body(i, acc):
    slot = lax.rem(i, 2)
    # Every thread is past its reads of the other slot (step i - 1) before it is refilled.
    plgpu.commit_smem()

    @pl.when(i + 1 < steps)
    def _():
      issue(i + 1, 1 - slot)

    plgpu.barrier_wait(ready.at[slot])
    for u in range(unroll):
      acc = acc + rows_smem[slot, u, :].astype(jnp.float32)
    return acc

  issue(0, 0)
  # (zeros in the layout of a row read from SMEM: the loop carry must keep one layout)
  out_gmem[c, :] = lax.fori_loop(0, steps, body, row_loops.zeros_like_row(rows_smem[0, 0, :]))


def probe_tma(table, *, n_ctas: int, steps: int, unroll: int, order: str = "random",
              chunk: int = 256, interpret=False):
  """``probe``'s sums, the rows gathered into SMEM by TMA copies (module docstring)."""
  d = table.shape[1]
  # Mosaic GPU's async copies take at most 256 elements per dimension.
  if d % chunk or not 0 < chunk <= 256:
    raise ValueError(f"probe_tma: {chunk=} must divide D={d} and be at most 256")
  with target.interpret_context(bool(interpret)):
    return plgpu.kernel(
        functools.partial(_tma_probe_kernel, steps=steps, unroll=unroll, order=order,
                          chunk=chunk),
        out_type=jax.ShapeDtypeStruct((n_ctas, d), jnp.float32),
        # One barrier per slot; every copy into the slot arrives on it once.
        scratch_types=[plgpu.SMEM((2, unroll, d), table.dtype),
                       plgpu.Barrier(num_arrivals=unroll * (d // chunk), num_barriers=2)],
        grid=(n_ctas,),
        grid_names=("c",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=target.interpret_params(interpret),
        kernel_name="l2_probe_tma",
    )(table)


def probe_reference(table, *, n_ctas: int, steps: int, unroll: int, order: str = "random"):
  """NumPy value of ``probe`` (for the test)."""
  t = np.asarray(table, np.float32)
  n_rows = t.shape[0]
  out = np.zeros((n_ctas, t.shape[1]), np.float32)
  for c in range(n_ctas):
    lin = (c * steps + np.arange(steps)[:, None]) * unroll + np.arange(unroll)[None, :]
    lin = lin.astype(np.int32)
    if order == "sequential":
      idx = lin % n_rows
    else:
      idx = ((lin * _HASH) & 0x7FFFFFFF) % n_rows
    out[c] = t[idx.reshape(-1)].sum(axis=0)
  return out


def main(argv):
  del argv
  d = 2048
  sms = target.num_sms()
  print(f"device: {jax.devices()[0].device_kind}, {sms} SMs, jax {jax.__version__}")
  if unknown := set(flags.FLAGS.variants) - {"registers", "tma"}:
    raise app.UsageError(f"--variants: unknown {sorted(unknown)} (registers, tma)")
  row_elems = _parse_row_elems(flags.FLAGS.row_elems)
  results = []
  if "tma" in flags.FLAGS.variants:
    results += _main_tma(d, sms, _rows_total(d))
  if "registers" in flags.FLAGS.variants:
    for elems in row_elems:
      results += _main_registers(elems, sms, _rows_total(elems))
  best = {}
  for r in results:
    k = (r["variant"], r["d"], r["table_mb"], r["order"])
    if r["tbps"] == r["tbps"] and r["tbps"] > best.get(k, {}).get("tbps", 0):
      best[k] = r
  print("\nbest per variant / table / order:")
  for (variant, elems, mb, order), r in sorted(best.items()):
    print(f"  {variant:9s} D={elems:5d} {mb:5.1f} MB {order:10s}: {r['tbps']:.2f} TB/s (unroll "
          f"{r['unroll']}, {r['ctas']} CTAs)")
  _write(results)


def _rows_total(d):
  """Rows of ``d`` bf16 elements in the ``--total_gb`` each probe reads."""
  return int(flags.FLAGS.total_gb * 1e9 / (d * 2))


def _parse_row_elems(values):
  """``--row_elems`` as ints; each a multiple of 128 (one 16-byte load per thread of a
  warpgroup) dividing 1024 * 2048 (so every table keeps the D=2048 tables' bytes)."""
  try:
    elems = [int(v) for v in values]
  except ValueError as e:
    raise app.UsageError(f"--row_elems: {values} are not all integers") from e
  if bad := [e for e in elems if e <= 0 or e % 128 or (1024 * 2048) % e]:
    raise app.UsageError(f"--row_elems: {bad} must be positive multiples of 128 that divide "
                         f"{1024 * 2048}")
  return elems


def _main_registers(d, sms, rows_total):
  """``probe`` per table size, row order, rows per step and CTAs per SM, rows of ``d``
  elements. Tables (bytes as at D=2048): 4 MB (L2 surely), 23 MB (one paper-shape weight),
  46 MB (the forward's two, or the two of W_up^T / W_down side by side as one [H, 2D]
  table at d=4096)."""
  results = []
  for n_rows in (1024 * 2048 // d, 5632 * 2048 // d, 11264 * 2048 // d):
    table = jax.random.normal(jax.random.key(n_rows), (n_rows, d), jnp.float32).astype(
        jnp.bfloat16)
    for order in ("random", "sequential"):
      for unroll in (1, 2, 4, 8):
        for ctas_per_sm in (4, 8, 16):
          results.append(_measure(probe, table, sms * ctas_per_sm, unroll, rows_total,
                                  variant="registers", order=order))
  return results


def _measure(probe_fn, table, n_ctas, unroll, rows_total, **labels):
  """One probe configuration: CUPTI time of ``probe_fn`` reading ~``rows_total`` rows of
  ``table`` in ``labels["order"]``; prints and returns a result row (``labels`` included)."""
  n_rows, d = table.shape
  steps = max(1, rows_total // (n_ctas * unroll))
  f = jax.jit(functools.partial(probe_fn, n_ctas=n_ctas, steps=steps, unroll=unroll,
                                order=labels["order"]))
  jax.block_until_ready(f(table))
  ms = timing.device_ms(f, table, iterations=5)
  gbytes = n_ctas * steps * unroll * d * 2 / 1e9
  tbps = gbytes / ms if ms else float("nan")
  row = dict(labels, d=d, table_mb=n_rows * d * 2 / 1e6, unroll=unroll, ctas=n_ctas, gb=gbytes,
             ms=ms, tbps=tbps)
  print(f"  {' '.join(f'{v}' for v in labels.values())} D={d} table {row['table_mb']:5.1f} MB "
        f"unroll {unroll} ctas {n_ctas:5d}: {gbytes:.2f} GB in {ms:.3f} ms = {tbps:.2f} TB/s",
        flush=True)
  return row


def _write(results):
  if flags.FLAGS.out:
    with open(flags.FLAGS.out, "w") as fh:
      json.dump(results, fh, indent=1)


def _main_tma(d, sms, rows_total):
  """``probe_tma`` on one paper-shape weight (23 MB), random rows, per rows per step and CTAs
  per SM (SMEM: 2 slots x unroll rows x 4 KB per CTA)."""
  n_rows = 5632
  table = jax.random.normal(jax.random.key(n_rows), (n_rows, d), jnp.float32).astype(
      jnp.bfloat16)
  results = []
  chunk = 256  # the widest copy (probe_tma): a 2048-column row is 8 copies
  for unroll in (2, 4, 8):
    for ctas_per_sm in (1, 2, 3, 6):
      if ctas_per_sm * 2 * unroll * d * 2 > 220_000:  # SMEM per SM
        continue
      results.append(_measure(functools.partial(probe_tma, chunk=chunk), table,
                              sms * ctas_per_sm, unroll, rows_total, variant="tma",
                              order="random", chunk=chunk))
  return results


if __name__ == "__main__":
  _define_flags()
  app.run(main)
