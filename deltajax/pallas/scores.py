"""Intra-chunk decayed scores of the kernels, for a gate of width W in {1, K}.

``A[i, j] = sum_k x_ik y_jk exp(g_ik - g_jk)`` on the causal triangle of one
chunk (``x = y = k``, strict, for the UT system; ``x = q``, ``y = k``,
``j <= i``, for the output).

* W = 1 (Gated DeltaNet): ``(X Y^T) * Gamma``, one ``[C, C]`` decay.
* W = K (KDA seed, the chunked data flow's 16-token diagonal blocks, as
  :class:`deltajax.common._ChannelBlocks`): by ``[16, 16]`` tiles. Tile
  ``(I, J < I)`` factors through ``r``, the gate at the token before block
  ``I``: ``(X_I e^{g_I - r}) (Y_J e^{r - g_J})^T``, one dot. The diagonal
  tile is formed column by column, ``sum_k x_ik y_jk exp(g_ik - g_jk)`` on
  ``[16, K]``, masked to ``i >= j`` before ``exp``. No exponent is ever
  positive, however strong the gate.

x, y and g come from the kernel's refs for W = K (tiles and single rows are
loaded with ``pl.ds``); for W = 1 from the values the kernel already holds.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from deltajax.pallas import core
from deltajax.pallas.core import SUB


@dataclasses.dataclass(frozen=True)
class ChannelTiles:
  """The ``[16, 16]`` tiles of the scores of a per-channel gate (the UT
  inverse takes them as tiles, the other kernels as one matrix).

  Refs: x, y ``[C, K]``, g ``[C, K]`` (float32), cuts ``[C]`` or None.
  """
  x_ref: object
  y_ref: object
  g_ref: object
  cuts_ref: object
  strict: bool
  dot: core.Dot

  @property
  def n(self) -> int:
    """16-token blocks in the chunk."""
    return self.g_ref.shape[0] // SUB

  def _load(self, ref, rows):
    return ref[rows, :].astype(core.accumulator(self.x_ref.dtype))

  def _cuts(self, rows):
    return None if self.cuts_ref is None else self.cuts_ref[rows]

  def _reference(self, i):
    """Gate ``[K]`` and cut count at token ``16 i - 1`` (before block i)."""
    t = i * SUB - 1
    return (self.g_ref[t, :].astype(core.accumulator(self.x_ref.dtype)),
            None if self.cuts_ref is None else self.cuts_ref[t])

  def _factor(self, i, j):
    """``e^{g - r}`` ``[16, K]`` for block ``j`` against block ``i``'s
    reference ``r``: block i's rows (``j == i``, exponent ``<= 0``) or an
    earlier block's (``j < i``, as ``e^{r - g}``); 0 across a cut."""
    rows = pl.ds(j * SUB, SUB)
    r, c_r = self._reference(i)
    g, c = self._load(self.g_ref, rows), self._cuts(rows)
    diff = g - r[None, :] if j == i else r[None, :] - g
    return core.masked_exp(diff, True if c is None else (c == c_r)[:, None])

  def _decayed(self, ref, i, j):
    """``(ref rows of block j * e, e)``: the left (``j == i``) or right
    (``j < i``) factor of tile ``(i, j)``, in x's dtype, and its decay."""
    decay = self._factor(i, j)
    x = self._load(ref, pl.ds(j * SUB, SUB)) * decay
    return x.astype(self.x_ref.dtype), decay

  def _column(self, i, j, g, c):
    """Column ``j`` (traced) of diagonal tile i: ``(y_t [1, K], e [16,
    K])`` with ``t = 16 i + j`` and ``e = exp(g_I - g_t)`` on the rows
    ``>= j`` (``> j`` strict) of t's segment; ``g, c``: block i's gate and
    cut counts."""
    t = i * SUB + j
    below = core.iota((SUB, 1), 0)
    mask = below > j if self.strict else below >= j
    if c is not None:
      mask = mask & (c == self.cuts_ref[t])[:, None]
    diff = g - self._load(self.g_ref, pl.ds(t, 1))
    return self._load(self.y_ref, pl.ds(t, 1)), core.masked_exp(diff, mask)

  def _over_columns(self, i, step, init):
    """``lax.fori_loop`` of ``step(j, y_t, e, carry)`` over the columns of
    diagonal tile i that can be nonzero."""
    rows = pl.ds(i * SUB, SUB)
    g, c = self._load(self.g_ref, rows), self._cuts(rows)
    return lax.fori_loop(
        0, SUB - 1 if self.strict else SUB,
        lambda j, carry: step(j, *self._column(i, j, g, c), carry), init)

  def _diagonal(self, i):
    x = self._load(self.x_ref, pl.ds(i * SUB, SUB))
    cols = core.iota((SUB, SUB), 1)
    return self._over_columns(
        i, lambda j, y_t, e, out: jnp.where(
            cols == j, jnp.sum(x * y_t * e, axis=1)[:, None], out),
        jnp.zeros((SUB, SUB), x.dtype))

  def tiles(self):
    """``{(i, j): [16, 16]}`` float32 for ``j <= i``."""
    out = {}
    for i in range(self.n):
      if i:
        left, _ = self._decayed(self.x_ref, i, i)
      for j in range(i):
        right, _ = self._decayed(self.y_ref, i, j)
        out[i, j] = self.dot(left, right, trans_b=True)
      out[i, i] = self._diagonal(i)
    return out

  def matrix(self):
    """The ``[C, C]`` scores."""
    return core.assemble(self.tiles(), self.n)

  def _diagonal_vjp(self, i, d):
    """``(dx, dy)`` ``[16, K]`` of diagonal tile i from its cotangent ``d``."""
    x = self._load(self.x_ref, pl.ds(i * SUB, SUB))
    rows, cols = core.iota((SUB, 1), 0), core.iota((SUB, SUB), 1)

    def column(j, y_t, e, grads):
      dx, dy = grads
      d_e = jnp.sum(jnp.where(cols == j, d, 0), axis=1)[:, None] * e
      return (dx + d_e * y_t,
              jnp.where(rows == j, jnp.sum(d_e * x, axis=0)[None, :], dy))

    zeros = jnp.zeros(x.shape, x.dtype)
    return self._over_columns(i, column, (zeros, zeros))

  def vjp(self, d):
    """``(dx, dy)`` ``[C, K]`` float32 from the scores' cotangent ``d [C, C]``."""
    dtype, n = self.x_ref.dtype, self.n
    dx, dy = {}, {j: 0 for j in range(n)}
    for i in range(n):
      d_rows = core.rows_of(d, i)
      dx[i], dy_i = self._diagonal_vjp(i, core.cols_of(d_rows, i))
      dy[i] += dy_i
      if not i:
        continue
      left, left_decay = self._decayed(self.x_ref, i, i)
      d_left = 0
      for j in range(i):
        d_ij = core.cols_of(d_rows, j).astype(dtype)
        right, right_decay = self._decayed(self.y_ref, i, j)
        d_left += self.dot(d_ij, right)
        dy[j] += self.dot(d_ij, left, trans_a=True) * right_decay
      dx[i] += d_left * left_decay
    return core.place_rows(dx, n), core.place_rows(dy, n)


@dataclasses.dataclass(frozen=True)
class Scores:
  """The decayed scores of one chunk and what their VJP needs.

  ``matrix`` ``[C, C]`` float32; for W = 1 ``decay`` is the ``[C, C]``
  ``Gamma``, for W = K ``tiles`` computes the VJP.
  """
  matrix: object
  dot: core.Dot
  decay: object = None
  tiles: ChannelTiles | None = None

  def vjp(self, d, x, y, g):
    """``(dx, dy, dg)`` from the cotangent ``d [C, C]`` of ``matrix``; x, y
    ``[C, K]`` values, g the gate ``[C]`` or ``[C, K]``. ``dg`` is the gate's
    share at ``[C]`` or ``[C, K]``: per channel ``x dx - y dy`` (each term
    is ``x_ik y_jk exp(g_ik - g_jk)``), for W = 1 summed over K."""
    if self.tiles is None:
      d_e = (d * self.decay).astype(x.dtype)
      p = d * self.matrix
      return (self.dot(d_e, y), self.dot(d_e, x, trans_a=True),
              jnp.sum(p, axis=1) - jnp.sum(p, axis=0))
    dx, dy = self.tiles.vjp(d)
    return dx, dy, x.astype(dx.dtype) * dx - y.astype(dy.dtype) * dy


def scores(x_ref, y_ref, g_ref, cuts_ref, *, x, y, g, cuts, strict,
           dot) -> Scores:
  """The decayed scores of one chunk on ``j < i`` (``strict``) or ``j <= i``.

  Args:
    x_ref, y_ref, g_ref, cuts_ref: the chunk's refs (read for W = K; cuts_ref
      may be None).
    x, y: ``[C, K]`` values of x_ref, y_ref; g, cuts: ``[C]`` (W = 1) or
      ``[C, K]`` float32 gate and ``[C]`` cut counts (or None).
  """
  if not core.per_channel(g):
    e = core.decay(g, g, core.causal(x.shape[0], strict=strict), cuts, cuts)
    return Scores(dot(x, y, trans_b=True) * e, dot, decay=e)
  tiles = ChannelTiles(x_ref, y_ref, g_ref, cuts_ref, strict, dot)
  return Scores(tiles.matrix(), dot, tiles=tiles)
