"""impl="pallas" in Pallas interpret mode on the CPU (the GPU run: tests/test_gpu.py).

Small shapes: every kernel runs element by element here.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deltajax
from deltajax import pallas
from deltajax.pallas import ops
from deltajax.pallas import ut

pytestmark = pytest.mark.skipif(
    pallas.gpu_capability() is not None,
    reason="interpret-mode checks; on a GPU run tests/test_gpu.py")


def _inputs(shape, seed):
  """numpy q, k (unit rows), v, a (GDN gate), b, initial state; cotangents."""
  bsz, t, h, dk, dv = shape
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((bsz, t, h, dk))
  k = rng.standard_normal((bsz, t, h, dk))
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  v = rng.standard_normal((bsz, t, h, dv))
  a = -np.logaddexp(0, rng.standard_normal((bsz, t, h)))
  b = rng.uniform(0.05, 1.95, (bsz, t, h))
  s0 = rng.standard_normal((bsz, h, dk, dv))
  cts = (rng.standard_normal((bsz, t, h, dv)),
         rng.standard_normal((bsz, h, dk, dv)))
  return (q, k, v, a, b, s0), cts


def _value_and_grads(impl, args, cts, chunk_size):
  def f(q, k, v, a, b, s0):
    return deltajax.gated_delta(q, k, v, a, b, initial_state=s0, impl=impl,
                                chunk_size=chunk_size, return_final_state=True)
  out, vjp = jax.vjp(f, *args)
  return out, vjp(tuple(jnp.asarray(c, x.dtype) for c, x in zip(cts, out)))


# (B, T, H, K, V), chunk: T not a multiple of the chunk, head dims padded to a
# power of two (20 -> 32, 100 -> 128: two V blocks), one chunk of 16.
SHAPES = [((1, 50, 2, 20, 24), 32), ((2, 40, 1, 16, 100), 16),
          ((1, 16, 1, 32, 16), 16)]


@pytest.mark.parametrize("shape,chunk_size", SHAPES)
def test_pallas_matches_chunked_in_float64(shape, chunk_size):
  args, cts = _inputs(shape, seed=sum(shape) + chunk_size)
  with jax.enable_x64(True):
    args = tuple(jnp.asarray(x, jnp.float64) for x in args)
    got, got_grads = _value_and_grads("pallas", args, cts, chunk_size)
    ref, ref_grads = _value_and_grads("chunked", args, cts, chunk_size)
  for name, x, y in zip(("o", "final_state", "dq", "dk", "dv", "da", "db",
                         "dh0"), (*got, *got_grads), (*ref, *ref_grads)):
    err = np.max(np.abs(np.asarray(x) - np.asarray(y))) / np.max(np.abs(y))
    assert err < 1e-12, (name, err)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-4),
                                       (jnp.bfloat16, 0.008)])
def test_pallas_low_precision_matches_float64_reference(dtype, tol):
  """float32 and bf16 q, k, v (float32 gates and state) against float64 on the
  same rounded values; outputs and gradients come back in the input dtypes."""
  args, cts = _inputs((1, 70, 2, 32, 32), seed=7)
  args = (tuple(jnp.asarray(x, dtype) for x in args[:3])
          + tuple(jnp.asarray(x, jnp.float32) for x in args[3:]))
  got, got_grads = _value_and_grads("pallas", args, cts, 32)
  with jax.enable_x64(True):
    ref, ref_grads = _value_and_grads(
        "chunked", tuple(jnp.asarray(x, jnp.float64) for x in args), cts, 32)
  expected_dtypes = (dtype, jnp.float32) + tuple(x.dtype for x in args)
  for x, y, dt in zip((*got, *got_grads), (*ref, *ref_grads), expected_dtypes):
    assert x.dtype == dt
    rel = np.linalg.norm(np.asarray(x, np.float64) - y) / np.linalg.norm(y)
    assert rel < tol


def _block_inverse(a):
  """``(I + a)^-1`` from :func:`ut.inverse_blocks`, as one numpy matrix."""
  n = a.shape[0] // 16
  blocks = ut.inverse_blocks(
      lambda i, j: jnp.asarray(a[16 * i:16 * (i + 1), 16 * j:16 * (j + 1)]), n)
  return np.block([[np.asarray(blocks[i, j]) if j <= i else np.zeros((16, 16))
                    for j in range(n)] for i in range(n)])


@pytest.mark.parametrize("beta", [1.0, 1.99])
def test_inverse_is_stable_for_aligned_keys(beta):
  """Identical keys: a power series of A would cancel catastrophically."""
  c = 64
  rng = np.random.default_rng(3)
  k = np.tile(rng.standard_normal((1, 32)), (c, 1))
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  a = np.tril(beta * (k @ k.T), -1)
  expected = np.linalg.inv(np.eye(c) + a)
  got = _block_inverse(a.astype(np.float32))
  assert np.max(np.abs(got - expected)) < 1e-4 * np.max(np.abs(expected))


@pytest.mark.parametrize("c", [16, 32, 128])
def test_inverse_with_decay_in_float64(c):
  """Random keys and b, a strong decay; chunk sizes the other tests skip."""
  rng = np.random.default_rng(c)
  k = rng.standard_normal((c, 24))
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  g = np.cumsum(-rng.uniform(0, 0.5, c))
  a = np.tril(rng.uniform(0, 2, (c, 1)) * (k @ k.T)
              * np.exp(np.minimum(g[:, None] - g[None, :], 0)), -1)
  with jax.enable_x64(True):
    got = _block_inverse(a)
  np.testing.assert_allclose(got @ (np.eye(c) + a), np.eye(c), atol=1e-13)


def test_pallas_mixed_input_dtypes():
  """bf16 q, k with float32 v reach the kernels in one dtype (a Triton dot
  needs it), match chunked, and each gradient comes back in its input's
  dtype."""
  args, cts = _inputs((1, 40, 1, 16, 16), seed=11)
  dtypes = (jnp.bfloat16, jnp.bfloat16) + (jnp.float32,) * 4
  args = tuple(jnp.asarray(x, d) for x, d in zip(args, dtypes))
  q, k, v, *_ = ops._padded(*args[:3], args[5])  # pylint: disable=protected-access
  assert q.dtype == k.dtype == v.dtype == jnp.float32
  got, got_grads = _value_and_grads("pallas", args, cts, 16)
  ref, ref_grads = _value_and_grads("chunked", args, cts, 16)
  for x, y, d in zip((*got, *got_grads), (*ref, *ref_grads),
                     (jnp.float32,) * 2 + dtypes):
    assert x.dtype == d
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    assert np.linalg.norm(x - y) / np.linalg.norm(y) < 1e-2


def test_pallas_rejects_per_channel_gate_and_small_chunks():
  args, _ = _inputs((1, 16, 1, 16, 16), seed=1)
  q, k, v, a, b, _ = (jnp.asarray(x, jnp.float32) for x in args)
  with pytest.raises(NotImplementedError, match="per-channel"):
    deltajax.kda(q, k, v, jnp.broadcast_to(a[..., None], q.shape), b,
                 impl="pallas")
  with pytest.raises(ValueError, match="chunk_size >= 16"):
    deltajax.gated_delta(q, k, v, a, b, impl="pallas", chunk_size=8)


def test_auto_is_chunked_without_gpu():
  assert deltajax.api._implementation("auto", per_channel=False) is (
      deltajax.chunked.gated_delta_chunked)
