"""Intra-chunk decayed scores of the kernels, for a gate of width W in {1, K}.

``A[i, j] = sum_k x_ik y_jk exp(g_ik - g_jk)`` on the causal triangle of one
chunk (``x = y = k``, strict, for the UT system; ``x = q``, ``y = k``,
``j <= i``, for the output).

* W = 1 (Gated DeltaNet): ``(X Y^T) * Gamma``, one ``[C, C]`` decay
  (:func:`scores`).
* W = K (KDA): :class:`ChannelScores`, by 16-token row blocks, each one
  product through a reference gate ``r`` (the seed's secondary chunking,
  ``(X_I e^{g_I - r}) (Y e^{r - g})^T``). Where the gate falls by at most
  :data:`SPAN` over block I (every channel), ``r`` is the gate in the middle
  of block I and one product gives the whole row block, diagonal tile
  included: every factor is at most ``e^SPAN``, and on and below the
  diagonal the product is the decay itself (<= 1). Elsewhere (a strong
  gate) ``r`` is the gate before block I, so the tiles left of the diagonal
  take only exponents <= 0, and the diagonal tile is formed column by column,
  masked to ``i >= j`` before ``exp``. Cuts are masked on the product.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from deltajax.pallas import core
from deltajax.pallas.core import SUB

# The largest fall of the gate over a 16-token block that is factored through
# the block's middle: factors and the masked products above the diagonal stay
# below e^40 (~2e17), far from float32's overflow; a product below the
# diagonal whose right factor underflows is below e^{40 - 87}.
SPAN = 40.0


def _place_cols(tile, j: int, n: int):
  """``[16, 16 n]``: the ``[16, 16]`` tile at columns ``16 j ..``, 0 elsewhere."""
  wide = jnp.broadcast_to(tile[:, None, :], (SUB, n, SUB))
  return jnp.where(core.iota(wide.shape, 1) == j, wide, 0).reshape(SUB, n * SUB)


@dataclasses.dataclass(frozen=True)
class ChannelScores:
  """The scores of a per-channel gate in one chunk, for left operands
  ``xs`` (q and/or k) against ``y``, by 16-token row blocks, and their VJP.

  Refs: xs and y ``[C, K]``, g ``[C, K]`` (the chunk-local cumulative gate),
  cuts ``[C]`` int32 or None; ``strict[m]``: whether x m's scores are
  strictly lower (``j < i``) or causal (``j <= i``).
  """
  xs: tuple
  strict: tuple
  y_ref: object
  g_ref: object
  cuts_ref: object
  dot: core.Dot

  @property
  def c(self) -> int:
    return self.g_ref.shape[0]

  @property
  def n(self) -> int:
    """16-token blocks in the chunk."""
    return self.c // SUB

  def _load(self, ref, rows):
    return ref[rows, :].astype(core.accumulator(self.y_ref.dtype))

  def _gate_at(self, t):
    """The gate ``[1, K]`` at token t."""
    return self._load(self.g_ref, pl.ds(t, 1))

  def _mm(self, a, b, **kw):
    """Products of the float32 factors: one TF32 pass for 16-bit inputs
    (whose own rounding is coarser), the configured precision otherwise."""
    low = jnp.dtype(self.y_ref.dtype).itemsize < 4
    return self.dot(a, b, precision="tf32" if low else None, **kw)

  def _mask(self, i: int, strict: bool):
    """``[16, C]``: the pairs of row block i that carry a score."""
    rows = core.iota((SUB, self.c), 0) + i * SUB
    cols = core.iota((SUB, self.c), 1)
    mask = rows > cols if strict else rows >= cols
    if self.cuts_ref is not None:
      mask = mask & (self.cuts_ref[pl.ds(i * SUB, SUB)][:, None]
                     == self.cuts_ref[...][None, :])
    return mask

  def _factored(self, i: int, ref_token: int, end: int):
    """``(X_I e^{g_I - r} per x [16, K], e^{g_I - r} [16, K], e^{r - g}
    [C, K] (0 on rows >= end), Y e^{r - g} [C, K])`` with ``r`` the gate at
    ``ref_token``."""
    r = self._gate_at(ref_token)
    rows = pl.ds(i * SUB, SUB)
    left = jnp.exp(self._load(self.g_ref, rows) - r)
    right = core.masked_exp(r - self._load(self.g_ref, pl.ds(0, self.c)),
                            core.iota((self.c, 1), 0) < end)
    y = self._load(self.y_ref, pl.ds(0, self.c)) * right
    return [self._load(x, rows) * left for x in self.xs], left, right, y

  def _is_gentle(self, i: int):
    """Whether the gate falls by at most SPAN over block i, every channel."""
    fall = self._gate_at(i * SUB) - self._gate_at(i * SUB + SUB - 1)
    return jnp.max(fall) <= SPAN

  def _middle(self, i: int):
    """``(reference token, column end)`` of row block i's one product."""
    return i * SUB + SUB // 2, (i + 1) * SUB

  def _before(self, i: int):
    """``(reference token, column end)`` of the tiles left of the diagonal."""
    return i * SUB - 1, i * SUB

  # Forward.

  def _rows_through(self, i: int, ref_token: int, end: int):
    xs, _, _, y = self._factored(i, ref_token, end)
    return [self._mm(x, y, trans_b=True) for x in xs]

  def _columns(self, i: int, step, init):
    """``lax.fori_loop`` of ``step(j, x tiles [16, K], y_t [1, K], e [16,
    K], carry)`` over the columns of diagonal tile i, with ``e = exp(g_I -
    g_t)`` on the rows ``>= j`` (``t = 16 i + j``), masked before exp."""
    rows = pl.ds(i * SUB, SUB)
    g = self._load(self.g_ref, rows)
    xs = [self._load(x, rows) for x in self.xs]
    below = core.iota((SUB, 1), 0)

    def column(j, carry):
      t = i * SUB + j
      e = core.masked_exp(g - self._gate_at(t), below >= j)
      return step(j, xs, self._load(self.y_ref, pl.ds(t, 1)), e, carry)
    return lax.fori_loop(0, SUB, column, init)

  def _diagonal(self, i: int):
    """Diagonal tile i per x, ``[16, 16]``, exactly, column by column."""
    cols = core.iota((SUB, SUB), 1)

    def step(j, xs, y_t, e, tiles):
      return tuple(jnp.where(cols == j, jnp.sum(x * y_t * e, axis=1)[:, None],
                             tile) for x, tile in zip(xs, tiles))
    zeros = jnp.zeros((SUB, SUB), core.accumulator(self.y_ref.dtype))
    return self._columns(i, step, tuple(zeros for _ in self.xs))

  def _rows_exact(self, i: int):
    diagonal = [_place_cols(d, i, self.n) for d in self._diagonal(i)]
    if i == 0:
      return diagonal
    return [a + d for a, d in zip(self._rows_through(i, *self._before(i)),
                                  diagonal)]

  def row_block(self, i: int):
    """Rows ``16 i ..`` of each x's scores, ``[16, C]`` float32, masked."""
    raw = lax.cond(self._is_gentle(i),
                   lambda: self._rows_through(i, *self._middle(i)),
                   lambda: self._rows_exact(i))
    return [jnp.where(self._mask(i, s), r, 0)
            for r, s in zip(raw, self.strict)]

  # VJP.

  def _vjp_through(self, i: int, ref_token: int, end: int, ds):
    """``(dx per x [16, K], dy [C, K])`` of row block i's product through
    the gate at ref_token; ``ds``: per x, the row block's cotangent seen
    by x and by y, ``[16, C]`` (0 where the product is not used)."""
    xs, left, right, y = self._factored(i, ref_token, end)
    dxs, dy = [], 0
    for x, (d_x, d_y) in zip(xs, ds):
      dxs.append(self._mm(d_x, y) * left)
      dy += self._mm(d_y, x, trans_a=True)
    return dxs, dy * right

  def _diagonal_vjp(self, i: int, ds):
    """``(dx per x, dy)`` ``[16, K]`` of diagonal tile i from ``ds``: per x,
    the tile's cotangents ``[16, 16]`` seen by x and by y."""
    cols, below = core.iota((SUB, SUB), 1), core.iota((SUB, 1), 0)

    def step(j, xs, y_t, e, grads):
      dxs, dy = grads
      new, dy_t = [], 0
      for x, (d_x, d_y), dx in zip(xs, ds, dxs):
        column = lambda d: jnp.sum(jnp.where(cols == j, d, 0), axis=1)[:, None]
        new.append(dx + column(d_x) * e * y_t)
        dy_t += jnp.sum(column(d_y) * e * x, axis=0)[None, :]
      return tuple(new), jnp.where(below == j, dy_t, dy)
    zeros = jnp.zeros((SUB, self.y_ref.shape[1]),
                      core.accumulator(self.y_ref.dtype))
    return self._columns(i, step, (tuple(zeros for _ in self.xs), zeros))

  def _vjp_exact(self, i: int, ds):
    tiles = [(core.cols_of(d_x, i), core.cols_of(d_y, i)) for d_x, d_y in ds]
    dxs, dy_diagonal = self._diagonal_vjp(i, tiles)
    dy = core.place_rows({i: dy_diagonal}, self.n)
    if i == 0:
      return list(dxs), dy
    off_x, off_y = self._vjp_through(i, *self._before(i), ds)
    return [a + b for a, b in zip(dxs, off_x)], dy + off_y

  def vjp(self, ds):
    """``(dx per x [C, K], dy [C, K])`` float32 from ``ds``: per x, the
    cotangent ``[C, C]`` of its scores as seen by x's rows and by y's rows
    (the two differ when the scores are row-weighted, ``diag(b) A``)."""
    dxs, dy = [{} for _ in self.xs], 0
    for i in range(self.n):
      masks = [self._mask(i, s) for s in self.strict]
      rows = [tuple(jnp.where(m, core.rows_of(d, i), 0) for d in pair)
              for m, pair in zip(masks, ds)]
      dx_i, dy_i = lax.cond(
          self._is_gentle(i),
          lambda: self._vjp_through(i, *self._middle(i), rows),
          lambda: self._vjp_exact(i, rows))
      for m, dx in enumerate(dx_i):
        dxs[m][i] = dx
      dy += dy_i
    return [core.place_rows(dx, self.n) for dx in dxs], dy


@dataclasses.dataclass(frozen=True)
class Scores:
  """The decayed scores of one chunk for a scalar gate: ``matrix [C, C]``
  float32 and its ``[C, C]`` decay ``Gamma``."""
  matrix: object
  decay: object
  dot: core.Dot

  def vjp(self, d, x, y):
    """``(dx, dy, dg)`` from the cotangent ``d [C, C]`` of ``matrix``; x, y
    ``[C, K]``; ``dg [C]``: the gate's share (each score is
    ``x_i . y_j exp(g_i - g_j)``)."""
    d_e = (d * self.decay).astype(x.dtype)
    p = d * self.matrix
    return (self.dot(d_e, y), self.dot(d_e, x, trans_a=True),
            jnp.sum(p, axis=1) - jnp.sum(p, axis=0))


def scores(*, x, y, g, cuts, strict, dot) -> Scores:
  """The decayed scores of one chunk for a scalar gate on ``j < i``
  (``strict``) or ``j <= i``: x, y ``[C, K]``, g ``[C]`` float32, cuts
  ``[C]`` or None."""
  e = core.decay(g, g, core.causal(x.shape[0], strict=strict), cuts, cuts)
  return Scores(dot(x, y, trans_b=True) * e, e, dot)

