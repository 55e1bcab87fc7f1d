"""The output's backward in Mosaic GPU: what flows from dO, chunk by chunk.

The contract of :func:`deltajax.pallas.output.output_backward` (a scalar
gate). For ``O = (scale e^g Q) S + P Delta`` with ``P = scale Gamma * Q K^T``
(``j <= i``; Gated DeltaNet's chunkwise form) and one chunk's entry
state ``S``::

  dDelta_local = P^T dO
  dP~          = scale Gamma * (dO Delta^T)      (the scores' cotangent)
  dq           = scale e^g * (dO S^T) + dP~ K
  dk_out       = dP~^T Q
  dg_out       = rowsum(Q * dq) - rowsum(K * dk_out)

The last line is the gate's share through ``e^g`` and ``Gamma``: each score
``q_i . k_j e^{g_i - g_j}`` gives ``g_i`` what it gives ``q_i`` and takes
from ``g_j`` what it gives ``k_j``, so the row and column sums of
``dP~ * Q K^T`` come out as sums over key channels (rows of both), in one
register layout. One CTA (one warpgroup) per (batch, chunk, value head): TMA
brings q, k (head ``j // G``), the gate, ``S``, Delta and dO; six wgmmas
with 16-bit operands (``P`` and ``dP~`` rounded to them, as the Pallas
kernel does) and float32 accumulation. dk_out leaves in q's 16-bit dtype
(:func:`deltajax.mosaic.ut_backward.ut_backward` takes it so: half the
HBM traffic of float32 for one more rounding); dDelta_local stays float32.

This is the backward of the one-warpgroup scan (under ``jax_enable_x64``);
the three-warpgroup one's backward forms these cotangents in
:func:`deltajax.mosaic.chunk_backward.chunk_backward`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from deltajax.mosaic import core
from deltajax.mosaic.core import COLS, ROWS, WGMMA
from deltajax.mosaic.ut import C

_INPUTS = 7  # TMA copies: q, k, the gate twice, S, Delta, dO


def _body(mg, q_ref, k_ref, g_ref, s_ref, delta_ref, do_ref, dq_ref, dg_ref,
          dd_ref, dk_ref, q_s, k_s, g_rows, g_cols, s_s, delta_s, do_s, p_s,
          dp_s, dq_s, dk_s, dd_s, dg_s, bar, *, groups, scale):
  bi, n, h = lax.axis_index("b"), lax.axis_index("n"), lax.axis_index("h")
  tokens, hk = pl.ds(n * C, C), lax.div(h, groups)
  core.copy_in(((q_ref.at[bi, tokens, hk], q_s),
                (k_ref.at[bi, tokens, hk], k_s),
                (g_ref.at[bi, h, tokens], g_rows),
                (g_ref.at[bi, h, tokens], g_cols),
                (s_ref.at[bi, h, n], s_s),
                (delta_ref.at[bi, tokens, h], delta_s),
                (do_ref.at[bi, tokens, h], do_s)), bar)
  plgpu.barrier_wait(bar)
  square = (C, C)
  g = mg.load(g_rows, ROWS)
  gamma = scale * core.decay(mg, g, mg.load(g_cols, COLS))
  qk, dp = mg.products([([(q_s, core.T(k_s))], square, None),
                        ([(do_s, core.T(delta_s))], square, None)])
  p_s[...] = (gamma * qk).astype(p_s.dtype)
  dp_s[...] = (gamma * dp).astype(dp_s.dtype)
  plgpu.commit_smem()
  dk_keys = (C, k_s.shape[1])
  dq, dk, dd = mg.products([
      ([(do_s, core.T(s_s))], dk_keys, None),
      ([(core.T(dp_s), q_s)], dk_keys, None),
      ([(core.T(p_s), do_s)], do_s.shape, None)])
  core.copy_out(dd, dd_s, dd_ref.at[bi, tokens, h])
  core.copy_out(dk, dk_s, dk_ref.at[bi, tokens, h])
  (dq,) = mg.products([([(dp_s, k_s)], dk_keys,
                        lax.broadcast_in_dim(scale * jnp.exp(g), dk_keys, [0])
                        * dq)])
  core.copy_out(dq, dq_s, dq_ref.at[bi, tokens, h])
  q, k = mg.load(q_s, WGMMA), mg.load(k_s, WGMMA)
  dg_s[...] = (jnp.sum(q.astype(jnp.float32) * dq, axis=1)
               - jnp.sum(k.astype(jnp.float32) * dk, axis=1))
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(dg_s, dg_ref.at[bi, h, tokens])
  plgpu.wait_smem_to_gmem(0)


def output_backward(mg, q, k, g, states, delta, d_o, *, scale):
  """The output's cotangents, chunk by chunk.

  Args:
    mg: :class:`core.Mosaic`.
    q, k: ``[B, T, H, K]``, delta and d_o ``[B, T, HV, V]``, states ``[B,
      HV, T / C, K, V]`` (the chunks' entry states), one 16-bit dtype; K and
      V in {64, 128}, T a multiple of 64.
    g: ``[B, HV, T]`` float32 chunk-local cumulative log gate.
    scale: Python float multiplying q.

  Returns:
    ``(dq [B, T, HV, K], dg [B, HV, T], d_delta [B, T, HV, V], dk [B, T, HV,
    K])`` as :func:`deltajax.pallas.output.output_backward`'s: dq in q's
    dtype without grouped value heads, else float32 (for the sum over the
    group); dg and d_delta float32, dk in q's dtype.
  """
  bsz, t_len, h, dk = q.shape
  heads, dv = d_o.shape[2:]
  dtype, f32 = q.dtype, jnp.float32
  dq_dtype = dtype if heads == h else f32
  per_head = (bsz, t_len, heads, dk)
  out_type = [jax.ShapeDtypeStruct(per_head, dq_dtype),
              jax.ShapeDtypeStruct(g.shape, f32),
              jax.ShapeDtypeStruct(d_o.shape, f32),
              jax.ShapeDtypeStruct(per_head, dtype)]
  vec = plgpu.SMEM((C,), f32)
  keys, vals = core.smem((C, dk), dtype), core.smem((C, dv), dtype)
  square = core.smem((C, C), dtype)
  scratch = [keys, keys, vec, vec, core.smem((dk, dv), dtype), vals, vals,
             square, square, core.smem((C, dk), dq_dtype),
             core.smem((C, dk), dtype), core.smem((C, dv), f32), vec,
             plgpu.Barrier(num_arrivals=_INPUTS)]
  body = lambda *refs: _body(mg, *refs, groups=heads // h, scale=scale)
  return tuple(mg.kernel(body, out_type=out_type, scratch_types=scratch,
                         grid=(bsz, t_len // C, heads),
                         grid_names=("b", "n", "h"),
                         kernel_name="deltajax_mosaic_output_backward",
                         )(q, k, g, states, delta, d_o))
