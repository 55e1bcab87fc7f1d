"""A per-channel gate's intra-chunk scores' backward, in Mosaic GPU.

:func:`backward`: the whole-chunk pass of
:func:`deltajax.pallas.intra.backward` (g ``[C, K]`` per chunk): for the
output's causal ``P = scale Gamma * Q K^T`` and the UT system's strictly
lower ``A = Gamma * K K^T`` (``Gamma_ijk = e^{g_ik - g_jk}``), with ``dP =
dO Delta^T`` and ``dA = diag(b) dM`` (dM from the backward through the UT
transform)::

  dq = scale e^g * (dO S^T) + scale (dP (K e^{r - g})) e^{g - r}
  u  = (dM (K e^{r - g})) e^{g - r}
  dy = (dP^T (scale Q e^{g - r}) + dM^T (diag(b) K e^{g - r})) e^{r - g}
  dk = dk_in + diag(b) u + dy,  db = rowsum(K * u)
  da = reverse cumsum over the chunk of (dg_in + Q * dq + K * (diag(b) u
       - dy)), 0 where a is below the floor

through one reference gate per channel, the midpoint ``r`` of the chunk's
range (a secondary chunking): on a chunk whose gate falls by at most
:data:`deltajax.pallas.intra.SPAN` (every channel) each factor is at most
``e^{SPAN / 2}``, which the operands' dtype :data:`OPERANDS` (bfloat16
whatever q's dtype) holds with float32's exponent range. This kernel runs
on every chunk; the Pallas pass by blocks (``intra.backward(...,
done=...)``) then rewrites the chunks whose gate falls further, where
these factors may overflow float32 (faster than the Pallas whole-chunk
pass on the H200: benchmarks/RESULTS.md). Cuts folded into the gate (a
full forget at each, ``cuts``: packed documents) count as no fall: the
chunk is factored through its gate unfolded between them, the pairs across
a cut masked and da 0 at a cut, so that a chunk holding a cut is taken
whole as any other.

One CTA (one warpgroup) per (batch, chunk, value head, 64 key channels): TMA
brings q, k (head ``j // G``), the gate's tile and its first and last rows,
a's first row, beta and dM (16-bit), then dO, Delta and the entry state's
rows of these channels by blocks of 64 value columns through one set of
tiles, then dk_in and dg_in in their place; the products after dP's and
the state's read take bfloat16 operands (dP, dM and the decayed operands
rounded to them, as the Pallas kernel rounds them to TF32) and float32
accumulation; the reverse cumulative sum is one product with an upper
triangle of ones (in dM's tile), of dg's two bfloat16 halves. dq and dk
are staged in q's and k's tiles, once read: 111 KB of shared memory, two
CTAs per multiprocessor (127 KB, one, with grouped value heads' float32
dq and dk). Gated DeltaNet-2's read keys ``kr`` (A's row keys, per value
head) take K's place in dy's dM term, in db and in da's ``diag(b) u``
term, and ``diag(b) u`` goes to ``dkr = dkr_in + diag(b) u`` rather than
dk: kr's tile and dkr_in's (staging dkr) take 135 KB, 151 KB with grouped
value heads, one CTA.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from deltajax import common
from deltajax.mosaic import core
from deltajax.mosaic import ut
from deltajax.mosaic.core import COLS, ROWS, WGMMA
from deltajax.mosaic.scan import BV
from deltajax.mosaic.ut import C

KB = 64  # key channels per CTA
# The dtype of the products' operands formed here, whatever q's 16-bit
# dtype: bfloat16, with float32's exponent range. Through the midpoint gate
# an operand carries a factor up to e^{SPAN / 2} = e^20 or down to e^-20.
# In float16 (65504 = e^11.1, normal down to e^-9.7) K e^{r - g}, scale Q
# e^{g - r} and b K e^{g - r} overflowed where a chunk's gate fell by more
# than about 22 (Inf dq, dk, da, db; NaN A and P in the forward), and small
# factors underflow. float16 inputs pay bfloat16's rounding here, within
# fla's tolerances: at gates falling by 11 a chunk (where float16 operands
# held), KDA's dq 2.1e-3 and da 5.4e-3 relative RMS from float64 against
# their 4.8e-4 and 8.0e-4.
OPERANDS = jnp.bfloat16
_CHUNK_INPUTS = 8  # TMA copies: q, k, the gate, its first and last rows,
# a's first row, beta, dM
_BLOCK_INPUTS = 3  # per block of BV value columns: dO, Delta, S


def _value_blocks(mg, refs, at, bar, block_bar, prepare):
  """``(dP = dO Delta^T [C, C], dO S^T [C, KB])`` float32, by blocks of BV
  value columns through one set of tiles (in a scope of their own);
  ``prepare()`` runs once the chunk's inputs (on ``bar``) are in, while the
  first block arrives. ``refs``: dO, Delta, S in HBM; ``at``: (batch,
  chunk, value head, key channels)."""
  do_ref, delta_ref, s_ref = refs
  bi, n, h, channels = at
  tokens = pl.ds(n * C, C)

  def scope(do_s, delta_s, s_s):
    def load_block(j):
      cols = pl.ds(j * BV, BV)
      core.copy_in(((do_ref.at[bi, tokens, h, cols], do_s),
                    (delta_ref.at[bi, tokens, h, cols], delta_s),
                    (s_ref.at[bi, h, n, channels, cols], s_s)), block_bar)

    load_block(0)
    plgpu.barrier_wait(bar)
    prepare()
    d_p = read = None
    n_blocks = do_ref.shape[-1] // BV
    for j in range(n_blocks):
      plgpu.barrier_wait(block_bar)
      d_p, read = mg.products([([(do_s, core.T(delta_s))], (C, C), d_p),
                               ([(do_s, core.T(s_s))], (C, KB), read)])
      if j + 1 < n_blocks:  # this block's tiles are read
        load_block(j + 1)
    return d_p, read

  tile = core.smem((C, BV), do_ref.dtype)
  return pl.run_scoped(scope, tile, tile, core.smem((KB, BV), s_ref.dtype))


def _cuts(mg, n_rows, n_cols):
  """``(n_i - n_0, n_i > n_{i-1}, n_{C-1} - n_0)`` per row (ROWS) of a
  chunk's cut counts ``n``, given per row (ROWS) and per column (COLS): the
  cuts after its first token up to each token, whether the token is a cut
  (``n_{-1} = 0``), the cuts after its first token; by sums over a
  square's columns."""
  square = (n_rows.shape[0], n_cols.shape[0])
  rows, cols = mg.iota(square, 0), mg.iota(square, 1)
  n = lax.broadcast_in_dim(n_cols, square, [1])
  at = lambda j: jnp.sum(jnp.where(cols == j, n, 0.0), axis=1)
  first = at(0)
  return n_rows - first, n_rows > at(rows - 1), at(square[1] - 1) - first


def _body(mg, *refs, groups, scale, out_dtype, read_keys, folded):
  """One chunk's 64 key channels; with ``read_keys`` (Gated DeltaNet-2),
  A's row keys kr and the other kernels' share of their cotangent after the
  other inputs, kr's cotangent after the other outputs and kr's tile after
  the other tiles; with ``folded``, the cut counts after those inputs and
  their two tiles (read per row, per column: a tile read in both layouts
  fails Mosaic GPU's layout inference) after those tiles."""
  n_in = 11 + 2 * read_keys + folded
  n_out = 4 + read_keys
  (q_ref, k_ref, g_ref, b_ref, a_ref, s_ref, do_ref, delta_ref, dm_ref,
   dkin_ref, dgin_ref, *rest_in) = refs[:n_in]
  read_in, cuts_ref = rest_in[:2 * read_keys], rest_in[2 * read_keys:]
  dq_ref, dk_ref, da_ref, db_ref, *dkr_ref = refs[n_in:n_in + n_out]
  (q_s, k_s, g_s, kd_s, qu_s, bku_s, dp_s, dm_s, g_first, g_last, a_first,
   b_s, db_s, bar, block_bar, late_bar, *rest_s) = refs[n_in + n_out:]
  kr_s, cuts_s = rest_s[:read_keys], rest_s[read_keys:]
  bi, n = lax.axis_index("b"), lax.axis_index("n")
  blocks = q_ref.shape[3] // KB
  h, m = lax.div(lax.axis_index("h"), blocks), lax.rem(lax.axis_index("h"),
                                                       blocks)
  tokens, channels, hk = pl.ds(n * C, C), pl.ds(m * KB, KB), lax.div(h, groups)
  core.copy_in(((q_ref.at[bi, tokens, hk, channels], q_s),
                (k_ref.at[bi, tokens, hk, channels], k_s),
                (g_ref.at[bi, h, tokens, channels], g_s),
                (g_ref.at[bi, h, n * C, channels], g_first),
                (g_ref.at[bi, h, n * C + C - 1, channels], g_last),
                (a_ref.at[bi, n * C, h, channels], a_first),
                (b_ref.at[bi, h, tokens], b_s),
                (dm_ref.at[bi, h, tokens], dm_s),
                *(((read_in[0].at[bi, tokens, h, channels], kr_s[0]),)
                  if read_keys else ()),
                *((cuts_ref[0].at[bi, h, tokens], tile) for tile in cuts_s)),
                bar)
  keys, square = (C, KB), (C, C)
  rows, cols = mg.iota(square, 0), mg.iota(square, 1)
  on_keys = lambda x: lax.broadcast_in_dim(x, keys, [1])
  load = lambda ref: mg.load(ref, WGMMA).astype(jnp.float32)
  row_keys = kr_s[0] if read_keys else k_s  # A's row keys

  def segments():
    """:func:`_cuts` of the chunk's cut counts."""
    return _cuts(mg, mg.load(cuts_s[0], ROWS), mg.load(cuts_s[1], COLS))

  def pairs(strict):
    """The pairs of tokens that carry a score: ``j <= i`` (``strict``: ``j
    < i``), with ``folded`` cuts in one segment."""
    keep = rows > cols if strict else rows >= cols
    if folded:
      keep &= (core.rows(mg.load(cuts_s[0], ROWS), square)
               == lax.broadcast_in_dim(mg.load(cuts_s[1], COLS), square, [1]))
    return keep

  def unfolded(g):
    """``(g, r)``: the gate ``g`` and r, the midpoint of its range per
    channel, in every row; with ``folded`` cuts, both without their full
    forgets (:func:`deltajax.pallas.intra._unfolded`)."""
    r = on_keys((mg.load(g_first, COLS) + mg.load(g_last, COLS)) / 2)
    if not folded:
      return g, r
    later, _, folds = segments()
    floor = common.LOG_DECAY_FLOOR
    return (g - floor * core.rows(later, keys),
            r - floor / 2 * core.rows(folds, keys))

  def prepare():
    """The decayed operands' tiles, and dM masked to its pairs in place."""
    g, r = unfolded(mg.load(g_s, WGMMA))
    beta = core.rows(mg.load(b_s, ROWS), keys)
    up = jnp.exp(g - r)
    kd_s[...] = (load(k_s) * jnp.exp(r - g)).astype(kd_s.dtype)
    qu_s[...] = (scale * up * load(q_s)).astype(qu_s.dtype)
    bku_s[...] = (beta * load(row_keys) * up).astype(bku_s.dtype)
    dm_s[...] = jnp.where(pairs(True), load(dm_s), 0.0).astype(dm_s.dtype)

  d_p, read = _value_blocks(mg, (do_ref, delta_ref, s_ref),
                            (bi, n, h, channels), bar, block_bar, prepare)

  def finish(dkin_s, dgin_s, *rest):
    """dq, dk, db and da (and dkr), with dk_in and dg_in (and dkr_in)
    arriving in the value blocks' place."""
    dkrin_s = rest[0] if read_keys else None
    dq_s = rest[-1] if len(rest) > read_keys else q_s
    core.copy_in(((dkin_ref.at[bi, tokens, h, channels], dkin_s),
                  (dgin_ref.at[bi, h, tokens, channels], dgin_s),
                  *(((read_in[1].at[bi, tokens, h, channels], dkrin_s),)
                    if read_keys else ())), late_bar)
    dp_s[...] = jnp.where(pairs(False), d_p, 0.0).astype(dp_s.dtype)
    plgpu.commit_smem()
    dq, u, dy = mg.products([
        ([(dp_s, kd_s)], keys, None),
        ([(dm_s, kd_s)], keys, None),
        ([(core.T(dp_s), qu_s), (core.T(dm_s), bku_s)], keys, None)])
    g_folded = mg.load(g_s, WGMMA)
    g, r = unfolded(g_folded)
    up = jnp.exp(g - r)
    dq = scale * (up * dq + jnp.exp(g_folded) * read)
    q_dq = load(q_s) * dq  # q is read: its tile stages a 16-bit dq
    dq_s[...] = dq.astype(dq_s.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(dq_s, dq_ref.at[bi, tokens, h, channels])
    k, k_row = load(k_s), load(row_keys)
    u = u * up
    dy = dy * jnp.exp(r - g)
    db_s[...] = jnp.sum(k_row * u, axis=1)
    dk_a = core.rows(mg.load(b_s, ROWS), keys) * u  # A's row keys' share
    plgpu.barrier_wait(late_bar)
    dk = load(dkin_s) + dy
    if read_keys:  # dkr staged in dkr_in's tile
      dkrin_s[...] = load(dkrin_s) + dk_a
    else:
      dk = dk + dk_a
    dg = load(dgin_s) + q_dq + k_row * dk_a - k * dy
    # dk staged in its own float32 tile, else in k's (read).
    dk_s = dkin_s if jnp.dtype(out_dtype) == jnp.float32 else k_s
    dk_s[...] = dk.astype(dk_s.dtype)
    # The reverse cumulative sum, da_i = sum_{j >= i} dg_j, as one product
    # with the upper triangle of ones (in dM's tile, read), of dg's two
    # 16-bit halves (in the decayed operands' tiles, read). The triangle as
    # a 16-bit register operand gave non-finite da on the H200 (from shared
    # memory, finite and repeatable).
    qu_s[...], bku_s[...] = ut.halves(dg, qu_s.dtype)
    dm_s[...] = jnp.where(cols >= rows, 1.0, 0.0).astype(dm_s.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(dk_s, dk_ref.at[bi, tokens, h, channels])
    plgpu.copy_smem_to_gmem(db_s, db_ref.at[m, bi, h, tokens])
    if read_keys:
      plgpu.copy_smem_to_gmem(dkrin_s, dkr_ref[0].at[bi, tokens, h,
                                                     channels])
    (da,) = mg.products([([(dm_s, qu_s), (dm_s, bku_s)], keys, None)])
    # g_0 = max(a_0, floor): a_0's cotangent is 0 below the floor (the later
    # tokens' a are above it where the gate falls gently, but at the folded
    # cuts, whose cotangent is 0).
    floored = on_keys(mg.load(a_first, COLS)) <= common.LOG_DECAY_FLOOR
    zero = (mg.iota(keys, 0) == 0) & floored
    if folded:
      zero |= core.rows(segments()[1], keys)
    dgin_s[...] = jnp.where(zero, 0.0, da)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(dgin_s, da_ref.at[bi, tokens, h, channels])
    plgpu.wait_smem_to_gmem(0)

  f32_tile = core.smem(keys, jnp.float32)
  # dk_in, dg_in (dkr_in), and dq's float32 staging tile where it has one.
  tiles = 2 + read_keys + (jnp.dtype(out_dtype) == jnp.float32)
  pl.run_scoped(finish, *[f32_tile] * tiles)


def backward(mg, q, k, g, b, a, states, d_o, delta, d_m, dk, dg, kr=None,
             dkr=None, cuts=None, *, scale):
  """The scores' and the output's VJP of every chunk through its gate's
  midpoint (valid where the gate falls gently), added to the other
  kernels' shares.

  Args:
    mg: :class:`core.Mosaic`.
    q, k: ``[B, T, H, K]``; d_o, delta: ``[B, T, HV, V]``; states: ``[B, HV,
      T / C, K, V]``: one 16-bit dtype, K and V in {64, 128}, T a multiple
      of 64.
    g: ``[B, HV, T, K]`` float32 chunk-local cumulative gate; b: ``[B, HV,
      T]`` beta; a: ``[B, T, HV, K]`` the log gate (its floor).
    d_m: ``[B, HV, T, C]`` the cotangent of ``M = diag(b) A``; dk: ``[B, T,
      HV, K]``; dg: g's shape: the other kernels' shares (float32).
    kr, dkr: None, or A's row keys ``[B, T, HV, K]`` in q's dtype (Gated
      DeltaNet-2's read keys) and the other kernels' share of their
      cotangent (float32).
    cuts: None, or ``[B, HV, T]`` float32: the chunk-local cumulative count
      of the cuts folded into g (a full forget at each,
      :func:`deltajax.pallas.intra.forward`'s ``folded``): each chunk's
      gate is unfolded between them, its scores' pairs across a cut masked
      and da 0 at a cut (:func:`deltajax.pallas.intra.backward`'s
      ``folded``), so that a chunk whose gate falls gently between its cuts
      is taken whole.
    scale: Python float multiplying q.

  Returns:
    ``(dq, dk, da, db)`` as the whole-chunk pass of
    :func:`deltajax.pallas.intra.backward` leaves them: dq, dk ``[B, T, HV,
    K]`` in q's dtype (float32 with grouped value heads), da ``[B, T, HV,
    K]`` float32, db ``[K / 64, B, HV, T]`` float32 by blocks of key
    channels; with kr, kr's cotangent ``[B, T, HV, K]`` float32 after them.
  """
  bsz, t_len, h, d = q.shape
  heads, dv = d_o.shape[2:]
  dtype, f32 = q.dtype, jnp.float32
  out_dtype = dtype if heads == h else f32
  per_head = (bsz, t_len, heads, d)
  out_type = [jax.ShapeDtypeStruct(per_head, out_dtype),
              jax.ShapeDtypeStruct(per_head, out_dtype),
              jax.ShapeDtypeStruct(per_head, f32),
              jax.ShapeDtypeStruct((d // KB, bsz, heads, t_len), f32)]
  d_m = d_m.astype(OPERANDS)  # rounded as the products round it
  keys, square = (C, KB), (C, C)
  vec, key_vec = plgpu.SMEM((C,), f32), plgpu.SMEM((KB,), f32)
  tile, operand = core.smem(keys, dtype), core.smem(keys, OPERANDS)
  read_keys, folded = kr is not None, cuts is not None
  scratch = [tile, tile, core.smem(keys, f32), operand, operand, operand,
             core.smem(square, OPERANDS), core.smem(square, OPERANDS),
             key_vec, key_vec, key_vec, vec, vec,
             plgpu.Barrier(
                 num_arrivals=_CHUNK_INPUTS + read_keys + 2 * folded),
             plgpu.Barrier(num_arrivals=_BLOCK_INPUTS),
             plgpu.Barrier(num_arrivals=2 + read_keys)]
  read_in = ()
  if read_keys:
    out_type.append(jax.ShapeDtypeStruct(per_head, f32))
    scratch.append(tile)
    read_in = (kr, dkr)
  if folded:
    scratch += [vec, vec]
    read_in += (cuts,)
  body = lambda *refs: _body(mg, *refs, groups=heads // h, scale=scale,
                             out_dtype=out_dtype, read_keys=read_keys,
                             folded=folded)
  return mg.kernel(
      body, out_type=out_type, scratch_types=scratch,
      grid=(bsz, t_len // C, heads * (d // KB)), grid_names=("b", "n", "h"),
      kernel_name="deltajax_mosaic_intra_backward",
      )(q, k, g, b, a, states, d_o, delta, d_m, dk, dg, *read_in)

