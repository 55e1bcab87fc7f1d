"""The implementations of the gated delta rule, each declaring what it supports.

:data:`REGISTRY` is read by ``impl="auto"``, by input validation, by
``deltajax.nn``, by the demo and by the tests (one implementation-by-feature
matrix). Every entry's function has the contract :data:`CONTRACT`; ``api``
normalises the user's inputs into it (gates, cuts, padding, packing) once.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax

from deltajax import chunked
from deltajax import mosaic
from deltajax import pallas
from deltajax import scan

CONTRACT = """``fn(q, k, v, a, b, initial_state, cut, chunk_seq, *, scale, chunk_size[,
config]) -> (o, final_state)``

* q, k ``[B, T, H, K]`` and v ``[B, T, HV, V]`` in the user's float dtypes,
  ``HV = G H`` (value head ``j`` reads query/key head ``j // G``), T a
  multiple of ``chunk_size``.
* a ``[B, T, HV, W]`` (``W = 1``: scalar gate; ``W = K``: per channel),
  ``<= 0``, ``-inf`` allowed: each implementation clamps it at
  :data:`common.LOG_DECAY_FLOOR` (:func:`common.floored`; the Pallas kernels
  in their gate kernel, where it costs no pass over a); scan and chunked
  make a gate at the floor a cut (a full forget); b ``[B, T, HV]``, or for
  the "gdn2" gate the pair
  ``(erase [B, T, HV, K], write [B, T, HV, V])``; in the compute dtype
  (float32, float64 for float64 inputs).
* initial_state ``[N, HV, K, V]`` in the compute dtype; ``N = B`` unless
  ``chunk_seq`` is given.
* cut: None, or bool of a's shape: the state before the token is discarded.
* chunk_seq: None, or int32 ``[T / chunk_size]`` with ``B = 1``: the
  (non-decreasing) sequence that owns each chunk. The first chunk of a
  sequence starts from ``initial_state[seq]``; the state leaving its last
  chunk is ``final_state[seq]``.
* config: only for an implementation whose :attr:`Implementation.config`
  is a class: an instance of it, or None (its defaults). A frozen
  dataclass validated when built, hashable (static under ``jit``).
* Returns o ``[B, T, HV, V]`` in v's dtype and final_state
  ``[N, HV, K, V]`` in the compute dtype; differentiable in q, k, v, a, b
  and initial_state (``jax.custom_vjp``).
"""

# "head": a [B, T, HV]; "channel": [B, T, HV, K]; "gdn2": a per channel, and
# b Gated DeltaNet-2's pair of erase and write gates.
GATES = ("head", "channel", "gdn2")


@dataclasses.dataclass(frozen=True)
class Implementation:
  """One implementation and what it supports.

  Attributes:
    name: the ``impl=`` name.
    fn: the function, with the contract :data:`CONTRACT`.
    gates: the gate kinds it computes ("head", "channel").
    chunk_sizes: the chunk sizes it accepts.
    packed: cuts and packed sequences (``cut``, ``chunk_seq``).
    grouped: grouped value heads (``HV > H``).
    native: the backends where it runs compiled ("cpu", "gpu", "tpu").
      Elsewhere it runs only if ``emulated`` (Pallas interpret mode).
    emulated: runs, slowly, off its native backends.
    min_capability: for "gpu", the lowest NVIDIA compute capability.
    wide: float32 and float64 q, k, v are computed at their precision;
      False: its products are 16-bit, and it takes 16-bit q, k, v only.
    max_head_dim: the largest K and V it takes (None: any).
    config: the class of its ``config=`` argument (:data:`CONTRACT`), its
      tuning knobs; None: it takes none.
  """
  name: str
  fn: Callable
  gates: tuple[str, ...]
  chunk_sizes: tuple[int, ...]
  packed: bool = True
  grouped: bool = True
  native: tuple[str, ...] = ("cpu", "gpu", "tpu")
  emulated: bool = False
  min_capability: tuple[int, int] | None = None
  wide: bool = True
  max_head_dim: int | None = None
  config: type | None = None

  def runs_natively(self) -> bool:
    """Whether it runs compiled on the default backend (and GPU)."""
    backend = jax.default_backend()
    if backend not in self.native:
      return False
    if backend == "gpu" and self.min_capability is not None:
      cc = pallas.gpu_capability()
      return cc is not None and cc >= self.min_capability
    return True

  def unsupported(self, *, gate: str, chunk_size: int, packed: bool,
                  grouped: bool, wide: bool = False,
                  head_dim: int = 0) -> str | None:
    """Why it cannot run this call, or None when it can; ``wide``: q, k, v
    in float32 or float64; ``head_dim``: the larger of K and V."""
    if gate not in self.gates:
      return f"it has no {gate!r} gate (it supports {self.gates})"
    if chunk_size not in self.chunk_sizes:
      return f"chunk_size must be one of {self.chunk_sizes}"
    if packed and not self.packed:
      return "it does not support segment_ids or cu_seqlens"
    if grouped and not self.grouped:
      return "it does not support grouped value heads"
    if wide and not self.wide:
      return ("its products are 16-bit: q, k and v must be bfloat16 or "
              "float16")
    if self.max_head_dim is not None and head_dim > self.max_head_dim:
      return f"it supports head dims up to {self.max_head_dim}"
    if not self.runs_natively() and not self.emulated:
      return f"it runs on {self.native} only, not {jax.default_backend()!r}"
    if (jax.default_backend() == "gpu" and self.min_capability is not None
        and not self.runs_natively()):
      cc = pallas.gpu_capability()
      return (f"it needs an NVIDIA GPU of compute capability >= "
              f"{'.'.join(map(str, self.min_capability))}; this one is "
              f"{cc[0]}.{cc[1]}")
    return None


CHUNK_SIZES = tuple(2 ** i for i in range(9))  # every implementation's, united

REGISTRY = {
    "scan": Implementation(
        "scan", scan.gated_delta_scan, gates=GATES, chunk_sizes=CHUNK_SIZES),
    "chunked": Implementation(
        "chunked", chunked.gated_delta_chunked, gates=GATES,
        chunk_sizes=CHUNK_SIZES),
    "pallas": Implementation(
        "pallas", pallas.gated_delta_pallas, gates=GATES,
        chunk_sizes=(16, 32, 64), native=("gpu",),
        emulated=True, min_capability=pallas.MIN_CAPABILITY,
        config=pallas.Config),
    # Hopper only; faster than "pallas" on the H100 and H200, forward and
    # forward+backward, for every gate at every shape timed
    # (benchmarks/RESULTS.md).
    "mosaic": Implementation(
        "mosaic", mosaic.gated_delta_mosaic, gates=GATES,
        chunk_sizes=(64,), native=("gpu",), emulated=True,
        min_capability=mosaic.MIN_CAPABILITY, wide=False,
        max_head_dim=mosaic.MAX_HEAD_DIM, config=mosaic.Config),
}

# The kernels "auto" considers, fastest first.
AUTO_KERNELS = ("mosaic", "pallas")

IMPLEMENTATIONS = ("auto", *REGISTRY)

# On the CPU the forward of "scan" beats "chunked" below these lengths (T, per
# gate kind): benchmarks/cpu_auto.py, B = 2, H = 4, K = V = 64, float32
# (RESULTS.md, "CPU: scan against chunked"); for the per-channel gate at every
# length measured (up to 1024, 2 to 10x).
SCAN_BELOW = {"head": 1024, "channel": float("inf"),
              "gdn2": float("inf")}  # as the per-channel gate (not measured)


def config_owner(impl: str, config) -> Implementation | None:
  """The implementation whose config class ``config`` is an instance of
  (None for None): the one it sends ``impl="auto"`` to, and the only one
  a named ``impl`` may be.

  Raises:
    TypeError: ``config`` is no implementation's config, or not ``impl``'s.
  """
  if config is None:
    return None
  owner = next((i for i in REGISTRY.values()
                if i.config is not None and isinstance(config, i.config)),
               None)
  if owner is None:
    known = ", ".join(f"{i.config.__module__}.{i.config.__qualname__} "
                      f"(impl={i.name!r})" for i in REGISTRY.values()
                      if i.config is not None)
    raise TypeError(f"config must be None or one of {known}; got "
                    f"{type(config).__name__} {config!r}")
  if impl not in ("auto", owner.name):
    takes = REGISTRY[impl].config if impl in REGISTRY else None
    raise TypeError(f"config={config!r} is impl={owner.name!r}'s; impl="
                    f"{impl!r} takes "
                    + ("no config" if takes is None else
                       f"{takes.__module__}.{takes.__qualname__}"))
  return owner


def select(impl: str, *, gate: str, length: int, chunk_size: int,
           packed: bool, grouped: bool, wide: bool = False,
           head_dim: int = 0, config=None) -> Implementation:
  """The implementation that runs a call: ``impl``, or the fastest for "auto".

  "auto" takes the first of :data:`AUTO_KERNELS` ("mosaic" on Hopper, then
  "pallas" on NVIDIA GPUs of compute capability >= 8.0) that runs natively
  and supports the call; else "scan"
  for short sequences on the CPU (:data:`SCAN_BELOW`); else "chunked".
  With a ``config``, "auto" is the implementation whose config it is
  (:func:`config_owner`), as if named.

  Raises:
    TypeError: ``config`` is not ``impl``'s (:func:`config_owner`).
    ValueError: ``impl`` is unknown or cannot run this call (or, under
      "auto", the implementation of ``config``).
  """
  features = dict(gate=gate, chunk_size=chunk_size, packed=packed,
                  grouped=grouped, wide=wide, head_dim=head_dim)
  owner = config_owner(impl, config)
  if impl == "auto" and owner is not None:
    reason = owner.unsupported(**features)
    if reason is not None:
      raise ValueError(f"config={config!r} is impl={owner.name!r}'s, which "
                       f"cannot run this call: {reason}. config=None lets "
                       f"impl='auto' pick one that can.")
    return owner
  if impl == "auto":
    for kernels in map(REGISTRY.get, AUTO_KERNELS):
      if kernels.runs_natively() and not kernels.unsupported(**features):
        return kernels
    if jax.default_backend() == "cpu" and length < SCAN_BELOW[gate]:
      return REGISTRY["scan"]
    return REGISTRY["chunked"]
  if impl not in REGISTRY:
    raise ValueError(f"impl must be one of {IMPLEMENTATIONS}; got {impl!r}")
  reason = REGISTRY[impl].unsupported(**features)
  if reason is not None:
    raise ValueError(f"impl={impl!r} cannot run this call: {reason}. "
                     f"impl='auto' picks one that can.")
  return REGISTRY[impl]
