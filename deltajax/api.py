"""Public API: input checks, the normalisation every implementation relies on, dispatch.

``gated_delta`` validates the user's arguments (shapes, dtypes and a
concrete ``cu_seqlens`` on the host; values, inside :func:`value_checks`, by
checkify debug checks in the compiled program), applies the fused options
(q/k L2 norm, the gate from ``A_log``/``dt_bias``, beta from logits), turns
``segment_ids`` into cuts and ``cu_seqlens`` into a chunk-aligned layout,
pads T, and calls the implementation that :func:`registry.select` picks, in
the contract :data:`registry.CONTRACT`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import numbers

import jax
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np

from deltajax import common
from deltajax import registry
from deltajax.pallas import step as pallas_step

IMPLEMENTATIONS = registry.IMPLEMENTATIONS
STEP_IMPLEMENTATIONS = ("auto", "jnp", "pallas")  # of gated_delta_step

LOG_DECAY_FLOOR = common.LOG_DECAY_FLOOR  # a = -inf is clamped here
L2_EPS = 1e-6

_FORMS = ("the accepted forms are q, k [B, T, H, K], v [B, T, HV, V], "
          "a [B, T, HV] or [B, T, HV, K], b [B, T, HV], initial_state "
          "[B, HV, K, V] (HV a multiple of H); or, for one sequence of one "
          "head (as under vmap), q, k [T, K], v [T, V], a [T] or [T, K], "
          "b [T], initial_state [K, V]")


def _check_float(name: str, x) -> None:
  if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
    raise TypeError(f"{name} must be a floating-point array; got dtype "
                    f"{jnp.result_type(x)}")


def _check_shape(name: str, x, expected: tuple, what: str) -> None:
  if tuple(x.shape) != tuple(expected):
    raise ValueError(f"{name} must have shape {what} = {tuple(expected)}; "
                     f"got {tuple(x.shape)}")


def _check_int(name: str, x, shape: tuple, what: str) -> None:
  if not jnp.issubdtype(jnp.result_type(x), jnp.integer):
    raise TypeError(f"{name} must be an integer array; got dtype "
                    f"{jnp.result_type(x)}")
  _check_shape(name, x, shape, what)


def _check_inputs(q, k, v, a, b, initial_state, *, require_per_channel,
                  n_states, w=None):
  """Validates the rank-4 form; returns the gate kind ("head", "channel", or
  "gdn2" with the write gate ``w``)."""
  for name, x in (("q", q), ("k", k), ("v", v), ("a", a), ("b", b),
                  ("w", w)):
    if x is not None:
      _check_float(name, x)
  if q.ndim != 4:
    raise ValueError(f"q has rank {q.ndim} (shape {tuple(q.shape)}); {_FORMS}")
  bsz, t, h, dk = q.shape
  _check_shape("k", k, q.shape, "q.shape [B, T, H, K]")
  if v.ndim != 4 or tuple(v.shape[:2]) != (bsz, t) or (h and v.shape[2] % h):
    raise ValueError(f"v must have shape [B, T, HV, V] with B, T = "
                     f"{(bsz, t)} from q and HV a multiple of H = {h}; got "
                     f"{tuple(v.shape)}")
  if 0 in (t, h, dk, *v.shape[2:]):
    raise ValueError(f"T, H, HV, K and V must be positive; got q "
                     f"{tuple(q.shape)}, v {tuple(v.shape)}")
  hv = v.shape[2]
  per_channel = tuple(a.shape) == (bsz, t, hv, dk)
  if require_per_channel and not per_channel:
    raise ValueError(f"{'gdn2' if w is not None else 'kda'} needs the "
                     f"per-channel gate: a must have shape [B, T, HV, K] = "
                     f"{(bsz, t, hv, dk)}; got {tuple(a.shape)}")
  if not per_channel and tuple(a.shape) != (bsz, t, hv):
    raise ValueError(f"a must have shape [B, T, HV] = {(bsz, t, hv)} (scalar "
                     f"gate) or [B, T, HV, K] = {(bsz, t, hv, dk)} "
                     f"(per-channel gate); got {tuple(a.shape)}")
  if w is None:
    _check_shape("b", b, (bsz, t, hv), "[B, T, HV]")
  else:
    _check_shape("b", b, (bsz, t, hv, dk), "[B, T, HV, K] (the erase gate)")
    _check_shape("w", w, (bsz, t, hv, v.shape[-1]),
                 "[B, T, HV, V] (the write gate)")
  if initial_state is not None:
    _check_float("initial_state", initial_state)
    _check_shape("initial_state", initial_state, (n_states, hv, dk, v.shape[-1]),
                 "[N, HV, K, V] (N = B, or the number of sequences of "
                 "cu_seqlens)")
  if w is not None:
    return "gdn2"
  return "channel" if per_channel else "head"


def _broken_rule(name: str, rule: str, index, value) -> str:
  """The message for element ``index`` of ``name``, ``value``, which breaks ``rule``."""
  return f"{name} {rule}; got {name}[{index}] = {value}"


def _cu_seqlens_rule(total: int) -> str:
  return f"must start at 0, be non-decreasing and end at T = {total}"


def _cu_seqlens_faults(cu_seqlens, total: int, xp):
  """Bool ``[N + 1]``: where ``cu_seqlens`` breaks :func:`_cu_seqlens_rule`.

  ``xp`` is numpy for a concrete ``cu_seqlens``, jax.numpy for a traced one.
  """
  faults = xp.concatenate([cu_seqlens[:1] != 0,
                           cu_seqlens[1:] < cu_seqlens[:-1]])
  last = xp.arange(cu_seqlens.shape[0]) == cu_seqlens.shape[0] - 1
  return faults | (last & (cu_seqlens != total))


def _check_cu_seqlens_values(cu_seqlens, total: int) -> None:
  """Raises ``ValueError`` at the first bad element of a concrete ``cu_seqlens``.

  A traced one (under ``jit``) cannot be read here; :func:`_debug_check_values`
  checks it inside :func:`value_checks`.
  """
  if isinstance(cu_seqlens, jax.core.Tracer):
    return
  cu_seqlens = np.asarray(cu_seqlens)
  faults = _cu_seqlens_faults(cu_seqlens, total, np)
  if faults.any():
    i = int(np.argmax(faults))
    raise ValueError(_broken_rule("cu_seqlens", _cu_seqlens_rule(total), i,
                                  cu_seqlens[i]))


def _slots_rule(pool_size: int) -> str:
  return (f"must be below the pool size P = {pool_size} and name each slot "
          f"at most once (a negative index is a padding row)")


def _slot_faults(state_indices, pool_size: int, xp):
  """Bool ``[B]``: where ``state_indices`` breaks :func:`_slots_rule`: an
  index past the pool, or a slot that an earlier row names.

  ``xp`` is numpy for concrete indices, jax.numpy for traced ones.
  """
  earlier = xp.tril(state_indices[:, None] == state_indices[None, :], -1)
  repeated = earlier.any(axis=1) & (state_indices >= 0)
  return (state_indices >= pool_size) | repeated


def check_slot_values(state_indices, pool_size: int) -> None:
  """Raises ``ValueError`` at the first bad element of concrete ``state_indices``
  (traced ones: inside :func:`value_checks`); the layers' pools
  (:mod:`deltajax.nn`) too."""
  if isinstance(state_indices, jax.core.Tracer):
    return
  state_indices = np.asarray(state_indices)
  faults = _slot_faults(state_indices, pool_size, np)
  if faults.any():
    i = int(np.argmax(faults))
    raise ValueError(_broken_rule("state_indices", _slots_rule(pool_size), i,
                                  state_indices[i]))


_VALUE_CHECKS = contextvars.ContextVar("deltajax_value_checks",
                                       default=False)


@contextlib.contextmanager
def value_checks(enabled: bool = True):
  """Calls traced inside it check their inputs' values in the compiled program.

  The checks are ``checkify.debug_check`` s (q, k, v and the state finite,
  ``a <= 0``, b in range, a traced ``cu_seqlens`` well formed); run the
  function under ``checkify.checkify(..., errors=checkify.user_checks)`` to
  get their error. Off by default: a check is a JAX effect, and a jitted
  function with an effect leaves JAX's fast dispatch path (more host time
  per call: benchmarks/RESULTS.md). ``jit`` caches traces: jit the function
  afresh inside the block (or one not yet called).
  """
  token = _VALUE_CHECKS.set(enabled)
  try:
    yield
  finally:
    _VALUE_CHECKS.reset(token)


def _debug_check(name: str, x, ok, rule: str) -> None:
  """A ``checkify.debug_check`` that ``ok`` (bool, x's shape) holds everywhere.

  A no-op unless the caller is functionalised by ``checkify.checkify`` (with
  ``errors=checkify.user_checks``); then the error names the first element of
  ``x`` that breaks ``rule``, by index and value.
  """
  index = jnp.unravel_index(jnp.argmin(ok), ok.shape)
  template = _broken_rule(name, rule, ", ".join(["{}"] * ok.ndim), "{}")
  checkify.debug_check(jnp.all(ok), template, *index, x[index])


def _debug_check_values(finite: dict, a, b, *, cu_seqlens=None, A_log=None,
                        dt_bias=None, beta_sigmoid=False,
                        allow_neg_eigval=False, state_indices=None,
                        pool_size=None) -> None:
  """The inputs' values as :func:`_debug_check` s, inside :func:`value_checks`.

  Args:
    finite: ``{name: array or None}``, arrays that must be finite (q, k, v
      and the state).
    a: the log decay, ``<= 0`` (``-inf`` forgets fully); with ``A_log`` the
      gate input, which like ``A_log`` and ``dt_bias`` must not be NaN.
    b: beta in ``[0, 2]``, so ``[0, 1]`` when ``allow_neg_eigval`` doubles
      it; with ``beta_sigmoid`` logits, not NaN; or Gated DeltaNet-2's
      ``(b, w)``, both in ``[0, 2]``.
    cu_seqlens: None, or ``[N + 1]``: starts at 0, non-decreasing, ends at
      T, ``a.shape[1]``.
    state_indices: None, or the ``[B]`` slots of a pool of ``pool_size``
      states (:func:`_slots_rule`).
  """
  checks = [(name, x, jnp.isfinite(x), "must be finite")
            for name, x in finite.items() if x is not None]
  if A_log is None:
    checks.append(("a", a, a <= 0,
                   "must be <= 0 (a log decay; -inf forgets fully)"))
  else:
    checks += [(name, x, ~jnp.isnan(x), "must not be NaN")
               for name, x in (("a", a), ("A_log", A_log),
                               ("dt_bias", dt_bias)) if x is not None]
  if isinstance(b, tuple):  # Gated DeltaNet-2's erase and write gates
    checks += [(name, x, (x >= 0) & (x <= 2), "must be in [0, 2]")
               for name, x in zip(("b", "w"), b)]
  elif beta_sigmoid:
    checks.append(("b", b, ~jnp.isnan(b), "must not be NaN"))
  elif allow_neg_eigval:
    checks.append(("b", b, (b >= 0) & (b <= 1),
                   "must be in [0, 1] (allow_neg_eigval doubles it)"))
  else:
    checks.append(("b", b, (b >= 0) & (b <= 2), "must be in [0, 2]"))
  if cu_seqlens is not None:
    total = a.shape[1]
    checks.append(("cu_seqlens", cu_seqlens,
                   ~_cu_seqlens_faults(cu_seqlens, total, jnp),
                   _cu_seqlens_rule(total)))
  if state_indices is not None:
    checks.append(("state_indices", state_indices,
                   ~_slot_faults(state_indices, pool_size, jnp),
                   _slots_rule(pool_size)))
  for name, x, ok, rule in checks:
    _debug_check(name, x, ok, rule)


def _check_gate_parameters(a, A_log, dt_bias, gate: str) -> None:
  hv, dk = a.shape[2], a.shape[-1]
  if A_log is not None:
    _check_float("A_log", A_log)
    _check_shape("A_log", A_log, (hv,), "[HV]")
  if dt_bias is not None:
    _check_float("dt_bias", dt_bias)
    shape = (hv,) if gate == "head" else (hv, dk)
    _check_shape("dt_bias", dt_bias, shape,
                 "[HV]" if gate == "head" else "[HV, K]")


def _static_int(name: str, x) -> int:
  if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral):
    raise TypeError(f"{name} must be an int; got {type(x).__name__} {x!r}")
  return int(x)


def _check_scale(scale, head_dim: int) -> float:
  """``scale`` as a Python float; ``K ** -0.5`` for None."""
  if scale is None:
    return float(head_dim ** -0.5)
  if isinstance(scale, (bool, np.bool_)) or not isinstance(scale,
                                                           numbers.Real):
    raise TypeError(f"scale must be a Python or numpy real number or None; "
                    f"got {type(scale).__name__} {scale!r}")
  if not math.isfinite(scale):
    raise ValueError(f"scale must be finite; got {scale}")
  return float(scale)


def _check_options(impl: str, chunk_size) -> int:
  """Returns ``chunk_size`` as a Python int."""
  if impl not in IMPLEMENTATIONS:
    raise ValueError(f"impl must be one of {IMPLEMENTATIONS}; got {impl!r}")
  chunk_size = _static_int("chunk_size", chunk_size)
  if chunk_size not in registry.CHUNK_SIZES:
    raise ValueError(f"chunk_size must be a power of two up to "
                     f"{registry.CHUNK_SIZES[-1]} (16, 32 or 64 for every "
                     f"implementation); got {chunk_size}")
  return chunk_size


def _to_rank4(q, k, v, a, b, initial_state, w=None):
  """Adds unit batch and head axes to the rank-2 single-head form."""
  if k.ndim != 2 or v.ndim != 2:
    raise ValueError(f"q has rank 2, so k and v must be [T, K] and [T, V]; got "
                     f"k {tuple(k.shape)}, v {tuple(v.shape)}; {_FORMS}")
  if w is not None and (a.ndim, b.ndim, w.ndim) != (2, 2, 2):
    raise ValueError(f"for q of rank 2, gdn2's a and b must be [T, K] and w "
                     f"[T, V]; got a {tuple(a.shape)}, b {tuple(b.shape)}, w "
                     f"{tuple(w.shape)}")
  if w is None and (a.ndim not in (1, 2) or b.ndim != 1):
    raise ValueError(f"for q of rank 2, a must be [T] or [T, K] and b [T]; got "
                     f"a {tuple(a.shape)}, b {tuple(b.shape)}; {_FORMS}")
  q, k, v = (x[None, :, None, :] for x in (q, k, v))
  a = a[None, :, None] if a.ndim == 1 else a[None, :, None, :]
  b = b[None, :, None] if b.ndim == 1 else b[None, :, None, :]
  if initial_state is not None:
    if initial_state.ndim != 2:
      raise ValueError(f"for q of rank 2, initial_state must be [K, V]; got "
                       f"{tuple(initial_state.shape)}")
    initial_state = initial_state[None, None]
  return q, k, v, a, b, initial_state, None if w is None else w[None, :, None]


def l2_normalize(x: jax.Array, eps: float = L2_EPS) -> jax.Array:
  """``x / sqrt(sum(x^2) + eps)`` over the last axis, computed in float32."""
  x32 = x.astype(common.compute_dtype(x))
  return (x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, -1, keepdims=True) + eps)
          ).astype(x.dtype)


def _fused_inputs(q, k, a, b, *, use_qk_l2norm, A_log, dt_bias, beta_sigmoid,
                  allow_neg_eigval, dtype):
  """Applies the fused options (fla's names) in the compute dtype.

  Returns ``(q, k, a, b)``: ``a = -exp(A_log) softplus(a + dt_bias)`` when
  ``A_log`` is given, ``b = sigmoid(b)`` for ``beta_sigmoid``, doubled for
  ``allow_neg_eigval``.
  """
  if use_qk_l2norm:
    q, k = l2_normalize(q), l2_normalize(k)
  a = a.astype(dtype)
  if A_log is not None:
    if dt_bias is not None:
      a = a + dt_bias.astype(dtype)
    rate = jnp.exp(A_log.astype(dtype))
    a = -(rate if a.ndim == 3 else rate[:, None]) * jax.nn.softplus(a)
  b = jax.tree.map(lambda x: x.astype(dtype), b)
  if beta_sigmoid:
    b = jax.nn.sigmoid(b)
  if allow_neg_eigval:
    b = 2.0 * b
  return q, k, a, b


def _segment_cuts(segment_ids: jax.Array, like: jax.Array) -> jax.Array:
  """Bool of ``like``'s shape ``[B, T, HV, W]``: tokens where the segment id changes."""
  cut = common.segment_starts(segment_ids)
  return jnp.broadcast_to(cut[:, :, None, None], like.shape)


@functools.partial(jax.jit, static_argnames=("scale", "impl", "chunk_size",
                                             "use_qk_l2norm", "beta_sigmoid",
                                             "allow_neg_eigval",
                                             "check_values", "config"))
def _run(q, k, v, a, b, initial_state, segment_ids, cu_seqlens, A_log, dt_bias,
         *, scale, impl, chunk_size, use_qk_l2norm, beta_sigmoid,
         allow_neg_eigval, check_values, config):
  """Normalises the inputs into :data:`registry.CONTRACT` and runs ``impl``
  (with ``config``, where it takes one); ``check_values``:
  :func:`value_checks` was on (static: a trace cached without the checks
  is not reused with them)."""
  if check_values:
    _debug_check_values(dict(q=q, k=k, v=v, initial_state=initial_state), a,
                        b, cu_seqlens=cu_seqlens, A_log=A_log,
                        dt_bias=dt_bias, beta_sigmoid=beta_sigmoid,
                        allow_neg_eigval=allow_neg_eigval)
  dtype = common.compute_dtype(q, k, v)
  q, k, a, b = _fused_inputs(
      q, k, a, b, use_qk_l2norm=use_qk_l2norm, A_log=A_log, dt_bias=dt_bias,
      beta_sigmoid=beta_sigmoid, allow_neg_eigval=allow_neg_eigval,
      dtype=dtype)
  if a.ndim == 3:
    a = a[..., None]
  bsz, t, _, dk = q.shape
  hv, dv = v.shape[2:]
  n_states = bsz if cu_seqlens is None else cu_seqlens.shape[0] - 1
  if initial_state is None:
    # zeros_like keeps the inputs' sharding (and, inside shard_map, the
    # device-varying type that lax.scan's carry must match).
    initial_state = jnp.zeros_like(v, dtype, shape=(n_states, hv, dk, dv))
  initial_state = initial_state.astype(dtype)
  cut = None if segment_ids is None else _segment_cuts(segment_ids, a)
  if isinstance(b, tuple):
    gate = "gdn2"
  else:
    gate = "head" if a.shape[-1] == 1 else "channel"
  chosen = registry.select(
      impl, gate=gate, length=t,
      chunk_size=chunk_size, packed=segment_ids is not None
      or cu_seqlens is not None, grouped=hv != q.shape[2],
      wide=jnp.dtype(jnp.result_type(q, k, v)).itemsize >= 4,
      head_dim=max(dk, dv), config=config)
  call = functools.partial(chosen.fn, scale=scale, chunk_size=chunk_size,
                           **({} if chosen.config is None
                              else dict(config=config)))
  if cu_seqlens is None:
    padded = common.round_up(t, chunk_size)
    q, k, v, a, b, cut = jax.tree.map(lambda x: common.pad_axis(x, 1, padded),
                                      (q, k, v, a, b, cut))
    o, final_state = call(q, k, v, a, b, initial_state, cut, None)
    return o[:, :t], final_state
  layout = common.chunk_layout(cu_seqlens, t, chunk_size)
  q, k, v, a, b = jax.tree.map(lambda x: common.to_layout(x, layout),
                               (q, k, v, a, b))
  o, final_state = call(q, k, v, a, b, initial_state, None, layout.chunk_seq)
  final_state = jnp.where(layout.empty[:, None, None, None], initial_state,
                          final_state)
  return common.from_layout(o, layout), final_state


def gated_delta(q, k, v, a, b, *, scale=None, initial_state=None,
                return_final_state=False, segment_ids=None, cu_seqlens=None,
                use_qk_l2norm=False, A_log=None, dt_bias=None,
                beta_sigmoid=False, allow_neg_eigval=False, impl="auto",
                chunk_size=64, config=None):
  """Gated delta rule linear attention (Gated DeltaNet; KDA with a per-channel gate).

  For each token, with the state ``S`` of shape ``[K, V]``::

      S <- S * exp(a_t)                       # per row for a per-channel gate
      S <- S + k_t (b_t (v_t - S^T k_t))^T    # the delta rule
      o_t = S^T (scale * q_t)

  Args:
    q, k: ``[B, T, H, K]``.
    v: ``[B, T, HV, V]``; ``HV = G H`` grouped value heads (value head ``j``
      reads query/key head ``j // G``); usually ``HV = H``.
    a: log decay ``log(alpha) <= 0``: ``[B, T, HV]`` (Gated DeltaNet) or
      ``[B, T, HV, K]`` (KDA). ``a = 0`` is DeltaNet, ``a = -inf`` forgets
      the state fully. With ``A_log``, the raw gate input instead.
    b: write strength beta, ``[B, T, HV]``, in ``[0, 2]``; not clamped. With
      ``beta_sigmoid``, logits.
    scale: multiplies q; defaults to ``K ** -0.5``.
    initial_state: ``[B, HV, K, V]`` (``[N, HV, K, V]`` with ``cu_seqlens``)
      or None (zeros).
    return_final_state: also return the final state, of initial_state's shape.
    segment_ids: integer ``[B, T]`` (packed documents, as in JAX attention):
      the state restarts from zero wherever the id changes along a row; the
      first segment of a row starts from ``initial_state``. Any integers:
      an id that comes back after another one starts a new segment.
    cu_seqlens: integer ``[N + 1]`` (fla's packed sequences, ``B = 1``):
      sequence ``n`` is tokens ``[cu_seqlens[n], cu_seqlens[n + 1])``, with
      ``cu_seqlens[0] = 0``, non-decreasing, and ``cu_seqlens[N] = T``. A
      concrete one (numpy, a list, a jax array) is checked here: a
      ``ValueError`` names its first bad element. It may be traced (under
      ``jit``); then only the value checks see it (below); unchecked, a
      bad one gives garbage outputs (never out-of-bounds memory accesses).
    use_qk_l2norm: L2-normalise q and k (eps 1e-6), gradients through it.
    A_log: ``[HV]``; then ``a = -exp(A_log) softplus(a + dt_bias)``.
    dt_bias: ``[HV]`` (``[HV, K]`` for KDA), used with ``A_log``.
    beta_sigmoid: ``b`` are logits, beta ``= sigmoid(b)``.
    allow_neg_eigval: beta is doubled (``2 sigmoid(b)`` with ``beta_sigmoid``).
    impl: "scan", "chunked", "pallas", "mosaic" or "auto"
      (:func:`registry.select`).
    chunk_size: tokens per chunk, 16, 32 or 64.
    config: None (every implementation's defaults), or the tuning config
      of the implementation that is to run it: ``deltajax.pallas.Config``
      (launch knobs) for "pallas", ``deltajax.mosaic.Config`` for
      "mosaic" ("scan" and "chunked" take none). A config picks its
      implementation: with ``impl="auto"`` that implementation runs the
      call (a ``ValueError`` if it cannot); with a named ``impl`` it must
      be that implementation's (else a ``TypeError``). Frozen dataclasses,
      validated when built, static under ``jit``.

  The rank-2 form ``q, k [T, K]``, ``v [T, V]``, ``a [T]`` or ``[T, K]``,
  ``b [T]``, ``initial_state [K, V]`` (one sequence of one head) is accepted
  too, which is what the function sees under ``jax.vmap``.

  Traced inside :func:`value_checks`, values are checked by
  ``checkify.debug_check`` s (q, k, v, initial_state finite, ``a <= 0``,
  beta in ``[0, 2]``, a traced ``cu_seqlens``); under
  ``checkify.checkify(f, errors=checkify.user_checks)`` the error names the
  argument and its first bad element (indices of the rank-4 form).

  Returns:
    ``o`` ``[B, T, HV, V]`` in v's dtype, or ``(o, final_state)`` with the
    state in float32 (float64 for float64 inputs).
  """
  return _gated_delta(**locals(), require_per_channel=False)


def kda(q, k, v, a, b, *, scale=None, initial_state=None,
        return_final_state=False, segment_ids=None, cu_seqlens=None,
        use_qk_l2norm=False, A_log=None, dt_bias=None, beta_sigmoid=False,
        allow_neg_eigval=False, impl="auto", chunk_size=64, config=None):
  """Kimi Delta Attention: :func:`gated_delta` with a per-channel gate ``a`` ``[B, T, HV, K]``."""
  return _gated_delta(**locals(), require_per_channel=True)


def gdn2(q, k, v, a, b, w, *, scale=None, initial_state=None,
         return_final_state=False, segment_ids=None, cu_seqlens=None,
         use_qk_l2norm=False, A_log=None, dt_bias=None, impl="auto",
         chunk_size=64, config=None):
  """Gated DeltaNet-2: KDA's per-channel decay with channel-wise erase and
  write gates in place of beta.

  For each token, with the state ``S`` of shape ``[K, V]``::

      S <- S * exp(a_t)                              # per row
      S <- S + k_t (w_t * v_t - S^T (b_t * k_t))^T   # erase, then write
      o_t = S^T (scale * q_t)

  (the paper's ``S_t = (I - k (b * k)^T) Diag(exp a) S + k (w * v)^T``).
  With ``b`` and ``w`` both beta it is :func:`kda`.

  Args:
    q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]`` (grouped value heads as in
      :func:`gated_delta`).
    a: per-channel log decay ``[B, T, HV, K]`` (with ``A_log``, the gate
      input, as in :func:`kda`).
    b: erase gate ``[B, T, HV, K]``, in ``[0, 2]`` (usually a sigmoid).
    w: write gate ``[B, T, HV, V]``, in ``[0, 2]``.
    The other arguments as in :func:`gated_delta`; the rank-2 form takes
    ``a, b [T, K]``, ``w [T, V]``.

  Implementations: "scan", "chunked" and "pallas"; ``impl="auto"`` picks
  "pallas" on NVIDIA GPUs of compute capability >= 8.0, else "scan" or
  "chunked" (:func:`registry.select`).

  Returns:
    ``o`` ``[B, T, HV, V]`` in v's dtype, or ``(o, final_state)``.
  """
  return _gated_delta(q, k, v, a, b, w=w, scale=scale,
                      initial_state=initial_state,
                      return_final_state=return_final_state,
                      segment_ids=segment_ids, cu_seqlens=cu_seqlens,
                      use_qk_l2norm=use_qk_l2norm, A_log=A_log,
                      dt_bias=dt_bias, beta_sigmoid=False,
                      allow_neg_eigval=False, impl=impl,
                      chunk_size=chunk_size, config=config,
                      require_per_channel=True)


def _gated_delta(q, k, v, a, b, *, scale, initial_state, return_final_state,
                 segment_ids, cu_seqlens, use_qk_l2norm, A_log, dt_bias,
                 beta_sigmoid, allow_neg_eigval, impl, chunk_size, config,
                 require_per_channel, w=None):
  q, k, v, a, b = (jnp.asarray(x) for x in (q, k, v, a, b))
  w = None if w is None else jnp.asarray(w)
  chunk_size = _check_options(impl, chunk_size)
  registry.config_owner(impl, config)  # a TypeError before tracing
  single_head = q.ndim == 2
  if single_head:
    if segment_ids is not None or cu_seqlens is not None:
      raise ValueError("segment_ids and cu_seqlens need the rank-4 form "
                       "q [B, T, H, K]")
    q, k, v, a, b, initial_state, w = _to_rank4(q, k, v, a, b, initial_state,
                                                w)
  if segment_ids is not None and cu_seqlens is not None:
    raise ValueError("pass segment_ids or cu_seqlens, not both")
  n_states = q.shape[0] if q.ndim == 4 else 1
  if cu_seqlens is not None:
    cu_seqlens = jnp.asarray(cu_seqlens)
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
      raise ValueError(f"cu_seqlens must have shape [N + 1] with N >= 1; got "
                       f"{tuple(cu_seqlens.shape)}")
    _check_int("cu_seqlens", cu_seqlens, cu_seqlens.shape, "[N + 1]")
    if q.shape[0] != 1:
      raise ValueError(f"with cu_seqlens, q must have batch size 1 (packed "
                       f"[1, T_total, H, K]); got {tuple(q.shape)}")
    _check_cu_seqlens_values(cu_seqlens, q.shape[1])
    n_states = cu_seqlens.shape[0] - 1
  if segment_ids is not None:
    segment_ids = jnp.asarray(segment_ids)
    _check_int("segment_ids", segment_ids, q.shape[:2], "[B, T]")
  if initial_state is not None:
    initial_state = jnp.asarray(initial_state)
  gate = _check_inputs(q, k, v, a, b, initial_state,
                       require_per_channel=require_per_channel,
                       n_states=n_states, w=w)
  A_log, dt_bias = (None if x is None else jnp.asarray(x)
                    for x in (A_log, dt_bias))
  _check_gate_parameters(a, A_log, dt_bias, gate)
  if dt_bias is not None and A_log is None:
    raise ValueError("dt_bias needs A_log (a = -exp(A_log) softplus(a + "
                     "dt_bias))")
  scale = _check_scale(scale, q.shape[-1])
  o, final_state = _run(
      q, k, v, a, b if w is None else (b, w), initial_state, segment_ids,
      cu_seqlens, A_log, dt_bias,
      scale=scale, impl=impl, chunk_size=chunk_size,
      use_qk_l2norm=bool(use_qk_l2norm), beta_sigmoid=bool(beta_sigmoid),
      allow_neg_eigval=bool(allow_neg_eigval),
      check_values=_VALUE_CHECKS.get(), config=config)
  if single_head:
    o, final_state = o[0, :, 0], final_state[0, 0]
  return (o, final_state) if return_final_state else o


def _check_state(state, state_indices, shape: tuple, name="state") -> None:
  """Checks ``state`` ``[B, HV, K, V]`` = ``shape`` or, with ``state_indices``
  ``[B]``, a pool ``[P, HV, K, V]`` and the slots its rows take."""
  _check_float(name, state)
  if state_indices is None:
    _check_shape(name, state, shape, "[B, HV, K, V]")
    return
  _check_int("state_indices", state_indices, shape[:1], "[B]")
  if (state.ndim != 4 or tuple(state.shape[1:]) != tuple(shape[1:])
      or not state.shape[0]):
    raise ValueError(f"with state_indices, {name} must be a pool of shape "
                     f"[P, HV, K, V] with P >= 1 and HV, K, V = "
                     f"{tuple(shape[1:])}; got {tuple(state.shape)}")
  check_slot_values(state_indices, state.shape[0])


def gated_delta_step(state, q, k, v, a, b, *, w=None, state_indices=None,
                     scale=None, impl="auto"):
  """One decoding step of the gated delta rule (or of Gated DeltaNet-2).

  Args:
    state: ``[B, HV, K, V]``; with ``state_indices``, a pool of states
      ``[P, HV, K, V]``.
    q, k: ``[B, H, K]``; v: ``[B, HV, V]`` (``HV = G H``, value head ``j``
      reads query/key head ``j // G``).
    a: ``[B, HV]`` (scalar gate) or ``[B, HV, K]`` (per-channel gate).
    b: ``[B, HV]``; with ``w``, Gated DeltaNet-2's erase gate ``[B, HV, K]``.
    w: None, or Gated DeltaNet-2's write gate ``[B, HV, V]`` (then a is per
      channel; :func:`gdn2`).
    state_indices: None, or integer ``[B]``: row ``i`` reads and writes the
      pool's slot ``state_indices[i]``; a negative index is a padding row,
      which leaves the pool as it is and outputs zeros. A slot may be named
      once; concrete indices are checked here (a ``ValueError`` names the
      first repeated or out-of-range one), traced ones (under ``jit``) only
      inside :func:`value_checks`; unchecked, a repeated slot gets one of
      its rows' states (with ``impl="pallas"``, whichever row writes last).
      Jit the caller with the pool donated (``donate_argnums``) and XLA
      updates it in place: the compiled step then holds no pool-sized
      buffer beyond the donated one (checked with
      ``compiled.memory_analysis()``, tests/test_step.py).
    scale: defaults to ``K ** -0.5``.
    impl: "jnp", "pallas" (one kernel, :mod:`deltajax.pallas.step`; Pallas
      interpret mode off the GPU) or "auto", the kernel on NVIDIA GPUs
      from Ampere on (faster than "jnp" in a jitted loop on an H100,
      benchmarks/RESULTS.md) and "jnp" elsewhere. "jnp" gathers a pool's B slots, steps them and
      scatters them back; the kernel reads and writes each row's slot in
      the pool itself, in the state's dtype. Gradients go through the jnp
      step.

  The state is computed in float32 (float64 for float64 inputs) whatever
  its dtype. Values are checked inside :func:`value_checks`, as in
  :func:`gated_delta` (the state of the slots read, and ``state_indices``).

  Returns:
    ``(o, new_state)``: ``o`` ``[B, HV, V]`` in v's dtype; the new state
    ``[B, HV, K, V]`` in float32 (float64 for float64 inputs), or in the
    state's dtype for a 16-bit (bfloat16, float16) state; or the new pool,
    in the pool's dtype.
  """
  state, q, k, v, a, b = (jnp.asarray(x) for x in (state, q, k, v, a, b))
  w, state_indices = (None if x is None else jnp.asarray(x)
                      for x in (w, state_indices))
  for name, x in (("q", q), ("k", k), ("v", v), ("a", a), ("b", b),
                  ("w", w)):
    if x is not None:
      _check_float(name, x)
  if q.ndim != 3:
    raise ValueError(f"q must have shape [B, H, K]; got {tuple(q.shape)}")
  bsz, h, dk = q.shape
  _check_shape("k", k, q.shape, "q.shape [B, H, K]")
  if v.ndim != 3 or v.shape[0] != bsz or (h and v.shape[1] % h):
    raise ValueError(f"v must have shape [B, HV, V] with B = {bsz} and HV a "
                     f"multiple of H = {h}; got {tuple(v.shape)}")
  if 0 in (h, dk, *v.shape[1:]):
    raise ValueError(f"H, HV, K and V must be positive; got q "
                     f"{tuple(q.shape)}, v {tuple(v.shape)}")
  hv = v.shape[1]
  if tuple(a.shape) not in ((bsz, hv), (bsz, hv, dk)):
    raise ValueError(f"a must have shape [B, HV] = {(bsz, hv)} or [B, HV, K] "
                     f"= {(bsz, hv, dk)}; got {tuple(a.shape)}")
  _check_state(state, state_indices, (bsz, hv, dk, v.shape[-1]))
  scale = _check_scale(scale, dk)
  impl = _step_impl(impl)
  if w is None:
    _check_shape("b", b, (bsz, hv), "[B, HV]")
  else:
    _check_shape("a", a, (bsz, hv, dk), "[B, HV, K] (gdn2's per-channel gate)")
    _check_shape("b", b, (bsz, hv, dk), "[B, HV, K] (the erase gate)")
    _check_shape("w", w, v.shape, "[B, HV, V] (the write gate)")
    b = (b, w)
  return _step(state, q, k, v, a, b, state_indices, scale=scale, impl=impl,
               check_values=_VALUE_CHECKS.get())


def gated_delta_verify(state, q, k, v, a, b, *, w=None, state_indices=None,
                       scale=None, impl="auto"):
  """T tokens from one state per row, with the state after each token: the
  verification step of speculative decoding.

  Runs :func:`gated_delta_step`'s step over the T draft tokens of each row
  and returns every intermediate state, so that the caller keeps the state
  after the last accepted token without computing it again. The pool is
  read, not written: which tokens are accepted depends on ``o``, so the
  caller commits afterwards with :func:`gated_delta_commit` (FlashInfer's
  ``gated_delta_rule_mtp`` keeps its intermediate states in a cache indexed
  by slot for the same reason).

  Args:
    state: ``[B, HV, K, V]``, or with ``state_indices`` a pool
      ``[P, HV, K, V]``.
    q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``.
    a: ``[B, T, HV]`` or ``[B, T, HV, K]``; b: ``[B, T, HV]``, or with ``w``
      Gated DeltaNet-2's erase gate ``[B, T, HV, K]``.
    w: None, or Gated DeltaNet-2's write gate ``[B, T, HV, V]``.
    state_indices: None, or integer ``[B]``, as in :func:`gated_delta_step`:
      row ``i`` starts from slot ``state_indices[i]``; a padding row
      (negative) gives zero outputs and states.
    scale, impl: as in :func:`gated_delta_step`; "pallas" runs the T
      tokens in one kernel (:func:`deltajax.pallas.step.gated_delta_verify_pallas`:
      each state read once), "jnp" loops over them; gradients go through
      the jnp loop.

  Returns:
    ``(o, states)``: ``o`` ``[B, T, HV, V]`` in v's dtype and ``states``
    ``[B, T, HV, K, V]``, ``states[:, t]`` the state after token ``t``, in
    the dtype :func:`gated_delta_step` returns its new state in (the pool's,
    with ``state_indices``). Between tokens the state stays in float32
    (float64 for float64 inputs).
  """
  state, q, k, v, a, b = (jnp.asarray(x) for x in (state, q, k, v, a, b))
  w, state_indices = (None if x is None else jnp.asarray(x)
                      for x in (w, state_indices))
  if q.ndim != 4:
    raise ValueError(f"q must have shape [B, T, H, K]; got "
                     f"{tuple(q.shape)}")
  _check_inputs(q, k, v, a, b, None, require_per_channel=w is not None,
                n_states=q.shape[0], w=w)
  bsz, _, _, dk = q.shape
  _check_state(state, state_indices, (bsz, v.shape[2], dk, v.shape[3]))
  scale = _check_scale(scale, dk)
  impl = _step_impl(impl)
  return _verify(state, q, k, v, a, b if w is None else (b, w), state_indices,
                 scale=scale, impl=impl, check_values=_VALUE_CHECKS.get())


def gated_delta_commit(pool, states, state_indices, accepted):
  """Writes the state after each row's last accepted token into its pool slot.

  Args:
    pool: ``[P, HV, K, V]``.
    states: ``[B, T, HV, K, V]``, from :func:`gated_delta_verify`.
    state_indices: integer ``[B]``, the slots ``states`` started from; a
      negative index is a padding row, which writes nothing.
    accepted: integer ``[B]`` in ``[0, T]``, the tokens accepted per row:
      slot ``state_indices[i]`` gets ``states[i, accepted[i] - 1]``; 0
      leaves it as it is. Concrete values are checked here, traced ones
      inside :func:`value_checks`.

  Returns:
    The new pool, in the pool's dtype: a gather of B states and a scatter,
    in place when the caller's jit donates the pool.
  """
  pool, states, state_indices, accepted = (
      jnp.asarray(x) for x in (pool, states, state_indices, accepted))
  _check_float("states", states)
  if states.ndim != 5 or 0 in states.shape:
    raise ValueError(f"states must have shape [B, T, HV, K, V]; got "
                     f"{tuple(states.shape)}")
  bsz, t = states.shape[:2]
  _check_state(pool, state_indices, (bsz, *states.shape[2:]), name="pool")
  _check_int("accepted", accepted, (bsz,), "[B]")
  if not isinstance(accepted, jax.core.Tracer):
    values = np.asarray(accepted)
    bad = (values < 0) | (values > t)
    if bad.any():
      i = int(np.argmax(bad))
      raise ValueError(_broken_rule("accepted", _accepted_rule(t), i,
                                    values[i]))
  return _commit(pool, states, state_indices, accepted,
                 check_values=_VALUE_CHECKS.get())


def _accepted_rule(length: int) -> str:
  return f"must be in [0, T] = [0, {length}]"


def _step_impl(impl: str) -> str:
  """The step's implementation, "jnp" or "pallas", for ``impl``: "auto" is
  the kernel where it runs compiled (NVIDIA GPUs from Ampere on), else
  "jnp"."""
  if impl not in STEP_IMPLEMENTATIONS:
    raise ValueError(f"impl must be one of {STEP_IMPLEMENTATIONS} for "
                     f"gated_delta_step and gated_delta_verify; got "
                     f"{impl!r}")
  if impl != "auto":
    return impl
  return "pallas" if registry.REGISTRY["pallas"].runs_natively() else "jnp"


def _stored_dtype(state, dtype) -> jnp.dtype:
  """The dtype a new state (not a pool) comes back in: a 16-bit state's own,
  else the compute dtype ``dtype``."""
  return state.dtype if state.dtype.itemsize < 4 else jnp.dtype(dtype)


def _start(state, q, k, v, a, b, state_indices, check_values):
  """``(rows, stored)``: the rows' states in the compute dtype, and the dtype
  new states are returned in; the value checks inside :func:`value_checks`."""
  rows = (state if state_indices is None
          else common.pool_rows(state, state_indices))
  if check_values:  # as in _run
    _debug_check_values(dict(state=rows, q=q, k=k, v=v), a, b,
                        state_indices=state_indices,
                        pool_size=state.shape[0])
  dtype = common.compute_dtype(q, k, v)
  stored = state.dtype if state_indices is not None else _stored_dtype(
      state, dtype)
  return rows.astype(dtype), stored


@functools.partial(jax.jit,
                   static_argnames=("scale", "impl", "check_values"))
def _step(state, q, k, v, a, b, state_indices, *, scale, impl, check_values):
  """The step on the state, or on the pool's slots: the kernel reads and
  writes them in the stored dtype; the jnp step gathers and scatters."""
  rows, stored = _start(state, q, k, v, a, b, state_indices, check_values)
  step = _pallas_step if impl == "pallas" else _jnp_pool_step
  return step(state.astype(stored), q, k, v, a, b, state_indices, scale,
              rows.dtype)


@functools.partial(jax.jit,
                   static_argnames=("scale", "impl", "check_values"))
def _verify(state, q, k, v, a, b, state_indices, *, scale, impl,
            check_values):
  """The draft tokens in one kernel ("pallas"), or in a loop of the jnp
  step."""
  rows, stored = _start(state, q, k, v, a, b, state_indices, check_values)
  verify = _pallas_verify if impl == "pallas" else _jnp_verify
  return verify(state, q, k, v, a, b, state_indices, scale, rows.dtype,
                stored)


def _jnp_verify(state, q, k, v, a, b, state_indices, scale, dtype, stored):
  """The tokens in a loop that writes each output and state into its
  ``[B, T, ...]`` buffer in place (a scan's stacked outputs would need a
  transpose of every state); the rows' states in the compute dtype
  ``dtype`` between tokens, returned in ``stored``."""
  rows = (state if state_indices is None
          else common.pool_rows(state, state_indices)).astype(dtype)
  bsz, t = q.shape[:2]
  tokens = (q, k, v, a, b)
  keep = ((lambda x: x) if state_indices is None
          else functools.partial(common.zero_padding_rows,
                                 state_indices=state_indices))

  def token(i, carry):
    rows, o, states = carry
    at = lambda x: jax.lax.dynamic_index_in_dim(x, i, 1, keepdims=False)
    o_i, rows = _jnp_step(rows, *jax.tree.map(at, tokens), scale)
    o = jax.lax.dynamic_update_index_in_dim(o, keep(o_i), i, 1)
    states = jax.lax.dynamic_update_index_in_dim(
        states, keep(rows).astype(stored), i, 1)
    return rows, o, states

  o = jnp.zeros_like(v)
  states = jnp.zeros((bsz, t, *rows.shape[1:]), stored)
  _, o, states = jax.lax.fori_loop(0, t, token, (rows, o, states))
  return o, states


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _pallas_verify(state, q, k, v, a, b, state_indices, scale, dtype, stored):
  """The verification kernel; its VJP is the jnp loop's (recomputed)."""
  return pallas_step.gated_delta_verify_pallas(
      state, q, k, v, a, b, scale=scale, state_indices=state_indices,
      dtype=dtype, states_dtype=stored)


def _pallas_verify_fwd(state, q, k, v, a, b, state_indices, scale, dtype,
                       stored):
  return (_pallas_verify(state, q, k, v, a, b, state_indices, scale, dtype,
                         stored), (state, q, k, v, a, b, state_indices))


def _pallas_verify_bwd(scale, dtype, stored, inputs, cotangents):
  _, pullback = jax.vjp(
      lambda *x: _jnp_verify(*x, scale, dtype, stored), *inputs)
  return pullback(cotangents)


_pallas_verify.defvjp(_pallas_verify_fwd, _pallas_verify_bwd)


@functools.partial(jax.jit, static_argnames=("check_values",))
def _commit(pool, states, state_indices, accepted, *, check_values):
  bsz, t = states.shape[:2]
  if check_values:
    _debug_check("state_indices", state_indices,
                 ~_slot_faults(state_indices, pool.shape[0], jnp),
                 _slots_rule(pool.shape[0]))
    _debug_check("accepted", accepted, (accepted >= 0) & (accepted <= t),
                 _accepted_rule(t))
  last = states[jnp.arange(bsz), jnp.maximum(accepted - 1, 0)]
  return common.with_pool_rows(
      pool, jnp.where(accepted > 0, state_indices, -1), last)


def _jnp_step(state, q, k, v, a, b, scale):
  """:func:`common.token_step` on repeated q/k heads; state in the compute dtype."""
  dtype = state.dtype
  groups = v.shape[1] // q.shape[1]
  q, k = (x if groups == 1 else jnp.repeat(x, groups, axis=1) for x in (q, k))
  a = common.floored(a.astype(dtype))
  a = a[..., None] if a.ndim == 2 else a
  new_state, o = common.token_step(
      state, q.astype(dtype) * scale, k.astype(dtype), v.astype(dtype), a,
      jax.tree.map(lambda x: x.astype(dtype), b))
  return o.astype(v.dtype), new_state


def _jnp_pool_step(state, q, k, v, a, b, state_indices, scale, dtype):
  """:func:`_jnp_step` on the state (in the compute dtype ``dtype``), or on
  the pool's slots between a gather and a scatter; the new state in the
  state's dtype."""
  rows = (state if state_indices is None
          else common.pool_rows(state, state_indices))
  o, rows = _jnp_step(rows.astype(dtype), q, k, v, a, b, scale)
  if state_indices is None:
    return o, rows.astype(state.dtype)
  return common.zero_padding_rows(o, state_indices), common.with_pool_rows(
      state, state_indices, rows)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _pallas_step(state, q, k, v, a, b, state_indices, scale, dtype):
  """The kernel's step; its VJP is the jnp step's (recomputed)."""
  return pallas_step.gated_delta_step_pallas(
      state, q, k, v, a, b, scale=scale, state_indices=state_indices,
      dtype=dtype)


def _pallas_step_fwd(state, q, k, v, a, b, state_indices, scale, dtype):
  return (_pallas_step(state, q, k, v, a, b, state_indices, scale, dtype),
          (state, q, k, v, a, b, state_indices))


def _pallas_step_bwd(scale, dtype, inputs, cotangents):
  _, pullback = jax.vjp(
      lambda *x: _jnp_pool_step(*x, scale, dtype), *inputs)
  return pullback(cotangents)


_pallas_step.defvjp(_pallas_step_fwd, _pallas_step_bwd)
