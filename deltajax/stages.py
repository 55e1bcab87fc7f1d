"""The pipeline that ``impl="pallas"`` and ``impl="mosaic"`` share.

Both backends run the same stages over chunks of C tokens, each a kernel
module of the same name in ``deltajax/pallas/`` and ``deltajax/mosaic/``:
``intra`` (a per-channel gate's intra-chunk scores), ``ut`` (the UT
transform: T, and W for the backward), ``scan`` (the state scan, forward),
``output``, ``reverse`` (the state cotangent's pass over the chunks in
reverse) and ``ut_backward`` (the backward through the UT transform).

Here is what the two share: the inputs in the kernels' layout (the gates,
:func:`gates`; the head dims padded, :func:`padded`, :func:`pad_state`),
what the forward saves (:class:`Residuals`), the backward's stages as
callables (:class:`Stages`) and the backward, written once over them
(:func:`backward`): :mod:`deltajax.pallas.ops` gives it the Pallas kernels,
:mod:`deltajax.mosaic.ops` its Mosaic GPU kernels. The gate's formation
(:func:`deltajax.pallas.intra.chunk_gates`) and a per-channel gate's share
of the output's backward (:func:`deltajax.pallas.output.delta_backward`)
are Pallas kernels in both.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from deltajax import common
from deltajax.pallas import core
from deltajax.pallas import intra
from deltajax.pallas import output


class Residuals(NamedTuple):
  """What the forward saves for :func:`backward`.

  q, k, v, a, b, initial_state, cut, chunk_seq and kr are the inputs of the
  kernels' custom VJP (:func:`deltajax.pallas.ops.gated_delta_pallas`'s
  after the read keys are formed; ``impl="mosaic"``'s padded to its
  kernels' widths), the rest what the forward's kernels formed (``B, T,
  H, HV, K, V``: batch, tokens, q/k heads, value heads, head dims; ``C``
  the chunk; ``N`` the initial states, B without chunk_seq).

  Attributes:
    q, k: ``[B, T, H, K]``.
    v: ``[B, T, HV, V]``.
    a: ``[B, T, HV, W]`` log decay (W = 1 or K).
    b: ``[B, T, HV]`` beta.
    initial_state: ``[N, HV, K, V]``.
    cut: None or bool of a's shape.
    chunk_seq: None or int32 ``[T / C]``.
    kr: None or Gated DeltaNet-2's read keys ``[B, T, HV, K]``.
    t: ``[B, HV, T, C]``, the UT inverse of every chunk.
    states: ``[B, HV, T / C, K, V]``, each chunk's entry state.
    delta: ``[B, T, HV, V]`` Delta, or None where the backward forms it
      again (``impl="mosaic"``'s three-warpgroup scan).
    p: None, or per channel ``P = scale Gamma * Q K^T [B, HV, T, C]``.
    kept: None, or per channel the forward's ``(g [B, HV, T, K], Q e^g, K
      e^{g_C - g})`` (``[B, T, HV, K]``), which the backward then does not
      form again.
  """
  q: jax.Array
  k: jax.Array
  v: jax.Array
  a: jax.Array
  b: jax.Array
  initial_state: jax.Array
  cut: jax.Array | None
  chunk_seq: jax.Array | None
  kr: jax.Array | None
  t: jax.Array
  states: jax.Array
  delta: jax.Array | None
  p: jax.Array | None
  kept: tuple[jax.Array, jax.Array, jax.Array] | None


class Stages(NamedTuple):
  """The backward's stages, each a kernel (or a few) of a backend, called by
  :func:`backward` with keyword arguments only. Every stage also gets
  ``chunk_size``, ``interpret``, ``dot`` and ``launch`` (the Pallas
  kernels': :class:`deltajax.pallas.core.Config`'s; a Mosaic GPU stage need
  not read them). Shapes as in :class:`Residuals`, the head dims padded; g
  the chunk-local cumulative gate, ``[B, HV, T]`` or per channel ``[B, HV,
  T, K]``; beta ``b [B, HV, T]``; cuts None or int32 ``[B, HV, T]``.

  Attributes:
    w_u: ``(*, k, v, g, b, cuts, t) -> (w, u)``: ``W = T diag(b) (K e^g)``
      and ``U = T diag(b) V`` ``[B, T, HV, K | V]`` (k: the read keys where
      there are). ``w`` None: not formed here, the ``reverse`` stage forms
      it from t and b; ``u`` None: ``ut_backward`` does not read it.
    output_backward: ``(*, q, k, g, cuts, states, delta, d_o, scale) -> (dq,
      dg, d_delta_local, dk)``, the output's backward for a per-head gate
      (per channel it is not called: :func:`backward` forms the output's
      share of dDelta, the rest is ``intra_backward``'s). All None: left to
      the later stages, ``reverse`` forming dDelta_local (with W) and
      ``ut_backward`` dq and the shares of dk and dg.
    reverse: ``(*, q, k, w, t, b, g, cuts, chunk_seq, d_o, d_delta_local,
      d_final, scale, decayed) -> (d_delta, d_next, d_initial)``, the state
      cotangent's pass over the chunks in reverse: g at each chunk's end
      per channel, ``decayed`` then ``(Q e^g, K e^{g_C - g})``, else None;
      w None: it forms W (and dDelta_local) from t and b. d_delta may be
      None where ``ut_backward`` forms it again.
    ut_backward: ``(*, q, k, v, g, b, cuts, t, w, u, states, d_next, delta,
      d_delta, dk_out, dg_out, kr, d_o, scale) -> (dk, dv, db, da,
      *rest)``: the backward through the UT transform, adding the output's
      shares dk_out and dg_out. Per channel rest is ``(dm, *dkr)`` (dM for
      ``intra_backward``; with read keys kr, their share of dkr); per head
      it is ``(dq,)`` where the output's backward was left to it (dk_out
      and dg_out None), else empty.
    intra_backward: ``(*, q, k, g, b, cuts, states, d_o, delta, d_m, dk,
      dg, kr, dkr, a, scale) -> (dq, dk, da, db, *dkr)``, per channel: the
      scores' backward and the output's dq and dk, adding dk, dg (and dkr)
      of ``ut_backward``; a padded as k.
  """
  w_u: Callable[..., Any]
  output_backward: Callable[..., Any]
  reverse: Callable[..., Any]
  ut_backward: Callable[..., Any]
  intra_backward: Callable[..., Any]


def backward(stages, scale, chunk_size, config, residuals, cotangents):
  """The VJP from the forward's :class:`Residuals`, through ``stages``
  (:class:`Stages`); ``config``: the Pallas kernels' (their launches; the
  gate's formation and a per-channel gate's share of the output's backward
  are Pallas kernels).

  Returns:
    The cotangents of the custom VJP's inputs, ``(dq, dk, dv, da, db,
    d_initial, None, None, dkr)``: cut and chunk_seq have none; dkr None
    without read keys.
  """
  (q, k, v, a, b, initial_state, cut, chunk_seq, kr, t, states, delta, p,
   kept) = residuals
  d_o, d_final = cotangents
  acc = initial_state.dtype
  shared = dict(chunk_size=chunk_size, interpret=config.interpret,
                dot=config.dot)
  qp, kp, vp = padded(q, k, v)
  krp = pad_keys(kr, kp)
  # Per channel: Q e^g and K e^{g_C - g} for the reverse pass (``kept``:
  # with g, as the forward formed them).
  if kept is None:
    g, beta, cuts, decayed = gates(a, b, cut, chunk_size, acc, kp.shape[-1],
                                   config.interpret, from_start=(qp,),
                                   to_end=(kp,))
  else:
    (g, *decayed), (_, beta, cuts) = kept, gate_inputs(a, b, cut,
                                                       chunk_size, acc)
  launch = functools.partial(config.launch, per_channel=g.ndim == 4)
  d_o = common.pad_axis(d_o.astype(vp.dtype), 3, vp.shape[-1])
  d_final_p = pad_state(d_final.astype(acc), kp.shape[-1], vp.shape[-1])
  w, u = stages.w_u(k=kp if kr is None else krp, v=vp, g=g, b=beta,
                    cuts=cuts, t=t, launch=launch("w_u"), **shared)
  if p is None:
    dq, dg_out, d_delta, dk_out = stages.output_backward(
        q=qp, k=kp, g=g, cuts=cuts, states=states, delta=delta, d_o=d_o,
        scale=scale, launch=launch("output_backward"), **shared)
  else:  # per channel, the output's dq, dg and dP are intra_backward's
    dq = dg_out = dk_out = None
    d_delta = output.delta_backward(p=p, d_o=d_o,
                                    launch=launch("output_backward"), **shared)
  # (Per channel the reverse pass takes g at each chunk's end.)
  g_ends = g if g.ndim == 3 else g[:, :, chunk_size - 1::chunk_size]
  d_delta, d_next, d_initial = stages.reverse(
      q=qp, k=kp, w=w, t=t, b=beta, g=g_ends, cuts=cuts, chunk_seq=chunk_seq,
      d_o=d_o, d_delta_local=d_delta, d_final=d_final_p, scale=scale,
      decayed=decayed, launch=launch("backward_scan"), **shared)
  dk, dv, db, da, *per_channel = stages.ut_backward(
      q=qp, k=kp, v=vp, g=g, b=beta, cuts=cuts, t=t, w=w, u=u, states=states,
      d_next=d_next, delta=delta, d_delta=d_delta, dk_out=dk_out,
      dg_out=dg_out, kr=krp, d_o=d_o, scale=scale,
      launch=launch("ut_backward"), **shared)
  if p is None and dq is None:  # the output's backward left to ut_backward
    dq = per_channel[-1]
  dkr = None
  if p is not None:
    d_m, *dkr = per_channel  # with read keys, ut_backward's share of dkr
    dq, dk, da, db_scores, *dkr = stages.intra_backward(
        q=qp, k=kp, g=g, b=beta, cuts=cuts, states=states, d_o=d_o,
        delta=delta, d_m=d_m, dk=dk, dg=da, kr=krp, dkr=dkr[0] if dkr else None,
        a=common.pad_axis(a, 3, kp.shape[-1]), scale=scale,
        launch=launch("intra_backward"), **shared)
    db += db_scores
  n_k, n_v, h = q.shape[-1], v.shape[-1], q.shape[2]
  # da is 0 below the floor, where a is clamped (common.floored): per
  # channel, intra.backward masks it (in a's layout); per head, here.
  if p is None:
    da = jnp.where(a > common.LOG_DECAY_FLOOR,
                   jnp.moveaxis(da, 1, 2)[..., None], 0)
  else:
    da = da[..., :n_k]
  if cut is not None:
    da = jnp.where(cut, 0, da)
  db = jnp.transpose(db, (0, 2, 1))
  d_initial = d_initial[..., :n_k, :n_v]
  if chunk_seq is not None:
    d_initial = jnp.where(unvisited(chunk_seq, d_initial.shape[0]),
                          d_final_p[..., :n_k, :n_v], d_initial)
  return (group_sum(dq[..., :n_k], h).astype(q.dtype),
          group_sum(dk[..., :n_k], h).astype(k.dtype),
          dv[..., :n_v].astype(v.dtype), da.astype(a.dtype),
          db.astype(b.dtype), d_initial.astype(initial_state.dtype),
          None, None, dkr[0][..., :n_k].astype(kr.dtype) if dkr else None)


def _chunk_cumsum(x, chunk_size):
  """The cumulative sum of ``x [B, HV, T, ...]`` within each chunk."""
  bsz, heads, t_len = x.shape[:3]
  return jnp.cumsum(x.reshape(bsz, heads, t_len // chunk_size, chunk_size,
                              *x.shape[3:]), axis=3).reshape(x.shape)


def gate_inputs(a, b, cut, chunk_size, dtype):
  """``(a, beta [B, HV, T], cuts)``: a in ``dtype``, 0 at a cut token (whose
  gate is irrelevant); beta per value head; the chunk-local cumulative cut
  count (int32 ``[B, HV, T]``, or None; a cut is per token)."""
  a = a.astype(dtype)
  if cut is not None:
    a = jnp.where(cut, 0, a)
  return (a, jnp.transpose(b, (0, 2, 1)).astype(dtype),
          cut_counts(cut, chunk_size))


def cut_counts(cut, chunk_size):
  """The chunk-local cumulative count of the cuts ``cut`` (bool ``[B, T, HV,
  W]``, equal across W: a cut is per token), int32 ``[B, HV, T]``; None
  for None."""
  if cut is None:
    return None
  return _chunk_cumsum(jnp.moveaxis(cut[..., 0], 1, 2).astype(jnp.int32),
                       chunk_size)


def gates(a, b, cut, chunk_size, dtype, k_dim, interpret, *, from_start=(),
          to_end=()):
  """``[B, T, HV, W]`` log gate, ``[B, T, HV]`` beta and the optional cuts ->
  the chunk-local cumulative gate, ``[B, HV, T]`` (W = 1) or
  ``[B, HV, T, k_dim]`` (W = K, padded channels 0), beta ``[B, HV, T]``, the
  cumulative cut count (:func:`gate_inputs`) and, for W = K, the operands
  ``from_start`` and ``to_end`` decayed by the gate
  (:func:`intra.chunk_gates`; None for W = 1). a is clamped at
  :data:`common.LOG_DECAY_FLOOR` (for W = K in the kernel)."""
  a, beta, cuts = gate_inputs(a, b, cut, chunk_size, dtype)
  if a.shape[-1] == 1:
    g = common.floored(jnp.moveaxis(a[..., 0], 1, 2))
    return _chunk_cumsum(g, chunk_size), beta, cuts, None
  g, starts, ends = intra.chunk_gates(
      common.pad_axis(a, 3, k_dim), cuts=cuts, from_start=from_start,
      to_end=to_end, chunk_size=chunk_size, interpret=interpret)
  return g, beta, cuts, starts + ends


def pad_state(s, k_dim, v_dim):
  """``[N, HV, K, V]`` padded with zeros to ``[N, HV, k_dim, v_dim]``."""
  return common.pad_axis(common.pad_axis(s, 2, k_dim), 3, v_dim)


def padded(q, k, v):
  """q, k, v in one dtype (the kernels' dots need it), head dims padded."""
  dtype = jnp.result_type(q, k, v)
  kp, vp = core.padded_dim(q.shape[-1]), core.padded_dim(v.shape[-1])
  q, k = (common.pad_axis(x.astype(dtype), 3, kp) for x in (q, k))
  return q, k, common.pad_axis(v.astype(dtype), 3, vp)


def read_keys(b, q, k, v):
  """``(beta, read keys, values)`` for the kernels of either backend. Gated
  DeltaNet-2's gates ``b = (erase, write)`` become the keys that read the
  state and form A's rows, ``kr = erase * k`` (per value head, ``[B, T,
  HV, K]``), the values ``write * v`` and beta 1, outside the kernels' VJP
  (autodiff carries their cotangents to the gates); beta has no read keys
  (None)."""
  if not isinstance(b, tuple):
    return b, None, v
  erase, write = b
  dtype = jnp.result_type(q, k, v)
  kr = erase * common.repeat_heads(k, v.shape[2] // k.shape[2]).astype(
      erase.dtype)
  v = (write * v.astype(write.dtype)).astype(v.dtype)
  return jnp.ones(erase.shape[:3], erase.dtype), kr.astype(dtype), v


def pad_keys(kr, kp):
  """Read keys padded as the keys ``kp`` (None stays None)."""
  return None if kr is None else common.pad_axis(kr, 3, kp.shape[-1])


def unvisited(chunk_seq, n_seq):
  """``[N, 1, 1, 1]``: the sequences that own no chunk (their state passes
  through unchanged)."""
  owned = jnp.zeros((n_seq,), jnp.bool_).at[chunk_seq].set(True)
  return ~owned[:, None, None, None]


def group_sum(x, h):
  """``[B, T, HV, K]`` per value head -> ``[B, T, H, K]``, summed per group
  (16-bit terms in float32)."""
  bsz, t_len, heads, d = x.shape
  if heads == h:
    return x
  return x.reshape(bsz, t_len, h, heads // h, d).sum(
      axis=3, dtype=jnp.promote_types(x.dtype, jnp.float32))
