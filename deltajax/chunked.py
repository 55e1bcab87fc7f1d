"""Chunkwise gated delta rule in jnp: the UT transform (Gated DeltaNet, ICLR 2025).

Per chunk of C tokens, with ``g`` the chunk-local cumulative log gate and
``Gamma[i, j] = exp(g_i - g_j)`` (zero across a cut, :class:`common.ChunkGate`):

* UT transform (parallel over chunks)::

    T = (I + strictLower(diag(b) (Gamma * K K^T)))^-1
    W = T diag(b) (K * e^g),  U = T diag(b) V

* State scan (the only sequential part)::

    Delta = U - W S                      # the corrected values ("v_new")
    S'    = e^{g_C} S + (K * e^{g_C - g})^T Delta

* Output (parallel over chunks)::

    O = (Q * e^g) S + (Gamma * Q K^T) Delta

``Delta`` is the solution of ``(I + strictLower(A)) Delta = R`` with
``R = diag(b)(V - diag(gamma) K S)``: the decay enters before the delta
prediction and the cross-chunk term ``W S`` is kept (Gated DeltaNet: Yang,
Kautz & Hatamizadeh, ICLR 2025). ``T`` comes from :func:`common.invert_unit_lower` (matmuls, no
LAPACK). The backward is derived by hand and follows the same three stages
in reverse; it stores only the chunk-entry states.
"""

from __future__ import annotations

from typing import NamedTuple

import functools

import jax
import jax.numpy as jnp
from jax import lax

from deltajax import common


class _Chunks(NamedTuple):
  """Chunk-major inputs ``[N, B, H, C, ...]`` in the compute dtype."""
  q: jax.Array  # scaled
  k: jax.Array
  v: jax.Array
  gate: common.ChunkGate  # [N, B, H, C, W]
  b: jax.Array | tuple  # [N, B, H, C], or (erase [..., C, K], write [..., C, V])


def _prepare(q, k, v, a, b, cut, scale, chunk_size, dtype) -> _Chunks:
  q = q.astype(dtype) * scale
  q, k, v, a, b = jax.tree.map(
      lambda x: common.to_chunks(x.astype(dtype), chunk_size),
      (q, k, v, a, b))
  cut = None if cut is None else common.to_chunks(cut, chunk_size)
  return _Chunks(q, k, v, common.ChunkGate.of(a, cut, axis=-2), b)


def _ut_transform(k, v, gate, b):
  """Returns ``(W, U, M, T)``: ``[..., C, K]``, ``[..., C, V]``, the strict
  ``M = Gamma * (erase K) K^T`` (``diag(b) Gamma * K K^T`` for beta) and
  ``T = (I + M)^-1``, ``[..., C, C]``; ``W = T (erase K e^g)``, ``U = T
  (write V)`` (:func:`common.erase_write`)."""
  erase, write = common.erase_write(b)
  m = common.decayed_scores(erase * k, k, gate, strict=True)
  t = common.invert_unit_lower(m)
  w = common.mm(t, erase * k * gate.from_start())
  return w, common.mm(t, write * v), m, t


def _corrected(u, w, state, cuts: common.StateCuts):
  """``Delta = U - W S``; ``W S`` selected away at the tokens that a cut
  separates from the entry state (their rows of W are 0)."""
  return u - common.drop(cuts.unread, common.mm(w, state))


def _state_scan(w, u, k_end, decay, cuts, initial_state, chunk_seq):
  """Scan over chunks; returns ``(final_state, entry_states, delta)``.

  ``cuts`` (:class:`common.StateCuts`) select the state away wherever a cut
  stops it, instead of multiplying it by a zero decay (NaN * 0 is NaN): a
  non-finite state does not cross a cut into the next chunks. (Within a
  chunk, a non-finite value still reaches the tokens on the far side of a
  cut through the products with T and the scores, whose zeros do not stop
  it.) The entry states are those the chunks use (0 where a cut at the
  first token discards them).
  """

  def step(state, x):
    w, u, k_end, decay, cuts = x
    delta = _corrected(u, w, state, cuts)
    new_state = (common.drop(cuts.stopped, decay[..., :, None] * state)
                 + common.einsum("...ck,...cv->...kv", k_end,
                                 common.drop(cuts.unwritten, delta)))
    return new_state, delta

  final_state, (states, delta) = common.scan_chunks(
      step, initial_state, (w, u, k_end, decay, cuts), chunk_seq,
      enter=lambda state, x: common.drop(x[-1].entry, state))
  return final_state, states, delta


def _state_scan_vjp(w, k_end, decay, cuts, d_states, d_delta, d_final,
                    chunk_seq):
  """Reverse of :func:`_state_scan`.

  ``d_states`` and ``d_delta`` are the cotangents that reach each chunk's
  entry state and ``Delta`` from the output. Returns ``(d_initial, (d_next,
  d_delta))`` with ``d_next`` the cotangent of each chunk's exit state.
  """

  def step(d_next, x):
    w, k_end, decay, cuts, d_state, d_delta = x
    d_delta = d_delta + common.mm(k_end, d_next)
    d_state = (d_state + decay[..., :, None] * d_next
               - common.einsum("...ck,...cv->...kv", w, d_delta))
    return common.drop(cuts.entry, d_state), (d_next, d_delta)

  return common.scan_chunks_reverse(
      step, d_final, (w, k_end, decay, cuts, d_states, d_delta), chunk_seq)


def gated_delta_chunked(q, k, v, a, b, initial_state, cut, chunk_seq, *,
                        scale, chunk_size):
  """Chunkwise gated delta rule (UT transform), in the contract of
  :data:`deltajax.registry.CONTRACT`: q, k ``[B, T, H, K]``, v
  ``[B, T, HV, V]``, a ``[B, T, HV, W]``, b ``[B, T, HV]``, initial_state
  ``[N, HV, K, V]``, cut and chunk_seq or None. Returns ``(o, final_state)``.
  """
  groups = v.shape[2] // q.shape[2]
  q, k = (common.repeat_heads(x, groups) for x in (q, k))
  return _chunked(q, k, v, common.floored(a), b, initial_state, cut, chunk_seq, scale,
                  chunk_size)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9))
def _chunked(q, k, v, a, b, initial_state, cut, chunk_seq, scale, chunk_size):
  return _chunked_fwd(q, k, v, a, b, initial_state, cut, chunk_seq, scale,
                      chunk_size)[0]


def _chunked_fwd(q, k, v, a, b, initial_state, cut, chunk_seq, scale,
                 chunk_size):
  c = _prepare(q, k, v, a, b, cut, scale, chunk_size, initial_state.dtype)
  w, u, _, _ = _ut_transform(c.k, c.v, c.gate, c.b)
  final_state, states, delta = _state_scan(
      w, u, c.k * c.gate.to_end(), c.gate.total(), c.gate.state_cuts(),
      initial_state, chunk_seq)
  o = (common.mm(c.q * c.gate.from_start(), states)
       + common.mm(common.decayed_scores(c.q, c.k, c.gate, strict=False),
                   delta))
  outputs = (common.from_chunks(o).astype(v.dtype), final_state)
  return outputs, (q, k, v, a, b, initial_state, cut, chunk_seq, states)


def _ut_transform_vjp(d_w, d_u, c: _Chunks, w, u, m, t):
  """Cotangents of :func:`_ut_transform`: ``(dk, dv, dg, db)``, dg per
  channel, db as ``c.b`` (beta, or the pair of erase and write gates)."""
  erase, write = common.erase_write(c.b)
  e_g = c.gate.from_start()
  k_g = c.k * e_g
  # [W | U] = T [erase K e^g | write V] with T = (I + M)^-1: the cotangents
  # of the right-hand sides are T^T d[W | U], and dM = -T^T d[W | U]
  # [W | U]^T.
  t_t = jnp.swapaxes(t, -1, -2)
  d_xk, d_xv = common.mm(t_t, d_w), common.mm(t_t, d_u)
  d_m = -(common.mm(d_xk, jnp.swapaxes(w, -1, -2))
          + common.mm(d_xv, jnp.swapaxes(u, -1, -2)))
  dx, dk2, dg1, dg2 = common.decayed_scores_vjp(
      d_m, erase * c.k, c.k, c.gate, strict=True)
  dk = (dx + d_xk * e_g) * erase + dk2
  dg = dg1 + dg2 + d_xk * erase * k_g
  d_erase, d_write = dx * c.k + d_xk * k_g, d_xv * c.v
  db = ((d_erase, d_write) if isinstance(c.b, tuple)
        else jnp.sum(d_erase, axis=-1) + jnp.sum(d_write, axis=-1))
  return dk, d_xv * write, dg, db


def _chunked_bwd(scale, chunk_size, residuals, cotangents):
  q, k, v, a, b, initial_state, cut, chunk_seq, states = residuals
  d_o, d_final = cotangents
  dtype = states.dtype
  c = _prepare(q, k, v, a, b, cut, scale, chunk_size, dtype)
  d_o = common.to_chunks(d_o.astype(dtype), chunk_size)
  w, u, m, t = _ut_transform(c.k, c.v, c.gate, c.b)
  to_end, decay = c.gate.to_end(), c.gate.total()
  k_end = c.k * to_end
  cuts = c.gate.state_cuts()
  delta = _corrected(u, w, states, cuts)
  e_g = c.gate.from_start()
  aqk = common.decayed_scores(c.q, c.k, c.gate, strict=False)

  # Output: O = (Q e^g) S + Aqk Delta.
  d_qg = common.mm(d_o, jnp.swapaxes(states, -1, -2))
  d_states = common.einsum("...ck,...cv->...kv", c.q * e_g, d_o)
  d_delta = common.mm(jnp.swapaxes(aqk, -1, -2), d_o)
  dq, dk, dg_q, dg_k = common.decayed_scores_vjp(
      common.mm(d_o, jnp.swapaxes(delta, -1, -2)), c.q, c.k, c.gate,
      strict=False)
  dq = dq + d_qg * e_g
  dg = dg_q + dg_k + d_qg * c.q * e_g

  # State scan, then its inputs: Delta = U - W S and the chunk-end decays.
  d_initial, (d_next, d_delta) = _state_scan_vjp(
      w, k_end, decay, cuts, d_states, d_delta, d_final.astype(dtype),
      chunk_seq)
  d_k_end = common.einsum("...cv,...kv->...ck", delta, d_next)
  dk = dk + d_k_end * to_end
  dg = dg - k_end * d_k_end
  dg_end = (jnp.sum(k_end * d_k_end, axis=-2)
            + decay * jnp.sum(d_next * states, axis=-1))
  dk_ut, dv, dg_ut, db = _ut_transform_vjp(
      -common.mm(d_delta, jnp.swapaxes(states, -1, -2)), d_delta, c, w, u,
      m, t)
  dk = dk + dk_ut
  dg = (dg + dg_ut).at[..., -1, :].add(dg_end)
  # g is a cumulative sum of a within the chunk.
  da = common.reduce_gate(lax.cumsum(dg, axis=dg.ndim - 2, reverse=True),
                          a.shape[-1])
  grads = (dq * scale, dk, dv, da, db)
  return (*jax.tree.map(lambda d, x: common.from_chunks(d).astype(x.dtype),
                        grads, (q, k, v, a, b)),
          d_initial.astype(initial_state.dtype), None, None)


_chunked.defvjp(_chunked_fwd, _chunked_bwd)
