"""UT transform kernel: per chunk, ``T = (I + strictLower(A))^-1``, ``W`` and ``U``.

``A = diag(b) (Gamma * K K^T)`` (GDN seed, section 2.3). The unit lower
triangular system is inverted by blocks of 16: each diagonal block by forward
substitution, the blocks below it by block forward substitution,
``T_ij = -T_ii sum_{j <= m < i} A_im T_mj``, all dots of Triton's minimum size.
Then ``W = T diag(b) (K e^g)`` and ``U = T diag(b) V``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from deltajax.pallas import core
from deltajax.pallas.core import SUB


def invert_unit_lower(a):
  """``(I + a)^-1`` for a strictly lower ``[n, n]`` value, by forward substitution."""
  n = a.shape[0]
  rows, cols = core.iota(a.shape, 0), core.iota(a.shape, 1)
  eye = (rows == cols).astype(a.dtype)
  t = eye
  for r in range(1, n):
    # T[r] = e_r - sum_{j < r} a[r, j] T[j]; rows j < r of t are final.
    new_row = core.row(eye, r) - jnp.sum(core.row(a, r)[:, None] * t, axis=0)
    t = jnp.where(rows == r, new_row[None, :], t)
  return t


def _a_block(k, g, beta, i, j):
  """Block ``(i, j)`` of ``diag(b) (Gamma * K K^T)``, strict on the diagonal."""
  mask = core.causal(SUB, strict=True) if i == j else True
  return (beta[i][:, None] * core.mm(k[i], k[j], trans_b=True)
          * core.decay(g[i], g[j], mask))


def inverse_blocks(k, g, beta):
  """Blocks ``T[i, j]`` (``j <= i``) of ``(I + strictLower(A))^-1``.

  ``k``, ``g``, ``beta`` are lists of the chunk's 16-token sub-blocks.
  """
  n = len(k)
  t = {}
  for i in range(n):
    a = {m: _a_block(k, g, beta, i, m) for m in range(i + 1)}
    t[i, i] = invert_unit_lower(a[i])
    for j in range(i):
      acc = sum(core.mm(a[m], t[m, j]) for m in range(j, i))
      t[i, j] = -core.mm(t[i, i], acc)
  return t


def _ut_kernel(k_ref, v_ref, g_ref, b_ref, w_ref, u_ref, t_ref):
  """One chunk: ``k [C, K]``, ``v [C, V]``, ``g, b [C]`` -> ``W``, ``U``, ``T [C, C]``."""
  n = k_ref.shape[0] // SUB
  sub = [pl.ds(i * SUB, SUB) for i in range(n)]
  k = [k_ref[s, :] for s in sub]
  acc = t_ref.dtype
  g = [g_ref[s].astype(acc) for s in sub]
  beta = [b_ref[s].astype(acc) for s in sub]
  t = inverse_blocks(k, g, beta)
  dtype = k_ref.dtype
  x_k = [(beta[j][:, None] * jnp.exp(g[j])[:, None] * k[j]).astype(dtype)
         for j in range(n)]
  x_v = [(beta[j][:, None] * v_ref[sub[j], :]).astype(dtype) for j in range(n)]
  for i in range(n):
    t_i = [t[i, j].astype(dtype) for j in range(i + 1)]
    w_ref[sub[i], :] = sum(core.mm(t_i[j], x_k[j]) for j in range(i + 1)
                           ).astype(w_ref.dtype)
    u_ref[sub[i], :] = sum(core.mm(t_i[j], x_v[j]) for j in range(i + 1)
                           ).astype(u_ref.dtype)
    for j in range(n):
      t_ref[sub[i], sub[j]] = (t[i, j] if j <= i else
                               jnp.zeros((SUB, SUB), acc))


def ut_transform(k, v, g, b, *, chunk_size):
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
      name="deltajax_ut_transform")(k, v, g, b)


def _ut_backward_kernel(k_ref, v_ref, g_ref, b_ref, t_ref, w_ref, u_ref,
                        s_ref, dnext_ref, delta_ref, dd_ref,
                        dk_ref, dv_ref, db_ref, dg_ref):
  """One chunk of the backward through ``Delta = U - W S``, the chunk-end
  decays and the UT transform (the steps of ``chunked._bwd`` after the scan)."""
  k, v = k_ref[...], v_ref[...]
  dtype, acc = k.dtype, t_ref.dtype
  c = k.shape[0]
  g, beta = g_ref[...].astype(acc), b_ref[...].astype(acc)
  s, d_next = s_ref[...], dnext_ref[...]
  d_delta = dd_ref[...]
  g_end = core.last(g)
  to_end = jnp.exp(g_end - g)[:, None]
  k_end = k.astype(acc) * to_end
  # Chunk-end decays: S' = e^{g_C} S + (K e^{g_C - g})^T Delta.
  d_k_end = core.mm(delta_ref[...].astype(dtype), d_next.astype(dtype),
                    trans_b=True)
  d_g_end = (jnp.sum(k_end * d_k_end)
             + jnp.exp(g_end) * jnp.sum(d_next * s))
  # Delta = U - W S, then [W | U] = T diag(b) [K e^g | V].
  d_w = -core.mm(d_delta.astype(dtype), s.astype(dtype), trans_b=True)
  t = t_ref[...]
  d_xk = core.mm(t, d_w, trans_a=True)
  d_xv = core.mm(t, d_delta, trans_a=True)
  d_m = -(core.mm(d_xk.astype(dtype), w_ref[...], trans_b=True)
          + core.mm(d_xv.astype(dtype), u_ref[...], trans_b=True))
  e = core.decay(g, g, core.causal(c, strict=True))
  kk = core.mm(k, k, trans_b=True) * e
  kg = k.astype(acc) * jnp.exp(g)[:, None]
  db_ref[...] = (jnp.sum(d_xk * kg, axis=1) + jnp.sum(d_xv * v, axis=1)
                 + jnp.sum(d_m * kk, axis=1))
  d_kk = beta[:, None] * d_m
  d_kk_e = (d_kk * e).astype(dtype)
  d_kg = beta[:, None] * d_xk
  dk_ref[...] = (core.mm(d_kk_e, k) + core.mm(d_kk_e, k, trans_a=True)
                 + d_kg * jnp.exp(g)[:, None] + d_k_end * to_end)
  dv_ref[...] = beta[:, None] * d_xv
  p = d_kk * kk
  dg = (jnp.sum(p, axis=1) - jnp.sum(p, axis=0) + jnp.sum(d_kg * kg, axis=1)
        - jnp.sum(k_end * d_k_end, axis=1))
  dg_ref[...] = dg + jnp.where(core.iota((c,), 0) == c - 1, d_g_end, 0)


def ut_backward(k, v, g, b, t, w, u, states, d_next, delta, d_delta, *,
                chunk_size):
  """Cotangents of the parallel stages around the state scan.

  Args:
    k, w: ``[B, T, H, K]``; v, u, delta: ``[B, T, H, V]``; g, b: ``[B, H, T]``;
    t: ``[B, H, T, C]`` from :func:`ut_transform`; states, d_next:
    ``[B, H, N, K, V]``; d_delta: ``[B, T, H, V]``.

  Returns:
    ``(dk, dv, db, dg)``: ``[B, T, H, K]``, ``[B, T, H, V]``, ``[B, H, T]``,
    ``[B, H, T]``, float32; dk and dg are shares to add to the output's.
  """
  bsz, t_len, h, dk = k.shape
  dv, c = v.shape[-1], chunk_size
  acc = t.dtype
  keys = core.block(None, c, None, dk)(lambda i, j, n: (i, n, j, 0))
  vals = core.block(None, c, None, dv)(lambda i, j, n: (i, n, j, 0))
  gate = core.block(None, None, c)(lambda i, j, n: (i, j, n))
  state = core.block(None, None, None, dk, dv)(lambda i, j, n: (i, j, n, 0, 0))
  return core.call(
      _ut_backward_kernel, grid=(bsz, h, t_len // c),
      in_specs=[keys, vals, gate, gate,
                core.block(None, None, c, c)(lambda i, j, n: (i, j, n, 0)),
                keys, vals, state, state, vals, vals],
      out_specs=[keys, vals, gate, gate],
      out_shape=[jax.ShapeDtypeStruct(k.shape, acc),
                 jax.ShapeDtypeStruct(v.shape, acc),
                 jax.ShapeDtypeStruct(g.shape, acc),
                 jax.ShapeDtypeStruct(g.shape, acc)],
      name="deltajax_ut_backward")(k, v, g, b, t, w, u, states, d_next, delta,
                                   d_delta)
