"""State passing in float64: split calls and token-by-token decoding equal one call."""

import functools

import chex
import jax.numpy as jnp
from absl.testing import parameterized

import deltajax
import utils

TOLERANCE = 1e-13


class StatePassingTest(utils.Float64TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(
      (f"{impl}_{gate}_T1_{split}", impl, gate == "kda", split)
      for impl in ("chunked", "scan") for gate in ("gdn", "kda")
      for split in (5, 16))
  def test_split_call_equals_one_call(self, impl, per_channel, split):
    """T = 23 tokens in one call, or ``split`` then ``23 - split`` (C = 8)."""
    x = utils.random_inputs(seed=2000 + split, length=23, key_dim=6,
                            value_dim=5, per_channel=per_channel)
    q, k, v, a, b, s0 = (jnp.asarray(t, jnp.float64) for t in x)
    call = self.variant(functools.partial(utils.gated_delta, impl,
                                          chunk_size=8))
    o, s = call(q, k, v, a, b, s0)
    head = call(*(t[:, :split] for t in (q, k, v, a, b)), s0)
    tail = call(*(t[:, split:] for t in (q, k, v, a, b)), head[1])
    chex.assert_trees_all_close(
        (jnp.concatenate([head[0], tail[0]], axis=1), tail[1]), (o, s),
        rtol=0, atol=TOLERANCE)

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(("gdn", False), ("kda", True))
  def test_decoding_steps_equal_one_call(self, per_channel):
    x = utils.random_inputs(seed=2100, length=11, key_dim=6, value_dim=5,
                            per_channel=per_channel)
    q, k, v, a, b, s0 = (jnp.asarray(t, jnp.float64) for t in x)
    o, s = utils.gated_delta("chunked", q, k, v, a, b, s0, chunk_size=4)
    step = self.variant(deltajax.gated_delta_step)
    state, outputs = s0, []
    for t in range(q.shape[1]):
      o_t, state = step(state, *(arr[:, t] for arr in (q, k, v, a, b)))
      outputs.append(o_t)
    chex.assert_trees_all_close((jnp.stack(outputs, axis=1), state), (o, s),
                                rtol=0, atol=TOLERANCE)
