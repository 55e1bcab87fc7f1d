"""The backward through the UT transform in Mosaic GPU, chunk by chunk.

The contract of :func:`deltajax.pallas.ut_backward.ut_backward` for a scalar
gate: from dDelta (the reverse pass's), the chunk's entry state ``S`` and the
cotangent ``dS'`` of its exit state, the cotangents of k, v, beta and the
gate through (Gated DeltaNet's chunkwise form: Yang, Kautz & Hatamizadeh,
ICLR 2025)::

  [W | U] = T diag(b) [K e^g | V],  T = (I + diag(b) A)^-1,
  A = Gamma * K K^T (j < i),        Delta = U - W S,
  S' = e^{g_C} S + (K e^{g_C - g})^T Delta,

with the output's shares ``dk_out``, ``dg_out`` added. In order:

* by blocks of BV value columns: ``dX_v = T^T dDelta`` (dv = ``b * dX_v``),
  ``dK_end = Delta dS'^T``, ``dW = -dDelta S^T``, ``Z = dX_v V^T``;
* ``dX_k = T^T dW``, the keys' and beta's shares, and ``dM = -dX_v U^T -
  dX_k W^T = -(Z diag(b) + dX_k K^T diag(b e^g)) T^T``: W and U are never
  formed;
* ``dA = diag(b) dM`` through ``A``: ``dk += dE K + dE^T K`` with ``dE =
  dA * Gamma``, and the gate's share ``rowsum(K * dE K) - rowsum(K * dE^T
  K)`` (as in :mod:`output`: sums over key channels, one register layout);
* ``da``, the reverse cumulative sum of the gate's cotangent over the chunk,
  plus the chunk end's share (which every ``da_i`` gets).

Sums that cross rows (the chunk end's totals, the reverse cumulative sum)
go through shared memory: a per-row vector stored, read back per column and
broadcast, then summed along rows. One CTA (one warpgroup) per (batch,
chunk, value head); products with 16-bit operands (dDelta, dW, dX and dE
rounded to them, as the Pallas kernel does; the bracket of dM in two
passes) and float32 accumulation. The value blocks' tiles and the keys'
side's share one region of shared memory (two scopes), so that two CTAs fit
on a multiprocessor at K = V = 128 (97 KB each with 16-bit dk_out and dk,
121 KB, one CTA, with float32 ones; 170 KB before).

A per-channel gate (KDA, g ``[C, K]``) gives, as the Pallas kernel, dk, db
and the cumulative gate's ``dg [C, K]`` without the scores' shares, and
``dM`` (the cotangent of ``diag(b) Gamma * K K^T``, for
:func:`deltajax.pallas.intra.backward`): the value blocks as above, then
``dX_k = T^T dW``, ``-dM = (Z + dX_k (K e^g)^T) diag(b) T^T`` (``K e^g``
staged in 16 bits), ``dk = e^{g_C - g} * dK_end + diag(b) e^g * dX_k``,
``dg = diag(b) (dX_k * K e^g) - K e^{g_C - g} * dK_end``, whose last row
adds the chunk end's share ``rowsum(dS' * S') = sum_i (K e^{g_C - g} *
dK_end)_i + e^{g_C} rowsum(dS' * S)`` (the sum over rows as one product of
a row of ones with the term's two 16-bit halves). Every exponent is ``<=
0``. The gate's float32 tile (32 KB at K = 128) arrives after the value
blocks, in their region, while ``dX_k`` is formed; it is read where it is
used (only dX_k and dK_end are live through dM's products), then stages
dk and dg: 103 KB of shared memory per CTA at K = V = 128 (dM staged in 16
bits), two CTAs per multiprocessor (143 KB, one, with the tile beside the
value blocks' tiles and dM in float32). With Gated DeltaNet-2's read keys
``kr`` (W's keys, per value head; k's write the state) the decayed keys
are ``Kr e^g`` (kr arriving with the gate's tile in their tile), dX_k's
share goes to ``dkr`` rather than dk, and a float32 tile more stages dkr:
135 KB, one CTA per multiprocessor.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from deltajax.mosaic import core
from deltajax.mosaic import ut
from deltajax.mosaic.core import COLS, ROWS, WGMMA
from deltajax.mosaic.scan import BV
from deltajax.mosaic.ut import C

_CHUNK_INPUTS = 7  # TMA copies: k, T, the gate twice, b twice, dg_out
# (per channel: the gate's last row alone, no dg_out; its tile comes later)
_BLOCK_INPUTS = 5  # per value block: v, dDelta, Delta, S, dS'


def _value_blocks(mg, refs, at, t_s, b_s, bar, block_bar, dtype):
  """The value blocks' shares, by blocks of BV columns in a scope of their
  own: ``(dK_end, -dW, Z = dX_v V^T, db's share, rowsum(dS' * S))``, ``[C,
  K]``, ``[C, K]``, ``[C, C]``, ``[C]``, ``[K]`` float32; dv written.

  ``refs``: v, dDelta, Delta, S, dS' and dv in HBM; ``at``: the chunk's
  ``(batch, chunk, value head)``; the chunk's inputs (arriving on ``bar``)
  hold T and beta."""
  v_ref, dd_ref, delta_ref, s_ref, dnext_ref, dv_ref = refs
  bi, n, h = at
  tokens, dk_dim = pl.ds(n * C, C), s_ref.shape[3]
  keys, square, tile = (C, dk_dim), (C, C), (C, BV)

  def scope(v_s, dd_s, delta_s, s_s, dn_s, dv_s):
    def load_block(j):
      cols = pl.ds(j * BV, BV)
      core.copy_in(((v_ref.at[bi, tokens, h, cols], v_s),
                    (dd_ref.at[bi, tokens, h, cols], dd_s),
                    (delta_ref.at[bi, tokens, h, cols], delta_s),
                    (s_ref.at[bi, h, n, :, cols], s_s),
                    (dnext_ref.at[bi, h, n, :, cols], dn_s)), block_bar)

    load_block(0)
    plgpu.barrier_wait(bar)
    beta = mg.load(b_s, ROWS)
    d_k_end = minus_dw = z = db = ds_sum = None
    n_blocks = v_ref.shape[-1] // BV
    for j in range(n_blocks):
      plgpu.barrier_wait(block_bar)
      d_xv, d_k_end, minus_dw = mg.products([
          ([(core.T(t_s), dd_s)], tile, None),
          ([(delta_s, core.T(dn_s))], keys, d_k_end),
          ([(dd_s, core.T(s_s))], keys, minus_dw)])
      (z,) = mg.products([([(d_xv.astype(v_s.dtype), core.T(v_s))],
                           square, z)])
      block_db = jnp.sum(d_xv * mg.load(v_s, WGMMA).astype(jnp.float32),
                         axis=1)
      block_ds = jnp.sum(mg.load(dn_s, WGMMA).astype(jnp.float32)
                         * mg.load(s_s, WGMMA).astype(jnp.float32), axis=1)
      db = block_db if db is None else db + block_db
      ds_sum = block_ds if ds_sum is None else ds_sum + block_ds
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last dv block
      dv_s[...] = (core.rows(beta, tile) * d_xv).astype(dv_s.dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(dv_s, dv_ref.at[bi, tokens, h,
                                              pl.ds(j * BV, BV)])
      if j + 1 < n_blocks:  # this block's tiles are read
        load_block(j + 1)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the scope's end
    return d_k_end, minus_dw, z, db, ds_sum

  block = core.smem(tile, dtype)
  state_block = core.smem((dk_dim, BV), dtype)
  return pl.run_scoped(scope, block, block, block, state_block, state_block,
                       block)


def _body(mg, k_ref, v_ref, g_ref, b_ref, t_ref, s_ref, dnext_ref, delta_ref,
          dd_ref, dkout_ref, dgout_ref, dk_ref, dv_ref, db_ref, da_ref, k_s,
          t_s, g_rows, g_cols, b_s, b_cols, dgout_s, vec_s, key_vec_s, bar,
          block_bar, dkout_bar, *, groups, dtypes):
  bi, n, h = lax.axis_index("b"), lax.axis_index("n"), lax.axis_index("h")
  tokens, hk = pl.ds(n * C, C), lax.div(h, groups)
  dk_dim = k_s.shape[1]
  keys, square = (C, dk_dim), (C, C)
  core.copy_in(((k_ref.at[bi, tokens, hk], k_s),
                (t_ref.at[bi, h, tokens], t_s),
                (g_ref.at[bi, h, tokens], g_rows),
                (g_ref.at[bi, h, tokens], g_cols),
                (b_ref.at[bi, h, tokens], b_s),
                (b_ref.at[bi, h, tokens], b_cols),
                (dgout_ref.at[bi, h, tokens], dgout_s)), bar)
  d_k_end, minus_dw, z, db, ds_sum = _value_blocks(
      mg, (v_ref, dd_ref, delta_ref, s_ref, dnext_ref, dv_ref), (bi, n, h),
      t_s, b_s, bar, block_bar, dtypes.k)

  def keys_side(dkout_s, dw_s, de_s, dk_s):
    """dk, db, da (in the shared memory that the value blocks held)."""
    plgpu.copy_gmem_to_smem(dkout_ref.at[bi, tokens, h], dkout_s, dkout_bar)
    beta, g, g_end = mg.load(b_s, ROWS), mg.load(g_rows, ROWS), g_rows[C - 1]
    to_end, from_start = jnp.exp(g_end - g), jnp.exp(g)
    dw_s[...] = (-minus_dw).astype(dw_s.dtype)
    plgpu.commit_smem()
    (d_xk,) = mg.products([([(core.T(t_s), dw_s)], keys, None)])
    # dX_k's 16-bit copy in dW's place (read), and what needs dX_k and
    # dK_end formed at once: neither is live through the products below,
    # nor K K^T through this one (the kernel is held at 255 registers and
    # spills otherwise).
    dw_s[...] = d_xk.astype(dw_s.dtype)
    plgpu.commit_smem()
    k = mg.load(k_s, WGMMA).astype(jnp.float32)
    end_share = jnp.sum(k * core.rows(to_end, keys) * d_k_end, axis=1)
    d_xk_kg = jnp.sum(d_xk * k * core.rows(from_start, keys), axis=1)
    dg = beta * d_xk_kg - end_share
    dk = (core.rows(to_end, keys) * d_k_end
          + core.rows(from_start * beta, keys) * d_xk)
    # -dM = dX_v U^T + dX_k W^T = (Z diag(b) + dX_k K^T diag(b e^g)) T^T for
    # U = T diag(b) V, W = T diag(b e^g) K, which are never formed; the
    # bracket in two bf16 passes.
    (z_k,) = mg.products([([(dw_s, core.T(k_s))], square, None)])
    beta_col = mg.load(b_cols, COLS)
    bracket = (z * lax.broadcast_in_dim(beta_col, square, [1])
               + z_k * lax.broadcast_in_dim(
                   beta_col * jnp.exp(mg.load(g_cols, COLS)), square, [1]))
    r_hi, r_lo = ut.halves(bracket, dw_s.dtype)
    minus_dm, kk = mg.products([([(r_hi, core.T(t_s)),
                                  (r_lo, core.T(t_s))], square, None),
                                ([(k_s, core.T(k_s))], square, None)])
    plgpu.barrier_wait(dkout_bar)
    dk = dk + mg.load(dkout_s, WGMMA).astype(jnp.float32)

    # M = diag(b) A: db's share, then dA = diag(b) dM through A.
    gamma = core.decay(mg, g, mg.load(g_cols, COLS), strict=True)
    d_b = db + d_xk_kg - jnp.sum(minus_dm * gamma * kk, axis=1)
    de_s[...] = (-core.rows(beta, square) * minus_dm * gamma).astype(
        de_s.dtype)
    plgpu.commit_smem()
    dk_rows, dk_cols = mg.products([([(de_s, k_s)], keys, None),
                                    ([(core.T(de_s), k_s)], keys, None)])
    dk = dk + dk_rows + dk_cols
    # K again from shared memory, not kept through the products.
    dg = dg + jnp.sum(mg.load(k_s, WGMMA).astype(jnp.float32)
                      * (dk_rows - dk_cols), axis=1)

    dk_s[...] = dk.astype(dk_s.dtype)
    vec_s[...] = d_b
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(dk_s, dk_ref.at[bi, tokens, h])
    plgpu.copy_smem_to_gmem(vec_s, db_ref.at[bi, h, tokens])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    # S' = e^{g_C} S + ...: g_C's share, which every da_i gets.
    g_end_share = (ut.column_sums(mg, end_share, vec_s, C)
                   + jnp.exp(g_end) * ut.column_sums(mg, ds_sum, key_vec_s,
                                                   dk_dim))
    da = ut.column_sums(mg, mg.load(dgout_s, ROWS) + dg, vec_s, None)
    vec_s[...] = da + g_end_share
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(vec_s, da_ref.at[bi, h, tokens])
    plgpu.wait_smem_to_gmem(0)

  keys_tile = core.smem(keys, dtypes.k)
  pl.run_scoped(keys_side, core.smem(keys, dtypes.dk_out), keys_tile,
                core.smem(square, dtypes.k), core.smem(keys, dtypes.dk))


def _channel_body(mg, *refs, groups, dtype, read_keys):
  """One chunk of a per-channel gate's backward (g ``[C, K]``, its last row
  in ``g_end_s``): dk, db and the cumulative gate's dg without the scores'
  shares, and dM for :func:`deltajax.pallas.intra.backward`; with
  ``read_keys`` (Gated DeltaNet-2), W's keys kr (after the other inputs)
  and their share of dkr (after the other outputs)."""
  n_in = 9 + read_keys
  (k_ref, v_ref, g_ref, b_ref, t_ref, s_ref, dnext_ref, delta_ref, dd_ref,
   *kr_ref) = refs[:n_in]
  (dk_ref, dv_ref, db_ref, dg_ref, dm_ref, *dkr_ref) = refs[
      n_in:n_in + 5 + read_keys]
  (k_s, t_s, g_end_s, b_s, b_cols, vec_s, key_vec_s, bar, block_bar,
   g_bar) = refs[n_in + 5 + read_keys:]
  bi, n, h = lax.axis_index("b"), lax.axis_index("n"), lax.axis_index("h")
  tokens, dk_dim = pl.ds(n * C, C), k_s.shape[1]
  keys, square = (C, dk_dim), (C, C)
  core.copy_in(((k_ref.at[bi, tokens, lax.div(h, groups)], k_s),
                (t_ref.at[bi, h, tokens], t_s),
                (g_ref.at[bi, h, n * C + C - 1], g_end_s),
                (b_ref.at[bi, h, tokens], b_s),
                (b_ref.at[bi, h, tokens], b_cols)), bar)
  d_k_end, minus_dw, z, db, ds_sum = _value_blocks(
      mg, (v_ref, dd_ref, delta_ref, s_ref, dnext_ref, dv_ref), (bi, n, h),
      t_s, b_s, bar, block_bar, dtype)

  def keys_side(dw_s, kg_s, g_s, dm_s, *dkr_s):
    """dM, then dk, db and dg (in the shared memory of the value blocks).
    The gate's float32 tile arrives in g_s while dX_k is formed, and stages
    dk, then dg, once read; only dX_k and dK_end are live through dM's
    products, the gate and K read again where they are used. W's keys
    (kr, or K) decayed, ``Kr e^g``, are staged in kg_s (kr arrives there
    with the gate), whose 16-bit copy also gives their share of db and dg
    (the forward's scan takes the same rounding of it)."""
    plgpu.copy_gmem_to_smem(g_ref.at[bi, h, tokens], g_s, g_bar)
    if read_keys:
      plgpu.copy_gmem_to_smem(kr_ref[0].at[bi, tokens, h], kg_s, g_bar)
    dw_s[...] = (-minus_dw).astype(dtype)
    plgpu.commit_smem()
    (d_xk,) = mg.products([([(core.T(t_s), dw_s)], keys, None)])
    plgpu.barrier_wait(g_bar)
    kg_s[...] = (mg.load(kg_s if read_keys else k_s, WGMMA).astype(
        jnp.float32) * jnp.exp(mg.load(g_s, WGMMA))).astype(dtype)
    dw_s[...] = d_xk.astype(dtype)  # dW is read
    plgpu.commit_smem()
    # -dM = dX_v U^T + dX_k W^T = (Z + dX_k (K e^g)^T) diag(b) T^T for U =
    # T diag(b) V, W = T diag(b) (K e^g), never formed; the bracket in two
    # 16-bit passes.
    (bracket,) = mg.products([([(dw_s, core.T(kg_s))], square, z)])
    bracket = bracket * lax.broadcast_in_dim(mg.load(b_cols, COLS), square,
                                             [1])
    r_hi, r_lo = ut.halves(bracket, dtype)
    (minus_dm,) = mg.products([([(r_hi, core.T(t_s)),
                                 (r_lo, core.T(t_s))], square, None)])
    dm_s[...] = (-minus_dm).astype(dm_s.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(dm_s, dm_ref.at[bi, h, tokens])

    beta = mg.load(b_s, ROWS)
    k = mg.load(k_s, WGMMA).astype(jnp.float32)
    g = mg.load(g_s, WGMMA)
    g_end = lax.broadcast_in_dim(mg.load(g_end_s, COLS), keys, [1])
    to_end, from_start = jnp.exp(g_end - g), jnp.exp(g)
    end_share = k * to_end * d_k_end
    d_xk_kg = d_xk * (mg.load(kg_s, WGMMA).astype(jnp.float32) if read_keys
                      else k * from_start)
    # W's keys' cotangent: dk's without read keys, else dkr.
    dk_read = core.rows(beta, keys) * from_start * d_xk
    dk = to_end * d_k_end
    if read_keys:
      dkr_s[0][...] = dk_read
    else:
      dk = dk + dk_read
    dg = core.rows(beta, keys) * d_xk_kg - end_share
    d_b = db + jnp.sum(d_xk_kg, axis=1)
    # S' = e^{g_C} S + (K e^{g_C - g})^T Delta: the last row's share, the
    # sum over rows of K e^{g_C - g} * dK_end (the product of its two 16-bit
    # halves with the last row of ones) and e^{g_C} * rowsum(dS' * S).
    dw_s[...], kg_s[...] = ut.halves(end_share, dtype)  # both are read
    key_vec_s[...] = ds_sum
    plgpu.commit_smem()  # every row has read g_s before its reuse
    g_s[...] = dk
    vec_s[...] = d_b
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(g_s, dk_ref.at[bi, tokens, h])
    plgpu.copy_smem_to_gmem(vec_s, db_ref.at[bi, h, tokens])
    if read_keys:
      plgpu.copy_smem_to_gmem(dkr_s[0], dkr_ref[0].at[bi, tokens, h])
    ds_share = jnp.exp(g_end) * lax.broadcast_in_dim(
        mg.load(key_vec_s, COLS), keys, [1])
    dg = dg + jnp.where(mg.iota(keys, 0) == C - 1, ds_share, 0.0)
    ones = jnp.where(mg.iota(square, 0) == C - 1, 1.0, 0.0).astype(dtype)
    dg = mg.mm([(ones, dw_s), (ones, kg_s)], keys, dg)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # dk has left g_s
    g_s[...] = dg
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(g_s, dg_ref.at[bi, h, tokens])
    plgpu.wait_smem_to_gmem(0)

  keys_tile = core.smem(keys, dtype)
  f32_tile = core.smem(keys, jnp.float32)
  pl.run_scoped(keys_side, keys_tile, keys_tile, f32_tile,
                core.smem(square, dtype), *([f32_tile] if read_keys else []))


class _Dtypes(NamedTuple):
  """The kernel's 16-bit dtype, and those of dk_out and dk."""
  k: object
  dk_out: object
  dk: object


def ut_backward(mg, k, v, g, b, t, states, d_next, delta, d_delta,
                dk_out=None, dg_out=None, kr=None):
  """The cotangents of k, v, beta and the gate's increments.

  Args:
    mg: :class:`core.Mosaic`.
    k: ``[B, T, H, K]``; v, delta, d_delta: ``[B, T, HV, V]``; t: ``[B, HV,
      T, C]``; states, d_next: ``[B, HV, T / C, K, V]``: one 16-bit dtype
      (d_delta may be float32: it is rounded to it); K and V in {64, 128},
      T a multiple of 64.
    g: ``[B, HV, T]`` (per head) or ``[B, HV, T, K]`` (per channel) float32:
      the chunk-local cumulative log gate; b: ``[B, HV, T]`` float32 beta.
    dk_out: ``[B, T, HV, K]`` (float32 or k's dtype), dg_out: ``[B, HV,
      T]`` float32: the output's shares (per head; None per channel).
    kr: None, or per channel W's keys ``[B, T, HV, K]`` in k's dtype
      (Gated DeltaNet-2's read keys; k then writes the state alone).

  Returns:
    ``(dk, dv, db, da)`` as
    :func:`deltajax.pallas.ut_backward.ut_backward`'s: ``[B, T, HV, K]`` (in
    k's dtype without grouped value heads, else float32),
    ``[B, T, HV, V]`` in v's dtype, ``[B, HV, T]`` twice, float32. Per
    channel, as its ``(dk, dv, db, dg, dm)``: dk ``[B, T, HV, K]``, db
    ``[B, HV, T]``, the cumulative gate's dg ``[B, HV, T, K]`` (without the
    scores' shares), float32, and dM ``[B, HV, T, C]`` in k's 16-bit dtype
    (:func:`deltajax.mosaic.intra.backward` rounds it so for its products);
    with kr, their share of kr's cotangent ``[B, T, HV, K]`` float32 after
    them.
  """
  bsz, t_len, h, dk = k.shape
  heads = v.shape[2]
  dtype, f32 = k.dtype, jnp.float32
  d_delta = d_delta.astype(dtype)  # float32 from the Pallas reverse pass
  vec = plgpu.SMEM((C,), f32)
  chunk_shared = [core.smem((C, dk), dtype), core.smem((C, C), dtype)]
  if g.ndim == 4:
    out_type = [jax.ShapeDtypeStruct((bsz, t_len, heads, dk), f32),
                jax.ShapeDtypeStruct(v.shape, v.dtype),
                jax.ShapeDtypeStruct(b.shape, f32),
                jax.ShapeDtypeStruct(g.shape, f32),
                jax.ShapeDtypeStruct(t.shape, dtype)]
    read_keys = kr is not None
    if read_keys:
      out_type.append(jax.ShapeDtypeStruct(kr.shape, f32))
    scratch = [*chunk_shared, plgpu.SMEM((dk,), f32), vec, vec, vec,
               plgpu.SMEM((dk,), f32),
               plgpu.Barrier(num_arrivals=_CHUNK_INPUTS - 2),
               plgpu.Barrier(num_arrivals=_BLOCK_INPUTS),
               plgpu.Barrier(num_arrivals=1 + read_keys)]
    body = lambda *refs: _channel_body(mg, *refs, groups=heads // h,
                                       dtype=dtype, read_keys=read_keys)
    inputs = (k, v, g, b, t, states, d_next, delta, d_delta,
              *([kr] if read_keys else []))
  else:
    dtypes = _Dtypes(dtype, dk_out.dtype, dtype if heads == h else f32)
    out_type = [jax.ShapeDtypeStruct((bsz, t_len, heads, dk), dtypes.dk),
                jax.ShapeDtypeStruct(v.shape, v.dtype),
                jax.ShapeDtypeStruct(b.shape, f32),
                jax.ShapeDtypeStruct(g.shape, f32)]
    # Only what both scopes of _body use; each scope allocates its own
    # tiles in the same place after these.
    scratch = [*chunk_shared, vec, vec, vec, vec, vec, vec,
               plgpu.SMEM((dk,), f32),
               plgpu.Barrier(num_arrivals=_CHUNK_INPUTS),
               plgpu.Barrier(num_arrivals=_BLOCK_INPUTS),
               plgpu.Barrier(num_arrivals=1)]
    body = lambda *refs: _body(mg, *refs, groups=heads // h, dtypes=dtypes)
    inputs = (k, v, g, b, t, states, d_next, delta, d_delta, dk_out, dg_out)
  return mg.kernel(
      body, out_type=out_type, scratch_types=scratch,
      grid=(bsz, t_len // C, heads), grid_names=("b", "n", "h"),
      kernel_name="deltajax_mosaic_ut_backward",
      )(*inputs)
