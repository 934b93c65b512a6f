"""Jittable train and eval steps.

Train state (a plain pytree, what orbax saves):
  params     nested dict of arrays (model.LanguageModel.init_params)
  opt_state  optax state
  step       int32 scalar, optimizer steps done
  rng        uint32 [2] base key; step s uses fold_in(rng, s)
  since      int32 [L, H] tokens since each FFN feature last fired

One step takes tokens [A, b, T + 1] (A = grad_accum_steps micro-batches of b
sequences) and minimizes

  loss = CE(logits, next tokens) + l1_coeff(step) * mean_l s_l L1_l

(s_l: `config.l1_layer_scales`, 1 for every layer by default)

with gradients summed over the A micro-batches by `lax.scan` and divided by
A, then one clipped AdamW update. Per-layer FFN statistics are reduced over
the micro-batches: means for l1 / nnz_per_token, max for max_tile_nnz, sums for
overflow_rows and feature_counts (a feature fired when its count is above 0).

Gradients are laid out like the optimizer's moments (`grad_sharding`; with
`mesh.shard_optimizer` split over every mesh axis: reduce-scattered, each device updates its
slice of the parameters, which XLA gathers back for the replicated parameters).

Data parallelism (a "data" mesh axis of more than one device, parameters replicated on every
device: no fsdp; `mesh.gradient_reduction` "auto" or "per_device"): the step runs per device
under `jax.shard_map` and one reduction per step adds the devices' gradients after the
backward (`psum_scatter` onto the moments' slices, `pmean` where they are replicated): with
A = 1 each matrix's gradient in the compute dtype (bf16, as XLA reduces it), with A > 1 each
device's f32 sum of its micro-batches. Under GSPMD (`gradient_reduction="gspmd"`, and every
mesh with fsdp) the FFN's and the loss's shard_map transposes reduce each gradient inside the
backward as it appears: with A = 1 each reduction stalls the matrix product it is scheduled
against (a lower per-GPU efficiency: docs/performance.md); with A > 1 every micro-batch's gradients are reduced inside the loop
(XLA does not move those reductions out of the nested loops: A all-reduces of the whole
gradient a step instead of one). Meshes with fsdp gather weights and reduce-scatter
gradients per micro-batch by design.
"""

import math

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import optax

from twell_jax import sharded
from twell_jax import stats as stats_lib
from train.config import checks as config_checks
from train.models import losses
from train.runtime import mesh as mesh_lib
from train.state import optim
from train.state import sparsity


# `mesh.gradient_reduction` (see the module docstring).


def _flat(h, tokens):
  """(h [N, D], next-token targets [N]) of a [b, T + 1] token batch's hidden states."""
  return h.reshape(-1, h.shape[-1]), tokens[:, 1:].reshape(-1)


def make_loss_fn(lm, cfg):
  d_ff = lm.cfg.d_ff
  scales = config_checks.parse_l1_layer_scales(cfg.get("l1_layer_scales", ""),
                                               lm.cfg.n_layers)

  def loss_fn(params, tokens, l1_coeff):
    h, stats = lm.hidden(params, tokens[:, :-1])
    x, targets = _flat(h, tokens)
    # The LM head in the compute dtype, in chunks, never as f32 [tokens, vocab] logits.
    ce = losses.cross_entropy_sum(x, params["embed"], targets) / targets.shape[0]
    per_layer = stats.l1 if scales is None else stats.l1 * jnp.asarray(scales, stats.l1.dtype)
    l1 = sparsity.l1_term(per_layer, d_ff, cfg.l1_normalization)
    return ce + l1_coeff * l1, (ce, l1, stats)

  return loss_fn


def _fold_micro_batches(st: stats_lib.FFNStats) -> stats_lib.FFNStats:
  """Per-micro-batch stats [A, L, ...] -> the step's [L, ...] (see the module docstring)."""
  return stats_lib.FFNStats(
      l1=jnp.mean(st.l1, 0),
      nnz_per_token=jnp.mean(st.nnz_per_token, 0),
      max_tile_nnz=jnp.max(st.max_tile_nnz, 0),
      overflow_rows=jnp.sum(st.overflow_rows, 0),
      feature_counts=jnp.sum(st.feature_counts, 0),
      heavy_rows_by_hot=jnp.sum(st.heavy_rows_by_hot, 0),
      implementation=st.implementation)


def _accumulate(grad_fn, params, tokens, l1_coeff, laid_out):
  """(gradients summed over the micro-batches of `tokens` [A, b, T+1], (loss, ce, l1)
  averaged over them, the stats folded over them); `laid_out` constrains the gradients'
  layout (the moments')."""

  def micro(grad_sum, toks):
    (loss, (ce, l1, stats)), grads = grad_fn(params, toks, l1_coeff)
    grad_sum = laid_out(jax.tree.map(jnp.add, grad_sum, laid_out(grads)))
    return grad_sum, (loss, ce, l1, stats)

  zeros = jax.tree.map(jnp.zeros_like, params)
  grad_sum, (loss, ce, l1, stats) = jax.lax.scan(micro, zeros, tokens)
  return grad_sum, (jnp.mean(loss), jnp.mean(ce), jnp.mean(l1), _fold_micro_batches(stats))


def _accumulate_per_device(grad_fn, params, tokens, l1_coeff, axes, grad_sharding,
                           compute_dtype):
  """`_accumulate` with each device of `axes` summing its own micro-batches and one
  reduction of the sums (see the module docstring)."""
  specs = (jax.tree.map(lambda _: P(), params) if grad_sharding is None else
           jax.tree.map(lambda s: s.spec, grad_sharding,
                        is_leaf=lambda x: isinstance(x, jax.sharding.NamedSharding)))
  n_dev = math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in axes)
  # One micro-batch: each matrix's gradient is a compute-dtype (bf16) product converted to
  # f32; it is reduced in the compute dtype, half the bytes (as XLA reduces it in the
  # GSPMD step). Sums of several micro-batches are reduced in f32.
  low = jnp.dtype(compute_dtype) if tokens.shape[0] == 1 else None

  def reduce(g, spec):
    """The mean over the devices of `g`, onto this device's slice of `spec`."""
    dtype = g.dtype
    if low is not None and g.ndim >= 2 and low.itemsize < dtype.itemsize:
      g = g.astype(low)
    dims = [d for d, e in enumerate(spec) if e is not None]
    if not dims:
      return lax.pmean(g, axes).astype(dtype)
    return (lax.psum_scatter(g, spec[dims[0]], scatter_dimension=dims[0], tiled=True)
            / n_dev).astype(dtype)

  def local(params, tokens, l1_coeff):
    grad_sum, (loss, ce, l1, stats) = _accumulate(grad_fn, params, tokens, l1_coeff,
                                                  lambda g: g)
    # Equal token counts per device: the mean over devices of each device's mean loss
    # is the loss of the whole batch, and its gradient the mean of theirs.
    mean = lambda a: lax.pmean(a, axes)
    return jax.tree.map(reduce, grad_sum, specs), (mean(loss), mean(ce), mean(l1),
                                                   sharded.reduce_stats(stats, axes))

  return jax.shard_map(local, mesh=jax.sharding.get_abstract_mesh(),
                       in_specs=(P(), P(None, axes), P()), out_specs=(specs, P()),
                       axis_names=frozenset(axes), check_vma=False)(params, tokens, l1_coeff)


def _per_device(mode: str) -> bool:
  """Whether the step runs per device with one reduction on the mesh in context (see the
  module docstring)."""
  mesh = jax.sharding.get_abstract_mesh()
  shape = dict(zip(mesh.axis_names, mesh.axis_sizes))
  data_only = (shape.get("data", 1) > 1
               and all(n == 1 for a, n in shape.items() if a != "data"))
  return data_only and mode != "gspmd"


def _dead_features(state, stats, params, opt_state, n_tokens: int, tx, cfg, init_std: float):
  """(params, opt_state, tokens since each feature fired, dead fraction per layer, features
  re-drawn): the counters updated by this step's firings, dead features measured before any
  re-init (so the log shows what was found), then optionally revived (`dead_reinit`)."""
  step = state["step"]
  since = sparsity.update_since(state["since"], stats.fired, n_tokens)  # fired: [L, H]
  dead_fraction = jnp.mean(sparsity.dead_mask(since, cfg.dead_window_tokens), axis=-1)
  n_reinit = jnp.int32(0)
  if cfg.dead_reinit:
    key = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), step)

    def do_reinit(args):
      p, o, s = args
      p, o, s, n = sparsity.reinit_dead(p, o, tx, s, cfg.dead_window_tokens, key, init_std)
      return p, o, s, n.astype(jnp.int32)

    params, opt_state, since, n_reinit = jax.lax.cond(
        (step + 1) % cfg.dead_reinit_every == 0, do_reinit,
        lambda args: (*args, jnp.int32(0)), (params, opt_state, since))
  return params, opt_state, since, dead_fraction, n_reinit


def make_train_step(lm, tx, cfg, grad_sharding=None):
  """Returns train_step(state, tokens [A, b, T+1]) -> (state, metrics).

  `grad_sharding` (a tree of shardings like the params: the optimizer moments') lays out
  each micro-batch's gradients and their sum (FSDP or ZeRO-1: each device keeps and sums only
  its slice, and XLA reduces the gradients with reduce-scatters).
  """
  grad_fn = jax.value_and_grad(make_loss_fn(lm, cfg), has_aux=True)
  lr_fn, l1_fn = optim.lr_schedule(cfg), optim.l1_schedule(cfg)
  constrain = ((lambda g: g) if grad_sharding is None else
               (lambda g: jax.lax.with_sharding_constraint(g, grad_sharding)))
  mode = (cfg.get("mesh") or {}).get("gradient_reduction", "auto")
  modes = mesh_lib.GRADIENT_REDUCTIONS
  if mode not in modes:
    raise ValueError(f"mesh.gradient_reduction must be one of {modes}; got {mode!r}")

  def train_step(state, tokens):
    params, step = state["params"], state["step"]
    l1_coeff = l1_fn(step)
    # Parameters replicated on every device of the mesh (a data axis, no fsdp): the step
    # runs manual over all of its axes (partly manual regions would leave cuDNN attention's
    # custom partitioning an abstract mesh, which it cannot lower).
    if _per_device(mode):
      axes = tuple(jax.sharding.get_abstract_mesh().axis_names)
      grad_sum, (loss, ce, l1, stats) = _accumulate_per_device(
          grad_fn, params, tokens, l1_coeff, axes, grad_sharding, lm.cfg.dtype)
    else:
      grad_sum, (loss, ce, l1, stats) = _accumulate(grad_fn, params, tokens, l1_coeff,
                                                    constrain)
    grads = jax.tree.map(lambda g: g / tokens.shape[0], grad_sum)
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = tx.update(grads, state["opt_state"], params)
    params = optax.apply_updates(params, updates)
    n_tokens = tokens.shape[0] * tokens.shape[1] * (tokens.shape[2] - 1)
    params, opt_state, since, dead_fraction, n_reinit = _dead_features(
        state, stats, params, opt_state, n_tokens, tx, cfg, lm.cfg.init_std)
    new_state = {**state, "params": params, "opt_state": opt_state,
                 "step": step + 1, "since": since}
    metrics = {
        "loss": loss, "cross_entropy": ce, "l1_term": l1, "l1_coeff": l1_coeff,
        "learning_rate": lr_fn(step), "grad_norm": grad_norm,
        "dead_reinit": n_reinit,
        # Per layer, [L]:
        "active_per_token": stats.nnz_per_token,
        "max_tile_nnz": stats.max_tile_nnz,
        "overflow_rows": stats.overflow_rows,
        "dead_fraction": dead_fraction,
        # [L, H]: tokens of the step on which each feature fired (the per-layer choice sorts
        # the features by it; not logged).
        "feature_counts": stats.feature_counts,
        # [L, ceil(H / 256)]: rows over the ELL width by number of hot features (the
        # per-layer choice weighs them; not logged).
        "heavy_rows_by_hot": stats.heavy_rows_by_hot,
    }
    return new_state, metrics

  return train_step


def make_eval_step(lm):
  """eval_step(params, tokens [b, T+1]) -> sums to accumulate over batches."""

  def eval_step(params, tokens):
    h, stats = lm.hidden(params, tokens[:, :-1])
    x, targets = _flat(h, tokens)
    ce = losses.per_token_cross_entropy(x, params["embed"], targets)
    return {
        "ce_sum": jnp.sum(ce), "tokens": jnp.float32(ce.size),
        "active_per_token": stats.nnz_per_token,   # [L], mean over tokens
        "max_tile_nnz": stats.max_tile_nnz,        # [L]
        "overflow_rows": stats.overflow_rows,      # [L]
        "fired": stats.fired,                      # [L, H]
    }

  return eval_step
