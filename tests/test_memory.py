"""Backward memory of the chunked path, read from XLA's compiled program.

Issue target: ``jit(grad)`` of ``kda`` at B=1, T=8192, H=2, K=V=128 float32
needs less than 256 MiB of temporaries (every token's state would be 1 GiB;
a ``[C, C, K]`` decay tensor per chunk, 0.5 GiB each).
"""

import jax
import jax.numpy as jnp
import pytest

import deltajax

LIMIT_MIB = 256


@pytest.mark.parametrize("gate", ("head", "channel"))
def test_chunked_backward_temporaries_stay_bounded(gate):
  bsz, t, h, d = 1, 8192, 2, 128
  spec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  a_shape = (bsz, t, h, d) if gate == "channel" else (bsz, t, h)

  def loss(q, k, v, a, b):
    return jnp.sum(deltajax.gated_delta(q, k, v, a, b, impl="chunked"))

  compiled = jax.jit(jax.grad(loss, argnums=range(5))).lower(
      spec(bsz, t, h, d), spec(bsz, t, h, d), spec(bsz, t, h, d),
      spec(*a_shape), spec(bsz, t, h)).compile()
  temp_mib = compiled.memory_analysis().temp_size_in_bytes / 2 ** 20
  assert temp_mib < LIMIT_MIB, f"{temp_mib:.0f} MiB"
