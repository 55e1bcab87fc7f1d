"""Math shared by every implementation: dtypes, padding, chunking, log-space gates.

Conventions used throughout deltajax:

* Arrays use fla's layout: q, k ``[B, T, H, K]``, v ``[B, T, H, V]``.
* The gate ``a`` (log decay, ``<= 0``) is carried as ``[B, T, H, G]`` with
  ``G = 1`` for Gated DeltaNet's scalar gate and ``G = K`` for KDA's
  per-channel gate, so that the same broadcasting code serves both.
* The state is the transposed ``S^T`` of the seeds, ``[B, H, K, V]``.
* ``q`` arrives unscaled; implementations multiply by ``scale`` in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def compute_dtype(*arrays) -> jnp.dtype:
  """float32, or float64 when any input is float64 (under ``jax_enable_x64``)."""
  return jnp.promote_types(jnp.result_type(*arrays), jnp.float32)


def pad_axis(x: jax.Array, axis: int, size: int) -> jax.Array:
  """Zero-pads ``x`` along ``axis`` up to ``size`` (no-op when already there)."""
  extra = size - x.shape[axis]
  if extra == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths)


def round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def to_chunks(x: jax.Array, chunk_size: int) -> jax.Array:
  """``[B, T, H, ...]`` -> chunk-major ``[N, B, H, C, ...]`` (T a multiple of C)."""
  b, t, h = x.shape[:3]
  x = x.reshape(b, t // chunk_size, chunk_size, h, *x.shape[3:])
  return jnp.moveaxis(x, (1, 3), (0, 2))


def from_chunks(x: jax.Array) -> jax.Array:
  """Inverse of :func:`to_chunks`: ``[N, B, H, C, ...]`` -> ``[B, N*C, H, ...]``."""
  n, b, h, c = x.shape[:4]
  x = jnp.moveaxis(x, (0, 2), (1, 3))
  return x.reshape(b, n * c, h, *x.shape[4:])


def causal_mask(c: int, *, strict: bool) -> jax.Array:
  """``[C, C]`` boolean: ``j < i`` when ``strict`` else ``j <= i``."""
  i = jnp.arange(c)
  return (i[:, None] > i[None, :]) if strict else (i[:, None] >= i[None, :])


def decay_ratio(g_x: jax.Array, g_y: jax.Array, mask: jax.Array) -> jax.Array:
  """``exp(g_x[i] - g_y[j])`` where ``mask[i, j]``, else 0.

  ``g_*`` are ``[..., C, G]`` chunk-local cumulative log gates. The difference
  is masked *before* ``exp`` (GDN seed, section 4.1): above the diagonal it
  is positive and can overflow. Returns ``[..., C, C]`` for ``G = 1`` and
  ``[..., C, C, K]`` for ``G = K``.
  """
  diff = g_x[..., :, None, :] - g_y[..., None, :, :]
  diff = jnp.where(mask[:, :, None], diff, -jnp.inf)
  e = jnp.exp(diff)
  return e[..., 0] if e.shape[-1] == 1 else e


def decayed_scores(x, y, g_x, g_y, *, strict: bool) -> jax.Array:
  """``A[i, j] = sum_k x[i, k] y[j, k] exp(g_x[i, k] - g_y[j, k])`` on the causal triangle.

  Args:
    x, y: ``[..., C, K]``.
    g_x, g_y: ``[..., C, G]`` cumulative log gates, ``G`` in ``{1, K}``.
    strict: keep ``j < i`` (the UT system) instead of ``j <= i`` (the output).

  Returns:
    ``[..., C, C]``. For a scalar gate this is ``Gamma * (x y^T)``; for a
    per-channel gate every exponent is taken per element and is ``<= 0``, so
    strong KDA gates neither overflow nor need a reference point.
  """
  e = decay_ratio(g_x, g_y, causal_mask(x.shape[-2], strict=strict))
  if g_x.shape[-1] == 1:
    return jnp.einsum("...ik,...jk->...ij", x, y) * e
  return jnp.einsum("...ik,...jk,...ijk->...ij", x, y, e)


def decayed_scores_vjp(d_scores, x, y, g_x, g_y, *, strict: bool):
  """Cotangents of :func:`decayed_scores`.

  Returns ``(dx, dy, dg_x, dg_y)``, all ``[..., C, K]``; the gate cotangents
  are per channel (``x * dx`` and ``-y * dy``) and are summed over ``K`` by
  :func:`reduce_gate` when the gate is scalar.
  """
  e = decay_ratio(g_x, g_y, causal_mask(x.shape[-2], strict=strict))
  if g_x.shape[-1] == 1:
    d = d_scores * e
    dx = jnp.einsum("...ij,...jk->...ik", d, y)
    dy = jnp.einsum("...ij,...ik->...jk", d, x)
  else:
    dx = jnp.einsum("...ij,...jk,...ijk->...ik", d_scores, y, e)
    dy = jnp.einsum("...ij,...ik,...ijk->...jk", d_scores, x, e)
  return dx, dy, x * dx, -y * dy


def reduce_gate(dg: jax.Array, gate_width: int) -> jax.Array:
  """Sums a per-channel gate cotangent ``[..., K]`` to ``[..., G]``."""
  if gate_width == 1:
    return jnp.sum(dg, axis=-1, keepdims=True)
  return dg


def token_step(state, q, k, v, a, b):
  """One token of the gated delta rule (the KDA seed's five lines).

  Args:
    state: ``[..., K, V]`` (the seeds' ``S^T``).
    q, k: ``[..., K]``, ``q`` already scaled.
    v: ``[..., V]``.
    a: ``[..., G]`` log decay, ``G`` in ``{1, K}``.
    b: ``[...]`` write strength beta.

  Returns:
    ``(new_state, o)`` with ``o`` ``[..., V]``. Decay, then predict, then
    correct: the prediction reads the already decayed state.
  """
  state = state * jnp.exp(a)[..., :, None]
  prediction = jnp.einsum("...kv,...k->...v", state, k)
  residual = b[..., None] * (v - prediction)
  state = state + k[..., :, None] * residual[..., None, :]
  o = jnp.einsum("...k,...kv->...v", q, state)
  return state, o


IMPLEMENTATION_DOC = """{summary}

  Args:
    q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; any float dtypes.
    a: ``[B, T, H, G]`` log decay, ``G`` in ``{{1, K}}``{gates}; b: ``[B, T, H]``.
    initial_state: ``[B, H, K, V]`` in the compute dtype.
    scale: multiplies q. chunk_size: C; divides T.

  Returns:
    ``(o, final_state)``: ``[B, T, H, V]`` in v's dtype, ``[B, H, K, V]``.
  """


def implementation(forward, backward, *, summary: str, gates: str = ""):
  """Builds an implementation ``f(q, k, v, a, b, initial_state, scale, chunk_size)``.

  Every implementation has the signature and contract of
  :data:`IMPLEMENTATION_DOC` and a ``jax.custom_vjp``:

  * ``forward(q, k, v, a, b, initial_state, scale, chunk_size)`` returns
    ``((o, final_state), saved)``;
  * ``backward(scale, chunk_size, inputs, saved, (d_o, d_final))`` returns
    the cotangents of the six array inputs, in their dtypes.
  """

  def f(q, k, v, a, b, initial_state, scale, chunk_size):
    return forward(q, k, v, a, b, initial_state, scale, chunk_size)[0]

  f.__doc__ = IMPLEMENTATION_DOC.format(summary=summary, gates=gates)
  f = jax.custom_vjp(f, nondiff_argnums=(6, 7))

  def fwd(*args):
    outputs, saved = forward(*args)
    return outputs, (args[:6], saved)

  def bwd(scale, chunk_size, residuals, cotangents):
    inputs, saved = residuals
    return backward(scale, chunk_size, inputs, saved, cotangents)

  f.defvjp(fwd, bwd)
  return f
