r"""Kernel-level sweeps on the GPU (device time per kernel from CUPTI), paper shape by default.

    python -m pallas_kernels.sweep [gate] [gate_chunks] [gate_steps] [down] [down_dh] [ahead] [train_ahead] [bwd] [train] [l2]

* ``gate``: ``gate_pack`` under several ``GateConfig`` schedules (wgmma pipelining depth,
  2-CTA clusters with W multicast, tile order); every config's words / counts must equal the
  default's bit for bit. XLA's gate GEMM (with ReLU, bf16 out) for scale.
* ``down``: the fused up/down kernel on the real pattern, and on the same pattern with every
  column folded into 8 per tile (a 176-row working set that lives in L1/L2): if the second is
  much faster, the kernel is bound by its weight-row traffic, else by latency / instructions.
* ``down`` also times the sparse_down versions (x placement, split sampled-up + down pair) and
  the whole forward per version against XLA dense.
* ``gate_chunks``: the library gate kernel per packing chunk width and row-max method.
* ``gate_steps``: the whole forward and forward + backward per library gate schedule.
* ``l2``: XLA's own fused row gather + sum at the fused kernels' access pattern (TB/s): the
  device's gather ceiling, independent of our kernels.
* ``down_dh``: the column-side dh + dW_down kernel per group, and timing diagnostics without
  its reduction / its stores (``csc_down_dh(diagnostic=...)``).
* ``ahead``: each gather kernel of the training step with its rows loaded one step ahead or
  not (``rows_ahead``), then the step per ``TrainConfig.rows_ahead`` (``train_ahead``: only
  the step).
* ``bwd``: the training kernels per variant (weight gradients in 1-3 kernels, group),
  then forward + backward per TrainConfig variant against XLA dense.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys

import jax
import jax.numpy as jnp

from pallas_kernels import bench_train
from pallas_kernels import benchmark
from pallas_kernels import common
from pallas_kernels import ffn_train_mgpu
from pallas_kernels import gate_pack_mgpu as gp
from pallas_kernels import sparse_down_mgpu
from pallas_kernels import train_bwd_mgpu
from pallas_kernels import train_fwd_mgpu


def kernel_ms(f, *args, iterations=10):
  """Median device ms of one call (all its kernels summed), or nan."""
  ms = common.device_ms(f, *args, iterations=iterations)
  return float("nan") if ms is None else ms


def _variants(label, fns, args, compared=lambda out: out):
  """Runs each (name, jitted f) of ``fns`` on ``args``; yields (name, f, same) for those that
  run, ``same`` = ``compared(output)`` bit-equal to the first one that ran (failures are
  printed and skipped)."""
  base = None
  for name, f in fns:
    try:
      out = compared(jax.block_until_ready(f(*args)))
    except Exception as e:
      print(f"  {label} {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
      continue
    base = out if base is None else base
    yield name, f, all(bool(jnp.array_equal(a, b)) for a, b in
                       zip(jax.tree.leaves(out), jax.tree.leaves(base)))


def _print_xla_gate(x, wg):
  """XLA's relu(x @ w_gate) (bf16 out): the gate GEMM without any packing, for scale."""
  xla = jax.jit(lambda a, b: jnp.maximum(a @ b, 0))
  print(f"  XLA relu(x @ w_gate) bf16: {kernel_ms(xla, x, wg):.4f} ms", flush=True)


def sweep_gate(x, wg):
  """gate_pack per GateConfig (the words must equal the default's) against XLA's GEMM and
  jax's own Pallas Hopper matmul (no epilogue work: the pipeline's own speed at this shape);
  ``pack=False`` times our kernel without the extraction loop."""
  _print_xla_gate(x, wg)
  from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm  # pylint: disable=import-outside-toplevel
  for tm, tn, wgd, cl in ((64, 256, hm.MatmulDimension.M, None),
                          (128, 128, hm.MatmulDimension.N, None),
                          (128, 128, hm.MatmulDimension.N, hm.MatmulDimension.M)):
    cfg = hm.TuningConfig(tile_m=tm, tile_n=tn, tile_k=64, max_concurrent_steps=4,
                          grid_minor_dim=hm.MatmulDimension.M, grid_tile_width=8,
                          wg_dimension=wgd, cluster_dimension=cl)
    try:
      f = jax.jit(lambda a, b, cfg=cfg: hm.matmul(a, b, None, cfg))
      print(f"  jax hopper_matmul_mgpu tile {tm}x{tn} wg={wgd} cluster={cl}: "
            f"{kernel_ms(f, x, wg):.4f} ms", flush=True)
    except Exception as e:
      print(f"  jax hopper_matmul_mgpu {tm}x{tn}: FAILED {type(e).__name__}: {str(e)[:200]}",
            flush=True)
  configs = [
      gp.GateConfig(),
      gp.GateConfig(extract_ways=1),
      gp.GateConfig(pack=False),
      gp.GateConfig(epilogue_wg=True, max_concurrent_steps=3, extract_ways=1),
      gp.GateConfig(epilogue_wg=True, max_concurrent_steps=3, extract_ways=1, pack=False),
      gp.GateConfig(epilogue_wg=True, max_concurrent_steps=3),
      gp.GateConfig(max_concurrent_steps=3),
  ]
  fns = [(_short(cfg), jax.jit(functools.partial(gp.gate_pack, config=cfg)))
         for cfg in configs]
  for name, f, same in _variants("gate_pack", fns, (x, wg)):
    print(f"  gate_pack {name}: {kernel_ms(f, x, wg):.4f} ms  equal_to_default={same}",
          flush=True)


def sweep_gate_chunks(x, wg, variants=((256, "smem"), (64, "smem"), (64, "reduce"),
                                        (128, "reduce"))):
  """The library gate kernel per packing chunk width and row-max method (``pack_chunk`` /
  ``packer_row_max``): fewer live keys per packer thread against more loops and loads."""
  _print_xla_gate(x, wg)
  configs = [dataclasses.replace(gp.LIBRARY_CONFIG, pack_chunk=c, packer_row_max=r)
             for c, r in variants]
  fns = [(_short(cfg), jax.jit(functools.partial(gp.gate_pack, config=cfg)))
         for cfg in configs]
  for name, f, same in _variants("gate_pack", fns, (x, wg)):
    print(f"  gate_pack {name}: {kernel_ms(f, x, wg):.4f} ms  equal_to_first={same}",
          flush=True)


GATE_STEP_CONFIGS = (gp.GateConfig(), gp.LIBRARY_CONFIG)


def sweep_gate_steps(x, wg, wu, wd):
  """Whole forward and forward + backward per library gate schedule (``LIBRARY_CONFIG``
  swapped in-process) against XLA dense, same process, wall time."""
  from pallas_kernels import ffn_mgpu  # pylint: disable=import-outside-toplevel
  spec = bench_train.SPECS["paper_16k"]
  ct = jax.random.normal(jax.random.key(1), x.shape, jnp.float32)
  dense_f, _, _ = common.time_fn(benchmark.dense_ffn, x, wg, wu, wd, iters=30,
                                 kernel_time=False)
  dense_b = jax.jit(jax.grad(bench_train._loss_fn("dense", spec, ct), argnums=(0, 1, 2, 3)))  # pylint: disable=protected-access
  dense_b, _, _ = common.time_fn(dense_b, x, wg, wu, wd, iters=20, kernel_time=False)
  print(f"  XLA dense: forward {dense_f:.3f} ms, fwd+bwd {dense_b:.3f} ms (wall)", flush=True)
  saved = gp.LIBRARY_CONFIG
  try:
    for cfg in GATE_STEP_CONFIGS:
      gp.LIBRARY_CONFIG = cfg
      fwd = jax.jit(lambda *a: ffn_mgpu.ffn_forward(*a)[0])
      step = jax.jit(jax.grad(bench_train._loss_fn("mosaic_gpu", spec, ct), argnums=(0, 1, 2, 3)))  # pylint: disable=protected-access
      try:
        f_ms, _, _ = common.time_fn(fwd, x, wg, wu, wd, iters=30, kernel_time=False)
        b_ms, _, _ = common.time_fn(step, x, wg, wu, wd, iters=20, kernel_time=False)
      except Exception as e:
        print(f"  {_short(cfg)}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        continue
      print(f"  gate {_short(cfg)}: forward {f_ms:.3f} ms (ratio {f_ms / dense_f:.3f}), "
            f"fwd+bwd {b_ms:.3f} ms (ratio {b_ms / dense_b:.3f})", flush=True)
  finally:
    gp.LIBRARY_CONFIG = saved


def sweep_l2(wu, wd, m=16384, active=30):
  """Row-gather throughput of XLA's own fused gather + sum (no Pallas), the access pattern of
  the fused kernels: ``active`` uniform random weight rows (4 KiB each) per token, summed.
  Compares the gather ceiling of the device with what our kernels reach (PERF.md)."""
  h, d = wd.shape
  idx = jax.random.randint(jax.random.key(7), (m, active), 0, h)
  wut = jnp.asarray(wu.T)
  cases = (
      ("one table (W_down, 23 MB)", lambda i: jnp.take(wd, i, axis=0), 1, idx),
      ("two tables (W_up^T + W_down, 46 MB)",
       lambda i: jnp.take(wut, i, axis=0) + jnp.take(wd, i, axis=0), 2, idx),
      ("one table, 256 rows (2 MB, L2 / L1 resident)", lambda i: jnp.take(wd, i, axis=0), 1,
       idx % 256),
  )
  for label, g, tables, ii in cases:
    f = jax.jit(lambda i, g=g: g(i).astype(jnp.float32).sum(1))
    table = common.kernel_breakdown(f, ii)
    if not table:
      continue
    ms = sum(t for _, t in table)
    gb = m * active * d * 2 * tables / 1e9
    print(f"  XLA gather+sum, {label}: {len(table)} kernel(s) {ms:.4f} ms, {gb:.2f} GB "
          f"gathered -> {gb / ms:.2f} TB/s  ({', '.join(n[:30] for n, _ in table)})",
          flush=True)


def _short(cfg):
  d = gp.GateConfig()
  return " ".join(f"{k}={v}" for k, v in dataclasses.asdict(cfg).items()
                  if v != getattr(d, k)) or "default"


DOWN_VARIANTS = (
    dict(prefetch=False),
    dict(),
    dict(x_mode="f32"),
    dict(x_mode="bf16"),
    dict(split=True, x_mode="f32"),
    dict(split=True),
)


def sweep_down(x, wg, wu, wd, fold=True):
  """Kernel time of every sparse_down version (all must give the default's bits), then the
  whole forward per version against XLA dense in the same process."""
  words, counts = jax.jit(gp.gate_pack)(x, wg)
  m = x.shape[0]
  row_ok = jnp.ones((m,), jnp.int32)
  wut = jnp.asarray(wu.T)
  folded = jnp.where(words == common.EMPTY_WORD, words, words & 0x0007FFFF)
  fns = [(kw or "default", jax.jit(functools.partial(sparse_down_mgpu.sparse_down, **kw)))
         for kw in DOWN_VARIANTS]
  for name, f, same in _variants("sparse_down", fns, (x, words, counts, row_ok, wut, wd)):
    real = kernel_ms(f, x, words, counts, row_ok, wut, wd)
    line = f"  sparse_down {name}: real pattern {real:.4f} ms, equal_to_v1={same}"
    if fold:
      # Keep only the low 3 bits of each local column: 8 columns per tile, 176 weight rows.
      line += f", folded (176-row working set) {kernel_ms(f, x, folded, counts, row_ok, wut, wd):.4f} ms"
    print(line, flush=True)
  dense_ms, _, _ = common.time_fn(benchmark.dense_ffn, x, wg, wu, wd, iters=20,
                                  kernel_time=False)
  print(f"  forward: XLA dense {dense_ms:.3f} ms (wall, median of 20)", flush=True)
  for kw in DOWN_VARIANTS[1:]:
    from pallas_kernels import ffn_mgpu  # pylint: disable=import-outside-toplevel
    f = jax.jit(lambda *a, kw=kw: ffn_mgpu.ffn_forward(*a, **kw)[0])
    ms, _, _ = common.time_fn(f, x, wg, wu, wd, iters=20, kernel_time=False)
    print(f"  forward {kw or 'default'}: {ms:.3f} ms wall, ratio {ms / dense_ms:.3f}",
          flush=True)


def sweep_bwd(spec_name="paper_16k", variants_rows=False, train_only=False,
              down_dh_only=False, ahead_only=False, train_variants=None):
  """Training kernels: where x / dy rows live (``x_mode``, with ``variants_rows``), the weight
  gradients in 1-3 kernels and ``group``; the weight gradients must keep the default's bits. Then forward + backward per
  TrainConfig variant against XLA dense forward + backward in the same process."""
  spec = bench_train.SPECS[spec_name]
  from twell_jax.testing import ffn_inputs  # pylint: disable=import-outside-toplevel
  x, wg, wu, wd = ffn_inputs(jax.random.key(0), spec.m, spec.d, spec.h,
                             active_fraction=spec.active / spec.h)
  if train_only:  # the whole step only: none of the kernel inputs below
    return sweep_train(spec, x, wg, wu, wd, variants=train_variants or TRAIN_VARIANTS)
  cfg = ffn_train_mgpu.make_config(spec.m, spec.d, spec.h, spec.ell_width, spec.tail_rows)
  _, resid = jax.jit(lambda *a: ffn_train_mgpu.forward(cfg, *a))(x, wg, wu, wd)
  _, _, _, _, cols, p, u, n = resid[:8]
  dy = jax.random.normal(jax.random.key(1), x.shape, jnp.bfloat16)
  c = jnp.full((1,), 2e-5 / spec.m, jnp.float32)
  wut, wgt = jnp.asarray(wu.T), jnp.asarray(wg.T)

  def variants(label, fn, args, kws):
    # (Outputs with unused ELL slots hold garbage there: same_bits is only meaningful for
    # the weight gradients.)
    fns = [(kw, jax.jit(functools.partial(fn, **kw))) for kw in kws]
    for name, f, same in _variants(label, fns, args):
      print(f"  {label} {name}: {kernel_ms(f, *args):.4f} ms  same_bits={same}", flush=True)

  if variants_rows:
    variants("ell_up_down", train_fwd_mgpu.ell_up_down, (x, cols, p, n, wut, wd),
             [dict(group=2), dict(group=2, x_mode="bf16"), dict(group=2, x_mode="reload"),
              dict(group=4, x_mode="reload")])
    variants("ell_bwd_rows", train_bwd_mgpu.ell_bwd_rows, (dy, cols, p, u, n, c, wd, wut, wgt),
             [dict(group=2), dict(group=2, dy_mode="bf16"), dict(group=2, dy_mode="reload"),
              dict(group=4, dy_mode="reload")])
  col_ptr, sid = jax.jit(lambda c_, n_: ffn_train_mgpu._csc(cfg, c_, n_))(cols, n)  # pylint: disable=protected-access
  if down_dh_only:
    return sweep_down_dh(cfg, dy, wd, col_ptr, sid, p, u, c)
  if ahead_only:
    return sweep_ahead(spec, cfg, (x, wg, wu, wd, dy, cols, p, u, n, c, col_ptr, sid))
  _, du, dg = train_bwd_mgpu.ell_bwd_rows(dy, cols, p, u, n, c, wd, wut, wgt)
  flat = lambda a: a.reshape(-1)[sid].astype(jnp.float32)
  variants("csc_weight_grads", train_bwd_mgpu.csc_weight_grads,
           (x, dy, col_ptr, sid // cfg.wk, flat(du), flat(dg), flat(p)),
           [dict(group=2), dict(group=2, kernels=2), dict(group=1, kernels=2),
            dict(group=1, kernels=3), dict(group=2, kernels=3)])
  variants("ell_up_down", train_fwd_mgpu.ell_up_down, (x, cols, p, n, wut, wd),
           [dict(group=2), dict(group=1)])
  variants("ell_bwd_rows", train_bwd_mgpu.ell_bwd_rows, (dy, cols, p, u, n, c, wd, wut, wgt),
           [dict(group=2, dx_dtype=jnp.bfloat16), dict(group=1, dx_dtype=jnp.bfloat16)])

  sweep_train(spec, x, wg, wu, wd)


def sweep_down_dh(cfg, dy, wd, col_ptr, sid, p, u, c):
  """The column-side dh + dW_down kernel (``csc_down_dh``) per ``group`` and, as timing
  diagnostics, without the per-entry dot (its cross-warp reduction), without the ELL-order
  stores, without any du / dg stores. same_bits compares dW_down and the CSC-order du / dg
  only; a diagnostic that skips the stores leaves its outputs unwritten (they may hold a
  previous call's values, so same_bits means nothing there)."""
  args = (dy, wd, col_ptr, sid // cfg.wk, p, u, c, sid)
  kws = [dict(group=1), dict(group=2), dict(group=4),
         dict(group=1, diagnostic="no_reduce"), dict(group=1, diagnostic="no_ell"),
         dict(group=1, diagnostic="no_stores"),
         dict(group=1, diagnostic="no_stores+no_reduce")]
  fns = [(kw, jax.jit(functools.partial(train_bwd_mgpu.csc_down_dh,
                                        ell_shape=(cfg.mp, cfg.wk), **kw))) for kw in kws]
  n_valid = int(col_ptr[-1])  # CSC entries past it, and unused ELL slots, are not written
  for kw, f, same in _variants("csc_down_dh", fns, args,
                               compared=lambda out: (out[0], out[1][:n_valid], out[2][:n_valid])):
    print(f"  csc_down_dh {kw}: {kernel_ms(f, *args):.4f} ms  same_bits={same}", flush=True)


TRAIN_VARIANTS = (dict(), dict(dh_group=2), dict(wgrads_group=2), dict(dh_in_columns=False))


def sweep_ahead(spec, cfg, arrays):
  """Each gather kernel of the training step with its rows loaded at the start of each step
  (``rows_ahead=False``) or one step ahead (``True``), per group; then the whole step per
  ``TrainConfig.rows_ahead``. same_bits: the kernel's outputs against its first variant
  (ELL-order / past-the-end slots excluded where they are not written)."""
  x, wg, wu, wd, dy, cols, p, u, n, c, col_ptr, sid = arrays
  wut, wgt = jnp.asarray(wu.T), jnp.asarray(wg.T)
  rows = sid // cfg.wk
  ell = (cfg.mp, cfg.wk)
  n_valid = int(col_ptr[-1])
  valid = ffn_train_mgpu.slot_mask(cfg, n)
  dwd, du_s, dg_s, du_e, dg_e = jax.jit(functools.partial(
      train_bwd_mgpu.csc_down_dh, ell_shape=ell))(dy, wd, col_ptr, rows, p, u, c, sid)
  du_e, dg_e = jnp.where(valid, du_e, 0), jnp.where(valid, dg_e, 0)
  cases = [
      ("ell_up_down", train_fwd_mgpu.ell_up_down, (x, cols, p, n, wut, wd),
       [dict(group=2), dict(group=2, rows_ahead=True), dict(group=1, rows_ahead=True)],
       lambda out: (jnp.where(n[:, None] > 0, out[0], 0), jnp.where(valid, out[1], 0))),
      ("csc_down_dh", functools.partial(train_bwd_mgpu.csc_down_dh, ell_shape=ell),
       (dy, wd, col_ptr, rows, p, u, c, sid),
       [dict(group=1), dict(group=1, rows_ahead=True), dict(group=2, rows_ahead=True)],
       lambda out: (out[0], out[1][:n_valid], out[2][:n_valid])),
      ("csc_weight_grads", functools.partial(train_bwd_mgpu.csc_weight_grads, kernels=2,
                                             x_only=True, out_dtype=jnp.bfloat16),
       (x, dy, col_ptr, rows, du_s, dg_s, None),
       [dict(group=1), dict(group=1, rows_ahead=True), dict(group=2, rows_ahead=True)],
       lambda out: out[:2]),
      ("ell_dx", functools.partial(train_bwd_mgpu.ell_dx, dx_dtype=jnp.bfloat16),
       (cols, n, du_e, dg_e, wut, wgt),
       [dict(group=2), dict(group=2, rows_ahead=True), dict(group=1, rows_ahead=True)],
       lambda out: out),
  ]
  for label, fn, args, kws, compared in cases:
    fns = [(kw, jax.jit(functools.partial(fn, **kw))) for kw in kws]
    for name, f, same in _variants(label, fns, args, compared=compared):
      print(f"  {label} {name}: {kernel_ms(f, *args):.4f} ms  same_bits={same}", flush=True)
  sweep_train(spec, x, wg, wu, wd, variants=AHEAD_VARIANTS)


# Run 1 of 2026-11-22 (eighth session): rows ahead helped csc_down_dh a little, ell_up_down and
# ell_dx only at group 1, and slowed the weight gradients.
AHEAD_VARIANTS = (dict(), dict(rows_ahead=("down_dh",)), dict(group=1),
                  dict(group=1, rows_ahead=("up_down", "dx")),
                  dict(group=1, rows_ahead=("up_down", "down_dh", "dx")))


def sweep_train(spec, x, wg, wu, wd, variants=TRAIN_VARIANTS):
  """Forward + backward per TrainConfig variant against XLA dense, same process."""
  ct = jax.random.normal(jax.random.key(1), x.shape, jnp.float32)
  dense = jax.jit(jax.grad(bench_train._loss_fn("dense", spec, ct), argnums=(0, 1, 2, 3)))  # pylint: disable=protected-access
  dense_ms, _, _ = common.time_fn(dense, x, wg, wu, wd, iters=20, kernel_time=False)
  print(f"  fwd+bwd: XLA dense {dense_ms:.3f} ms (wall, median of 20)", flush=True)
  for kw in variants:
    tc = ffn_train_mgpu.make_config(spec.m, spec.d, spec.h, spec.ell_width, spec.tail_rows,
                                    **kw)

    def step(x_, wg_, wu_, wd_, tc=tc):
      out, res = ffn_train_mgpu.forward(tc, x_, wg_, wu_, wd_)
      return out[0], ffn_train_mgpu.backward(tc, res, (ct.astype(jnp.bfloat16),
                                                       jnp.float32(2e-5)))

    f = jax.jit(step)
    ms, _, _ = common.time_fn(f, x, wg, wu, wd, iters=20, kernel_time=False)
    print(f"  fwd+bwd TrainConfig {kw or 'default'}: {ms:.3f} ms wall, "
          f"ratio {ms / dense_ms:.3f}", flush=True)
    if os.environ.get("SWEEP_BREAKDOWN"):  # needs XLA_FLAGS=--xla_gpu_enable_command_buffer=
      common.print_breakdown(str(kw), common.kernel_breakdown(f, x, wg, wu, wd))


def main(argv):
  what = argv[1:] or ["gate", "down", "bwd"]
  print("device:", jax.devices()[0].device_kind, flush=True)
  x, wg, wu, wd = benchmark.make_inputs(benchmark.SPECS["paper_16k"])
  for w in what:
    print(f"== {w}", flush=True)
    try:
      if w == "gate":
        sweep_gate(x, wg)
      elif w == "down":
        sweep_down(x, wg, wu, wd)
      elif w == "bwd":
        sweep_bwd()
      elif w == "gate_chunks":
        sweep_gate_chunks(x, wg)
      elif w == "gate_steps":
        sweep_gate_steps(x, wg, wu, wd)
      elif w == "l2":
        sweep_l2(wu, wd)
      elif w == "train":
        sweep_bwd(train_only=True)
      elif w == "down_dh":
        sweep_bwd(down_dh_only=True)
      elif w == "ahead":
        sweep_bwd(ahead_only=True)
      elif w == "train_ahead":
        sweep_bwd(train_only=True, train_variants=AHEAD_VARIANTS)
    except Exception as e:  # keep going
      print(f"  {w} failed: {type(e).__name__}: {str(e)[:500]}", flush=True)


if __name__ == "__main__":
  main(sys.argv)
