"""Shared test helpers: realistic random inputs, calls, error measures."""

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

import pytest

import deltajax
from deltajax import pallas

# The marks of a GPU test module: ``-m gpu`` selects it; skipped without an
# NVIDIA GPU the Pallas kernels run on.
GPU_TESTS = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        pallas.gpu_capability() is None
        or pallas.gpu_capability() < pallas.MIN_CAPABILITY,
        reason="needs an NVIDIA GPU of compute capability >= 8.0"),
]


def slow(*values, **kwargs):
  """A case of a parametrised test that runs with ``-m slow`` only: the
  default run keeps one case per behaviour, the slow run the whole grid."""
  return pytest.param(*values, marks=pytest.mark.slow, **kwargs)


class Float64TestCase(chex.TestCase):
  """A ``chex.TestCase`` whose tests run with ``jax_enable_x64``."""

  def setUp(self):
    super().setUp()
    self.enter_context(jax.enable_x64(True))


class Inputs(NamedTuple):
  """float64 numpy inputs in deltajax's layout."""
  q: np.ndarray  # [B, T, H, K]
  k: np.ndarray  # [B, T, H, K], L2-normalised
  v: np.ndarray  # [B, T, HV, V]
  a: np.ndarray  # [B, T, HV] or [B, T, HV, K], log decay <= 0
  b: np.ndarray  # [B, T, HV], beta in (0, 1)
  initial_state: np.ndarray  # [N, HV, K, V]


def random_inputs(seed: int, *, batch=2, length=12, heads=2, key_dim=4,
                  value_dim=4, per_channel=False, gate_scale=1.0,
                  state_scale=0.5, value_heads=None, states=None,
                  nonnegative_qk=False, beta_one=False) -> Inputs:
  """Inputs like fla's tests: q, v ~ N(0, 1), k L2-normalised,
  ``b = sigmoid(N(0, 1))``, ``a = gate_scale * logsigmoid(N(0, 1))``.

  ``value_heads`` (HV, default H) gives v, a, b and the state grouped value
  heads; ``states`` (default B) the number of initial states (the number of
  sequences of packed inputs). ``nonnegative_qk``: q, k uniform in [0, 1)
  and both L2-normalised (fla's KDA tests: nearly aligned keys);
  ``beta_one``: b = 1 (fla's GDN tests).
  """
  rng = np.random.default_rng(seed)
  hv = heads if value_heads is None else value_heads
  draw = rng.uniform if nonnegative_qk else rng.standard_normal
  q = draw(size=(batch, length, heads, key_dim))
  k = draw(size=(batch, length, heads, key_dim))
  if nonnegative_qk:
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  v = rng.standard_normal((batch, length, hv, value_dim))
  gate_shape = (batch, length, hv) + ((key_dim,) if per_channel else ())
  a = -gate_scale * np.logaddexp(0.0, -rng.standard_normal(gate_shape))
  b = (np.ones((batch, length, hv)) if beta_one else
       1.0 / (1.0 + np.exp(-rng.standard_normal((batch, length, hv)))))
  s0 = state_scale * rng.standard_normal(
      (batch if states is None else states, hv, key_dim, value_dim))
  return Inputs(q, k, v, a, b, s0)


def random_cotangents(seed: int, inputs: Inputs):
  """Random ``(d_o, d_final_state)``, float64 numpy, for a VJP."""
  rng = np.random.default_rng(seed)
  return (rng.standard_normal(inputs.v.shape),
          rng.standard_normal(inputs.initial_state.shape))


def gated_delta(impl, q, k, v, a, b, initial_state, **options):
  """``deltajax.gated_delta(..., return_final_state=True)`` with positional state."""
  return deltajax.gated_delta(q, k, v, a, b, initial_state=initial_state,
                              impl=impl, return_final_state=True, **options)


def vjp(fn, args, cotangents):
  """``(outputs, grads)``: ``fn(*args)`` and the VJP of ``cotangents``
  (cast to the outputs' dtypes)."""
  outputs, pullback = jax.vjp(fn, *args)
  cotangents = tuple(jnp.asarray(c).astype(o.dtype)
                     for c, o in zip(cotangents, outputs))
  return outputs, pullback(cotangents)


def as_float64(x) -> np.ndarray:
  return np.asarray(x).astype(np.float64)


def max_abs_error(x, ref) -> float:
  return float(np.max(np.abs(as_float64(x) - as_float64(ref))))


def relative_max_error(x, ref) -> float:
  """``max |x - ref| / max |ref|``."""
  return max_abs_error(x, ref) / float(np.max(np.abs(as_float64(ref))))


def relative_rms_error(x, ref) -> float:
  """fla's ``get_err_ratio``: ``||x - ref|| / ||ref||``."""
  x, ref = as_float64(x), as_float64(ref)
  return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def strong_kda_inputs(seed: int, *, batch=1, length=128, heads=1, key_dim=32,
                      value_dim=32, chunk_size=64) -> Inputs:
  """KDA inputs at the edge of stability: per-channel gates of -5 on every
  token of the first chunk (a quarter of the channels), -30 on single
  tokens (another quarter), weak elsewhere; b near 2; nearly aligned keys
  (one direction plus 5% noise). A chunked implementation that took the
  exponent of a positive number (say ``exp(g_0 - g_j)``, up to
  ``5 chunk_size``) would overflow in float32."""
  rng = np.random.default_rng(seed)
  shape = (batch, length, heads)
  q = rng.standard_normal((*shape, key_dim))
  k = rng.standard_normal(key_dim) + 0.05 * rng.standard_normal(
      (*shape, key_dim))
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  v = rng.standard_normal((*shape, value_dim))
  a = -0.05 * np.logaddexp(0.0, rng.standard_normal((*shape, key_dim)))
  quarter = key_dim // 4
  a[:, :chunk_size, :, :quarter] = -5.0
  single = rng.uniform(size=(batch, length)) < 0.1
  a[:, :, :, quarter:2 * quarter][single] = -30.0
  b = rng.uniform(1.9, 1.99, shape)
  s0 = rng.standard_normal((batch, heads, key_dim, value_dim))
  return Inputs(q, k, v, a, b, s0)
