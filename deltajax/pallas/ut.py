"""UT transform kernels: per chunk, ``T = (I + A)^-1``, then ``W`` and ``U``.

``A = diag(b) (Gamma * K K^T)`` (the UT transform of Gated DeltaNet's
chunkwise form: Yang, Kautz & Hatamizadeh, ICLR 2025) is strictly lower, so
``I + A`` is unit lower triangular: never singular, no pivoting. It is
inverted by blocks of 16: the diagonal blocks by forward substitution, the
blocks below by block forward substitution,
``T_ij = -T_ii sum_{j <= m < i} A_im T_mj``, with dots of Triton's minimum
size; the blocks are stored one by one. Substitution,
unlike a power series of ``A``, stays accurate for aligned keys with ``b``
near 2 (tests/test_pallas.py). A second kernel forms ``W = T diag(b) (K e^g)``
and ``U = T diag(b) V`` for the backward; the forward scan applies T itself.

Every kernel here is parallel over (batch, value head, chunk). Value head j
reads q/k head ``j // G`` through its index map (GVA). With cuts, ``Gamma``
and ``e^g`` are the masked decays of :mod:`core` (0 across a cut). For a
per-channel gate, :func:`inverse` takes ``Gamma * K K^T`` formed by
:func:`intra.forward`, ``K e^g`` is per channel, and :func:`ut_backward`
leaves the cotangent of ``diag(b) Gamma * K K^T`` to :func:`intra.backward`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from deltajax.pallas import core
from deltajax.pallas import scores
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


def inverse_blocks(a_block, n: int, mm):
  """Blocks ``T[i, j]`` (``j <= i``) of ``(I + A)^-1``, A strictly lower.

  The n diagonal blocks are inverted together (15 substitution steps on
  ``[n, 16, 16]``), then the blocks below them by ``[16, 16]`` products
  ``mm``.

  Args:
    a_block: ``a_block(i, j)`` gives the float32 ``[16, 16]`` block
      ``A[i, j]`` (``j <= i``), strictly lower when ``i == j``.
    n: number of 16-blocks in the chunk.
    mm: the float32 products.
  """
  a = {(i, m): a_block(i, m) for i in range(n) for m in range(i + 1)}
  diagonal = _unstack(_invert_unit_lower_blocks(
      _stack([a[i, i] for i in range(n)])))
  t = {}
  for i in range(n):
    t[i, i] = diagonal[i]
    for j in range(i):
      t[i, j] = -mm(t[i, i], sum(mm(a[i, m], t[m, j]) for m in range(j, i)))
  return t


def block_product(dtype, dot: core.Dot):
  """The float32 products of :func:`inverse_blocks` for keys of ``dtype``:
  exact for float32 keys, else in the config's precision (three TF32 passes
  by default). The sums below the diagonal cancel with aligned keys: at b =
  1.99 with identical keys T erred by 5 % of its largest entry with one
  TF32 pass on the H200, and by 3.1e-3 with three bf16 passes
  (:meth:`core.Dot.split`, emulated on the CPU), against 2.0e-3 with three
  TF32 passes and the tests' bound of 2^-8."""
  return functools.partial(
      dot, precision="ieee" if jnp.dtype(dtype) == jnp.float32 else None)


def invert(tiles, beta, n: int, dtype, dot: core.Dot):
  """The blocks ``{(i, j): T_ij}`` (``j <= i``, float32 ``[16, 16]``) of
  ``(I + diag(b) A)^-1`` from the ``[16, 16]`` tiles ``{(i, j): A_ij}``
  (``j <= i``) of the strictly lower A and ``beta``: n ``[16]`` pieces of
  b; products by :func:`block_product` for keys of ``dtype``."""
  return inverse_blocks(lambda i, j: beta[i][:, None] * tiles[i, j], n,
                        block_product(dtype, dot))


def store_blocks(ref, blocks, n: int):
  """``ref [16 n, 16 n]`` from its ``[16, 16]`` blocks ``{(i, j): x}``,
  absent blocks 0: stored block by block (a Triton value cannot be
  concatenated)."""
  zero = jnp.zeros((SUB, SUB), ref.dtype)
  for i in range(n):
    for j in range(n):
      x = blocks.get((i, j))
      ref[pl.ds(i * SUB, SUB), pl.ds(j * SUB, SUB)] = (
          zero if x is None else x.astype(ref.dtype))


def _inverse_kernel(*, k_ref, g_ref, b_ref, cuts_ref, a_ref, t_ref, dot):
  """One chunk: ``b [C]`` and either ``A [C, C]`` (a per-channel gate's,
  from :func:`intra.forward`) or ``k [C, K]``, ``g, cuts [C]`` -> ``T [C,
  C]``, by 16-blocks (:func:`invert`)."""
  n = k_ref.shape[0] // SUB
  sub = [pl.ds(i * SUB, SUB) for i in range(n)]
  acc = core.accumulator(k_ref.dtype)
  if a_ref is not None:
    tiles = {(i, j): a_ref[sub[i], sub[j]].astype(acc)
             for i in range(n) for j in range(i + 1)}
  else:
    k = [k_ref[s, :] for s in sub]
    g = [g_ref[s].astype(acc) for s in sub]
    cuts = [None if cuts_ref is None else cuts_ref[s] for s in sub]
    tiles = {(i, j): dot(k[i], k[j], trans_b=True) * core.decay(
        g[i], g[j], core.causal(SUB, strict=True) if i == j else True,
        cuts[i], cuts[j]) for i in range(n) for j in range(i + 1)}
  beta = [b_ref[s].astype(acc) for s in sub]
  store_blocks(t_ref, invert(tiles, beta, n, k_ref.dtype, dot), n)


def _w_u_kernel(*, k_ref, v_ref, g_ref, b_ref, cuts_ref, t_ref, w_ref, u_ref,
                dot):
  """One chunk: ``[W | U] = T diag(b) [K e^g | V]``."""
  acc = core.accumulator(k_ref.dtype)
  g, beta = g_ref[...].astype(acc), b_ref[...].astype(acc)
  cuts = None if cuts_ref is None else cuts_ref[...]
  t = t_ref[...]
  x_k = (core.on_keys(core.from_start(g, cuts), beta)
         * k_ref[...].astype(acc))
  x_v = beta[:, None] * v_ref[...].astype(acc)
  w_ref[...] = dot(t, x_k.astype(t.dtype)).astype(w_ref.dtype)
  u_ref[...] = dot(t, x_v.astype(t.dtype)).astype(u_ref.dtype)


def _chunk_specs(chunk_size, groups):
  """BlockSpec makers for grid ``(B, HV, N)``: q/k rows (head ``j // G``),
  value-head rows, gates, ``[C, C]`` blocks, ``[K, V]`` chunk states."""
  c = chunk_size
  qk = lambda d: core.block(None, c, None, d)(
      lambda i, j, n: (i, n, core.qk_head(j, groups), 0))
  tok = lambda d: core.block(None, c, None, d)(lambda i, j, n: (i, n, j, 0))
  gate = core.block(None, None, c)(lambda i, j, n: (i, j, n))
  square = core.block(None, None, c, c)(lambda i, j, n: (i, j, n, 0))
  state = lambda dk, dv: core.block(None, None, None, dk, dv)(
      lambda i, j, n: (i, j, n, 0, 0))
  return qk, tok, gate, square, state


def _gate_spec(g, chunk_size):
  """The gate's BlockSpec for grid ``(B, HV, N)``: one chunk."""
  return core.gate_spec(g, chunk_size, lambda i, j, n: (i, j, n))


def inverse(*, k, g, b, cuts, a, heads, chunk_size, launch, interpret, dot):
  """``T = (I + diag(b) A)^-1`` of every chunk.

  Args:
    k: ``[B, T, H, K]`` (K a power of two); g: ``[B, HV, T]`` chunk-local
      cumulative log gate; b: ``[B, HV, T]``; cuts: ``[B, HV, T]`` int32
      chunk-local cumulative cut count, or None; heads: HV; a: None (A is
      formed here from k, g and cuts), or ``[B, HV, T, C]`` (a per-channel
      gate's, from :func:`intra.forward`; g and cuts are then None).

  Returns:
    ``t [B, HV, T, C]`` in k's dtype: each chunk's ``[C, C]`` inverse at its
    rows.
  """
  bsz, t_len, h, dk = k.shape
  qk, _, gate, square, _ = _chunk_specs(chunk_size, heads // h)
  return core.call(
      _inverse_kernel, grid=(bsz, heads, t_len // chunk_size),
      inputs=dict(k_ref=(k, qk(dk)),
                  g_ref=(g, None if g is None else _gate_spec(g, chunk_size)),
                  b_ref=(b, gate), cuts_ref=(cuts, gate), a_ref=(a, square)),
      outputs=dict(t_ref=(jax.ShapeDtypeStruct(
          (bsz, heads, t_len, chunk_size), k.dtype), square)),
      launch=launch, interpret=interpret, name="deltajax_ut_inverse", dot=dot)


def w_u(*, k, v, g, b, cuts, t, chunk_size, launch, interpret, dot):
  """``W = T diag(b) (K e^g)`` and ``U = T diag(b) V``, chunk by chunk.

  The forward scan never forms them (:func:`state.forward_scan`); the
  backward does, from the forward's T.

  Args:
    k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``; g: ``[B, HV, T]`` or
    ``[B, HV, T, K]``; b, cuts: ``[B, HV, T]``; t: ``[B, HV, T, C]`` from
    :func:`inverse`.

  Returns:
    ``(w [B, T, HV, K], u [B, T, HV, V])`` in k's dtype.
  """
  bsz, t_len, h, dk = k.shape
  heads, dv = v.shape[2:]
  qk, tok, gate, square, _ = _chunk_specs(chunk_size, heads // h)
  return core.call(
      _w_u_kernel, grid=(bsz, heads, t_len // chunk_size),
      inputs=dict(k_ref=(k, qk(dk)), v_ref=(v, tok(dv)),
                  g_ref=(g, _gate_spec(g, chunk_size)), b_ref=(b, gate),
                  cuts_ref=(cuts, gate), t_ref=(t, square)),
      outputs=dict(
          w_ref=(jax.ShapeDtypeStruct((bsz, t_len, heads, dk), k.dtype),
                 tok(dk)),
          u_ref=(jax.ShapeDtypeStruct(v.shape, v.dtype), tok(dv))),
      launch=launch, interpret=interpret, name="deltajax_ut_w_u", dot=dot)


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
    ``[B, HV, T]``; t: ``[B, HV, T, C]`` from :func:`inverse`; states,
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
  qk, tok, gate, square, state = _chunk_specs(chunk_size, heads // h)
  vals, states_spec = tok(dv), state(dk, dv)
  gates = _gate_spec(g, chunk_size)
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
