"""Intra-chunk kernels of a per-channel (KDA) gate: the scores, formed once.

Forward (:func:`forward`), parallel over (batch, value head, chunk): the
strictly lower ``A = Gamma * K K^T`` of the UT system and the output's causal
``P = scale Gamma * Q K^T``, ``[C, C]`` per chunk, by the tiles of
:class:`scores.ChannelTiles`. :func:`ut.inverse` and the output kernels then
work on plain matrices, as for a scalar gate.

Backward (:func:`backward`): the output and UT kernels leave the cotangents
``dP`` and ``dM`` (of ``M = diag(b) A``) as matrices; one kernel turns them
into the scores' shares of dq, dk, db and the per-channel gate's, adds the
other kernels' shares, and sums the gate's cotangent into ``da`` (reverse
cumulative sum within the chunk, the gate being the cumulative sum of a).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from deltajax.pallas import core
from deltajax.pallas import scores
from deltajax.pallas.core import SUB


def _tiles(q_ref, k_ref, g_ref, cuts_ref, dot):
  """P's (causal, rows q) and A's (strict, rows k) tiles, both against k."""
  return scores.ChannelTiles(xs=(q_ref, k_ref), strict=(False, True),
                             y_ref=k_ref, g_ref=g_ref, cuts_ref=cuts_ref,
                             dot=dot)


def _tile(i: int, j: int):
  """The ref index of tile (i, j) of a ``[C, C]`` block."""
  return pl.ds(i * SUB, SUB), pl.ds(j * SUB, SUB)


def _forward_kernel(*, q_ref, k_ref, g_ref, cuts_ref, a_ref, p_ref, scale,
                    dot):
  tiles = _tiles(q_ref, k_ref, g_ref, cuts_ref, dot)
  zeros = jnp.zeros((SUB, SUB), jnp.float32)
  for i in range(tiles.n):
    qk, kk = tiles.row(i)
    for j in range(tiles.n):
      at = _tile(i, j)
      p_ref[at] = (scale * qk[j] if j <= i else zeros).astype(p_ref.dtype)
      a_ref[at] = (kk[j] if j <= i else zeros).astype(a_ref.dtype)


def _backward_kernel(*, q_ref, k_ref, g_ref, b_ref, cuts_ref, dp_ref, dm_ref,
                     dq_in_ref, dk_in_ref, dg_in_ref, db_in_ref, dq_ref,
                     dk_ref, da_ref, db_ref, scale, dot):
  """``dq = dq_in + (P's row side)``, ``dk = dk_in + b u + (both y sides)``,
  ``db = db_in + k . u``, ``da = reverse cumsum of (dg_in + q dq_P +
  k (b u - dy))``, with u A's row-side VJP of dM (``dA = diag(b) dM``, and
  ``sum_j dM_ij A_ij = k_i . u_i``)."""
  tiles = _tiles(q_ref, k_ref, g_ref, cuts_ref, dot)
  acc = core.accumulator(k_ref.dtype)
  n = tiles.n
  dq_p, u, dy = {}, {}, [0] * n
  for i in range(n):
    beta = b_ref[pl.ds(i * SUB, SUB)].astype(acc)[:, None]
    d_p = [(scale * dp_ref[_tile(i, j)],) * 2 for j in range(i + 1)]
    d_m = [(dm_ref[_tile(i, j)], beta * dm_ref[_tile(i, j)])
           for j in range(i + 1)]
    (dq_p[i], u[i]), dy_i = tiles.row_vjp(i, [d_p, d_m])
    for j, d in enumerate(dy_i):
      dy[j] += d
  later = 0  # the gate's cotangent summed over the blocks after this one
  for i in reversed(range(n)):
    rows = pl.ds(i * SUB, SUB)
    q, k = q_ref[rows, :].astype(acc), k_ref[rows, :].astype(acc)
    dk_a = b_ref[rows].astype(acc)[:, None] * u[i]
    dq_ref[rows, :] = (dq_in_ref[rows, :] + dq_p[i]).astype(dq_ref.dtype)
    dk_ref[rows, :] = (dk_in_ref[rows, :] + dk_a + dy[i]).astype(dk_ref.dtype)
    db_ref[rows] = db_in_ref[rows] + jnp.sum(k * u[i], axis=1)
    dg = dg_in_ref[rows, :] + q * dq_p[i] + k * (dk_a - dy[i])
    da_ref[rows, :] = core.reverse_cumsum(dg, dot) + later
    later += jnp.sum(dg, axis=0)[None, :]


def _specs(chunk_size, groups):
  """BlockSpec makers for grid ``(B, HV, N)``: q/k rows (head ``j // G``),
  value-head rows, the gate, ``[C, C]`` blocks, per-token values."""
  c = chunk_size
  return dict(
      qk=lambda d: core.block(None, c, None, d)(
          lambda i, j, n: (i, n, core.qk_head(j, groups), 0)),
      keys=lambda d: core.block(None, c, None, d)(
          lambda i, j, n: (i, n, j, 0)),
      g=lambda d: core.block(None, None, c, d)(lambda i, j, n: (i, j, n, 0)),
      square=core.block(None, None, c, c)(lambda i, j, n: (i, j, n, 0)),
      gate=core.block(None, None, c)(lambda i, j, n: (i, j, n)))


def forward(*, q, k, g, cuts, heads, scale, chunk_size, launch, interpret,
            dot):
  """The intra-chunk scores of every chunk.

  Args:
    q, k: ``[B, T, H, K]``; g: ``[B, HV, T, K]`` chunk-local cumulative log
    gate; cuts: ``[B, HV, T]`` int32 chunk-local cumulative cut count, or
    None; heads: HV.

  Returns:
    ``(a [B, HV, T, C] float32 (float64 for float64 inputs), p
    [B, HV, T, C] in q's dtype)``: each chunk's
    ``A = Gamma * K K^T`` (strictly lower) and ``P = scale Gamma * Q K^T``
    (causal) at its rows; 0 across a cut.
  """
  bsz, t_len, h, dk = k.shape
  sp = _specs(chunk_size, heads // h)
  per_chunk = (bsz, heads, t_len, chunk_size)
  acc = core.accumulator(k.dtype)
  return core.call(
      _forward_kernel, grid=(bsz, heads, t_len // chunk_size),
      inputs=dict(q_ref=(q, sp["qk"](dk)), k_ref=(k, sp["qk"](dk)),
                  g_ref=(g, sp["g"](dk)), cuts_ref=(cuts, sp["gate"])),
      outputs=dict(
          a_ref=(jax.ShapeDtypeStruct(per_chunk, acc), sp["square"]),
          p_ref=(jax.ShapeDtypeStruct(per_chunk, q.dtype), sp["square"])),
      launch=launch, interpret=interpret, name="deltajax_intra", scale=scale,
      dot=dot)


def backward(*, q, k, g, b, cuts, d_p, d_m, dq, dk, dg, db, scale, chunk_size,
             launch, interpret, dot):
  """The scores' VJP, added to the other kernels' shares.

  Args:
    q, k: ``[B, T, H, K]``; g: ``[B, HV, T, K]``; b: ``[B, HV, T]``; cuts:
    ``[B, HV, T]`` or None; d_p, d_m: ``[B, HV, T, C]`` float32, the
    cotangents of P and of ``M = diag(b) A``; dq, dk: ``[B, T, HV, K]``,
    dg: g's shape, db: b's shape: the other shares (all in the accumulator
    dtype: float32, float64 for float64 inputs).

  Returns:
    ``(dq, dk [B, T, HV, K]`` (in q's dtype without GVA, else float32 for the
    sum over the group), ``da`` (g's shape: the cotangent of the gate's
    increments; 0 is not forced at cuts), ``db [B, HV, T]``), in the
    accumulator dtype.
  """
  bsz, t_len, h, d = q.shape
  heads = g.shape[1]
  sp = _specs(chunk_size, heads // h)
  acc = core.accumulator(q.dtype)
  per_head = jax.ShapeDtypeStruct((bsz, t_len, heads, d),
                                  q.dtype if heads == h else acc)
  return core.call(
      _backward_kernel, grid=(bsz, heads, t_len // chunk_size),
      inputs=dict(q_ref=(q, sp["qk"](d)), k_ref=(k, sp["qk"](d)),
                  g_ref=(g, sp["g"](d)), b_ref=(b, sp["gate"]),
                  cuts_ref=(cuts, sp["gate"]), dp_ref=(d_p, sp["square"]),
                  dm_ref=(d_m, sp["square"]), dq_in_ref=(dq, sp["keys"](d)),
                  dk_in_ref=(dk, sp["keys"](d)), dg_in_ref=(dg, sp["g"](d)),
                  db_in_ref=(db, sp["gate"])),
      outputs=dict(
          dq_ref=(per_head, sp["keys"](d)), dk_ref=(per_head, sp["keys"](d)),
          da_ref=(jax.ShapeDtypeStruct(g.shape, acc), sp["g"](d)),
          db_ref=(jax.ShapeDtypeStruct(b.shape, acc), sp["gate"])),
      aliases=dict(dg_in_ref="da_ref", db_in_ref="db_ref"),
      launch=launch, interpret=interpret, name="deltajax_intra_backward",
      scale=scale, dot=dot)
