"""TwELL and hybrid layouts: bit-exact round trips, overflow accounting, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import twell_jax as tj


def _bits(a):
  return np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(a), jnp.uint16))


def _random_h(seed, m, n, density, *, dense_rows=(), zero_rows=(), dtype=jnp.bfloat16):
  rng = np.random.default_rng(seed)
  h = rng.standard_normal((m, n)).astype(np.float32)
  h[rng.random((m, n)) >= density] = 0.0
  for r in dense_rows:
    h[r] = rng.standard_normal(n)
  for r in zero_rows:
    h[r] = 0.0
  return jnp.asarray(h, dtype)


CASES = [
    # (m, n, density, dense_rows, zero_rows)
    (1, 256, 0.0, (), ()),              # one all-zero row
    (1, 256, 1.0, (), ()),              # one fully dense row
    (7, 512, 0.02, (3,), (0, 6)),        # mix
    (130, 768, 0.08, (5, 77, 129), (1,)),  # odd M, tiles near capacity
    (33, 256, 0.6, (), (2,)),           # most tiles overflow
]


@pytest.mark.parametrize("m,n,density,dense_rows,zero_rows", CASES)
@pytest.mark.parametrize("capacity", [None, 0, 2])
def test_round_trip_bit_exact(m, n, density, dense_rows, zero_rows, capacity):
  h = _random_h(m * n, m, n, density, dense_rows=dense_rows, zero_rows=zero_rows)
  tw = tj.to_twell(h, overflow_capacity=capacity)
  hy = tj.to_hybrid(h, ell_width=16, tail_rows=capacity)
  np.testing.assert_array_equal(_bits(tj.to_dense(tw)), _bits(h))
  np.testing.assert_array_equal(_bits(tj.to_dense(hy)), _bits(h))


def test_signed_zero_and_nan_survive():
  h = jnp.zeros((2, 256), jnp.bfloat16).at[0, 3].set(-0.0).at[1, 255].set(jnp.nan).at[1, 0].set(2.0)
  for s in (tj.to_twell(h), tj.to_hybrid(h)):
    np.testing.assert_array_equal(_bits(tj.to_dense(s)), _bits(h))


def test_twell_fields_and_overflow_counts():
  h = _random_h(0, 9, 512, 0.03, dense_rows=(2, 5), zero_rows=(0,))
  tw = tj.to_twell(h, tile_n=256, compression=8, overflow_capacity=4)
  assert tw.values.shape == (9, 2, 32) and tw.values.dtype == jnp.bfloat16
  assert tw.columns.shape == (9, 2, 32) and tw.columns.dtype == jnp.int32
  counts = (np.asarray(h.astype(jnp.float32)).reshape(9, 2, 256) != 0).sum(-1)
  np.testing.assert_array_equal(np.asarray(tw.counts), counts)
  assert int(tw.overflow_rows) == 2 and not bool(tw.capacity_exceeded)
  np.testing.assert_array_equal(np.asarray(tw.overflow_index), [2, 5, 9, 9])
  # Entries are in column order and columns are global and inside their tile.
  valid = np.arange(32) < np.asarray(tw.counts)[..., None]
  cols = np.where(valid, np.asarray(tw.columns), -1)
  for r in (1, 3, 4):
    for t in range(2):
      c = cols[r, t][cols[r, t] >= 0]
      assert np.all(np.diff(c) > 0) and np.all((c >= 256 * t) & (c < 256 * (t + 1)))
  assert tw.fallback is not None and tj.to_twell(h, overflow_capacity=9).fallback is None


def test_capacity_exceeded_is_visible_and_exact():
  h = _random_h(1, 16, 256, 0.9)
  hy = tj.to_hybrid(h, ell_width=8, tail_rows=3)
  assert int(hy.heavy_rows) == 16 and bool(hy.capacity_exceeded)
  np.testing.assert_array_equal(_bits(tj.to_dense(hy)), _bits(h))


@pytest.mark.parametrize("compression,slots", [(2, 128), (4, 64), (8, 32)])
def test_compression_sets_slots(compression, slots):
  tw = tj.to_twell(_random_h(2, 4, 512, 0.1), compression=compression)
  assert tw.slots == slots and tw.values.shape == (4, 2, slots)


def test_works_under_jit():
  h = _random_h(3, 20, 512, 0.05, dense_rows=(4,))
  out = jax.jit(lambda a: tj.to_dense(tj.to_twell(a, overflow_capacity=1)))(h)
  np.testing.assert_array_equal(_bits(out), _bits(h))


@pytest.mark.parametrize("bad,match", [
    (jnp.zeros((4,), jnp.bfloat16), "2-D"),
    (jnp.zeros((4, 100), jnp.bfloat16), "multiple of tile_n"),
    (jnp.zeros((4, 256), jnp.int32), "floating dtype"),
    (jnp.zeros((0, 256), jnp.bfloat16), "at least one row"),
])
def test_bad_input_to_twell(bad, match):
  with pytest.raises(ValueError, match=match):
    tj.to_twell(bad)


def test_bad_arguments():
  h = jnp.zeros((4, 256), jnp.bfloat16)
  with pytest.raises(ValueError, match="compression"):
    tj.to_twell(h, compression=3)
  with pytest.raises(ValueError, match="ell_width"):
    tj.to_hybrid(h, ell_width=0)
  with pytest.raises(ValueError, match="tail_rows"):
    tj.to_hybrid(h, tail_rows=-1)
  with pytest.raises(ValueError, match="TwELL or twell_jax.Hybrid"):
    tj.to_dense(h)
