"""Output kernels, parallel over chunks: ``O = (scale Q e^g) S + (Gamma * scale Q K^T) Delta``."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deltajax.pallas import core


def _scores(q, k, g, scale):
  """``(Gamma * scale Q K^T, Gamma)`` on ``j <= i``; ``[C, C]``."""
  e = core.decay(g, g, core.causal(q.shape[0], strict=False))
  return core.mm(q, k, trans_b=True) * e * scale, e


def _output_kernel(q_ref, k_ref, g_ref, s_ref, delta_ref, o_ref, *, scale):
  q, k = q_ref[...], k_ref[...]
  dtype, acc = q.dtype, core.accumulator(q.dtype)
  g = g_ref[...].astype(acc)
  scores, _ = _scores(q, k, g, scale)
  qg = q.astype(acc) * (scale * jnp.exp(g))[:, None]
  o = (core.mm(qg.astype(dtype), s_ref[...].astype(dtype))
       + core.mm(scores.astype(dtype), delta_ref[...].astype(dtype)))
  o_ref[...] = o.astype(o_ref.dtype)


def _output_backward_kernel(q_ref, k_ref, g_ref, s_ref, delta_ref, do_ref,
                            dq_ref, dk_ref, dg_ref, dd_ref, *, scale, block_v):
  q, k = q_ref[...], k_ref[...]
  dtype, acc = q.dtype, core.accumulator(q.dtype)
  g = g_ref[...].astype(acc)
  scores, e = _scores(q, k, g, scale)
  scores_t = scores.astype(dtype)
  d_scores, d_qg = 0, 0
  for vs in core.blocks(dd_ref.shape[1], block_v):
    d_o = do_ref[:, vs].astype(dtype)
    d_scores += core.mm(d_o, delta_ref[:, vs].astype(dtype), trans_b=True)
    d_qg += core.mm(d_o, s_ref[:, vs].astype(dtype), trans_b=True)
    dd_ref[:, vs] = core.mm(scores_t, d_o, trans_a=True)
  qg = q.astype(acc) * (scale * jnp.exp(g))[:, None]
  d_qk = (d_scores * e * scale).astype(dtype)
  dq_ref[...] = (core.mm(d_qk, k) + d_qg * (scale * jnp.exp(g))[:, None]
                 ).astype(dq_ref.dtype)
  dk_ref[...] = core.mm(d_qk, q, trans_a=True)
  p = d_scores * scores
  dg_ref[...] = (jnp.sum(p, axis=1) - jnp.sum(p, axis=0)
                 + jnp.sum(d_qg * qg, axis=1))


def output(q, k, g, states, delta, *, chunk_size, scale, out_dtype,
           block_v=128, num_warps=4, num_stages=1):
  """Chunk outputs.

  Args:
    q, k: ``[B, T, H, K]``; g: ``[B, H, T]``; states: ``[B, H, N, K, V]``;
    delta: ``[B, T, H, V]``.

  Returns:
    ``o`` ``[B, T, H, V]`` in ``out_dtype``.
  """
  bsz, t_len, h, dk = q.shape
  dv = delta.shape[-1]
  bv, c = min(dv, block_v), chunk_size
  keys = core.block(None, c, None, dk)(lambda i, j, n, v: (i, n, j, 0))
  vals = core.block(None, c, None, bv)(lambda i, j, n, v: (i, n, j, v))
  return core.call(
      lambda *refs: _output_kernel(*refs, scale=scale),
      grid=(bsz, h, t_len // c, dv // bv),
      in_specs=[keys, keys,
                core.block(None, None, c)(lambda i, j, n, v: (i, j, n)),
                core.block(None, None, None, dk, bv)(
                    lambda i, j, n, v: (i, j, n, 0, v)),
                vals],
      out_specs=vals,
      out_shape=jax.ShapeDtypeStruct(delta.shape, out_dtype),
      num_warps=num_warps, num_stages=num_stages, name="deltajax_output")(q, k, g, states, delta)


def output_backward(q, k, g, states, delta, d_o, *, chunk_size, scale,
                    block_v=64, num_warps=4, num_stages=2):
  """Cotangents that flow from the output, chunk by chunk.

  Returns:
    ``(dq [B, T, H, K], dk [B, T, H, K], dg [B, H, T], d_delta [B, T, H, V])``:
    dq complete in q's dtype; the output's shares of dk, dg and ``dDelta``
    (``(Gamma * scale Q K^T)^T dO``) in float32.
  """
  bsz, t_len, h, dk = q.shape
  dv, c = delta.shape[-1], chunk_size
  acc = core.accumulator(q.dtype)
  keys = core.block(None, c, None, dk)(lambda i, j, n: (i, n, j, 0))
  vals = core.block(None, c, None, dv)(lambda i, j, n: (i, n, j, 0))
  gate = core.block(None, None, c)(lambda i, j, n: (i, j, n))
  return core.call(
      lambda *refs: _output_backward_kernel(*refs, scale=scale,
                                            block_v=block_v),
      grid=(bsz, h, t_len // c),
      in_specs=[keys, keys, gate,
                core.block(None, None, None, dk, dv)(
                    lambda i, j, n: (i, j, n, 0, 0)),
                vals, vals],
      out_specs=[keys, keys, gate, vals],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct(q.shape, acc),
                 jax.ShapeDtypeStruct(g.shape, acc),
                 jax.ShapeDtypeStruct(delta.shape, acc)],
      num_warps=num_warps, num_stages=num_stages,
      name="deltajax_output_backward")(q, k, g, states, delta, d_o)
