"""``impl="pallas"``: the chunked algorithm as Pallas kernels, with its custom_vjp.

Forward: (for a per-channel gate, :func:`intra.forward`: the intra-chunk
scores, parallel over chunks) -> :func:`ut.inverse` (parallel) ->
:func:`scan.forward` (sequential over chunks; applies T, so W and U are
never formed) -> :func:`output.output` (parallel). Backward
(:func:`deltajax.stages.backward` on :func:`backward_stages`):
:func:`ut.w_u` and :func:`output.output_backward` (per channel
:func:`output.delta_backward`: ``P^T dO`` alone) (parallel) ->
:func:`reverse.backward` (sequential, reverse) ->
:func:`ut_backward.ut_backward` (parallel) (-> :func:`intra.backward` per
channel: the output's other cotangents and the scores'). The backward keeps
the forward's ``T``, ``Delta``, chunk-entry states (and ``P``) in
:class:`deltajax.stages.Residuals` and recomputes ``W``, ``U``: memory
``O(T (K + V) + (T / C) K V)`` per value head.

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
from deltajax import stages
from deltajax.pallas import core
from deltajax.pallas import intra
from deltajax.pallas import output
from deltajax.pallas import reverse
from deltajax.pallas import scan
from deltajax.pallas import ut
from deltajax.pallas import ut_backward


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
  b, kr, v = stages.read_keys(b, q, k, v)
  return _pallas(float(scale), chunk_size, config, q, k, v, a, b,
                 initial_state, cut, chunk_seq, kr)


def _forward(scale, chunk_size, config, q, k, v, a, b, initial_state, cut,
             chunk_seq, kr):
  acc = initial_state.dtype
  shared = dict(chunk_size=chunk_size, interpret=config.interpret,
                dot=config.dot)
  qp, kp, vp = stages.padded(q, k, v)
  g, beta, cuts, decayed, t, p, _ = before_scan(
      scale, chunk_size, config, qp, kp, stages.pad_keys(kr, kp), a, b, cut,
      heads=v.shape[2], dtype=acc)
  qg, *keys = decayed or (None,)
  launch = functools.partial(config.launch, per_channel=g.ndim == 4)
  s0 = stages.pad_state(initial_state, kp.shape[-1], vp.shape[-1])
  delta, states, final = scan.forward(
      t=t, k=kp, v=vp, g=g, b=beta, cuts=cuts, chunk_seq=chunk_seq,
      initial_state=s0, decayed=keys or None, launch=launch("forward_scan"),
      **shared)
  o, delta = output.output(
      q=qp, k=kp, g=g, cuts=cuts, states=states, delta=delta, p=p, qg=qg,
      scale=scale, out_dtype=v.dtype, launch=launch("output"), **shared)
  final = final[..., :q.shape[-1], :v.shape[-1]]
  if chunk_seq is not None:
    final = jnp.where(stages.unvisited(chunk_seq, final.shape[0]),
                      initial_state, final)
  return (o[..., :v.shape[-1]], final), (t, states, delta, p)


def before_scan(scale, chunk_size, config, q, k, kr, a, b, cut, *, heads,
                dtype, keep_g=False, folded=None):
  """The forward's parallel steps before the state scan, on q, k (and the
  read keys kr) padded as :func:`stages.padded` pads them: the gates
  (:func:`stages.gates`; per channel with the intra-chunk scores,
  :func:`intra.forward`), and T (:func:`ut.inverse`).

  Returns:
    ``(g, beta, cuts, decayed, t, p, g_whole)``: :func:`stages.gates`' first
    three,
    but per channel g only at each chunk's end, ``[B, HV, T / C, K]``
    (``g_whole``: with ``keep_g``, per channel, the whole ``[B, HV, T,
    K]``, for the backward; else None); ``decayed``
    (per channel, else None): ``Q e^g`` for the output, ``Kr e^g`` (the read
    keys, K without kr) and ``K e^{g_C - g}`` for the scan, ``[B, T, HV,
    K]``; T ``[B, HV, T, C]``; ``p`` (per channel, else None): ``P = scale
    Gamma * Q K^T [B, HV, T, C]``.

  ``folded`` (per channel, with cut None): None, or the cut counts
  (:func:`stages.cut_counts`) of the cuts folded into a
  (:func:`deltajax.mosaic.ops.cut_into_gate`), returned as ``cuts``: the
  scores' kernels mask them and factor through the gate without their
  folds (:func:`intra.forward`'s ``folded``).
  """
  shared = dict(chunk_size=chunk_size, interpret=config.interpret,
                dot=config.dot)
  launch = functools.partial(config.launch, per_channel=a.shape[-1] > 1)
  if a.shape[-1] == 1:
    g, beta, cuts, _ = stages.gates(a, b, cut, chunk_size, dtype,
                                    k.shape[-1], config.interpret)
    return g, beta, cuts, None, ut.inverse(
        k=k, g=g, b=beta, cuts=cuts, a=None, heads=heads,
        launch=launch("inverse"), **shared), None, None
  a, beta, cuts = stages.gate_inputs(a, b, cut, chunk_size, dtype)
  if folded is not None:
    cuts = folded
  a = common.pad_axis(a, 3, k.shape[-1])
  a_kk, p, g_end, starts, ends, g = intra.forward(
      q=q, k=k, kr=kr, a=a, cuts=cuts, heads=heads, scale=scale,
      from_start=(q, k if kr is None else kr), to_end=(k,),
      launch=launch("intra"), keep_g=keep_g, folded=folded is not None,
      **shared)
  t = ut.inverse(k=k, g=None, b=beta, cuts=None, a=a_kk, heads=heads,
                 launch=launch("inverse"), **shared)
  return g_end, beta, cuts, starts + ends, t, p, g if keep_g else None


def _fwd(scale, chunk_size, config, q, k, v, a, b, initial_state, cut,
         chunk_seq, kr):
  outputs, saved = _forward(scale, chunk_size, config, q, k, v, a, b,
                            initial_state, cut, chunk_seq, kr)
  return outputs, stages.Residuals(q, k, v, a, b, initial_state, cut,
                                   chunk_seq, kr, *saved, kept=None)


def _reverse(*, t, b, **kwargs):
  """:func:`reverse.backward`, on the W of :func:`ut.w_u` (t and b are not
  read)."""
  del t, b
  return reverse.backward(**kwargs)


def _ut_backward(*, q, d_o, scale, **kwargs):
  """:func:`ut_backward.ut_backward`, after the output's backward (q, d_o
  and scale are not read)."""
  del q, d_o, scale
  return ut_backward.ut_backward(**kwargs)


def backward_stages():
  """The backward's stages (:class:`stages.Stages`) in Pallas kernels.
  (A function: :mod:`deltajax.stages` imports this package's kernels, and
  may be imported first, before this module uses it.)"""
  return stages.Stages(
      w_u=ut.w_u, output_backward=output.output_backward, reverse=_reverse,
      ut_backward=_ut_backward, intra_backward=intra.backward)


def _bwd(scale, chunk_size, config, residuals, cotangents):
  return stages.backward(backward_stages(), scale, chunk_size, config,
                         residuals, cotangents)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _pallas(scale, chunk_size, config, q, k, v, a, b, initial_state, cut,
            chunk_seq, kr):
  """:func:`gated_delta_pallas` after its checks, with the read keys of
  :func:`deltajax.stages.read_keys`; scale, chunk_size and the resolved
  config are static."""
  return _forward(scale, chunk_size, config, q, k, v, a, b, initial_state,
                  cut, chunk_seq, kr)[0]


_pallas.defvjp(_fwd, _bwd)
