"""Output kernels, parallel over chunks: ``O = (scale Q e^g) S + (Gamma * scale Q K^T) Delta``.

Grids run over value heads; q/k head ``j // G`` comes through the index maps
(GVA). With cuts, ``Gamma`` and ``e^g`` are the masked decays of :mod:`core`.
For a per-channel gate, ``Q e^g`` is per channel, the scores
``P = scale Gamma * Q K^T`` come formed (:func:`intra.forward`), and the
backward here is dDelta's share ``P^T dO`` alone (:func:`delta_backward`):
:func:`intra.backward` forms the rest.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deltajax.pallas import core
from deltajax.pallas import scores


def _output_kernel(*, q_ref, k_ref, g_ref, cuts_ref, s_ref, delta_ref, p_ref,
                   qg_ref, o_ref, scale, dot, low_ref=None):
  dtype = s_ref.dtype
  acc = core.accumulator(dtype)
  if qg_ref is None:  # a scalar gate: the scores are formed here
    q = q_ref[...]
    g = g_ref[...].astype(acc)
    cuts = None if cuts_ref is None else cuts_ref[...]
    p = scale * scores.scores(x=q, y=k_ref[...], g=g, cuts=cuts,
                              strict=False, dot=dot).matrix
    read = dot((q.astype(acc) * core.on_keys(
        scale * core.from_start(g, cuts))).astype(dtype), s_ref[...])
  else:
    p = p_ref[...].astype(acc)
    read = scale * dot(qg_ref[...], s_ref[...])
  # P Delta in float32: with aligned keys and a long memory, rounding P and
  # Delta to 16 bits would cost o 2e-3 of relative error each.
  delta = delta_ref[...]
  o = read + dot.split(dtype)(p, delta.astype(acc))
  o_ref[...] = o.astype(o_ref.dtype)
  if low_ref is not None:  # the backward's copy of Delta
    low_ref[...] = delta.astype(low_ref.dtype)


def _output_backward_kernel(*, q_ref, k_ref, g_ref, cuts_ref, s_ref,
                            delta_ref, do_ref, dq_ref, dg_ref, dd_ref, dk_ref,
                            scale, block_v, dot):
  q = q_ref[...]
  dtype, acc = q.dtype, core.accumulator(q.dtype)
  g = g_ref[...].astype(acc)
  cuts = None if cuts_ref is None else cuts_ref[...]
  qk = scores.scores(x=q, y=k_ref[...], g=g, cuts=cuts, strict=False, dot=dot)
  p = (qk.matrix * scale).astype(dtype)
  d_p, d_qg = 0, 0
  for vs in core.blocks(dd_ref.shape[1], block_v):
    d_o = do_ref[:, vs].astype(dtype)
    d_p += dot(d_o, delta_ref[:, vs].astype(dtype), trans_b=True)
    d_qg += dot(d_o, s_ref[:, vs].astype(dtype), trans_b=True)
    dd_ref[:, vs] = dot(p, d_o, trans_a=True)
  dq = d_qg * core.on_keys(scale * core.from_start(g, cuts))
  dq_p, dk_ref[...], dg_p = qk.vjp(d_p * scale, q, k_ref[...])
  dq_ref[...] = (dq + dq_p).astype(dq_ref.dtype)
  dg_ref[...] = jnp.sum(dq * q.astype(acc), axis=1) + dg_p


def _delta_backward_kernel(*, p_ref, do_ref, dd_ref, dtype, dot):
  dd_ref[...] = dot(p_ref[...].astype(dtype), do_ref[...].astype(dtype),
                    trans_a=True)


def _specs(chunk_size, groups, dk, dv):
  """BlockSpec makers for grids ``(B, HV, N, ...)``."""
  c = chunk_size
  return dict(
      qk=core.block(None, c, None, dk)(
          lambda i, j, n, *_: (i, n, core.qk_head(j, groups), 0)),
      keys=core.block(None, c, None, dk)(lambda i, j, n, *_: (i, n, j, 0)),
      vals=core.block(None, c, None, dv)(
          lambda i, j, n, *v: (i, n, j, *(v or (0,)))),
      gate=core.block(None, None, c)(lambda i, j, n, *_: (i, j, n)),
      square=core.block(None, None, c, c)(lambda i, j, n, *_: (i, j, n, 0)),
      state=core.block(None, None, None, dk, dv)(
          lambda i, j, n, *v: (i, j, n, 0, *(v or (0,)))))


def output(*, q, k, g, cuts, states, delta, p, chunk_size, scale, out_dtype,
           launch, interpret, dot, qg=None):
  """Chunk outputs.

  Args:
    q, k: ``[B, T, H, K]``; g: ``[B, HV, T]``; cuts: ``[B, HV, T]`` int32 or
    None; states: ``[B, HV, N, K, V]``; delta: ``[B, T, HV, V]``; for a
    per-channel gate, p: ``[B, HV, T, C]`` from :func:`intra.forward` and
    qg: ``Q e^g [B, T, HV, K]`` from :func:`intra.forward` (q, k, g and
    cuts are then not read).

  Returns:
    ``(o, delta)``, ``[B, T, HV, V]`` in ``out_dtype``: the outputs, and
    Delta (float32 from the scan, for the products here) in out_dtype for
    the backward.
  """
  bsz, t_len, h, dk = q.shape
  heads, dv = delta.shape[2:]
  bv = min(dv, launch.block_v)
  sp = _specs(chunk_size, heads // h, dk, bv)
  values = jax.ShapeDtypeStruct(delta.shape, out_dtype)
  low = {} if out_dtype == delta.dtype else dict(low_ref=(values, sp["vals"]))
  if qg is not None:
    q = k = g = cuts = None
  result = core.call(
      _output_kernel, grid=(bsz, heads, t_len // chunk_size, dv // bv),
      inputs=dict(q_ref=(q, sp["qk"]), k_ref=(k, sp["qk"]),
                  g_ref=(g, sp["gate"]), cuts_ref=(cuts, sp["gate"]),
                  s_ref=(states, sp["state"]), delta_ref=(delta, sp["vals"]),
                  p_ref=(p, sp["square"]), qg_ref=(qg, sp["keys"])),
      outputs=dict(o_ref=(values, sp["vals"]), **low),
      launch=launch, interpret=interpret, name="deltajax_output",
      scale=scale, dot=dot)
  return result if low else (result, delta)


def output_backward(*, q, k, g, cuts, states, delta, d_o, chunk_size, scale,
                    launch, interpret, dot):
  """Cotangents that flow from the output of a scalar gate, chunk by chunk.

  Returns:
    ``(dq [B, T, HV, K], dg [B, HV, T], d_delta [B, T, HV, V], dk [B, T, HV,
    K])``, per value head: dq complete (in q's dtype without GVA, else
    float32 for the sum over the group); the output's shares of dg,
    ``dDelta`` (``P^T dO``) and dk, in float32.
  """
  bsz, t_len, h, dk = q.shape
  heads, dv = delta.shape[2:]
  acc = core.accumulator(q.dtype)
  sp = _specs(chunk_size, heads // h, dk, dv)
  per_head = (bsz, t_len, heads, dk)
  return core.call(
      _output_backward_kernel, grid=(bsz, heads, t_len // chunk_size),
      inputs=dict(q_ref=(q, sp["qk"]), k_ref=(k, sp["qk"]),
                  g_ref=(g, sp["gate"]), cuts_ref=(cuts, sp["gate"]),
                  s_ref=(states, sp["state"]), delta_ref=(delta, sp["vals"]),
                  do_ref=(d_o, sp["vals"])),
      outputs=dict(
          dq_ref=(jax.ShapeDtypeStruct(
              per_head, q.dtype if heads == h else acc), sp["keys"]),
          dg_ref=(jax.ShapeDtypeStruct(g.shape, acc), sp["gate"]),
          dd_ref=(jax.ShapeDtypeStruct(delta.shape, acc), sp["vals"]),
          dk_ref=(jax.ShapeDtypeStruct(per_head, acc), sp["keys"])),
      launch=launch, interpret=interpret, name="deltajax_output_backward",
      scale=scale, block_v=launch.block_v, dot=dot)


def delta_backward(*, p, d_o, chunk_size, launch, interpret, dot):
  """The output's share of dDelta for a per-channel gate, ``P^T dO``, chunk
  by chunk (the output's other cotangents are :func:`intra.backward`'s).

  Args:
    p: ``[B, HV, T, C]`` from :func:`intra.forward`; d_o: ``[B, T, HV, V]``.

  Returns:
    ``[B, T, HV, V]`` in the accumulator dtype (float32; float64 for
    float64 inputs).
  """
  bsz, t_len, heads, dv = d_o.shape
  sp = _specs(chunk_size, 1, 0, dv)
  return core.call(
      _delta_backward_kernel, grid=(bsz, heads, t_len // chunk_size),
      inputs=dict(p_ref=(p, sp["square"]), do_ref=(d_o, sp["vals"])),
      outputs=dict(dd_ref=(jax.ShapeDtypeStruct(
          d_o.shape, core.accumulator(d_o.dtype)), sp["vals"])),
      launch=launch, interpret=interpret, name="deltajax_delta_backward",
      dtype=d_o.dtype, dot=dot)
