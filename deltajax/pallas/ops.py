"""``impl="pallas"``: the chunked algorithm as Pallas kernels, with its custom_vjp.

Forward: (for a per-channel gate, :func:`intra.forward`: the intra-chunk
scores, parallel over chunks) -> :func:`ut.inverse` (parallel) ->
:func:`state.forward_scan` (sequential over chunks; applies T, so W and U are
never formed) -> :func:`output.output` (parallel). Backward:
:func:`ut.w_u` and :func:`output.output_backward` (per channel
:func:`output.delta_backward`: ``P^T dO`` alone) (parallel) ->
:func:`state.backward_scan` (sequential, reverse) -> :func:`ut.ut_backward`
(parallel) (-> :func:`intra.backward` per channel: the output's other
cotangents and the scores'). The backward keeps the forward's ``T``,
``Delta``, chunk-entry states (and ``P``) and recomputes ``W``, ``U``:
memory ``O(T (K + V) + (T / C) K V)`` per value head.

The gate's width W (1: Gated DeltaNet's scalar gate, K: KDA's per-channel
gate) is static: the cumulative gate is ``[B, HV, T]`` or ``[B, HV, T, K]``,
and the kernels branch on it where the math differs (:mod:`core`'s gate
helpers, :mod:`scores`); for W = 1 they do exactly the scalar gate's work.
For W = K the intra-chunk scores are formed once, by :mod:`intra`, and the
other kernels work on them as matrices, as for W = 1.
The gate cotangent is per channel for W = K (da ``[B, T, HV, K]``).

Every kernel runs over the HV value heads and reads q/k head ``j // G``
through its index maps (GVA); dq and dk are formed per value head and summed
over each group here. Cuts and packed sequences (``chunk_seq``) are optional
inputs that the kernels handle in static branches: without them, the kernels
do exactly the work of the plain case.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from deltajax import common
from deltajax.pallas import core
from deltajax.pallas import intra
from deltajax.pallas import output
from deltajax.pallas import state
from deltajax.pallas import ut


def gated_delta_pallas(q, k, v, a, b, initial_state, cut, chunk_seq, *,
                       scale, chunk_size, config=None):
  """Gated delta rule with Pallas (Triton) kernels.

  Args:
    q, k: ``[B, T, H, K]``, any float dtype (cast to the common dtype of q,
      k, v for the kernels' dots).
    v: ``[B, T, HV, V]``, ``HV = G H``: value head j reads q/k head
      ``j // G`` (grouped value heads).
    a: ``[B, T, HV, W]`` log decay ``<= 0`` in the compute dtype: ``W = 1``
      (Gated DeltaNet) or ``W = K`` (KDA, per key channel).
    b: ``[B, T, HV]`` beta, or Gated DeltaNet-2's pair ``(erase [B, T, HV,
      K], write [B, T, HV, V])`` (with W = K), compute dtype.
    initial_state: ``[N, HV, K, V]`` compute dtype; N = B without chunk_seq.
    cut: None or bool of a's shape, equal across the channels: where True,
      the state carried into the token is replaced by zero before its decay
      and update (its a is then irrelevant and gets a zero gradient).
    chunk_seq: None or int32 ``[T / chunk_size]`` (then B = 1): the
      non-decreasing sequence index of each chunk. A sequence's first chunk
      starts from ``initial_state[seq]``; its final state is the one leaving
      its last chunk (a sequence without chunks keeps its initial state).
    scale: Python float multiplying q.
    chunk_size: C, a power of two >= 16 dividing T.
    config: :class:`core.Config` (None: the defaults).

  Returns:
    ``(o [B, T, HV, V] in v's dtype, final_state [N, HV, K, V] in the
    compute dtype)``. Differentiable (custom VJP) in q, k, v, a, b and
    initial_state.
  """
  if chunk_size < core.SUB or chunk_size & (chunk_size - 1):
    raise ValueError(f"impl='pallas' needs chunk_size >= {core.SUB}, a power "
                     f"of two; got {chunk_size}")
  bsz, t_len, h = q.shape[:3]
  heads = v.shape[2]
  if t_len % chunk_size or heads % h:
    raise ValueError(f"T = {t_len} must be a multiple of chunk_size = "
                     f"{chunk_size} and HV = {heads} a multiple of H = {h}")
  if chunk_seq is not None and (bsz != 1 or chunk_seq.shape
                                != (t_len // chunk_size,)):
    raise ValueError(f"chunk_seq needs B = 1 and shape [T / C] = "
                     f"{(t_len // chunk_size,)}; got B = {bsz}, "
                     f"{tuple(chunk_seq.shape)}")
  config = (config or core.Config()).resolve()
  b, kr, v = _read_keys(b, q, k, v)
  return _pallas(float(scale), chunk_size, config, q, k, v, a, b,
                 initial_state, cut, chunk_seq, kr)


def _read_keys(b, q, k, v):
  """``(beta, read keys, values)`` for the kernels. Gated DeltaNet-2's gates
  ``b = (erase, write)`` become the keys that read the state and form A's
  rows, ``kr = erase * k`` (per value head, ``[B, T, HV, K]``), the values
  ``write * v`` and beta 1, outside the kernels' VJP (autodiff carries
  their cotangents to the gates); beta has no read keys (None)."""
  if not isinstance(b, tuple):
    return b, None, v
  erase, write = b
  dtype = jnp.result_type(q, k, v)
  kr = erase * common.repeat_heads(k, v.shape[2] // k.shape[2]).astype(
      erase.dtype)
  v = (write * v.astype(write.dtype)).astype(v.dtype)
  return jnp.ones(erase.shape[:3], erase.dtype), kr.astype(dtype), v


def _chunk_cumsum(x, chunk_size):
  """The cumulative sum of ``x [B, HV, T, ...]`` within each chunk."""
  bsz, heads, t_len = x.shape[:3]
  return jnp.cumsum(x.reshape(bsz, heads, t_len // chunk_size, chunk_size,
                              *x.shape[3:]), axis=3).reshape(x.shape)


def _gate_inputs(a, b, cut, chunk_size, dtype):
  """``(a, beta [B, HV, T], cuts)``: a in ``dtype``, 0 at a cut token (whose
  gate is irrelevant); beta per value head; the chunk-local cumulative cut
  count (int32 ``[B, HV, T]``, or None; a cut is per token)."""
  a = a.astype(dtype)
  cuts = None
  if cut is not None:
    a = jnp.where(cut, 0, a)
    cuts = _chunk_cumsum(jnp.moveaxis(cut[..., 0], 1, 2).astype(jnp.int32),
                         chunk_size)
  return a, jnp.transpose(b, (0, 2, 1)).astype(dtype), cuts


def gates(a, b, cut, chunk_size, dtype, k_dim, interpret, *, from_start=(),
          to_end=()):
  """``[B, T, HV, W]`` log gate, ``[B, T, HV]`` beta and the optional cuts ->
  the chunk-local cumulative gate, ``[B, HV, T]`` (W = 1) or
  ``[B, HV, T, k_dim]`` (W = K, padded channels 0), beta ``[B, HV, T]``, the
  cumulative cut count (:func:`_gate_inputs`) and, for W = K, the operands
  ``from_start`` and ``to_end`` decayed by the gate
  (:func:`intra.chunk_gates`; None for W = 1). a is clamped at
  :data:`common.LOG_DECAY_FLOOR` (for W = K in the kernel)."""
  a, beta, cuts = _gate_inputs(a, b, cut, chunk_size, dtype)
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


def _padded(q, k, v):
  """q, k, v in one dtype (the kernels' dots need it), head dims padded."""
  dtype = jnp.result_type(q, k, v)
  kp, vp = core.padded_dim(q.shape[-1]), core.padded_dim(v.shape[-1])
  q, k = (common.pad_axis(x.astype(dtype), 3, kp) for x in (q, k))
  return q, k, common.pad_axis(v.astype(dtype), 3, vp)


def _unvisited(chunk_seq, n_seq):
  """``[N, 1, 1, 1]``: the sequences that own no chunk (their state passes
  through unchanged)."""
  owned = jnp.zeros((n_seq,), jnp.bool_).at[chunk_seq].set(True)
  return ~owned[:, None, None, None]


def _group_sum(x, h):
  """``[B, T, HV, K]`` per value head -> ``[B, T, H, K]``, summed per group
  (16-bit terms in float32)."""
  bsz, t_len, heads, d = x.shape
  if heads == h:
    return x
  return x.reshape(bsz, t_len, h, heads // h, d).sum(
      axis=3, dtype=jnp.promote_types(x.dtype, jnp.float32))


def _pad_keys(kr, kp):
  """Read keys padded as the keys ``kp`` (None stays None)."""
  return None if kr is None else common.pad_axis(kr, 3, kp.shape[-1])


def _forward(scale, chunk_size, config, q, k, v, a, b, initial_state, cut,
             chunk_seq, kr):
  acc = initial_state.dtype
  shared = dict(chunk_size=chunk_size, interpret=config.interpret,
                dot=config.dot)
  qp, kp, vp = _padded(q, k, v)
  g, beta, cuts, decayed, t, p, _ = before_scan(
      scale, chunk_size, config, qp, kp, _pad_keys(kr, kp), a, b, cut,
      heads=v.shape[2], dtype=acc)
  qg, *keys = decayed or (None,)
  launch = functools.partial(config.launch, per_channel=g.ndim == 4)
  s0 = pad_state(initial_state, kp.shape[-1], vp.shape[-1])
  delta, states, final = state.forward_scan(
      t=t, k=kp, v=vp, g=g, b=beta, cuts=cuts, chunk_seq=chunk_seq,
      initial_state=s0, decayed=keys or None, launch=launch("forward_scan"),
      **shared)
  o, delta = output.output(
      q=qp, k=kp, g=g, cuts=cuts, states=states, delta=delta, p=p, qg=qg,
      scale=scale, out_dtype=v.dtype, launch=launch("output"), **shared)
  final = final[..., :q.shape[-1], :v.shape[-1]]
  if chunk_seq is not None:
    final = jnp.where(_unvisited(chunk_seq, final.shape[0]), initial_state,
                      final)
  return (o[..., :v.shape[-1]], final), (t, states, delta, p, None)


def before_scan(scale, chunk_size, config, q, k, kr, a, b, cut, *, heads,
                dtype, keep_g=False):
  """The forward's parallel steps before the state scan, on q, k (and the
  read keys kr) padded as :func:`_padded` pads them: the gates
  (:func:`gates`; per channel with the intra-chunk scores,
  :func:`intra.forward`), and T (:func:`ut.inverse`).

  Returns:
    ``(g, beta, cuts, decayed, t, p, g_whole)``: :func:`gates`' first three,
    but per channel g only at each chunk's end, ``[B, HV, T / C, K]``
    (``g_whole``: with ``keep_g``, per channel, the whole ``[B, HV, T,
    K]``, for the backward; else None); ``decayed``
    (per channel, else None): ``Q e^g`` for the output, ``Kr e^g`` (the read
    keys, K without kr) and ``K e^{g_C - g}`` for the scan, ``[B, T, HV,
    K]``; T ``[B, HV, T, C]``; ``p`` (per channel, else None): ``P = scale
    Gamma * Q K^T [B, HV, T, C]``.
  """
  shared = dict(chunk_size=chunk_size, interpret=config.interpret,
                dot=config.dot)
  launch = functools.partial(config.launch, per_channel=a.shape[-1] > 1)
  if a.shape[-1] == 1:
    g, beta, cuts, _ = gates(a, b, cut, chunk_size, dtype, k.shape[-1],
                             config.interpret)
    return g, beta, cuts, None, ut.inverse(
        k=k, g=g, b=beta, cuts=cuts, a=None, heads=heads,
        launch=launch("inverse"), **shared), None, None
  a, beta, cuts = _gate_inputs(a, b, cut, chunk_size, dtype)
  a = common.pad_axis(a, 3, k.shape[-1])
  a_kk, p, g_end, starts, ends, g = intra.forward(
      q=q, k=k, kr=kr, a=a, cuts=cuts, heads=heads, scale=scale,
      from_start=(q, k if kr is None else kr), to_end=(k,),
      launch=launch("intra"), keep_g=keep_g, **shared)
  t = ut.inverse(k=k, g=None, b=beta, cuts=None, a=a_kk, heads=heads,
                 launch=launch("inverse"), **shared)
  return g_end, beta, cuts, starts + ends, t, p, g if keep_g else None


def _fwd(scale, chunk_size, config, q, k, v, a, b, initial_state, cut,
         chunk_seq, kr):
  outputs, saved = _forward(scale, chunk_size, config, q, k, v, a, b,
                            initial_state, cut, chunk_seq, kr)
  return outputs, (q, k, v, a, b, initial_state, cut, chunk_seq, kr, saved)


def backward(scale, chunk_size, config, residuals, cotangents,
             w_u=ut.w_u, output_backward=output.output_backward,
             backward_scan=state.backward_scan, ut_backward=ut.ut_backward,
             intra_backward=intra.backward):
  """The VJP from :func:`_fwd`'s residuals (also ``impl="mosaic"``'s
  backward, on the residuals its forward saves in this layout, with its own
  kernels in place of :func:`ut.w_u`, :func:`output.output_backward`,
  :func:`state.backward_scan` and :func:`ut.ut_backward`, of their
  signatures, and per channel :func:`intra.backward`; per head, its
  ``ut_backward`` may return dq last, for an ``output_backward`` that left
  it to it). The saved
  residuals' last, ``kept``: None, or per channel the forward's ``(g, Q
  e^g, K e^{g_C - g})``, which the backward then does not form again."""
  (q, k, v, a, b, initial_state, cut, chunk_seq, kr,
   (t, states, delta, p, kept)) = residuals
  d_o, d_final = cotangents
  acc = initial_state.dtype
  shared = dict(chunk_size=chunk_size, interpret=config.interpret,
                dot=config.dot)
  qp, kp, vp = _padded(q, k, v)
  krp = _pad_keys(kr, kp)
  # Per channel: Q e^g and K e^{g_C - g} for the backward scan (``kept``:
  # with g, as the forward formed them).
  if kept is None:
    g, beta, cuts, decayed = gates(a, b, cut, chunk_size, acc, kp.shape[-1],
                                   config.interpret, from_start=(qp,),
                                   to_end=(kp,))
  else:
    (g, *decayed), (_, beta, cuts) = kept, _gate_inputs(a, b, cut,
                                                        chunk_size, acc)
  launch = functools.partial(config.launch, per_channel=g.ndim == 4)
  d_o = common.pad_axis(d_o.astype(vp.dtype), 3, vp.shape[-1])
  d_final_p = pad_state(d_final.astype(acc), kp.shape[-1], vp.shape[-1])
  w, u = w_u(k=kp if kr is None else krp, v=vp, g=g, b=beta, cuts=cuts,
             t=t, launch=launch("w_u"), **shared)
  if p is None:
    dq, dg_out, d_delta, dk_out = output_backward(
        q=qp, k=kp, g=g, cuts=cuts, states=states, delta=delta, d_o=d_o,
        scale=scale, launch=launch("output_backward"), **shared)
  else:  # per channel, the output's dq, dg and dP are intra.backward's
    dq = dg_out = dk_out = None
    d_delta = output.delta_backward(p=p, d_o=d_o,
                                    launch=launch("output_backward"), **shared)
  # (Per channel the scans take g at each chunk's end.)
  g_ends = g if g.ndim == 3 else g[:, :, chunk_size - 1::chunk_size]
  d_delta, d_next, d_initial = backward_scan(
      q=qp, k=kp, w=w, g=g_ends, cuts=cuts, chunk_seq=chunk_seq, d_o=d_o,
      d_delta_local=d_delta, d_final=d_final_p, scale=scale, decayed=decayed,
      launch=launch("backward_scan"), **shared)
  dk, dv, db, da, *per_channel = ut_backward(
      k=kp, v=vp, g=g, b=beta, cuts=cuts, t=t, w=w, u=u, states=states,
      d_next=d_next, delta=delta, d_delta=d_delta, dk_out=dk_out,
      dg_out=dg_out, kr=krp, launch=launch("ut_backward"), **shared)
  if p is None and dq is None:  # the output's backward left to ut_backward
    dq = per_channel[-1]
  dkr = None
  if p is not None:
    d_m, *dkr = per_channel  # with read keys, ut_backward's share of dkr
    dq, dk, da, db_scores, *dkr = intra_backward(
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
    d_initial = jnp.where(_unvisited(chunk_seq, d_initial.shape[0]),
                          d_final.astype(acc), d_initial)
  return (_group_sum(dq[..., :n_k], h).astype(q.dtype),
          _group_sum(dk[..., :n_k], h).astype(k.dtype),
          dv[..., :n_v].astype(v.dtype), da.astype(a.dtype),
          db.astype(b.dtype), d_initial.astype(initial_state.dtype),
          None, None, dkr[0][..., :n_k].astype(kr.dtype) if dkr else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _pallas(scale, chunk_size, config, q, k, v, a, b, initial_state, cut,
            chunk_seq, kr):
  """:func:`gated_delta_pallas` after its checks, with the read keys of
  :func:`_read_keys`; scale, chunk_size and the resolved config are
  static."""
  return _forward(scale, chunk_size, config, q, k, v, a, b, initial_state,
                  cut, chunk_seq, kr)[0]


_pallas.defvjp(_fwd, backward)
