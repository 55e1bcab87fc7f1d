"""References written from the seeds, independent of deltajax's code.

* :func:`ref_a`: reference A of the Gated DeltaNet seed (section 3.1), the
  token recurrence in numpy float64, in the paper's orientation ``S [V, K]``
  with the decay ``alpha`` (not its log). Generalised only as far as the tests
  need: a per-channel ``alpha`` (the KDA seed's ``S <- S Diag(alpha)(I - b k
  k^T) + b v k^T``), an initial state, and the final state.
* :func:`plain_scan`: the same recurrence as a plain ``lax.scan`` in jnp, with
  no custom VJP, so that ``jax.vjp`` gives the autodiff gradients.

Neither applies a query scale; call deltajax with ``scale=1.0`` to compare.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def ref_a(q, k, v, alpha, beta, initial_state=None):
  """The seed's reference A, token by token.

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
