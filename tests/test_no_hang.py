"""The chunked path never deadlocks on the CPU.

jaxlib 0.10's batched CPU triangular solve deadlocks when two run at once
(both Eigen pool threads wait in ``lapack_strsm_ffi``); deltajax inverts its
unit-triangular chunk systems with matmuls instead
(:func:`deltajax.common.invert_unit_lower`). Two checks: no LAPACK solve in
any program deltajax builds, and the programs that used to hang finish in a
subprocess under a timeout.
"""

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deltajax
import utils

TIMEOUT_S = 300

_PROGRAMS = textwrap.dedent("""
    import jax, jax.numpy as jnp, deltajax
    B, T, H, K, V = 2, 1024, 4, 32, 32
    keys = jax.random.split(jax.random.key(0), 5)
    q, k = (jax.random.normal(x, (B, T, H, K)) for x in keys[:2])
    v = jax.random.normal(keys[2], (B, T, H, V))
    a = jax.nn.log_sigmoid(jax.random.normal(keys[3], (B, T, H)))
    b = jax.nn.sigmoid(jax.random.normal(keys[4], (B, T, H)))
    f = lambda *x: deltajax.gated_delta(*x, impl="chunked", use_qk_l2norm=True)
    two = jax.jit(lambda q, k, v, a, b: f(q, k, v, a, b) + f(k, q, v, a, b))
    loss = jax.jit(jax.grad(lambda q, k, v, a, b: jnp.sum(two(q, k, v, a, b))))
    for i in range(3):
      jax.block_until_ready(two(q, k + i, v, a, b))
      jax.block_until_ready(loss(q, k + i, v, a, b))
    print("done")
""")


def test_two_chunked_calls_in_one_program_finish():
  result = subprocess.run([sys.executable, "-c", _PROGRAMS],
                          capture_output=True, text=True, timeout=TIMEOUT_S)
  assert result.returncode == 0, result.stderr
  assert result.stdout.strip().endswith("done")


@pytest.mark.parametrize("gate", ("gdn", "kda"))
def test_no_lapack_triangular_solve_in_forward_or_backward(gate):
  x = utils.random_inputs(7, per_channel=gate == "kda", length=40)
  args = tuple(jnp.asarray(t, jnp.float32) for t in x)

  def loss(*args):
    o, s = utils.gated_delta("chunked", *args, chunk_size=16)
    return jnp.sum(o) + jnp.sum(s)

  text = str(jax.make_jaxpr(jax.grad(loss, argnums=range(6)))(*args))
  assert "triangular_solve" not in text
  assert "dot_general" in text  # the program was traced through
