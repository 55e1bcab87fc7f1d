"""The backward's chunk-parallel part in one Mosaic GPU kernel (per-head gate).

What :func:`deltajax.mosaic.output.output_backward` and
:func:`deltajax.mosaic.ut_backward.ut_backward` form between them, from
the chunks' entry states ``S`` (the forward's) and the cotangents ``dS'`` of
their exit states (the reverse pass's) alone: Delta and dDelta are formed
again rather than read, and the output's shares of dk and the gate never
leave the CTA. For one chunk (Gated DeltaNet's chunkwise form: Yang, Kautz
& Hatamizadeh, ICLR 2025; ``g`` the
chunk-local cumulative gate, ``P = scale Gamma * Q K^T`` on ``j <= i``)::

  Delta  = T diag(b) (V - e^g * (K S))
  dDelta = P^T dO + e^{g_C - g} * (K dS')

and from there the two kernels' formulas (their docstrings). Three
warpgroups share the chunk's tiles, each with its own chain of products:

* WG0, the output's: Delta (published), ``dP~ = scale Gamma * (dO
  Delta^T)`` (published), ``dq = scale e^g * (dO S^T) + dP~ K`` and
  ``rowsum(Q * dq)``;
* WG1, the values': dDelta, ``dX_v = T^T dDelta`` (dv), ``Z = dX_v V^T``,
  ``dW = -dDelta S^T`` (published), ``dX_k = T^T dW``, ``-dM`` and ``dE =
  -diag(b) (-dM) * Gamma`` (published), db;
* WG2, the keys': ``dk = e^{g_C - g} * (Delta dS'^T) + dP~^T Q + dE^T K
  + dE K + diag(b e^g) dX_k`` (dX_k formed again, not rounded), the keys'
  share of the gate's cotangent, and da (the reverse cumulative sum, with
  the chunk end's share).

Products take 16-bit operands (Delta, dDelta, dP~, dW, dE, and dX_k in
``Z_k = dX_k K^T``, rounded to them as the two kernels round them) with
float32 accumulation. One CTA per (batch, chunk, value head); K and V in
{64, 128}: 226 KB of shared memory at K = V = 128 (one CTA a
multiprocessor; where K = V the tile of dDelta holds dW and Y's dq; v's
holds dv).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from deltajax.mosaic import core
from deltajax.mosaic import ut
from deltajax.mosaic.core import COLS, ROWS, WGMMA
from deltajax.mosaic.ut import C

_FIRST = 8  # TMA copies WG0 waits for first: k, v, T, S, the gate, beta twice
_SECOND = 3  # then q, dO, dS'
# Registers per thread of WG0, WG1, WG2: at most 3 x 168 in all (the launch
# share of 384 threads), multiples of 8.
REGISTERS = (104, 216, 184)
_LAUNCH_REGISTERS = 168
# WG0 forms its [C, K] and [C, V] float32 tiles by blocks of this many
# columns, as jla's chunk_grads does, so that fewer registers are live in
# its small share: at full width (128) ptxas spilled.
BLOCK = 64


def _blocks(width):
  """Static column slices of ``BLOCK`` (or ``width``, if narrower)."""
  block = min(width, BLOCK)
  return [pl.ds(i, block) for i in range(0, width, block)]


def _enter(mg, wg, *inputs):
  """Warpgroup ``wg``'s register budget moved from the launch share to its
  share of :data:`REGISTERS`, then the wait for its ``inputs``
  (barriers)."""
  n = REGISTERS[wg]
  mg.set_max_registers(n, action="increase" if n > _LAUNCH_REGISTERS
                       else "decrease")
  for barrier in inputs:
    plgpu.barrier_wait(barrier)


def _body(mg, q_ref, k_ref, v_ref, do_ref, t_ref, g_ref, b_ref, s_ref,
          dn_ref, dq_ref, dk_ref, dv_ref, db_ref, da_ref, q_s, k_s, v_s, do_s,
          t_s, s_s, dn_s, g_rows, g_cols, b_rows, b_cols, y_s, delta_s, dd_s,
          dp_s, de_s, dk_s, dgq_s, dg1_s, db_s, vec_s, first, second,
          delta_ready, dp_ready, dgq_ready, dw_ready, de_ready, dg1_ready,
          done, *own, groups, scale):
  # dq staged in Y's tile and dW in dDelta's where K = V, else in their own.
  dq_s, dw_s = own or (y_s, dd_s)
  bi, n, h = lax.axis_index("b"), lax.axis_index("n"), lax.axis_index("h")
  tokens, hk = pl.ds(n * C, C), lax.div(h, groups)
  keys, vals, square = k_s.shape, v_s.shape, (C, C)
  k_blocks, v_blocks = _blocks(keys[1]), _blocks(vals[1])
  k_tile, v_tile = (C, min(keys[1], BLOCK)), (C, min(vals[1], BLOCK))
  wg = lax.axis_index("wg")
  f32 = jnp.float32
  load = lambda ref: mg.load(ref, WGMMA).astype(f32)
  g_end = lambda: g_rows[C - 1]

  @pl.when(wg == 0)
  def _output():
    _enter(mg, 0)
    core.copy_in(((k_ref.at[bi, tokens, hk], k_s),
                  (v_ref.at[bi, tokens, h], v_s),
                  (t_ref.at[bi, h, tokens], t_s),
                  (s_ref.at[bi, h, n], s_s),
                  (g_ref.at[bi, h, tokens], g_rows),
                  (g_ref.at[bi, h, tokens], g_cols),
                  (b_ref.at[bi, h, tokens], b_rows),
                  (b_ref.at[bi, h, tokens], b_cols)), first)
    core.copy_in(((q_ref.at[bi, tokens, hk], q_s),
                  (do_ref.at[bi, tokens, h], do_s),
                  (dn_ref.at[bi, h, n], dn_s)), second)
    plgpu.barrier_wait(first)
    g, beta = mg.load(g_rows, ROWS), mg.load(b_rows, ROWS)
    for vs in v_blocks:
      k_state = mg.mm([(k_s, s_s.at[:, vs])], v_tile)
      y_s.at[:, vs][...] = (core.rows(beta, v_tile) * (
          load(v_s.at[:, vs]) - core.rows(jnp.exp(g), v_tile) * k_state)
                            ).astype(y_s.dtype)
    plgpu.commit_smem()
    for vs in v_blocks:
      delta_s.at[:, vs][...] = mg.mm([(t_s, y_s.at[:, vs])], v_tile).astype(
          delta_s.dtype)
    plgpu.commit_smem()
    plgpu.barrier_arrive(delta_ready)
    plgpu.barrier_wait(second)
    # One product at a time (this warpgroup is off the critical path, and
    # so holds few registers).
    dp = mg.mm([(do_s, core.T(delta_s))], square)
    dp_s[...] = (scale * core.decay(mg, g, mg.load(g_cols, COLS)) * dp
                 ).astype(dp_s.dtype)
    plgpu.commit_smem()
    plgpu.barrier_arrive(dp_ready)
    dgq = 0
    for ks in k_blocks:  # Y was read: dq is staged in its tile where K = V
      dq = mg.mm([(do_s, core.T(s_s.at[ks, :]))], k_tile)
      dq = mg.mm([(dp_s, k_s.at[:, ks])], k_tile,
                 core.rows(scale * jnp.exp(g), k_tile) * dq)
      dgq += jnp.sum(load(q_s.at[:, ks]) * dq, axis=1)
      dq_s.at[:, ks][...] = dq.astype(dq_s.dtype)
    dgq_s[...] = dgq
    plgpu.commit_smem()
    plgpu.barrier_arrive(dgq_ready)
    plgpu.copy_smem_to_gmem(dq_s, dq_ref.at[bi, tokens, h])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == 1)
  def _values():
    _enter(mg, 1, first, second)
    g, beta = mg.load(g_rows, ROWS), mg.load(b_rows, ROWS)
    # P^T: the keys' rows, the queries' columns.
    p_t = scale * core.decay(mg, g, mg.load(g_cols, COLS),
                             transposed=True) * mg.mm(
                                 [(k_s, core.T(q_s))], square)
    local, kds = mg.products([([(p_t.astype(k_s.dtype), do_s)], vals, None),
                              ([(k_s, dn_s)], vals, None)])
    dd_s[...] = (local + core.rows(jnp.exp(g_end() - g), vals) * kds
                 ).astype(dd_s.dtype)
    plgpu.commit_smem()
    d_xv, minus_dw = mg.products([([(core.T(t_s), dd_s)], vals, None),
                                  ([(dd_s, core.T(s_s))], keys, None)])
    dw_s[...] = (-minus_dw).astype(dw_s.dtype)  # dDelta read
    plgpu.commit_smem()
    plgpu.barrier_arrive(dw_ready)
    # dX_v's uses first, so that only its 16-bit copies stay live through
    # the next products (at K = V = 128, float32 dX_v held through them
    # left ptxas too few registers for the wgmmas).
    db = jnp.sum(d_xv * load(v_s), axis=1)
    dv = (core.rows(beta, vals) * d_xv).astype(v_s.dtype)
    d_xk, z = mg.products([
        ([(core.T(t_s), dw_s)], keys, None),
        ([(d_xv.astype(v_s.dtype), core.T(v_s))], square, None)])
    plgpu.barrier_wait(delta_ready)  # WG0 has read v
    v_s[...] = dv
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(v_s, dv_ref.at[bi, tokens, h])
    d_xk_kg = jnp.sum(d_xk * load(k_s) * core.rows(jnp.exp(g), keys),
                      axis=1)
    z_k = mg.mm([(d_xk.astype(k_s.dtype), core.T(k_s))], square)
    dg1_s[...] = beta * d_xk_kg
    plgpu.commit_smem()
    plgpu.barrier_arrive(dg1_ready)
    # -dM = (Z diag(b) + dX_k K^T diag(b e^g)) T^T (ut_backward's), the
    # bracket in two 16-bit passes.
    beta_col = mg.load(b_cols, COLS)
    bracket = (z * lax.broadcast_in_dim(beta_col, square, [1])
               + z_k * lax.broadcast_in_dim(
                   beta_col * jnp.exp(mg.load(g_cols, COLS)), square, [1]))
    r_hi, r_lo = ut.halves(bracket, k_s.dtype)
    minus_dm, kk = mg.products([([(r_hi, core.T(t_s)),
                                  (r_lo, core.T(t_s))], square, None),
                                ([(k_s, core.T(k_s))], square, None)])
    gamma = core.decay(mg, g, mg.load(g_cols, COLS), strict=True)
    de_s[...] = (-core.rows(beta, square) * minus_dm * gamma).astype(
        de_s.dtype)
    plgpu.commit_smem()
    plgpu.barrier_arrive(de_ready)
    core.copy_out(db + d_xk_kg - jnp.sum(minus_dm * gamma * kk, axis=1),
                  db_s, db_ref.at[bi, h, tokens])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == 2)
  def _keys():
    _enter(mg, 2, first, second)
    # rowsum(dS' * S) by [64, 64] blocks: only its total is used.
    ds_sum = None
    blocks = lambda n: [pl.ds(i * 64, 64) for i in range(n // 64)]
    for rows in blocks(keys[1]):
      for cols in blocks(vals[1]):
        part = jnp.sum(load(s_s.at[rows, cols]) * load(dn_s.at[rows, cols]),
                       axis=1)
        ds_sum = part if ds_sum is None else ds_sum + part
    g = mg.load(g_rows, ROWS)
    plgpu.barrier_wait(delta_ready)
    (d_k_end,) = mg.products([([(delta_s, core.T(dn_s))], keys, None)])
    minus = core.rows(jnp.exp(g_end() - g), keys) * d_k_end
    end_share = jnp.sum(load(k_s) * minus, axis=1)
    # dX_k = T^T dW again (WG1 forms it too, for its products), so that
    # its share of dk is not rounded to 16 bits.
    plgpu.barrier_wait(dw_ready)
    (d_xk,) = mg.products([([(core.T(t_s), dw_s)], keys, None)])
    plus = core.rows(mg.load(b_rows, ROWS) * jnp.exp(g), keys) * d_xk
    dg = -jnp.sum(load(k_s) * plus, axis=1)  # WG1 has this share
    plgpu.barrier_wait(dp_ready)
    plgpu.barrier_wait(de_ready)
    minus, plus = mg.products([
        ([(core.T(dp_s), q_s), (core.T(de_s), k_s)], keys, minus),
        ([(de_s, k_s)], keys, plus)])
    dg = dg + jnp.sum(load(k_s) * (plus - minus), axis=1)
    dk = plus + minus
    core.copy_out(dk, dk_s, dk_ref.at[bi, tokens, h])
    # S' = e^{g_C} S + ...: g_C's share, which every da_i gets.
    g_end_share = (ut.column_sums(mg, end_share, vec_s, C)
                   + jnp.exp(g_end()) * ut.column_sums(mg, ds_sum, vec_s, C))
    plgpu.barrier_wait(dgq_ready)
    plgpu.barrier_wait(dg1_ready)
    dg = dg + mg.load(dgq_s, ROWS) + mg.load(dg1_s, ROWS)
    da = ut.column_sums(mg, dg, vec_s, None) + g_end_share
    core.copy_out(da, vec_s, da_ref.at[bi, h, tokens])
    plgpu.wait_smem_to_gmem(0)

  # Every warpgroup leaves together (as the scan's).
  plgpu.barrier_arrive(done)
  plgpu.barrier_wait(done)


def chunk_backward(mg, q, k, v, g, b, t, states, d_next, d_o, *, scale):
  """The cotangents of q, k, v, beta and the gate, chunk by chunk.

  Args:
    mg: :class:`core.Mosaic`.
    q, k: ``[B, T, H, K]``; v, d_o: ``[B, T, HV, V]``; t: ``[B, HV, T,
      C]``; states, d_next: ``[B, HV, T / C, K, V]`` (the chunks' entry
      states and their exit states' cotangents): one 16-bit dtype; K and V
      in {64, 128}, T a multiple of 64.
    g: ``[B, HV, T]`` float32 chunk-local cumulative log gate; b: ``[B, HV,
      T]`` float32 beta.
    scale: Python float multiplying q.

  Returns:
    ``(dq, dk [B, T, HV, K] in q's dtype, dv [B, T, HV, V] in v's dtype,
    db, da [B, HV, T] float32)``: per value head (grouped heads are summed
    by the caller); da the cotangent of the log gate's increments.
  """
  bsz, t_len, h, dk = q.shape
  heads, dv = v.shape[2:]
  if {dk, dv} - {64, 128}:
    raise ValueError(f"chunk_backward needs K, V in (64, 128); got {dk}, "
                     f"{dv}")
  dtype, f32 = q.dtype, jnp.float32
  keys, vals = core.smem((C, dk), dtype), core.smem((C, dv), dtype)
  square, state = core.smem((C, C), dtype), core.smem((dk, dv), dtype)
  vec = plgpu.SMEM((C,), f32)
  once = lambda n=1: plgpu.Barrier(num_arrivals=n)
  # q, k, v, dO, T, S, dS', the gate and beta twice; Y, Delta, dDelta, dP~,
  # dE, dk's staging, four vectors; the barriers; where K != V, dq's
  # staging and dW (else in Y's and dDelta's tiles: 226 KB at 128).
  scratch = [keys, keys, vals, vals, square, state, state, vec, vec, vec, vec,
             vals, vals, vals, square, square, keys, vec, vec, vec, vec,
             once(_FIRST), once(_SECOND), once(), once(), once(), once(),
             once(), once(), once(3), *([keys, keys] if dk != dv else [])]
  out_type = [jax.ShapeDtypeStruct((bsz, t_len, heads, dk), dtype),
              jax.ShapeDtypeStruct((bsz, t_len, heads, dk), dtype),
              jax.ShapeDtypeStruct(v.shape, v.dtype),
              jax.ShapeDtypeStruct(b.shape, f32),
              jax.ShapeDtypeStruct(g.shape, f32)]
  body = lambda *refs: _body(mg, *refs, groups=heads // h, scale=scale)
  return mg.kernel(
      body, out_type=out_type, scratch_types=scratch,
      grid=(bsz, t_len // C, heads), grid_names=("b", "n", "h"),
      num_threads=3, thread_name="wg",
      kernel_name="deltajax_mosaic_chunk_backward",
      )(q, k, v, d_o, t, g, b, states, d_next)
