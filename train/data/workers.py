"""Tokenizing worker processes: lists of texts in, lists of int32 id arrays out, in order.

`EncoderPool(tokenizer, n)` starts n worker processes (`python -m train.data.workers`, each a
plain interpreter importing numpy and the tokenizer's library, not JAX or the trainer) and
sends each the pickled tokenizer (a file path; `train.data.tokenizer`). `submit(texts)` hands
one task to the next worker in turn and returns a `Future` of its arrays; a thread per worker
writes the task and reads the answer, so one worker's work never waits on another's pipe.
The packer (`pipeline.PackedBatches`) keeps a few tasks per worker in flight and takes the
results in the order it submitted them, so the token stream is the same at any worker count.

Why processes started this way and not `multiprocessing`: its spawn and forkserver children
import the parent's `__main__` (the trainer: JAX and all), and fork copies a multithreaded
process holding a GPU context.
"""

import concurrent.futures
import os
import pickle
import queue
import struct
import subprocess
import sys
import threading

from train.data import tokenizer as tokenizer_lib

_HEADER = struct.Struct("<Q")


def _send(stream, obj) -> None:
  data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
  stream.write(_HEADER.pack(len(data)))
  stream.write(data)
  stream.flush()


def _receive(stream):
  head = stream.read(_HEADER.size)
  if len(head) < _HEADER.size:
    raise EOFError
  (n,) = _HEADER.unpack(head)
  data = stream.read(n)
  if len(data) < n:
    raise EOFError
  return pickle.loads(data)


class WorkerError(RuntimeError):
  """A tokenizing worker failed; the message carries its error."""


class _Worker:
  """One worker process and the thread that talks to it."""

  def __init__(self, tokenizer, index: int):
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    self.proc = subprocess.Popen(
        [sys.executable, "-m", "train.data.workers"], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, env=env)
    self.index = index
    self.closing = False
    self.tasks: queue.Queue = queue.Queue()
    _send(self.proc.stdin, tokenizer)
    self.thread = threading.Thread(target=self._run, daemon=True,
                                   name=f"tokenize-worker-{index}")
    self.thread.start()

  def _run(self):
    while True:
      item = self.tasks.get()
      if item is None or self.closing:
        return
      texts, future = item
      if not future.set_running_or_notify_cancel():
        continue
      try:
        _send(self.proc.stdin, texts)
        ok, value = _receive(self.proc.stdout)
      except (EOFError, OSError, ValueError):  # ValueError: the pipe closed under us
        future.set_exception(WorkerError(
            f"tokenizing worker {self.index} exited (status {self.proc.poll()})"))
        continue
      if ok:
        future.set_result(value)
      else:
        future.set_exception(WorkerError(f"tokenizing worker {self.index}: {value}"))

  def stop(self):
    """Cancels the queued tasks and lets the task in progress finish (`finish` waits)."""
    self.closing = True
    while True:
      try:
        item = self.tasks.get_nowait()
      except queue.Empty:
        break
      if item is not None:
        item[1].cancel()
    self.tasks.put(None)

  def finish(self):
    """After `stop`: waits for the task in progress, then for the process to exit once its
    input closes."""
    self.thread.join(timeout=30)
    try:
      self.proc.stdin.close()
    except OSError:
      pass

  def reap(self):
    try:
      self.proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
      self.proc.kill()
      self.proc.wait()


class EncoderPool:
  """`n` worker processes tokenizing with `tokenizer` (module docstring)."""

  def __init__(self, tokenizer, n: int):
    if n < 1:
      raise ValueError(f"EncoderPool needs at least one worker, got {n}")
    self._workers = [_Worker(tokenizer, i) for i in range(n)]
    self._next = 0

  def __len__(self):
    return len(self._workers)

  def submit(self, texts: list) -> concurrent.futures.Future:
    future = concurrent.futures.Future()
    self._workers[self._next].tasks.put((texts, future))
    self._next = (self._next + 1) % len(self._workers)
    return future

  def close(self):
    # Every worker is told first and reaped last, so their exits overlap (8 SentencePiece
    # workers on 2 cores: 0.15 s, against 0.22-0.26 s one after another).
    for w in self._workers:
      w.stop()
    for w in self._workers:
      w.finish()
    for w in self._workers:
      w.reap()


def auto_count(data_cfg) -> int:
  """`data.workers`, with -1 resolved: none for the byte tokenizer (cheaper than a pipe),
  else half the CPU cores (the rest run the trainer, XLA and the reading), at most 16."""
  n = int(data_cfg.get("workers", -1))
  if n >= 0:
    return n
  if data_cfg.tokenizer == "byte":
    return 0
  return max(1, min(16, (os.cpu_count() or 2) // 2))


def _serve() -> None:
  """The worker's loop: a tokenizer, then tasks until its input closes."""
  stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
  sys.stdout = sys.stderr  # a library printing must not corrupt the answers
  try:
    tokenizer = _receive(stdin)
  except EOFError:
    return
  while True:
    try:
      texts = _receive(stdin)
    except EOFError:
      return
    try:
      answer = (True, tokenizer_lib.encode_many(tokenizer, texts))
    except Exception as e:  # pylint: disable=broad-except
      answer = (False, f"{type(e).__name__}: {e}")
    _send(stdout, answer)


if __name__ == "__main__":
  _serve()
