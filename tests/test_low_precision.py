"""bfloat16 and float16 inputs against the float64 reference, with fla's tolerances.

As in fla's tests of the gated delta rule: realistic inputs (L2-normalised k,
``b = sigmoid(randn)``, ``a = logsigmoid(randn) * gate_scale`` from weak to
strong), a float32 initial state, random output and state cotangents, and the
relative RMS error ``||x - ref|| / ||ref||``. q, k, v, a and b are rounded to
the low dtype first; the reference is deltajax's scan in float64 on the same
rounded values (itself checked against reference A and autodiff in
test_forward.py and test_gradients.py).

Aligned keys near b = 2 (``allow_neg_eigval``) hold each implementation,
the GPU kernels included, to its own bound: there the kernels' 16-bit
operands cost far more than fla's tolerances.

float32 means float32: every matrix product of the jnp implementations
(forward and backward, both gates, the decoding step) asks for
``Precision.HIGHEST``, read from the jaxpr, since XLA's default takes TF32
products on NVIDIA GPUs (errors near 1e-3; the GPU run: tests/test_gpu.py).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import pytest

import deltajax
import utils

TOLERANCES = {"o": 0.005, "final_state": 0.005, "dq": 0.008, "dk": 0.008,
              "dv": 0.008, "da": 0.02, "db": 0.02, "dh0": 0.008}
NAMES = tuple(TOLERANCES)
# (B, T, H, K = V, gate_scale): fla's shapes, gates from weak to strong.
CASES = ((2, 75, 4, 60, 1.0), (1, 500, 1, 100, 10.0), (1, 1024, 4, 128, 0.1),
         (2, 1024, 1, 64, 1.0))
DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16}


@functools.lru_cache(maxsize=None)
def _case(case, dtype_name):
  """``(low, reference)``: the low-precision arguments and cotangents, and the
  float64 reference's outputs and gradients (float64 numpy, by name)."""
  bsz, t_len, heads, dim, gate_scale = case
  seed = 4000 + CASES.index(case) * 10 + list(DTYPES).index(dtype_name)
  x = utils.random_inputs(seed, batch=bsz, length=t_len, heads=heads,
                          key_dim=dim, value_dim=dim, gate_scale=gate_scale,
                          state_scale=1.0)
  return _rounded(x, utils.random_cotangents(seed + 1, x),
                  DTYPES[dtype_name])


def _rounded(x, cotangents, dtype):
  """:func:`_case`'s pair for inputs ``x`` (:class:`utils.Inputs`) and
  ``cotangents``, rounded to ``dtype``."""
  low = tuple(jnp.asarray(t, dtype) for t in x[:5]) + (
      jnp.asarray(x.initial_state, jnp.float32),)
  low_cotangents = (jnp.asarray(cotangents[0], dtype),
                    jnp.asarray(cotangents[1], jnp.float32))
  with jax.enable_x64(True):
    reference = _measure("scan", tuple(jnp.asarray(t, jnp.float64)
                                       for t in low), low_cotangents)
  return (low, low_cotangents), reference


def _measure(impl, args, cotangents):
  """Outputs and gradients of ``impl`` by name, as float64 numpy."""
  fn = jax.jit(functools.partial(utils.gated_delta, impl))
  outputs, grads = utils.vjp(fn, args, cotangents)
  return dict(zip(NAMES, (utils.as_float64(x) for x in (*outputs, *grads))))


@pytest.mark.parametrize("impl", ("chunked", "scan"))
@pytest.mark.parametrize("dtype_name", tuple(DTYPES))
@pytest.mark.parametrize(
    "case", CASES[:2] + tuple(utils.slow(c) for c in CASES[2:]),  # T = 1024
    ids=lambda c: "B{}_T{}_H{}_K{}_g{}".format(*c))
def test_matches_float64_reference(case, dtype_name, impl):
  _check(impl, _case(case, dtype_name), TOLERANCES,
         f"{impl} {dtype_name} {case}")


def _check(impl, case, bounds, label):
  """Runs ``impl`` on ``case`` (:func:`_case`'s pair) and asserts every
  relative RMS error against the float64 reference within ``bounds``."""
  (args, cotangents), reference = case
  got = _measure(impl, args, cotangents)
  errors = {n: utils.relative_rms_error(got[n], reference[n]) for n in NAMES}
  print(f"low precision {label}: relative RMS error "
        + ", ".join(f"{n} {e:.2g}" for n, e in errors.items()))
  assert all(np.isfinite(list(errors.values())))
  failed = {n: e for n, e in errors.items() if not e <= bounds[n]}
  assert not failed, f"above the bounds {bounds}: {failed}"


# Aligned keys near b = 2, the end of fla's ``allow_neg_eigval`` range:
# keys one direction plus 1 % noise, a = 0, b = 2 on one head (every
# transition ``I - 2 k k^T`` a reflection) and 1.99 on the other. The problem
# is well conditioned and the state stays bounded. (B, T, H, K = V.)
ALIGNED = (1, 256, 2, 64)
ALIGNED_NOISE = 0.01
ALIGNED_BETAS = (2.0, 1.99)  # per head
# The GPU kernels' bound on these inputs, relative RMS against float64
# (README, "Accuracy with aligned keys near b = 2"): the bf16 copy of T =
# (I + diag(b) Gamma * K K^T)^-1 that the scans and the backward multiply
# perturbs each chunk's state transition along the keys' common direction
# (the C^2 / 2 rounding errors of T add up there), and the perturbations
# compound over the chunks. T's copy alone costs o 0.16, da 0.26; every
# other 16-bit copy together 0.03 to 0.05. Measured in the CPU's
# interpreters (the GPU's three TF32 passes in the inverse and three bf16
# passes in P Delta, emulated, changed them by 10 % at most), with a
# margin of a quarter. The jnp implementations compute in float32: fla's
# tolerances.
ALIGNED_KERNELS = dict(o=0.22, final_state=0.22, dq=0.22, dk=0.16, dv=0.23,
                       da=0.34, db=0.34, dh0=0.035)
ALIGNED_BOUNDS = {"scan": TOLERANCES, "chunked": TOLERANCES,
                  "pallas": ALIGNED_KERNELS, "mosaic": ALIGNED_KERNELS}


@functools.lru_cache(maxsize=None)
def _aligned_case():
  """:func:`_case`'s pair for :data:`ALIGNED` in bfloat16."""
  bsz, t_len, heads, dim = ALIGNED
  seed = 4100
  x = utils.random_inputs(seed, batch=bsz, length=t_len, heads=heads,
                          key_dim=dim, value_dim=dim, state_scale=1.0)
  rng = np.random.default_rng(seed + 2)
  k = rng.standard_normal(dim) + ALIGNED_NOISE * rng.standard_normal(
      x.k.shape)
  x = x._replace(k=k / np.linalg.norm(k, axis=-1, keepdims=True),
                 a=np.zeros_like(x.a),
                 b=np.broadcast_to(ALIGNED_BETAS, x.b.shape))
  return _rounded(x, utils.random_cotangents(seed + 1, x), jnp.bfloat16)


@pytest.mark.parametrize("impl", ("scan", "chunked", "pallas",
                                  utils.slow("mosaic")))
def test_aligned_keys_near_b_2(impl):
  """bfloat16 q, k, v with aligned keys at b = 2 and 1.99 against float64,
  each implementation within its bound (:data:`ALIGNED_BOUNDS`); on a GPU,
  the kernels compiled (skipped where they cannot run)."""
  reason = deltajax.registry.REGISTRY[impl].unsupported(
      gate="head", chunk_size=64, packed=False, grouped=False)
  if reason:
    pytest.skip(reason)
  _check(impl, _aligned_case(), ALIGNED_BOUNDS[impl],
         f"{impl} aligned keys, b {ALIGNED_BETAS}, {ALIGNED}")


# Float32-exact settings of a dot_general's ``precision`` (per operand), as
# a Precision or a dot algorithm.
EXACT = (lax.Precision.HIGHEST, lax.DotAlgorithmPreset.F32_F32_F32)


def _dots(jaxpr):
  """Every dot_general equation of ``jaxpr`` and of the jaxprs inside it
  (jit, scan, while and cond bodies, custom_vjp primals)."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      yield eqn
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr
        if hasattr(sub, "eqns"):
          yield from _dots(sub)


def _traced(impl, per_channel, dtype):
  """Jaxprs ``(forward, forward and backward)`` of ``impl`` ("scan",
  "chunked" or the decoding step, "step") on ``dtype`` q, k, v and float32
  gates and state: two chunks, so that the blocked inverse and the
  per-channel score blocks run."""
  x = utils.random_inputs(7, batch=1, length=100, heads=2, key_dim=32,
                          value_dim=16, per_channel=per_channel)
  args = (*(jnp.asarray(t, dtype) for t in x[:3]),
          *(jnp.asarray(t, jnp.float32) for t in x[3:]))
  if impl == "step":
    fn = lambda q, k, v, a, b, s: deltajax.gated_delta_step(
        s, q[:, 0], k[:, 0], v[:, 0], a[:, 0], b[:, 0], impl="jnp")
  else:
    fn = functools.partial(utils.gated_delta, impl)
  cotangents = tuple(jnp.zeros_like(y) for y in jax.eval_shape(fn, *args))
  return (jax.make_jaxpr(fn)(*args),
          jax.make_jaxpr(lambda *a: utils.vjp(fn, a, cotangents))(*args))


@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16),
                         ids=("float32", "bfloat16"))
@pytest.mark.parametrize("per_channel", (False, True), ids=("gdn", "kda"))
@pytest.mark.parametrize("impl", ("chunked", "scan", "step"))
def test_every_product_is_float32_exact(impl, per_channel, dtype):
  """Every dot_general of the forward and the backward multiplies float32
  operands at HIGHEST precision (16-bit inputs are computed in float32)."""
  forward, backward = (list(_dots(j.jaxpr)) for j in _traced(
      impl, per_channel, dtype))
  print(f"{impl} {'kda' if per_channel else 'gdn'} {jnp.dtype(dtype).name}: "
        f"{len(forward)} products in the forward, {len(backward)} with the "
        f"backward")
  assert forward and len(backward) > len(forward)
  for eqn in backward:
    precision = eqn.params["precision"]
    precision = precision if isinstance(precision, tuple) else (precision,)
    assert all(p in EXACT for p in precision), eqn
    assert all(v.aval.dtype == jnp.float32 for v in eqn.invars), eqn
