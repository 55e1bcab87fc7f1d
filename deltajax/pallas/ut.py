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
:func:`intra.forward` and ``K e^g`` is per channel. The backward through
this transform is :mod:`ut_backward`'s, with this module's block specs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from deltajax.pallas import core
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


def chunk_specs(chunk_size, groups):
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


def chunk_gate_spec(g, chunk_size):
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
  qk, _, gate, square, _ = chunk_specs(chunk_size, heads // h)
  return core.call(
      _inverse_kernel, grid=(bsz, heads, t_len // chunk_size),
      inputs=dict(k_ref=(k, qk(dk)),
                  g_ref=(g, None if g is None
                         else chunk_gate_spec(g, chunk_size)),
                  b_ref=(b, gate), cuts_ref=(cuts, gate), a_ref=(a, square)),
      outputs=dict(t_ref=(jax.ShapeDtypeStruct(
          (bsz, heads, t_len, chunk_size), k.dtype), square)),
      launch=launch, interpret=interpret, name="deltajax_ut_inverse", dot=dot)


def w_u(*, k, v, g, b, cuts, t, chunk_size, launch, interpret, dot):
  """``W = T diag(b) (K e^g)`` and ``U = T diag(b) V``, chunk by chunk.

  The forward scan never forms them (:func:`scan.forward`); the
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
  qk, tok, gate, square, _ = chunk_specs(chunk_size, heads // h)
  return core.call(
      _w_u_kernel, grid=(bsz, heads, t_len // chunk_size),
      inputs=dict(k_ref=(k, qk(dk)), v_ref=(v, tok(dv)),
                  g_ref=(g, chunk_gate_spec(g, chunk_size)), b_ref=(b, gate),
                  cuts_ref=(cuts, gate), t_ref=(t, square)),
      outputs=dict(
          w_ref=(jax.ShapeDtypeStruct((bsz, t_len, heads, dk), k.dtype),
                 tok(dk)),
          u_ref=(jax.ShapeDtypeStruct(v.shape, v.dtype), tok(dv))),
      launch=launch, interpret=interpret, name="deltajax_ut_w_u", dot=dot)
