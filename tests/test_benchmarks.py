"""The benchmarks' own pieces on the CPU: specs (and how the calibrated ones reproduce the
captured layers), the L2 probe kernel (interpreter), and one pass of the kernel benchmark over
the tiny spec in interpret mode (a smoke test of the code path; timings there mean nothing)."""

from __future__ import annotations

import json
import os
import types

from absl import app
from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.sweeps import activity_sweep
from benchmarks.sweeps import captured
from benchmarks import kernels
from benchmarks.acceptance import matrix
from benchmarks import scaling
from benchmarks.common import specs
from benchmarks import time_to_quality
from benchmarks import whole_run
from benchmarks.probes import l2_rows

_DATA = os.path.join(os.path.dirname(__file__), "data", "real_activity_h100.json")
_LEVELS = {"paper": "skew", "extreme": "extreme"}     # captured level -> spec name
# How close a calibrated spec's batch lands on its captured layer: absolute for fractions and
# shares, relative for counts per token.
_ABSOLUTE = {"dead_fraction": 0.03, "top1pct_share": 0.08, "top10pct_share": 0.08,
             "hottest_fraction": 0.05}
_RELATIVE = {"active_per_token": 0.15, "row_p99": 0.3, "row_max": 0.3}
# In 4096 tokens, features that fire only in the captured batch's rare near-dense rows or on
# a few of its tokens fire nowhere, and the longest row is another: there only the statistics
# that do not depend on the batch size are compared.
_SMALL_BATCH = ("active_per_token", "top1pct_share", "top10pct_share", "hottest_fraction",
                "row_p99")


def _captured_layers():
  with open(_DATA) as f:
    data = json.load(f)["captured"]
  return data, [(level, i, target) for level, layers in data["levels"].items()
                for i, target in enumerate(layers)]


def _misses(got: dict, want: dict, keys) -> list[str]:
  out = []
  for k in keys:
    if k in _ABSOLUTE and abs(got[k] - want[k]) > _ABSOLUTE[k]:
      out.append(f"{k} {got[k]:.3f} vs {want[k]:.3f}")
    if k in _RELATIVE and abs(got[k] - want[k]) > _RELATIVE[k] * want[k]:
      out.append(f"{k} {got[k]:.1f} vs {want[k]:.1f}")
  return out


class SpecsTest(absltest.TestCase):

  def test_inputs_are_deterministic(self):
    a = specs.get("tiny").inputs(seed=3)
    b = specs.get("tiny").inputs(seed=3)
    for u, v in zip(a, b):
      np.testing.assert_array_equal(np.asarray(u, np.float32), np.asarray(v, np.float32))

  def test_unknown_spec(self):
    with self.assertRaisesRegex(KeyError, "unknown spec"):
      specs.get("paper_16x")


class CalibratedSpecsTest(absltest.TestCase):
  """The `paper_16k_<level>_l<i>` specs against the captured layers they reproduce
  (tests/data/real_activity_h100.json), generated with D = 128 (the statistics do not depend
  on D: every gate column's random part has unit norm)."""

  def test_specs_reproduce_the_captured_layers(self):
    data, layers = _captured_layers()
    misses = []
    for level, i, want in layers:
      spec = specs.get(f"paper_16k_{_LEVELS[level]}_l{i}")
      self.assertEqual(spec.m, data["tokens"])
      for m, keys in ((spec.m, tuple(_ABSOLUTE) + tuple(_RELATIVE)), (4096, _SMALL_BATCH)):
        got = captured.generated_stats(spec.generator_args(), m, 128, spec.h)
        misses += [f"{level} layer {i} at M={m}: {e}" for e in _misses(got, want, keys)]
    self.assertEqual(misses, [])

  def test_fit_generator_gives_the_spec_arguments(self):
    """The spec table is fit_generator's output: refitting two of the layers gives it back."""
    data, layers = _captured_layers()
    for level, i, want in (layers[1], layers[8]):
      ref = specs.get(f"paper_16k_{_LEVELS[level]}_l{i}").generator_args()
      fit = captured.fit_generator(want, data["tokens"], data["h"])
      for k in ("active_fraction", "dead_fraction", "hottest", "heavy_fraction", "heavy_fill",
                "top_shares", "row_spread"):
        np.testing.assert_allclose(fit[k], ref[k], rtol=2e-3, atol=1e-3, err_msg=k)


class ThreeAnchorFitTest(absltest.TestCase):

  def test_the_top_half_share_is_fitted_where_recorded(self):
    """A layer whose top half holds 97% of the firings: fitted with the top-50% share, the
    generated batch has it; the first two anchors alone leave the top half near 70%."""
    m, d, h = 4096, 128, 1024
    want = captured.generated_stats(
        {"active_fraction": 0.04, "dead_fraction": 0.03, "hottest": 0.6,
         "top_shares": ((0.01, 0.09), (0.1, 0.48), (0.5, 0.97)), "row_spread": 0.3}, m, d, h)
    self.assertAlmostEqual(want["top50pct_share"], 0.97, delta=0.01)
    got = captured.generated_stats(captured.fit_generator(want, m, h), m, d, h)
    self.assertAlmostEqual(got["top50pct_share"], want["top50pct_share"], delta=0.01)
    older = {k: v for k, v in want.items() if k != "top50pct_share"}
    two = captured.generated_stats(captured.fit_generator(older, m, h), m, d, h)
    self.assertLess(two["top50pct_share"], 0.85)
    # The same anchor given as a measured extra share (fraction, share).
    extra = captured.fit_generator(older, m, h, extra_shares=((0.5, want["top50pct_share"]),))
    self.assertAlmostEqual(captured.generated_stats(extra, m, d, h)["top50pct_share"],
                           want["top50pct_share"], delta=0.01)


class L2ProbeTest(parameterized.TestCase):

  @parameterized.parameters("random", "sequential")
  def test_reads_the_rows_it_counts(self, order):
    """The L2 ceiling probe sums exactly the rows whose bytes it reports."""
    table = jax.random.normal(jax.random.key(5), (96, 256)).astype(jnp.bfloat16)
    want = l2_rows.probe_reference(table, n_ctas=3, steps=5, unroll=2, order=order)
    got = l2_rows.probe(table, n_ctas=3, steps=5, unroll=2, order=order, interpret=True)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)
    # The TMA variant (rows into SMEM, two slots; 128-column copies: two per row).
    got = l2_rows.probe_tma(table, n_ctas=3, steps=5, unroll=2, order=order, chunk=128,
                            interpret=True)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)

  def test_row_lengths_checked_up_front(self):
    self.assertEqual(l2_rows._parse_row_elems(["2048", "4096"]), [2048, 4096])  # pylint: disable=protected-access
    for bad in (["3000"], ["0"], ["2048", "four"], ["384"]):
      with self.assertRaisesRegex(app.UsageError, "--row_elems"):
        l2_rows._parse_row_elems(bad)  # pylint: disable=protected-access


class KernelBenchmarkSmokeTest(absltest.TestCase):
  """The forward + backward benchmark's code path on the CPU, with the portable sparse
  implementation (the kernels' own interpret-mode tests cover mosaic_gpu)."""

  def test_forward_and_backward_on_the_tiny_spec(self):
    spec = specs.get("tiny")
    bwd = kernels.bench_fwd_bwd(spec, iters=1, impls=("dense", "xla"), interpret=False,
                                breakdown=False)
    self.assertNotIn("xla_error", bwd)
    self.assertLess(bwd["xla_residual_ratio"], 1.0)
    self.assertLess(max(bwd["xla_grad_rel_vs_dense"]), 5e-2)
    self.assertGreater(bwd["input"]["active_per_token"], 1.0)


class MatrixTest(absltest.TestCase):
  """The acceptance matrix's cells and the table made from its results."""

  def test_meshes_and_commands(self):
    self.assertEqual(matrix.meshes(1), ["1"])
    self.assertEqual(matrix.meshes(2), ["data=2", "fsdp=2"])
    self.assertEqual(matrix.meshes(4), ["data=4", "fsdp=4", "data=2,fsdp=2"])
    self.assertEqual(matrix.meshes(8), ["data=8", "fsdp=8", "data=2,fsdp=4"])   # a full node
    four = ["1"] + matrix.meshes(4)
    self.assertEqual(matrix.select_meshes(four, ["data", "fsdp"]), four[1:])
    self.assertEqual(matrix.select_meshes(four, ["fsdp"]), ["fsdp=4"])
    self.assertEqual(matrix.select_meshes(four, "data=4,fsdp=4,data=2,fsdp=2".split(",")),
                     four[1:])
    self.assertEqual(matrix.select_meshes(four, ["data=2", "fsdp=2"]), ["data=2,fsdp=2"])
    with self.assertRaisesRegex(ValueError, "data=8"):
      matrix.select_meshes(four, ["data=4", "data=8"])
    # The 1.5B and 2B cells (~100 GB of checkpoints at the most) one at a time, after the others.
    cells = [("paper_2b", "default", "fsdp=4"), ("tiny", "default", "fsdp=4"),
             ("paper_1p5b", "mosaic_gpu", "data=2,fsdp=2")]
    self.assertEqual(matrix.split_cells(cells), ([cells[1]], [cells[0], cells[2]]))
    cmd = matrix.train_cmd("small", "mosaic_gpu", "data=2,fsdp=2", "/w")
    self.assertIn("--config=configs/small.py", cmd)
    self.assertIn("--config.model.ffn_implementation=mosaic_gpu", cmd)
    self.assertIn("--config.mesh.data=2", cmd)
    self.assertIn("--config.mesh.fsdp=2", cmd)
    default = matrix.train_cmd("tiny", "default", "1", "/w")
    self.assertFalse(any("ffn_implementation" in a for a in default))
    # The big configs keep one checkpoint per run: their flag comes after the common one (the
    # last of a repeated flag wins).
    keep = lambda cmd: [a for a in cmd if a.startswith("--config.keep_checkpoints=")][-1]
    self.assertEqual(keep(matrix.train_cmd("paper_2b", "default", "fsdp=2", "/w")),
                     "--config.keep_checkpoints=1")
    self.assertEqual(keep(cmd), "--config.keep_checkpoints=2")

  def test_committed_results_make_a_table(self):
    paths = [os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks", "results",
                          d, "matrix.json")
             for d in ("h100", "h200", "h200x2", "h100x2", "h200x4")]
    results = []
    for path in paths:
      with open(path) as f:
        results.append(json.load(f))
    text = matrix.table(results)
    self.assertEqual(len(text.splitlines()), 2 + sum(len(r["cells"]) for r in results))
    for r in results:
      for c in r["cells"]:
        self.assertEqual(c["ok"], c["error"] is None)
        self.assertIn(f"| {c['config']} | {c['impl']} | {c['mesh']} |", text)


class ScalingSmokeTest(absltest.TestCase):
  """The scaling benchmark's code path on one CPU device (the 4-device meshes are covered by
  tests/test_sharding.py)."""

  def test_one_mesh(self):
    import types  # pylint: disable=import-outside-toplevel
    fl = types.SimpleNamespace(shape="tiny", layers=2, batch_per_device=2, iters=1,
                               weights="init", remat=False, sparse="xla", scan_layers=True,
                               scan_unroll=True, frozen_weights=True, grad_accum=2,
                               choose_mesh="1x1")
    params = scaling._params(fl)  # pylint: disable=protected-access
    # The sparse model as the trainer runs it: the per-layer choice from one step's counts.
    choice = scaling._choose(fl, params)  # pylint: disable=protected-access
    self.assertLen(choice["key"][0], 2)
    self.assertEqual(choice["order"].shape, (2, 256))
    r = scaling.run_mesh(fl, "sparse", 1, 1, params, choice=choice)
    self.assertEqual(r["mesh"], "1x1")
    self.assertEqual(r["tokens_per_step"], 2 * 2 * 64)  # 2 micro-batches of 2 rows of 64
    self.assertTrue(r["scan_unroll"])   # the scan unrolled (model.scan_unroll) runs too
    self.assertEqual(r["ffn_per_layer"], choice["describe"])
    self.assertEqual(r["compiler_options"], {})                 # one device: XLA's own
    self.assertGreater(r["tokens_per_s"], 0)
    self.assertEqual(r["collectives"], {})
    self.assertEqual(r["non_weight_collectives"], [])
    self.assertTrue(r["scan_layers"])
    # Timed at learning rate 0 (the weights, and so the activity, do not drift), unless asked.
    config = scaling._config  # pylint: disable=protected-access
    self.assertEqual(config(fl, "sparse", 1, 1).learning_rate, 0.0)
    fl.frozen_weights = False
    self.assertGreater(config(fl, "sparse", 1, 1).learning_rate, 0.0)

  def test_default_meshes_double_up_to_every_device(self):
    self.assertEqual(scaling.default_meshes(1), ["1x1"])
    self.assertEqual(scaling.default_meshes(2), ["1x1", "2x1"])
    self.assertEqual(scaling.default_meshes(4), ["1x1", "2x1", "4x1"])
    self.assertEqual(scaling.default_meshes(8), ["1x1", "2x1", "4x1", "8x1"])
    self.assertEqual(scaling.default_meshes(6), ["1x1", "2x1", "4x1", "6x1"])

  def test_parse_mesh_names_a_bad_value(self):
    from absl import app  # pylint: disable=import-outside-toplevel
    self.assertEqual(scaling.parse_mesh("2x2"), (2, 2))
    for bad in ("4", "1x", "0x4", "2x2x1", "ax4"):
      with self.assertRaisesRegex(app.UsageError, f"mesh '{bad}': expected DATAxFSDP"):
        scaling.parse_mesh(bad)

  def test_merge_results_pairs_each_depth_and_mesh(self):
    """Invocations with each model at its own setting merge into one: every run keeps its
    invocation's setting, and per depth and mesh the sparse/dense tokens/s and peak memory."""
    run = lambda model, mesh, tps, peak, step_peak: {
        "model": model, "mesh": mesh, "tokens_per_s": tps,
        "xla_peak_bytes_per_device": step_peak, "measured_peak_bytes_per_device": [peak, None]}
    top = {"device": "H", "device_count": 4, "jax": "0", "weights": "trained",
           "train_steps": 500}
    sparse = {**top, "layers": 28, "batch_per_device": 8, "grad_accum": 1, "remat": False,
              "runs": [run("sparse", "1x4", 300.0, 60, 30), run("sparse", "2x2", 280.0, 50, 25)]}
    dense = {**top, "layers": 28, "batch_per_device": 4, "grad_accum": 2, "remat": False,
             "runs": [run("dense", "1x4", 200.0, 80, 60),
                      {"model": "dense", "mesh": "2x2", "error": "RESOURCE_EXHAUSTED"}]}
    merged = scaling.merge_results([sparse, dense])
    self.assertEqual(merged["ratios"], [{"layers": 28, "mesh": "1x4", "speedup": 1.5,
                                         "peak_memory_ratio": 0.5,
                                         "process_peak_ratio": 0.75}])
    self.assertLen(merged["runs"], 3)
    self.assertEqual([r["grad_accum"] for r in merged["runs"]], [1, 1, 2])
    self.assertEqual(merged["failed"][0]["mesh"], "2x2")

  def test_loop_layout_of_stacked_params(self):
    """`--scan_layers=false` runs scan-layout (cached) weights in the loop layout: the
    parameters the loop layout's init makes, with layer l's slice of every stacked leaf."""
    from train.models import transformer as model_lib  # pylint: disable=import-outside-toplevel
    from benchmarks.common import trained  # pylint: disable=import-outside-toplevel
    cfg = trained.config_for("tiny", batch=2)
    shapes = {}
    for scan in (True, False):
      cfg.model.scan_layers = scan
      lm = model_lib.LanguageModel(model_lib.ModelConfig.from_config(cfg.model))
      shapes[scan] = jax.eval_shape(lm.init_params, jax.random.key(0))
    stacked = jax.tree.map(lambda s: jnp.arange(np.prod(s.shape), dtype=jnp.float32).reshape(
        s.shape), shapes[True])
    loop = scaling.loop_layout(stacked)
    self.assertEqual(jax.tree.structure(loop), jax.tree.structure(shapes[False]))
    for l, block in loop["blocks"].items():
      for got, whole in zip(jax.tree.leaves(block), jax.tree.leaves(stacked["blocks"])):
        np.testing.assert_array_equal(got, whole[l])


class TraceBreakdownTest(absltest.TestCase):
  """`timing.trace_breakdown` on a Perfetto trace shaped like jax.profiler's: the first GPU's
  kernels per step, by stream and by name (numeric suffixes merged); host events ignored."""

  def test_per_step_summary(self):
    import gzip  # pylint: disable=import-outside-toplevel
    from benchmarks.common import timing  # pylint: disable=import-outside-toplevel
    meta = lambda pid, name: {"ph": "M", "name": "process_name", "pid": pid,
                              "args": {"name": name}}
    kernel = lambda pid, tid, name, ts, dur: {"ph": "X", "pid": pid, "tid": tid, "name": name,
                                              "ts": ts, "dur": dur}
    events = [meta(1, "/device:GPU:0"), meta(2, "/device:GPU:1"), meta(7, "/host:CPU"),
              kernel(1, 24, "fusion.1", 0, 1000), kernel(1, 24, "fusion.2", 1500, 500),
              kernel(1, 101, "ncclDevKernel_AllReduce(x)", 1200, 2000),
              kernel(2, 30, "fusion.9", 0, 9000), kernel(7, 5, "host work", 0, 99999)]
    tmp = self.create_tempdir().full_path
    os.makedirs(os.path.join(tmp, "plugins", "profile", "t"))
    with gzip.open(os.path.join(tmp, "plugins", "profile", "t", "perfetto_trace.json.gz"),
                   "wt") as f:
      json.dump({"traceEvents": events}, f)
    r = timing.trace_breakdown(tmp, steps=2)
    self.assertAlmostEqual(r["span_ms"], 3.2 / 2)                 # 0 to 3,200 us
    self.assertEqual(r["busy_ms_by_stream"], {"101": 1.0, "24": 0.75})
    self.assertEqual(r["kernels"], [["ncclDevKernel_AllReduce", 1.0], ["fusion", 0.75]])
    # Compute 0-1,000 and 1,500-2,000; the collective 1,200-3,200 runs alone over 1,200-1,500
    # and 2,000-3,200; nothing runs over 1,000-1,200.
    self.assertAlmostEqual(r["compute_ms"], 1.5 / 2)
    self.assertAlmostEqual(r["collective_ms"], 2.0 / 2)
    self.assertAlmostEqual(r["exposed_collective_ms"], 1.5 / 2)
    self.assertAlmostEqual(r["idle_ms"], 0.2 / 2)
    self.assertIsNone(timing.trace_breakdown(self.create_tempdir().full_path, steps=1))


class DecodeFfnSmokeTest(absltest.TestCase):
  """`benchmarks.sweeps.decode_ffn --smoke --sweep`: the few-row FFN against dense by rows and union
  (interpreted), the break-even table and the sweep's entries, into the JSON."""

  def test_smoke_mode(self):
    import subprocess  # pylint: disable=import-outside-toplevel
    import sys  # pylint: disable=import-outside-toplevel
    tmp = self.create_tempdir().full_path
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = os.path.join(tmp, "decode_ffn.json")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.sweeps.decode_ffn", "--smoke", "--sweep",
                           f"--out={out}"], cwd=root, capture_output=True, text=True,
                          timeout=600, check=False)
    self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
    with open(out) as f:
      r = json.load(f)
    self.assertEqual([x["m"] for x in r["rows"]], [2, 2, 16, 16])
    for x in r["rows"]:
      self.assertEqual(x["max_rel_diff_to_dense"], 0.0)    # the dense FFN's roundings
      self.assertGreater(x["union"], 0)
      self.assertAlmostEqual(x["ratio"], x["dense_us"] / x["sparse_us"])
    self.assertEqual(set(r["break_even"]), {"2", "16"})
    self.assertEqual(len(r["sweep"]), 2)


class DecodeSmokeTest(absltest.TestCase):
  """`benchmarks.decode --smoke --sparse=sparse`: dense against the few-row sparse kernels
  (interpreted) in every layer through train.generate, the bandwidth ceiling and exactness,
  into the JSON the GPU runs write."""

  def test_smoke_mode(self):
    import subprocess  # pylint: disable=import-outside-toplevel
    import sys  # pylint: disable=import-outside-toplevel
    tmp = self.create_tempdir().full_path
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = os.path.join(tmp, "decode.json")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.decode", "--smoke", f"--out={out}",
                           "--sparse=sparse", f"--cache_dir={tmp}/trained"], cwd=root, capture_output=True,
                          text=True, timeout=600, check=False)
    self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
    with open(out) as f:
      r = json.load(f)
    self.assertGreater(r["peak_bandwidth_gbs"], 0)
    self.assertEqual([(x["batch"], x["prompt"]) for x in r["rows"]], [(1, 16), (4, 16)])
    for x in r["rows"]:
      self.assertTrue(x["exact"], x)          # the same greedy tokens as the dense FFN
      self.assertEqual(set(x["sparse_layers"]), {"S"})
      self.assertGreater(x["dense_tokens_per_s"], 0)
      self.assertAlmostEqual(x["ratio"], x["sparse_tokens_per_s"] / x["dense_tokens_per_s"])
      self.assertGreater(x["bytes_per_step"], x["weight_bytes"])      # + the KV cache
      self.assertAlmostEqual(x["dense_bandwidth_fraction"],
                             x["dense_tokens_per_s"] / x["ceiling_tokens_per_s"])


class DecodePartingTest(absltest.TestCase):
  """Where two greedy decodes part, for rows whose continuations end at an end of sequence at
  different lengths (ragged)."""

  def test_parting_positions(self):
    from benchmarks import decode  # pylint: disable=import-outside-toplevel
    self.assertIsNone(decode.parting([1, 2, 3], [1, 2, 3]))
    self.assertEqual(decode.parting([1, 2, 3], [1, 5, 3]), 1)
    self.assertEqual(decode.parting([1, 2], [1, 2, 7, 8]), 2)     # one ended at its EOS
    self.assertEqual(decode.parting([], [4]), 0)


def _run_module(out: str, module: str, *args: str, timeout: int = 600) -> dict:
  """Runs `python -m module --out=OUT args` from the repository; the JSON it wrote."""
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  subprocess.run([sys.executable, "-m", module, f"--out={out}", *args], cwd=root, check=True,
                 capture_output=True, timeout=timeout)
  with open(out) as f:
    return json.load(f)


class EndToEndSmokeTest(absltest.TestCase):
  """`benchmarks.e2e`'s CPU mode as a subprocess (its own flags): the JSON it writes holds the
  fields the GPU runs report."""

  def test_tiny_cpu_mode(self):
    r = _run_module(os.path.join(self.create_tempdir().full_path, "e2e.json"),
                    "benchmarks.e2e", "--shapes=tiny", "--steps=3", "--iters=2")
    tiny = r["tiny"]
    for key in ("train_speedup", "prefill_speedup_2x64", "peak_memory_ratio",
                "peak_memory_ratio_no_remat"):
      self.assertGreater(tiny[key], 0, key)
    self.assertLen(tiny["tail_per_token"], tiny["layers"])
    self.assertLen(tiny["predicted_train_ratio"], tiny["layers"])


class WholeRunSmokeTest(absltest.TestCase):
  """`benchmarks.whole_run --smoke`: the user's commands (train.main) for dense SiLU and the
  sparse model, concurrently, timed whole; the JSON holds the issue's fields and the plot is
  drawn."""

  def test_smoke(self):
    tmp = self.create_tempdir().full_path
    png = os.path.join(tmp, "w.png")
    r = _run_module(os.path.join(tmp, "w.json"), "benchmarks.whole_run", "--smoke",
                    "--runs=dense_silu,sparse", "--parallel", "--stagger_s=1", "--deterministic",
                    f"--workdir={tmp}/runs", f"--plot={png}")
    self.assertEqual([run["name"] for run in r["runs"]], ["dense_silu", "sparse"])
    self.assertGreaterEqual(r["runs"][1]["started_at"] - r["runs"][0]["started_at"], 1.0)
    self.assertTrue(r["deterministic"])
    for run in r["runs"]:
      self.assertIn("--xla_gpu_deterministic_ops=true", run["xla_flags"])
    self.assertEqual(r["steps"], 6)
    self.assertEqual(r["tokens_per_step"], 16 * 64)
    dense, sparse = r["runs"]
    for run in r["runs"]:
      self.assertGreater(run["wall_s"], run["first_step_s"])
      self.assertEqual([p["step"] for p in run["points"]], [1, 2, 4, 6])
      self.assertLen(run["points"][-1]["active_per_token"], 2)
      self.assertIsNotNone(run["eval_ce"])
    self.assertAlmostEqual(r["wall_ratios"][0], dense["wall_s"] / sparse["wall_s"])
    self.assertAlmostEqual(r["ce_ratio"], sparse["eval_ce"] / dense["eval_ce"])
    self.assertEqual([s for s, _ in sparse["step_ratios"]], [2, 4, 6])
    self.assertIn("landing_waits_s", sparse)   # the log's format: test_layer_choice
    self.assertEqual(len(sparse["build_s"]), len(sparse["landing_waits_s"]))
    self.assertEqual(len(sparse["landing_late_steps"]), len(sparse["landing_waits_s"]))
    # The wall-clock cut at the first step and the evaluation (step 6), summing to it.
    for run in r["runs"]:
      self.assertEqual([label for label, _ in run["phases"]], ["start", "1-6", "end"])
      self.assertAlmostEqual(sum(sec for _, sec in run["phases"]), run["wall_s"])
    self.assertAlmostEqual(dict(sparse["phase_ratios"])["start"],
                           dense["first_step_s"] / sparse["first_step_s"])
    self.assertTrue(os.path.getsize(png) > 0)
    # One run per invocation (one GPU, a time limit per command), merged afterwards: the same
    # summary from the runs' JSONs alone.
    halves = []
    for i, run in enumerate(r["runs"]):
      halves.append(os.path.join(tmp, f"half{i}.json"))
      with open(halves[-1], "w") as f:
        json.dump(dict(r, runs=[run]), f)
    merged = _run_module(os.path.join(tmp, "m.json"), "benchmarks.whole_run", "--smoke",
                         "--runs=", f"--merge={','.join(halves)}", f"--workdir={tmp}/none")
    self.assertEqual(merged["wall_ratios"], r["wall_ratios"])
    self.assertEqual(merged["runs"][1]["step_ratios"], sparse["step_ratios"])
    # Sparse runs alone (no dense SiLU run): whether their decisions agree.
    other = dict(sparse, decisions=sparse["decisions"] + [[99, "D D", 100]])
    for runs, same in (([sparse, sparse], True), ([sparse, other], False)):
      with open(halves[0], "w") as f:
        json.dump(dict(r, runs=runs), f)
      alone = _run_module(os.path.join(tmp, "s.json"), "benchmarks.whole_run", "--smoke",
                          "--runs=", f"--merge={halves[0]}", f"--workdir={tmp}/none")
      self.assertEqual(alone["same_decisions"], same)
      self.assertNotIn("wall_ratios", alone)


class WholeRunVariantsTest(absltest.TestCase):
  """`--runs` entries NAME+KEY=VALUE: the overrides reach that run's command only, and the run
  gets its ratios but stays out of the summary's; a bad entry is named before anything runs."""

  def test_overrides_and_summary(self):
    fl = types.SimpleNamespace(workdir="/w", shape="tiny", warmup_steps=2, steps=6, log_every=2,
                               eval_every=6, eval_batches=2, checkpoint_every=0, l1=3e-5,
                               extra_flags=["--config.seed=3"])
    cmd, workdir = whole_run.run_command(fl, "sparse+layer_choice.landing_steps=200", 2, [])
    self.assertEqual(workdir, "/w/2_sparse")
    self.assertEqual(cmd[-2:], ["--config.seed=3", "--config.layer_choice.landing_steps=200"])
    plain, _ = whole_run.run_command(fl, "sparse", 1, [])
    self.assertNotIn("--config.layer_choice.landing_steps=200", plain)
    for bad in ("sprase", "sparse+landing_steps", "dense_silu+=3"):
      with self.assertRaisesRegex(app.UsageError, "run "):
        whole_run.parse_run(bad)
    run = lambda name, wall: {"name": name, "wall_s": wall, "first_step_s": 1.0, "evals": [],
                              "points": [], "eval_ce": None, "decisions": []}
    results = {"runs": [run("dense_silu", 300.0), run("sparse", 250.0),
                        run("sparse+layer_choice.landing_steps=200", 240.0)]}
    whole_run.summarize(results)
    self.assertEqual(results["wall_ratios"], [1.2])
    self.assertAlmostEqual(results["runs"][2]["wall_ratio"], 1.25)


class TimeToQualityTest(absltest.TestCase):
  """`benchmarks.time_to_quality`: three runs a seed (dense, sparse at equal steps, sparse at
  dense's wall-clock), carried on across commands, and the ratios over seeds."""

  def test_smoke_across_two_commands(self):
    from benchmarks.common import cli_run  # pylint: disable=import-outside-toplevel
    tmp = self.create_tempdir().full_path
    out, png = os.path.join(tmp, "t.json"), os.path.join(tmp, "t.png")
    args = ("--smoke", "--seeds=0", f"--workdir={tmp}/runs", f"--plot={png}")
    # Two at once, a budget of 1 s: dense and sparse start together (nothing predicts them),
    # each on its own "GPU"; sparse_t, waiting for both, no longer fits after them.
    first = _run_module(out, "benchmarks.time_to_quality", *args, "--budget_s=1",
                        "--gpus=0,1", "--stagger_s=1")
    self.assertEqual(sorted((r["arm"], r["gpu"]) for r in first["runs"]),
                     [("dense", "0"), ("sparse", "1")])
    dense_first, sparse_first = sorted(first["runs"], key=lambda r: r["arm"])
    self.assertBetween(sparse_first["started_at"] - dense_first["started_at"], 1.0,
                       dense_first["wall_s"])
    levers = os.path.join(tmp, "new", "levers.json")   # its folder made
    r = _run_module(out, "benchmarks.time_to_quality", *args, f"--levers_out={levers}")
    self.assertEqual([x["arm"] for x in r["runs"]][2:], ["sparse_t"])
    self.assertEqual(r["runs"][:2], first["runs"])           # kept, not rerun
    self.assertIsNone(r["runs"][2]["gpu"])                   # one at a time: no GPU named
    # The host's GPUs as nvidia-smi lists them (none here): runs of one seed compare alike.
    self.assertEqual({x["host_gpus"] for x in r["runs"]}, {len(cli_run.gpu_names())})
    r["runs"] = sorted(r["runs"][:2], key=lambda x: x["arm"]) + r["runs"][2:]
    # Every run keeps the digest of the code it ran: this checkout's, the same for all three.
    self.assertEqual(r["codes"], {cli_run.code_digest(): 3})
    dense, sparse, sparse_t = r["runs"]
    self.assertEqual(sparse_t["steps"], time_to_quality.equal_time_steps(
        dense, sparse, 6, r["tokens_per_step"], 6))
    with open(levers) as f:
      table = json.load(f)
    self.assertEqual([(x["lever"], x["arm"]) for x in table["rows"]],
                     [("l1=2e-05", "sparse"), ("l1=2e-05", "sparse_t")])
    self.assertAlmostEqual(table["rows"][1]["ce_over_dense"],
                           sparse_t["eval_ce"] / dense["eval_ce"])
    self.assertEqual(sparse_t["points"][-1]["step"], sparse_t["steps"])
    for run in r["runs"]:
      self.assertGreater(run["evals"][-1]["ce_se"], 0.0)
      self.assertGreater(run["data_passes"], 0.0)
    (row,) = r["per_seed"]
    self.assertAlmostEqual(row["wall_ratio"], dense["wall_s"] / sparse["wall_s"])
    self.assertAlmostEqual(row["ce_ratio_equal_time"], sparse_t["eval_ce"] / dense["eval_ce"])
    self.assertLen(dense["evals"][-1]["batch_ce"], 2)
    self.assertAlmostEqual(np.mean(dense["evals"][-1]["batch_ce"]), dense["eval_ce"], places=5)
    self.assertGreater(row["ce_ratio_equal_time_se"], 0.0)
    self.assertEqual(r["summary"]["wall_ratio"]["n"], 1)
    self.assertIsNone(r["summary"]["wall_ratio"]["ci95"])
    self.assertGreater(r["corpus"]["train"]["documents"], r["corpus"]["validation"]["documents"])
    self.assertGreater(r["corpus"]["train_tokens_estimate"], 0)
    self.assertTrue(os.path.getsize(png) > 0)
    # Commands run side by side, each with its own file: --merge joins them, running nothing.
    with open(out) as f:
      whole = json.load(f)
    parts = [os.path.join(tmp, name) for name in ("a.json", "b.json")]
    for path, runs in zip(parts, (whole["runs"][:2], whole["runs"][2:])):
      with open(path, "w") as f:
        json.dump({**whole, "runs": runs}, f)
    joined = _run_module(os.path.join(tmp, "joined.json"), "benchmarks.time_to_quality",
                         "--smoke", f"--merge={','.join(parts)}", f"--workdir={tmp}/none")
    self.assertEqual(joined["runs"], whole["runs"])
    self.assertEqual(joined["per_seed"], whole["per_seed"])
    self.assertEqual(joined["corpus"], whole["corpus"])
    self.assertFalse(os.path.exists(f"{tmp}/none"))
    with self.assertRaises(Exception):   # a run in two of the files
      _run_module(os.path.join(tmp, "twice.json"), "benchmarks.time_to_quality", "--smoke",
                  f"--merge={parts[0]},{parts[0]}")

  def test_a_run_of_an_arm_not_timed_yet_is_predicted_from_one_running(self):
    """Side by side, the first dense run still going: the next dense run is predicted from its
    logged steps (a budget must not start a run that cannot end within it), not from the
    shorter sparse run finished beside it."""
    import time  # pylint: disable=import-outside-toplevel
    wd = self.create_tempdir().full_path
    with open(os.path.join(wd, "metrics.jsonl"), "w") as f:
      for step in (1, 50, 100):
        f.write(json.dumps({"step": step, "wall_time": 0.0, "tokens_per_s": 1.0}) + "\n")
      f.write(json.dumps({"step": 100, "wall_time": 0.0, "eval/loss": 4.0}) + "\n")
    running = [{"arm": "dense", "workdir": wd, "t0": time.time() - 60.0, "steps": 250}]
    finished = [{"arm": "sparse", "wall_s": 100.0}]
    self.assertBetween(time_to_quality.predicted_s(finished, "dense", running), 150.0, 152.0)
    self.assertEqual(time_to_quality.predicted_s(finished, "sparse", running), 100.0)
    self.assertEqual(time_to_quality.predicted_s(finished, "dense"), 100.0)
    self.assertIsNone(time_to_quality.predicted_s([], "dense"))

  def test_a_stopped_command_leaves_no_run_behind(self):
    """SIGTERM (a time limit) while two runs train side by side: both are killed with it."""
    import signal  # pylint: disable=import-outside-toplevel
    import subprocess  # pylint: disable=import-outside-toplevel
    import sys  # pylint: disable=import-outside-toplevel
    import time  # pylint: disable=import-outside-toplevel
    tmp = self.create_tempdir().full_path
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.time_to_quality", "--smoke", "--seeds=0",
         f"--workdir={tmp}/runs", f"--out={tmp}/t.json", "--gpus=0,1", "--stagger_s=0"],
        cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    logs = [f"{tmp}/runs/0_dense.log", f"{tmp}/runs/0_sparse.log"]
    deadline = time.time() + 120
    while not all(os.path.exists(p) for p in logs) and time.time() < deadline:
      time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    self.assertEqual(proc.wait(timeout=60), 143)
    left = subprocess.run(["pgrep", "-f", "--", f"--workdir={tmp}/runs/"],
                          capture_output=True, text=True, check=False).stdout
    self.assertEqual(left, "")

  def test_ratios_over_seeds(self):
    """CE on an exact power law of time recovers dense's CE time; the interval is Student t."""
    a, runs = 0.1, []
    ce = lambda t: 10.0 * t ** -a
    for seed, (dense_s, sparse_s, sparse_t_s) in enumerate(
        [(300.0, 240.0, 310.0), (320.0, 250.0, 330.0), (310.0, 230.0, 300.0)]):
      for arm, wall in (("dense", dense_s), ("sparse", sparse_s), ("sparse_t", sparse_t_s)):
        # Sparse converges as if it had 1.2x the time: it reaches dense's CE at wall / 1.2.
        runs.append({"seed": seed, "arm": arm, "wall_s": wall, "steps": 1,
                     "eval_ce": ce(wall if arm == "dense" else wall * 1.2)})
    runs[0]["code"] = "abc"   # the runs that keep the digest of the code they ran
    results = {"runs": runs}
    time_to_quality.summarize(results)
    self.assertEqual(results["codes"], {"abc": 1, "unrecorded": 8})
    self.assertAlmostEqual(results["slope"], a)
    for row in results["per_seed"]:
      self.assertAlmostEqual(row["time_to_dense_ce_s"] * 1.2,
                             {0: 300.0, 1: 320.0, 2: 310.0}[row["seed"]])
    walls = [300 / 240, 320 / 250, 310 / 230]
    got = results["summary"]["wall_ratio"]
    self.assertAlmostEqual(got["mean"], np.mean(walls))
    half = 4.302653 * np.std(walls, ddof=1) / np.sqrt(3)     # t(0.975, 2)
    np.testing.assert_allclose(got["ci95"], [np.mean(walls) - half, np.mean(walls) + half],
                               rtol=1e-6)
    self.assertAlmostEqual(results["summary"]["time_to_dense_ce_ratio"]["mean"], 1.2)
    # Only sparse_t ends below dense's CE (at 1.2x its wall-clock it is past dense's): the
    # bound is dense's wall-clock over its.
    self.assertAlmostEqual(results["summary"]["time_to_dense_ce_ratio_at_least"]["mean"],
                           np.mean([300 / 310, 320 / 330, 310 / 300]))
    # Paired over the same held-out batches: a run 2% above dense on every batch has a ratio
    # of 1.02 with no error; batch-to-batch scatter gives one.
    base = {"evals": [{"batch_ce": [3.0, 4.0, 5.0, 6.0]}]}
    same = {"evals": [{"batch_ce": [1.02 * v for v in base["evals"][0]["batch_ce"]]}]}
    self.assertAlmostEqual(time_to_quality.paired_ratio_se(same, base), 0.0)
    noisy = {"evals": [{"batch_ce": [3.1, 3.9, 5.1, 5.9]}]}
    self.assertGreater(time_to_quality.paired_ratio_se(noisy, base), 0.01)
    self.assertIsNone(time_to_quality.paired_ratio_se(noisy, {"evals": [{}]}))

  def test_phases_per_arm_over_seeds(self):
    """Each arm's wall-clock cut at its first step and evaluations, averaged over seeds."""
    run = lambda seed, arm, first, evals, wall: {
        "seed": seed, "arm": arm, "steps": 1000, "wall_s": wall, "eval_ce": 4.0,
        "first_step_s": first, "evals": [{"step": s, "seconds": t} for s, t in evals]}
    results = {"runs": [run(0, "dense", 20.0, [(500, 80.0), (1000, 140.0)], 143.0),
                        run(1, "dense", 22.0, [(500, 84.0), (1000, 146.0)], 149.0),
                        run(0, "sparse", 15.0, [(500, 60.0), (1000, 100.0)], 102.0),
                        run(0, "sparse_t", 15.0, [(500, 60.0), (1400, 140.0)], 143.0)]}
    time_to_quality.summarize(results)
    got = {arm: [(label, v["mean"], v["n"]) for label, v in cut]
           for arm, cut in results["phases"].items()}
    self.assertEqual(got, {
        "dense": [("start", 21.0, 2), ("1-500", 61.0, 2), ("500-1000", 61.0, 2), ("end", 3.0, 2)],
        "sparse": [("start", 15.0, 1), ("1-500", 45.0, 1), ("500-1000", 40.0, 1), ("end", 2.0, 1)]})

  def test_equal_time_counts_the_evaluations_the_extra_steps_add(self):
    """10 steps/s and 50 s to spare: 500 more steps, but the evaluations at 2,600-3,000 take
    2 s each, so 400 steps and 4 evaluations (48 s) are what fit."""
    sparse = {"wall_s": 250.0, "points": [{"step": 2500, "seconds": 240.0,
                                           "tokens_per_s": 100.0}] * 5,
              "evals": [{"step": 2500, "seconds": 242.0}, {"step": 2400, "seconds": 0.0}]}
    self.assertEqual(time_to_quality.eval_seconds(sparse), 2.0)
    dense = {"wall_s": 300.0}
    self.assertEqual(time_to_quality.equal_time_steps(dense, sparse, 2500, 10, 100), 2900)
    self.assertEqual(time_to_quality.equal_time_steps(dense, sparse, 2500, 10, 0), 3000)
    self.assertEqual(time_to_quality.equal_time_steps({"wall_s": 240.0}, sparse, 2500, 10,
                                                      100), 2500)

  def test_levers_merge_by_lever_seed_arm_and_steps(self):
    run = lambda seed, arm, steps, wall, ce: {"seed": seed, "arm": arm, "steps": steps,
                                              "wall_s": wall, "eval_ce": ce, "evals": []}
    setting = {"device": "d", "steps": 100, "shape": "s", "eval_batches": 2}
    first = {**setting, "l1": 3e-5, "sparse_flags": [],
             "runs": [run(0, "dense", 100, 300.0, 4.0), run(0, "sparse_t", 150, 300.0, 4.2)]}
    table = time_to_quality.merge_levers(None, first)
    again = {**first, "runs": [first["runs"][0], run(0, "sparse_t", 150, 306.0, 4.1)]}
    other = {**setting, "l1": 2e-5, "sparse_flags": ["--config.dead_reinit=true"],
             "runs": [run(0, "dense", 100, 300.0, 4.0), run(0, "sparse_t", 140, 297.0, 3.8),
                      run(1, "dense", 100, 310.0, 4.4), run(1, "sparse_t", 140, 310.0, 4.0)]}
    table = time_to_quality.merge_levers(time_to_quality.merge_levers(table, again), other)
    self.assertEqual([(r["lever"], r["seed"], r["eval_ce"]) for r in table["rows"]],
                     [("l1=2e-05 --config.dead_reinit=true", 0, 3.8),
                      ("l1=2e-05 --config.dead_reinit=true", 1, 4.0), ("l1=3e-05", 0, 4.1)])
    # The same flags on another version of the code: another row, another lever.
    newer = {**first, "runs": [first["runs"][0], {**run(0, "sparse_t", 150, 290.0, 4.0),
                                                   "code": "abc"}]}
    table = time_to_quality.merge_levers(table, newer)
    self.assertEqual([(r["lever"], r["code"], r["eval_ce"]) for r in table["rows"]][2:],
                     [("l1=3e-05", "abc", 4.0), ("l1=3e-05", "unrecorded", 4.1)])
    (revived, plain, _) = sorted(table["levers"],
                                 key=lambda g: (g["lever"], g["code"] != "unrecorded"))
    self.assertEqual((revived["runs"], revived["seeds"]), (2, [0, 1]))
    self.assertAlmostEqual(revived["ce_over_dense"]["mean"], (3.8 / 4.0 + 4.0 / 4.4) / 2)
    self.assertAlmostEqual(plain["wall_over_dense"]["mean"], 306.0 / 300.0)

  def test_a_file_of_another_setting_is_refused_before_any_run(self):
    """--out, --dense_from and --levers_out must hold runs of the same setting: one of another
    L1 or device is named in the error, not mixed in (checked before the first run)."""
    with self.assertRaisesRegex(app.UsageError, "t.json holds runs with l1=3e-05, not 2e-05"):
      time_to_quality._check_setting({"l1": 3e-5, "steps": 2500}, {"l1": 2e-5, "steps": 2500},
                                     "t.json")
    with self.assertRaisesRegex(app.UsageError, "levers.json holds runs with device='A100'"):
      time_to_quality._check_setting({"device": "A100"}, {"device": "NVIDIA H200"},
                                     "levers.json")
    time_to_quality._check_setting({}, {"device": "NVIDIA H200"}, None)   # a new file

  def test_time_to_dense_ce_agrees_with_the_seeds_own_runs(self):
    """Where dense's CE lies between a seed's two sparse runs, the time is interpolated
    between them (the seed's own slope, not the pooled one); where both ended above it, it
    lies past the longer run's end; where both ended below, before the shorter run's."""
    run = lambda seed, arm, wall, ce: {"seed": seed, "arm": arm, "wall_s": wall, "steps": 1,
                                       "eval_ce": ce}
    results = {"runs": [
        # Seed 0: steep (slope log(4.0/3.6)/log(2)), brackets dense's 3.8.
        run(0, "dense", 300.0, 3.8), run(0, "sparse", 200.0, 4.0), run(0, "sparse_t", 400.0, 3.6),
        # Seed 1: shallow, both runs above dense's CE.
        run(1, "dense", 300.0, 3.8), run(1, "sparse", 250.0, 3.9), run(1, "sparse_t", 310.0, 3.88),
        # Seed 2: both below.
        run(2, "dense", 300.0, 3.8), run(2, "sparse", 240.0, 3.75), run(2, "sparse_t", 300.0, 3.7)]}
    time_to_quality.summarize(results)
    rows = {r["seed"]: r for r in results["per_seed"]}
    f = np.log(4.0 / 3.8) / np.log(4.0 / 3.6)
    self.assertAlmostEqual(rows[0]["time_to_dense_ce_s"], 200.0 * 2.0 ** f)
    self.assertGreater(rows[1]["time_to_dense_ce_s"], 310.0)
    self.assertAlmostEqual(rows[1]["time_to_dense_ce_s"],
                           310.0 * (3.88 / 3.8) ** (1 / results["slope"]))
    self.assertLess(rows[2]["time_to_dense_ce_s"], 240.0)
    self.assertGreater(results["slope"], 0)

  def test_a_seed_counts_in_the_ratios_its_runs_allow(self):
    """Dense and sparse_t alone (a lever screened at equal time) give the equal-time ratio
    only; a dense run alone gives no row but counts in the dense runs' spread."""
    run = lambda seed, arm, wall, ce: {"seed": seed, "arm": arm, "wall_s": wall, "steps": 1,
                                       "eval_ce": ce}
    results = {"runs": [run(0, "dense", 300.0, 4.0), run(0, "sparse_t", 290.0, 3.9),
                        run(1, "dense", 310.0, 4.2), run(1, "sparse", 240.0, 4.41),
                        run(2, "dense", 320.0, 4.4)]}
    time_to_quality.summarize(results)
    rows = {r["seed"]: r for r in results["per_seed"]}
    self.assertCountEqual(rows, [0, 1])
    self.assertIsNone(rows[0]["wall_ratio"])
    self.assertAlmostEqual(rows[0]["ce_ratio_equal_time"], 3.9 / 4.0)
    self.assertAlmostEqual(rows[1]["ce_ratio_equal_steps"], 4.41 / 4.2)
    self.assertIsNone(rows[1]["ce_ratio_equal_time"])
    self.assertIsNone(results["slope"])
    summary = results["summary"]
    self.assertEqual((summary["wall_ratio"]["n"], summary["ce_ratio_equal_time"]["n"]), (1, 1))
    self.assertEqual(summary["time_to_dense_ce_ratio"]["n"], 0)
    self.assertAlmostEqual(summary["dense_ce"]["mean"], 4.2)
    self.assertEqual(summary["dense_wall_s"]["n"], 3)


class TailColumnsTest(absltest.TestCase):

  def test_the_longest_column_outside_the_hot_features_in_fair_shares(self):
    active = np.zeros((64, 1024), bool)
    active[:, 0] = True           # hot
    active[:32, 1] = True         # the longest column outside K = 1
    active[np.arange(64), 2 + np.arange(64)] = True
    out = activity_sweep.tail_columns(active, 1)
    self.assertEqual(out["tail_per_token"], 1.5)
    self.assertEqual(out["longest_tail_column"], 32)
    # 96 entries over 1024 CTAs is under one entry each: a share counts as one entry.
    self.assertEqual(out["longest_over_share"], 32.0)


class ActivitySweepSmokeTest(absltest.TestCase):
  """`benchmarks.sweeps.activity_sweep --smoke`: a run's captured layers and the sweep points, each
  with the choice's K and the measured ratio."""

  def test_smoke(self):
    r = _run_module(os.path.join(self.create_tempdir().full_path, "a.json"),
                    "benchmarks.sweeps.activity_sweep", "--smoke", "--capture_steps=2",
                    "--actives=20", "--early=2:0", "--iters=1", "--profile_captures=2:1",
                    "--steps=40", "--stop_at_last_capture")
    self.assertEqual([c["step"] for c in r["captures"]], [2])
    self.assertEqual((r["steps"], r["schedule_steps"]), (2, 40))   # stopped at the capture
    self.assertLen(r["captures"][0]["layers"], 2)
    for layer in r["captures"][0]["layers"]:      # as trained, and sorted by this batch
      self.assertGreater(layer["sorted"]["ratio"], 0)
      self.assertGreaterEqual(layer["as_ordered"]["longest_over_share"], 0)
    self.assertEqual([("profile" in l) for l in r["captures"][0]["layers"]], [False, True])
    self.assertEqual(set(r["captures"][0]["layers"][1]["profile"]), {"sparse", "dense"})
    self.assertEqual(sorted(p["skew"] for p in r["sweep"]), ["early", "last_layer"])
    for p in r["sweep"] + r["captures"][0]["layers"]:
      self.assertAlmostEqual(p["ratio"], p["sparse_ms"] / p["dense_ms"])
      self.assertAlmostEqual(p["pipelined_ratio"],
                             p["sparse_pipelined_ms"] / p["dense_pipelined_ms"])

  def test_smoke_on_saved_skews(self):
    """`--skews_from`: no training run; `--scan_hot` times more K at the last layer's points,
    each beside its floor, and the chosen K is among them with the point's own ratio."""
    saved = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", "h200",
                         "activity_sweep.json")
    r = _run_module(os.path.join(self.create_tempdir().full_path, "a.json"),
                    "benchmarks.sweeps.activity_sweep", "--smoke", f"--skews_from={saved}",
                    "--actives=20", "--scan_hot=0", "--profile_active=20", "--iters=1")
    self.assertNotIn("captures", r)
    self.assertEqual(sorted(p["skew"] for p in r["sweep"]), ["early", "last_layer"])
    last = next(p for p in r["sweep"] if p["skew"] == "last_layer")
    early = next(p for p in r["sweep"] if p["skew"] == "early")
    self.assertNotIn("k_scan", early)
    scanned = {s["hot_features"]: s for s in last["k_scan"]}
    self.assertIn(0, scanned)
    self.assertEqual(scanned[last["hot_features"]]["ratio"], last["ratio"])
    for s in last["k_scan"]:
      self.assertGreater(s["floor_ratio"], 0)
      self.assertAlmostEqual(s["ratio"], s["sparse_ms"] / last["dense_ms"])
    self.assertIn("profile", last)   # empty where CUPTI is unavailable (this CPU)
    for p in r["sweep"]:
      self.assertLessEqual(p["floors"]["entries"]["ratio"], p["floors"]["kernels"]["ratio"])


class SavedSkewsTest(absltest.TestCase):

  def test_a_file_without_fitted_skews_is_refused_by_name(self):
    path = os.path.join(self.create_tempdir().full_path, "whole_run.json")
    with open(path, "w") as f:
      json.dump({"device": "NVIDIA H100", "runs": []}, f)
    with self.assertRaisesRegex(ValueError, "whole_run.json holds no fitted skews"):
      activity_sweep.saved_skews(path)


class FloorTest(absltest.TestCase):
  """`activity_sweep.floor_ms`: dense's nine GEMMs against the gate's one and K's eight."""

  def test_all_hot_is_dense_and_rows_add_linearly(self):
    m, d, h = 16384, 2048, 5632
    dense = 9 * 2 * m * d * h / activity_sweep.GEMM_FLOP_PER_S * 1e3
    self.assertAlmostEqual(activity_sweep.floor_ms(m, d, h, h, 0.0), dense)
    self.assertAlmostEqual(activity_sweep.floor_ms(m, d, h, 0, 0.0), dense / 9)
    one_row = activity_sweep.floor_ms(m, d, h, 0, 1.0) - activity_sweep.floor_ms(m, d, h, 0, 0.0)
    self.assertAlmostEqual(one_row, 6 * m * d * 2 / activity_sweep.ROW_BYTES_PER_S * 1e3)


class BestFloorsTest(absltest.TestCase):
  """`activity_sweep.best_floors`: the kernels' best K and dense rows, the tile bound and the
  FLOP bound, each over dense's nine GEMMs."""

  D = 2048

  def test_empty_and_full_activity(self):
    empty = activity_sweep.best_floors(np.zeros((256, 512), bool), self.D)
    for key in ("kernels", "blocks", "entries"):
      self.assertAlmostEqual(empty[key]["ratio"], 1 / 9)
    self.assertEqual(empty["kernels"]["hot_features"], 0)
    full = activity_sweep.best_floors(np.ones((256, 512), bool), self.D)
    for key in ("kernels", "blocks", "entries"):
      self.assertAlmostEqual(full[key]["ratio"], 1.0)

  def test_features_on_every_token_become_hot(self):
    """128 features on every token: as hot columns they cost less than as row reads (76
    GEMM columns an entry) or as dense rows of all 512 features."""
    active = np.zeros((256, 512), bool)
    active[:, :128] = True
    f = activity_sweep.best_floors(active, self.D, step=128)
    self.assertEqual((f["kernels"]["hot_features"], f["kernels"]["dense_rows"]), (128, 0))
    self.assertAlmostEqual(f["kernels"]["ratio"], (512 + 8 * 128) / (9 * 512))
    self.assertAlmostEqual(f["entries"]["ratio"], (512 + 8 * 128) / (9 * 512))
    self.assertAlmostEqual(f["blocks"]["nonzero_tiles"], 0.25)   # one of four feature tiles
    one = np.zeros((256, 512), bool)
    one[:, 0] = True              # one entry a token: a row read beats 128 hot columns
    self.assertEqual(activity_sweep.best_floors(one, self.D)["kernels"]["hot_features"], 0)

  def test_heavy_rows_go_dense(self):
    """Tokens with every feature active: cheaper as dense rows than as 512 row reads each."""
    active = np.zeros((256, 512), bool)
    active[:16] = True
    active[16:, 200] = True       # one entry per light token: stays a row read (76 > 1)
    f = activity_sweep.best_floors(active, self.D, step=128)
    self.assertEqual((f["kernels"]["hot_features"], f["kernels"]["dense_rows"]), (0, 16))
    gemm = 2 * self.D / activity_sweep.GEMM_FLOP_PER_S
    row = activity_sweep.ROW_PASSES * self.D * 2 / activity_sweep.ROW_BYTES_PER_S
    expected = (gemm * 256 * 512 + 16 * 8 * gemm * 512 + 240 * row) / (9 * gemm * 256 * 512)
    self.assertAlmostEqual(f["kernels"]["ratio"], expected)
    self.assertAlmostEqual(f["row_over_gemm"], row / (8 * gemm))


class DataPipelineSmokeTest(absltest.TestCase):
  """`benchmarks.data_pipeline --smoke`: parquet shards through the packer with a
  tokenizer.json, in the packer's thread and in worker processes, one cell each."""

  def test_smoke(self):
    r = _run_module(os.path.join(self.create_tempdir().full_path, "d.json"),
                    "benchmarks.data_pipeline", "--smoke", "--tokenizers=hf", "--max_docs=300",
                    "--seq_len=255", "--workers=0,2")
    self.assertEqual(r["format"], "parquet")
    self.assertEqual([c["workers"] for c in r["cells"]], [0, 2])
    for c in r["cells"]:
      self.assertGreater(c["batches"], 0)
      # "seconds" is rounded to 10 ms in the JSON
      self.assertAlmostEqual(c["tokens_per_s"] * c["seconds"] / (c["batches"] * 8 * 256), 1,
                             delta=0.02)


if __name__ == "__main__":
  absltest.main()
