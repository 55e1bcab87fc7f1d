"""impl="mosaic" on the H200: checked against "chunked", timed against "pallas".

    python -m benchmarks.mosaic_check [--variants mosaic:inv=mosaic ...]

(a) Correctness: the forward (o and the final state) of impl="mosaic"
against impl="chunked" (float32, HIGHEST products) on the same rounded
inputs, for float16 and bf16 q/k/v (it refuses float32 ones), at shapes with
T not a multiple of 64, an initial state, K = V = 64 and 128, odd head dims
and grouped value heads; then one forward+backward's gradients. Prints max
abs and relative RMS errors (fla's tolerance: 0.005 for o and the state,
0.008 for dq, dk, dv, dh0, 0.02 for da, db). (b) Speed: forward and
forward+backward of "mosaic" and "pallas" on benchmark.py's inputs (bf16)
and timing (:func:`benchmark.median_ms`). "mosaic:inv=mosaic" takes the
Mosaic GPU UT inverse, "mosaic:wide" hands the output's share
of dk on in float32 (``narrow_dk=False``), "mosaic:bwd=..."
is "mosaic" with the backward's Mosaic GPU kernels limited to those named
(``gated_delta_mosaic(..., backward=...)``; "pallas": none), to time each
against its Pallas counterpart. "mosaic:one" is the same
with the scan's other schedule (one warpgroup:
``gated_delta_mosaic(..., schedule="one")``; the default has three);
its forward checks run last. Every case catches its own exception and prints its first 300
characters. About six minutes on the H200 with every variant (run L):
``--variants`` picks some.
"""

from __future__ import annotations

import argparse
import functools
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import deltajax
from benchmarks.benchmark import MOSAIC_VARIANTS as VARIANTS
from benchmarks.benchmark import make_inputs, median_ms, mosaic_variant

# (B, T, H, HV, K, V)
CHECKS = [(2, 256, 2, 2, 64, 64), (2, 1000, 2, 2, 128, 128),
          (1, 100, 2, 4, 100, 60), (2, 4096, 4, 4, 128, 128)]
TIMED = [(4, 4096, 16, 128), (8, 1024, 8, 64)]
def _errors(got, ref):
  got, ref = (np.asarray(x, np.float64) for x in (got, ref))
  return (float(np.max(np.abs(got - ref))),
          float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)))


def _inputs(shape, seed, dtype):
  bsz, t, h, hv, dk, dv = shape
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((bsz, t, h, dk))
  k = rng.standard_normal((bsz, t, h, dk))
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  v = rng.standard_normal((bsz, t, hv, dv))
  a = -np.logaddexp(0, rng.standard_normal((bsz, t, hv))) / 4
  b = 1 / (1 + np.exp(-rng.standard_normal((bsz, t, hv))))
  s0 = 0.1 * rng.standard_normal((bsz, hv, dk, dv))
  low = tuple(jnp.asarray(x, dtype) for x in (q, k, v))
  return low + tuple(jnp.asarray(x, jnp.float32) for x in (a, b, s0))


def _call(impl, q, k, v, a, b, s0):
  """``(o, final state)`` of ``impl``, or of the contract function with the
  options of :data:`VARIANTS`."""
  if impl in VARIANTS:
    return mosaic_variant(impl, q, k, v, a, b, s0)
  return deltajax.gated_delta(q, k, v, a, b, initial_state=s0, impl=impl,
                              return_final_state=True)


def _run(label, fn):
  try:
    print(f"{label}: {fn()}", flush=True)
  except Exception as e:  # one failure must not hide the other cases
    text = "".join(traceback.format_exception_only(e)).replace("\n", " ")
    print(f"{label}: FAILED {text[:300]}", flush=True)


def check_forward(shape, dtype, impl="mosaic"):
  args = _inputs(shape, sum(shape), dtype)
  # The reference takes the same rounded values, in float32.
  ref_args = tuple(x.astype(jnp.float32) for x in args)
  o, s = jax.jit(functools.partial(_call, impl))(*args)
  ro, rs = jax.jit(functools.partial(_call, "chunked"))(*ref_args)
  (o_max, o_rel), (s_max, s_rel) = _errors(o, ro), _errors(s, rs)
  finite = bool(jnp.all(jnp.isfinite(o)) & jnp.all(jnp.isfinite(s)))
  return (f"o max {o_max:.1e} rel {o_rel:.1e} | state max {s_max:.1e} rel "
          f"{s_rel:.1e} | finite {finite} | "
          f"{'ok' if max(o_rel, s_rel) <= 0.005 and finite else 'OVER 0.005'}")


def check_gradients(shape, impl="mosaic"):
  args = _inputs(shape, 7, jnp.bfloat16)
  rng = np.random.default_rng(8)
  d_o = jnp.asarray(rng.standard_normal(args[2].shape), jnp.float32)
  d_s = jnp.asarray(rng.standard_normal(args[5].shape), jnp.float32)

  def grads(impl, args):
    def loss(*x):
      o, s = _call(impl, *x)
      return jnp.sum(o.astype(jnp.float32) * d_o) + jnp.sum(s * d_s)
    return jax.jit(jax.grad(loss, argnums=range(6)))(*args)

  got = grads(impl, args)
  ref = grads("chunked", tuple(x.astype(jnp.float32) for x in args))
  names = ("dq", "dk", "dv", "da", "db", "dh0")
  return " ".join(f"{n} {_errors(g, r)[1]:.1e}"
                  for n, g, r in zip(names, got, ref))


@functools.cache  # "pallas" is the baseline of both mosaic schedules
def time_impl(impl, shape):
  q, k, v, a, b, do = make_inputs(shape)
  q, k, v, do = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, do))
  a, b = jnp.asarray(a), jnp.asarray(b)
  s0 = jnp.zeros((*v.shape[:1], v.shape[2], q.shape[-1], v.shape[-1]))
  attention = lambda q, k, v, a, b: _call(impl, q, k, v, a, b, s0)[0]
  fwd = jax.jit(attention)
  fwd_bwd = jax.jit(jax.grad(
      lambda *x: jnp.sum(attention(*x).astype(jnp.float32) * do),
      argnums=range(5)))
  t_fwd = median_ms(lambda: fwd(q, k, v, a, b), 10)
  t_bwd = median_ms(lambda: fwd_bwd(q, k, v, a, b), 10)
  return t_fwd, t_bwd


def _checks_and_times(impl, checks, gradient_shape):
  """Prints the forward checks, one gradient check and the times of
  ``impl`` (and of "pallas" for the ratio)."""
  for shape in checks:
    for dtype in (jnp.float16, jnp.bfloat16):
      _run(f"{impl} forward {shape} {jnp.dtype(dtype).name}",
           functools.partial(check_forward, shape, dtype, impl))
  _run(f"{impl} gradients {gradient_shape} bf16 rel RMS",
       functools.partial(check_gradients, gradient_shape, impl))
  for shape in TIMED:
    times = {}
    for name in ("pallas", impl):
      def timed(name=name):
        times[name] = time_impl(name, shape)
        return "fwd {:.3f} ms, fwd+bwd {:.3f} ms".format(*times[name])
      _run(f"time {shape} {name}", timed)
    if len(times) == 2:
      (pf, pb), (mf, mb) = times["pallas"], times[impl]
      print(f"time {shape} {impl} / pallas: fwd {mf / pf:.2f}, fwd+bwd "
            f"{mb / pb:.2f}", flush=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--variants", nargs="*", default=list(VARIANTS),
                      choices=list(VARIANTS),
                      help="the variants to check and time after the default")
  args = parser.parse_args()
  print(f"JAX {jax.__version__}, {jax.devices()}")
  _checks_and_times("mosaic", CHECKS, (2, 1000, 2, 2, 128, 128))
  scans = ("mosaic:one",)
  for impl in args.variants:  # e.g. the backward's kernels one by one
    if impl not in scans:
      _checks_and_times(impl, [], (2, 1024, 2, 2, 128, 128))
  for impl in [i for i in scans if i in args.variants]:
    # The other scan schedule, called directly: T a multiple of 64.
    _checks_and_times(impl, [c for c in CHECKS if c[1] % 64 == 0],
                      (2, 1024, 2, 2, 128, 128))


if __name__ == "__main__":
  main()
