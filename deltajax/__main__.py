"""``python -m deltajax``: every implementation on one small random input.

Prints the devices and the implementation that ``impl="auto"`` picks here
for each gate kind, then for each implementation in
``deltajax.registry.REGISTRY`` its max abs difference from "scan" and its
forward time (jit, ``block_until_ready``, median of a few runs).
"""

from __future__ import annotations

import functools
import statistics
import time

import jax
import jax.numpy as jnp

import deltajax
from deltajax import registry

SHAPE = dict(batch=2, length=256, heads=4, key_dim=64, value_dim=64)
REPEATS = 5


def random_inputs(seed: int, *, batch, length, heads, key_dim, value_dim):
  """float32 ``(q, k, v, a, b)``: L2-normalised k, ``a = logsigmoid``, ``b = sigmoid``.

  Shapes: q, k ``[B, T, H, K]``, v ``[B, T, H, V]``, a and b ``[B, T, H]``.
  """
  keys = jax.random.split(jax.random.key(seed), 5)
  q = jax.random.normal(keys[0], (batch, length, heads, key_dim))
  k = jax.random.normal(keys[1], (batch, length, heads, key_dim))
  k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
  v = jax.random.normal(keys[2], (batch, length, heads, value_dim))
  a = jax.nn.log_sigmoid(jax.random.normal(keys[3], (batch, length, heads)))
  b = jax.nn.sigmoid(jax.random.normal(keys[4], (batch, length, heads)))
  return q, k, v, a, b


def median_seconds(fn, args, repeats: int = REPEATS) -> float:
  """Median wall time of ``fn(*args)`` after one warm-up (compiling) call."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def main() -> None:
  print(f"deltajax {deltajax.__version__}, JAX {jax.__version__}, devices "
        f"{jax.devices()}")
  print("inputs: float32, " + ", ".join(f"{n}={s}" for n, s in SHAPE.items()))
  head_dim = max(SHAPE["key_dim"], SHAPE["value_dim"])
  for gate in registry.GATES:
    picks = {(t, dtype): registry.select(
        "auto", gate=gate, length=t, chunk_size=64, packed=False,
        grouped=False, wide=dtype == "float32", head_dim=head_dim).name
             for t in (SHAPE["length"], 4096)
             for dtype in ("float32", "bfloat16")}
    print(f'impl="auto" for the {gate!r} gate picks ' + ", ".join(
        f"{name!r} at T = {t} ({dtype} q, k, v)"
        for (t, dtype), name in picks.items()))
  args = random_inputs(0, **SHAPE)
  reference = None
  for impl, entry in registry.REGISTRY.items():
    fn = jax.jit(functools.partial(deltajax.gated_delta, impl=impl))
    # An implementation with 16-bit products takes bfloat16 q, k, v.
    x = args if entry.wide else (
        *(y.astype(jnp.bfloat16) for y in args[:3]), *args[3:])
    o = fn(*x).astype(jnp.float32)
    reference = o if reference is None else reference
    diff = float(jnp.max(jnp.abs(o - reference)))
    note = "" if entry.wide else " (bfloat16 q, k, v)"
    if entry.runs_natively():
      timing = f"forward {1e3 * median_seconds(fn, x):8.2f} ms"
    else:
      timing = "not timed (interpreted: no GPU)"
    print(f"{impl:>8}: max abs diff vs scan {diff:.2e}, {timing}{note}")


if __name__ == "__main__":
  main()
