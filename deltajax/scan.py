"""The token recurrence: the definition of the gated delta rule (GDN seed, reference A).

``lax.scan`` over tokens of :func:`deltajax.common.token_step`. The backward
keeps the state only at chunk boundaries (memory ``O((T / C) K V)``) and
recomputes each chunk's token states while differentiating it, so its
gradients are those of autodiff through the plain scan.
"""

from __future__ import annotations

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


def _prepare(q, k, v, a, b, scale, chunk_size, dtype):
  q = q.astype(dtype) * scale
  return tuple(_token_major(x.astype(dtype), chunk_size) for x in (q, k, v, a, b))


def _scan_tokens(state, q, k, v, a, b):
  """Runs :func:`common.token_step` over the leading axis; returns ``(state, o)``."""
  return lax.scan(lambda s, x: common.token_step(s, *x), state, (q, k, v, a, b))


def _forward(q, k, v, a, b, initial_state, scale, chunk_size):
  dtype = initial_state.dtype
  xs = _prepare(q, k, v, a, b, scale, chunk_size, dtype)

  def chunk(state, x):
    new_state, o = _scan_tokens(state, *x)
    return new_state, (state, o)

  final_state, (states, o) = lax.scan(chunk, initial_state, xs)
  return (_batch_major(o).astype(v.dtype), final_state), states


def _backward(scale, chunk_size, inputs, states, cotangents):
  q, k, v, a, b, _ = inputs
  d_o, d_final = cotangents
  dtype = states.dtype
  xs = _prepare(q, k, v, a, b, scale, chunk_size, dtype)
  d_o = _token_major(d_o.astype(dtype), chunk_size)

  def chunk_back(d_next, x):
    state, inputs, d_o_chunk = x
    _, vjp = jax.vjp(_scan_tokens, state, *inputs)
    d_state, *d_inputs = vjp((d_next, d_o_chunk))
    return d_state, d_inputs

  d_initial, d_inputs = lax.scan(chunk_back, d_final.astype(dtype),
                                 (states, xs, d_o), reverse=True)
  dq, dk, dv, da, db = (_batch_major(x) for x in d_inputs)
  dq = dq * scale
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
          da.astype(a.dtype), db.astype(b.dtype), d_initial)


gated_delta_scan = common.implementation(
    _forward, _backward,
    summary="Token-by-token gated delta rule (chunk_size: checkpoint interval).")
