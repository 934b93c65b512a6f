"""Training on a device mesh (train/runtime/mesh.py, twell_jax/sharded.py) with host CPU devices.

* `MeshRulesTest` (in process): mesh sizes from the config, the FSDP rule, the HLO parser.
* `MeshesTest`: a subprocess with 8 host devices (the device count is fixed when the
  backend starts) trains the micro model with the sparse "xla" implementation (its custom VJP
  runs per device under shard_map) on meshes 1, data=4, data=2 x fsdp=2 and fsdp=4 (four of
  the devices) and the full node's data=8, data=2 x fsdp=4 and fsdp=8: the same loss curve
  and parameters as one device; the compiled steps gather weights only (no all-gather,
  all-to-all or all-reduce of an activation); a checkpoint written from one mesh restores
  onto the others (data=2 x fsdp=4 among them) and continues identically; with two
  micro-batches a step, the same on meshes 1, data=4 and data=2 x fsdp=2, and data parallel
  reduces the gradients once per step, not inside the micro-batch loop.
The Mosaic GPU kernels themselves refuse the interpreter inside shard_map over more than one
device (the interpreter keeps one simulated GPU memory per process); they run per device
under shard_map on a one-device mesh in tests/test_transforms.py, and on GPUs.
"""

import json
import os
import sys
import textwrap

from absl.testing import absltest
import numpy as np
import pytest

import train_test_util as tu
from train.runtime import mesh as mesh_lib
from benchmarks.common import hlo as hlo_lib

_MESHES = textwrap.dedent("""
    import json, tempfile
    import jax, numpy as np
    jax.config.update("jax_disable_most_optimizations", True)
    import train_test_util as tu
    from benchmarks.common import hlo as hlo_lib
    from train.runtime import mesh as mesh_lib
    from train.state import checkpointing
    from train.state import trainer as trainer_lib

    # 8 x 24 tokens: no activation axis has the length of a parameter's (32, 16, 256, 259).
    cfg = tu.micro_config(batch_size=8, **{"data.seq_len": 24})
    cfg.model.ffn_implementation = "xla"
    tokens = np.random.default_rng(0).integers(3, 259, (4, 1, 8, 25)).astype(np.int32)

    def trainer(data, fsdp, shard_optimizer=False, reduction="auto"):
      cfg.mesh.update(data=data, fsdp=fsdp, shard_optimizer=shard_optimizer,
                      gradient_reduction=reduction)
      return trainer_lib.Trainer(cfg, mesh=mesh_lib.make_mesh(cfg.mesh, jax.devices()[:data * fsdp]))

    def steps(tr, state, batches):
      put = lambda t: tr.put_batch(t, tr.batch_sharding)
      step = tr.jit_train_step().lower(state, put(batches[0])).compile()
      losses = []
      for t in batches:
        state, m = step(state, put(t))
        losses.append(float(m["loss"]))
      return state, losses, step.as_text()

    out, saved, wd = {}, None, tempfile.mkdtemp()
    import optax
    # Optimizer moments split over the devices (mesh.shard_optimizer), then data parallel
    # with them replicated, reduced under GSPMD and per device (mesh.gradient_reduction).
    runs = ((1, 1, 1, "auto", ""), (4, 1, 1, "auto", ""), (2, 2, 1, "auto", ""),
            (1, 4, 1, "auto", ""), (4, 1, 0, "gspmd", "_replicated_moments"),
            (4, 1, 0, "per_device", "_per_device"),
            (8, 1, 1, "auto", ""), (2, 4, 1, "auto", ""), (1, 8, 1, "auto", ""))
    for data, fsdp, zero, reduction, suffix in runs:
      tr = trainer(data, fsdp, bool(zero), reduction)
      state, losses, hlo = steps(tr, tr.new_state(jax.random.key(0)), tokens[:3])
      params = jax.device_get(state["params"])
      ref = out.get("1x1", {}).get("params", params)
      w_up = state["params"]["blocks"][0]["ffn"]["w_up"]
      mu = optax.tree_utils.tree_get(state["opt_state"], "mu")["blocks"][0]["ffn"]["w_up"]
      out[f"{data}x{fsdp}{suffix}"] = {
          "moment_shard": list(mu.addressable_shards[0].data.shape),
          "losses": losses, "params": params,
          "param_diff": max(float(np.max(np.abs(a - b))) for a, b in
                            zip(jax.tree.leaves(params), jax.tree.leaves(ref))),
          "w_up_shard": list(w_up.addressable_shards[0].data.shape),
          "collectives": hlo_lib.collectives(hlo),
          "param_shapes": [list(p.shape) for p in jax.tree.leaves(params)],
      }
      if (data, fsdp, zero) == (4, 1, 1):  # a checkpoint of step 3 on this mesh
        mngr = checkpointing.make_manager(wd)
        checkpointing.save(mngr, 3, state, {"processes": []}, {"step": 3}, force=True)
        mngr.wait_until_finished()
        mngr.close()
        saved = jax.device_get(state)
    for data, fsdp in ((2, 2), (2, 4), (1, 1)):  # restored onto other meshes, one more step
      tr = trainer(data, fsdp)
      mngr, restored = checkpointing.restore_latest(wd, tr.abstract_state())
      mngr.close()
      state = restored["state"]
      same = all(np.array_equal(a, b) for a, b in
                 zip(jax.tree.leaves(jax.device_get(state)), jax.tree.leaves(saved)))
      laid_out = all(a.sharding == s for a, s in zip(jax.tree.leaves(state),
                                                      jax.tree.leaves(tr.state_sharding)))
      _, losses, _ = steps(tr, state, tokens[3:])
      out[f"restored_{data}x{fsdp}"] = {"equal": same, "laid_out": laid_out, "losses": losses}
      if (data, fsdp) == (2, 2):
        # Inference (train.generate, train.report) gathers a split model onto one device.
        from train.inference import loading
        inf = loading.inference_params(state["params"], tr.model_cfg)
        inference_devices = sorted({len(a.sharding.device_set) for a in jax.tree.leaves(inf)})
    # Two micro-batches a step (4 rows each): data parallel sums each device's micro-batches
    # and reduces once per step, outside the micro-batch loop.
    cfg.grad_accum_steps = 2
    accum = tokens[:2].reshape(2, 2, 4, 25)
    for data, fsdp in ((1, 1), (4, 1), (2, 2)):
      tr = trainer(data, fsdp)
      state, losses, hlo = steps(tr, tr.new_state(jax.random.key(0)), accum)
      params = jax.device_get(state["params"])
      ref = out.get("accum_1x1", {}).get("params", params)
      out[f"accum_{data}x{fsdp}"] = {
          "losses": losses, "params": params,
          "param_diff": max(float(np.max(np.abs(a - b))) for a, b in
                            zip(jax.tree.leaves(params), jax.tree.leaves(ref))),
          "collectives": hlo_lib.collectives(hlo),
          "loop_collectives": hlo_lib.loop_collectives(hlo),
          "param_shapes": [list(p.shape) for p in jax.tree.leaves(params)]}
    for v in out.values():
      v.pop("params", None)
    out["inference_devices"] = inference_devices

    # twell_jax.sharded.ffn itself: leading axis split, tokens split, nothing divides.
    import jax.numpy as jnp
    import twell_jax
    from twell_jax import sharded
    ws = [0.2 * jax.random.normal(jax.random.key(i), s) for i, s in
          ((1, (32, 256)), (2, (32, 256)), (3, (256, 32)))]
    def loss(f, impl):
      def g(x, *ws):
        y, st = f(x, *ws, implementation=impl, return_stats=True)
        return jnp.sum(y ** 2) + 10 * st.l1, st
      return jax.jit(jax.value_and_grad(g, argnums=(0, 1, 2, 3), has_aux=True))
    for impl in ("dense", "xla"):
      for lead in ((4, 6), (3, 8), (3, 5)):
        x = jax.random.normal(jax.random.key(0), lead + (32,))
        with jax.set_mesh(trainer(2, 2).mesh):
          got = loss(sharded.ffn, impl)(x, *ws)
        want = loss(twell_jax.ffn, impl)(x, *ws)
        out[f"ffn_{impl}_{lead[0]}x{lead[1]}"] = max(
            float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))) /
                  (1.0 + jnp.max(jnp.abs(b.astype(jnp.float32)))))
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    print("RESULT " + json.dumps(out))
    """)

def _run(script: str, devices: int, timeout: int = 300) -> dict:
  out = tu.run([sys.executable, "-c", script], timeout=timeout,
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               PYTHONPATH=os.path.dirname(__file__) + os.pathsep + tu.REPO)
  assert out.returncode == 0, out.stderr[-4000:]
  line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")][-1]
  return json.loads(line[len("RESULT "):])


class MeshRulesTest(absltest.TestCase):

  def test_mesh_shape_fills_minus_one_and_rejects_bad_sizes(self):
    self.assertEqual(mesh_lib.mesh_shape({"data": -1, "fsdp": 1}, 8), {"data": 8, "fsdp": 1})
    self.assertEqual(mesh_lib.mesh_shape({"data": 2, "fsdp": -1}, 8), {"data": 2, "fsdp": 4})
    self.assertEqual(mesh_lib.mesh_shape(None, 4), {"data": 4, "fsdp": 1})
    for bad in ({"data": -1, "fsdp": -1}, {"data": 3, "fsdp": -1}, {"data": 2, "fsdp": 2},
                {"data": 0, "fsdp": 8}):
      with self.assertRaises(mesh_lib.MeshError, msg=str(bad)):
        mesh_lib.mesh_shape(bad, 8)

  def test_state_layout_without_a_cpu_backend(self):
    """`JAX_PLATFORMS=cuda` loads no CPU backend: the optimizer's placeholder scalars are
    made on the default device instead, and the layout is the same."""
    from unittest import mock  # pylint: disable=import-outside-toplevel
    from train.state import trainer as trainer_lib  # pylint: disable=import-outside-toplevel
    cfg = tu.micro_config()
    want = trainer_lib.Trainer(cfg).state_sharding
    local_devices = mesh_lib.jax.local_devices

    def without_cpu(*args, backend=None, **kwargs):
      if backend == "cpu":
        raise RuntimeError("Unknown backend cpu. Available backends are ['cuda']")
      return local_devices(*args, backend=backend, **kwargs)

    with mock.patch.object(mesh_lib.jax, "local_devices", without_cpu):
      self.assertEqual(trainer_lib.Trainer(cfg).state_sharding, want)

  def test_fsdp_rule(self):
    spec = lambda shape, **kw: tuple(mesh_lib.param_spec(shape, 4, **kw))
    self.assertEqual(spec((2048, 5632)), (None, "fsdp"))        # the largest axis
    self.assertEqual(spec((5632, 2048)), ("fsdp", None))
    self.assertEqual(spec((2048, 2048)), ("fsdp", None))        # ties: the earlier one
    self.assertEqual(spec((259, 32)), (None, "fsdp"))           # 259 does not divide by 4
    self.assertEqual(spec((2048,)), ())                         # norm scales: replicated
    self.assertEqual(spec((30, 2)), ())                         # nothing divides
    self.assertEqual(spec((8, 2048, 5632), stacked=True), (None, None, "fsdp"))
    self.assertEqual(spec((8, 2048), stacked=True), ())         # stacked norm scales
    self.assertEqual(tuple(mesh_lib.param_spec((2048, 5632), 1)), ())

  def test_when_processes_are_joined(self):
    from train.runtime import distributed  # pylint: disable=g-import-not-at-top
    args = distributed.initialize_args
    self.assertIsNone(args(None, None, None, False))             # one process
    self.assertIsNone(args("h:1234", 1, 0, False))               # one process, said so
    self.assertEqual(args("h:1234", 2, 1, False),
                     {"coordinator_address": "h:1234", "num_processes": 2, "process_id": 1})
    self.assertEqual(args(None, None, None, True, env={}),        # the cluster fills in
                     {"coordinator_address": None, "num_processes": None, "process_id": None})
    k8s = {"JOB_COMPLETION_INDEX": "3"}                            # a Kubernetes indexed Job
    self.assertEqual(args("twell-0.twell:8476", 4, None, True, env=k8s)["process_id"], 3)
    self.assertEqual(args("h:1", 4, 1, True, env=k8s)["process_id"], 1)   # the flag first
    self.assertIsNone(args(None, None, None, False, env=k8s))      # only with --distributed

  def test_collectives_parser(self):
    hlo = textwrap.dedent("""
        %all-gather.3 = bf16[2048,5632]{1,0} all-gather(bf16[1024,5632]{1,0} %p), dimensions={0}
        %ag-start = (bf16[8,16]{1,0}, bf16[16,16]{1,0}) all-gather-start(bf16[8,16]{1,0} %x)
        %ag-done = bf16[16,16]{1,0} all-gather-done(%ag-start)
        %all-reduce.7 = (f32[], f32[32,256]{1,0}, /*index=2*/s32[256]{0}) all-reduce(%a, %b, %c)
        %fusion = f32[4]{0} fusion(%all-gather.3), kind=kLoop
        """)
    self.assertEqual(hlo_lib.collectives(hlo), [
        ("all-gather", [("bf16", (2048, 5632))]),
        ("all-gather", [("bf16", (8, 16)), ("bf16", (16, 16))]),
        ("all-reduce", [("f32", ()), ("f32", (32, 256)), ("s32", (256,))])])
    found = hlo_lib.collectives(hlo) + [("all-gather", [("bf16", (192, 32))]),
                                         ("all-to-all", [("f32", (8, 24, 2, 16))])]
    self.assertEqual(hlo_lib.non_weight_collectives(found, [(2048, 5632), (16,), (16, 8)]), [
        ("all-gather", "bf16", (16, 16)),                       # (8, 16): (16, 8) transposed
        ("all-reduce", "f32", (32, 256)), ("all-gather", "bf16", (192, 32)),
        ("all-to-all", "f32", (8, 24, 2, 16))])
    # Under fsdp=2 an async all-gather starts from a shard, a reduce-scatter ends with one.
    shards = [("all-gather", [("bf16", (1024, 5632)), ("bf16", (2048, 5632))]),
              ("reduce-scatter", [("bf16", (2048, 2816))]),
              ("reduce-scatter", [("bf16", (2048, 1408))])]
    self.assertEqual(hlo_lib.non_weight_collectives(shards, [(2048, 5632)], fsdp=2),
                     [("reduce-scatter", "bf16", (2048, 1408))])
    self.assertLen(hlo_lib.non_weight_collectives(shards, [(2048, 5632)]), 3)

  def test_collective_overlap_parser(self):
    hlo = textwrap.dedent("""
        HloModule m, is_scheduled=true

        %wrapped (a: f32[4]) -> f32[4] {
          %a = f32[4]{0} parameter(0)
          %inner-start = f32[9]{0} all-reduce-start(%a)
          %f = f32[4]{0} fusion(%a), kind=kLoop
        }

        ENTRY %main (p: f32[4]) -> f32[4] {
          %p = f32[4]{0} parameter(0)
          %all-reduce-start.1 = (f32[4]{0}, bf16[2,8]{1,0}) all-reduce-start(%p, %q)
          %fusion.2 = f32[4]{0} fusion(%p), kind=kLoop
          %ag-start = (bf16[8,16]{1,0}, bf16[16,16]{1,0}) all-gather-start(bf16[8,16]{1,0} %x)
          %custom-call.3 = f32[4]{0} custom-call(%p), custom_call_target="x"
          %all-reduce-done.1 = (f32[4]{0}, bf16[2,8]{1,0}) all-reduce-done(%all-reduce-start.1)
          %ag-done = bf16[16,16]{1,0} all-gather-done(%ag-start)
          %rs = ((f32[8]{0}), f32[4]{0}) async-start(%p), calls=%wrapped_reduce-scatter
          %rsd = f32[4]{0} async-done(%rs)
          %all-reduce.9 = f32[8]{0} all-reduce(%p)
          ROOT %t = f32[4]{0} add(%p, %p)
        }
        """)
    self.assertEqual(hlo_lib.collective_overlap(hlo), [
        {"kind": "all-reduce", "bytes": 4 * 4 + 16 * 2, "between": 2},
        {"kind": "all-gather", "bytes": 16 * 16 * 2, "between": 1},
        {"kind": "reduce-scatter", "bytes": 32, "between": 0}])   # waited for at once
    # The GPU's form: the operands' tuple, then the results; each reduced byte counted once.
    gpu = hlo.replace("%all-reduce-start.1 = (f32[4]{0}, bf16[2,8]{1,0}) all-reduce-start",
                      "%all-reduce-start.1 = ((f32[4]{0}, bf16[2,8]{1,0}), f32[4]{0}, "
                      "bf16[2,8]{1,0}) all-reduce-start")
    self.assertNotEqual(gpu, hlo)
    self.assertEqual(hlo_lib.collective_overlap(gpu)[0],
                     {"kind": "all-reduce", "bytes": 4 * 4 + 16 * 2, "between": 2})


class TwoGpuOverlapTest(absltest.TestCase):
  """On two GPUs, the data-parallel step under GSPMD (`mesh.gradient_reduction="gspmd"`)
  overlaps its gradient reductions with the backward (XLA's latency-hiding scheduler, on by
  default): most of the bytes the asynchronous reductions move have compute scheduled between
  their start and their done."""

  @pytest.mark.gpu
  def test_gradient_reductions_overlap_the_backward(self):
    import jax  # pylint: disable=import-outside-toplevel
    from train.state import trainer as trainer_lib  # pylint: disable=import-outside-toplevel
    if jax.default_backend() != "gpu" or jax.device_count() < 2:
      self.skipTest("needs two GPUs")
    from configs import tiny  # pylint: disable=import-outside-toplevel
    cfg = tiny.get_config()   # no data read: the step is only compiled
    cfg.update(batch_size=8)
    cfg.data.seq_len = 128
    cfg.model.update(d_model=256, n_heads=4, n_kv_heads=2, d_ff=1024, n_layers=4,
                     ffn_implementation="dense")
    # XLA reducing the gradients inside the backward (the default reduces them per device
    # after it).
    cfg.mesh.update(data=2, fsdp=1, gradient_reduction="gspmd")
    tr = trainer_lib.Trainer(cfg, mesh=mesh_lib.make_mesh(cfg.mesh, jax.devices()[:2]))
    state = tr.abstract_state()
    batch = jax.ShapeDtypeStruct((1, 8, cfg.data.seq_len + 1), np.int32,
                                 sharding=tr.batch_sharding)
    hlo = tr.jit_train_step().lower(state, batch).compile().as_text()
    # Reduce-scatters with the optimizer's moments split (mesh.shard_optimizer), all-reduces
    # without.
    found = [o for o in hlo_lib.collective_overlap(hlo)
             if o["kind"] in ("all-reduce", "reduce-scatter")]
    self.assertNotEmpty(found)
    total = sum(o["bytes"] for o in found)
    hidden = sum(o["bytes"] for o in found if o["between"] > 0)
    self.assertGreater(hidden, 0.5 * total, found)

  @pytest.mark.gpu
  def test_tied_table_gradient_reduced_in_two_parts(self):
    """The LM head's gradient of the tied embedding is all-reduced on its own, in bf16, and
    early; XLA's reassociation used to fold it into the lookup's, reducing one f32 [V, D]
    sum after the whole backward (losses._reduced_apart)."""
    import jax  # pylint: disable=import-outside-toplevel
    from train.state import trainer as trainer_lib  # pylint: disable=import-outside-toplevel
    if jax.default_backend() != "gpu" or jax.device_count() < 2:
      self.skipTest("needs two GPUs")
    from configs import tiny  # pylint: disable=import-outside-toplevel
    cfg = tiny.get_config()
    cfg.update(batch_size=8)
    cfg.data.seq_len = 128
    # A table of 64 MiB in bf16: XLA concatenates small gradients into flat buffers before
    # reducing them, which would hide the table's shape.
    cfg.model.update(d_model=1024, n_heads=8, n_kv_heads=4, d_ff=1024, n_layers=2,
                     vocab_size=32768, ffn_implementation="dense", dtype="bfloat16")
    cfg.mesh.update(data=2, fsdp=1, gradient_reduction="gspmd")
    tr = trainer_lib.Trainer(cfg, mesh=mesh_lib.make_mesh(cfg.mesh, jax.devices()[:2]))
    batch = jax.ShapeDtypeStruct((1, 8, cfg.data.seq_len + 1), np.int32,
                                 sharding=tr.batch_sharding)
    hlo = tr.jit_train_step().lower(tr.abstract_state(), batch).compile().as_text()
    table = (tr.model_cfg.vocab_size, tr.model_cfg.d_model)
    # One set of dtypes per all-reduce that moves the table (an async start lists its
    # operand and its result).
    reduced = [{dt for dt, shape in shapes if shape == table}
               for kind, shapes in hlo_lib.collectives(hlo)
               if kind in ("all-reduce", "reduce-scatter")]
    reduced = [dts for dts in reduced if dts]
    self.assertEqual(reduced, [{"bf16"}, {"bf16"}])


class MeshesTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.out = _run(_MESHES, 8)

  def test_same_loss_curve_and_parameters_on_every_mesh(self):
    ref = self.out["1x1"]["losses"]
    self.assertLess(ref[-1], ref[0])
    for mesh in ("4x1", "2x2", "1x4", "4x1_replicated_moments", "4x1_per_device", "8x1", "2x4",
                 "1x8"):
      np.testing.assert_allclose(self.out[mesh]["losses"], ref, rtol=1e-5, err_msg=mesh)
      self.assertLess(self.out[mesh]["param_diff"], 1e-5, mesh)

  def test_micro_batches_reduced_once_per_step(self):
    """Two micro-batches a step: the same losses and parameters on every mesh; data parallel
    reduces no gradient inside the micro-batch loop (it reduces the summed gradients once)."""
    ref = self.out["accum_1x1"]["losses"]
    for mesh in ("4x1", "2x2"):
      r = self.out[f"accum_{mesh}"]
      np.testing.assert_allclose(r["losses"], ref, rtol=1e-5, err_msg=mesh)
      self.assertLess(r["param_diff"], 1e-5, mesh)
      fsdp = int(mesh.split("x")[1])
      self.assertEqual(hlo_lib.non_weight_collectives(r["collectives"], r["param_shapes"],
                                                       fsdp, devices=4), [], mesh)
    # data=4: nothing inside the loop (with fsdp, GSPMD reduces over "fsdp" per micro-batch,
    # an all-reduce on the CPU, a reduce-scatter on GPUs).
    self.assertEqual(self.out["accum_4x1"]["loop_collectives"], [])
    self.assertIn("all-reduce", {kind for kind, _ in self.out["accum_4x1"]["collectives"]})

  def test_sharded_ffn_equals_ffn(self):
    """y, every statistic and every gradient, with x split over its leading axis, over its
    flattened tokens, and not split (15 tokens on 4 devices)."""
    for impl in ("dense", "xla"):
      for lead in ("4x6", "3x8", "3x5"):
        self.assertLess(self.out[f"ffn_{impl}_{lead}"], 1e-5, f"{impl} {lead}")

  def test_parameters_split_over_fsdp(self):
    self.assertEqual(self.out["4x1"]["w_up_shard"], [32, 256])   # replicated
    self.assertEqual(self.out["2x2"]["w_up_shard"], [32, 128])
    self.assertEqual(self.out["1x4"]["w_up_shard"], [32, 64])
    self.assertEqual(self.out["2x4"]["w_up_shard"], [32, 64])
    self.assertEqual(self.out["1x8"]["w_up_shard"], [32, 32])

  def test_optimizer_moments_split_over_every_axis(self):
    """ZeRO stage 1: AdamW's moments split over all the mesh's devices whatever its axes, and
    following the parameters with mesh.shard_optimizer=False."""
    for mesh in ("4x1", "2x2", "1x4"):
      self.assertEqual(self.out[mesh]["moment_shard"], [32, 64], mesh)
    for mesh in ("8x1", "2x4", "1x8"):
      self.assertEqual(self.out[mesh]["moment_shard"], [32, 32], mesh)
    self.assertEqual(self.out["4x1_replicated_moments"]["moment_shard"], [32, 256])
    self.assertEqual(self.out["1x1"]["moment_shard"], [32, 256])

  def test_no_activation_moves_between_devices(self):
    for mesh in ("4x1", "2x2", "1x4", "4x1_replicated_moments", "4x1_per_device", "8x1", "2x4",
                 "1x8"):
      r = self.out[mesh]
      kinds = {kind for kind, _ in r["collectives"]}
      self.assertTrue(kinds & {"all-reduce", "reduce-scatter"}, mesh)   # the gradients
      # The activations ([8, 24, D], [192, D], [192, H], ...) match no parameter's shape.
      data, fsdp = (int(a) for a in mesh.split("_")[0].split("x"))
      self.assertEqual(hlo_lib.non_weight_collectives(r["collectives"], r["param_shapes"],
                                                       fsdp, devices=data * fsdp), [], mesh)
    gathers = lambda mesh: [ops for kind, ops in self.out[mesh]["collectives"]
                            if kind == "all-gather"]
    self.assertNotEmpty(gathers("2x2"))          # FSDP: weights are gathered
    self.assertNotEmpty(gathers("4x1"))          # ZeRO-1: the updated slices gathered back
    self.assertEmpty(gathers("4x1_replicated_moments"))   # data parallel: nothing
    self.assertEmpty(gathers("4x1_per_device"))

  def test_checkpoint_restores_onto_other_meshes(self):
    for mesh in ("2x2", "2x4", "1x1"):
      r = self.out[f"restored_{mesh}"]
      self.assertTrue(r["equal"], mesh)
      self.assertTrue(r["laid_out"], mesh)
      np.testing.assert_allclose(r["losses"], self.out["restored_1x1"]["losses"], rtol=1e-5,
                                 err_msg=mesh)

  def test_inference_parameters_on_one_device(self):
    self.assertEqual(self.out["inference_devices"], [1])


if __name__ == "__main__":
  absltest.main()
