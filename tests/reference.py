"""References written from the papers, independent of deltajax's code.

* :func:`ref_a`: the Gated DeltaNet recurrence (Yang, Kautz & Hatamizadeh,
  ICLR 2025) token by token in numpy float64, in the paper's orientation
  ``S [V, K]`` with the decay ``alpha`` (not its log). Generalised only as far
  as the tests need: a per-channel ``alpha`` (KDA's ``S <- S Diag(alpha)(I -
  b k k^T) + b v k^T``: Kimi Linear, 2025), an initial state, and the final
  state.
* :func:`plain_scan`: the same recurrence as a plain ``lax.scan`` in jnp, with
  no custom VJP, so that ``jax.vjp`` gives the autodiff gradients.
* :func:`plain_scan_gdn2`: that rule as a plain differentiable ``lax.scan``.
* :func:`ref_gdn2`: Gated DeltaNet-2 (Hatamizadeh, Choi and Kautz, 2026,
  arXiv 2605.22791) as
  the paper writes it, ``S_t = (I - k (b * k)^T) Diag(exp a) S_{t-1} + k (w *
  v)^T`` with ``S [K, V]``, in numpy float64.

Neither applies a query scale; call deltajax with ``scale=1.0`` to compare.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def ref_a(q, k, v, alpha, beta, initial_state=None):
  """The Gated DeltaNet recurrence, token by token.

  Args:
    q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``.
    alpha: decay in ``(0, 1]``, ``[B, T, H]`` or per channel ``[B, T, H, K]``.
    beta: ``[B, T, H]``.
    initial_state: ``[B, H, K, V]`` (deltajax's ``S^T``) or None (zeros).

  Returns:
    ``(o, final_state)``: ``[B, T, H, V]`` and ``[B, H, K, V]``, float64.
  """
  q, k, v, alpha, beta = (np.asarray(x, np.float64)
                          for x in (q, k, v, alpha, beta))
  bsz, t_len, heads, dk = q.shape
  dv = v.shape[-1]
  o = np.zeros((bsz, t_len, heads, dv))
  final_state = np.zeros((bsz, heads, dk, dv))
  for b in range(bsz):
    for h in range(heads):
      s = (np.zeros((dv, dk)) if initial_state is None
           else np.asarray(initial_state[b, h], np.float64).T)
      for t in range(t_len):
        kt, vt, qt = k[b, t, h], v[b, t, h], q[b, t, h]
        decay = np.diag(np.broadcast_to(alpha[b, t, h], (dk,)))
        be = beta[b, t, h]
        s = s @ (decay @ (np.eye(dk) - be * np.outer(kt, kt))) + be * np.outer(
            vt, kt)
        o[b, t, h] = s @ qt
      final_state[b, h] = s.T
  return o, final_state


def plain_scan(q, k, v, a, b, initial_state):
  """Reference A as a differentiable ``lax.scan`` (no scale, no custom VJP).

  Args:
    q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``.
    a: log decay, ``[B, T, H]`` or ``[B, T, H, K]``; b: ``[B, T, H]``.
    initial_state: ``[B, H, K, V]`` (deltajax's ``S^T``).

  Returns:
    ``(o, final_state)``: ``[B, T, H, V]`` and ``[B, H, K, V]``.
  """
  dk = q.shape[-1]
  alpha = jnp.exp(a)
  alpha = jnp.broadcast_to(alpha[..., None], q.shape) if a.ndim == 3 else alpha

  def token(s, x):
    """``s`` ``[B, H, V, K]``: ``S <- S Diag(alpha)(I - b k k^T) + b v k^T``."""
    qt, kt, vt, at, bt = x
    householder = (jnp.eye(dk) - bt[..., None, None] * kt[..., :, None]
                   * kt[..., None, :])
    s = (s @ (at[..., :, None] * householder)
         + bt[..., None, None] * vt[..., :, None] * kt[..., None, :])
    return s, jnp.einsum("bhvk,bhk->bhv", s, qt)

  xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, alpha, b))
  s, o = lax.scan(token, jnp.swapaxes(initial_state, -1, -2), xs)
  return jnp.moveaxis(o, 0, 1), jnp.swapaxes(s, -1, -2)


def plain_scan_vjp(inputs, cotangents):
  """``(o, final_state)`` of :func:`plain_scan` and the gradients of ``<(o, s), cotangents>``.

  ``inputs`` is ``(q, k, v, a, b, initial_state)``; returns ``(outputs, grads)``
  with the grads in the same order.
  """
  outputs, vjp = jax.vjp(plain_scan, *inputs)
  return outputs, vjp(cotangents)


def grouped(q, k, v):
  """q, k ``[B, T, H, K]`` repeated to v's ``HV = G H`` heads (head ``j`` reads ``j // G``)."""
  groups = v.shape[2] // q.shape[2]
  return jnp.repeat(q, groups, axis=2), jnp.repeat(k, groups, axis=2)


def plain_scan_grouped(q, k, v, a, b, initial_state):
  """:func:`plain_scan` with grouped value heads."""
  return plain_scan(*grouped(q, k, v), v, a, b, initial_state)


def sequence_by_sequence(q, k, v, a, b, initial_state, cu_seqlens):
  """Packed sequences (fla's ``cu_seqlens``, B = 1), each run on its own.

  ``initial_state`` is ``[N, HV, K, V]``; returns ``(o [1, T, HV, V],
  final_state [N, HV, K, V])`` of :func:`plain_scan_grouped` per sequence.
  """
  outputs, finals = [], []
  for n, (start, end) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:])):
    piece = (x[:, start:end] for x in (q, k, v, a, b))
    o, s = plain_scan_grouped(*piece, initial_state[n:n + 1])
    outputs.append(o)
    finals.append(s)
  return jnp.concatenate(outputs, axis=1), jnp.concatenate(finals, axis=0)


def segment_by_segment(q, k, v, a, b, initial_state, segment_ids):
  """Rows of packed documents (``segment_ids`` ``[B, T]``, numpy), each run on its own.

  A row's first segment starts from its initial state, the others from zero;
  the final state is the state after the row's last token.
  """
  outputs, finals = [], []
  for row, ids in enumerate(np.asarray(segment_ids)):
    starts = [0] + [t for t in range(1, len(ids)) if ids[t] != ids[t - 1]]
    state = initial_state[row:row + 1]
    pieces = []
    for i, (start, end) in enumerate(zip(starts, starts[1:] + [len(ids)])):
      if i > 0:
        state = jnp.zeros_like(state)
      o, state = plain_scan_grouped(
          *(x[row:row + 1, start:end] for x in (q, k, v, a, b)), state)
      pieces.append(o)
    outputs.append(jnp.concatenate(pieces, axis=1))
    finals.append(state)
  return jnp.concatenate(outputs, axis=0), jnp.concatenate(finals, axis=0)


def ref_gdn2(q, k, v, a, b, w, initial_state=None):
  """Gated DeltaNet-2 token by token, in the paper's form.

  Args:
    q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``.
    a: per-channel log decay ``[B, T, H, K]``; b: erase gate ``[B, T, H, K]``;
    w: write gate ``[B, T, H, V]``.
    initial_state: ``[B, H, K, V]`` or None (zeros).

  Returns:
    ``(o, final_state)``: ``o_t = S_t^T q_t`` ``[B, T, H, V]`` and
    ``[B, H, K, V]``, float64.
  """
  q, k, v, a, b, w = (np.asarray(x, np.float64) for x in (q, k, v, a, b, w))
  bsz, t_len, heads, dk = q.shape
  dv = v.shape[-1]
  o = np.zeros((bsz, t_len, heads, dv))
  final_state = np.zeros((bsz, heads, dk, dv))
  for i in range(bsz):
    for h in range(heads):
      s = (np.zeros((dk, dv)) if initial_state is None
           else np.asarray(initial_state[i, h], np.float64))
      for t in range(t_len):
        kt = k[i, t, h]
        erase = np.eye(dk) - np.outer(kt, b[i, t, h] * kt)
        s = (erase @ np.diag(np.exp(a[i, t, h])) @ s
             + np.outer(kt, w[i, t, h] * v[i, t, h]))
        o[i, t, h] = s.T @ q[i, t, h]
      final_state[i, h] = s
  return o, final_state


def plain_scan_gdn2(q, k, v, a, b, w, initial_state):
  """:func:`ref_gdn2` as a differentiable ``lax.scan`` (no scale, no custom
  VJP); the same arguments, ``initial_state`` required."""
  dk = q.shape[-1]

  def token(s, x):
    """``s [B, H, K, V]``: ``S <- (I - k (b k)^T) Diag(e^a) S + k (w v)^T``."""
    qt, kt, vt, at, bt, wt = x
    erase = jnp.eye(dk) - kt[..., :, None] * (bt * kt)[..., None, :]
    s = (erase @ (jnp.exp(at)[..., :, None] * s)
         + kt[..., :, None] * (wt * vt)[..., None, :])
    return s, jnp.einsum("bhkv,bhk->bhv", s, qt)

  xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, a, b, w))
  s, o = lax.scan(token, initial_state, xs)
  return jnp.moveaxis(o, 0, 1), s
