"""Metric sinks (TensorBoard events, JSON lines, console) and progress/ETA.

TensorBoard event files are written with the `tensorboard` package alone
(`EventFileWriter` + the protos in `tensorboard.compat.proto`), so neither
TensorFlow nor clu is needed. Every logged interval also appends one JSON
object to DIR/metrics.jsonl ("step", "wall_time" and the scalars), which is what scripts and
tests read, and so does every event the trainer records ("step", "wall_time", "event" and its
fields: a per-layer FFN choice decided, one landing, the held-out batches' losses; `events`). Only process 0 writes; other
processes log to the console only.
"""

import json
import os
import time
from typing import Any

from absl import logging
import numpy as np


def flatten_metrics(metrics: dict) -> dict[str, float]:
  """{"nnz": [L] array, "loss": scalar} -> {"nnz/layer_0": .., "loss": ..}."""
  out = {}
  for k, v in metrics.items():
    a = np.asarray(v)
    if a.ndim == 0:
      out[k] = float(a)
    else:
      for i, x in enumerate(a.reshape(-1)):
        out[f"{k}/layer_{i}"] = float(x)
  return out


def read_jsonl(workdir: str) -> list[dict]:
  """The rows of DIR/metrics.jsonl in order ([] when there is none). A line cut short by a
  crash mid-write is skipped."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.isfile(path):
    return []
  rows = []
  with open(path) as f:
    for line in f:
      try:
        rows.append(json.loads(line))
      except ValueError:
        continue
  return rows


def events(rows: list[dict], name: str) -> list[dict]:
  """The rows of `read_jsonl` recording event `name`, in order."""
  return [r for r in rows if r.get("event") == name]


def _histogram_proto(summary_pb2, values, bins: int = 30):
  """A TensorBoard HistogramProto of `values` (numpy bins over their range)."""
  v = np.asarray(values, np.float64).reshape(-1)
  if v.size == 0:
    v = np.zeros(1)
  counts, edges = np.histogram(v, bins=bins)
  return summary_pb2.HistogramProto(
      min=float(v.min()), max=float(v.max()), num=float(v.size), sum=float(v.sum()),
      sum_squares=float(np.sum(v * v)), bucket_limit=[float(e) for e in edges[1:]],
      bucket=[float(c) for c in counts])


class MetricWriter:
  """Writes scalar dicts to TensorBoard and DIR/metrics.jsonl."""

  def __init__(self, logdir: str, *, enabled: bool = True):
    self._enabled = enabled
    self._tb = None
    self._jsonl = None
    if not enabled:
      return
    os.makedirs(logdir, exist_ok=True)
    self._jsonl = open(os.path.join(logdir, "metrics.jsonl"), "a")
    try:
      # pylint: disable=g-import-not-at-top
      from tensorboard.summary.writer import event_file_writer
      from tensorboard.compat.proto import event_pb2, summary_pb2
      self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2
      self._tb = event_file_writer.EventFileWriter(
          os.path.join(logdir, "tensorboard"))
    except ImportError:
      logging.warning("tensorboard is not installed: no event files.")

  def write_scalars(self, step: int, scalars: dict[str, float]):
    if not self._enabled:
      return
    # wall_time (seconds since the epoch): when the row was written, for curves against time.
    self._jsonl.write(json.dumps({"step": int(step), "wall_time": round(time.time(), 3),
                                  **scalars}) + "\n")
    self._jsonl.flush()
    if self._tb is not None:
      values = [self._summary_pb2.Summary.Value(tag=k, simple_value=v)
                for k, v in scalars.items()]
      self._tb.add_event(self._event_pb2.Event(
          wall_time=time.time(), step=int(step),
          summary=self._summary_pb2.Summary(value=values)))

  def write_event(self, step: int, event: str, **fields):
    """One event (metrics.jsonl only): {"step", "wall_time", "event": event, **fields}."""
    if not self._enabled:
      return
    self._jsonl.write(json.dumps({"step": int(step), "wall_time": round(time.time(), 3),
                                  "event": event, **fields}) + "\n")
    self._jsonl.flush()

  def write_histograms(self, step: int, histograms: dict[str, Any], bins: int = 30):
    """Histograms of value arrays (TensorBoard's histogram tab); not in metrics.jsonl."""
    if self._tb is None:
      return
    values = [self._summary_pb2.Summary.Value(
        tag=k, histo=_histogram_proto(self._summary_pb2, v, bins)) for k, v in histograms.items()]
    self._tb.add_event(self._event_pb2.Event(
        wall_time=time.time(), step=int(step), summary=self._summary_pb2.Summary(value=values)))

  def write_text(self, step: int, tag: str, text: str):
    """A text summary (shown in TensorBoard's text tab)."""
    if self._tb is None:
      return
    # The text plugin reads a string tensor tagged with its plugin name.
    from tensorboard.compat.proto import tensor_pb2, tensor_shape_pb2  # pylint: disable=g-import-not-at-top
    tensor = tensor_pb2.TensorProto(
        dtype=7, string_val=[text.encode()],  # 7 = DT_STRING
        tensor_shape=tensor_shape_pb2.TensorShapeProto())
    meta = self._summary_pb2.SummaryMetadata(
        plugin_data=self._summary_pb2.SummaryMetadata.PluginData(
            plugin_name="text"))
    self._tb.add_event(self._event_pb2.Event(
        wall_time=time.time(), step=int(step),
        summary=self._summary_pb2.Summary(value=[self._summary_pb2.Summary.Value(
            tag=tag, tensor=tensor, metadata=meta)])))

  def flush(self):
    if self._tb is not None:
      self._tb.flush()

  def close(self):
    if self._tb is not None:
      self._tb.close()
    if self._jsonl is not None:
      self._jsonl.close()


class Progress:
  """Steps/s and ETA over the steps done in this process (resume-aware)."""

  def __init__(self, total_steps: int, start_step: int):
    self.total, self.start = total_steps, start_step
    self.t0 = time.time()

  def eta_line(self, step: int) -> str:
    done = step - self.start
    elapsed = time.time() - self.t0
    rate = done / elapsed if elapsed > 0 and done > 0 else 0.0
    left = (self.total - step) / rate if rate > 0 else float("nan")
    pct = 100.0 * step / max(1, self.total)
    return (f"step {step}/{self.total} ({pct:.1f}%) {rate:.2f} steps/s "
            f"elapsed {_hms(elapsed)} ETA {_hms(left)}")


def _hms(seconds: float) -> str:
  if not np.isfinite(seconds):
    return "?"
  s = int(seconds)
  return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class _DropNoisyLibraries:
  """absl logging filter: hides orbax's per-save INFO chatter."""

  def filter(self, record) -> bool:
    return (record.levelno >= 30 or
            "orbax" not in getattr(record, "pathname", ""))


def quiet_library_logs():
  """Keeps console progress readable: orbax logs only warnings and up."""
  import logging as py_logging  # pylint: disable=g-import-not-at-top
  from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
  absl_logging.get_absl_handler().addFilter(_DropNoisyLibraries())
  py_logging.getLogger("absl").addFilter(_DropNoisyLibraries())
