"""jit, grad and vmap: the rank-2 form under vmap, and no retracing."""

import functools

import chex
import jax
import jax.numpy as jnp
from absl.testing import parameterized

import deltajax
import utils

CASES = tuple((f"{impl}_{gate}", impl, gate == "kda")
              for impl in ("chunked", "scan") for gate in ("gdn", "kda"))


def _inputs(seed, per_channel):
  x = utils.random_inputs(seed, batch=3, length=10, heads=2, key_dim=8,
                          value_dim=4, per_channel=per_channel)
  return tuple(jnp.asarray(t, jnp.float32) for t in x)


def _vmap_batch_and_heads(fn):
  """Maps ``fn`` on rank-2 inputs over B (axis 0) and then H (axis 1 of the
  rest) of rank-4 inputs; ``initial_state [B, H, K, V]`` maps over axes 0, 0."""
  over_heads = jax.vmap(fn, in_axes=(1, 1, 1, 1, 1, 0), out_axes=(1, 0))
  return jax.vmap(over_heads, in_axes=0, out_axes=0)


class TransformsTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(*CASES)
  def test_vmap_of_rank2_form_equals_rank4_call(self, impl, per_channel):
    args = _inputs(5000, per_channel)
    call = functools.partial(utils.gated_delta, impl, chunk_size=4)
    vmapped = self.variant(_vmap_batch_and_heads(call))
    chex.assert_trees_all_close(vmapped(*args), call(*args), rtol=1e-6,
                                atol=1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(*CASES)
  def test_grad_of_vmapped_rank2_form_equals_rank4_grad(self, impl,
                                                        per_channel):
    args = _inputs(5100, per_channel)
    call = functools.partial(utils.gated_delta, impl, chunk_size=4)

    def loss(fn, *args):
      o, s = fn(*args)
      return jnp.sum(jnp.sin(o)) + jnp.sum(s * s)

    argnums = tuple(range(len(args)))
    grad_vmapped = self.variant(jax.grad(
        functools.partial(loss, _vmap_batch_and_heads(call)), argnums))
    grad_rank4 = jax.grad(functools.partial(loss, call), argnums)
    chex.assert_trees_all_close(grad_vmapped(*args), grad_rank4(*args),
                                rtol=1e-5, atol=1e-5)

  @parameterized.named_parameters(*CASES)
  def test_repeated_calls_of_one_shape_trace_once(self, impl, per_channel):
    chex.clear_trace_counter()

    @jax.jit
    @chex.assert_max_traces(n=1)
    def value_and_grad(q, k, v, a, b, s0):
      def loss(q, k, v, a, b, s0):
        o, s = utils.gated_delta(impl, q, k, v, a, b, s0, chunk_size=4)
        return jnp.sum(o) + jnp.sum(s)
      return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5))(
          q, k, v, a, b, s0)

    for seed in range(5200, 5203):
      chex.assert_tree_all_finite(value_and_grad(*_inputs(seed, per_channel)))

  def test_eager_calls_of_one_shape_compile_once(self):
    """The un-jitted public function reuses its compiled computation; a new
    shape compiles (so that the log being watched is the right one)."""
    def call(seed, length=10):
      q, k, v, a, b, s0 = _inputs(seed, per_channel=False)
      return deltajax.gated_delta(q[:, :length], k[:, :length], v[:, :length],
                                  a[:, :length], b[:, :length],
                                  initial_state=s0)

    call(5300)
    with jax.log_compiles(True):
      with self.assertNoLogs("jax", level="WARNING"):
        call(5301)
        call(5302)
      with self.assertLogs("jax", level="WARNING"):
        call(5303, length=9)
