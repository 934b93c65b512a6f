r"""Configuration sweeps on the GPU: every variant against the default, same inputs, one process.

    python -m benchmarks.sweeps.sweep --what=gate,forward,train --specs=paper_16k,paper_16k_skew

* ``gate``: the gate kernel (``gate_pack``) per ``GateConfig`` (device time, CUPTI); every
  variant's words / counts must equal the default's bit for bit. XLA's relu(x @ w_gate)
  without packing for scale.
* ``forward``: the inference forward per ``ForwardConfig``, and with a held copy of w_up^T
  (``ffn_forward(w_up_t=)``).
* ``up_down``: the fused up / down kernel alone (device time) per ``GatherConfig`` on the
  ELL rows of the calibrated hot features' cold columns (outputs must match bit for bit),
  and the TwELL -> ELL conversion: XLA's and the kernel's per ``ConvertConfig``.
* ``train``: forward + backward (``jax.grad`` of sum(y * ct) + 2e-5 l1) per ``HybridConfig``
  variant of the training kernels (which kernel computes dh, groups, rows loaded ahead),
  with the dense FFN's time for the ratio.
Variants that fail to compile (SMEM, registers) are reported and skipped.
"""

from __future__ import annotations

import dataclasses
import json

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

from benchmarks.common import specs as specs_lib
from benchmarks.common import timing
from pallas_kernels import _row_loops as row_loops
from pallas_kernels import ell_up_down_mgpu
from pallas_kernels import ffn_mgpu
from pallas_kernels import gate_pack_mgpu as gp
from pallas_kernels import reference
from pallas_kernels import twell_to_ell_triton
from twell_jax import mosaic

_WHAT = flags.DEFINE_list("what", ["train"], "gate, forward, up_down and / or train")
_SPECS = flags.DEFINE_list("specs", ["paper_16k", "paper_16k_skew"], "benchmarks.common.specs names")
_OUT = flags.DEFINE_string("out", None, "write the results as JSON here")

_G = row_loops.GatherConfig
_C = twell_to_ell_triton.ConvertConfig
GATE_VARIANTS = {
    "default": gp.GateConfig(),
    "chunk128": gp.GateConfig(pack_chunk=128),
    "stages2": gp.GateConfig(max_concurrent_steps=2),
    "lag0": gp.GateConfig(delay_release=0),
    "k32_stages6": gp.GateConfig(tile_k=32, max_concurrent_steps=6),
    "minor_n": gp.GateConfig(grid_minor_dim=1),
    "snake4": gp.GateConfig(grid_tile_width=4),
    "snake16": gp.GateConfig(grid_tile_width=16),
}
# Variants of the inference forward (at the input's calibrated K unless they set hot_features).
FORWARD_VARIANTS = {
    "default": {},
    "ell_reload": dict(ell=_G(rows_ahead=True, row_mode="reload")),
    "ell_no_ahead": dict(ell=_G(row_mode="f32")),
    "weight_check_xla": dict(weight_check="xla"),
    # A layer that holds w_up^T [H, D] beside w_up (``ffn_forward(w_up_t=)``).
    "held_w_up_t": dict(hold_w_up_t=True),
    "convert_xla": dict(convert="xla"),
}
# The fused up / down kernel alone (``ffn_mgpu.ForwardConfig.ell``).
UP_DOWN_VARIANTS = {
    "default": ffn_mgpu.ForwardConfig().ell,
    "reload": _G(rows_ahead=True, row_mode="reload"),
    "bf16": _G(rows_ahead=True, row_mode="bf16"),
    "no_ahead": _G(row_mode="f32"),
    "group2": _G(group=2, row_mode="f32"),
}
# The TwELL -> ELL conversion kernel (``ffn_mgpu.ForwardConfig.convert_kernel``).
CONVERT_VARIANTS = {
    "default": _C(),
    "rows2": _C(rows_per_program=2),
    "rows8": _C(rows_per_program=8),
    "rows32_warps4": _C(rows_per_program=32, num_warps=4),
    "warps2": _C(num_warps=2),
    "tiles_per_step22": _C(tiles_per_step=22),
}
TRAIN_VARIANTS = {
    "default": {},
    "hot256": dict(hot_features=256),
    "hot512": dict(hot_features=512),
    "dh_rows": dict(dh_in_columns=False),
    "down_dh_g2": dict(down_dh=_G(group=2)),
    "wgrads_ahead": dict(wgrads=_G(rows_ahead=True)),
    "row_kernels_g2": dict(up_down=_G(group=2), dx=_G(group=2)),
}


def _same(a, b) -> bool:
  return all(bool(jnp.array_equal(u, v)) for u, v in
             zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def sweep_gate(spec, x, wg, wu, wd) -> dict:
  """Per ``GATE_VARIANTS`` entry; "default_checking" is the default kernel with the forward's
  NaN / infinity check of w_up (gated) and w_down in its packing warpgroup
  (``gate_pack(check=)``), against XLA's reduction over the same arrays ("xla_check_ms")."""
  w = wg if spec.gated else wu
  checked = (wu if spec.gated else None, wd)
  out = {"xla_gate_ms": timing.device_ms(jax.jit(lambda a, b: jnp.maximum(a @ b, 0)), x, w),
         "xla_check_ms": timing.device_ms(jax.jit(reference.any_nonfinite), *checked)}
  base = None
  variants = [(name, cfg, ()) for name, cfg in GATE_VARIANTS.items()]
  variants.append(("default_checking", gp.GateConfig(), checked))
  for name, cfg, check in variants:
    f = jax.jit(lambda a, b, *c, cfg=cfg: gp.gate_pack(a, b, config=cfg, check=c))
    try:
      got = jax.block_until_ready(f(x, w, *check))
    except Exception as e:  # pylint: disable=broad-except
      out[name] = f"failed: {type(e).__name__}: {str(e)[:200]}"
      continue
    base = got if base is None else base
    out[name] = {"device_ms": timing.device_ms(f, x, w, *check),
                 "same_bits": _same(got[:2], base[:2])}
    if check:
      out[name]["found_nonfinite"] = bool(got[2])
  return out


def sweep_forward(spec, x, wg, wu, wd, k: int) -> dict:
  """The inference forward (y only) per variant at the input's calibrated K: synchronized
  wall, pipelined and device ms, each over the dense FFN's."""
  dense = jax.jit(lambda *a: reference.dense_ffn_hidden(*a)[0])
  args = (x, wg, wu, wd)

  def times(f):
    return {"ms": timing.wall_ms(f, *args, iters=20),
            "pipelined_ms": timing.pipelined_ms(f, *args, iters=20),
            "device_ms": timing.device_ms(f, *args)}

  out = {"hot_features": k, "dense": times(dense)}
  base = None
  wu_t = jnp.asarray(wu.T) if spec.gated else None
  for name, kw in FORWARD_VARIANTS.items():
    kw = dict(kw)
    held = wu_t if kw.pop("hold_w_up_t", False) else None
    cfg = ffn_mgpu.ForwardConfig(**{"hot_features": k, **kw})
    f = jax.jit(lambda *a, cfg=cfg, held=held: ffn_mgpu.ffn_forward(
        *a, config=cfg, w_up_t=held)[0])
    try:
      y = jax.block_until_ready(f(*args)).astype(jnp.float32)
    except Exception as e:  # pylint: disable=broad-except
      out[name] = f"failed: {type(e).__name__}: {str(e)[:300]}"
      print(f"  forward {name}: {out[name]}", flush=True)
      continue
    base = y if base is None else base
    t = times(f)
    t.update({f"{key}_ratio": t[key] / out["dense"][key] for key in t
              if t[key] is not None and out["dense"][key]})
    t["rel_vs_default"] = float(jnp.linalg.norm(y - base) / jnp.linalg.norm(base))
    out[name] = t
    print(f"  {spec.m}x{spec.d}x{spec.h} forward {name}: " + ", ".join(
        f"{key} {t[key]:.3f}" for key in ("ms_ratio", "pipelined_ms_ratio", "device_ms_ratio",
                                          "device_ms") if t.get(key) is not None), flush=True)
  return out


def sweep_train(spec, x, wg, wu, wd) -> dict:
  ct = jax.random.normal(jax.random.key(1), x.shape, jnp.float32)

  def grad_fn(ffn):
    def loss(*w):
      y, l1 = ffn(*w)
      return jnp.sum(y.astype(jnp.float32) * ct) + 2e-5 * l1
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))

  def dense(*w):
    y, h, _ = reference.dense_ffn_hidden(*w)
    return y, jnp.sum(jnp.abs(h.astype(jnp.float32))) / x.shape[0]

  out = {"dense_ms": timing.wall_ms(grad_fn(dense), x, wg, wu, wd, iters=20)}
  base_cfg = mosaic.default_config(spec.m, spec.d, spec.h, ell_width=spec.ell_width,
                                   tail_rows=spec.tail_rows)
  base = None
  for name, kw in TRAIN_VARIANTS.items():
    cfg = dataclasses.replace(base_cfg, train=dataclasses.replace(base_cfg.train, **kw))
    f = grad_fn(lambda *w, cfg=cfg: (lambda y, st: (y, st.l1))(
        *mosaic.ffn_with_config(cfg, *w)))
    try:
      g = jax.block_until_ready(f(x, wg, wu, wd))
    except Exception as e:  # pylint: disable=broad-except
      out[name] = f"failed: {type(e).__name__}: {str(e)[:200]}"
      continue
    base = g if base is None else base
    ms = timing.wall_ms(f, x, wg, wu, wd, iters=20)
    # Variants may round differently (hot features): compare by relative error, not bits.
    err = max(float(jnp.linalg.norm((a - b).astype(jnp.float32))
                    / jnp.maximum(jnp.linalg.norm(b.astype(jnp.float32)), 1e-30))
              for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(base)))
    out[name] = {"ms": ms, "ratio": ms / out["dense_ms"], "device_ms":
                 timing.device_ms(f, x, wg, wu, wd), "rel_vs_default": err}
    print(f"  {spec.m}x{spec.d}x{spec.h} {name}: {ms:.3f} ms, ratio {ms / out['dense_ms']:.3f}, "
          f"rel vs default {err:.1e}", flush=True)
  return out


def sweep_up_down(spec, x, wg, wu, wd, k: int) -> dict:
  """The fused kernel (inference: no u) on the ELL rows of the gate packed past the k hot
  features, per ``UP_DOWN_VARIANTS``; the TwELL -> ELL conversion timed on its own."""
  w = wg if spec.gated else wu
  words, counts = gp.gate_pack(x, w, col_start=k)
  width = ffn_mgpu.ForwardConfig().max_row_entries
  to_ell = jax.jit(lambda words, counts: ell_up_down_mgpu.ell_from_twell(
      words, counts, slots=gp.GateConfig().slots, width=width))
  entries, n, _, _ = to_ell(words, counts)
  wu_t = wu.T if spec.gated else None
  out = {"hot_features": k, "entries_per_row": float(jnp.mean(n)),
         "conversion_ms": timing.device_ms(to_ell, words, counts), "conversion_kernel": {}}
  no_nonfinite = jnp.bool_(False)
  converted = None
  for name, cfg in CONVERT_VARIANTS.items():
    f = jax.jit(lambda a, b, c, cfg=cfg: twell_to_ell_triton.twell_to_ell(
        a, b, c, m=a.shape[0], slots=gp.GateConfig().slots, width=width, config=cfg)[:2])
    got = jax.block_until_ready(f(words, counts, no_nonfinite))
    converted = got if converted is None else converted
    out["conversion_kernel"][name] = {
        "device_ms": timing.device_ms(f, words, counts, no_nonfinite),
        "same_bits": _same(got, converted)}
    print(f"  {spec.m}x{spec.d}x{spec.h} conversion {name}: "
          f"{out['conversion_kernel'][name]['device_ms']:.4f} ms (XLA's "
          f"{out['conversion_ms']:.4f} ms)", flush=True)
  base = None
  for name, cfg in UP_DOWN_VARIANTS.items():
    f = jax.jit(lambda *a, cfg=cfg: ell_up_down_mgpu.ell_up_down(*a, write_u=False,
                                                                 config=cfg))
    args = (x, entries, n, wu_t, wd)
    try:
      got = jax.block_until_ready(f(*args))
    except Exception as e:  # pylint: disable=broad-except
      out[name] = f"failed: {type(e).__name__}: {str(e)[:200]}"
      continue
    base = got if base is None else base
    out[name] = {"device_ms": timing.device_ms(f, *args), "same_bits": _same(got, base)}
    print(f"  {spec.m}x{spec.d}x{spec.h} up_down {name}: {out[name]['device_ms']:.4f} ms "
          f"(conversion {out['conversion_ms']:.4f} ms)", flush=True)
  return out


SWEEPS = {"gate": sweep_gate, "forward": sweep_forward, "train": sweep_train,
          "up_down": sweep_up_down}


def main(argv):
  del argv
  print("device:", jax.devices()[0].device_kind, flush=True)
  results = []
  for spec_name in _SPECS.value:
    spec = specs_lib.get(spec_name)
    # Features sorted by activity, so that the hot-feature variants take the hottest ones.
    arrays, k = specs_lib.calibrated_inputs(spec)
    for what in _WHAT.value:
      extra = (k,) if what in ("up_down", "forward") else ()
      r = {"spec": spec_name, "sweep": what, **SWEEPS[what](spec, *arrays, *extra)}
      results.append(r)
      print(json.dumps(r), flush=True)
      if _OUT.value:
        with open(_OUT.value, "w") as f:
          json.dump(results, f, indent=1)


if __name__ == "__main__":
  jax.config.config_with_absl()
  app.run(main)
