"""UT transform kernel: per chunk, ``T = (I + strictLower(A))^-1``, ``W`` and ``U``.

``A = diag(b) (Gamma * K K^T)`` (GDN seed, section 2.3) is strictly lower, so
``I + A`` is unit lower triangular: never singular, no pivoting. ``T`` is
found by forward substitution, which stays accurate where power series of
``A`` cancel catastrophically (aligned keys with ``b`` near 2), but with full
chunk dots instead of ``C`` serial steps: the 16 x 16 diagonal blocks are
substituted together, one row of each per step (15 steps), then the blocks
below them one block row at a time,
``T[i, :i] = -T[i, i] A[i, :i] T[:i, :i]``.
Then ``W = T diag(b) (K e^g)`` and ``U = T diag(b) V``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from deltajax.pallas import core
from deltajax.pallas.core import SUB


def invert_unit_lower(a):
  """``(I + a)^-1`` for a strictly lower ``[C, C]`` value, C a multiple of 16."""
  rows, cols = core.iota(a.shape, 0), core.iota(a.shape, 1)
  eye = (rows == cols).astype(a.dtype)
  block_row, block_col = rows // SUB, cols // SUB
  diagonal = jnp.where(block_row == block_col, a, 0)
  t = eye
  for r in range(1, SUB):
    at_r = rows % SUB == r
    t = jnp.where(at_r, eye - core.mm(jnp.where(at_r, diagonal, 0), t), t)
  for i in range(1, a.shape[0] // SUB):
    left = (block_row == i) & (block_col < i)
    t_ii = jnp.where((block_row == i) & (block_col == i), t, 0)
    t = jnp.where(left, -core.mm(t_ii, core.mm(jnp.where(left, a, 0), t)), t)
  return t


def kk_matrix(k, g):
  """``Gamma * K K^T`` on the strict lower triangle, ``[C, C]``; g ``[C]``."""
  e = core.decay(g, g, core.causal(k.shape[0], strict=True))
  return core.mm(k, k, trans_b=True) * e, e


def _ut_kernel(k_ref, v_ref, g_ref, b_ref, w_ref, u_ref, t_ref):
  """One chunk: ``k [C, K]``, ``v [C, V]``, ``g, b [C]`` -> ``W``, ``U``, ``T [C, C]``."""
  k = k_ref[...]
  dtype, acc = k.dtype, t_ref.dtype
  g, beta = g_ref[...].astype(acc), b_ref[...].astype(acc)
  kk, _ = kk_matrix(k, g)
  t = invert_unit_lower(beta[:, None] * kk)
  t_ref[...] = t
  t = t.astype(dtype)
  x_k = beta[:, None] * jnp.exp(g)[:, None] * k.astype(acc)
  w_ref[...] = core.mm(t, x_k.astype(dtype)).astype(w_ref.dtype)
  x_v = beta[:, None] * v_ref[...].astype(acc)
  u_ref[...] = core.mm(t, x_v.astype(dtype)).astype(u_ref.dtype)


def ut_transform(k, v, g, b, *, chunk_size, num_warps=4, num_stages=1):
  """UT transform of every chunk.

  Args:
    k: ``[B, T, H, K]``; v: ``[B, T, H, V]`` (K, V padded to powers of two).
    g: ``[B, H, T]`` chunk-local cumulative log gate; b: ``[B, H, T]``.

  Returns:
    ``(w [B, T, H, K], u [B, T, H, V], t [B, H, T, C])``: W and U in k's
    dtype, and the inverse ``T`` of each chunk (the chunk's ``[C, C]`` block
    at its rows) in float32 (float64 for float64 inputs).
  """
  bsz, t_len, h, dk = k.shape
  dv = v.shape[-1]
  c = chunk_size
  tok = lambda d: core.block(None, c, None, d)(lambda i, j, n: (i, n, j, 0))
  gate = core.block(None, None, c)(lambda i, j, n: (i, j, n))
  acc = jnp.promote_types(k.dtype, jnp.float32)
  return core.call(
      _ut_kernel, grid=(bsz, h, t_len // c),
      in_specs=[tok(dk), tok(dv), gate, gate],
      out_specs=[tok(dk), tok(dv),
                 core.block(None, None, c, c)(lambda i, j, n: (i, j, n, 0))],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype),
                 jax.ShapeDtypeStruct(v.shape, v.dtype),
                 jax.ShapeDtypeStruct((bsz, h, t_len, c), acc)],
      num_warps=num_warps, num_stages=num_stages,
      name="deltajax_ut_transform")(k, v, g, b)


def _ut_backward_kernel(k_ref, v_ref, g_ref, b_ref, t_ref, w_ref, u_ref,
                        s_ref, dnext_ref, delta_ref, dd_ref, dk_out_ref,
                        dg_out_ref, dk_ref, dv_ref, db_ref, da_ref, *,
                        block_v):
  """One chunk of the backward through ``Delta = U - W S``, the chunk-end
  decays and the UT transform (the steps of ``chunked._bwd`` after the scan),
  adding the output's shares ``dk_out``, ``dg_out``."""
  k = k_ref[...]
  dtype, acc = k.dtype, t_ref.dtype
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
  g_end = core.last(g)
  to_end = jnp.exp(g_end - g)[:, None]
  k_end = k.astype(acc) * to_end
  d_g_end = jnp.sum(k_end * d_k_end) + jnp.exp(g_end) * d_s_sum
  # [W | U] = T diag(b) [K e^g | V]: d[W | U] -> dX = T^T d[W | U], dM.
  t = t_ref[...].astype(dtype)
  d_xk = core.mm(t, d_w.astype(dtype), trans_a=True)
  d_m = -core.mm(d_xk.astype(dtype), w_ref[...], trans_b=True)
  db = 0
  for vs in v_blocks:
    d_xv = core.mm(t, dd_ref[:, vs].astype(dtype), trans_a=True)
    dv_ref[:, vs] = (beta[:, None] * d_xv).astype(dv_ref.dtype)
    db += jnp.sum(d_xv * v_ref[:, vs], axis=1)
    d_m -= core.mm(d_xv.astype(dtype), u_ref[:, vs], trans_b=True)
  kk, e = kk_matrix(k, g)
  kg = k.astype(acc) * jnp.exp(g)[:, None]
  db_ref[...] = db + jnp.sum(d_xk * kg, axis=1) + jnp.sum(d_m * kk, axis=1)
  d_kk = beta[:, None] * d_m
  d_kk_e = (d_kk * e).astype(dtype)
  d_kg = beta[:, None] * d_xk
  dk_ref[...] = (core.mm(d_kk_e, k) + core.mm(d_kk_e, k, trans_a=True)
                 + d_kg * jnp.exp(g)[:, None] + d_k_end * to_end
                 + dk_out_ref[...]).astype(dk_ref.dtype)
  p = d_kk * kk
  dg = (jnp.sum(p, axis=1) - jnp.sum(p, axis=0) + jnp.sum(d_kg * kg, axis=1)
        - jnp.sum(k_end * d_k_end, axis=1) + dg_out_ref[...])
  dg += jnp.where(core.iota((c,), 0) == c - 1, d_g_end, 0)
  # g is the cumulative sum of a within the chunk: da is the reverse cumsum.
  rows, cols = core.iota((c, c), 0), core.iota((c, c), 1)
  da_ref[...] = jnp.sum(jnp.where(cols >= rows, dg[None, :], 0), axis=1)


def ut_backward(k, v, g, b, t, w, u, states, d_next, delta, d_delta, dk_out,
                dg_out, *, chunk_size, block_v=64, num_warps=4, num_stages=2):
  """Cotangents of the parallel stages around the state scan.

  Args:
    k, w: ``[B, T, H, K]``; v, u, delta: ``[B, T, H, V]``; g, b: ``[B, H, T]``;
    t: ``[B, H, T, C]`` from :func:`ut_transform`; states, d_next:
    ``[B, H, N, K, V]``; d_delta: ``[B, T, H, V]``; dk_out ``[B, T, H, K]``
    and dg_out ``[B, H, T]``: the output's shares of dk and dg.

  Returns:
    ``(dk, dv, db, da)``: ``[B, T, H, K]`` and ``[B, T, H, V]`` in k's and v's
    dtypes, ``[B, H, T]`` and ``[B, H, T]`` float32.
  """
  bsz, t_len, h, dk = k.shape
  dv, c = v.shape[-1], chunk_size
  acc = t.dtype
  keys = core.block(None, c, None, dk)(lambda i, j, n: (i, n, j, 0))
  vals = core.block(None, c, None, dv)(lambda i, j, n: (i, n, j, 0))
  gate = core.block(None, None, c)(lambda i, j, n: (i, j, n))
  state = core.block(None, None, None, dk, dv)(lambda i, j, n: (i, j, n, 0, 0))
  return core.call(
      functools.partial(_ut_backward_kernel, block_v=block_v),
      grid=(bsz, h, t_len // c),
      in_specs=[keys, vals, gate, gate,
                core.block(None, None, c, c)(lambda i, j, n: (i, j, n, 0)),
                keys, vals, state, state, vals, vals, keys, gate],
      out_specs=[keys, vals, gate, gate],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype),
                 jax.ShapeDtypeStruct(v.shape, v.dtype),
                 jax.ShapeDtypeStruct(g.shape, acc),
                 jax.ShapeDtypeStruct(g.shape, acc)],
      num_warps=num_warps, num_stages=num_stages,
      name="deltajax_ut_backward")(k, v, g, b, t, w, u, states, d_next, delta,
                                   d_delta, dk_out, dg_out)
