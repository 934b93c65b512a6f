"""train.models.embedding: the lookup's gradient (a blocked segment sum) against an f32 scatter-add."""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from train.models import embedding


def _reference(ids, rows, v):
  """f32 sums per id, in float64 on the host (ids outside [0, v) dropped)."""
  out = np.zeros((v, rows.shape[1]), np.float64)
  ok = (ids >= 0) & (ids < v)
  np.add.at(out, ids[ok], np.asarray(rows, np.float64)[ok])
  return out


def _skewed_ids(rng, n, v):
  """Text-like ids: a few ids take most tokens (one 30%), many appear once or never."""
  p = 1.0 / np.arange(1, v + 1) ** 1.1
  p[7] = p.sum() * 0.45           # a hot id that is not the smallest
  return rng.choice(v, size=n, p=p / p.sum()).astype(np.int32)


class SegmentSumTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("skewed", "skewed", 1000, 300, 32),
      ("one_id", "one", 517, 50, 16),          # a single run spanning every block
      ("all_distinct", "distinct", 256, 300, 8),
      ("not_a_block_multiple", "skewed", 131, 40, 24),
      ("fewer_than_a_block", "skewed", 5, 40, 8),
      ("out_of_range", "invalid", 400, 30, 8),
  )
  def test_equals_scatter_add(self, kind, n, v, d):
    rng = np.random.default_rng(n + v)
    if kind == "skewed":
      ids = _skewed_ids(rng, n, v)
    elif kind == "one":
      ids = np.full(n, 3, np.int32)
    elif kind == "distinct":
      ids = rng.permutation(v)[:n].astype(np.int32)
    else:
      ids = rng.integers(-5, v + 5, n).astype(np.int32)
    rows = rng.standard_normal((n, d)).astype(np.float32)
    got = np.asarray(embedding.segment_sum(jnp.asarray(ids), jnp.asarray(rows), v))
    np.testing.assert_allclose(got, _reference(ids, rows, v), rtol=1e-5, atol=1e-5)

  def test_bf16_rows_sum_in_f32(self):
    rng = np.random.default_rng(0)
    ids = _skewed_ids(rng, 4000, 64)
    rows = jnp.asarray(rng.standard_normal((4000, 16)), jnp.bfloat16)
    got = embedding.segment_sum(jnp.asarray(ids), rows, 64)
    self.assertEqual(got.dtype, jnp.float32)
    want = _reference(ids, np.asarray(rows.astype(jnp.float32)), 64)
    # f32 accumulation of exact bf16 values: far tighter than bf16 adds (~1e-1 here).
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


class LookupTest(absltest.TestCase):

  def test_value_and_gradient_match_take(self):
    rng = np.random.default_rng(1)
    table = jnp.asarray(rng.standard_normal((300, 24)), jnp.float32)
    tokens = jnp.asarray(_skewed_ids(rng, 2 * 333, 300).reshape(2, 333))
    ct = jnp.asarray(rng.standard_normal((2, 333, 24)), jnp.float32)
    f = lambda t: jnp.sum(embedding.lookup(t, tokens) * ct)
    g = lambda t: jnp.sum(jnp.take(t, tokens, axis=0) * ct)
    np.testing.assert_array_equal(embedding.lookup(table, tokens),
                                  jnp.take(table, tokens, axis=0))
    np.testing.assert_allclose(jax.grad(f)(table), jax.grad(g)(table), rtol=1e-5, atol=1e-5)

  def test_gradient_has_the_table_dtype(self):
    table = jnp.ones((10, 4), jnp.bfloat16)
    tokens = jnp.array([[1, 1, 2]], jnp.int32)
    grad = jax.grad(lambda t: jnp.sum(embedding.lookup(t, tokens).astype(jnp.float32)))(table)
    self.assertEqual(grad.dtype, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(grad[:3, 0], np.float32), [0, 2, 1])


if __name__ == "__main__":
  absltest.main()
