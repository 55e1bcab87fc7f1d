"""Forward values in float64: chunked and scan against the token recurrence.

A small case (B=2, H=2, T=12, K=V=4, C=4) and its two degenerate cases
(DeltaNet, a = 0; pure decay, b ~ 0), KDA, odd shapes, an initial state, and
strong gates.
"""

import functools

import chex
import jax.numpy as jnp
import numpy as np
from absl.testing import parameterized

import deltajax
import reference
import utils

IMPLS = ("chunked", "scan")
TABLE_TOLERANCE = 1e-13  # max abs error


def _jnp(inputs: utils.Inputs, dtype=jnp.float64):
  return tuple(jnp.asarray(x, dtype) for x in inputs)


class SmallTableTest(utils.Float64TestCase):
  """B=2, H=2, T=12, K=V=4, C=4 against :func:`reference.ref_a`, with
  deltajax's ``a = log(alpha)``, scale 1."""

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(
      ("gated", None, None),
      ("deltanet_a0", 0.0, None),
      ("pure_decay_b1e-12", None, 1e-12),
  )
  def test_chunked_and_scan_match_reference_a(self, a_value, b_value):
    x = utils.random_inputs(seed=1000, batch=2, length=12, heads=2, key_dim=4,
                            value_dim=4)
    a = x.a if a_value is None else np.full_like(x.a, a_value)
    b = x.b if b_value is None else np.full_like(x.b, b_value)
    ref_o, ref_s = reference.ref_a(x.q, x.k, x.v, np.exp(a), b)
    args = tuple(jnp.asarray(t, jnp.float64) for t in (x.q, x.k, x.v, a, b))
    got = {}
    for impl in IMPLS:
      fn = self.variant(functools.partial(utils.gated_delta, impl, scale=1.0,
                                          chunk_size=4))
      got[impl] = fn(*args, None)
      for name, value, ref in zip(("o", "final_state"), got[impl],
                                  (ref_o, ref_s)):
        err = utils.max_abs_error(value, ref)
        print(f"table {self._testMethodName} {impl} vs ref_A {name}: "
              f"max abs error {err:.3g}")
        self.assertLessEqual(err, TABLE_TOLERANCE)
        # For b = 1e-12 the output is ~1e-12: bound the relative error too.
        self.assertLessEqual(utils.relative_max_error(value, ref),
                             TABLE_TOLERANCE)
    for chunked, scan in zip(got["chunked"], got["scan"]):
      self.assertLessEqual(utils.relative_max_error(chunked, scan),
                           TABLE_TOLERANCE)


class ShapesTest(utils.Float64TestCase):
  """T not a multiple of the chunk, head dims not powers of two, an initial
  state, the default scale ``K ** -0.5``, both gates."""

  @parameterized.named_parameters(
      (f"T{t}_K{k}_V{v}_C{c}_{impl}_{gate}", t, k, v, c, impl, gate == "kda")
      for t, k, v, c in ((13, 4, 4, 4), (21, 60, 48, 8), (9, 100, 100, 4),
                         (5, 4, 4, 64))
      for impl in IMPLS for gate in ("gdn", "kda"))
  def test_matches_reference_a(self, length, key_dim, value_dim, chunk_size,
                               impl, per_channel):
    x = utils.random_inputs(seed=1100 + length, length=length, key_dim=key_dim,
                            value_dim=value_dim, per_channel=per_channel)
    ref_o, ref_s = reference.ref_a(x.q * key_dim**-0.5, x.k, x.v, np.exp(x.a),
                                   x.b, x.initial_state)
    o, s = utils.gated_delta(impl, *_jnp(x), chunk_size=chunk_size)
    chex.assert_shape(o, x.v.shape)
    chex.assert_shape(s, x.initial_state.shape)
    chex.assert_trees_all_close((o, s), (ref_o, ref_s), rtol=0, atol=1e-12)


class KdaTest(utils.Float64TestCase):
  """The per-channel gate: its GDN special case, chunked vs scan, strong gates."""

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(*IMPLS)
  def test_equal_channels_give_gated_deltanet(self, impl):
    x = utils.random_inputs(seed=1200, length=19, key_dim=8, value_dim=6)
    q, k, v, a, b, s0 = _jnp(x)
    a_channels = jnp.broadcast_to(a[..., None], q.shape)
    kda = self.variant(functools.partial(deltajax.kda, impl=impl, chunk_size=8,
                                         return_final_state=True))
    gdn = self.variant(functools.partial(deltajax.gated_delta, impl=impl,
                                         chunk_size=8, return_final_state=True))
    chex.assert_trees_all_close(
        kda(q, k, v, a_channels, b, initial_state=s0),
        gdn(q, k, v, a, b, initial_state=s0), rtol=0, atol=1e-13)

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(
      ("realistic_float64", None, jnp.float64, 1e-13),
      ("strong_float64", -5.0, jnp.float64, 1e-13),
      # exp(g_i - g_j) above the diagonal reaches exp(315): inf in float32
      # unless masked before exp.
      ("strong_float32", -5.0, jnp.float32, 2e-5),
  )
  def test_chunked_matches_scan_and_reference(self, a_value, dtype, tolerance):
    x = utils.random_inputs(seed=1300, length=100, key_dim=16, value_dim=8,
                            per_channel=True)
    if a_value is not None:
      x = x._replace(a=np.full_like(x.a, a_value))
    ref_o, ref_s = reference.ref_a(x.q, x.k, x.v, np.exp(x.a), x.b,
                                   x.initial_state)
    outputs = {}
    for impl in IMPLS:
      kda = self.variant(functools.partial(deltajax.kda, impl=impl, scale=1.0,
                                           chunk_size=64,
                                           return_final_state=True))
      q, k, v, a, b, s0 = _jnp(x, dtype)
      outputs[impl] = kda(q, k, v, a, b, initial_state=s0)
      chex.assert_tree_all_finite(outputs[impl])
      for value, ref in zip(outputs[impl], (ref_o, ref_s)):
        self.assertLessEqual(utils.relative_max_error(value, ref), tolerance)
    chex.assert_trees_all_close(outputs["chunked"], outputs["scan"], rtol=0,
                                atol=tolerance)
