"""`twell_jax.FeedForward` in a user's own model, written against the public API only.

A small NNX decoder (embedding, causal attention, the sparse FFN; layers stacked with
`nnx.vmap`, run with `nnx.scan` + `nnx.remat`) as someone adopting the layer from
docs/layer.md would write it, with flax, optax and orbax and nothing of twell_jax's
internals or of train/:

* training steps under `nnx.jit` and `nnx.value_and_grad` lower the loss; the statistics
  say which implementation ran, as `twell_jax.resolve_implementation` predicts;
* the scanned, rematerialised layers compute what a Python loop over them does, forward and
  gradients, with the default implementation and with the sparse "xla" one;
* `nnx.vmap` of the layer gives per-example outputs and statistics;
* orbax saves the trained model and restores it exactly;
* the Linen wrapper trains inside a Linen model;
* mistakes get errors that name the argument: token ids, a wrong weight, a wrong x,
  forward-mode autodiff of a sparse implementation; `calibrate` takes a [B, T, D] batch;
* on 2 host devices (a subprocess: the device count is fixed when JAX starts), an Explicit
  mesh (`jax.make_mesh`'s default) and an Auto one, with inputs that are not sharded: the
  layer, `twell_jax.sharded.ffn` and the decoder's loss and gradients equal the calls
  without a mesh.
"""

import json
import os
import subprocess
import sys

import twell_jax  # first: sizes the CPU thread pool before JAX starts

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import linen as nn
from flax import nnx

VOCAB, D, H, LAYERS, HEADS = 64, 32, 256, 2, 2


class Block(nnx.Module):
  """Pre-norm decoder block: causal self-attention, then the sparse FFN."""

  def __init__(self, *, implementation, rngs: nnx.Rngs):
    self.attn_norm = nnx.RMSNorm(D, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(HEADS, D, decode=False, rngs=rngs)
    self.ffn_norm = nnx.RMSNorm(D, rngs=rngs)
    self.ffn = twell_jax.FeedForward(D, H, implementation=implementation, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.attn_norm(x), mask=nnx.make_causal_mask(x[..., 0]))
    y, stats = self.ffn(self.ffn_norm(x), return_stats=True)
    return x + y.astype(x.dtype), stats


class Decoder(nnx.Module):
  """tokens [B, T] -> (logits [B, T, VOCAB], per-layer FFNStats [LAYERS])."""

  def __init__(self, *, implementation=None, rngs: nnx.Rngs):
    self.embed = nnx.Embed(VOCAB, D, rngs=rngs)

    @nnx.split_rngs(splits=LAYERS)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def blocks(rngs):
      return Block(implementation=implementation, rngs=rngs)

    self.blocks = blocks(rngs)

  def __call__(self, tokens):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
    @nnx.remat
    def layer(x, block):
      return block(x)

    x, stats = layer(self.embed(tokens), self.blocks)
    return self.embed.attend(x), stats

  def unrolled(self, tokens):
    """The same model as a Python loop over its layers (no scan, no remat)."""
    graphdef, state = nnx.split(self.blocks)
    x, all_stats = self.embed(tokens), []
    for i in range(LAYERS):
      x, stats = nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state))(x)
      all_stats.append(stats)
    return self.embed.attend(x), twell_jax.stats.stack(all_stats)


def loss_fn(model, tokens, unrolled=False):
  logits, stats = (model.unrolled if unrolled else model)(tokens[:, :-1])
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
  return ce + 1e-3 * jnp.mean(stats.l1), stats


def _tokens(batch=4, length=17, seed=1):
  return jax.random.randint(jax.random.key(seed), (batch, length), 0, VOCAB)


def _max_rel(a, b) -> float:
  """Largest difference over the leaves of two trees, relative to the leaf's scale."""
  return max(float(jnp.max(jnp.abs(jnp.asarray(u, jnp.float32) - jnp.asarray(v, jnp.float32)))
                   / (1.0 + jnp.max(jnp.abs(jnp.asarray(v, jnp.float32)))))
             for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@nnx.jit
def _train_step(model, optimizer, tokens):
  (loss, stats), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, tokens)
  optimizer.update(model, grads)
  return loss, stats


def _trained_decoder(steps=4):
  model = Decoder(rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  losses = [float(_train_step(model, optimizer, _tokens())[0]) for _ in range(steps)]
  return model, losses


def test_training_under_jit_lowers_the_loss_and_names_the_implementation():
  model, losses = _trained_decoder()
  assert losses[-1] < 0.8 * losses[0], losses
  _, stats = model(_tokens())
  assert stats.l1.shape == (LAYERS,) and stats.feature_counts.shape == (LAYERS, H)
  sds = jax.ShapeDtypeStruct
  expected = twell_jax.resolve_implementation(
      sds((4, 17, D), jnp.bfloat16), sds((D, H), jnp.bfloat16), sds((D, H), jnp.bfloat16),
      sds((H, D), jnp.bfloat16))
  assert stats.implementation == expected
  if jax.default_backend() == "cpu":
    assert expected == "dense"   # the kernels need a Hopper GPU or interpret=True


@pytest.mark.parametrize("implementation", [None, "xla"])
def test_scan_and_remat_compute_what_a_loop_over_the_layers_does(implementation):
  model = Decoder(implementation=implementation, rngs=nnx.Rngs(2))
  tokens = _tokens(batch=2, length=9)
  value_and_grad = nnx.value_and_grad(loss_fn, has_aux=True)
  (loss, stats), grads = nnx.jit(value_and_grad)(model, tokens)
  (loss_loop, stats_loop), grads_loop = nnx.jit(
      lambda m, t: value_and_grad(m, t, unrolled=True))(model, tokens)
  assert stats.implementation == stats_loop.implementation
  assert stats.implementation == (implementation or twell_jax.resolve_implementation(
      *(jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((2, 8, D), (D, H), (D, H), (H, D)))))
  assert _max_rel(loss, loss_loop) < 1e-5
  assert _max_rel(stats.l1, stats_loop.l1) < 1e-5
  np.testing.assert_array_equal(stats.feature_counts, stats_loop.feature_counts)
  ffn_grads = lambda g: nnx.state(g.blocks.ffn)
  assert _max_rel(ffn_grads(grads), ffn_grads(grads_loop)) < 1e-4
  assert float(jnp.max(jnp.abs(grads.blocks.ffn.w_gate[...]))) > 0


def test_vmap_gives_per_example_outputs_and_stats():
  layer = twell_jax.FeedForward(D, H, dtype=jnp.float32, rngs=nnx.Rngs(3))
  x = jax.random.normal(jax.random.key(4), (3, 5, D))
  y, stats = nnx.vmap(lambda m, x: m(x, return_stats=True), in_axes=(None, 0))(layer, x)
  assert y.shape == x.shape and stats.l1.shape == (3,) and stats.feature_counts.shape == (3, H)
  for i in range(3):
    y_i, stats_i = layer(x[i], return_stats=True)
    np.testing.assert_allclose(y[i], y_i, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(stats.feature_counts[i], stats_i.feature_counts)


def test_orbax_restores_the_trained_model_exactly(tmp_path):
  model, _ = _trained_decoder(steps=2)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "decoder", nnx.state(model))
  checkpointer.wait_until_finished()
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Decoder(rngs=nnx.Rngs(9))))
  restored = nnx.merge(graphdef, checkpointer.restore(tmp_path / "decoder", abstract))
  tokens = _tokens(seed=5)
  (logits, stats), (logits_back, stats_back) = model(tokens), restored(tokens)
  np.testing.assert_array_equal(logits_back, logits)
  np.testing.assert_array_equal(stats_back.feature_counts, stats.feature_counts)
  for name in ("w_gate", "w_up", "w_down"):
    np.testing.assert_array_equal(getattr(restored.blocks.ffn, name)[...],
                                  getattr(model.blocks.ffn, name)[...])


class LinenLM(nn.Module):
  """A Linen model around the layer's Linen wrapper."""

  @nn.compact
  def __call__(self, tokens):
    embed = nn.Embed(VOCAB, D)
    x = embed(tokens)
    y, stats = twell_jax.layers.linen_feed_forward(D, H, name="mlp")(
        nn.RMSNorm()(x), return_stats=True)
    return embed.attend(x + y.astype(x.dtype)), stats


def test_the_linen_wrapper_trains_in_a_linen_model():
  model, tokens = LinenLM(), _tokens()
  params = model.init(jax.random.key(6), tokens[:, :-1])["params"]
  assert params["mlp"]["w_up"].shape == (D, H)
  optimizer = optax.adam(1e-2)

  @jax.jit
  def step(params, opt_state):
    def loss(p):
      logits, stats = model.apply({"params": p}, tokens[:, :-1])
      ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
      return ce + 1e-3 * stats.l1
    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = optimizer.update(grads, opt_state)
    return optax.apply_updates(params, updates), opt_state, value, grads

  opt_state, losses = optimizer.init(params), []
  for _ in range(4):
    params, opt_state, value, grads = step(params, opt_state)
    losses.append(float(value))
  assert losses[-1] < losses[0], losses
  assert float(jnp.max(jnp.abs(grads["mlp"]["w_gate"]))) > 0


def test_mistakes_get_errors_that_name_the_argument():
  layer = twell_jax.FeedForward(D, H, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"^x must have a floating dtype; got int32"):
    layer(_tokens())                                  # token ids instead of embeddings
  with pytest.raises(ValueError, match=r"^x must have shape \[\.\.\., D\] with D = 32"):
    layer(jnp.ones((2, 3, D + 1)))
  x = jnp.ones((6, D), jnp.bfloat16)
  w_gate, w_up, w_down = (jnp.asarray(w[...], jnp.bfloat16)
                          for w in (layer.w_gate, layer.w_up, layer.w_down))
  with pytest.raises(ValueError, match=r"^w_up must have shape \[D, H\] = \(32, 256\)"):
    twell_jax.ffn(x, w_gate, w_up[:, :128], w_down)
  with pytest.raises(ValueError, match=r"^x must have shape \[\.\.\., D\] with D = 32"):
    twell_jax.ffn(jnp.ones((6, 16), jnp.bfloat16), w_gate, w_up, w_down)
  sparse = twell_jax.FeedForward(D, H, implementation="xla", rngs=nnx.Rngs(0))
  for forward_mode in (lambda f, v: jax.jvp(f, (v,), (v,)),
                       lambda f, v: jax.jit(lambda v: jax.jvp(f, (v,), (v,)))(v),
                       lambda f, v: jax.jacfwd(lambda v: jnp.sum(f(v)))(v)):
    with pytest.raises(NotImplementedError, match=r"reverse mode only.*implementation='dense'"):
      forward_mode(sparse, jnp.ones((4, D)))


def test_calibrate_takes_a_batch_of_sequences():
  layer = twell_jax.FeedForward(D, 512, dtype=jnp.float32, rngs=nnx.Rngs(7))
  weights = (layer.w_gate[...], layer.w_up[...], layer.w_down[...])
  x = jax.random.normal(jax.random.key(8), (4, 16, D))
  calibrated = twell_jax.features.calibrate(x, *weights)
  flat = twell_jax.features.calibrate(x.reshape(-1, D), *weights)
  for a, b in zip(calibrated, flat):
    np.testing.assert_array_equal(a, b)
  layer.w_gate[...], layer.w_up[...], layer.w_down[...] = calibrated[:3]
  layer.hot_features = calibrated[3]
  y_sorted = layer(x)                                # sorting features keeps the function
  np.testing.assert_allclose(y_sorted, twell_jax.ffn(x, *weights), rtol=2e-5, atol=2e-5)
  with pytest.raises(ValueError, match=r"^x must have dtype"):
    twell_jax.features.calibrate(_tokens(), *weights)
  with pytest.raises(ValueError, match=r"^w_down must have shape \[H, D\] = \(512, 32\)"):
    twell_jax.features.calibrate(x, weights[0], weights[1], weights[2][:, :8])


# ---- two host devices: a subprocess runs `mesh_results` and prints them ----

def mesh_results() -> dict:
  """On every mesh JAX makes for 2 devices by default (Explicit) and with Auto axes:
  differences from the call without a mesh (relative to the scale), and what ran."""
  from jax.sharding import AxisType   # pylint: disable=g-import-not-at-top
  # A fresh layer per mesh: nnx.jit writes the state back onto the layer, placed on the mesh
  # of the call.
  new_layer = lambda: twell_jax.FeedForward(D, H, rngs=nnx.Rngs(0))
  layer = new_layer()
  weights = [jnp.asarray(w[...], jnp.bfloat16) for w in (layer.w_gate, layer.w_up, layer.w_down)]
  x = jax.random.normal(jax.random.key(1), (4, 6, D))
  tokens = _tokens()

  def ffn_value_and_grad(x, *ws):
    def loss(x, *ws):
      y, stats = twell_jax.sharded.ffn(x, *ws, implementation="xla", return_stats=True)
      return jnp.sum(y.astype(jnp.float32) ** 2) + 10 * stats.l1
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(x, *ws)

  def decoder(implementation):
    model = Decoder(implementation=implementation, rngs=nnx.Rngs(0))
    return nnx.jit(nnx.value_and_grad(loss_fn, has_aux=True))(model, tokens)

  x3 = jax.random.normal(jax.random.key(2), (3, 8, D), jnp.bfloat16)   # 3 rows: tokens split
  want = {"layer": layer(x), "ffn": ffn_value_and_grad(x3, *weights),
          "dense": decoder(None), "xla": decoder("xla")}
  out = {"devices": jax.device_count()}
  for kind in ("explicit", "auto"):
    types = {} if kind == "explicit" else {"axis_types": (AxisType.Auto,)}
    mesh = jax.make_mesh((2,), ("data",), **types)
    layer = new_layer()
    with jax.set_mesh(mesh):
      y = layer(x)
      got = {"layer": y, "ffn": ffn_value_and_grad(x3, *weights),
             "dense": decoder(None), "xla": decoder("xla")}
      out[f"{kind}_axis_types"] = str(mesh.axis_types)
      out[f"{kind}_layer_jit"] = _max_rel(nnx.jit(lambda m, x: m(x))(layer, x), want["layer"])
      out[f"{kind}_y_spec"] = str(jax.typeof(y).sharding.spec)
    out[f"{kind}_layer_exact"] = bool(np.array_equal(y, want["layer"]))
    for name in ("ffn", "dense", "xla"):
      out[f"{kind}_{name}"] = _max_rel(got[name], want[name])
    out[f"{kind}_ran"] = [got[name][0][1].implementation for name in ("dense", "xla")]
  return out


def test_explicit_and_auto_meshes_on_two_host_devices():
  here = os.path.dirname(os.path.abspath(__file__))
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
             JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([here, os.path.dirname(here)]))
  script = "import json, test_user_model as t; print('RESULT', json.dumps(t.mesh_results()))"
  proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                        text=True, timeout=600, cwd=os.path.dirname(here), check=False)
  assert proc.returncode == 0, proc.stderr[-4000:]
  line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1]
  out = json.loads(line[len("RESULT "):])
  assert out["devices"] == 2
  assert out["explicit_axis_types"] == "(Explicit,)" and out["auto_axis_types"] == "(Auto,)"
  for kind in ("explicit", "auto"):
    assert out[f"{kind}_layer_exact"], out      # each device: the same rows, the same sums
    assert out[f"{kind}_layer_jit"] == 0.0, out
    # Loss and gradients: sums split over the devices, rounded in bf16 for "ffn" (bf16
    # operands) and in f32 for the decoders.
    assert out[f"{kind}_ffn"] < 1e-2, out
    for name in ("dense", "xla"):
      assert out[f"{kind}_{name}"] < 1e-4, (kind, name, out)
    assert out[f"{kind}_ran"] == ["dense", "xla"], out
  assert out["explicit_y_spec"] == "P(None, None, None)", out   # x's sharding: none


@pytest.mark.gpu
def test_on_a_hopper_gpu_the_default_runs_the_kernels_and_says_so():
  """Where `implementation=None` resolves to the kernels: the statistics name them, the
  output is the dense FFN's, reverse mode works and forward mode is refused by name; under
  `jax.default_device(cpu)` the same call runs (and says) dense."""
  kind = jax.devices()[0].device_kind
  if not any(name in kind for name in ("H100", "H200", "H800")):
    pytest.skip(f"needs a Hopper GPU; the device is {kind!r}")
  d, h = 2048, 5632                                   # the paper's shape: the kernels win
  layer = twell_jax.FeedForward(d, h, rngs=nnx.Rngs(0))
  x = 0.5 * jax.random.normal(jax.random.key(1), (4, 2048, d))
  sds = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  call = (sds(4, 2048, d), sds(d, h), sds(d, h), sds(h, d))
  assert twell_jax.resolve_implementation(*call) == "mosaic_gpu"
  assert twell_jax.resolve_implementation(*call, device=jax.devices("cpu")[0]) == "dense"
  y, stats = nnx.jit(lambda m, x: m(x, return_stats=True))(layer, x)
  assert stats.implementation == "mosaic_gpu"
  weights = [jnp.asarray(w[...], jnp.bfloat16) for w in (layer.w_gate, layer.w_up, layer.w_down)]
  y_dense = twell_jax.ffn(x.astype(jnp.bfloat16), *weights, implementation="dense")
  assert _max_rel(y, y_dense) < 2e-2
  grads = nnx.grad(lambda m: m(x, return_stats=True)[1].l1)(layer)
  assert float(jnp.max(jnp.abs(grads.w_gate[...]))) > 0
  with pytest.raises(NotImplementedError, match=r"implementation='dense'"):
    jax.jvp(layer, (x,), (x,))
  with jax.default_device(jax.devices("cpu")[0]):
    assert twell_jax.resolve_implementation(*call) == "dense"
    layer_cpu = twell_jax.FeedForward(64, 256, rngs=nnx.Rngs(0))
    _, stats_cpu = layer_cpu(jnp.ones((8, 64)), return_stats=True)
  assert stats_cpu.implementation == "dense"
