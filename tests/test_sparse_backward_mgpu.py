"""The training backward's gather kernels (pallas_kernels/sparse_backward_mgpu.py) against numpy.

Row side (ell_dh, ell_dx) and column side (column_sums, csc_down_dh) on small hand-built
patterns with fixed seeds: empty rows and columns, full rows, a hot column, unwritten slots
holding NaN. Interpret-mode twins run on the CPU; the GPU class needs a Hopper GPU.
"""

from __future__ import annotations

import functools

from absl.testing import absltest
from absl.testing import parameterized
import jax.numpy as jnp
import numpy as np
import pytest

import kernel_test_util as ktu
from pallas_kernels import _row_loops as row_loops
from pallas_kernels import sparse_backward_mgpu as bwd

F32 = jnp.float32


class BackwardKernelsTestBase(ktu.KernelTestBase):

  @parameterized.parameters(True, False)
  def test_row_dh_and_dx_match_reference(self, gated):
    """The row-side backward (ell_dh, then ell_dx) against numpy."""
    rng = np.random.default_rng(11)
    m, d, h, wk = 16, 128, 256, 8
    n = rng.integers(0, wk + 1, m).astype(np.int32)
    n[0], n[1] = 0, wk                                   # an empty row and a full row
    cols = np.stack([rng.choice(h, wk, replace=False) for _ in range(m)]).astype(np.int32)
    valid = np.arange(wk)[None, :] < n[:, None]
    cols = np.where(valid, cols, 0)
    bf = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16).astype(F32))
    p = bf(np.where(valid, np.abs(rng.normal(size=(m, wk))) + 0.1, 0))
    u = bf(np.where(valid, rng.normal(size=(m, wk)), 0))
    dy, wd, wut, wgt = (bf(rng.normal(size=s_)) for s_ in ((m, d), (h, d), (h, d), (h, d)))
    c = np.float32(0.3)
    b16 = lambda a: jnp.asarray(a, jnp.bfloat16)
    cols_j, n_j = jnp.asarray(cols), jnp.asarray(n)
    du, dg = bwd.ell_dh(b16(dy), cols_j, b16(p), b16(u) if gated else None, n_j,
                        jnp.full((1,), c, F32), b16(wd), interpret=self.INTERPRET)
    dx = bwd.ell_dx(cols_j, n_j, du, dg, b16(wut), b16(wgt) if gated else None,
                    interpret=self.INTERPRET)
    hv = bf(p * u) if gated else p
    dh = np.where(valid, np.einsum("md,mkd->mk", dy, wd[cols]) + c * np.sign(hv), 0)
    dg_ref = dh * u if gated else dh
    dx_ref = np.einsum("mk,mkd->md", dg_ref, wgt[cols] if gated else wut[cols])
    if gated:
      du_ref = dh * p
      dx_ref += np.einsum("mk,mkd->md", du_ref, wut[cols])
      np.testing.assert_allclose(np.where(valid, du, 0), du_ref, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(np.where(valid, dg, 0), dg_ref, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-4, atol=1e-3)

  def test_ell_dx_ignores_unwritten_slots(self):
    """csc_down_dh leaves ELL slots past a row's count unwritten: ell_dx must not read them
    into dx (NaN there must not reach the result)."""
    rng = np.random.default_rng(12)
    m, d, h, wk = 8, 128, 256, 6
    n = rng.integers(0, wk + 1, m).astype(np.int32)
    n[0], n[1] = 0, wk
    cols = jnp.asarray(rng.integers(0, h, (m, wk)), jnp.int32)
    valid = np.arange(wk)[None, :] < n[:, None]
    du, dg = (rng.normal(size=(m, wk)).astype(F32) for _ in range(2))
    wut, wgt = (jnp.asarray(rng.normal(size=(h, d)), jnp.bfloat16) for _ in range(2))
    run = lambda a, b: bwd.ell_dx(cols, jnp.asarray(n), jnp.asarray(a), jnp.asarray(b),
                                  wut, wgt, interpret=self.INTERPRET)
    clean = run(np.where(valid, du, 0), np.where(valid, dg, 0))
    dirty = run(np.where(valid, du, np.nan), np.where(valid, dg, np.nan))
    np.testing.assert_array_equal(np.asarray(dirty), np.asarray(clean))
    self.assertTrue(np.isfinite(np.asarray(clean)).all())

  def test_column_kernels_match_reference_and_round_once(self):
    """The column-side kernels against numpy: column_sums and csc_down_dh, whose gate / up
    values are read from ELL-order arrays through ids (so the ELL layout here is a shuffled
    one, with slots no entry names holding NaN). Every kernel sums in f32 and rounds once as
    it writes: the bf16 outputs are the f32 outputs rounded. Column 1 holds most entries
    (a hot feature), column 0 none."""
    rng = np.random.default_rng(13)
    m, d, h, e = 8, 128, 6, 20
    rows = rng.integers(0, m, e).astype(np.int32)
    counts = rng.multinomial(e, np.array([0.0, 0.6] + [0.1] * (h - 2)))
    counts[0] = 0                                      # an empty column
    counts[1] += e - counts.sum()
    self.assertGreater(counts[1], 10)       # 3 pieces of at most 5 at PieceConfig(3, 4) below
    col_ptr = jnp.asarray(np.concatenate([[0], np.cumsum(counts)]), jnp.int32)
    seg = np.repeat(np.arange(h), counts)
    x, dy, wd = (rng.normal(size=s_).astype(F32) for s_ in ((m, d), (m, d), (h, d)))
    b16 = lambda a: jnp.asarray(a, jnp.bfloat16)
    bf = lambda a: np.asarray(b16(a).astype(F32))
    x, dy, wd = bf(x), bf(dy), bf(wd)
    # CSC entry i sits at ELL slot ids[i] of a [4, 8] layout (32 slots; 12 unused: NaN).
    ell_shape = (4, 8)
    ids = rng.permutation(32)[:e].astype(np.int32)
    p_csc = bf(np.where(rng.random(e) < 0.2, 0.0, np.abs(rng.normal(size=e)) + 0.1))
    u_csc = bf(rng.normal(size=e))
    p_ell, u_ell = (np.full(32, np.nan, F32) for _ in range(2))
    p_ell[ids], u_ell[ids] = p_csc, u_csc
    c = 0.3
    du, dg = (rng.normal(size=e).astype(F32) for _ in range(2))
    hh = bf(p_csc * u_csc)
    ref = lambda coef, a: np.stack([(coef[seg == j, None] * a[rows[seg == j]]).sum(0)
                                    for j in range(h)])
    dh = np.where(p_csc > 0, np.einsum("ed,ed->e", dy[rows], wd[seg]) + c * np.sign(hh), 0)
    args = lambda *a: tuple(jnp.asarray(v) for v in a)
    rows_j = jnp.asarray(rows)
    runs = {}
    # group 2 with the hot column cut in pieces (L = max(3, ceil(20 / 4)) = 5: 3 pieces, the
    # other columns whole), and rows loaded one step ahead at group 1 with every column whole
    # (every column's loop runs past its end).
    for name, cfg, pc in (
        ("", row_loops.GatherConfig(group=2), bwd.PieceConfig(length=3, extra=4)),
        ("_ahead", row_loops.GatherConfig(rows_ahead=True), bwd.PieceConfig())):
      runs["x" + name] = (functools.partial(
          lambda dt, cfg, pc: bwd.column_sums(b16(x), col_ptr, rows_j, *args(du, dg),
                                              config=cfg, piece_config=pc, out_dtype=dt,
                                              interpret=self.INTERPRET), cfg=cfg, pc=pc),
                          (ref(du, x), ref(dg, x)))
      runs["dy" + name] = (functools.partial(
          lambda dt, cfg, pc: bwd.column_sums(b16(dy), col_ptr, rows_j, jnp.asarray(hh),
                                              config=cfg, piece_config=pc, out_dtype=dt,
                                              interpret=self.INTERPRET), cfg=cfg, pc=pc),
                           (ref(hh, dy),))
      runs["down_dh" + name] = (functools.partial(
          lambda dt, cfg, pc: bwd.csc_down_dh(
              b16(dy), b16(wd), col_ptr, rows_j, b16(p_ell).reshape(ell_shape),
              b16(u_ell).reshape(ell_shape), jnp.full((1,), c, F32), jnp.asarray(ids),
              ell_shape, config=cfg, piece_config=pc, out_dtype=dt,
              interpret=self.INTERPRET), cfg=cfg, pc=pc),
          (ref(hh, dy), dh * p_csc, dh * u_csc))
    for name, (run, refs) in runs.items():
      full, rounded = run(F32), run(jnp.bfloat16)
      for i, (a, r) in enumerate(zip(full, refs)):
        np.testing.assert_allclose(np.asarray(a), r, rtol=1e-4, atol=1e-4, err_msg=f"{name} {i}")
      self.assertEqual(rounded[0].dtype, jnp.bfloat16, name)
      np.testing.assert_array_equal(np.asarray(rounded[0]),
                                    np.asarray(full[0].astype(jnp.bfloat16)), err_msg=name)
      if name.startswith("down_dh"):   # du, dg also in ELL order, at ids
        for a_ell, a_csc in ((full[3], full[1]), (full[4], full[2])):
          np.testing.assert_array_equal(np.asarray(a_ell).reshape(-1)[ids], np.asarray(a_csc))
      else:
        for a, b in zip(full[1:], rounded[1:]):
          np.testing.assert_array_equal(np.asarray(b), np.asarray(a.astype(jnp.bfloat16)))

  def test_rejects_bad_shapes(self):
    with self.assertRaisesRegex(ValueError, "PieceConfig"):
      bwd.PieceConfig(length=0)
    z = jnp.zeros((8,), F32)
    with self.assertRaisesRegex(ValueError, "column_sums"):
      bwd.column_sums(jnp.zeros((8, 100), jnp.bfloat16), jnp.zeros((5,), jnp.int32),
                      jnp.zeros((8,), jnp.int32), z, interpret=self.INTERPRET)
    with self.assertRaisesRegex(ValueError, "group"):
      row_loops.GatherConfig(group=0)


class ColumnPiecesTest(absltest.TestCase):
  """``column_pieces`` (XLA glue) on random column lengths, some far longer than the rest:
  every entry of every column in exactly one piece, no piece longer than L or outside its
  column, a column's pieces summed into that column's row and only a long column's."""

  def test_pieces_cover_each_entry_once(self):
    rng = np.random.default_rng(5)
    for trial in range(60):
      h = int(rng.integers(1, 12))
      lens = rng.integers(0, 30, h) * (rng.random(h) < 0.7)
      if trial % 2:
        lens[rng.integers(h)] = int(rng.integers(30, 200))     # one long column
      n_entries = max(1, int(lens.sum()) + int(rng.integers(0, 20)))   # padding entries
      ptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
      cfg = bwd.PieceConfig(length=int(rng.integers(1, 10)), extra=int(rng.integers(1, 40)))
      pc = bwd.column_pieces(jnp.asarray(ptr), n_entries, cfg)
      start, end, col, slot, long_cols, seg = (np.asarray(a) for a in pc)
      x = pc.n_extra
      length = max(cfg.length, -(-int(ptr[-1]) // x))
      cover = np.zeros(n_entries, int)
      summed = {}
      for g in range(start.shape[0]):
        self.assertTrue(0 <= col[g] < h)
        if end[g] > start[g]:
          self.assertTrue(ptr[col[g]] <= start[g] and end[g] <= ptr[col[g] + 1], (trial, g))
          self.assertLessEqual(end[g] - start[g], length)
          cover[start[g]:end[g]] += 1
        if slot[g] < 0:
          self.assertLess(g, h)              # a whole column: its own CTA, its own row
          self.assertLessEqual(lens[col[g]], length)
        elif slot[g] < 2 * x:
          summed.setdefault(int(long_cols[seg[slot[g]]]), set()).add(int(col[g]))
      np.testing.assert_array_equal(cover[:ptr[-1]], 1, err_msg=f"trial {trial}")
      self.assertTrue(all(k == v.pop() for k, v in summed.items()), trial)
      self.assertEqual(sorted(summed), sorted(np.flatnonzero(lens > length)), trial)

  def test_merge_sums_each_long_columns_pieces_and_ignores_unused_rows(self):
    """``_merge_pieces``: a long column's row is the sum of its pieces' partial rows, rounded
    once; other rows stay; partial rows no piece wrote (NaN here) reach no output."""
    rng = np.random.default_rng(7)
    lens = np.array([3, 40, 0, 17, 2, 90], np.int32)
    ptr = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    pc = bwd.column_pieces(ptr, 200, bwd.PieceConfig(length=8, extra=32))
    x, d = pc.n_extra, 128
    slot, col = np.asarray(pc.slot), np.asarray(pc.col)
    partial = np.full((2 * x + 1, d), np.nan, np.float32)
    written = [g for g in range(slot.shape[0]) if 0 <= slot[g] < 2 * x]
    for g in written:
      partial[slot[g]] = rng.normal(size=d)
    out = rng.normal(size=(lens.shape[0], d)).astype(np.float32)
    got = np.asarray(bwd._merge_pieces(jnp.asarray(out, jnp.bfloat16), jnp.asarray(partial),
                                       pc).astype(jnp.float32))
    want = np.array(jnp.asarray(out, jnp.bfloat16).astype(jnp.float32))
    for j in np.flatnonzero(lens > 8):
      rows = [slot[g] for g in written if col[g] == j]
      self.assertGreater(len(rows), 1)
      want[j] = np.asarray(jnp.asarray(partial[rows].sum(axis=0), jnp.bfloat16)
                           .astype(jnp.float32))
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)
    self.assertTrue(np.isfinite(got).all())


class BackwardKernelsInterpretTest(BackwardKernelsTestBase):
  INTERPRET = True


@pytest.mark.gpu
class BackwardKernelsGpuTest(BackwardKernelsTestBase):
  INTERPRET = False


if __name__ == "__main__":
  absltest.main()
