"""The UT transform's W in Mosaic GPU, and helpers of the other kernels.

``T = (I + diag(b) A)^-1`` of every chunk, ``A = Gamma * K K^T`` (strictly
lower), comes from the Pallas kernel :func:`deltajax.pallas.ut.inverse`
(substitution in 16-blocks). For the backward's reverse pass, :func:`w`
forms ``W = T diag(b) (K e^g)`` from the forward's T: one CTA (one
warpgroup) per (batch, chunk, value head), TMA bringing the chunk's keys
(q/k head ``j // G``), gate, beta and T into shared memory, one wgmma.

:func:`halves` and :func:`column_sums` serve the other kernels: a float32
value as two 16-bit operands, and sums across a tile's rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from deltajax.mosaic import core
from deltajax.mosaic.core import COLS, ROWS

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


def _w_body(mg, k_ref, g_ref, b_ref, t_ref, w_ref, k_s, g_s, b_s, t_s, bar,
            *, groups):
  """W of one chunk."""
  bi, n, h = lax.axis_index("b"), lax.axis_index("n"), lax.axis_index("h")
  tokens, hk = pl.ds(n * C, C), lax.div(h, groups)
  core.copy_in(((k_ref.at[bi, tokens, hk], k_s),
                (g_ref.at[bi, h, tokens], g_s),
                (b_ref.at[bi, h, tokens], b_s),
                (t_ref.at[bi, h, tokens], t_s)), bar)
  plgpu.barrier_wait(bar)
  beta = mg.load(b_s, ROWS)
  keys = k_s.shape
  if len(g_s.shape) == 2:  # per channel: the gate's [C, K] tile
    k_factor = core.rows(beta, keys) * jnp.exp(mg.load(g_s, core.WGMMA))
  else:
    k_factor = core.rows(beta * jnp.exp(mg.load(g_s, ROWS)), keys)
  # diag(b) K e^g in K's place, then W in its place.
  x = mg.load(k_s, core.WGMMA).astype(jnp.float32)
  k_s[...] = (k_factor * x).astype(k_s.dtype)
  plgpu.commit_smem()
  (w,) = mg.products([([(t_s, k_s)], keys, None)])
  k_s[...] = w.astype(k_s.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(k_s, w_ref.at[bi, tokens, h])
  plgpu.wait_smem_to_gmem(0)


def w(mg, k, g, b, t, *, heads):
  """``W = T diag(b) (K e^g)``, chunk by chunk (the Mosaic GPU
  ut_backward forms what it needs of ``U = T diag(b) V`` itself).

  Args:
    mg: :class:`core.Mosaic`.
    k: ``[B, T, H, K]``, t: ``[B, HV, T, C]``, one 16-bit dtype; K in {64,
      128}, T a multiple of 64.
    g: ``[B, HV, T]`` (per head) or ``[B, HV, T, K]`` (per channel)
      float32: the chunk-local cumulative log gate; b: ``[B, HV, T]``
      float32 beta.
    heads: HV (a multiple of H).

  Returns:
    ``w [B, T, HV, K]`` in k's dtype, as :func:`deltajax.pallas.ut.w_u`'s.
  """
  bsz, t_len, h, dk = k.shape
  vec = plgpu.SMEM((C,), jnp.float32)
  gate = core.smem((C, dk), jnp.float32) if g.ndim == 4 else vec
  scratch = [core.smem((C, dk), k.dtype), gate, vec,
             core.smem((C, C), k.dtype), plgpu.Barrier(num_arrivals=4)]
  return mg.kernel(
      lambda *refs: _w_body(mg, *refs, groups=heads // h),
      out_type=jax.ShapeDtypeStruct((bsz, t_len, heads, dk), k.dtype),
      scratch_types=scratch,
      grid=(bsz, t_len // C, heads), grid_names=("b", "n", "h"),
      kernel_name="deltajax_mosaic_w")(k, g, b, t)
