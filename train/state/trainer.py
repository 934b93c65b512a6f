"""The trainer's parts built from a config: `Trainer` (mesh, model, tokenizer, optimizer,
shardings, the jitted train step, evaluation), shared by the training loop (`train.training.
loop`), evaluation and generation from checkpoints.

Devices: a ("data", "fsdp") mesh over every device of every process (config `mesh`, see
`train.runtime.mesh`): batches split over both axes, parameters and optimizer state split over
"fsdp" (replicated with fsdp = 1: data parallel), the FFN and the loss run per device under
`jax.shard_map`.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from train import errors
from train.config import checks as config_checks
from train.data import pipeline as data_lib
from train.data import tokenizer as tokenizer_lib
from train.models import transformer as model_lib
from train.runtime import compilation
from train.runtime import mesh as mesh_lib
from train.state import optim
from train.state import sparsity
from train.state import steps as steps_lib


def _mesh_of(mesh_cfg=None) -> jax.sharding.Mesh:
  """The config's ("data", "fsdp") mesh over all devices (ConfigError if it does not fit)."""
  try:
    return mesh_lib.make_mesh(mesh_cfg)
  except mesh_lib.MeshError as e:
    raise errors.ConfigError(f"config.mesh: {e}") from e


class Trainer:
  """Everything built from the config that the loop and eval share."""

  def __init__(self, cfg, mesh=None):
    self.cfg = cfg
    self.mesh = mesh or _mesh_of(cfg.get("mesh"))
    config_checks.check(cfg, self.mesh.size, jax.process_count())
    self.model_cfg = model_lib.ModelConfig.from_config(cfg.model)
    self.lm = model_lib.LanguageModel(self.model_cfg)
    self.tokenizer = tokenizer_lib.make_tokenizer(cfg.data)
    if self.tokenizer.vocab_size > self.model_cfg.vocab_size:
      raise errors.ConfigError(f"model.vocab_size={self.model_cfg.vocab_size} is "
                       f"below the tokenizer's {self.tokenizer.vocab_size}")
    self.tx = optim.make_optimizer(cfg)
    self.replicated = NamedSharding(self.mesh, P())
    self.batch_sharding = mesh_lib.batch_sharding(self.mesh)
    self.eval_sharding = mesh_lib.eval_sharding(self.mesh)
    shapes = self._state_shapes()
    # The optimizer's moments, and the gradients inside the step, share one layout.
    self.grad_sharding = mesh_lib.moment_shardings(
        shapes["params"], self.mesh, scan_layers=self.model_cfg.scan_layers,
        shard_optimizer=bool((cfg.get("mesh") or {}).get("shard_optimizer", False)))
    self.state_sharding = mesh_lib.state_shardings(
        shapes, self.tx, self.mesh, scan_layers=self.model_cfg.scan_layers,
        moments=self.grad_sharding)
    # Evaluation steps per FFN choice (jitted or compiled), and compiles started ahead.
    self._eval_steps, self._eval_ahead = {}, {}

  def init_state(self, key):
    params = self.lm.init_params(key)
    return {"params": params, "opt_state": self.tx.init(params),
            "step": jnp.int32(0), "rng": jax.random.key_data(key),
            "since": sparsity.init_since(self.model_cfg.n_layers,
                                         self.model_cfg.d_ff)}

  def new_state(self, key):
    """A fresh train state, laid out on the mesh (`state_sharding`)."""
    return jax.jit(self.init_state, out_shardings=self.state_sharding)(key)

  def _state_shapes(self):
    # The key is made inside the trace: `jax.random.key(0)` outside would compile and run a
    # program on the device, the process's first on the main thread (on a GPU, the
    # compiler's start-up, on the way to a run's first step).
    return jax.eval_shape(lambda: self.init_state(jax.random.key(0)))

  def abstract_state(self):
    """The state's shapes with their shardings on this mesh (the restore target)."""
    shapes = self._state_shapes()
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        shapes, self.state_sharding)

  def batch_spec(self):
    """The train step's batch (micro-batches, rows, seq_len + 1 tokens) with its sharding,
    for a step compiled ahead of its arguments (`compile_train_step`)."""
    cfg = self.cfg
    return jax.ShapeDtypeStruct(
        (cfg.grad_accum_steps, cfg.batch_size // cfg.grad_accum_steps, cfg.data.seq_len + 1),
        np.int32, sharding=self.batch_sharding)

  def _model(self, layer_key=None):
    """The model, its FFNs overridden by `layer_key` (L implementation names and L numbers of
    hot features) when given."""
    if layer_key is None:
      return self.lm
    names, hot = layer_key
    return model_lib.LanguageModel(dataclasses.replace(
        self.model_cfg, ffn_layer_implementations=tuple(names),
        ffn_layer_hot_features=tuple(hot)))

  def jit_train_step(self, layer_key=None):
    """The jitted step; `layer_key` (a `LayerChoice.key`: L implementation names and L
    numbers of hot features) overrides the model's FFNs."""
    step = steps_lib.make_train_step(self._model(layer_key), self.tx, self.cfg,
                                     grad_sharding=self.grad_sharding)
    return jax.jit(mesh_lib.traced_in(self.mesh, step),
                   in_shardings=(self.state_sharding, self.batch_sharding),
                   out_shardings=(self.state_sharding, self.replicated),
                   donate_argnums=0)

  def compile_train_step(self, layer_key, state_spec, batch_spec, *, autotune: bool = True):
    """`jit_train_step(layer_key)` compiled ahead of time for these argument types (and
    shardings); `autotune=False` compiles a GPU step with `compilation.NO_AUTOTUNE`."""
    lowered = self.jit_train_step(layer_key).lower(state_spec, batch_spec)
    untuned = not autotune and jax.default_backend() == "gpu"
    return lowered.compile(compiler_options=compilation.NO_AUTOTUNE if untuned else None)

  def sort_features(self, state, order):
    """`state` with each layer's hidden features in `order` [L, H] (the parameters, the
    optimizer state and the dead-feature counters alike: the model computes the same function,
    the run continues the same optimization)."""
    if not hasattr(self, "_sort_features"):
      def permute(state, order):
        since = jnp.take_along_axis(state["since"], order, axis=1)
        return {**model_lib.permute_ffn_features(
            {k: v for k, v in state.items() if k != "since"}, order), "since": since}
      self._sort_features = jax.jit(permute, out_shardings=self.state_sharding,
                                    donate_argnums=0)
    return self._sort_features(state, jnp.asarray(order))

  def put_batch(self, local: np.ndarray, sharding) -> jax.Array:
    return jax.make_array_from_process_local_data(sharding, local)

  def eval_batches(self):
    cfg = self.cfg
    rows = cfg.batch_size // cfg.grad_accum_steps // jax.process_count()
    return data_lib.eval_batches(
        cfg.data, self.tokenizer, seq_len=cfg.data.seq_len, rows=rows,
        num_batches=cfg.eval_batches, shard_index=jax.process_index(),
        shard_count=jax.process_count())

  def _eval_step(self, layer_key=None):
    """The jitted evaluation step of the FFN choice `layer_key` (None: the model's own),
    one per Trainer and choice."""
    if layer_key not in self._eval_steps:
      self._eval_steps[layer_key] = jax.jit(mesh_lib.traced_in(
          self.mesh, steps_lib.make_eval_step(self._model(layer_key))))
    return self._eval_steps[layer_key]

  def compile_eval_ahead(self, params, batch, layer_key=None, *, autotune: bool = True):
    """Compiles the evaluation step for `params` and held-out batches like `batch` on a
    worker thread (inside `compilation.beside_training`), for `evaluate` to use: the first
    evaluation of a run then does not compile (a second or two, more beside a background build
    of the per-layer choice). `autotune=False` compiles a GPU step with
    `compilation.NO_AUTOTUNE`: autotuning's candidate kernels would share the device with the
    training steps."""
    like = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
    specs = (jax.tree.map(like, params), like(self.put_batch(batch, self.eval_sharding)))
    untuned = not autotune and jax.default_backend() == "gpu"

    def build():
      with compilation.beside_training():
        return self._eval_step(layer_key).lower(*specs).compile(
            compiler_options=compilation.NO_AUTOTUNE if untuned else None)

    self._eval_ahead[layer_key] = compilation.on_worker_thread(build)

  def eval_compiled(self, layer_key=None) -> bool | None:
    """Whether the evaluation step of `layer_key` is compiled: True (compiled ahead and
    done, or compiled by an evaluation), False (compiling ahead), None (never asked for, or
    its compile ahead failed: `evaluate` would compile it, and raise its error)."""
    ahead = self._eval_ahead.get(layer_key)
    if ahead is not None:
      if not ahead.done():
        return False
      return None if ahead.exception() is not None else True
    step = self._eval_steps.get(layer_key)
    return True if isinstance(step, jax.stages.Compiled) else None

  def evaluate(self, params, batches, layer_key=None) -> dict:
    """Held-out loss, perplexity and per-layer sparsity over `batches`; `layer_key` (a
    `LayerChoice.key`) overrides the model's FFNs, as in `jit_train_step`. `loss_se` is the
    loss's standard error from the spread of the batches' own losses (0 for one batch);
    `batch_losses` are those losses, in the batches' order (the held-out batches are the same
    for every run of one data config, so two runs compare batch by batch)."""
    ahead = self._eval_ahead.pop(layer_key, None)
    eval_step = self._eval_step(layer_key)
    if ahead is not None:
      try:
        eval_step = self._eval_steps[layer_key] = ahead.result()
      except Exception:  # pylint: disable=broad-except  # compiled here instead, and raised
        pass
    tot, batch_losses = None, []
    for b in batches:
      out = eval_step(params, self.put_batch(b, self.eval_sharding))
      out = jax.device_get(out)
      batch_losses.append(float(out["ce_sum"]) / max(float(out["tokens"]), 1.0))
      if tot is None:
        tot = {k: np.array(v, np.float64) for k, v in out.items()}
        tot["fired"] = np.array(out["fired"], bool)
        tot["max_tile_nnz"] = np.array(out["max_tile_nnz"])
      else:
        for k in ("ce_sum", "tokens", "active_per_token", "overflow_rows"):
          tot[k] = tot[k] + out[k]
        tot["max_tile_nnz"] = np.maximum(tot["max_tile_nnz"],
                                         out["max_tile_nnz"])
        tot["fired"] = tot["fired"] | np.asarray(out["fired"], bool)
    n = len(batches)
    loss = float(tot["ce_sum"] / tot["tokens"])
    h = self.model_cfg.d_ff
    active = tot["active_per_token"] / n
    return {
        "loss": loss, "perplexity": float(np.exp(min(loss, 80.0))),
        "loss_se": float(np.std(batch_losses, ddof=1) / np.sqrt(n)) if n > 1 else 0.0,
        "batch_losses": batch_losses,
        "tokens": int(tot["tokens"]),
        "active_per_token": [float(x) for x in active],
        "sparsity": [float(1.0 - x / h) for x in active],
        "max_tile_nnz": [int(x) for x in tot["max_tile_nnz"]],
        "overflow_rows": [int(x) for x in tot["overflow_rows"]],
        "never_fired_fraction": [float(x) for x in
                                 1.0 - tot["fired"].mean(axis=-1)],
    }
