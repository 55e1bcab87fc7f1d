"""Times sequence parallelism (deltajax.parallel) against one device.

On GPUs (the defaults: T = 65536 and 262144, 1 and 2 devices)::

    PYTHONPATH=. python benchmarks/parallel_bench.py

On CPU devices at small T, to demonstrate (``--impl scan``: on a machine
with few cores, jaxlib 0.10's batched LAPACK triangular solve, which impl
"chunked" uses on CPU, can deadlock when several CPU devices run it at
once)::

    PYTHONPATH=. python benchmarks/parallel_bench.py --cpu-devices 2 \\
        --t 1024 4096 --h 4 --dk 32 --dv 32 --dtype float32 --impl scan

For each T it prints the forward and forward+backward time of
``deltajax.gated_delta`` on one device and of
``gated_delta_sequence_parallel`` on each device count, and the pieces of a
device's work that the design rests on: one device's segment with V and with
V + K value columns (the augmented pass that also yields the segment's
transition), and the cross-device combine done by log2(D) rounds of
ppermute doubling (deltajax's) against an all-gather of every map.
"""

import argparse
import os
import statistics
import sys
import time


def parse_args():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--t", type=int, nargs="+", default=[65536, 262144])
  p.add_argument("--devices", type=int, nargs="+", default=[1, 2])
  p.add_argument("--b", type=int, default=1)
  p.add_argument("--h", type=int, default=16)
  p.add_argument("--dk", type=int, default=128)
  p.add_argument("--dv", type=int, default=128)
  p.add_argument("--gate", choices=("gdn", "kda"), default="gdn")
  p.add_argument("--impl", default="auto")
  p.add_argument("--chunk-size", type=int, default=64)
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--reps", type=int, default=10)
  p.add_argument("--cpu-devices", type=int, default=0,
                 help="run on this many CPU devices instead of accelerators")
  return p.parse_args()


ARGS = parse_args()
if ARGS.cpu_devices:
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count="
                             f"{ARGS.cpu_devices}")
  os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import deltajax
from deltajax import parallel


def median_ms(fn, *args):
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(ARGS.reps):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times)


def make_inputs(t, dv=None):
  """Random q, k, v, a, b in ``--dtype`` (gates in float32), unit-norm keys."""
  dv = dv or ARGS.dv
  keys = jax.random.split(jax.random.key(t), 5)
  shape = (ARGS.b, t, ARGS.h, ARGS.dk)
  dtype = jnp.dtype(ARGS.dtype)
  q = jax.random.normal(keys[0], shape, dtype)
  k = jax.random.normal(keys[1], shape, jnp.float32)
  k = (k / jnp.linalg.norm(k, axis=-1, keepdims=True)).astype(dtype)
  v = jax.random.normal(keys[2], (*shape[:3], dv), dtype)
  gate_shape = shape if ARGS.gate == "kda" else shape[:3]
  a = -0.05 * jax.nn.softplus(jax.random.normal(keys[3], gate_shape))
  b = jax.nn.sigmoid(jax.random.normal(keys[4], shape[:3]))
  return q, k, v, a, b


def fwd_and_grad(attention):
  """Jitted forward and forward+backward (grads of q, k, v, a, b)."""
  loss = lambda *x: jnp.sum(attention(*x).astype(jnp.float32))
  return (jax.jit(attention),
          jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))))


def single_device(x):
  attention = lambda *x: deltajax.gated_delta(
      *x, impl=ARGS.impl, chunk_size=ARGS.chunk_size)
  x = jax.device_put(x, jax.devices()[0])
  return [median_ms(fn, *x) for fn in fwd_and_grad(attention)], jax.jit(
      attention)(*x)


def sequence_parallel(x, mesh):
  attention = lambda *x: parallel.gated_delta_sequence_parallel(
      *x, mesh=mesh, axis_name="sp", impl=ARGS.impl,
      chunk_size=ARGS.chunk_size)
  x = [jax.device_put(y, NamedSharding(mesh, P(None, "sp")))
       for y in x]
  return [median_ms(fn, *x) for fn in fwd_and_grad(attention)], jax.jit(
      attention)(*x)


def segment_pass_ms(t):
  """Forward of one device's segment with V and with V + K value columns."""
  run = jax.jit(lambda *x: deltajax.gated_delta(
      *x, impl=ARGS.impl, chunk_size=ARGS.chunk_size))
  device = jax.devices()[0]
  return [median_ms(run, *jax.device_put(make_inputs(t, dv), device))
          for dv in (ARGS.dv, ARGS.dv + ARGS.dk)]


def combine_all_gather(f, g, initial_state, axis_name):
  """The alternative combine: all-gather every segment's map, then each
  device applies the maps before its own, one after another."""
  dv = g.shape[-1]
  maps = lax.all_gather(jnp.concatenate([g, f], axis=-1), axis_name)
  entry_states = [initial_state]
  for segment_map in maps[:-1]:
    entry_states.append(segment_map[..., dv:] @ entry_states[-1]
                        + segment_map[..., :dv])
  return jnp.stack(entry_states)[lax.axis_index(axis_name)]


def combine_ms(mesh):
  """Time of deltajax's combine (ppermute doubling) and of all-gather."""
  n = mesh.shape["sp"]
  dk, dv, shape = ARGS.dk, ARGS.dv, (n * ARGS.b, ARGS.h)
  keys = jax.random.split(jax.random.key(0), 3)
  f = 0.3 * jax.random.normal(keys[0], (*shape, dk, dk)) / dk ** 0.5
  g = jax.random.normal(keys[1], (*shape, dk, dv))
  s0 = jax.random.normal(keys[2], (ARGS.b, ARGS.h, dk, dv))
  segment = NamedSharding(mesh, P("sp"))
  f, g = jax.device_put((f, g), segment)
  s0 = jax.device_put(s0, NamedSharding(mesh, P()))
  results, times = [], []
  doubling = parallel._segment_initial_state  # pylint: disable=protected-access
  for combine in (doubling, combine_all_gather):
    fn = jax.jit(jax.shard_map(
        lambda f, g, s, combine=combine: combine(f, g, s, "sp"), mesh=mesh,
        in_specs=(P("sp"), P("sp"), P()), out_specs=P("sp")))
    results.append(fn(f, g, s0))
    times.append(median_ms(fn, f, g, s0))
  scale = float(jnp.max(jnp.abs(results[0])))
  assert float(jnp.max(jnp.abs(results[0] - results[1]))) <= 1e-4 * scale
  return times


def main():
  print(f"jax {jax.__version__}, {jax.device_count()} x "
        f"{jax.devices()[0].device_kind}; B={ARGS.b} H={ARGS.h} K={ARGS.dk} "
        f"V={ARGS.dv} {ARGS.gate} impl={ARGS.impl} C={ARGS.chunk_size} "
        f"{ARGS.dtype}; median of {ARGS.reps}")
  print("| T | devices | fwd ms | fwd+bwd ms | fwd speedup | fwd+bwd speedup "
        "| max abs diff vs 1 device | segment fwd ms, V / V+K columns "
        "| combine ms, doubling (deltajax) / all-gather |")
  print("|---|---|---|---|---|---|---|---|---|")
  for t in ARGS.t:
    x = make_inputs(t)
    base, reference = None, None
    for n in ARGS.devices:
      if n > jax.device_count():
        print(f"skipping {n} devices: only {jax.device_count()}",
              file=sys.stderr)
        continue
      if n == 1:
        times, o = single_device(x)
        base, reference = times, np.asarray(o, np.float32)
        pieces = segment_pass_ms(t)
        combine = [0.0, 0.0]
      else:
        mesh = jax.make_mesh((n,), ("sp",), devices=jax.devices()[:n])
        times, o = sequence_parallel(x, mesh)
        pieces = segment_pass_ms(t // n)
        combine = combine_ms(mesh)
      speedup = (["%.2f" % (b / m) for b, m in zip(base, times)] if base
                 else ["-", "-"])
      diff = ("%.2e" % np.max(np.abs(np.asarray(o, np.float32) - reference))
              if reference is not None and n > 1 else "-")
      print(f"| {t} | {n} | {times[0]:.2f} | {times[1]:.2f} | {speedup[0]} | "
            f"{speedup[1]} | {diff} | {pieces[0]:.2f} / {pieces[1]:.2f} | "
            f"{combine[0]:.3f} / {combine[1]:.3f} |", flush=True)


if __name__ == "__main__":
  main()
