"""The state scan over chunks, forward and backward: the only sequential kernels.

One program per (batch, head, V block) walks the chunks with the state
``[K, BV]`` in registers, in float32. Only what depends on the carried state
stays on this path (ANCHORS: the sequential path is latency-bound): forward,
``Delta = U - W S`` and the state update; backward, the state cotangent.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from deltajax.pallas import core


def _forward_kernel(w_ref, u_ref, k_end_ref, g_ref, s0_ref,
                    delta_ref, states_ref, final_ref, *, chunk_size):
  c = chunk_size
  dtype, acc = w_ref.dtype, final_ref.dtype

  def chunk(n, s):
    rows = pl.ds(n * c, c)
    states_ref[n] = s.astype(states_ref.dtype)
    delta = u_ref[rows, :].astype(acc) - core.mm(w_ref[rows, :], s.astype(dtype))
    delta_ref[rows, :] = delta.astype(delta_ref.dtype)
    decay = jnp.exp(core.last(g_ref[rows].astype(acc)))
    return decay * s + core.mm(k_end_ref[rows, :], delta.astype(dtype),
                               trans_a=True)

  s = lax.fori_loop(0, w_ref.shape[0] // c, chunk, s0_ref[...].astype(acc))
  final_ref[...] = s


def _backward_kernel(q_ref, k_end_ref, w_ref, g_ref, do_ref, dd_ref, dfinal_ref,
                     d_delta_ref, d_next_ref, d_initial_ref, *, chunk_size,
                     scale):
  c = chunk_size
  n_chunks = w_ref.shape[0] // c
  dtype, acc = w_ref.dtype, d_initial_ref.dtype

  def load(n):
    rows = pl.ds(n * c, c)
    return (q_ref[rows, :], k_end_ref[rows, :], w_ref[rows, :], g_ref[rows],
            do_ref[rows, :], dd_ref[rows, :])

  def chunk(i, carry):
    # The previous chunk's tiles are loaded before this chunk's products, so
    # their latency is hidden (measured faster than Triton's pipelining here,
    # but slower in the forward scan).
    ds, (q, k_end, w, g, d_o, dd) = carry
    n = n_chunks - 1 - i
    next_tiles = load(jnp.maximum(n - 1, 0))
    d_next_ref[n] = ds.astype(d_next_ref.dtype)
    g = g.astype(acc)
    d_delta = dd + core.mm(k_end, ds.astype(dtype))
    d_delta_ref[pl.ds(n * c, c), :] = d_delta
    qg = q.astype(acc) * (scale * jnp.exp(g))[:, None]
    ds = (core.mm(qg.astype(dtype), d_o.astype(dtype), trans_a=True)
          + jnp.exp(core.last(g)) * ds
          - core.mm(w, d_delta.astype(dtype), trans_a=True))
    return ds, next_tiles

  d_initial_ref[...], _ = lax.fori_loop(
      0, n_chunks, chunk, (dfinal_ref[...].astype(acc), load(n_chunks - 1)))


def _pipeline_stages(stage_bytes, most=3, budget=176 * 1024):
  """Pipeline depth for a chunk loop: Triton keeps one copy of each step's
  loaded tiles per stage in shared memory (232 KB on the H200; the rest of
  the kernel took 32 KB at K = 256)."""
  return max(1, min(most, budget // stage_bytes))


def forward_scan(w, u, k_end, g, initial_state, *, chunk_size, block_v=64,
                 num_warps=4, num_stages=None):
  """``Delta = U - W S`` and ``S' = e^{g_C} S + (K e^{g_C - g})^T Delta``, chunk by chunk.

  Args:
    w, k_end: ``[B, T, H, K]``; u: ``[B, T, H, V]``; g: ``[B, H, T]``;
    initial_state: ``[B, H, K, V]`` float32 (float64 in interpret mode).

  Returns:
    ``(delta [B, T, H, V] in u's dtype, states [B, H, N, K, V] (each chunk's
    entry state, in k's dtype), final_state [B, H, K, V])``.
  """
  bsz, t_len, h, dk = w.shape
  dv, bv = u.shape[-1], min(u.shape[-1], block_v)
  n = t_len // chunk_size
  acc = initial_state.dtype
  if num_stages is None:  # W, K e^{g_C - g} and U tiles of one chunk
    num_stages = _pipeline_stages(
        chunk_size * (2 * dk + bv) * w.dtype.itemsize)
  seq = lambda d: core.block(None, t_len, None, d)
  state = core.block(None, None, dk, bv)(lambda i, j, v: (i, j, 0, v))
  states = core.block(None, None, n, dk, bv)(lambda i, j, v: (i, j, 0, 0, v))
  return core.call(
      lambda *refs: _forward_kernel(*refs, chunk_size=chunk_size),
      grid=(bsz, h, dv // bv),
      in_specs=[seq(dk)(lambda i, j, v: (i, 0, j, 0)),
                seq(bv)(lambda i, j, v: (i, 0, j, v)),
                seq(dk)(lambda i, j, v: (i, 0, j, 0)),
                core.block(None, None, t_len)(lambda i, j, v: (i, j, 0)),
                state],
      out_specs=[seq(bv)(lambda i, j, v: (i, 0, j, v)), states, state],
      out_shape=[jax.ShapeDtypeStruct(u.shape, u.dtype),
                 jax.ShapeDtypeStruct((bsz, h, n, dk, dv), w.dtype),
                 jax.ShapeDtypeStruct((bsz, h, dk, dv), acc)],
      num_warps=num_warps, num_stages=num_stages,
      name="deltajax_state_forward")(w, u, k_end, g, initial_state)


def backward_scan(q, k_end, w, g, d_o, d_delta_local, d_final, *, chunk_size,
                  scale, block_v=64, num_warps=8, num_stages=1):
  """Reverse scan for the state cotangent.

  With ``dS`` the cotangent of a chunk's exit state::

    dDelta = dDelta_local + (K e^{g_C - g}) dS
    dS_in  = (scale Q e^g)^T dO + e^{g_C} dS - W^T dDelta

  Args:
    q, k_end, w: ``[B, T, H, K]``; g: ``[B, H, T]``; d_o: ``[B, T, H, V]``;
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
          q, k_end, w, g, d_o, d_delta_local, d_final)
