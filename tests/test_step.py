"""gated_delta_step's kernel (impl="pallas", Pallas interpret mode on the CPU)
against the float64 reference, the jnp step and a call over the sequence
(the GPU run: tests/test_gpu.py)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deltajax
from deltajax import api
from deltajax import pallas
import reference
import utils

pytestmark = pytest.mark.skipif(
    pallas.gpu_capability() is not None,
    reason="interpret-mode checks; on a GPU run tests/test_gpu.py")

# (B, H, HV, K, V): powers of two; grouped value heads; dims the kernel pads
# (48 -> 64, 100 -> 128: four V blocks of 32).
SHAPES = [(2, 2, 2, 32, 64), (1, 2, 4, 64, 32), (2, 1, 2, 48, 100)]
GATES = ("gdn", "kda")


def _inputs(shape, gate, seed, length=1):
  """float64 numpy ``(q, k, v, a, b, s0)`` of ``length`` tokens."""
  bsz, h, hv, dk, dv = shape
  return utils.random_inputs(seed, batch=bsz, length=length, heads=h,
                             key_dim=dk, value_dim=dv,
                             per_channel=gate == "kda", value_heads=hv)


def _token(x, t=0):
  """``(state, q, k, v, a, b)``: token ``t`` of ``x``, with its initial state."""
  return (x.initial_state, *(y[:, t] for y in (x.q, x.k, x.v, x.a, x.b)))


def _reference(state, q, k, v, a, b):
  """The recurrence (float64 numpy) for one token; ``q`` scaled."""
  groups = v.shape[1] // q.shape[1]
  q, k = (np.repeat(y, groups, axis=1)[:, None] for y in (q, k))
  o, s = reference.ref_a(q * q.shape[-1] ** -0.5, k, v[:, None],
                         np.exp(a)[:, None], b[:, None], state)
  return o[:, 0], s


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_pallas_matches_float64_reference(x64, shape, gate):
  args = _token(_inputs(shape, gate, seed=sum(shape)))
  o, s = deltajax.gated_delta_step(*(jnp.asarray(y) for y in args),
                                   impl="pallas")
  ref_o, ref_s = _reference(*args)
  assert o.dtype == s.dtype == jnp.float64
  np.testing.assert_allclose(o, ref_o, rtol=0, atol=1e-12)
  np.testing.assert_allclose(s, ref_s, rtol=0, atol=1e-12)


@pytest.mark.parametrize("impl", ("jnp", "pallas"))
@pytest.mark.parametrize("gate", GATES)
def test_full_forget_at_the_floor(x64, gate, impl):
  """``a = -inf`` (one head, or half the channels) drops the state, even
  a non-finite one (NaN there)."""
  state, q, k, v, a, b = _token(_inputs(SHAPES[1], gate, seed=5))
  a, bad = a.copy(), state.copy()
  a[0, 1] = -np.inf
  bad[0, 1] = np.nan
  if gate == "kda":
    a[0, 2, ::2] = -np.inf
    bad[0, 2, ::2] = np.inf
  o, s = deltajax.gated_delta_step(
      *(jnp.asarray(y) for y in (bad, q, k, v, a, b)), impl=impl)
  ref_o, ref_s = _reference(state, q, k, v, a, b)
  assert np.all(np.isfinite(o)) and np.all(np.isfinite(s))
  np.testing.assert_allclose(o, ref_o, rtol=0, atol=1e-12)
  np.testing.assert_allclose(s, ref_s, rtol=0, atol=1e-12)


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16))
def test_pallas_matches_jnp(gate, dtype):
  """16-bit or float32 q, k, v with float32 gates and state: the two
  implementations compute from the same values in float32."""
  state, q, k, v, a, b = _token(_inputs(SHAPES[1], gate, seed=7))
  args = (jnp.asarray(state, jnp.float32),
          *(jnp.asarray(y, dtype) for y in (q, k, v)),
          *(jnp.asarray(y, jnp.float32) for y in (a, b)))
  o, s = deltajax.gated_delta_step(*args, impl="pallas")
  ref_o, ref_s = deltajax.gated_delta_step(*args, impl="jnp")
  assert (o.dtype, s.dtype) == (dtype, jnp.float32)
  bound = 1e-5 if dtype == jnp.float32 else 1e-2  # o rounded to bf16
  assert utils.relative_max_error(o, ref_o) < bound
  assert utils.relative_max_error(s, ref_s) < 1e-5


@pytest.mark.parametrize("gate", GATES)
def test_jitted_loop_matches_sequence_call(x64, gate):
  """Seven steps in a ``lax.scan`` equal ``gated_delta(impl="scan")``."""
  x = _inputs(SHAPES[1], gate, seed=11, length=7)
  q, k, v, a, b, s0 = (jnp.asarray(y) for y in x)

  @jax.jit
  def decode(state):
    def step(state, token):
      o, state = deltajax.gated_delta_step(state, *token, impl="pallas")
      return state, o
    tokens = tuple(jnp.moveaxis(y, 1, 0) for y in (q, k, v, a, b))
    state, o = jax.lax.scan(step, state, tokens)
    return jnp.moveaxis(o, 0, 1), state

  o, s = decode(s0)
  ref_o, ref_s = utils.gated_delta("scan", q, k, v, a, b, s0)
  np.testing.assert_allclose(o, ref_o, rtol=0, atol=1e-12)
  np.testing.assert_allclose(s, ref_s, rtol=0, atol=1e-12)


@pytest.mark.parametrize("gate", GATES)
def test_pallas_gradients_are_the_jnp_steps(x64, gate):
  args = tuple(jnp.asarray(y) for y in _token(_inputs(SHAPES[1], gate,
                                                      seed=13)))
  rng = np.random.default_rng(17)
  cotangents = (rng.standard_normal(args[3].shape),  # o, like v
                rng.standard_normal(args[0].shape))

  def grads(impl):
    step = functools.partial(deltajax.gated_delta_step, impl=impl)
    return utils.vjp(step, args, cotangents)[1]

  for got, ref in zip(grads("pallas"), grads("jnp")):
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-12)


def test_auto_takes_jnp_until_the_kernel_is_timed_on_a_gpu():
  assert api._step_impl("auto") == "jnp"
