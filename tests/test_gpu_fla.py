"""fla's test grids through ``impl="auto"`` on the GPU: what a user gets.

fla's Gated DeltaNet grid (T x D x gate normaliser x scale x half the gates
zeroed), its KDA and Gated DeltaNet-2 shapes (with the gate formed inside
from ``A_log``/``dt_bias``, the safe gate clamped at -5 and the q/k L2 norm
inside), its packed sequences (``cu_seqlens``, gates of -1000 on masked
tokens) and grouped value heads, each in float16 and bfloat16, against the
float64 token recurrence (``impl="scan"``, the definition) on the same
rounded inputs: fla's metric and tolerances (relative RMS error), every
output and gradient finite.

Cases of one shape and scale share a call (their rows side by side in the
batch), and both dtypes share the float64 reference, so the module compiles
once per shape, scale and dtype; compiling dominates, so the GPU tests run
in parallel workers: ``python -m pytest -m gpu -n 14 tests``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deltajax
import utils

pytestmark = utils.GPU_TESTS

DTYPES = (jnp.float16, jnp.bfloat16)
TOLERANCES = dict(o=0.005, s=0.005, dq=0.008, dk=0.008, dv=0.008, da=0.02,
                  db=0.02, dw=0.02, dh0=0.008)
RULES = dict(gdn=deltajax.gated_delta, kda=deltajax.kda, gdn2=deltajax.gdn2)


def _normalize(x):
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _sigmoid(x):
  return 1 / (1 + np.exp(-x))


def _inputs(rng, *, bsz, t, h, d, hv=None, rule="gdn", div=1.0, mask_p=0.0,
            safe_gate=False, raw_gate=False, states=None):
  """float64 numpy ``(q, k, v, a, b[, w], h0)`` as fla's tests draw them:
  q, k uniform and L2-normalised (KDA, Gated DeltaNet-2) or normal with k
  normalised (Gated DeltaNet), v normal, gates ``logsigmoid(N(0, 1)) / div``
  with a fraction ``mask_p`` zeroed (``raw_gate``: N(0, 1), for A_log and
  dt_bias), beta ``sigmoid(N(0, 1))``, a random initial state."""
  hv = h if hv is None else hv
  per_channel = rule != "gdn"
  draw = rng.uniform if per_channel else rng.standard_normal
  q = draw(size=(bsz, t, h, d))
  k = _normalize(draw(size=(bsz, t, h, d)))
  if per_channel:
    q = _normalize(q)
  v = rng.standard_normal((bsz, t, hv, d))
  a = rng.standard_normal((bsz, t, hv) + ((d,) if per_channel else ()))
  if not raw_gate:
    a = -np.logaddexp(0.0, -a) / div
    a = np.where(rng.uniform(size=a.shape) < mask_p, 0.0, a)
    if safe_gate:
      a = np.maximum(a, -5.0)
  b = _sigmoid(rng.standard_normal((bsz, t, hv)))
  gates = (b,)
  if rule == "gdn2":
    gates = (_sigmoid(rng.standard_normal((bsz, t, hv, d))),
             _sigmoid(rng.standard_normal((bsz, t, hv, d))))
  h0 = rng.standard_normal((bsz if states is None else states, hv, d, d))
  return (q, k, v, a, *gates, h0)


def _cotangents(rng, args):
  """``(d_o, d_final)`` for ``args``' outputs."""
  v, h0 = args[2], args[-1]
  return rng.standard_normal(v.shape), rng.standard_normal(h0.shape)


def _value_and_grads(rule, impl, args, cts, **options):
  """``{name: float64 numpy}``: the outputs and every input's gradient."""
  fn = RULES[rule]

  def run(args, cts):
    f = lambda *x: fn(*x[:-1], initial_state=x[-1], impl=impl,
                      return_final_state=True, **options)
    out, vjp = jax.vjp(f, *args)
    return out, vjp(tuple(c.astype(o.dtype) for c, o in zip(cts, out)))

  out, grads = jax.jit(run)(args, tuple(jnp.asarray(c) for c in cts))
  names = ("o", "s", "dq", "dk", "dv", "da",
           *(("db", "dw") if rule == "gdn2" else ("db",)), "dh0")
  return {n: np.asarray(x, np.float64)
          for n, x in zip(names, (*out, *grads))}


def _rounded(args, dtype):
  """q, k, v in ``dtype``, the rest float32: the user's call."""
  return (tuple(jnp.asarray(x, dtype) for x in args[:3])
          + tuple(jnp.asarray(x, jnp.float32) for x in args[3:]))


def _check(rule, args, cts, *, cases=1, packed=False, label="", **options):
  """``impl="auto"`` in each of :data:`DTYPES` against float64 on the same
  rounded values, per case (``cases`` equal runs of rows along the batch).
  Unpacked, the dtypes' rounded inputs go through the reference side by
  side in one call."""
  calls = [_rounded(args, dtype) for dtype in DTYPES]
  as_float64 = lambda x: jnp.asarray(np.asarray(x, np.float64))
  with jax.enable_x64(True):
    if packed:
      refs = [_value_and_grads(rule, "scan", tuple(map(as_float64, low)),
                               cts, **options) for low in calls]
    else:
      both = tuple(as_float64(np.concatenate([np.asarray(low[i], np.float64)
                                              for low in calls]))
                   for i in range(len(args)))
      ref = _value_and_grads(rule, "scan", both,
                             tuple(np.concatenate([c, c]) for c in cts),
                             **options)
      refs = [{n: x[i * len(x) // 2:(i + 1) * len(x) // 2]
               for n, x in ref.items()} for i in range(2)]
  failures = []
  for dtype, low, ref in zip(DTYPES, calls, refs):
    got = _value_and_grads(rule, "auto", low, cts, **options)
    for name, x in got.items():
      tol = TOLERANCES[name]
      assert np.all(np.isfinite(x)), (label, jnp.dtype(dtype).name, name)
      for case, (g, r) in enumerate(zip(np.split(x, cases),
                                        np.split(ref[name], cases))):
        norm = np.linalg.norm(r)
        err = np.linalg.norm(g - r) / norm if norm > 1e-12 else 0.0
        if err > tol:
          failures.append(f"{label} case {case} {jnp.dtype(dtype).name} "
                          f"{name}: {err:.2e} > {tol}")
  assert not failures, "\n".join(failures)


# fla's Gated DeltaNet grid: for each (T, D, scale), the six gates (normaliser
# 0.1, 1, 10; none or half of the gates zeroed) side by side, two rows each.
GDN_GATES = [(div, mask_p) for div in (0.1, 1.0, 10.0) for mask_p in (0, 0.5)]


@pytest.mark.parametrize("scale", [1.0, 0.1])
@pytest.mark.parametrize("d", [32, 64, 100, 256])
@pytest.mark.parametrize("t", [1, 15, 63, 300])
def test_gdn_grid(t, d, scale):
  rng = np.random.default_rng([t, d, int(10 * scale)])
  cases = [_inputs(rng, bsz=2, t=t, h=2, d=d, div=div, mask_p=mask_p)
           for div, mask_p in GDN_GATES]
  args = tuple(np.concatenate(x) for x in zip(*cases))
  _check("gdn", args, _cotangents(rng, args), cases=len(cases), scale=scale,
         label=f"gdn T={t} D={d} scale={scale}")


# fla's KDA and Gated DeltaNet-2 shapes: (B, T, H, D, scale, normaliser,
# mask_p, q/k L2 norm inside, gate from A_log and dt_bias, safe gate).
KDA_SHAPES = [
    (1, 63, 1, 64, 1.0, 1, 0, False, False, True),
    (2, 500, 3, 60, 1.0, 1, 0, False, False, True),
    (2, 1000, 3, 64, 0.1, 1, 0.5, False, False, False),
    (3, 1024, 4, 100, 1.0, 0.1, 0, False, False, False),
    (4, 1024, 4, 128, 0.1, 1, 0, False, False, True),
    (4, 1024, 4, 128, 0.1, 1, 0, True, False, True),
    (2, 1500, 4, 128, 0.1, 10, 0, False, True, False),
    (4, 2048, 8, 64, 0.1, 1, 0, False, True, True),
]


@pytest.mark.parametrize("rule", ["kda", "gdn2"])
@pytest.mark.parametrize("shape", KDA_SHAPES, ids=str)
def test_kda_shapes(shape, rule):
  bsz, t, h, d, scale, div, mask_p, l2norm, gate_inside, safe = shape
  rng = np.random.default_rng([bsz, t, h, d])
  args = _inputs(rng, bsz=bsz, t=t, h=h, d=d, rule=rule, div=div,
                 mask_p=mask_p, safe_gate=safe, raw_gate=gate_inside)
  options = dict(scale=scale, use_qk_l2norm=l2norm)
  if gate_inside:
    options.update(A_log=jnp.asarray(rng.standard_normal(h), jnp.float32),
                   dt_bias=jnp.asarray(rng.standard_normal((h, d)),
                                       jnp.float32))
  _check(rule, args, _cotangents(rng, args), label=f"{rule} {shape}",
         **options)


# fla's packed sequences: (rule, H, D, mask_p, cu_seqlens); per channel,
# masked tokens take a gate of -1000 (a full forget, in effect).
PACKED = [
    ("gdn", 4, 60, 0, [0, 15]),
    ("gdn", 4, 64, 0, [0, 256, 500, 1000]),
    ("gdn", 4, 64, 0.5, [0, 256, 500, 1000]),
    ("gdn", 4, 100, 0, [0, 15, 100, 300, 1200, 2000]),
    ("kda", 4, 60, 0.1, [0, 15]),
    ("kda", 4, 64, 0.9, [0, 256, 500, 1000]),
    ("kda", 4, 128, 0.5, [0, 256, 500, 1000]),
    ("kda", 4, 100, 0, [0, 15, 100, 300, 1200, 2000]),
    ("kda", 4, 256, 0, [0, 100, 300, 1200, 3000, 4096]),
]


@pytest.mark.parametrize("case", PACKED, ids=str)
def test_packed(case):
  rule, h, d, mask_p, cu = case
  rng = np.random.default_rng([h, d, len(cu), int(10 * mask_p)])
  args = _inputs(rng, bsz=1, t=cu[-1], h=h, d=d, rule=rule, mask_p=mask_p,
                 states=len(cu) - 1)
  if rule == "kda":
    a = np.where(rng.uniform(size=args[3].shape) < mask_p, -1000.0, args[3])
    args = (*args[:3], a, *args[4:])
  _check(rule, args, _cotangents(rng, args), packed=True,
         cu_seqlens=jnp.asarray(cu, jnp.int32), label=f"packed {case}")


# fla's grouped value heads: (B, T, H, HV, D, scale, normaliser).
GROUPED = [(2, 1000, 2, 8, 128, 1.0, 0.1), (2, 1024, 4, 8, 128, 1.0, 10)]


@pytest.mark.parametrize("rule", ["gdn", "kda"])
@pytest.mark.parametrize("shape", GROUPED, ids=str)
def test_grouped_value_heads(shape, rule):
  bsz, t, h, hv, d, scale, div = shape
  rng = np.random.default_rng([bsz, t, h, hv])
  args = _inputs(rng, bsz=bsz, t=t, h=h, hv=hv, d=d, rule=rule, div=div)
  _check(rule, args, _cotangents(rng, args), scale=scale,
         label=f"{rule} grouped {shape}")
