"""Flax NNX layers: Gated DeltaNet, Kimi Delta Attention and DeltaNet.

The three layers are one implementation, :class:`DeltaRuleLayer`, and differ
only in the shape of the decay gate ``a``:

* :class:`GatedDeltaNet`: one decay per head, ``a`` ``[B, T, H]``.
* :class:`KimiDeltaAttention`: one decay per head and key channel, ``a``
  ``[B, T, H, K]``.
* :class:`DeltaNet`: no decay, ``a = 0``.

Each follows the Gated DeltaNet paper and fla's layers::

    q, k, v = silu(causal depthwise conv(x W_qkv))   # short convolution
    q, k    = l2_normalize(q), l2_normalize(k)       # per head
    beta    = sigmoid(x W_b)                         # [B, T, HV]
    a       = -exp(A_log) * softplus(x W_a + dt_bias)
    o       = gated_delta(q, k, v, a, beta)
    y       = (RMSNorm(o) * silu(x W_g)) W_o

q and k have H heads; v, beta, the gate and the state have ``HV = G H``
(``num_v_heads``, grouped value heads as in Qwen3-Next), value head ``j``
reading q/k head ``j // G``. A ``mask`` ``[B, T]`` marks padding (False):
padded tokens are zeroed before the projections, leave the state unchanged
and give zero outputs. ``segment_ids`` ``[B, T]`` packs several sequences in
one row: the state and the convolution window restart where the id changes.

Training calls ``layer(x)``; decoding carries a :class:`DeltaCache`::

    cache = layer.init_cache(batch_size)
    y, cache = layer(prompt, cache=cache)     # prefill
    y, cache = layer(token, cache=cache)      # one token at a time

This module needs flax (``pip install deltajax[nn]``) and is not imported by
``import deltajax``; use ``import deltajax.nn``.
"""

from __future__ import annotations

import math
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from deltajax import api
from deltajax import common

__all__ = ["CHUNK_SIZES", "DeltaCache", "DeltaNet", "DeltaRuleLayer",
           "GatedDeltaNet", "GatedDeltaNet2", "KimiDeltaAttention", "OUTPUT_GATES", "a_log_init",
           "causal_depthwise_conv", "conv_kernel_init", "dt_bias_init",
           "l2_normalize"]


CHUNK_SIZES = (16, 32, 64)
OUTPUT_GATES = ("silu", "sigmoid")


class DeltaCache(NamedTuple):
  """What a layer carries from one call to the next while decoding.

  Attributes:
    conv: ``[B, conv_size - 1, 2 H K + HV V]``, the last ``conv_size - 1``
      q, k, v projections before the short convolution, in the layer's dtype.
    state: ``[B, HV, K, V]``, the recurrent state: float32, or the dtype
      given to :meth:`DeltaRuleLayer.init_cache` (bfloat16 halves it, at a
      relative error near 4e-3: docs/accuracy.md), kept from call to call
      and computed in float32.
  """
  conv: jax.Array
  state: jax.Array


def causal_depthwise_conv(x: jax.Array, kernel: jax.Array, history: jax.Array,
                          segment_ids: jax.Array | None = None
                          ) -> tuple[jax.Array, jax.Array]:
  """Causal depthwise convolution of ``x`` continued from ``history``.

  Args:
    x: ``[B, T, C]``.
    kernel: ``[W, C]``; ``kernel[-1]`` weighs the current token.
    history: ``[B, W - 1, C]``, the inputs before ``x`` (zeros at the start).
    segment_ids: optional ``[B, T]``; a token's window then holds only the
      tokens of its own segment (``history`` counts as the first token's).

  Returns:
    ``(y, new_history)``: ``[B, T, C]`` and the last ``W - 1`` inputs
    ``[B, W - 1, C]``.
  """
  width, t = kernel.shape[0], x.shape[1]
  padded = jnp.concatenate([history.astype(x.dtype), x], axis=1)
  if segment_ids is not None:
    # Segments are numbered, not compared by id: an id that comes back after
    # another one starts a new segment, as it does for the state.
    segments = jnp.cumsum(common.segment_starts(segment_ids), axis=1)
    padded_segments = jnp.pad(segments, ((0, 0), (width - 1, 0)))

  def tap(i):
    """The inputs ``W - 1 - i`` tokens back, zero across a segment start."""
    window = padded[:, i:i + t]
    if segment_ids is None:
      return window
    same = padded_segments[:, i:i + t] == segments
    return jnp.where(same[..., None], window, 0)

  y = sum(tap(i) * kernel[i] for i in range(width))
  return y, padded[:, padded.shape[1] - (width - 1):]


def l2_normalize(x: jax.Array, eps: float = 1e-6, *,
                 divide: bool = False) -> jax.Array:
  """``x * rsqrt(sum(x^2) + eps)`` over the last axis, computed in float32.

  ``divide=True`` computes ``x / sqrt(sum(x^2) + eps)`` instead (the same up
  to rounding; Kimi Linear's form in transformers).
  """
  x32 = x.astype(jnp.float32)
  sum_sq = jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps
  out = x32 / jnp.sqrt(sum_sq) if divide else x32 * jax.lax.rsqrt(sum_sq)
  return out.astype(x.dtype)


def a_log_init(key, shape, dtype=jnp.float32):
  """``A_log = log(A)``, ``A ~ Uniform(1, 16)``: Mamba-2's range, kept by fla."""
  a = jax.random.uniform(key, shape, jnp.float32, minval=1.0, maxval=16.0)
  return jnp.log(a).astype(dtype)


def dt_bias_init(key, shape, dtype=jnp.float32, *, dt_min=1e-3, dt_max=0.1,
                 dt_floor=1e-4):
  """``dt_bias = softplus^-1(dt)``, ``dt`` log-uniform in ``[dt_min, dt_max]``.

  So that at initialisation ``softplus(dt_bias)`` is a time step between 0.001
  and 0.1, as in Mamba-2 and the Gated DeltaNet paper.
  """
  u = jax.random.uniform(key, shape, jnp.float32)
  dt = jnp.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
  dt = jnp.maximum(dt, dt_floor)
  return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)


def conv_kernel_init(key, shape, dtype=jnp.float32):
  """``Uniform(-1/sqrt(W), 1/sqrt(W))`` for a ``[W, C]`` depthwise kernel (PyTorch's Conv1d default)."""
  bound = shape[0] ** -0.5
  return jax.random.uniform(key, shape, jnp.float32, -bound, bound).astype(dtype)


# The API's check of an int option: a TypeError for a bool (``True`` is no
# count) or a non-integer, naming the option.
_static_int = api._static_int  # pylint: disable=protected-access


def _positive_int(name: str, value) -> int:
  """``value`` as an int (:func:`_static_int`); a ValueError below 1."""
  value = _static_int(name, value)
  if value < 1:
    raise ValueError(f"{name} must be a positive integer; got {value!r}")
  return value


class DeltaRuleLayer(nnx.Module):
  """The gated delta rule token mixer; subclasses fix the gate's shape.

  Args:
    d_model: width of the input and output ``[B, T, d_model]``.
    num_heads: H, the q/k heads.
    rngs: ``nnx.Rngs`` for the parameters.
    num_v_heads: HV, the value heads (and those of beta, the gate and the
      state), a multiple of H; defaults to H. Value head ``j`` reads q/k head
      ``j // (HV / H)``.
    head_dim: K, the q/k width per head; defaults to ``d_model // num_heads``.
    value_head_dim: V, the value width per head; defaults to ``head_dim``.
    conv_size: width of the short causal convolution over q, k and v.
    allow_neg_eigval: ``beta = 2 sigmoid(.)`` in ``(0, 2)`` instead of
      ``(0, 1)``, which lets the transition have negative eigenvalues.
    norm_eps: epsilon of the output RMSNorm.
    gate_rank: computes the gate's ``x W_a`` through a rank-``gate_rank``
      bottleneck, two projections ``(x W_a1) W_a2`` (Kimi Linear's
      ``f_a``, ``f_b``); None: one projection.
    output_gate_rank: the same for the output gate's ``x W_g``.
    output_gate: "silu" (Gated DeltaNet) or "sigmoid" (Kimi Linear), the
      activation of the output gate.
    l2_divide: normalise q and k as ``x / sqrt(sum x^2 + eps)`` rather than
      ``x * rsqrt(sum x^2 + eps)`` (see :func:`l2_normalize`).
    impl, chunk_size: passed to :func:`deltajax.gated_delta`; ``chunk_size``
      is 16, 32 or 64.
    dtype: dtype of the activations (e.g. ``jnp.bfloat16``); q and k after
      normalisation, the gates, the output norm and the recurrent state are
      float32 whatever it is.
    param_dtype: dtype of the parameters.
  """

  gate: ClassVar[str]  # "head", "channel", "gdn2" or "none"

  def __init__(self, d_model: int, num_heads: int, *, rngs: nnx.Rngs,
               num_v_heads: int | None = None, head_dim: int | None = None,
               value_head_dim: int | None = None, conv_size: int = 4,
               allow_neg_eigval: bool = False, norm_eps: float = 1e-5,
               gate_rank: int | None = None,
               output_gate_rank: int | None = None, output_gate: str = "silu",
               l2_divide: bool = False, impl: str = "auto",
               chunk_size: int = 64, dtype=jnp.float32,
               param_dtype=jnp.float32):
    d_model = _positive_int("d_model", d_model)
    num_heads = _positive_int("num_heads", num_heads)
    num_v_heads = _positive_int(
        "num_v_heads", num_heads if num_v_heads is None else num_v_heads)
    if num_v_heads % num_heads:
      raise ValueError(f"num_v_heads={num_v_heads} must be a multiple of "
                       f"num_heads={num_heads}")
    if head_dim is None:
      if d_model % num_heads:
        raise ValueError(f"d_model={d_model} is not divisible by num_heads="
                         f"{num_heads}; pass head_dim")
      head_dim = d_model // num_heads
    head_dim = _positive_int("head_dim", head_dim)
    value_head_dim = _positive_int("value_head_dim", head_dim
                                   if value_head_dim is None
                                   else value_head_dim)
    gate_rank, output_gate_rank = (
        None if value is None else _positive_int(name, value)
        for name, value in (("gate_rank", gate_rank),
                            ("output_gate_rank", output_gate_rank)))
    conv_size = _positive_int("conv_size", conv_size)
    if impl not in api.IMPLEMENTATIONS:
      raise ValueError(f"impl must be one of {api.IMPLEMENTATIONS}; got "
                       f"{impl!r}")
    chunk_size = _static_int("chunk_size", chunk_size)
    if chunk_size not in CHUNK_SIZES:
      raise ValueError(f"chunk_size must be one of {CHUNK_SIZES}; got "
                       f"{chunk_size!r}")
    if output_gate not in OUTPUT_GATES:
      raise ValueError(f"output_gate must be one of {OUTPUT_GATES}; got "
                       f"{output_gate!r}")
    self.d_model = d_model
    self.num_heads = num_heads
    self.num_v_heads = num_v_heads
    self.head_dim = head_dim
    self.value_head_dim = value_head_dim
    self.conv_size = conv_size
    self.allow_neg_eigval = allow_neg_eigval
    self.output_gate = output_gate
    self.l2_divide = l2_divide
    self.impl = impl
    self.chunk_size = chunk_size
    self.dtype = dtype

    hv, dk, dv = num_v_heads, head_dim, value_head_dim
    def linear(n_in, n_out):
      return nnx.Linear(n_in, n_out, use_bias=False, dtype=dtype,
                        param_dtype=param_dtype, rngs=rngs)

    def projection(n_in, n_out, rank):
      if rank is None:
        return linear(n_in, n_out)
      return nnx.Sequential(linear(n_in, rank), linear(rank, n_out))

    self.qkv_proj = linear(d_model, self._qkv_width)
    self.conv_kernel = nnx.Param(conv_kernel_init(
        rngs.params(), (conv_size, self._qkv_width), param_dtype))
    # beta, or Gated DeltaNet-2's erase gate (per key channel) and write
    # gate (per value channel).
    self.b_proj = linear(d_model, hv * (dk if self.gate == "gdn2" else 1))
    if self.gate == "gdn2":
      self.w_proj = linear(d_model, hv * dv)
    gate_width = {"head": 1, "channel": dk, "gdn2": dk, "none": 0}[self.gate]
    if gate_width:
      self.a_proj = projection(d_model, hv * gate_width, gate_rank)
      self.A_log = nnx.Param(a_log_init(rngs.params(), (hv,), param_dtype))
      gate_shape = (hv,) if gate_width == 1 else (hv, gate_width)
      self.dt_bias = nnx.Param(dt_bias_init(rngs.params(), gate_shape,
                                            param_dtype))
    self.g_proj = projection(d_model, hv * dv, output_gate_rank)
    self.o_norm = nnx.RMSNorm(dv, epsilon=norm_eps, dtype=jnp.float32,
                              param_dtype=param_dtype, rngs=rngs)
    self.o_proj = linear(hv * dv, d_model)

  def init_cache(self, batch_size: int, state_dtype=jnp.float32
                 ) -> DeltaCache:
    """An empty :class:`DeltaCache`: no tokens seen yet; its state in
    ``state_dtype`` (float32, or bfloat16 to halve it)."""
    batch_size = _positive_int("batch_size", batch_size)
    if not jnp.issubdtype(state_dtype, jnp.floating):
      raise TypeError(f"state_dtype must be a floating-point dtype; got "
                      f"{state_dtype!r}")
    return DeltaCache(
        conv=self._empty_history(batch_size),
        state=jnp.zeros(self._state_shape(batch_size), state_dtype))

  @property
  def _qkv_width(self) -> int:
    """``2 H K + HV V``: the channels of the q, k, v projection and convolution."""
    return (2 * self.num_heads * self.head_dim
            + self.num_v_heads * self.value_head_dim)

  def _state_shape(self, batch_size: int) -> tuple[int, ...]:
    """``(B, HV, K, V)``."""
    return (batch_size, self.num_v_heads, self.head_dim, self.value_head_dim)

  def _empty_history(self, batch_size: int) -> jax.Array:
    """Zeros ``[B, conv_size - 1, 2 H K + HV V]``: the convolution's left padding."""
    return jnp.zeros((batch_size, self.conv_size - 1, self._qkv_width),
                     self.dtype)

  def __call__(self, x: jax.Array, *, cache: DeltaCache | None = None,
               mask: jax.Array | None = None,
               segment_ids: jax.Array | None = None,
               state_indices: jax.Array | None = None):
    """Mixes the tokens of ``x`` ``[B, T, d_model]``.

    Args:
      x: ``[B, T, d_model]``.
      cache: a :class:`DeltaCache` to continue from (decoding), or None.
      mask: optional bool ``[B, T]``, False at padding tokens: they are
        zeroed before the projections (so the convolution does not see
        them), leave the state unchanged and give zero outputs.
      segment_ids: optional integer ``[B, T]`` for packed sequences: the
        state and the convolution window restart where the id changes. Not
        with ``cache``.
      state_indices: optional integer ``[B]``, with ``cache``: the cache is
        a pool of P sequences (:meth:`init_cache` ``(P)``) and row ``i``
        continues the one in slot ``state_indices[i]`` (its convolution
        history and state) and writes it back; a negative index is a
        padding row, which leaves the pool as it is and outputs zeros. A
        slot may be named once (as in :func:`deltajax.gated_delta_step`,
        which a single token runs on the pool). Jit the caller with the
        pool donated and XLA updates it in place.

    Returns:
      ``y`` ``[B, T, d_model]`` in the layer's dtype; with ``cache``,
      ``(y, new_cache)``, continuing the sequences that ``cache`` holds
      (with ``state_indices``, the new pool).
    """
    x, mask, segment_ids, state_indices = (
        None if z is None else jnp.asarray(z)
        for z in (x, mask, segment_ids, state_indices))
    self._check_call(x, cache, mask, segment_ids, state_indices)
    bsz, t, _ = x.shape
    if mask is not None:
      x = jnp.where(mask[..., None], x, 0)
    if cache is None:
      history = self._empty_history(bsz)
    elif state_indices is None:
      history = cache.conv
    else:
      history = common.pool_rows(cache.conv, state_indices)
    qkv, history = causal_depthwise_conv(
        self.qkv_proj(x), self.conv_kernel[...].astype(self.dtype), history,
        segment_ids)
    q, k, v = self._split_heads(nnx.silu(qkv))
    # Normalised in float32 and handed to the rule in the layer's dtype (the
    # kernels' dots run in it, as fla's layers do).
    q, k = (l2_normalize(z, divide=self.l2_divide) for z in (q, k))
    beta = self._write_strength(x)
    a = self.log_decay(x)
    if mask is not None:
      masked = lambda z: jnp.where(mask.reshape(bsz, t, *(1,) * (z.ndim - 2)),
                                   z, 0.0)
      a, beta = masked(a), jax.tree.map(masked, beta)
    if cache is None:
      o = self._rule(q, k, v, a, beta, segment_ids=segment_ids)
    else:
      o, state = self._continue(cache.state, q, k, v, a, beta, state_indices)
    y = self.o_proj(self._gated_norm(o, x).reshape(bsz, t, -1))
    if mask is not None:
      y = jnp.where(mask[..., None], y, 0)
    if cache is None:
      return y
    if state_indices is None:
      return y, DeltaCache(history, state.astype(cache.state.dtype))
    return (common.zero_padding_rows(y, state_indices),
            DeltaCache(common.with_pool_rows(cache.conv, state_indices,
                                             history), state))

  def _check_call(self, x, cache, mask, segment_ids, state_indices) -> None:
    """Raises ``ValueError``/``TypeError`` for arguments of the wrong shape or dtype."""
    if x.ndim != 3 or x.shape[-1] != self.d_model:
      raise ValueError(f"x must have shape [B, T, d_model] with d_model="
                       f"{self.d_model}; got {tuple(x.shape)}")
    bsz, t, _ = x.shape
    if state_indices is not None:
      if cache is None:
        raise ValueError("state_indices names the slots of a cache pool; "
                         "pass the pool as cache")
      if (tuple(state_indices.shape) != (bsz,)
          or not jnp.issubdtype(state_indices.dtype, jnp.integer)):
        raise ValueError(f"state_indices must be an integer array of shape "
                         f"[B] = {(bsz,)}; got {state_indices.dtype} "
                         f"{tuple(state_indices.shape)}")
    if cache is not None:
      rows = bsz if state_indices is None else cache.state.shape[0]
      expected = DeltaCache((rows, self.conv_size - 1, self._qkv_width),
                            self._state_shape(rows))
      got = DeltaCache(*(tuple(c.shape) for c in cache))
      if got != expected or not rows:
        n, what = (("B", f"for x of batch size {bsz}")
                   if state_indices is None else
                   ("P", "for a pool of P >= 1 sequences"))
        raise ValueError(f"cache must have conv [{n}, conv_size - 1, 2 H K "
                         f"+ HV V] = {expected.conv} and state [{n}, HV, K, "
                         f"V] = {expected.state} {what} (see init_cache); "
                         f"got conv {got.conv}, state {got.state}")
      if state_indices is not None:
        api.check_slot_values(state_indices, rows)
    for name, value, kind, what in (
        ("mask", mask, jnp.bool_, "bool"),
        ("segment_ids", segment_ids, jnp.integer, "an integer dtype")):
      if value is None:
        continue
      if tuple(value.shape) != (bsz, t):
        raise ValueError(f"{name} must have shape [B, T] = {(bsz, t)}; got "
                         f"{tuple(value.shape)}")
      if not jnp.issubdtype(value.dtype, kind):
        raise TypeError(f"{name} must have {what}; got dtype {value.dtype}")
    if segment_ids is not None and cache is not None:
      raise ValueError("segment_ids (packed sequences) cannot be combined "
                       "with cache; decode each sequence in its own row")

  def log_decay(self, x: jax.Array) -> jax.Array:
    """``a = -exp(A_log) softplus(x W_a + dt_bias)``, float32.

    ``[B, T, HV]`` for a per-head gate (zeros without one), ``[B, T, HV, K]``
    for a per-channel gate (KDA's, Gated DeltaNet-2's).
    """
    bsz, t, _ = x.shape
    if self.gate == "none":
      return jnp.zeros((bsz, t, self.num_v_heads), jnp.float32)
    z = self.a_proj(x).astype(jnp.float32)
    z = z.reshape(bsz, t, *self.dt_bias.shape) + self.dt_bias[...]
    rate = jnp.exp(self.A_log[...].astype(jnp.float32))
    if self.gate != "head":
      rate = rate[:, None]
    return -rate * jax.nn.softplus(z)

  def _write_strength(self, x: jax.Array):
    """beta ``= sigmoid(x W_b)`` ``[B, T, HV]`` (doubled with
    ``allow_neg_eigval``); for Gated DeltaNet-2 the pair ``(erase [B, T, HV,
    K], write [B, T, HV, V])``, sigmoids of ``x W_b`` and ``x W_w`` (the
    erase gate doubled with ``allow_neg_eigval``). float32."""
    bsz, t, _ = x.shape
    beta = nnx.sigmoid(self.b_proj(x).astype(jnp.float32))
    if self.allow_neg_eigval:
      beta = 2.0 * beta
    if self.gate != "gdn2":
      return beta
    write = nnx.sigmoid(self.w_proj(x).astype(jnp.float32))
    return (beta.reshape(bsz, t, self.num_v_heads, self.head_dim),
            write.reshape(bsz, t, self.num_v_heads, self.value_head_dim))

  def _gated_norm(self, o: jax.Array, x: jax.Array) -> jax.Array:
    """``RMSNorm(o) * act(x W_g)`` per value head, in float32; ``[B, T, HV, V]`` in the layer's dtype."""
    gate = self.g_proj(x).reshape(o.shape).astype(jnp.float32)
    act = nnx.silu if self.output_gate == "silu" else nnx.sigmoid
    return (self.o_norm(o.astype(jnp.float32)) * act(gate)).astype(self.dtype)

  def _split_heads(self, qkv: jax.Array):
    """``[B, T, 2 H K + HV V]`` -> q, k ``[B, T, H, K]`` and v ``[B, T, HV, V]``."""
    bsz, t, _ = qkv.shape
    width = self.num_heads * self.head_dim
    q, k, v = jnp.split(qkv, [width, 2 * width], axis=-1)
    return (q.reshape(bsz, t, self.num_heads, self.head_dim),
            k.reshape(bsz, t, self.num_heads, self.head_dim),
            v.reshape(bsz, t, self.num_v_heads, self.value_head_dim))

  def _rule(self, q, k, v, a, beta, **options):
    """:func:`deltajax.gated_delta` (:func:`deltajax.gdn2` for the pair of
    gates) with the layer's ``impl`` and ``chunk_size``."""
    options = dict(impl=self.impl, chunk_size=self.chunk_size, **options)
    if isinstance(beta, tuple):
      return api.gdn2(q, k, v, a, *beta, **options)
    return api.gated_delta(q, k, v, a, beta, **options)

  def _continue(self, state, q, k, v, a, beta, state_indices):
    """Runs the rule from ``state`` (with ``state_indices``, from a pool's
    slots); one token takes :func:`deltajax.gated_delta_step`.

    Returns ``(o [B, T, HV, V], final_state [B, HV, K, V])``, or with
    ``state_indices`` the new pool in place of the final state.
    """
    if q.shape[1] == 1:
      erase, write = beta if isinstance(beta, tuple) else (beta, None)
      o, state = api.gated_delta_step(
          state, q[:, 0], k[:, 0], v[:, 0], a[:, 0], erase[:, 0],
          w=None if write is None else write[:, 0],
          state_indices=state_indices)
      return o[:, None], state
    if state_indices is None:
      return self._rule(q, k, v, a, beta, initial_state=state,
                        return_final_state=True)
    o, rows = self._rule(q, k, v, a, beta,
                         initial_state=common.pool_rows(state, state_indices),
                         return_final_state=True)
    return o, common.with_pool_rows(state, state_indices, rows)


class GatedDeltaNet(DeltaRuleLayer):
  """Gated DeltaNet (Yang et al., 2024): one decay per head, ``a`` ``[B, T, H]``.

  ``GatedDeltaNet(d_model, num_heads, rngs=rngs, **options)``; the options
  are those of :class:`DeltaRuleLayer`.
  """
  gate = "head"


class KimiDeltaAttention(DeltaRuleLayer):
  """Kimi Delta Attention: one decay per head and key channel, ``a`` ``[B, T, H, K]``.

  ``KimiDeltaAttention(d_model, num_heads, rngs=rngs, **options)``; the
  options are those of :class:`DeltaRuleLayer`. The same computation as
  :func:`deltajax.kda`.
  """
  gate = "channel"


class GatedDeltaNet2(DeltaRuleLayer):
  """Gated DeltaNet-2 (Hatamizadeh, Choi & Kautz, 2026): KDA's per-channel
  decay, with beta split into an erase gate ``sigmoid(x W_b)`` per key
  channel ``[B, T, HV, K]`` and a write gate ``sigmoid(x W_w)`` per value
  channel ``[B, T, HV, V]``.

  ``GatedDeltaNet2(d_model, num_heads, rngs=rngs, **options)``; the options
  are those of :class:`DeltaRuleLayer`. The same computation as
  :func:`deltajax.gdn2`.
  """
  gate = "gdn2"


class DeltaNet(DeltaRuleLayer):
  """DeltaNet (Schlag et al., 2021; Yang et al., 2024): the delta rule without decay, ``a = 0``.

  ``DeltaNet(d_model, num_heads, rngs=rngs, **options)``; the options are
  those of :class:`DeltaRuleLayer`.
  """
  gate = "none"
