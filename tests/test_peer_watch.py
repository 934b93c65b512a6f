"""The watch that ends every process of a multi-process run when one is lost or fails
(`train.runtime.peer_watch`), on an in-memory key-value store and a hand-moved clock."""

import os
import subprocess
import sys
import threading

from absl.testing import absltest

from train.runtime import peer_watch as pw


class FakeStore:
  """The key-value methods of jax's distributed runtime client, in memory; `down` makes every
  call fail as when the coordination service's process is gone."""

  def __init__(self):
    self.kv, self.down = {}, False
    self.cond = threading.Condition()

  def _check(self):
    if self.down:
      raise RuntimeError("UNAVAILABLE: Failed to connect to remote host: Connection refused")

  def key_value_set(self, key, value, allow_overwrite=False):
    self._check()
    with self.cond:
      if key in self.kv and not allow_overwrite:
        raise RuntimeError(f"ALREADY_EXISTS: {key}")
      self.kv[key] = value
      self.cond.notify_all()

  def key_value_dir_get(self, prefix):
    self._check()
    return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]

  def blocking_key_value_get(self, key, timeout_in_ms):
    self._check()
    with self.cond:
      if not self.cond.wait_for(lambda: key in self.kv, timeout_in_ms / 1000):
        raise RuntimeError(f"DEADLINE_EXCEEDED: GetKeyValue() timed out with key: {key}")
      return self.kv[key]


class Clock:
  def __init__(self):
    self.t = 100.0

  def __call__(self):
    return self.t


def _watches(store, clock, n=3, timeout_s=10.0):
  verdicts = {}
  watches = [pw.PeerWatch(store, i, n, timeout_s=timeout_s, interval_s=0.05, clock=clock,
                          act=lambda v, i=i: verdicts.setdefault(i, v)) for i in range(n)]
  return watches, verdicts


class PeerWatchTest(absltest.TestCase):

  def test_a_silent_peer_is_lost_after_the_timeout_and_the_verdict_is_shared(self):
    store, clock = FakeStore(), Clock()
    (w0, w1, w2), _ = _watches(store, clock)
    for _ in range(3):        # everyone beats; nobody is judged
      clock.t += 4
      self.assertIsNone(w0.check())
      self.assertIsNone(w1.check())
      self.assertIsNone(w2.check())
    # Process 2 stops beating. Silence counts from when process 0 first saw its last beat.
    for dt in (4, 6):         # 6 s of silence: not yet lost
      clock.t += dt
      self.assertIsNone(w1.check())
      self.assertIsNone(w0.check())
    clock.t += 5              # 11 s
    v = w0.check()
    self.assertEqual(v.code, pw.LOST_EXIT_CODE)
    self.assertIn("lost process 2 of 3 silent for 11 s", v.line)
    self.assertIn("process 0 stops too", v.line)
    self.assertIn("resumes from its last committed checkpoint", v.line)
    self.assertEqual(store.kv[pw.PREFIX + "lost"], "2 11.0 0")
    # Process 1 reads the published verdict, naming who saw it, without judging on its own.
    v1 = w1.wait()
    self.assertIn("lost process 2 of 3 silent for 11 s (seen by process 0)", v1.line)
    self.assertIn("process 1 stops too", v1.line)
    self.assertEqual(w1.check().line, v1.line)

  def test_the_coordinator_named_as_such(self):
    store, clock = FakeStore(), Clock()
    _, w1 = _watches(store, clock, n=2)[0]
    self.assertIsNone(w1.check())
    clock.t += 30
    self.assertIn("lost process 0 of 2, the coordinator, silent for 30 s", w1.check().line)

  def test_a_peer_that_ended_is_not_judged_and_one_that_failed_stops_the_others(self):
    store, clock = FakeStore(), Clock()
    (w0, w1, w2), _ = _watches(store, clock)
    w2.stop(failed=False)     # process 2 finished: its silence does not count
    for _ in range(15):
      clock.t += 4
      self.assertIsNone(w0.check())
      self.assertIsNone(w1.check())
    w0.stop(failed=True)
    v = w1.check()
    self.assertEqual(v.code, pw.FAILED_EXIT_CODE)
    self.assertIn("process 0 of 3 stopped with an error (see its log); process 1 stops too",
                  v.line)

  def test_a_vanished_service_means_process_0_is_gone(self):
    store, clock = FakeStore(), Clock()
    _, w1 = _watches(store, clock, n=2)[0]
    self.assertIsNone(w1.wait())    # a deadline: nothing published
    store.down = True
    for v in (w1.wait(), w1.check()):
      self.assertEqual(v.code, pw.LOST_EXIT_CODE)
      self.assertIn("lost process 0 of 2, the coordinator: its coordination service stopped "
                    "answering (UNAVAILABLE: Failed to connect", v.line)

  def test_the_thread_acts_once_and_a_stopped_watch_never(self):
    store = FakeStore()
    (w0, w1), verdicts = _watches(store, Clock(), n=2)
    w1.start()
    store.key_value_set(pw.PREFIX + "lost", "0 21.0 0")
    self.assertTrue(w1.await_verdict(5))
    self.assertIn("lost process 0 of 2", verdicts[1].line)
    w0.stop(failed=False)
    w0._decide(pw.Verdict("error: x", 75))   # after stop: ignored
    self.assertNotIn(0, verdicts)

  def test_await_returns_when_every_peer_has_ended_or_errs_too(self):
    store, clock = FakeStore(), Clock()
    (w0, w1, w2), _ = _watches(store, clock)
    w1.stop(failed=True)
    w2.await_verdict(0)                      # process 2 hit an error too
    self.assertIn(pw.PREFIX + "erring/2", store.kv)
    self.assertFalse(w0.await_verdict(30))   # returns at once, not after 30 s

  def test_bad_settings(self):
    with self.assertRaisesRegex(ValueError, "timeout_s=1.0 must exceed interval_s=1.0"):
      pw.PeerWatch(FakeStore(), 0, 2, timeout_s=1.0)


class TimeoutFlagTest(absltest.TestCase):

  def test_a_timeout_below_the_check_interval_is_refused(self):
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "train.main", "--config=configs/tiny.py",
                        f"--workdir={self.create_tempdir().full_path}", "--peer_timeout_s=0.5"],
                       cwd=repo, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
    self.assertNotEqual(r.returncode, 0)
    self.assertIn("flag --peer_timeout_s=0.5: --peer_timeout_s must be 0 (off) or more than 1 s",
                  r.stderr)


if __name__ == "__main__":
  absltest.main()
