"""``impl="pallas"``: the chunked algorithm as Pallas kernels, with its custom_vjp.

Forward: :func:`ut.inverse` (parallel over chunks) ->
:func:`state.forward_scan` (sequential over chunks; applies T, so W and U are
never formed) -> :func:`output.output` (parallel). Backward:
:func:`ut.w_u` and :func:`output.output_backward` (parallel) ->
:func:`state.backward_scan` (sequential, reverse) -> :func:`ut.ut_backward`
(parallel). The backward keeps the forward's ``T``, ``Delta`` and
chunk-entry states and recomputes ``W``, ``U``: memory
``O(T (K + V) + (T / C) K V)`` per head.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from deltajax import common
from deltajax.pallas import core
from deltajax.pallas import output
from deltajax.pallas import state
from deltajax.pallas import ut


def _gates(a, b, chunk_size, dtype):
  """``[B, T, H, 1]`` log gate and ``[B, T, H]`` beta -> ``[B, H, T]`` cumulative gate and beta."""
  bsz, t_len, h, _ = a.shape
  a = jnp.transpose(a[..., 0], (0, 2, 1)).astype(dtype)
  g = jnp.cumsum(a.reshape(bsz, h, t_len // chunk_size, chunk_size), axis=-1)
  return g.reshape(bsz, h, t_len), jnp.transpose(b, (0, 2, 1)).astype(dtype)


def _pad_state(state, k_dim, v_dim):
  """``[B, H, K, V]`` padded with zeros to ``[B, H, k_dim, v_dim]``."""
  return common.pad_axis(common.pad_axis(state, 2, k_dim), 3, v_dim)


def _padded(q, k, v, state):
  """q, k, v in one dtype (the kernels' dots need it), head dims padded."""
  dtype = jnp.result_type(q, k, v)
  kp, vp = core.padded_dim(q.shape[-1]), core.padded_dim(v.shape[-1])
  q, k = (common.pad_axis(x.astype(dtype), 3, kp) for x in (q, k))
  v = common.pad_axis(v.astype(dtype), 3, vp)
  return q, k, v, _pad_state(state, kp, vp)


def _check(q, a, chunk_size):
  if a.shape[-1] != 1:
    raise NotImplementedError(
        "impl='pallas' has kernels for the scalar (Gated DeltaNet) gate; use "
        "impl='chunked' for a per-channel (KDA) gate (impl='auto' does).")
  if chunk_size < core.SUB:
    raise ValueError(f"impl='pallas' needs chunk_size >= {core.SUB}; got "
                     f"{chunk_size}")


def _forward(q, k, v, a, b, initial_state, scale, chunk_size):
  _check(q, a, chunk_size)
  acc = initial_state.dtype
  g, beta = _gates(a, b, chunk_size, acc)
  qp, kp, vp, s0 = _padded(q, k, v, initial_state)
  t = ut.inverse(kp, g, beta, chunk_size=chunk_size)
  delta, states, final = state.forward_scan(t, kp, vp, g, beta, s0,
                                            chunk_size=chunk_size)
  o = output.output(qp, kp, g, states, delta, chunk_size=chunk_size,
                    scale=scale, out_dtype=v.dtype)
  n_k, n_v = q.shape[-1], v.shape[-1]
  return ((o[..., :n_v], final[..., :n_k, :n_v]),
          (t, states, delta))


def _backward(scale, chunk_size, inputs, saved, cotangents):
  q, k, v, a, b, initial_state = inputs
  t, states, delta = saved
  d_o, d_final = cotangents
  acc = initial_state.dtype
  g, beta = _gates(a, b, chunk_size, acc)
  qp, kp, vp, _ = _padded(q, k, v, initial_state)
  d_o = common.pad_axis(d_o.astype(vp.dtype), 3, vp.shape[-1])
  d_final = _pad_state(d_final.astype(acc), kp.shape[-1], vp.shape[-1])
  w, u = ut.w_u(kp, vp, g, beta, t, chunk_size=chunk_size)
  dq, dk_out, dg_out, d_delta = output.output_backward(
      qp, kp, g, states, delta, d_o, chunk_size=chunk_size, scale=scale)
  d_delta, d_next, d_initial = state.backward_scan(
      qp, kp, w, g, d_o, d_delta, d_final, chunk_size=chunk_size,
      scale=scale)
  dk, dv, db, da = ut.ut_backward(
      kp, vp, g, beta, t, w, u, states, d_next, delta, d_delta, dk_out,
      dg_out, chunk_size=chunk_size)
  n_k, n_v = q.shape[-1], v.shape[-1]
  da = jnp.transpose(da, (0, 2, 1))[..., None]
  db = jnp.transpose(db, (0, 2, 1))
  return (dq[..., :n_k].astype(q.dtype), dk[..., :n_k].astype(k.dtype),
          dv[..., :n_v].astype(v.dtype), da.astype(a.dtype),
          db.astype(b.dtype),
          d_initial[..., :n_k, :n_v].astype(initial_state.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _pallas(q, k, v, a, b, initial_state, scale, chunk_size):
  return _forward(q, k, v, a, b, initial_state, scale, chunk_size)[0]


def _pallas_fwd(q, k, v, a, b, initial_state, scale, chunk_size):
  outputs, saved = _forward(q, k, v, a, b, initial_state, scale, chunk_size)
  return outputs, ((q, k, v, a, b, initial_state), saved)


def _pallas_bwd(scale, chunk_size, residuals, cotangents):
  inputs, saved = residuals
  return _backward(scale, chunk_size, inputs, saved, cotangents)


_pallas.defvjp(_pallas_fwd, _pallas_bwd)


def gated_delta_pallas(q, k, v, a, b, initial_state, cut, chunk_seq, *, scale,
                       chunk_size):
  """Gated delta rule with Pallas (Triton) kernels, in the contract of
  :data:`deltajax.registry.CONTRACT`: scalar gate, no cuts, no packing, no
  grouped value heads."""
  if cut is not None or chunk_seq is not None or v.shape[2] != q.shape[2]:
    raise NotImplementedError("impl='pallas' has no packed sequences or "
                              "grouped value heads yet")
  return _pallas(q, k, v, a, b, initial_state, scale, chunk_size)
