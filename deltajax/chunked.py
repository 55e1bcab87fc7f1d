"""Chunkwise gated delta rule in jnp: the UT transform (GDN seed, sections 2.3 and 3.2).

Per chunk of C tokens, with ``g`` the chunk-local cumulative log gate:

* UT transform (parallel over chunks)::

    M = I + strictLower(diag(b) (Gamma * K K^T))
    W = M^-1 diag(b) (K * e^g),  U = M^-1 diag(b) V

* State scan (the only sequential part)::

    Delta = U - W S                      # the corrected values ("v_new")
    S'    = e^{g_C} S + (K * e^{g_C - g})^T Delta

* Output (parallel over chunks)::

    O = (Q * e^g) S + (Gamma * Q K^T) Delta

``Delta`` is the seed's solution of ``(I + strictLower(A)) Delta = R`` with
``R = diag(b)(V - diag(gamma) K S)``: the decay enters before the delta
prediction and the cross-chunk term ``W S`` is kept (seed summary, items 6
and 7). The backward is derived by hand and follows the same three stages in
reverse; it stores only the chunk-entry states.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from deltajax import common


class _Chunks(NamedTuple):
  """Chunk-major inputs ``[N, B, H, C, ...]`` in the compute dtype."""
  q: jax.Array  # scaled
  k: jax.Array
  v: jax.Array
  g: jax.Array  # [N, B, H, C, G] chunk-local cumulative log gate
  b: jax.Array  # [N, B, H, C]


def _prepare(q, k, v, a, b, scale, chunk_size, dtype) -> _Chunks:
  q = q.astype(dtype) * scale
  q, k, v, a, b = (common.to_chunks(x.astype(dtype), chunk_size)
                   for x in (q, k, v, a, b))
  return _Chunks(q, k, v, jnp.cumsum(a, axis=-2), b)


def _ut_transform(k, v, g, b):
  """Returns ``(W, U, KK)``: ``[..., C, K]``, ``[..., C, V]`` and the strict ``Gamma * K K^T``."""
  kk = common.decayed_scores(k, k, g, g, strict=True)
  rhs = b[..., None] * jnp.concatenate([k * jnp.exp(g), v], axis=-1)
  y = lax.linalg.triangular_solve(b[..., :, None] * kk, rhs, left_side=True,
                                  lower=True, unit_diagonal=True)
  return y[..., :k.shape[-1]], y[..., k.shape[-1]:], kk


def _chunk_end_decays(g):
  """``(e^{g_C - g}, e^{g_C})``: decay from each token to the chunk end ``[..., C, G]``
  and the state's decay over the chunk ``[..., G]``."""
  g_end = g[..., -1:, :]
  return jnp.exp(g_end - g), jnp.exp(g_end[..., 0, :])


def _state_scan(w, u, k_end, decay, initial_state):
  """Scan over chunks; returns ``(final_state, entry_states, delta)``."""

  def step(state, x):
    w, u, k_end, decay = x
    delta = u - w @ state
    new_state = (decay[..., :, None] * state
                 + jnp.einsum("...ck,...cv->...kv", k_end, delta))
    return new_state, (state, delta)

  final_state, (states, delta) = lax.scan(step, initial_state,
                                          (w, u, k_end, decay))
  return final_state, states, delta


def _state_scan_vjp(w, k_end, decay, d_states, d_delta, d_final):
  """Reverse of :func:`_state_scan`.

  ``d_states`` and ``d_delta`` are the cotangents that reach each chunk's
  entry state and ``Delta`` from the output. Returns ``(d_initial, d_next,
  d_delta)`` with ``d_next`` the cotangent of each chunk's exit state.
  """

  def step(d_next, x):
    w, k_end, decay, d_state, d_delta = x
    d_delta = d_delta + k_end @ d_next
    d_state = (d_state + decay[..., :, None] * d_next
               - jnp.einsum("...ck,...cv->...kv", w, d_delta))
    return d_state, (d_next, d_delta)

  d_initial, (d_next, d_delta) = lax.scan(
      step, d_final, (w, k_end, decay, d_states, d_delta), reverse=True)
  return d_initial, d_next, d_delta


def _forward(q, k, v, a, b, initial_state, scale, chunk_size):
  c = _prepare(q, k, v, a, b, scale, chunk_size, initial_state.dtype)
  w, u, _ = _ut_transform(c.k, c.v, c.g, c.b)
  to_end, decay = _chunk_end_decays(c.g)
  final_state, states, delta = _state_scan(w, u, c.k * to_end, decay,
                                          initial_state)
  o = ((c.q * jnp.exp(c.g)) @ states
       + common.decayed_scores(c.q, c.k, c.g, c.g, strict=False) @ delta)
  return (common.from_chunks(o).astype(v.dtype), final_state), states


def _ut_transform_vjp(d_w, d_u, c: _Chunks, w, u, kk):
  """Cotangents of :func:`_ut_transform`: ``(dk, dv, dg, db)``, dg per channel."""
  n_k = c.k.shape[-1]
  e_g = jnp.exp(c.g)
  x = jnp.concatenate([c.k * e_g, c.v], axis=-1)
  m = c.b[..., :, None] * kk
  d_x = lax.linalg.triangular_solve(m, jnp.concatenate([d_w, d_u], axis=-1),
                                    left_side=True, lower=True,
                                    transpose_a=True, unit_diagonal=True)
  d_m = -d_x @ jnp.swapaxes(jnp.concatenate([w, u], axis=-1), -1, -2)
  db = jnp.sum(d_x * x, axis=-1) + jnp.sum(d_m * kk, axis=-1)
  d_x = c.b[..., None] * d_x
  dk1, dk2, dg1, dg2 = common.decayed_scores_vjp(
      c.b[..., :, None] * d_m, c.k, c.k, c.g, c.g, strict=True)
  d_kg = d_x[..., :n_k]
  dk = dk1 + dk2 + d_kg * e_g
  dg = dg1 + dg2 + d_kg * x[..., :n_k]
  return dk, d_x[..., n_k:], dg, db


def _backward(scale, chunk_size, inputs, states, cotangents):
  q, k, v, a, b, _ = inputs
  d_o, d_final = cotangents
  dtype = states.dtype
  c = _prepare(q, k, v, a, b, scale, chunk_size, dtype)
  d_o = common.to_chunks(d_o.astype(dtype), chunk_size)
  w, u, kk = _ut_transform(c.k, c.v, c.g, c.b)
  to_end, decay = _chunk_end_decays(c.g)
  k_end = c.k * to_end
  delta = u - w @ states
  e_g = jnp.exp(c.g)
  aqk = common.decayed_scores(c.q, c.k, c.g, c.g, strict=False)

  # Output: O = (Q e^g) S + Aqk Delta.
  d_qg = d_o @ jnp.swapaxes(states, -1, -2)
  d_states = jnp.einsum("...ck,...cv->...kv", c.q * e_g, d_o)
  d_delta = jnp.swapaxes(aqk, -1, -2) @ d_o
  dq, dk, dg_q, dg_k = common.decayed_scores_vjp(
      d_o @ jnp.swapaxes(delta, -1, -2), c.q, c.k, c.g, c.g, strict=False)
  dq = dq + d_qg * e_g
  dg = dg_q + dg_k + d_qg * c.q * e_g

  # State scan, then its inputs: Delta = U - W S and the chunk-end decays.
  d_initial, d_next, d_delta = _state_scan_vjp(w, k_end, decay, d_states,
                                               d_delta, d_final.astype(dtype))
  d_k_end = jnp.einsum("...cv,...kv->...ck", delta, d_next)
  dk = dk + d_k_end * to_end
  dg = dg - k_end * d_k_end
  dg_end = (jnp.sum(k_end * d_k_end, axis=-2)
            + decay * jnp.sum(d_next * states, axis=-1))
  dk_ut, dv, dg_ut, db = _ut_transform_vjp(
      -d_delta @ jnp.swapaxes(states, -1, -2), d_delta, c, w, u, kk)
  dk = dk + dk_ut
  dg = (dg + dg_ut).at[..., -1, :].add(dg_end)
  # g is a cumulative sum of a within the chunk.
  da = common.reduce_gate(lax.cumsum(dg, axis=dg.ndim - 2, reverse=True),
                          a.shape[-1])
  grads = (dq * scale, dk, dv, da, db)
  return (*(common.from_chunks(d).astype(x.dtype)
            for d, x in zip(grads, (q, k, v, a, b))), d_initial)


gated_delta_chunked = common.implementation(
    _forward, _backward, summary="Chunkwise gated delta rule (UT transform).")
