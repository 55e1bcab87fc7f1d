"""Intra-chunk decayed scores of the kernels, for a gate of width W in {1, K}.

``A[i, j] = sum_k x_ik y_jk exp(g_ik - g_jk)`` on the causal triangle of one
chunk (``x = y = k``, strict, for the UT system; ``x = q``, ``y = k``,
``j <= i``, for the output).

* W = 1 (Gated DeltaNet): ``(X Y^T) * Gamma``, one ``[C, C]`` decay
  (:func:`scores`).
* W = K (KDA): :class:`ChannelTiles`, ``[16, 16]`` tiles, each one product
  through a reference gate ``r`` shared by its row block I (the seed's
  secondary chunking, ``(X_I e^{g_I - r}) (Y_J e^{r - g_J})^T``). Where the
  gate falls by at most :data:`SPAN` over block I (every channel), ``r`` is
  the gate in the middle of block I, for the diagonal tile too: every factor
  is at most ``e^SPAN``, and on and below the diagonal the product is the
  decay itself (<= 1). Elsewhere (a strong gate) ``r`` is the gate before
  block I, so the tiles left of the diagonal take only exponents <= 0, and
  the diagonal tile is formed column by column, masked to ``i >= j`` before
  ``exp``. Cuts are masked on the products.
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


@dataclasses.dataclass(frozen=True)
class ChannelTiles:
  """The ``[16, 16]`` tiles of the scores of a per-channel gate in one chunk,
  for row operands ``xs`` (q and/or k) against ``y``, and their VJP, row
  block by row block. Operands are read from refs by 16-token blocks
  (``pl.ds``): no value is sliced or reshaped.

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
  def n(self) -> int:
    """16-token blocks in the chunk."""
    return self.g_ref.shape[0] // SUB

  def _load(self, ref, i: int):
    """Block i of ``ref`` ``[16, K]`` in the accumulator dtype."""
    return ref[pl.ds(i * SUB, SUB), :].astype(
        core.accumulator(self.y_ref.dtype))

  def _gate_at(self, t):
    """The gate ``[1, K]`` at token t."""
    return self.g_ref[pl.ds(t, 1), :].astype(
        core.accumulator(self.y_ref.dtype))

  def _mm(self, a, b, **kw):
    """Products of the float32 factors: one TF32 pass for 16-bit inputs
    (whose own rounding is coarser), the configured precision otherwise."""
    low = jnp.dtype(self.y_ref.dtype).itemsize < 4
    return self.dot(a, b, precision="tf32" if low else None, **kw)

  def mask(self, i: int, j: int, strict: bool):
    """``[16, 16]`` (or True): the pairs of tile (i, j) that carry a score."""
    mask = True
    if i == j:
      mask = core.causal(SUB, strict=strict)
    if self.cuts_ref is not None:
      mask = mask & (self.cuts_ref[pl.ds(i * SUB, SUB)][:, None]
                     == self.cuts_ref[pl.ds(j * SUB, SUB)][None, :])
    return mask

  def _is_gentle(self, i: int):
    """Whether the gate falls by at most SPAN over block i, every channel."""
    fall = self._gate_at(i * SUB) - self._gate_at(i * SUB + SUB - 1)
    return jnp.max(fall) <= SPAN

  def _through(self, i: int, ref_token: int, blocks: int):
    """Row block i's factors through the gate r at ref_token: ``(X_I
    e^{g_I - r} per x, e^{g_I - r}, [(e^{r - g_J}, Y_J e^{r - g_J}) for J <
    blocks])``, each ``[16, K]``."""
    r = self._gate_at(ref_token)
    left = jnp.exp(self._load(self.g_ref, i) - r)
    right = []
    for j in range(blocks):
      decay = jnp.exp(r - self._load(self.g_ref, j))
      right.append((decay, self._load(self.y_ref, j) * decay))
    return [self._load(x, i) * left for x in self.xs], left, right

  def _middle(self, i: int):
    """``(reference token, blocks)``: one product per tile of row block i,
    the diagonal tile included, through the middle of block i."""
    return i * SUB + SUB // 2, i + 1

  def _before(self, i: int):
    """``(reference token, blocks)``: the tiles left of the diagonal through
    the gate before block i."""
    return i * SUB - 1, i

  def _columns(self, i: int, step, init):
    """``lax.fori_loop`` of ``step(j, x blocks [16, K], y_t [1, K], e [16,
    K], carry)`` over the columns of diagonal tile i, with ``e = exp(g_I -
    g_t)`` on the rows ``>= j`` (``t = 16 i + j``), masked before exp."""
    g = self._load(self.g_ref, i)
    xs = [self._load(x, i) for x in self.xs]
    below = core.iota((SUB, 1), 0)

    def column(j, carry):
      t = i * SUB + j
      e = core.masked_exp(g - self._gate_at(t), below >= j)
      y_t = self.y_ref[pl.ds(t, 1), :].astype(g.dtype)
      return step(j, xs, y_t, e, carry)
    return lax.fori_loop(0, SUB, column, init)

  # Forward.

  def _row_through(self, i: int, ref_token: int, blocks: int):
    xs, _, right = self._through(i, ref_token, blocks)
    return [[self._mm(x, y, trans_b=True) for _, y in right] for x in xs]

  def _diagonal(self, i: int):
    """Diagonal tile i per x, ``[16, 16]``, exactly, column by column."""
    cols = core.iota((SUB, SUB), 1)

    def step(j, xs, y_t, e, tiles):
      return tuple(jnp.where(cols == j, jnp.sum(x * y_t * e, axis=1)[:, None],
                             tile) for x, tile in zip(xs, tiles))
    zeros = jnp.zeros((SUB, SUB), core.accumulator(self.y_ref.dtype))
    return self._columns(i, step, tuple(zeros for _ in self.xs))

  def _row_exact(self, i: int):
    diagonal = self._diagonal(i)
    if i == 0:
      return [[d] for d in diagonal]
    return [row + [d] for row, d in zip(self._row_through(i, *self._before(i)),
                                        diagonal)]

  def row(self, i: int):
    """Per x, the tiles ``(i, j)``, ``j <= i``, of row block i: ``[16, 16]``
    float32, masked."""
    raw = lax.cond(self._is_gentle(i),
                   lambda: self._row_through(i, *self._middle(i)),
                   lambda: self._row_exact(i))
    return [[jnp.where(self.mask(i, j, s), tile, 0)
             for j, tile in enumerate(row)]
            for row, s in zip(raw, self.strict)]

  # VJP.

  def _vjp_through(self, i: int, ref_token: int, blocks: int, ds):
    """``(dx per x [16, K], [dy_J [16, K] for J < blocks])`` of row block
    i's products through the gate at ref_token; ``ds``: per x, per tile
    ``(i, J)``, its cotangent as seen by x and by y."""
    xs, left, right = self._through(i, ref_token, blocks)
    dxs = []
    dys = [0] * blocks
    for x, d_row in zip(xs, ds):
      dx = 0
      for j, ((decay, y), (d_x, d_y)) in enumerate(zip(right, d_row)):
        dx += self._mm(d_x, y)
        dys[j] += self._mm(d_y, x, trans_a=True)
      dxs.append(dx * left)
    return dxs, [dy * decay for dy, (decay, _) in zip(dys, right)]

  def _diagonal_vjp(self, i: int, ds):
    """``(dx per x, dy)`` ``[16, K]`` of diagonal tile i from ``ds``: per x,
    the tile's cotangents seen by x and by y."""
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
    dxs, dy_diagonal = self._diagonal_vjp(i, [d_row[i] for d_row in ds])
    if i == 0:
      return list(dxs), [dy_diagonal]
    off_x, off_y = self._vjp_through(i, *self._before(i),
                                     [d_row[:i] for d_row in ds])
    return [a + b for a, b in zip(dxs, off_x)], off_y + [dy_diagonal]

  def row_vjp(self, i: int, ds):
    """``(dx per x [16, K], [dy_J [16, K] for J <= i])``: row block i's
    share of the VJP, from ``ds``: per x, per tile ``(i, J)``, ``J <= i``,
    the tile's cotangent as seen by x's rows and by y's rows ``[16, 16]``
    (the two differ when the scores are row-weighted, ``diag(b) A``)."""
    ds = [[tuple(jnp.where(self.mask(i, j, s), d, 0) for d in pair)
           for j, pair in enumerate(d_row)]
          for d_row, s in zip(ds, self.strict)]
    return lax.cond(self._is_gentle(i),
                    lambda: self._vjp_through(i, *self._middle(i), ds),
                    lambda: self._vjp_exact(i, ds))


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

