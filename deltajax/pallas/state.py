"""The state scan over chunks, forward and backward: the only sequential kernels.

One program per (batch, head, V block) walks the chunks with the state
``[K, BV]`` in registers, in float32. Only what depends on the carried state
stays on this path (ANCHORS: the sequential path is latency-bound): forward,
``Delta`` and the state update; backward, the state cotangent.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from deltajax.pallas import core


def _forward_kernel(t_ref, k_ref, v_ref, g_ref, b_ref, s0_ref,
                    delta_ref, states_ref, final_ref, *, chunk_size):
  c = chunk_size
  dtype, acc = k_ref.dtype, final_ref.dtype

  def chunk(n, s):
    rows = pl.ds(n * c, c)
    states_ref[n] = s.astype(states_ref.dtype)
    k = k_ref[rows, :]
    g, beta = g_ref[rows].astype(acc), b_ref[rows].astype(acc)
    g_end = g_ref[n * c + c - 1].astype(acc)
    # Delta = U - W S = T diag(b) (V - e^g K S): W and U are never formed.
    y = beta[:, None] * (v_ref[rows, :].astype(acc)
                         - jnp.exp(g)[:, None] * core.mm(k, s.astype(dtype)))
    delta = core.mm(t_ref[rows, :], y.astype(dtype))
    delta_ref[rows, :] = delta.astype(delta_ref.dtype)
    delta_end = (delta * jnp.exp(g_end - g)[:, None]).astype(dtype)
    return jnp.exp(g_end) * s + core.mm(k, delta_end, trans_a=True)

  s = lax.fori_loop(0, k_ref.shape[0] // c, chunk, s0_ref[...].astype(acc))
  final_ref[...] = s


def _backward_kernel(q_ref, k_ref, w_ref, g_ref, do_ref, dd_ref, dfinal_ref,
                     d_delta_ref, d_next_ref, d_initial_ref, *, chunk_size,
                     scale):
  c = chunk_size
  n_chunks = w_ref.shape[0] // c
  dtype, acc = w_ref.dtype, d_initial_ref.dtype

  def load(n):
    rows = pl.ds(n * c, c)
    return (q_ref[rows, :], k_ref[rows, :], w_ref[rows, :], g_ref[rows],
            g_ref[n * c + c - 1], do_ref[rows, :], dd_ref[rows, :])

  def chunk(i, carry):
    # The previous chunk's tiles are loaded before this chunk's products, so
    # their latency is hidden (measured faster than Triton's pipelining here,
    # but slower in the forward scan).
    ds, (q, k, w, g, g_end, d_o, dd) = carry
    n = n_chunks - 1 - i
    next_tiles = load(jnp.maximum(n - 1, 0))
    d_next_ref[n] = ds.astype(d_next_ref.dtype)
    g, g_end = g.astype(acc), g_end.astype(acc)
    d_delta = dd + jnp.exp(g_end - g)[:, None] * core.mm(k, ds.astype(dtype))
    d_delta_ref[pl.ds(n * c, c), :] = d_delta
    qg = q.astype(acc) * (scale * jnp.exp(g))[:, None]
    ds = (core.mm(qg.astype(dtype), d_o.astype(dtype), trans_a=True)
          + jnp.exp(g_end) * ds
          - core.mm(w, d_delta.astype(dtype), trans_a=True))
    return ds, next_tiles

  d_initial_ref[...], _ = lax.fori_loop(
      0, n_chunks, chunk, (dfinal_ref[...].astype(acc), load(n_chunks - 1)))


def _pipeline_stages(stage_bytes, most=3, budget=176 * 1024):
  """Pipeline depth for a chunk loop: Triton keeps one copy of each step's
  loaded tiles per stage in shared memory (232 KB on the H200; the rest of
  the kernel took 32 KB at K = 256)."""
  return max(1, min(most, budget // stage_bytes))


def forward_scan(t, k, v, g, b, initial_state, *, chunk_size, block_v=64,
                 num_warps=4, num_stages=None):
  """``Delta = T diag(b) (V - e^g K S)`` (= ``U - W S``) and
  ``S' = e^{g_C} S + K^T (e^{g_C - g} Delta)``, chunk by chunk.

  Args:
    t: ``[B, H, T, C]`` from :func:`ut.inverse`; k: ``[B, T, H, K]``;
    v: ``[B, T, H, V]``; g, b: ``[B, H, T]``; initial_state: ``[B, H, K, V]``
    float32 (float64 in interpret mode).

  Returns:
    ``(delta [B, T, H, V] in v's dtype, states [B, H, N, K, V] (each chunk's
    entry state, in k's dtype), final_state [B, H, K, V])``.
  """
  bsz, t_len, h, dk = k.shape
  dv, bv = v.shape[-1], min(v.shape[-1], block_v)
  c = chunk_size
  n = t_len // c
  acc = initial_state.dtype
  if num_stages is None:  # T, K and V tiles of one chunk
    num_stages = _pipeline_stages(c * (c + dk + bv) * k.dtype.itemsize)
  seq = lambda d: core.block(None, t_len, None, d)
  gate = core.block(None, None, t_len)(lambda i, j, x: (i, j, 0))
  state = core.block(None, None, dk, bv)(lambda i, j, x: (i, j, 0, x))
  states = core.block(None, None, n, dk, bv)(lambda i, j, x: (i, j, 0, 0, x))
  return core.call(
      lambda *refs: _forward_kernel(*refs, chunk_size=c),
      grid=(bsz, h, dv // bv),
      in_specs=[core.block(None, None, t_len, c)(lambda i, j, x: (i, j, 0, 0)),
                seq(dk)(lambda i, j, x: (i, 0, j, 0)),
                seq(bv)(lambda i, j, x: (i, 0, j, x)), gate, gate, state],
      out_specs=[seq(bv)(lambda i, j, x: (i, 0, j, x)), states, state],
      out_shape=[jax.ShapeDtypeStruct(v.shape, v.dtype),
                 jax.ShapeDtypeStruct((bsz, h, n, dk, dv), k.dtype),
                 jax.ShapeDtypeStruct((bsz, h, dk, dv), acc)],
      num_warps=num_warps, num_stages=num_stages,
      name="deltajax_state_forward")(t, k, v, g, b, initial_state)


def backward_scan(q, k, w, g, d_o, d_delta_local, d_final, *, chunk_size,
                  scale, block_v=64, num_warps=8, num_stages=1):
  """Reverse scan for the state cotangent.

  With ``dS`` the cotangent of a chunk's exit state::

    dDelta = dDelta_local + e^{g_C - g} (K dS)
    dS_in  = (scale Q e^g)^T dO + e^{g_C} dS - W^T dDelta

  Args:
    q, k, w: ``[B, T, H, K]``; g: ``[B, H, T]``; d_o: ``[B, T, H, V]``;
    d_delta_local: ``[B, T, H, V]`` float32, the output's share of dDelta;
    d_final: ``[B, H, K, V]``.

  Returns:
    ``(d_delta [B, T, H, V], d_next [B, H, N, K, V] in k's dtype, d_initial
    [B, H, K, V])``.
  """
  bsz, t_len, h, dk = q.shape
  dv, bv = d_o.shape[-1], min(d_o.shape[-1], block_v)
  n = t_len // chunk_size
  acc = d_final.dtype
  seq = lambda d: core.block(None, t_len, None, d)
  keys = seq(dk)(lambda i, j, v: (i, 0, j, 0))
  vals = seq(bv)(lambda i, j, v: (i, 0, j, v))
  state = core.block(None, None, dk, bv)(lambda i, j, v: (i, j, 0, v))
  states = core.block(None, None, n, dk, bv)(lambda i, j, v: (i, j, 0, 0, v))
  return core.call(
      lambda *refs: _backward_kernel(*refs, chunk_size=chunk_size,
                                     scale=scale),
      grid=(bsz, h, dv // bv),
      in_specs=[keys, keys, keys,
                core.block(None, None, t_len)(lambda i, j, v: (i, j, 0)),
                vals, vals, state],
      out_specs=[vals, states, state],
      out_shape=[jax.ShapeDtypeStruct(d_o.shape, acc),
                 jax.ShapeDtypeStruct((bsz, h, n, dk, dv), w.dtype),
                 jax.ShapeDtypeStruct((bsz, h, dk, dv), acc)],
      num_warps=num_warps, num_stages=num_stages,
      name="deltajax_state_backward")(
          q, k, w, g, d_o, d_delta_local, d_final)
