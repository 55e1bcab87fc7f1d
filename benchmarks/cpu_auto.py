"""Forward time of "scan" and "chunked" on the CPU against T: where "auto" switches.

``python benchmarks/cpu_auto.py`` prints, for each gate kind, the forward
time of both implementations (float32, B = 2, H = 4, K = V = 64, jit,
median of a few runs) and the shortest T at which "chunked" wins, which is
what ``deltajax.registry.SCAN_BELOW`` holds.
"""

from __future__ import annotations

import functools

import jax

import deltajax
from deltajax.__main__ import median_seconds
from deltajax.__main__ import random_inputs

LENGTHS = (32, 64, 128, 256, 512, 1024)


def main() -> None:
  print(f"JAX {jax.__version__}, {jax.devices()}")
  for gate, fn in (("head", deltajax.gated_delta), ("channel", deltajax.kda)):
    switch = None
    for t in LENGTHS:
      q, k, v, a, b = random_inputs(0, batch=2, length=t, heads=4, key_dim=64,
                                    value_dim=64)
      if gate == "channel":
        a = jax.numpy.broadcast_to(a[..., None], q.shape)
      ms = {impl: 1e3 * median_seconds(
          jax.jit(functools.partial(fn, impl=impl)), (q, k, v, a, b))
            for impl in ("scan", "chunked")}
      if switch is None and ms["chunked"] < ms["scan"]:
        switch = t
      print(f"{gate:>8} T={t:5d}: scan {ms['scan']:8.2f} ms, chunked "
            f"{ms['chunked']:8.2f} ms")
    print(f"{gate:>8}: chunked is faster from T = {switch}")


if __name__ == "__main__":
  main()
