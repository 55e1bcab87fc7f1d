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
    beta    = sigmoid(x W_b)                         # [B, T, H]
    a       = -exp(A_log) * softplus(x W_a + dt_bias)
    o       = gated_delta(q, k, v, a, beta)
    y       = (RMSNorm(o) * silu(x W_g)) W_o

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

__all__ = ["DeltaCache", "DeltaNet", "DeltaRuleLayer", "GatedDeltaNet",
           "KimiDeltaAttention", "a_log_init", "causal_depthwise_conv",
           "conv_kernel_init", "dt_bias_init", "l2_normalize"]


class DeltaCache(NamedTuple):
  """What a layer carries from one call to the next while decoding.

  Attributes:
    conv: ``[B, conv_size - 1, 2 H K + H V]``, the last ``conv_size - 1``
      q, k, v projections before the short convolution, in the layer's dtype.
    state: ``[B, H, K, V]`` float32, the recurrent state.
  """
  conv: jax.Array
  state: jax.Array


def causal_depthwise_conv(x: jax.Array, kernel: jax.Array,
                          history: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Causal depthwise convolution of ``x`` continued from ``history``.

  Args:
    x: ``[B, T, C]``.
    kernel: ``[W, C]``; ``kernel[-1]`` weighs the current token.
    history: ``[B, W - 1, C]``, the inputs before ``x`` (zeros at the start).

  Returns:
    ``(y, new_history)``: ``[B, T, C]`` and the last ``W - 1`` inputs
    ``[B, W - 1, C]``.
  """
  width, t = kernel.shape[0], x.shape[1]
  padded = jnp.concatenate([history.astype(x.dtype), x], axis=1)
  y = sum(padded[:, i:i + t] * kernel[i] for i in range(width))
  return y, padded[:, padded.shape[1] - (width - 1):]


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
  """``x / sqrt(sum(x^2) + eps)`` over the last axis, computed in float32."""
  x32 = x.astype(jnp.float32)
  norm = jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)
  return (x32 * norm).astype(x.dtype)


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


class DeltaRuleLayer(nnx.Module):
  """The gated delta rule token mixer; subclasses fix the gate's shape.

  Args:
    d_model: width of the input and output ``[B, T, d_model]``.
    num_heads: H.
    rngs: ``nnx.Rngs`` for the parameters.
    head_dim: K, the q/k width per head; defaults to ``d_model // num_heads``.
    value_head_dim: V, the value width per head; defaults to ``head_dim``.
    conv_size: width of the short causal convolution over q, k and v.
    allow_neg_eigval: ``beta = 2 sigmoid(.)`` in ``(0, 2)`` instead of
      ``(0, 1)``, which lets the transition have negative eigenvalues.
    norm_eps: epsilon of the output RMSNorm.
    impl, chunk_size: passed to :func:`deltajax.gated_delta`.
    dtype: dtype of the activations (e.g. ``jnp.bfloat16``); the recurrent
      state and the gates are float32 whatever it is.
    param_dtype: dtype of the parameters.
  """

  gate: ClassVar[str]  # "head", "channel" or "none"

  def __init__(self, d_model: int, num_heads: int, *, rngs: nnx.Rngs,
               head_dim: int | None = None, value_head_dim: int | None = None,
               conv_size: int = 4, allow_neg_eigval: bool = False,
               norm_eps: float = 1e-5, impl: str = "auto", chunk_size: int = 64,
               dtype=jnp.float32, param_dtype=jnp.float32):
    if head_dim is None:
      if d_model % num_heads:
        raise ValueError(f"d_model={d_model} is not divisible by num_heads="
                         f"{num_heads}; pass head_dim")
      head_dim = d_model // num_heads
    if conv_size < 1:
      raise ValueError(f"conv_size must be at least 1; got {conv_size}")
    if impl not in api.IMPLEMENTATIONS:
      raise ValueError(f"impl must be one of {api.IMPLEMENTATIONS}; got "
                       f"{impl!r}")
    self.num_heads = num_heads
    self.head_dim = head_dim
    self.value_head_dim = value_head_dim or head_dim
    self.conv_size = conv_size
    self.allow_neg_eigval = allow_neg_eigval
    self.impl = impl
    self.chunk_size = chunk_size
    self.dtype = dtype

    h, dk, dv = num_heads, head_dim, self.value_head_dim
    def linear(n_in, n_out):
      return nnx.Linear(n_in, n_out, use_bias=False, dtype=dtype,
                        param_dtype=param_dtype, rngs=rngs)

    self.qkv_proj = linear(d_model, self._qkv_width)
    self.conv_kernel = nnx.Param(conv_kernel_init(
        rngs.params(), (conv_size, self._qkv_width), param_dtype))
    self.b_proj = linear(d_model, h)
    gate_width = {"head": 1, "channel": dk, "none": 0}[self.gate]
    if gate_width:
      self.a_proj = linear(d_model, h * gate_width)
      self.A_log = nnx.Param(a_log_init(rngs.params(), (h,), param_dtype))
      gate_shape = (h,) if gate_width == 1 else (h, gate_width)
      self.dt_bias = nnx.Param(dt_bias_init(rngs.params(), gate_shape,
                                            param_dtype))
    self.g_proj = linear(d_model, h * dv)
    self.o_norm = nnx.RMSNorm(dv, epsilon=norm_eps, dtype=dtype,
                              param_dtype=param_dtype, rngs=rngs)
    self.o_proj = linear(h * dv, d_model)

  def init_cache(self, batch_size: int) -> DeltaCache:
    """An empty :class:`DeltaCache`: no tokens seen yet."""
    return DeltaCache(
        conv=self._empty_history(batch_size),
        state=jnp.zeros((batch_size, self.num_heads, self.head_dim,
                         self.value_head_dim), jnp.float32))

  @property
  def _qkv_width(self) -> int:
    """``2 H K + H V``: the channels of the q, k, v projection and convolution."""
    return self.num_heads * (2 * self.head_dim + self.value_head_dim)

  def _empty_history(self, batch_size: int) -> jax.Array:
    """Zeros ``[B, conv_size - 1, 2 H K + H V]``: the convolution's left padding."""
    return jnp.zeros((batch_size, self.conv_size - 1, self._qkv_width),
                     self.dtype)

  def __call__(self, x: jax.Array, *, cache: DeltaCache | None = None):
    """Mixes the tokens of ``x`` ``[B, T, d_model]``.

    Returns ``y`` ``[B, T, d_model]`` in the layer's dtype; with ``cache``,
    ``(y, new_cache)``, continuing the sequences that ``cache`` holds.
    """
    bsz, t, _ = x.shape
    history = self._empty_history(bsz) if cache is None else cache.conv
    qkv, history = causal_depthwise_conv(
        self.qkv_proj(x), self.conv_kernel[...].astype(self.dtype), history)
    q, k, v = self._split_heads(nnx.silu(qkv))
    q, k = l2_normalize(q), l2_normalize(k)
    beta = nnx.sigmoid(self.b_proj(x).astype(jnp.float32))
    if self.allow_neg_eigval:
      beta = 2.0 * beta
    a = self.log_decay(x)
    if cache is None:
      o = api.gated_delta(q, k, v, a, beta, impl=self.impl,
                          chunk_size=self.chunk_size)
    else:
      o, state = self._continue(cache.state, q, k, v, a, beta)
    gate = self.g_proj(x).reshape(bsz, t, self.num_heads, -1)
    o = self.o_norm(o.astype(self.dtype)) * nnx.silu(gate)
    y = self.o_proj(o.reshape(bsz, t, -1))
    return y if cache is None else (y, DeltaCache(history, state))

  def log_decay(self, x: jax.Array) -> jax.Array:
    """``a = -exp(A_log) softplus(x W_a + dt_bias)``, float32.

    ``[B, T, H]`` for a per-head gate (zeros without one), ``[B, T, H, K]``
    for a per-channel gate.
    """
    bsz, t, _ = x.shape
    if self.gate == "none":
      return jnp.zeros((bsz, t, self.num_heads), jnp.float32)
    z = self.a_proj(x).astype(jnp.float32)
    z = z.reshape(bsz, t, *self.dt_bias.shape) + self.dt_bias[...]
    rate = jnp.exp(self.A_log[...].astype(jnp.float32))
    if self.gate == "channel":
      rate = rate[:, None]
    return -rate * jax.nn.softplus(z)

  def _split_heads(self, qkv: jax.Array):
    """``[B, T, 2 H K + H V]`` -> q, k ``[B, T, H, K]`` and v ``[B, T, H, V]``."""
    bsz, t, _ = qkv.shape
    width = self.num_heads * self.head_dim
    q, k, v = jnp.split(qkv, [width, 2 * width], axis=-1)
    return (q.reshape(bsz, t, self.num_heads, self.head_dim),
            k.reshape(bsz, t, self.num_heads, self.head_dim),
            v.reshape(bsz, t, self.num_heads, self.value_head_dim))

  def _continue(self, state, q, k, v, a, beta):
    """Runs the rule from ``state``; one token takes :func:`deltajax.gated_delta_step`.

    Returns ``(o [B, T, H, V], final_state [B, H, K, V])``.
    """
    if q.shape[1] == 1:
      o, state = api.gated_delta_step(state, q[:, 0], k[:, 0], v[:, 0],
                                      a[:, 0], beta[:, 0])
      return o[:, None], state
    return api.gated_delta(q, k, v, a, beta, initial_state=state,
                           return_final_state=True, impl=self.impl,
                           chunk_size=self.chunk_size)


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


class DeltaNet(DeltaRuleLayer):
  """DeltaNet (Schlag et al., 2021; Yang et al., 2024): the delta rule without decay, ``a = 0``.

  ``DeltaNet(d_model, num_heads, rngs=rngs, **options)``; the options are
  those of :class:`DeltaRuleLayer`.
  """
  gate = "none"
