"""Public API: input checks, padding and dispatch over the implementations."""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from deltajax import chunked
from deltajax import common
from deltajax import pallas
from deltajax import scan

IMPLEMENTATIONS = ("auto", "scan", "chunked", "pallas")

_FORMS = ("the accepted forms are q, k [B, T, H, K], v [B, T, H, V], "
          "a [B, T, H] or [B, T, H, K], b [B, T, H], initial_state "
          "[B, H, K, V]; or, for one sequence of one head (as under vmap), "
          "q, k [T, K], v [T, V], a [T] or [T, K], b [T], initial_state [K, V]")


def _implementation(impl: str, per_channel: bool) -> Callable:
  """Maps an ``impl`` name to ``f(q, k, v, a, b, s0, scale, chunk_size)``.

  "auto" is the Pallas kernels on NVIDIA GPUs that Triton lowering supports
  (compute capability >= 8.0) for the scalar gate, else "chunked".
  """
  if impl == "auto":
    cc = pallas.gpu_capability()
    use_pallas = (not per_channel and cc is not None
                  and cc >= pallas.MIN_CAPABILITY)
    impl = "pallas" if use_pallas else "chunked"
  return {"scan": scan.gated_delta_scan,
          "chunked": chunked.gated_delta_chunked,
          "pallas": _pallas}[impl]


def _pallas(q, k, v, a, b, initial_state, scale, chunk_size):
  """The Pallas entry point (which also takes cuts and packed sequences)."""
  return pallas.gated_delta_pallas(q, k, v, a, b, initial_state, None, None,
                                   scale=scale, chunk_size=chunk_size)


def _check_float(name: str, x) -> None:
  if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
    raise TypeError(f"{name} must be a floating-point array; got dtype "
                    f"{jnp.result_type(x)}")


def _check_shape(name: str, x, expected: tuple, what: str) -> None:
  if tuple(x.shape) != tuple(expected):
    raise ValueError(f"{name} must have shape {what} = {tuple(expected)}; "
                     f"got {tuple(x.shape)}")


def _check_inputs(q, k, v, a, b, initial_state, *, require_per_channel: bool):
  """Validates the rank-4 form; returns whether the gate is per channel."""
  for name, x in (("q", q), ("k", k), ("v", v), ("a", a), ("b", b)):
    _check_float(name, x)
  if q.ndim != 4:
    raise ValueError(f"q has rank {q.ndim} (shape {tuple(q.shape)}); {_FORMS}")
  bsz, t, h, dk = q.shape
  _check_shape("k", k, q.shape, "q.shape [B, T, H, K]")
  if v.ndim != 4 or tuple(v.shape[:3]) != (bsz, t, h):
    raise ValueError(f"v must have shape [B, T, H, V] with B, T, H = "
                     f"{(bsz, t, h)} from q; got {tuple(v.shape)}")
  per_channel = tuple(a.shape) == tuple(q.shape)
  if require_per_channel and not per_channel:
    raise ValueError(f"kda needs the per-channel gate: a must have shape "
                     f"q.shape [B, T, H, K] = {tuple(q.shape)}; got "
                     f"{tuple(a.shape)}")
  if not per_channel and tuple(a.shape) != (bsz, t, h):
    raise ValueError(f"a must have shape [B, T, H] = {(bsz, t, h)} (scalar "
                     f"gate) or [B, T, H, K] = {tuple(q.shape)} (per-channel "
                     f"gate); got {tuple(a.shape)}")
  _check_shape("b", b, (bsz, t, h), "[B, T, H]")
  if initial_state is not None:
    _check_float("initial_state", initial_state)
    _check_shape("initial_state", initial_state, (bsz, h, dk, v.shape[-1]),
                 "[B, H, K, V]")
  if t == 0 or dk == 0 or v.shape[-1] == 0:
    raise ValueError(f"T, K and V must be positive; got q {tuple(q.shape)}, "
                     f"v {tuple(v.shape)}")
  return per_channel


def _check_options(scale, impl: str, chunk_size: int) -> None:
  if impl not in IMPLEMENTATIONS:
    raise ValueError(f"impl must be one of {IMPLEMENTATIONS}; got {impl!r}")
  if (not isinstance(chunk_size, int) or chunk_size < 1
      or chunk_size & (chunk_size - 1)):
    raise ValueError(f"chunk_size must be a power of two; got {chunk_size!r}")
  if scale is not None and not isinstance(scale, (int, float)):
    raise TypeError(f"scale must be a Python number or None; got "
                    f"{type(scale).__name__}")


def _to_rank4(q, k, v, a, b, initial_state):
  """Adds unit batch and head axes to the rank-2 single-head form."""
  if k.ndim != 2 or v.ndim != 2:
    raise ValueError(f"q has rank 2, so k and v must be [T, K] and [T, V]; got "
                     f"k {tuple(k.shape)}, v {tuple(v.shape)}; {_FORMS}")
  if a.ndim not in (1, 2) or b.ndim != 1:
    raise ValueError(f"for q of rank 2, a must be [T] or [T, K] and b [T]; got "
                     f"a {tuple(a.shape)}, b {tuple(b.shape)}; {_FORMS}")
  q, k, v = (x[None, :, None, :] for x in (q, k, v))
  a = a[None, :, None] if a.ndim == 1 else a[None, :, None, :]
  b = b[None, :, None]
  if initial_state is not None:
    if initial_state.ndim != 2:
      raise ValueError(f"for q of rank 2, initial_state must be [K, V]; got "
                       f"{tuple(initial_state.shape)}")
    initial_state = initial_state[None, None]
  return q, k, v, a, b, initial_state


@functools.partial(jax.jit, static_argnames=("scale", "impl", "chunk_size"))
def _run(q, k, v, a, b, initial_state, *, scale, impl, chunk_size):
  """Pads T to a multiple of ``chunk_size`` and calls the implementation.

  Padded tokens have ``a = 0`` and ``b = 0``: they leave the state unchanged.
  """
  dtype = common.compute_dtype(q, k, v)
  if initial_state is None:
    # zeros_like keeps the inputs' sharding (and, inside shard_map, the
    # device-varying type that lax.scan's carry must match).
    initial_state = jnp.zeros_like(
        q, dtype, shape=(q.shape[0], q.shape[2], q.shape[3], v.shape[3]))
  t = q.shape[1]
  padded = common.round_up(t, chunk_size)
  q, k, v, a, b = (common.pad_axis(x, 1, padded) for x in (q, k, v, a, b))
  per_channel = a.ndim == 4
  if not per_channel:
    a = a[..., None]
  o, final_state = _implementation(impl, per_channel)(q, k, v, a, b,
                                         initial_state.astype(dtype), scale,
                                         chunk_size)
  return o[:, :t], final_state


def gated_delta(q, k, v, a, b, *, scale=None, initial_state=None,
                return_final_state=False, impl="auto", chunk_size=64):
  """Gated delta rule linear attention (Gated DeltaNet; KDA with a per-channel gate).

  For each token, with the state ``S`` of shape ``[K, V]``::

      S <- S * exp(a_t)                       # per row for a per-channel gate
      S <- S + k_t (b_t (v_t - S^T k_t))^T    # the delta rule
      o_t = S^T (scale * q_t)

  Args:
    q, k: ``[B, T, H, K]``.
    v: ``[B, T, H, V]``.
    a: log decay ``log(alpha) <= 0``: ``[B, T, H]`` (Gated DeltaNet) or
      ``[B, T, H, K]`` (KDA). ``a = 0`` is DeltaNet.
    b: write strength beta, ``[B, T, H]``, in ``(0, 2)``; not clamped.
    scale: multiplies q; defaults to ``K ** -0.5``.
    initial_state: ``[B, H, K, V]`` or None (zeros).
    return_final_state: also return the final state ``[B, H, K, V]``.
    impl: "scan", "chunked", "pallas" or "auto" (the fastest for the platform).
    chunk_size: tokens per chunk, a power of two.

  The rank-2 form ``q, k [T, K]``, ``v [T, V]``, ``a [T]`` or ``[T, K]``,
  ``b [T]``, ``initial_state [K, V]`` (one sequence of one head) is accepted
  too, which is what the function sees under ``jax.vmap``.

  Returns:
    ``o`` ``[B, T, H, V]`` in v's dtype, or ``(o, final_state)`` with the
    state in float32 (float64 for float64 inputs).
  """
  return _gated_delta(q, k, v, a, b, scale=scale, initial_state=initial_state,
                      return_final_state=return_final_state, impl=impl,
                      chunk_size=chunk_size, require_per_channel=False)


def kda(q, k, v, a, b, *, scale=None, initial_state=None,
        return_final_state=False, impl="auto", chunk_size=64):
  """Kimi Delta Attention: :func:`gated_delta` with a per-channel gate ``a`` of q's shape."""
  return _gated_delta(q, k, v, a, b, scale=scale, initial_state=initial_state,
                      return_final_state=return_final_state, impl=impl,
                      chunk_size=chunk_size, require_per_channel=True)


def _gated_delta(q, k, v, a, b, *, scale, initial_state, return_final_state,
                 impl, chunk_size, require_per_channel):
  q, k, v, a, b = (jnp.asarray(x) for x in (q, k, v, a, b))
  _check_options(scale, impl, chunk_size)
  single_head = q.ndim == 2
  if single_head:
    q, k, v, a, b, initial_state = _to_rank4(q, k, v, a, b, initial_state)
  _check_inputs(q, k, v, a, b, initial_state,
                require_per_channel=require_per_channel)
  scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
  o, final_state = _run(q, k, v, a, b, initial_state, scale=scale, impl=impl,
                        chunk_size=chunk_size)
  if single_head:
    o, final_state = o[0, :, 0], final_state[0, 0]
  return (o, final_state) if return_final_state else o


def gated_delta_step(state, q, k, v, a, b, *, scale=None):
  """One decoding step of the gated delta rule.

  Args:
    state: ``[B, H, K, V]``.
    q, k: ``[B, H, K]``; v: ``[B, H, V]``.
    a: ``[B, H]`` (scalar gate) or ``[B, H, K]`` (per-channel gate).
    b: ``[B, H]``.
    scale: defaults to ``K ** -0.5``.

  Returns:
    ``(o, new_state)``: ``[B, H, V]`` in v's dtype and ``[B, H, K, V]``.
  """
  state, q, k, v, a, b = (jnp.asarray(x) for x in (state, q, k, v, a, b))
  for name, x in (("state", state), ("q", q), ("k", k), ("v", v), ("a", a),
                  ("b", b)):
    _check_float(name, x)
  if q.ndim != 3:
    raise ValueError(f"q must have shape [B, H, K]; got {tuple(q.shape)}")
  bsz, h, dk = q.shape
  _check_shape("k", k, q.shape, "q.shape [B, H, K]")
  if v.ndim != 3 or tuple(v.shape[:2]) != (bsz, h):
    raise ValueError(f"v must have shape [B, H, V] with B, H = {(bsz, h)}; got "
                     f"{tuple(v.shape)}")
  if tuple(a.shape) not in ((bsz, h), (bsz, h, dk)):
    raise ValueError(f"a must have shape [B, H] = {(bsz, h)} or [B, H, K] = "
                     f"{(bsz, h, dk)}; got {tuple(a.shape)}")
  _check_shape("b", b, (bsz, h), "[B, H]")
  _check_shape("state", state, (bsz, h, dk, v.shape[-1]), "[B, H, K, V]")
  scale = float(dk ** -0.5 if scale is None else scale)
  return _step(state, q, k, v, a, b, scale=scale)


@functools.partial(jax.jit, static_argnames=("scale",))
def _step(state, q, k, v, a, b, *, scale):
  dtype = common.compute_dtype(q, k, v)
  a = a[..., None] if a.ndim == 2 else a
  new_state, o = common.token_step(
      state.astype(dtype), q.astype(dtype) * scale, k.astype(dtype),
      v.astype(dtype), a.astype(dtype), b.astype(dtype))
  return o.astype(v.dtype), new_state
