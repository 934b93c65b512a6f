"""The one timer of the benchmarks: wall clock of synchronized calls, CUPTI device time.

* ``wall_ms``: median wall-clock ms of synchronized calls after warm-up (what a caller waits).
* ``device_ms``: median device time of one call, all its kernels summed (mosaic's CUPTI
  profiler), or None where CUPTI is unavailable.
* ``pipelined_ms``: ms per call of back-to-back calls with one final sync (host dispatch
  overlaps the device, as in a training loop; host syncs inside the call still show), the
  median of several rounds.
* ``kernel_breakdown``: per-kernel device time in launch order.
* ``trace_breakdown``: a ``jax.profiler`` trace's first GPU, per step: the span, each
  stream's busy time, the idle time, collective (NCCL) time and the part of it no compute
  kernel hides, and the largest kernels by total time (works for programs of several
  devices, where CUPTI's ``kernel_breakdown`` does not).
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import statistics
import time

import jax


def wall_ms(f, *args, iters: int) -> float:
  jax.block_until_ready(f(*args))
  jax.block_until_ready(f(*args))
  ts = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    ts.append((time.perf_counter() - t0) * 1e3)
  return statistics.median(ts)


def synced_steps_ms(step, state, batch, *, iters: int, warmup: int = 2):
  """Wall ms of each of `iters` calls `state, metrics = step(state, batch)`, each waited for,
  after `warmup` calls: (ms list, state, the last metrics)."""
  m = None
  for _ in range(warmup):
    state, m = step(state, batch)
  jax.block_until_ready(state)
  ms = []
  for _ in range(iters):
    t0 = time.perf_counter()
    state, m = step(state, batch)
    jax.block_until_ready(state)
    ms.append((time.perf_counter() - t0) * 1e3)
  return ms, state, m


def device_ms(f, *args, iterations: int = 10) -> float | None:
  from jax.experimental.mosaic.gpu import profiler  # pylint: disable=import-outside-toplevel
  try:
    try:
      _, rt = profiler.measure(f, iterations=iterations)(*args)
    except RuntimeError as e:
      if "not consistent" not in str(e):
        raise
      # A conditional's branches launch different kernels from call to call: one call per
      # measurement.
      rt = [profiler.measure(f, iterations=1)(*args)[1] for _ in range(iterations)]
      rt = [t if not isinstance(t, list) else t[0] for t in rt]
  except Exception as e:  # pylint: disable=broad-except  # CUPTI may be unavailable
    print(f"  (profiler.measure failed: {type(e).__name__}: {str(e)[:200]})")
    return None
  if rt is None:
    return None
  return statistics.median(rt) if isinstance(rt, list) else float(rt)


def pipelined_ms(f, *args, iters: int, rounds: int = 5, carry: bool = False):
  """Median over ``rounds`` of the mean ms per call of ``iters`` back-to-back calls (one round
  alone moves by a few percent with the host's scheduling).

  ``carry``: ``f`` is a step ``(state, *rest) -> (state, ...)`` that may donate its state;
  each call takes the state the last one returned, and ``(ms, last state)`` is returned.
  """
  args = list(args)
  if not carry:
    jax.block_until_ready(f(*args))
  per_call = []
  for _ in range(rounds):
    t0 = time.perf_counter()
    outs = []
    for _ in range(iters):
      outs.append(f(*args))
      if carry:
        args[0], outs = outs[-1][0], []
    jax.block_until_ready(args[0] if carry else outs)
    per_call.append((time.perf_counter() - t0) * 1e3 / iters)
  ms = statistics.median(per_call)
  return (ms, args[0]) if carry else ms


def kernel_breakdown(f, *args, iterations: int = 5) -> list[tuple[str, float]] | None:
  """[(kernel name, median ms)] of one call, or None where CUPTI is unavailable. Calls whose
  kernels differ between iterations (a conditional's branches, command buffers) are measured
  once."""
  from jax.experimental.mosaic.gpu import profiler  # pylint: disable=import-outside-toplevel
  try:
    try:
      _, per_iter = profiler.measure(f, aggregate=False, iterations=iterations)(*args)
    except RuntimeError as e:
      if "not consistent" not in str(e):
        raise
      iterations = 1
      _, per_iter = profiler.measure(f, aggregate=False, iterations=1)(*args)
  except Exception as e:  # pylint: disable=broad-except
    print(f"  (kernel_breakdown failed: {type(e).__name__}: {str(e)[:200]})")
    return None
  if not per_iter:
    return None
  if iterations == 1:
    per_iter = [per_iter]
  return [(name, statistics.median(it[i][1] for it in per_iter))
          for i, (name, _) in enumerate(per_iter[0])]


def summarize_breakdown(label: str, table, top: int = 12) -> dict:
  """Prints the largest kernels of a breakdown; returns {"kernels", "kernel_sum_ms"}."""
  if not table:
    return {}
  total = sum(t for _, t in table)
  print(f"  {label}: {len(table)} kernels, {total:.3f} ms device time")
  merged: dict[str, float] = {}
  for name, t in table:
    merged[name] = merged.get(name, 0.0) + t
  for name, t in sorted(merged.items(), key=lambda kv: -kv[1])[:top]:
    print(f"    {t:8.4f} ms  {name[:90]}")
  return {"kernels": [[n, t] for n, t in table], "kernel_sum_ms": total}


def kernel_kind(name: str) -> str:
  """The kind of a GPU kernel by its name: the sparse FFN kernels, cuDNN attention, GEMMs or
  the rest."""
  n = name.lower()
  if "twell" in n or "mosaic" in n:
    return "sparse FFN kernels"
  if "cudnn" in n or "flash" in n or "fmha" in n or "sdpa" in n:
    return "attention (cuDNN)"
  if any(k in n for k in ("gemm", "xmma", "nvjet", "cutlass", "sm90", "triton_gemm")):
    return "GEMMs"
  return "other (fusions, copies, reductions)"


def by_kind(table) -> dict[str, float]:
  """{kind: ms} of a `kernel_breakdown` table (`kernel_kind`); {} for None."""
  kinds: dict[str, float] = {}
  for name, t in table or ():
    kinds[kernel_kind(name)] = kinds.get(kernel_kind(name), 0.0) + t
  return kinds


def _union(intervals) -> list[tuple[float, float]]:
  out = []
  for a, b in sorted(intervals):
    if out and a <= out[-1][1]:
      out[-1] = (out[-1][0], max(out[-1][1], b))
    else:
      out.append((a, b))
  return out


def _length(intervals) -> float:
  return sum(b - a for a, b in intervals)


def trace_breakdown(trace_dir: str, steps: int, top: int = 12) -> dict | None:
  """Per step of the `steps` steps traced into `trace_dir` (`jax.profiler.trace` with
  `create_perfetto_trace=True`), on the first GPU: {"span_ms" (first kernel start to last
  end), "idle_ms" (no kernel running), "collective_ms" (NCCL kernels' time, summed),
  "exposed_collective_ms" (NCCL kernels running while no other kernel does), "compute_ms"
  (time some other kernel runs), "busy_ms_by_stream", "kernels": [[name, ms]] (the `top`
  largest; names with their numeric suffixes merged)}; None without a trace of a GPU."""
  paths = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
  if not paths:
    return None
  with gzip.open(max(paths, key=os.path.getmtime)) as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  gpu = [e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
         and e.get("args", {}).get("name", "").startswith("/device:GPU:")]
  if not gpu:
    return None
  kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") == min(gpu)]
  if not kernels:
    return None
  by_name, by_stream = collections.Counter(), collections.Counter()
  for e in kernels:
    by_name[re.sub(r"[._]\d+$", "", e["name"].split("(")[0])] += e["dur"]
    by_stream[str(e["tid"])] += e["dur"]
  start = min(e["ts"] for e in kernels)
  end = max(e["ts"] + e["dur"] for e in kernels)
  per = lambda us: us / 1e3 / steps
  span = lambda e: (e["ts"], e["ts"] + e["dur"])
  is_nccl = lambda e: "nccl" in e["name"].lower()
  busy = _length(_union(span(e) for e in kernels))
  compute = _length(_union(span(e) for e in kernels if not is_nccl(e)))
  return {"span_ms": per(end - start),
          "idle_ms": per(end - start - busy),
          "collective_ms": per(sum(e["dur"] for e in kernels if is_nccl(e))),
          "exposed_collective_ms": per(busy - compute),   # busy with collectives alone
          "compute_ms": per(compute),
          "busy_ms_by_stream": {k: per(v) for k, v in by_stream.most_common()},
          "kernels": [[k, per(v)] for k, v in by_name.most_common(top)]}


def peak_bytes(compiled) -> int:
  """XLA's peak device memory of a compiled program: its temporaries, arguments and outputs,
  less the outputs aliased onto donated arguments."""
  mem = compiled.memory_analysis()
  return int(mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes
             - mem.alias_size_in_bytes)
