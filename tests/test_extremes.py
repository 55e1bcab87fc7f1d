"""Valid extreme inputs, in float32: finite outputs and gradients, and chunked
agreeing with scan (so that a finite but wrong value fails too)."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference
import utils

AGREEMENT = 1e-4  # chunked vs scan, float32
# name -> (a value, b value, T); None keeps the realistic random value.
EXTREMES = {
    "a=-30": (-30.0, None, 100),
    "a=-inf": (-np.inf, None, 100),
    "a=-inf on every 7th token": ("-inf every 7", None, 100),
    "a=0": (0.0, None, 100),
    "b=0": (None, 0.0, 100),
    "b=1.99": (None, 1.99, 100),
    "T=1": (None, None, 1),
}


def _inputs(extreme, per_channel, seed, **shape):
  a_value, b_value, length = EXTREMES.get(extreme, (None, None, None))
  x = utils.random_inputs(seed, length=shape.pop("length", length),
                          per_channel=per_channel, **shape)
  if a_value == "-inf every 7":
    x = x._replace(a=np.where((np.arange(x.a.shape[1]) % 7 == 3)[
        :, None] if x.a.ndim == 3 else (np.arange(x.a.shape[1]) % 7 == 3)[
            :, None, None], -np.inf, x.a))
  elif a_value is not None:
    x = x._replace(a=np.full_like(x.a, a_value))
  if b_value is not None:
    x = x._replace(b=np.full_like(x.b, b_value))
  return tuple(jnp.asarray(t, jnp.float32) for t in x)


@functools.partial(jax.jit, static_argnums=0)
def _value_and_grads(impl, *args):
  """Outputs and gradients; one compilation per implementation and shape,
  shared by the extremes."""
  def loss(*args):
    o, s = utils.gated_delta(impl, *args)
    return jnp.sum(o * o) + jnp.sum(s), (o, s)
  (_, outputs), grads = jax.value_and_grad(
      loss, argnums=tuple(range(len(args))), has_aux=True)(*args)
  return outputs, grads


def _assert_agree(chunked, scan):
  """Inputs and gradients are O(1): absolute and relative tolerance alike.

  (A relative-only test is too strict where the true value is tiny: for
  a = -30 the exact da is ~1e-13, and chunked's da carries float32 rounding
  of ~1e-7 from summing O(1) terms that cancel.)
  """
  chex.assert_trees_all_close(chunked, scan, rtol=AGREEMENT, atol=AGREEMENT)


@pytest.mark.parametrize("per_channel", (False, True), ids=("gdn", "kda"))
@pytest.mark.parametrize("extreme", tuple(EXTREMES))
def test_extremes_are_finite_and_agree(extreme, per_channel):
  args = _inputs(extreme, per_channel, seed=6000 + list(EXTREMES).index(
      extreme), batch=1, heads=2, key_dim=16, value_dim=8)
  results = {impl: _value_and_grads(impl, *args)
             for impl in ("chunked", "scan")}
  for impl, result in results.items():
    chex.assert_tree_all_finite(result, custom_message=f"{impl} {extreme}")
  _assert_agree(results["chunked"], results["scan"])


@pytest.mark.parametrize("per_channel", (False, True), ids=("gdn", "kda"))
def test_long_sequence_forward_is_finite_and_agrees(per_channel):
  """T = 8192, forward only, small heads."""
  args = _inputs("T=8192", per_channel, seed=6100, batch=1, length=8192,
                 heads=1, key_dim=8, value_dim=8)
  outputs = {impl: jax.jit(functools.partial(utils.gated_delta, impl))(*args)
             for impl in ("chunked", "scan")}
  chex.assert_tree_all_finite(outputs)
  _assert_agree(outputs["chunked"], outputs["scan"])


# Against the float64 reference (relative RMS error of the outputs and of
# every gradient): float64, and float32 about as close as chunked gets. The
# Pallas kernels keep a floored gate in the chunk's cumulative gate (a cut
# there would put every call on the kernels' cut path): the gates after it
# in its chunk sit 200 below its start and lose 200 eps of precision.
FLOORED_TOLERANCE = {jnp.float64: 1e-14, jnp.float32: 3e-6}
FLOORED_TOLERANCE_CLAMPED = {jnp.float64: 2e-13, jnp.float32: 1e-4}


def _floored_inputs(gate, seed):
  """Inputs whose gate is at the floor (a = -inf or -1e4, half each) on 10 %
  of the tokens (every channel), or per channel on 10 % of single
  channels, in chunks of 64: cuts inside the chunks."""
  x = utils.random_inputs(seed, batch=1, length=128, heads=2, key_dim=16,
                          value_dim=16, per_channel=gate != "gdn")
  rng = np.random.default_rng(seed)
  shape = x.a.shape if gate == "kda single channels" else x.a.shape[:3]
  floored = rng.uniform(size=shape) < 0.1
  value = np.where(rng.uniform(size=shape) < 0.5, -np.inf, -1e4)
  if gate == "kda":
    floored, value = floored[..., None], value[..., None]
  return x._replace(a=np.where(floored, value, x.a))


@pytest.mark.parametrize("dtype", (jnp.float32, utils.slow(jnp.float64)),
                         ids=("float32", "float64"))
@pytest.mark.parametrize("gate", ("gdn", utils.slow("kda"),
                                  "kda single channels"))
@pytest.mark.parametrize("impl", ("scan", "chunked", "pallas"))
def test_floored_gates_against_the_float64_reference(impl, gate, dtype):
  """A gate at the floor is a full forget: scan and chunked make it a cut
  with a = 0, so the gates after it in its chunk keep their precision; the
  Pallas kernels clamp it at the floor. (Taken as a decay, not a cut, a
  floored gate costs chunked 1.3e-5 to 1.5e-5 in float32, four times the
  tolerance.)"""
  x = _floored_inputs(gate, seed=8)
  cotangents = utils.random_cotangents(9, x)
  with jax.enable_x64(True):
    rounded = tuple(jnp.asarray(jnp.asarray(t, dtype), jnp.float64)
                    for t in x)
    ref = utils.vjp(reference.plain_scan, rounded, cotangents)
  with jax.enable_x64(dtype == jnp.float64):
    got = utils.vjp(functools.partial(utils.gated_delta, impl, scale=1.0,
                                      chunk_size=64),
                    tuple(jnp.asarray(t, dtype) for t in x), cotangents)
  for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
    tolerance = (FLOORED_TOLERANCE_CLAMPED if impl == "pallas"
                 else FLOORED_TOLERANCE)[dtype]
    assert utils.relative_rms_error(g, r) < tolerance, (
        utils.relative_rms_error(g, r))
