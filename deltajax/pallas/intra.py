"""Intra-chunk kernels of a per-channel (KDA) gate: the gate, the scores.

:func:`chunk_gates` (the backward's): the chunk-local cumulative gate ``g =
cumsum(a)``, read in a's ``[B, T, HV, K]`` layout and written per value head,
and operands decayed by it.

Forward (:func:`forward`), parallel over (batch, value head, chunk): the
same gate and decayed operands (g itself kept only at each chunk's end), and
the strictly lower ``A = Gamma * K K^T`` of the UT system and the output's
causal ``P = scale Gamma * Q K^T``, ``[C, C]`` per chunk, where ``Gamma_ijk
= exp(g_ik - g_jk)``; a second pass forms the scores of the chunks whose
gate is not gentle (below), row block by row block. :func:`ut.inverse` and
the output kernels then work on plain matrices, as for a scalar gate.

Backward (:func:`backward`), parallel over (batch, value head, chunk, block
of key channels): the UT kernel leaves the cotangent ``dM`` (of ``M =
diag(b) A``) as a matrix, and this kernel forms the output's ``dP = dO
Delta^T`` and its read of the state's share of dq (the output's last
cotangent, ``P^T dO``, is :func:`output.delta_backward`'s); it turns them
into the scores' shares of dq, dk, db and of the gate, adds the other
kernels' shares, and sums the gate's cotangent into ``da`` (reverse
cumulative sum within the chunk), written in a's layout.

Every score is a product through a reference gate ``r`` (a secondary
chunking): ``x_i . y_j Gamma_ij = (x_i e^{g_i - r}) .
(y_j e^{r - g_j})``. For the 16 rows of block I (forward, and the row side
of the backward), ``r`` is the gate in the middle of block I where the gate
falls by at most :data:`SPAN` over the block (every channel): one ``[16, K]
x [K, C]`` product gives the whole row, the diagonal tile included, with
every factor at most ``e^SPAN``. Elsewhere (a strong gate), ``r`` is the gate
before block I: the columns left of the diagonal take only exponents <= 0,
and the diagonal tile is formed column by column, masked to ``i >= j``
before ``exp``. The column side of the backward (block I as ``y``) is the
mirror image: the middle of block I, or the gate at its end. Cuts are
masked on the products.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from deltajax import common
from deltajax.pallas import core
from deltajax.pallas.core import SUB

# The largest fall of the gate over a 16-token block that is factored through
# the block's middle: factors and the masked products above the diagonal stay
# below e^40 (~2e17), far from float32's overflow; a product below the
# diagonal whose right factor underflows is below e^{40 - 87}.
SPAN = 40.0


def _acc(ref):
  return core.accumulator(ref.dtype)


def _row(ref, t, ks=slice(None)):
  """Row t (a traced token) of ``ref`` ``[C, K]``, ``[1, K]`` float32."""
  return ref[pl.ds(t, 1), ks].astype(core.accumulator(ref.dtype))


def _is_gentle(g_ref, start, ks=slice(None), span=SUB):
  """Whether the gate falls by at most SPAN over the ``span`` tokens from
  ``start``."""
  fall = _row(g_ref, start, ks) - _row(g_ref, start + span - 1, ks)
  return jnp.max(fall) <= SPAN


def _later_cuts(cuts):
  """The cut counts ``[C]`` of a chunk less its first token's: the cuts
  after it."""
  return cuts - jnp.sum(jnp.where(core.iota(cuts.shape, 0) == 0, cuts, 0))


def _folds(cuts_ref, folded):
  """The cuts folded into the chunk's gate after its first token (0 unless
  ``folded``): each takes :data:`common.LOG_DECAY_FLOOR` off the gate."""
  return core.last(_later_cuts(cuts_ref[...])) if folded else 0


def _unfolded(g, cuts, folded):
  """The gate ``g [C, k]`` without the full forgets of the cuts folded into
  it after the chunk's first token (``folded``; ``cuts [C]`` its cut
  counts ``n``): ``g - FLOOR (n - n_0)``, the gate of the unfolded inputs
  from there on.
  The scores are factored through it, every pair across a cut masked; g
  itself where nothing is folded."""
  if not folded:
    return g
  return g - common.LOG_DECAY_FLOOR * _later_cuts(cuts).astype(g.dtype)[:,
                                                                        None]


def _is_gentle_chunk(g_ref, cuts_ref, folded):
  """Whether the gate (unfolded: :func:`_unfolded`) falls by at most SPAN
  over the chunk, every channel."""
  return _falls_gently(_row(g_ref, 0), _row(g_ref, g_ref.shape[0] - 1),
                       _folds(cuts_ref, folded))


def _cut_tokens(cuts_ref, start, size):
  """Whether each of the ``size`` tokens from ``start`` is a cut, ``[size]``:
  its cut count above the token's before it (0 before the chunk)."""
  n = cuts_ref[...]
  i = start + core.iota((size, n.shape[0]), 0)
  before = jnp.sum(jnp.where(core.iota(i.shape, 1) == i - 1, n[None, :], 0),
                   axis=1)
  return cuts_ref[pl.ds(start, size)] > before


def _first_gate(a_ref, ks=slice(None), cuts_ref=None, folded=False):
  """The chunk's first cumulative gate ``g_0 = a_0`` (floored; the floor
  where a cut is folded there), ``[1, k]``."""
  g = common.floored(_row(a_ref, 0, ks))
  if folded:
    g = jnp.where(cuts_ref[pl.ds(0, 1)][:, None] > 0,
                  common.LOG_DECAY_FLOOR, g)
  return g


def _falls_gently(first, end, folds):
  """:func:`_is_gentle_chunk` from the gate's first ``[1, k]`` and last
  ``[k]`` values and the cuts ``folds`` folded in after the first token
  (both passes of :func:`forward` decide it from these)."""
  return jnp.max(first - end) + common.LOG_DECAY_FLOOR * folds <= SPAN


def _row_reference(g_ref, start, gentle, ks=slice(None)):
  """``(r [1, k], limit)`` for row block I at ``start``: the gate in the
  middle of block I where ``gentle``, else the gate before it (0 before the
  chunk); the y rows factored through r are ``j < limit``."""
  token = jnp.where(gentle, start + SUB // 2, start - 1)
  r = jnp.where(token >= 0, _row(g_ref, jnp.maximum(token, 0), ks), 0)
  return r, start + SUB * gentle.astype(jnp.int32)


def _column_reference(g_ref, start, gentle, ks=slice(None)):
  """``(r [1, k], first)`` for column block I at ``start``: the gate in the
  middle of block I where ``gentle``, else the gate at its end; the x rows
  factored through r are ``i >= first``."""
  r = _row(g_ref, jnp.where(gentle, start + SUB // 2, start + SUB - 1), ks)
  return r, start + SUB * (1 - gentle.astype(jnp.int32))


def _pairs(rows, cols, cuts_ref, strict: bool):
  """``[len(rows), len(cols)]``: the pairs of tokens that carry a score
  (``j <= i``, or ``j < i``, in one segment between cuts); ``rows``, ``cols``:
  ``(start, size)``."""
  i = rows[0] + core.iota((rows[1], cols[1]), 0)
  j = cols[0] + core.iota((rows[1], cols[1]), 1)
  mask = i > j if strict else i >= j
  if cuts_ref is not None:
    mask &= (cuts_ref[pl.ds(*rows)][:, None]
             == cuts_ref[pl.ds(*cols)][None, :])
  return mask


def _diagonal_columns(g_ref, y_ref, start, ks, step, init):
  """``lax.fori_loop`` of ``step(j, y_t [1, k], e [16, k], carry)`` over the
  columns ``t = start + j`` of the diagonal tile at ``start``, with ``e =
  exp(g_I - g_t)`` on the rows ``>= j``, masked before exp."""
  g = g_ref[pl.ds(start, SUB), ks].astype(_acc(g_ref))
  below = core.iota((SUB, 1), 0)

  def column(j, carry):
    t = start + j
    e = core.masked_exp(g - _row(g_ref, t, ks), below >= j)
    return step(j, _row(y_ref, t, ks), e, carry)
  return lax.fori_loop(0, SUB, column, init)


def _cumulative_gate(a_ref, ks, dtype, cuts_ref=None, folded=False):
  """``g = cumsum(a)`` over the chunk's tokens (a floored; with ``folded``,
  the floor at the cuts of ``cuts_ref``), channels ks."""
  a = common.floored(a_ref[:, ks].astype(dtype))
  if folded:
    a = jnp.where(_cut_tokens(cuts_ref, 0, a.shape[0])[:, None],
                  common.LOG_DECAY_FLOOR, a)
  return jnp.cumsum(a, axis=0)


def _store_decayed(g, g_end, cuts, ks, counts, decayed):
  """For each side (``counts``: side -> number of operands), the inputs
  ``x_{side}_{i}`` times the decay from the chunk's entry state to each
  token (``e^g``, side "start") or from each token to the chunk's end
  (``e^{g_C - g}``, "end"), into ``out_{side}_{i}``, channels ks."""
  decays = dict(
      start=lambda: core.from_start(g, cuts),
      end=lambda: core.to_end(g, g_end, cuts,
                              None if cuts is None else core.last(cuts)))
  for side, count in counts:
    e = decays[side]() if count else None
    for i in range(count):
      out = decayed[f"out_{side}_{i}"]
      out[:, ks] = (decayed[f"x_{side}_{i}"][:, ks].astype(g.dtype)
                    * e).astype(out.dtype)


def _chunk_gates_kernel(*, a_ref, cuts_ref, g_ref, counts, **decayed):
  """g, and the operands decayed by it (:func:`_store_decayed`)."""
  g = _cumulative_gate(a_ref, slice(None), g_ref.dtype)
  g_ref[...] = g
  _store_decayed(g, core.last(g), None if cuts_ref is None else cuts_ref[...],
                 slice(None), counts, decayed)


def _decayed_specs(sides, heads, rows, inputs, outputs):
  """The inputs and outputs of :func:`_store_decayed` for ``sides`` (side,
  operands ``[B, T, H, K]``; value head j reads ``j // G``), with ``rows(h)``
  the BlockSpec of an array of h heads; returns its ``counts``."""
  for side, xs in sides:
    for i, x in enumerate(xs):
      inputs[f"x_{side}_{i}"] = (x, rows(x.shape[2]))
      outputs[f"out_{side}_{i}"] = (jax.ShapeDtypeStruct(
          (*x.shape[:2], heads, x.shape[3]), x.dtype), rows(heads))
  return tuple((side, len(xs)) for side, xs in sides)


def chunk_gates(a, *, cuts=None, from_start=(), to_end=(), chunk_size,
                interpret):
  """The chunk-local cumulative gate of a per-channel log gate, and key-side
  operands decayed by it (so that the sequential scans take no exponentials).

  Args:
    a: ``[B, T, HV, K]``, float32 (float64), K a power of two.
    cuts: ``[B, HV, T]`` int32 chunk-local cumulative cut count, or None.
    from_start, to_end: arrays ``x [B, T, H, K]`` (value head j reads head
      ``j // G``), each to be returned times ``e^g`` (the decay from the
      chunk's entry state to each token) or ``e^{g_C - g}`` (from each token
      to the chunk's end); the decays are 0 across a cut.

  Returns:
    ``(g, starts, ends)``: ``g [B, HV, T, K]`` with ``g_t = sum of a_s`` over
    the tokens ``s <= t`` of t's chunk (a clamped at
    :data:`common.LOG_DECAY_FLOOR`); ``starts``, ``ends``: tuples of
    ``[B, T, HV, K]`` in each x's dtype, in the order given.
  """
  bsz, t_len, heads, dk = a.shape
  c = chunk_size
  rows = lambda h: core.block(None, c, None, dk)(
      lambda i, j, n: (i, n, core.qk_head(j, heads // h), 0))
  inputs = dict(a_ref=(a, rows(heads)), cuts_ref=(
      cuts, core.block(None, None, c)(lambda i, j, n: (i, j, n))))
  outputs = dict(g_ref=(jax.ShapeDtypeStruct((bsz, heads, t_len, dk),
                                             a.dtype),
                        core.block(None, None, c, dk)(
                            lambda i, j, n: (i, j, n, 0))))
  counts = _decayed_specs((("start", from_start), ("end", to_end)), heads,
                          rows, inputs, outputs)
  g, *decayed = core.call(
      _chunk_gates_kernel, grid=(bsz, heads, t_len // c), inputs=inputs,
      outputs=outputs, launch=core.Launch(num_warps=4), interpret=interpret,
      name="deltajax_chunk_gates", as_tuple=True, counts=counts)
  return g, tuple(decayed[:len(from_start)]), tuple(decayed[len(from_start):])


def _store_scores(*, p_ref, kk_ref, cuts_ref, start, qk, kk, scale):
  """Stores the rows from ``start`` of P (``scale qk``) and A (``kk``),
  masked to their pairs."""
  at = ((start, qk.shape[0]), (0, qk.shape[1]))
  rows = pl.ds(start, qk.shape[0])
  p_ref[rows, :] = jnp.where(_pairs(*at, cuts_ref, strict=False), scale * qk,
                             0).astype(p_ref.dtype)
  kk_ref[rows, :] = jnp.where(_pairs(*at, cuts_ref, strict=True), kk,
                              0).astype(kk_ref.dtype)


def _forward_whole_chunk(*, q_ref, k_ref, kr_ref, gates, cuts_ref, kk_ref,
                         p_ref, scale, dot):
  """The chunk's P and A ``[C, C]`` through one reference, the midpoint of
  the gate's range: ``(X e^{g - r}) (K e^{r - g})^T``; ``gates``: ``(ks,
  g [C, k], r [1, k])`` per block of key channels."""
  mm = dot.of_float32(k_ref.dtype)
  qk = kk = 0
  for ks, g, r in gates:
    up = jnp.exp(g - r)
    k_down = k_ref[:, ks].astype(g.dtype) * jnp.exp(r - g)
    qk += mm(q_ref[:, ks].astype(g.dtype) * up, k_down, trans_b=True)
    kk += mm(kr_ref[:, ks].astype(g.dtype) * up, k_down, trans_b=True)
  _store_scores(p_ref=p_ref, kk_ref=kk_ref, cuts_ref=cuts_ref, start=0,
                qk=qk, kk=kk, scale=scale)


def _forward_by_blocks(*, start, q_ref, k_ref, kr_ref, g_ref, cuts_ref,
                       kk_ref, p_ref, scale, dot, block_k):
  """Rows ``start .. start + 15`` of one chunk's P and A, ``[16, C]`` each,
  through the reference of :func:`_row_reference`, the diagonal tile exactly
  where the block's gate is not gentle."""
  c, d = k_ref.shape
  rows = pl.ds(start, SUB)
  mm = dot.of_float32(k_ref.dtype)
  token = core.iota((c, 1), 0)
  gentle = _is_gentle(g_ref, start)
  qk = kk = 0
  for ks in core.blocks(d, block_k):
    r, limit = _row_reference(g_ref, start, gentle, ks)
    g_i = g_ref[rows, ks].astype(r.dtype)
    left = jnp.exp(g_i - r)
    right = k_ref[:, ks].astype(r.dtype) * core.masked_exp(
        r - g_ref[:, ks].astype(r.dtype), token < limit)
    qk += mm(q_ref[rows, ks].astype(r.dtype) * left, right, trans_b=True)
    kk += mm(kr_ref[rows, ks].astype(r.dtype) * left, right, trans_b=True)

  def diagonal(tiles):
    cols = core.iota((SUB, c), 1)

    def step(j, y_t, e, tiles, ks):
      t = start + j
      return tuple(tile + jnp.where(cols == t, jnp.sum(
          x_ref[rows, ks].astype(e.dtype) * y_t * e, axis=1)[:, None], 0)
                   for x_ref, tile in zip((q_ref, kr_ref), tiles))
    for ks in core.blocks(d, block_k):
      tiles = _diagonal_columns(
          g_ref, k_ref, start, ks,
          lambda j, y_t, e, tiles, ks=ks: step(j, y_t, e, tiles, ks), tiles)
    return tiles
  qk, kk = lax.cond(gentle, lambda t: t, diagonal, (qk, kk))
  _store_scores(p_ref=p_ref, kk_ref=kk_ref, cuts_ref=cuts_ref, start=start,
                qk=qk, kk=kk, scale=scale)


def _gate_and_scores_kernel(*, a_ref, cuts_ref, q_ref, k_ref, kr_ref, g_ref,
                            g_end_ref, kk_ref, p_ref, counts, scale, dot,
                            block_k, every_g, folded, **decayed):
  """The forward's first pass over one chunk: its cumulative gate, the
  operands decayed by it (:func:`_store_decayed`), the gate at its end, and
  its scores where the gate is gentle (:func:`_forward_whole_chunk`); where
  it is not, g (the second pass's input; written only there unless
  ``every_g``)."""
  cuts = None if cuts_ref is None else cuts_ref[...]
  blocks = core.blocks(a_ref.shape[1], block_k)
  gates = [_cumulative_gate(a_ref, ks, g_ref.dtype, cuts_ref, folded)
           for ks in blocks]
  ends = [core.last(g) for g in gates]
  folds = _folds(cuts_ref, folded)
  first = lambda ks: _first_gate(a_ref, ks, cuts_ref, folded)
  gentle = functools.reduce(jnp.logical_and, [
      _falls_gently(first(ks), end, folds) for ks, end in zip(blocks, ends)])
  for ks, g, end in zip(blocks, gates, ends):
    g_end_ref[ks] = end
    _store_decayed(g, end, cuts, ks, counts, decayed)

    def store_g(ks=ks, g=g):
      g_ref[:, ks] = g
    if every_g:
      store_g()
    else:
      pl.when(~gentle)(store_g)
  # The midpoint of the unfolded gate's range: g_0 and g_C - FLOOR folds.
  pl.when(gentle)(lambda: _forward_whole_chunk(
      q_ref=q_ref, k_ref=k_ref, kr_ref=k_ref if kr_ref is None else kr_ref,
      gates=[(ks, _unfolded(g, cuts, folded),
              (first(ks) + end
               - common.LOG_DECAY_FLOOR * folds) / 2)
             for ks, g, end in zip(blocks, gates, ends)],
      cuts_ref=cuts_ref, kk_ref=kk_ref, p_ref=p_ref, scale=scale, dot=dot))


def _scores_by_blocks_kernel(*, a_ref, g_end_ref, q_ref, k_ref, kr_ref,
                             g_ref, cuts_ref, kk_ref, p_ref, scale, dot,
                             block_k, folded, **done):
  """The forward's second pass: a chunk whose gate is not gentle, block of
  rows by block (one program per chunk: most chunks exit at once);
  ``done`` (the first pass's scores, aliased to this pass's) is not read."""
  del done

  def block(i, carry):
    _forward_by_blocks(
        start=i * SUB, q_ref=q_ref, k_ref=k_ref,
        kr_ref=k_ref if kr_ref is None else kr_ref, g_ref=g_ref,
        cuts_ref=cuts_ref, kk_ref=kk_ref, p_ref=p_ref, scale=scale, dot=dot,
        block_k=block_k)
    return carry
  gentle = _falls_gently(_first_gate(a_ref, cuts_ref=cuts_ref,
                                     folded=folded),
                         g_end_ref[...], _folds(cuts_ref, folded))

  @pl.when(~gentle)
  def _():
    lax.fori_loop(0, k_ref.shape[0] // SUB, block, 0)


def _row_side(*, start, gentle, g_ref, k_ref, d_rows, mm):
  """Row block I's VJP as x, per cotangent ``d [16, C]`` of its rows:
  ``sum_j d_ij k_j Gamma_ij`` ``[16, k]``, the diagonal tile included only
  where ``gentle``."""
  c = k_ref.shape[0]
  acc = _acc(g_ref)
  r, limit = _row_reference(g_ref, start, gentle)
  left = jnp.exp(g_ref[pl.ds(start, SUB), :].astype(acc) - r)
  right = k_ref[...].astype(acc) * core.masked_exp(
      r - g_ref[...].astype(acc), core.iota((c, 1), 0) < limit)
  return [mm(d, right) * left for d in d_rows]


def _column_side(*, start, gentle, g_ref, xs, d_cols, mm):
  """Block I's VJP as y: ``sum_i sum_m d_m,ij x_m,i Gamma_ij`` ``[16, k]``
  over the pairs ``(d_m [C, 16], x_m [C, k])``, the diagonal tile included
  only where ``gentle``."""
  c = g_ref.shape[0]
  acc = _acc(g_ref)
  r, first = _column_reference(g_ref, start, gentle)
  down = core.masked_exp(g_ref[...].astype(acc) - r,
                         core.iota((c, 1), 0) >= first)
  up = jnp.exp(r - g_ref[pl.ds(start, SUB), :].astype(acc))
  return sum(mm(d, x * down, trans_a=True) for d, x in zip(d_cols, xs)) * up


def _diagonal_vjp(*, start, g_ref, k_ref, xs, d_tiles, grads):
  """Adds diagonal tile I's VJP, exactly: ``grads = (row-side per d_tile
  [16, k], column side [16, k])``; ``d_tiles``: per row operand x (``[16,
  k]`` block I of q, beta k), its cotangent tile ``[16, 16]``, masked."""
  cols = core.iota((SUB, SUB), 1)
  below = core.iota((SUB, 1), 0)

  def step(j, y_t, e, carry):
    rows_side, dy = carry
    d_j = [jnp.sum(jnp.where(cols == j, d, 0), axis=1)[:, None]
           for d in d_tiles]
    rows_side = [r + d * e * y_t for r, d in zip(rows_side, d_j)]
    dy_t = sum(jnp.sum(d * x * e, axis=0) for d, x in zip(d_j, xs))
    return rows_side, dy + jnp.where(below == j, dy_t[None, :], 0)
  return _diagonal_columns(g_ref, k_ref, start, slice(None), step, grads)


def _store_dq(refs, rows, dq_p, scale, dot):
  """Stores ``rows``' dq: P's row side ``dq_p`` plus the state's read,
  ``scale e^g * (dO S^T)``; returns their gate cotangent so far, dg_in plus
  ``q dq``."""
  g = refs["g"][rows, :].astype(dq_p.dtype)
  cuts = None if refs["cuts"] is None else refs["cuts"][rows]
  read = dot(refs["do"][rows, :], refs["s"][...], trans_b=True)
  dq = dq_p + read * core.on_keys(scale * core.from_start(g, cuts))
  refs["dq"][rows, :] = dq.astype(refs["dq"].dtype)
  return refs["dg_in"][rows, :] + refs["q"][rows, :].astype(dq.dtype) * dq


def _finish(refs, rows, dg, u, dy, later, dot, folded):
  """Stores ``rows``' dk (and dkr), db and da from their gate cotangent so
  far ``dg`` (:func:`_store_dq`), A's row side ``u`` and the column sides
  ``dy``; ``later``: the gate's cotangent summed over the rows after these;
  ``folded``: da is 0 at the cuts folded into g too. Returns it summed over
  ``rows`` too."""
  acc = u.dtype
  k = refs["k"][rows, :].astype(acc)
  dk_a = refs["b"][rows].astype(acc)[:, None] * u  # A's row keys' share
  if refs["kr"] is None:  # A's row keys are k
    refs["dk"][rows, :] = (refs["dk_in"][rows, :] + dk_a + dy).astype(
        refs["dk"].dtype)
    refs["db"][rows] = jnp.sum(k * u, axis=1)
    dg += k * (dk_a - dy)
  else:
    kr = refs["kr"][rows, :].astype(acc)
    refs["dkr"][rows, :] = (refs["dkr_in"][rows, :] + dk_a).astype(
        refs["dkr"].dtype)
    refs["dk"][rows, :] = (refs["dk_in"][rows, :] + dy).astype(
        refs["dk"].dtype)
    refs["db"][rows] = jnp.sum(kr * u, axis=1)
    dg += kr * dk_a - k * dy
  da = core.reverse_cumsum(dg, dot) + later
  if refs["a"] is not None:  # 0 below the floor, where a is clamped
    da = jnp.where(refs["a"][rows, :] > common.LOG_DECAY_FLOOR, da, 0)
  if folded:
    da = jnp.where(_cut_tokens(refs["cuts"], rows.start, rows.size)[:, None],
                   0, da)
  refs["da"][rows, :] = da
  return later + jnp.sum(dg, axis=0)[None, :]


def _row_keys(refs, k, at):
  """A's row keys at ``at``: the keys ``k`` already loaded there, or the
  read keys kr (Gated DeltaNet-2)."""
  return k if refs["kr"] is None else refs["kr"][at].astype(k.dtype)


def _masked_cotangents(refs, rows, cols, at, dot):
  """dP and dM at ``at`` (a ref index: rows, columns), masked to their
  pairs; rows and cols: ``(start, size)`` of the tokens there. ``dP = dO
  Delta^T`` is formed here, from the rows of dO and Delta at ``at``."""
  d_p = dot(refs["do"][at[0], :], refs["delta"][at[1], :], trans_b=True)
  return [jnp.where(_pairs(rows, cols, refs["cuts"], strict=s), x, 0)
          for x, s in ((d_p, False),
                       (refs["dm"][at].astype(d_p.dtype), True))]


def _backward_whole_chunk(refs, *, scale, dot, folded):
  """The chunk's VJP through one reference, the midpoint ``r`` of the
  gate's range (every factor at most ``e^{SPAN / 2}``): ``dq_P = scale (dP
  (K e^{r - g})) e^{g - r}``, ``u = (dM (K e^{r - g})) e^{g - r}``, ``dy =
  (dP^T (scale Q e^{g - r}) + dM^T (diag(b) K e^{g - r})) e^{r - g}``, g
  unfolded (:func:`_unfolded`)."""
  g_ref, cuts_ref = refs["g"], refs["cuts"]
  c = g_ref.shape[0]
  acc = _acc(g_ref)
  mm = dot.of_float32(refs["k"].dtype)
  g = _unfolded(g_ref[...].astype(acc),
                None if cuts_ref is None else cuts_ref[...], folded)
  r = (_row(g_ref, 0) + _row(g_ref, c - 1)
       - common.LOG_DECAY_FLOOR * _folds(cuts_ref, folded)) / 2
  up, down = jnp.exp(g - r), jnp.exp(r - g)
  # In this order, with dq stored first, fewer [C, k] float32 values are
  # live at once (registers).
  k_down = refs["k"][...].astype(acc) * down
  d_p, d_m = _masked_cotangents(refs, (0, c), (0, c), (slice(None),) * 2,
                                dot)
  dg = _store_dq(refs, pl.ds(0, c), scale * mm(d_p, k_down) * up, scale, dot)
  u = mm(d_m, k_down) * up
  q = refs["q"][...].astype(acc)
  beta = refs["b"][...].astype(acc)[:, None]
  kr = _row_keys(refs, refs["k"][...].astype(acc), ...)
  dy = (mm(d_p, scale * q * up, trans_a=True)
        + mm(d_m, beta * kr * up, trans_a=True)) * down
  _finish(refs, pl.ds(0, c), dg, u, dy, 0, dot, folded)


def _backward_by_blocks(refs, *, scale, dot, folded):
  """The chunk's VJP block by block (last first), each through the
  references of :func:`_row_reference` and :func:`_column_reference`, the
  diagonal tile exactly where the block's gate is not gentle."""
  g_ref, k_ref = refs["g"], refs["k"]
  c, width = k_ref.shape
  acc = _acc(g_ref)
  mm = dot.of_float32(k_ref.dtype)
  beta = refs["b"][...].astype(acc)[:, None]
  xs = [scale * refs["q"][...].astype(acc),
        beta * _row_keys(refs, k_ref[...].astype(acc), ...)]

  def block(i, later):
    start = (c // SUB - 1 - i) * SUB
    rows = pl.ds(start, SUB)
    gentle = _is_gentle(g_ref, start)
    at = dict(start=start, gentle=gentle, g_ref=g_ref)
    d_rows = _masked_cotangents(refs, (start, SUB), (0, c),
                                (rows, slice(None)), dot)
    d_cols = _masked_cotangents(refs, (0, c), (start, SUB),
                                (slice(None), rows), dot)
    grads = (_row_side(k_ref=k_ref, d_rows=d_rows, mm=mm, **at),
             _column_side(xs=xs, d_cols=d_cols, mm=mm, **at))
    q, k = refs["q"][rows, :].astype(acc), k_ref[rows, :].astype(acc)
    kr = _row_keys(refs, k, (rows, slice(None)))
    beta_i = refs["b"][rows].astype(acc)[:, None]
    (dq_p, u), dy = lax.cond(
        gentle, lambda grads: grads,
        lambda grads: _diagonal_vjp(
            start=start, g_ref=g_ref, k_ref=k_ref, xs=[scale * q, beta_i * kr],
            d_tiles=_masked_cotangents(refs, (start, SUB), (start, SUB),
                                       (rows, rows), dot),
            grads=grads),
        grads)
    return _finish(refs, rows, _store_dq(refs, rows, scale * dq_p, scale, dot),
                   u, dy, later, dot, folded)
  lax.fori_loop(0, c // SUB, block, jnp.zeros((1, width), acc))


def _backward_kernel(*, whole_chunk, scale, dot, folded, **refs):
  """One chunk, the key channels of one block (q, k, g and the dq, dk, dg
  refs ``[C, k]``), where the chunk's gate is gentle (``whole_chunk``) or
  where it is not; db's share of these channels.

  ``dq = scale e^g * (dO S^T) + P's row side`` (``dP = dO Delta^T``),
  ``dk = dk_in + b u + dy`` (u: A's row side of dM, ``dA = diag(b) dM``; dy:
  both column sides), ``db = kr . u`` (``sum_j dM_ij A_ij``), ``da = reverse
  cumsum of (dg_in + q dq + kr b u - k dy)``; with read keys kr (A's row
  side, Gated DeltaNet-2), ``b u`` goes to ``dkr = dkr_in + b u`` instead of
  dk. The refs are named without ``_ref``; ``*_done`` (the whole-chunk
  pass's outputs, aliased to this pass's) are not read.
  """
  refs = {name[:-len("_ref")]: ref for name, ref in refs.items()}
  gentle = _is_gentle_chunk(refs["g"], refs["cuts"], folded)
  if whole_chunk:
    pl.when(gentle)(lambda: _backward_whole_chunk(refs, scale=scale, dot=dot,
                                                  folded=folded))
  else:
    pl.when(~gentle)(lambda: _backward_by_blocks(refs, scale=scale, dot=dot,
                                                 folded=folded))


def _chunk_rows(chunk_size, groups, width):
  """BlockSpec makers for grid ``(m, B, HV, N)``: one chunk's q/k rows
  (head ``j // G``) or per-value-head rows, ``width`` channels at block m
  (all for ``width=None``). The grid's first index runs fastest (Pallas'
  Triton launch grid): the programs of one chunk run side by side and share
  its reads in L2."""
  c = chunk_size
  col = lambda m: 0 if width is None else m
  return dict(
      qk=lambda d: core.block(None, c, None, width or d)(
          lambda m, i, j, n: (i, n, core.qk_head(j, groups), col(m))),
      keys=lambda d: core.block(None, c, None, width or d)(
          lambda m, i, j, n: (i, n, j, col(m))),
      g=lambda d: core.block(None, None, c, width or d)(
          lambda m, i, j, n: (i, j, n, col(m))),
      gate=core.block(None, None, c)(lambda m, i, j, n: (i, j, n)))


def forward(*, q, k, a, cuts, heads, scale, chunk_size, launch, interpret,
            dot, kr=None, from_start=(), to_end=(), keep_g=False,
            folded=False):
  """The chunk-local gate and the intra-chunk scores of every chunk, with
  the operands decayed by the gate (:func:`chunk_gates`' work, fused: g is
  written whole only with ``keep_g``).

  Args:
    q, k: ``[B, T, H, K]``; a: ``[B, T, HV, K]`` per-channel log gate (as
    :func:`chunk_gates` takes it); cuts: ``[B, HV, T]`` int32 chunk-local
    cumulative cut count, or None; heads: HV; launch.block_k: key channels
    per inner product; kr: None, or ``[B, T, HV, K]``: the keys on A's row
    side (Gated DeltaNet-2's erased keys ``b * k``); from_start, to_end: as
    :func:`chunk_gates` takes them; keep_g: g written for every chunk (for
    the backward), not only where the second pass reads it; folded: the
    cuts are folded into the gate here (a full forget, a at
    :data:`common.LOG_DECAY_FLOOR`, at each cut token: g, g_end and the
    decayed operands are ``impl="mosaic"``'s folded gate's, a as given),
    and the scores unfold it again between the cuts (:func:`_unfolded`)
    and mask the pairs across them.

  Returns:
    ``(a, p, g_end, starts, ends, g)``: ``[B, HV, T, C]`` float32 (float64 for
    float64 inputs), each chunk's ``A = Gamma * Kr K^T`` (strictly lower;
    ``Kr = K`` without kr) and ``P = scale Gamma * Q K^T`` (causal) at its
    rows, 0 across a cut; ``g_end [B, HV, T / C, K]``, the cumulative gate
    at each chunk's end; ``starts``, ``ends``: as :func:`chunk_gates`
    returns them; ``g [B, HV, T, K]``, the cumulative gate (at every chunk
    with ``keep_g``, else only where the gate is not gentle).
  """
  bsz, t_len, h, dk = k.shape
  c, n = chunk_size, t_len // chunk_size
  sp = _chunk_rows(c, heads // h, None)
  per_chunk = (bsz, heads, t_len, c)
  ends = core.block(None, None, None, dk)(lambda m, i, j, n: (i, j, n, 0))
  inputs = dict(a_ref=(a, sp["keys"](dk)), cuts_ref=(cuts, sp["gate"]),
                q_ref=(q, sp["qk"](dk)), k_ref=(k, sp["qk"](dk)),
                kr_ref=(kr, sp["keys"](dk)))
  chunk = core.block(None, None, c, c)(lambda m, i, j, n: (i, j, n, 0))
  chunks = dict(
      kk_ref=(jax.ShapeDtypeStruct(per_chunk, core.accumulator(k.dtype)),
              chunk),
      p_ref=(jax.ShapeDtypeStruct(per_chunk, core.accumulator(q.dtype)),
             chunk))
  outputs = dict(
      g_ref=(jax.ShapeDtypeStruct((bsz, heads, t_len, dk), a.dtype),
             sp["g"](dk)),
      g_end_ref=(jax.ShapeDtypeStruct((bsz, heads, n, dk), a.dtype), ends),
      **chunks)
  rows = lambda x_heads: core.block(None, c, None, dk)(
      lambda m, i, j, n: (i, n, core.qk_head(j, heads // x_heads), 0))
  counts = _decayed_specs((("start", from_start), ("end", to_end)), heads,
                          rows, inputs, outputs)
  run = functools.partial(core.call, launch=launch, interpret=interpret,
                          scale=scale, dot=dot, block_k=launch.block_k or dk,
                          folded=folded)
  g, g_end, kk, p, *decayed = run(
      _gate_and_scores_kernel, grid=(1, bsz, heads, n), inputs=inputs,
      outputs=outputs, name="deltajax_intra", as_tuple=True, counts=counts,
      every_g=keep_g)
  # The chunks whose gate is not gentle, written into the first pass's
  # outputs.
  kk, p = run(
      _scores_by_blocks_kernel, grid=(1, bsz, heads, n),
      inputs=dict(a_ref=inputs["a_ref"], g_end_ref=(g_end, ends),
                  q_ref=inputs["q_ref"], k_ref=inputs["k_ref"],
                  kr_ref=inputs["kr_ref"], g_ref=(g, sp["g"](dk)),
                  cuts_ref=inputs["cuts_ref"],
                  kk_done_ref=(kk, chunk), p_done_ref=(p, chunk)),
      outputs=chunks,
      aliases=dict(kk_done_ref="kk_ref", p_done_ref="p_ref"),
      name="deltajax_intra_blocks")
  starts = tuple(decayed[:len(from_start)])
  return kk, p, g_end, starts, tuple(decayed[len(from_start):]), g


def backward(*, q, k, g, b, cuts, states, d_o, delta, d_m, dk, dg, scale,
             chunk_size, launch, interpret, dot, kr=None, dkr=None, a=None,
             done=None, folded=False):
  """The output's VJP (but for ``P^T dO``, :func:`output.delta_backward`)
  and the scores', added to the other kernels' shares.

  Args:
    q, k: ``[B, T, H, K]``; g: ``[B, HV, T, K]``; b: ``[B, HV, T]``; cuts:
    ``[B, HV, T]`` or None; states: ``[B, HV, T / C, K, V]`` each chunk's
    entry state; d_o, delta: ``[B, T, HV, V]`` the output's cotangent and
    Delta, in q's dtype (P's cotangent ``dO Delta^T`` is formed from them);
    d_m: ``[B, HV, T, C]`` float32, the cotangent of ``M = diag(b) A``; dk:
    ``[B, T, HV, K]``, dg: g's shape: the other kernels' shares (in the
    accumulator dtype: float32, float64 for float64 inputs);
    launch.block_k: key channels per program;
    kr, dkr: None, or A's row keys ``[B, T, HV, K]`` (:func:`forward`) and
    the other kernels' share of their cotangent; a: None, or the log gate
    ``[B, T, HV, K]``: da is 0 where it is below the floor (clamped there,
    :func:`common.floored`); done: None, or the whole-chunk pass's ``(dq,
    dk, da, db [K / W, B, HV, T][, dkr])`` formed elsewhere for every chunk
    (:func:`deltajax.mosaic.intra.backward`; W key channels per block of
    db, which must tile ``launch.block_k``'s): this pass then rewrites only
    the chunks whose gate is not gentle (on a block's channels); folded: g
    is the gate with the cuts folded in (:func:`forward`'s ``folded``), a
    as given: g unfolded between the cuts where the chunk is taken whole,
    da 0 at the cuts.

  Returns:
    ``(dq, dk [B, T, HV, K]`` (in q's dtype without GVA, else float32 for the
    sum over the group), ``da [B, T, HV, K]`` (the cotangent of the gate's
    increments, in a's layout; 0 is not forced at cuts), ``db [B, HV, T]``
    the scores' share of db), in the accumulator dtype; with kr, the
    cotangent of kr ``[B, T, HV, K]`` (float32) after them.
  """
  bsz, t_len, h, d = q.shape
  heads, dv = d_o.shape[2:]
  width = min(d, launch.block_k or d)
  sp = _chunk_rows(chunk_size, heads // h, width)
  values = _chunk_rows(chunk_size, heads // h, None)["keys"](dv)
  state = core.block(None, None, None, width, dv)(
      lambda m, i, j, n: (i, j, n, m, 0))
  square = core.block(None, None, chunk_size, chunk_size)(
      lambda m, i, j, n: (i, j, n, 0))
  acc = core.accumulator(q.dtype)
  per_head = lambda dtype: jax.ShapeDtypeStruct((bsz, t_len, heads, d), dtype)
  inputs = dict(q_ref=(q, sp["qk"](d)), k_ref=(k, sp["qk"](d)),
                g_ref=(g, sp["g"](d)), b_ref=(b, sp["gate"]),
                cuts_ref=(cuts, sp["gate"]), s_ref=(states, state),
                do_ref=(d_o, values), delta_ref=(delta, values),
                dm_ref=(d_m, square), dk_in_ref=(dk, sp["keys"](d)),
                dg_in_ref=(dg, sp["g"](d)),
                kr_ref=(kr, sp["keys"](d)), dkr_in_ref=(dkr, sp["keys"](d)),
                a_ref=(a, sp["keys"](d)))
  outputs = dict(
      dq_ref=(per_head(q.dtype if heads == h else acc), sp["keys"](d)),
      dk_ref=(per_head(q.dtype if heads == h else acc), sp["keys"](d)),
      da_ref=(per_head(acc), sp["keys"](d)),
      db_ref=(jax.ShapeDtypeStruct((d // width, bsz, heads, t_len), acc),
              core.block(None, None, None, chunk_size)(
                  lambda m, i, j, n: (m, i, j, n))))
  if kr is not None:
    outputs["dkr_ref"] = (per_head(acc), sp["keys"](d))
  grid = (d // width, bsz, heads, t_len // chunk_size)
  run = lambda whole_chunk, inputs, **kw: core.call(
      _backward_kernel, grid=grid, inputs=inputs, outputs=outputs,
      launch=launch, interpret=interpret, scale=scale, dot=dot,
      whole_chunk=whole_chunk, folded=folded, **kw)
  if done is None:
    done = run(True, inputs, name="deltajax_intra_backward")
  else:  # db's blocks of key channels summed into this pass's wider ones
    done = list(done)
    db = done[3]
    if width % (d // db.shape[0]):
      raise ValueError(f"done: db's blocks of {d // db.shape[0]} key "
                       f"channels do not tile this pass's of {width}")
    done[3] = jnp.sum(db.reshape(d // width, -1, *db.shape[1:]), axis=1)
  # The chunks whose gate is not gentle, written into the first pass's
  # outputs.
  names = [n[:-len("_ref")] for n in outputs]
  dq, dk, da, db, *dkr = run(
      False, {**inputs, **{f"{n}_done_ref": (x, outputs[f"{n}_ref"][1])
                           for n, x in zip(names, done)}},
      aliases={f"{n}_done_ref": f"{n}_ref" for n in names},
      name="deltajax_intra_backward_blocks")
  return (dq, dk, da, jnp.sum(db, axis=0), *dkr)
