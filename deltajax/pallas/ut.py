"""UT transform kernels: per chunk, ``T = (I + A)^-1``, then ``W`` and ``U``.

``A = diag(b) (Gamma * K K^T)`` (GDN seed, section 2.3) is strictly lower, so
``I + A`` is unit lower triangular: never singular, no pivoting. It is
inverted by blocks of 16: the diagonal blocks by forward substitution, the
blocks below by block forward substitution,
``T_ij = -T_ii sum_{j <= m < i} A_im T_mj``, with dots of Triton's minimum
size; the blocks are then assembled into one ``[C, C]`` value. Substitution,
unlike a power series of ``A``, stays accurate for aligned keys with ``b``
near 2 (tests/test_pallas.py). A second kernel forms ``W = T diag(b) (K e^g)``
and ``U = T diag(b) V`` for the backward; the forward scan applies T itself.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from deltajax.pallas import core
from deltajax.pallas.core import SUB


def _invert_unit_lower_blocks(a):
  """``(I + a_i)^-1`` for strictly lower ``a [n, 16, 16]``, all n at once, row by row."""
  rows, cols = core.iota(a.shape, 1), core.iota(a.shape, 2)
  eye = (rows == cols).astype(a.dtype)
  t = eye
  for r in range(1, a.shape[1]):
    # T[r] = e_r - sum_{j < r} a[r, j] T[j]; rows j < r of t are final.
    a_r = jnp.sum(jnp.where(rows == r, a, 0), axis=1)
    t = jnp.where(rows == r,
                  eye - jnp.sum(a_r[:, :, None] * t, axis=1)[:, None, :], t)
  return t


def _stack(blocks):
  """``[16, 16]`` values -> ``[n, 16, 16]`` (no concatenation in Triton)."""
  n = len(blocks)
  which = core.iota((n, SUB, SUB), 0)
  return sum(jnp.where(which == i, x[None], 0) for i, x in enumerate(blocks))


def _unstack(x):
  """Inverse of :func:`_stack`: ``[n, 16, 16]`` -> n ``[16, 16]`` values."""
  which = core.iota(x.shape, 0)
  return [jnp.sum(jnp.where(which == i, x, 0), axis=0)
          for i in range(x.shape[0])]


def inverse_blocks(a_block, n: int, precision: str = "ieee"):
  """Blocks ``T[i, j]`` (``j <= i``) of ``(I + A)^-1``, A strictly lower.

  The n diagonal blocks are inverted together (15 substitution steps on
  ``[n, 16, 16]``), then the blocks below them by ``[16, 16]`` products in
  ``precision`` (:func:`core.mm`).

  Args:
    a_block: ``a_block(i, j)`` gives the float32 ``[16, 16]`` block
      ``A[i, j]`` (``j <= i``), strictly lower when ``i == j``.
    n: number of 16-blocks in the chunk.
  """
  a = {(i, m): a_block(i, m) for i in range(n) for m in range(i + 1)}
  diagonal = _unstack(_invert_unit_lower_blocks(
      _stack([a[i, i] for i in range(n)])))
  mm = functools.partial(core.mm, precision=precision)
  t = {}
  for i in range(n):
    t[i, i] = diagonal[i]
    for j in range(i):
      t[i, j] = -mm(t[i, i], sum(mm(a[i, m], t[m, j]) for m in range(j, i)))
  return t


def _assemble(t, n):
  """The ``[C, C]`` lower block-triangular matrix from its ``[16, 16]`` blocks."""
  shape = (n, SUB, n, SUB)
  bi, bj = core.iota(shape, 0), core.iota(shape, 2)
  full = sum(jnp.where((bi == i) & (bj == j), x[None, :, None, :], 0)
             for (i, j), x in t.items())
  return full.reshape(n * SUB, n * SUB)


def kk_matrix(k, g):
  """``Gamma * K K^T`` on the strict lower triangle, ``[C, C]``; g ``[C]``."""
  e = core.decay(g, g, core.causal(k.shape[0], strict=True))
  return core.mm(k, k, trans_b=True) * e, e


def _inverse_kernel(k_ref, g_ref, b_ref, t_ref):
  """One chunk: ``k [C, K]``, ``g, b [C]`` -> ``T [C, C]``."""
  n = k_ref.shape[0] // SUB
  sub = [pl.ds(i * SUB, SUB) for i in range(n)]
  acc = core.accumulator(k_ref.dtype)
  k = [k_ref[s, :] for s in sub]
  g = [g_ref[s].astype(acc) for s in sub]
  beta = [b_ref[s].astype(acc) for s in sub]

  def a_block(i, j):
    mask = core.causal(SUB, strict=True) if i == j else True
    return (beta[i][:, None] * core.mm(k[i], k[j], trans_b=True)
            * core.decay(g[i], g[j], mask))

  # T is used in k's dtype: for 16-bit inputs, one TF32 pass (10-bit
  # mantissas) is more than enough; float32 inputs get exact products.
  precision = "ieee" if k_ref.dtype == jnp.float32 else "tf32"
  t_ref[...] = _assemble(inverse_blocks(a_block, n, precision),
                         n).astype(t_ref.dtype)


def _w_u_kernel(k_ref, v_ref, g_ref, b_ref, t_ref, w_ref, u_ref):
  """One chunk: ``[W | U] = T diag(b) [K e^g | V]``."""
  acc = core.accumulator(k_ref.dtype)
  g, beta = g_ref[...].astype(acc), b_ref[...].astype(acc)
  t = t_ref[...]
  x_k = (beta * jnp.exp(g))[:, None] * k_ref[...].astype(acc)
  x_v = beta[:, None] * v_ref[...].astype(acc)
  w_ref[...] = core.mm(t, x_k.astype(t.dtype)).astype(w_ref.dtype)
  u_ref[...] = core.mm(t, x_v.astype(t.dtype)).astype(u_ref.dtype)


def _chunk_specs(chunk_size):
  """BlockSpec makers for grid ``(B, H, N)``: token rows, gates, ``[C, C]`` blocks."""
  c = chunk_size
  tok = lambda d: core.block(None, c, None, d)(lambda i, j, n: (i, n, j, 0))
  gate = core.block(None, None, c)(lambda i, j, n: (i, j, n))
  square = core.block(None, None, c, c)(lambda i, j, n: (i, j, n, 0))
  return tok, gate, square


def inverse(k, g, b, *, chunk_size, num_warps=1, num_stages=1):
  """``T = (I + A)^-1`` of every chunk.

  Args:
    k: ``[B, T, H, K]`` (K a power of two); g: ``[B, H, T]`` chunk-local
      cumulative log gate; b: ``[B, H, T]``.

  Returns:
    ``t [B, H, T, C]`` in k's dtype: each chunk's ``[C, C]`` inverse at its
    rows.
  """
  bsz, t_len, h, dk = k.shape
  tok, gate, square = _chunk_specs(chunk_size)
  return core.call(
      _inverse_kernel, grid=(bsz, h, t_len // chunk_size),
      in_specs=[tok(dk), gate, gate], out_specs=square,
      out_shape=jax.ShapeDtypeStruct((bsz, h, t_len, chunk_size), k.dtype),
      num_warps=num_warps, num_stages=num_stages,
      name="deltajax_ut_inverse")(k, g, b)


def w_u(k, v, g, b, t, *, chunk_size, num_warps=4, num_stages=1):
  """``W = T diag(b) (K e^g)`` and ``U = T diag(b) V``, chunk by chunk.

  The forward scan never forms them (:func:`state.forward_scan`); the
  backward does, from the forward's T.

  Args:
    k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g, b: ``[B, H, T]``;
    t: ``[B, H, T, C]`` from :func:`inverse`.

  Returns:
    ``(w [B, T, H, K], u [B, T, H, V])`` in k's dtype.
  """
  bsz, t_len, h, dk = k.shape
  dv = v.shape[-1]
  tok, gate, square = _chunk_specs(chunk_size)
  return core.call(
      _w_u_kernel, grid=(bsz, h, t_len // chunk_size),
      in_specs=[tok(dk), tok(dv), gate, gate, square],
      out_specs=[tok(dk), tok(dv)],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype),
                 jax.ShapeDtypeStruct(v.shape, v.dtype)],
      num_warps=num_warps, num_stages=num_stages,
      name="deltajax_ut_w_u")(k, v, g, b, t)


def _ut_backward_kernel(k_ref, v_ref, g_ref, b_ref, t_ref, w_ref, u_ref,
                        s_ref, dnext_ref, delta_ref, dd_ref, dk_out_ref,
                        dg_out_ref, dk_ref, dv_ref, db_ref, da_ref, *,
                        block_v):
  """One chunk of the backward through ``Delta = U - W S``, the chunk-end
  decays and the UT transform (the steps of ``chunked._bwd`` after the scan),
  adding the output's shares ``dk_out``, ``dg_out``."""
  k = k_ref[...]
  dtype, acc = k.dtype, core.accumulator(k.dtype)
  c = k.shape[0]
  g, beta = g_ref[...].astype(acc), b_ref[...].astype(acc)
  v_blocks = core.blocks(v_ref.shape[1], block_v)
  # Chunk-end decays, S' = e^{g_C} S + (K e^{g_C - g})^T Delta, and
  # Delta = U - W S: the sums over V.
  d_k_end, d_s_sum, d_w = 0, 0, 0
  for vs in v_blocks:
    s, d_next = s_ref[:, vs], dnext_ref[:, vs]
    d_k_end += core.mm(delta_ref[:, vs].astype(dtype), d_next.astype(dtype),
                       trans_b=True)
    d_s_sum += jnp.sum(d_next * s)
    d_w -= core.mm(dd_ref[:, vs].astype(dtype), s.astype(dtype), trans_b=True)
  # Each cotangent piece is folded into dk, dg, db as soon as it is known,
  # so few [C, K] float32 tiles are live at once (register pressure).
  g_end = core.last(g)
  to_end = jnp.exp(g_end - g)[:, None]
  k_acc = k.astype(acc)
  k_end = k_acc * to_end
  dk = dk_out_ref[...] + d_k_end * to_end
  dg = dg_out_ref[...] - jnp.sum(k_end * d_k_end, axis=1)
  d_g_end = jnp.sum(k_end * d_k_end) + jnp.exp(g_end) * d_s_sum
  # [W | U] = T diag(b) [K e^g | V]: d[W | U] -> dX = T^T d[W | U], dM.
  t = t_ref[...].astype(dtype)
  d_xk = core.mm(t, d_w.astype(dtype), trans_a=True)
  d_m = -core.mm(d_xk.astype(dtype), w_ref[...], trans_b=True)
  eg = jnp.exp(g)[:, None]
  d_xk_kg = d_xk * k_acc * eg
  db = jnp.sum(d_xk_kg, axis=1)
  dg += beta * db
  dk += (beta[:, None] * eg) * d_xk
  for vs in v_blocks:
    d_xv = core.mm(t, dd_ref[:, vs].astype(dtype), trans_a=True)
    dv_ref[:, vs] = (beta[:, None] * d_xv).astype(dv_ref.dtype)
    db += jnp.sum(d_xv * v_ref[:, vs], axis=1)
    d_m -= core.mm(d_xv.astype(dtype), u_ref[:, vs], trans_b=True)
  kk, e = kk_matrix(k, g)
  db_ref[...] = db + jnp.sum(d_m * kk, axis=1)
  d_kk = beta[:, None] * d_m
  p = d_kk * kk
  dg += jnp.sum(p, axis=1) - jnp.sum(p, axis=0)
  d_kk_e = (d_kk * e).astype(dtype)
  dk_ref[...] = (dk + core.mm(d_kk_e, k) + core.mm(d_kk_e, k, trans_a=True)
                 ).astype(dk_ref.dtype)
  dg += jnp.where(core.iota((c,), 0) == c - 1, d_g_end, 0)
  # g is the cumulative sum of a within the chunk: da is the reverse cumsum.
  rows, cols = core.iota((c, c), 0), core.iota((c, c), 1)
  da_ref[...] = jnp.sum(jnp.where(cols >= rows, dg[None, :], 0), axis=1)


def ut_backward(k, v, g, b, t, w, u, states, d_next, delta, d_delta, dk_out,
                dg_out, *, chunk_size, block_v=64, num_warps=4, num_stages=2):
  """Cotangents of the parallel stages around the state scan.

  Args:
    k, w: ``[B, T, H, K]``; v, u, delta: ``[B, T, H, V]``; g, b: ``[B, H, T]``;
    t: ``[B, H, T, C]`` from :func:`inverse`; states, d_next:
    ``[B, H, N, K, V]``; d_delta: ``[B, T, H, V]``; dk_out ``[B, T, H, K]``
    and dg_out ``[B, H, T]``: the output's shares of dk and dg.

  Returns:
    ``(dk, dv, db, da)``: ``[B, T, H, K]`` and ``[B, T, H, V]`` in k's and v's
    dtypes, ``[B, H, T]`` and ``[B, H, T]`` float32.
  """
  bsz, t_len, h, dk = k.shape
  dv, c = v.shape[-1], chunk_size
  acc = core.accumulator(k.dtype)
  tok, gate, square = _chunk_specs(c)
  keys, vals = tok(dk), tok(dv)
  state = core.block(None, None, None, dk, dv)(lambda i, j, n: (i, j, n, 0, 0))
  return core.call(
      functools.partial(_ut_backward_kernel, block_v=block_v),
      grid=(bsz, h, t_len // c),
      in_specs=[keys, vals, gate, gate, square,
                keys, vals, state, state, vals, vals, keys, gate],
      out_specs=[keys, vals, gate, gate],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype),
                 jax.ShapeDtypeStruct(v.shape, v.dtype),
                 jax.ShapeDtypeStruct(g.shape, acc),
                 jax.ShapeDtypeStruct(g.shape, acc)],
      num_warps=num_warps, num_stages=num_stages,
      name="deltajax_ut_backward")(k, v, g, b, t, w, u, states, d_next, delta,
                                   d_delta, dk_out, dg_out)
