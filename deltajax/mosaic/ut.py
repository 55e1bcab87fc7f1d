"""The UT transform in Mosaic GPU: per chunk, ``T = (I + diag(b) A)^-1``.

``A = Gamma * K K^T`` (strictly lower; GDN seed, section 2.3) for a scalar
gate, so ``I + diag(b) A`` is unit lower triangular. It is inverted by
recursive doubling (:func:`_invert`): the inverse of its diagonal blocks of
size s gives that of size 2s through two ``[64, 64]`` products on the
tensor cores, s = 2 to 32, each in three bf16 passes (the operands split
into their bf16 rounding and the rest), about float32 accuracy. These are
block forward substitution's values (:mod:`deltajax.pallas.ut` substitutes
within 16x16 blocks first), not a power series of A: they stay accurate for
aligned keys with b near 2.

One CTA (one warpgroup) per (batch, chunk, value head): TMA brings the
chunk's keys (q/k head ``j // G``), gate and beta into shared memory;
``K K^T`` is one wgmma.

For the backward, :func:`w_u` forms ``[W | U] = T diag(b) [K e^g | V]`` from
the forward's T: two wgmmas per chunk.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from deltajax.mosaic import compat
from deltajax.mosaic.compat import COLS, ROWS

C = 64   # the chunk: one wgmma tile of rows


def halves(x, dtype):
  """``x`` float32 -> its ``dtype`` rounding and the rounding of the rest."""
  high = x.astype(dtype)
  return high, (x - high.astype(jnp.float32)).astype(dtype)


def column_sums(mg, x, staging, width):
  """Sums across the rows of a per-row vector ``x``, as per-row vectors of
  length C: with ``width`` (x's length), x's total in every row; without it
  (x of length C), ``y_i = sum_{j >= i} x_j``. Through ``staging``
  (float32, x's length)."""
  staging[...] = x
  plgpu.commit_smem()  # a warpgroup barrier too: every row's value is in
  square = (C, width or C)
  cols = lax.broadcast_in_dim(mg.load(staging, COLS), square, [1])
  if width is None:
    cols = jnp.where(mg.iota(square, 1) >= mg.iota(square, 0), cols, 0.0)
  total = jnp.sum(cols, axis=1)
  plgpu.commit_smem()  # every row has read the staging before its reuse
  return total


def _split_product(mg, a, b, b_hi, b_lo):
  """``a @ b`` of float32 ``[C, C]`` values in three bf16 passes (the
  product of the rests dropped); ``b`` is staged in ``b_hi``, ``b_lo``."""
  a_hi, a_lo = halves(a, b_hi.dtype)
  b_hi[...], b_lo[...] = halves(b, b_hi.dtype)
  plgpu.commit_smem()
  return mg.mm([(a_hi, b_hi), (a_lo, b_hi), (a_hi, b_lo)], (C, C))


def _invert(mg, a, hi_s, lo_s):
  """``(I + a)^-1`` for the strictly lower float32 ``a [C, C]`` by
  recursive doubling: ``X``, the inverse of ``I + a``'s diagonal blocks of
  size s, becomes that of size 2s as ``X - X (a * M_s) X``, ``M_s`` masking
  each 2s-block's lower-left s-block (``D + E`` with ``(D^-1 E)^2 = 0``
  inverts to ``D^-1 - D^-1 E D^-1``): the same values as block forward
  substitution, with no reductions across the layout's threads. The
  products go through ``hi_s``, ``lo_s`` (:func:`_split_product`)."""
  rows, cols = mg.iota((C, C), 0), mg.iota((C, C), 1)
  lower_left = lambda size: jnp.where(
      (lax.div(rows, 2 * size) == lax.div(cols, 2 * size))
      & (lax.div(rows, size) > lax.div(cols, size)), a, 0.0)
  x = jnp.where(rows == cols, 1.0, 0.0) - lower_left(1)  # X = I at size 1
  size = 2
  while size < C:
    link = _split_product(mg, lower_left(size), x, hi_s, lo_s)
    x = x - _split_product(mg, x, link, hi_s, lo_s)
    size *= 2
  return x


def _body(mg, k_ref, g_ref, b_ref, t_ref, k_s, g_rows, g_cols, b_s, hi_s,
          lo_s, t_s, bar, *, groups):
  bi, n, h = lax.axis_index("b"), lax.axis_index("n"), lax.axis_index("h")
  tokens = pl.ds(n * C, C)
  compat.copy_in(((k_ref.at[bi, tokens, lax.div(h, groups)], k_s),
                  (g_ref.at[bi, h, tokens], g_rows),
                  (g_ref.at[bi, h, tokens], g_cols),
                  (b_ref.at[bi, h, tokens], b_s)), bar)
  plgpu.barrier_wait(bar)
  kk = mg.mm([(k_s, compat.T(k_s))], (C, C))
  # diag(b) (Gamma * K K^T).
  gamma = compat.decay(mg, mg.load(g_rows, ROWS), mg.load(g_cols, COLS),
                       strict=True)
  a = lax.broadcast_in_dim(mg.load(b_s, ROWS), (C, C), [0]) * gamma * kk
  t_s[...] = _invert(mg, a, hi_s, lo_s).astype(t_s.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(t_s, t_ref.at[bi, h, tokens])
  plgpu.wait_smem_to_gmem(0)


def inverse(mg, k, g, b, heads):
  """``T`` of every chunk.

  Args:
    mg: :class:`compat.Mosaic`.
    k: ``[B, T, H, K]`` 16-bit, K 64 or 128, T a multiple of 64.
    g: ``[B, HV, T]`` float32 chunk-local cumulative log gate.
    b: ``[B, HV, T]`` float32 beta.
    heads: HV (a multiple of H).

  Returns:
    ``t [B, HV, T, C]`` in k's dtype: each chunk's inverse at its rows.
  """
  bsz, t_len, h, dk = k.shape
  vec = plgpu.SMEM((C,), jnp.float32)
  square = compat.smem((C, C), k.dtype)
  body = lambda *refs: _body(mg, *refs, groups=heads // h)
  return mg.kernel(
      body, out_type=jax.ShapeDtypeStruct((bsz, heads, t_len, C), k.dtype),
      scratch_types=[compat.smem((C, dk), k.dtype), vec, vec, vec, square,
                     square, square, plgpu.Barrier(num_arrivals=4)],
      grid=(bsz, t_len // C, heads), grid_names=("b", "n", "h"),
      kernel_name="deltajax_mosaic_ut_inverse")(k, g, b)


def _w_u_body(mg, *refs, groups, values):
  """W (and U where ``values``) of one chunk."""
  n_in = 5 if values else 4
  inputs, outputs = refs[:n_in], refs[n_in:n_in + 1 + values]
  k_ref, *v_ref, g_ref, b_ref, t_ref = inputs
  k_s, *v_s, g_s, b_s, t_s, bar = refs[n_in + 1 + values:]
  bi, n, h = lax.axis_index("b"), lax.axis_index("n"), lax.axis_index("h")
  tokens, hk = pl.ds(n * C, C), lax.div(h, groups)
  compat.copy_in(((k_ref.at[bi, tokens, hk], k_s),
                  *((x.at[bi, tokens, h], x_s) for x, x_s in zip(v_ref, v_s)),
                  (g_ref.at[bi, h, tokens], g_s),
                  (b_ref.at[bi, h, tokens], b_s),
                  (t_ref.at[bi, h, tokens], t_s)), bar)
  plgpu.barrier_wait(bar)
  beta = mg.load(b_s, ROWS)
  keys = k_s.shape
  if len(g_s.shape) == 2:  # per channel: the gate's [C, K] tile
    k_factor = compat.rows(beta, keys) * jnp.exp(mg.load(g_s, compat.WGMMA))
  else:
    k_factor = compat.rows(beta * jnp.exp(mg.load(g_s, ROWS)), keys)
  # diag(b) [K e^g | V], in place of K and V, then W and U in their place.
  operands = [(k_s, k_factor)] + [
      (x_s, compat.rows(beta, x_s.shape)) for x_s in v_s]
  for x_s, factor in operands:
    x = mg.load(x_s, compat.WGMMA).astype(jnp.float32)
    x_s[...] = (factor * x).astype(x_s.dtype)
  plgpu.commit_smem()
  products = mg.products([([(t_s, x_s)], x_s.shape, None)
                          for x_s, _ in operands])
  for (x_s, _), x, dst in zip(operands, products, outputs):
    x_s[...] = x.astype(x_s.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(x_s, dst.at[bi, tokens, h])
  plgpu.wait_smem_to_gmem(0)


def w_u(mg, k, v, g, b, t, *, values=True):
  """``W = T diag(b) (K e^g)`` and ``U = T diag(b) V``, chunk by chunk.

  Args:
    mg: :class:`compat.Mosaic`.
    k: ``[B, T, H, K]``, v: ``[B, T, HV, V]``, t: ``[B, HV, T, C]``, one
      16-bit dtype; K and V in {64, 128}, T a multiple of 64.
    g: ``[B, HV, T]`` (per head) or ``[B, HV, T, K]`` (per channel)
      float32: the chunk-local cumulative log gate; b: ``[B, HV, T]``
      float32 beta.
    values: form U too (False: for :func:`ut_backward.ut_backward` that
      forms U itself; v is then only read for its shape).

  Returns:
    ``(w [B, T, HV, K], u [B, T, HV, V] or None)`` in k's dtype, as
    :func:`deltajax.pallas.ut.w_u`'s.
  """
  bsz, t_len, h, dk = k.shape
  heads, dv = v.shape[2:]
  vec = plgpu.SMEM((C,), jnp.float32)
  out_type = [jax.ShapeDtypeStruct((bsz, t_len, heads, dk), k.dtype)]
  scratch = [compat.smem((C, dk), k.dtype)]
  if values:
    out_type.append(jax.ShapeDtypeStruct(v.shape, k.dtype))
    scratch.append(compat.smem((C, dv), k.dtype))
  gate = compat.smem((C, dk), jnp.float32) if g.ndim == 4 else vec
  scratch += [gate, vec, compat.smem((C, C), k.dtype),
              plgpu.Barrier(num_arrivals=4 + values)]
  outputs = mg.kernel(
      lambda *refs: _w_u_body(mg, *refs, groups=heads // h, values=values),
      out_type=out_type, scratch_types=scratch,
      grid=(bsz, t_len // C, heads), grid_names=("b", "n", "h"),
      kernel_name="deltajax_mosaic_w_u")(k, *([v] if values else []), g, b,
                                         t)
  return outputs[0], outputs[1] if values else None
