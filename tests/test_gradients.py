"""Gradients in float64: the custom VJPs of chunked and scan against autodiff of
a plain scan (tests/reference.py), and ``jax.test_util.check_grads``."""

import functools

import chex
import jax
import jax.numpy as jnp
from absl.testing import parameterized
from jax import test_util

import reference
import utils

ARGS = ("q", "k", "v", "a", "b", "initial_state")
RELATIVE_TOLERANCE = 1e-10  # max |g - ref| / max |ref|, per argument
SCALE = 0.5  # not 1, so that a missing scale in a backward shows
CASES = tuple((f"{impl}_{gate}", impl, gate == "kda")
              for impl in ("chunked", "scan") for gate in ("gdn", "kda"))


def _args(seed, per_channel):
  """float64 inputs with T = 10 (not a multiple of C = 4), K = 4, V = 3."""
  x = utils.random_inputs(seed=seed, length=10, key_dim=4, value_dim=3,
                          per_channel=per_channel)
  return tuple(jnp.asarray(t, jnp.float64) for t in x), x


def _plain_scan(q, k, v, a, b, initial_state):
  return reference.plain_scan(q * SCALE, k, v, a, b, initial_state)


class GradientTest(utils.Float64TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(*CASES)
  def test_matches_autodiff_of_plain_scan(self, impl, per_channel):
    args, x = _args(3000 + per_channel, per_channel)
    cotangents = utils.random_cotangents(3100 + per_channel, x)
    fn = functools.partial(utils.gated_delta, impl, scale=SCALE, chunk_size=4)
    _, grads = self.variant(functools.partial(utils.vjp, fn))(args, cotangents)
    _, ref_grads = utils.vjp(_plain_scan, args, cotangents)
    errors = {name: utils.relative_max_error(g, ref)
              for name, g, ref in zip(ARGS, grads, ref_grads)}
    print(f"gradients {impl} {'kda' if per_channel else 'gdn'} vs autodiff of "
          f"a plain scan: max relative error "
          + ", ".join(f"d{n} {e:.2g}" for n, e in errors.items()))
    chex.assert_trees_all_equal_shapes(grads, args)
    self.assertTrue(all(e <= RELATIVE_TOLERANCE for e in errors.values()),
                    errors)

  @parameterized.named_parameters(*CASES)
  def test_check_grads(self, impl, per_channel):
    args, _ = _args(3200 + per_channel, per_channel)
    fn = functools.partial(utils.gated_delta, impl, scale=SCALE, chunk_size=4)
    test_util.check_grads(jax.jit(fn), args, order=1, modes=("rev",))

  def test_reference_passes_check_grads(self):
    """The reference's own autodiff agrees with finite differences."""
    args, _ = _args(3300, per_channel=True)
    test_util.check_grads(_plain_scan, args, order=1, modes=("rev",))
