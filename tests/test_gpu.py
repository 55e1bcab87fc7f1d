"""GPU checks of impl="pallas" (run on the H200 with ``python -m pytest -m gpu tests``).

bf16 inputs, float32 initial state, against the float64 chunked reference on
the same device and the same (bf16-rounded) values, with fla's tolerances
(relative RMS error).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deltajax
from deltajax import pallas

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        pallas.gpu_capability() is None
        or pallas.gpu_capability() < pallas.MIN_CAPABILITY,
        reason="needs an NVIDIA GPU of compute capability >= 8.0"),
]

TOLERANCES = dict(o=0.005, s=0.005, dq=0.008, dk=0.008, dv=0.008, dh0=0.008,
                  da=0.02, db=0.02)


def _inputs(t, d, seed, bsz=2, h=2):
  rng = np.random.default_rng(seed)
  q, k, v = (rng.standard_normal((bsz, t, h, d)) for _ in range(3))
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  a = -np.logaddexp(0, rng.standard_normal((bsz, t, h))) / 4
  b = 1 / (1 + np.exp(-rng.standard_normal((bsz, t, h))))
  s0 = rng.standard_normal((bsz, h, d, d)) * 0.1
  d_o = rng.standard_normal((bsz, t, h, d))
  d_s = rng.standard_normal((bsz, h, d, d)) * 0.1
  return (q, k, v, a, b, s0), (d_o, d_s)


def _run(impl, args, cotangents):
  def f(q, k, v, a, b, s0):
    return deltajax.gated_delta(q, k, v, a, b, initial_state=s0, impl=impl,
                                return_final_state=True)
  (o, s), vjp = jax.vjp(f, *args)
  grads = vjp(tuple(jnp.asarray(c, x.dtype) for c, x in zip(cotangents,
                                                              (o, s))))
  names = ("dq", "dk", "dv", "da", "db", "dh0")
  out = dict(o=o, s=s, **dict(zip(names, grads)))
  return {n: np.asarray(x, np.float64) for n, x in out.items()}


@pytest.mark.parametrize("t,d", [(1, 64), (63, 100), (64, 128), (1000, 256),
                                 (4096, 128), (1000, 64)])
def test_pallas_bf16_matches_float64_reference(t, d):
  with jax.enable_x64(True):
    args, cts = _inputs(t, d, seed=t * 1000 + d)
    low = tuple(jnp.asarray(x, jnp.bfloat16) for x in args[:3]) + tuple(
        jnp.asarray(x, jnp.float32) for x in args[3:])
    # The reference sees the same (bf16-rounded) values, in float64.
    ref = _run("chunked", tuple(jnp.asarray(x, jnp.float64) for x in low), cts)
    got = _run("pallas", low, cts)
  errors = {n: np.linalg.norm(got[n] - ref[n]) / np.linalg.norm(ref[n])
            for n in TOLERANCES}
  print(f"T={t} D={d}: " + " ".join(f"{n}={e:.1e}" for n, e in errors.items()))
  for n, tol in TOLERANCES.items():
    assert np.all(np.isfinite(got[n])), n
    assert errors[n] <= tol, (n, errors[n])
