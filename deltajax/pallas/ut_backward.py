"""The backward through the UT transform: per chunk, the cotangents of the
parallel stages around the state scan.

From the reverse pass's dDelta, the chunk's entry state and the cotangent of
its exit state, W and U (:func:`ut.w_u`), it forms dk, dv, db and the gate's
cotangent, adding a scalar gate's output's shares. Parallel over (batch,
value head, chunk), with :mod:`ut`'s block specs. For a per-channel gate it
leaves the cotangent of ``diag(b) Gamma * K K^T`` to :func:`intra.backward`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deltajax.pallas import core
from deltajax.pallas import scores
from deltajax.pallas import ut


def _ut_backward_kernel(*, k_ref, kr_ref, v_ref, g_ref, b_ref, cuts_ref, t_ref,
                        w_ref, u_ref, s_ref, dnext_ref, delta_ref, dd_ref,
                        dk_out_ref, dg_out_ref, dk_ref, dv_ref, db_ref,
                        da_ref, block_v, block_k, dot, dm_ref=None,
                        dkr_ref=None):
  """One chunk of the backward through ``Delta = U - W S``, the chunk-end
  decays and the UT transform (the steps of ``chunked._bwd`` after the scan),
  adding a scalar gate's output's shares ``dk_out``, ``dg_out``. The gate
  cotangent is per token (``[C]``) or per channel (``[C, K]``), as the
  gate.

  Everything but ``dM`` (a sum over the keys) is per key channel: the work
  goes by blocks of ``block_k`` channels, so that few ``[C, K]`` float32
  values are live at once (register pressure). With read keys ``kr`` (W's
  keys, Gated DeltaNet-2), their cotangent goes to ``dkr``, k's (the state
  update's) to dk."""
  dtype = k_ref.dtype
  acc = core.accumulator(dtype)
  c = k_ref.shape[0]
  channel = len(g_ref.shape) == 2
  beta = b_ref[...].astype(acc)
  cuts = None if cuts_ref is None else cuts_ref[...]
  cuts_end = None if cuts is None else core.last(cuts)
  v_blocks = core.blocks(v_ref.shape[1], block_v)
  t = t_ref[...].astype(dtype)
  # [W | U] = T diag(b) [K e^g | V]: d[W | U] -> dX = T^T d[W | U], dM; the
  # V side first.
  db, d_m = 0, 0
  for vs in v_blocks:
    d_xv = dot(t, dd_ref[:, vs].astype(dtype), trans_a=True)
    dv_ref[:, vs] = (beta[:, None] * d_xv).astype(dv_ref.dtype)
    db += jnp.sum(d_xv * v_ref[:, vs], axis=1)
    d_m -= dot(d_xv.astype(dtype), u_ref[:, vs], trans_b=True)
  last_row = core.iota((c, 1), 0) == c - 1
  dg, dks = 0, []
  for ks in core.blocks(k_ref.shape[1], block_k):
    g = (g_ref[:, ks] if channel else g_ref[...]).astype(acc)
    # Chunk-end decays, S' = e^{g_C} S + (K e^{g_C - g})^T Delta, and
    # Delta = U - W S: the sums over V.
    d_k_end, d_s_sum, d_w = 0, 0, 0
    for vs in v_blocks:
      s, d_next = s_ref[ks, vs], dnext_ref[ks, vs]
      d_k_end += dot(delta_ref[:, vs].astype(dtype), d_next.astype(dtype),
                     trans_b=True)
      d_s_sum += core.gate_total(d_next * s, g, keys_axis=0)
      d_w -= dot(dd_ref[:, vs].astype(dtype), s.astype(dtype), trans_b=True)
    g_end = core.last(g)
    to_end = core.on_keys(core.to_end(g, g_end, cuts, cuts_end))
    k = k_ref[:, ks].astype(acc)
    k_end = k * to_end
    dk = d_k_end * to_end
    if dk_out_ref is not None:
      dk += dk_out_ref[:, ks]
    dg_k = -core.key_sum(k_end * d_k_end, g)
    d_g_end = (core.gate_total(k_end * d_k_end, g, keys_axis=1)
               + core.over_chunk(g_end, cuts_end) * d_s_sum)
    d_xk = dot(t, d_w.astype(dtype), trans_a=True)
    d_m -= dot(d_xk.astype(dtype), w_ref[:, ks], trans_b=True)
    eg = core.from_start(g, cuts)
    k_read = k if kr_ref is None else kr_ref[:, ks].astype(acc)
    d_xk_kg = d_xk * k_read * core.on_keys(eg)
    db += jnp.sum(d_xk_kg, axis=1)
    dg_k += beta[:, None] * d_xk_kg if channel else beta * jnp.sum(
        d_xk_kg, axis=1)
    if dkr_ref is None:
      dk += core.on_keys(eg, beta) * d_xk
    else:
      dkr_ref[:, ks] = core.on_keys(eg, beta) * d_xk
    if channel:  # the scores' and the output's shares are intra.backward's
      da_ref[:, ks] = dg_k + jnp.where(last_row, d_g_end[None, :], 0)
      dk_ref[:, ks] = dk.astype(dk_ref.dtype)
    else:
      dg += dg_k + jnp.where(last_row[:, 0], d_g_end, 0)
      dks.append((ks, dk))
  if channel:
    dm_ref[...] = d_m
    db_ref[...] = db
    return
  # M = diag(b) A, A the strictly lower decayed K K^T: dA = diag(b) dM.
  g = g_ref[...].astype(acc)
  kk = scores.scores(x=k_ref[...], y=k_ref[...], g=g, cuts=cuts, strict=True,
                     dot=dot)
  db_ref[...] = db + jnp.sum(d_m * kk.matrix, axis=1)
  for ks, dk in dks:
    k = k_ref[:, ks]
    d_k1, d_k2, d_g_kk = kk.vjp(beta[:, None] * d_m, k, k)
    dk_ref[:, ks] = (dk + d_k1 + d_k2).astype(dk_ref.dtype)
  # g is the cumulative sum of a within the chunk: da is the reverse cumsum.
  da_ref[...] = core.reverse_cumsum(dg_out_ref[...] + dg + d_g_kk, dot)


def ut_backward(*, k, v, g, b, cuts, t, w, u, states, d_next, delta, d_delta,
                dk_out, dg_out, chunk_size, launch, interpret, dot, kr=None):
  """Cotangents of the parallel stages around the state scan.

  Args:
    k: ``[B, T, H, K]``; w: ``[B, T, HV, K]``; v, u, delta:
    ``[B, T, HV, V]``; g: ``[B, HV, T]`` or ``[B, HV, T, K]``; b, cuts:
    ``[B, HV, T]``; t: ``[B, HV, T, C]`` from :func:`ut.inverse`; states,
    d_next: ``[B, HV, N, K, V]``; d_delta: ``[B, T, HV, V]``; dk_out
    ``[B, T, HV, K]`` and dg_out ``[B, HV, T]``: a scalar gate's output's
    shares of dk and dg (None for a per-channel gate).

  Returns:
    ``(dk, dv, db, da)``: ``[B, T, HV, K]`` per value head (in k's dtype
    without GVA, else float32 for the sum over the group),
    ``[B, T, HV, V]`` in v's dtype, ``[B, HV, T]`` and g's shape, float32
    (da of the cumulative gate's increments; 0 is not forced at cuts). For
    a per-channel gate, ``(dk, dv, db, dg, dm)``: dk, db and the cumulative
    gate's dg (float32) without the scores' and the output's shares, and
    ``dm [B, HV, T, C]``,
    the cotangent of ``diag(b) Gamma * K K^T``, for :func:`intra.backward`;
    with read keys kr ``[B, T, HV, K]`` (W's keys, per channel), their share
    of kr's cotangent (float32) after them.
  """
  bsz, t_len, h, dk = k.shape
  heads, dv = v.shape[2:]
  acc = core.accumulator(k.dtype)
  qk, tok, gate, square, state = ut.chunk_specs(chunk_size, heads // h)
  vals, states_spec = tok(dv), state(dk, dv)
  gates = ut.chunk_gate_spec(g, chunk_size)
  channel = {}
  if g.ndim == 4:
    channel = dict(dm_ref=(jax.ShapeDtypeStruct(t.shape, acc), square))
  if kr is not None:
    channel["dkr_ref"] = (jax.ShapeDtypeStruct(kr.shape, acc), tok(dk))
  return core.call(
      _ut_backward_kernel, grid=(bsz, heads, t_len // chunk_size),
      inputs=dict(k_ref=(k, qk(dk)), kr_ref=(kr, tok(dk)), v_ref=(v, vals),
                  g_ref=(g, gates),
                  b_ref=(b, gate), cuts_ref=(cuts, gate), t_ref=(t, square),
                  w_ref=(w, tok(dk)), u_ref=(u, vals),
                  s_ref=(states, states_spec),
                  dnext_ref=(d_next, states_spec), delta_ref=(delta, vals),
                  dd_ref=(d_delta, vals), dk_out_ref=(dk_out, tok(dk)),
                  dg_out_ref=(dg_out, gates)),
      outputs=dict(
          dk_ref=(jax.ShapeDtypeStruct(
              (bsz, t_len, heads, dk),
              k.dtype if heads == h and not channel else acc), tok(dk)),
          dv_ref=(jax.ShapeDtypeStruct(v.shape, v.dtype), vals),
          db_ref=(jax.ShapeDtypeStruct(b.shape, acc), gate),
          da_ref=(jax.ShapeDtypeStruct(g.shape, acc), gates), **channel),
      # dg_out (a scalar gate's) is read before da is written, chunk by chunk.
      aliases=None if dg_out is None else dict(dg_out_ref="da_ref"),
      launch=launch, interpret=interpret, name="deltajax_ut_backward",
      block_v=launch.block_v, block_k=launch.block_k or dk, dot=dot)
