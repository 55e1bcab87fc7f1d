"""The token recurrence: the definition of the gated delta rule (Gated DeltaNet, ICLR 2025).

``lax.scan`` over tokens of :func:`deltajax.common.token_step`. The backward
keeps the state only at chunk boundaries (memory ``O((T / C) K V)``) and
recomputes each chunk's token states while differentiating it, so its
gradients are those of autodiff through the plain scan.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from deltajax import common


def _token_major(x: jax.Array, chunk_size: int) -> jax.Array:
  """``[B, T, H, ...]`` -> ``[N, C, B, H, ...]``."""
  return jnp.moveaxis(common.to_chunks(x, chunk_size), 3, 1)


def _batch_major(x: jax.Array) -> jax.Array:
  """Inverse of :func:`_token_major`."""
  return common.from_chunks(jnp.moveaxis(x, 1, 3))


def _prepare(q, k, v, a, b, cut, scale, chunk_size, dtype):
  """Token-major ``(q scaled, k, v, a, b, cut)`` (b: beta or Gated
  DeltaNet-2's pair); ``cut`` stays None without cuts."""
  q = q.astype(dtype) * scale
  xs = jax.tree.map(lambda x: _token_major(x.astype(dtype), chunk_size),
                    (q, k, v, a, b))
  return (*xs, None if cut is None else _token_major(cut, chunk_size))


def _scan_tokens(state, q, k, v, a, b, cut):
  """Runs :func:`common.token_step` over the leading axis; returns ``(state, o)``."""
  return lax.scan(lambda s, x: common.token_step(s, *x), state,
                  (q, k, v, a, b, cut))


def gated_delta_scan(q, k, v, a, b, initial_state, cut, chunk_seq, *, scale,
                     chunk_size):
  """Token-by-token gated delta rule, in the contract of
  :data:`deltajax.registry.CONTRACT`; ``chunk_size`` is the interval at
  which the backward keeps states. Returns ``(o, final_state)``.
  """
  groups = v.shape[2] // q.shape[2]
  q, k = (common.repeat_heads(x, groups) for x in (q, k))
  return _scan(q, k, v, common.floored(a), b, initial_state, cut, chunk_seq, scale, chunk_size)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9))
def _scan(q, k, v, a, b, initial_state, cut, chunk_seq, scale, chunk_size):
  return _scan_fwd(q, k, v, a, b, initial_state, cut, chunk_seq, scale,
                   chunk_size)[0]


def _scan_fwd(q, k, v, a, b, initial_state, cut, chunk_seq, scale,
              chunk_size):
  xs = _prepare(q, k, v, a, b, cut, scale, chunk_size, initial_state.dtype)
  final_state, (states, o) = common.scan_chunks(
      lambda state, x: _scan_tokens(state, *x), initial_state, xs, chunk_seq)
  outputs = (_batch_major(o).astype(v.dtype), final_state)
  return outputs, (q, k, v, a, b, initial_state, cut, chunk_seq, states)


def _scan_bwd(scale, chunk_size, residuals, cotangents):
  q, k, v, a, b, initial_state, cut, chunk_seq, states = residuals
  d_o, d_final = cotangents
  dtype = states.dtype
  xs = _prepare(q, k, v, a, b, cut, scale, chunk_size, dtype)
  d_o = _token_major(d_o.astype(dtype), chunk_size)

  def chunk_back(d_next, x):
    state, inputs, d_o_chunk = x
    _, vjp = jax.vjp(lambda s, *x: _scan_tokens(s, *x, inputs[-1]), state,
                     *inputs[:-1])
    d_state, *d_inputs = vjp((d_next, d_o_chunk))
    return d_state, d_inputs

  d_initial, d_inputs = common.scan_chunks_reverse(
      chunk_back, d_final.astype(dtype), (states, xs, d_o), chunk_seq)
  dq, dk, dv, da, db = jax.tree.map(_batch_major, tuple(d_inputs))
  dq = dq * scale
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
          da.astype(a.dtype), jax.tree.map(lambda d, x: d.astype(x.dtype),
                                           db, b),
          d_initial.astype(initial_state.dtype), None, None)


_scan.defvjp(_scan_fwd, _scan_bwd)
