"""``impl="mosaic"``: Gated DeltaNet as Mosaic GPU kernels (Hopper).

Forward: the UT inverse (parallel over chunks; the Pallas kernel
:func:`deltajax.pallas.ut.inverse` by default, timed at half of
:func:`ut.inverse`'s time on the H200, or with ``inverse="mosaic"`` that
one) -> :func:`scan.forward` (the state scan and the output fused,
sequential over chunks, in one of :data:`scan.SCHEDULES`: by default
"specialized", three warpgroups, for the per-head gate). The products run
on the tensor cores with 16-bit operands, so q, k and v must be 16-bit (the
registry refuses float32 and float64 ones: ``wide=False``); gates, beta,
the state and every accumulation are float32.

Backward: the steps of :func:`deltajax.pallas.ops.backward`, on the inputs
and residuals in the forward's layout (head dims zero-padded to 64 or 128,
:func:`_padded`), each kernel in Mosaic GPU: ``W`` (and ``U`` for the Pallas
ut_backward:
:func:`ut.w_u`), the output's backward
(:func:`output.output_backward`), the reverse state pass
(:func:`reverse.backward`), the backward through the UT transform
(:func:`ut_backward.ut_backward`). The forward under differentiation also
writes what that backward keeps from its own forward (``T``, the chunk-entry
states, Delta), so nothing is recomputed. With
``fused_reverse`` (and the scan's three warpgroups), the reverse pass has
three too and forms W and the output's share of dDelta itself
(:func:`reverse.specialized`): no ``ut.w_u``, and no float32 dDelta_local
through HBM. With ``fused_grads`` (and ``fused_reverse``), the output's
backward and the backward through the UT transform are one kernel of three
warpgroups (:func:`chunk_backward.chunk_backward`) that forms Delta and
dDelta again from the states and their cotangents: the forward saves no
Delta, the reverse pass writes no dDelta, and the output's share of dk
stays in shared memory: three temporaries fewer.

A per-channel gate (KDA, ``a [B, T, HV, K]``): the Pallas kernels form the
gate, the decayed operands ``Q e^g``, ``K e^g``, ``K e^{g_C - g}``, the
intra-chunk scores and T (:func:`deltajax.pallas.intra.forward`,
:func:`deltajax.pallas.ut.inverse`), as ``impl="pallas"`` does; the scan
and the output are :func:`scan.forward`'s (schedule "one"), and the backward
is the Pallas one (:func:`deltajax.pallas.ops.backward`) on the residuals
it keeps (with P), but for W, the reverse state pass and the backward
through the UT transform, which run in Mosaic GPU (:func:`ut.w_u`,
:func:`reverse.backward` on the decayed operands,
:func:`ut_backward.ut_backward` on the gate's tile) where ``backward`` has
them, and the scores' backward (:func:`intra.backward` through each
chunk's midpoint gate, the Pallas kernel by blocks after it where the gate
falls steeply), all by default (run Y saw non-finite da through the
scores' backward before its triangle came from shared memory; RESULTS
run Z: finite and repeatable). The output's Mosaic backward takes the
per-head gate only.

Few long sequences (CTAs filling at most half the multiprocessors) are
cut into equal runs of chunks walked side by side (``pieces``): the runs'
affine maps (:func:`scan.piece_maps`) composed into each run's entry state
for the scan, and in the backward a local reverse pass per run whose
shares of the entry cotangents are carried back through the maps'
transposes before the reverse pass walks every run
(:func:`_reverse_in_pieces`).

Supported: the per-head and per-channel gates, ``chunk_size = 64``, head
dims up to 128 (zero-padded to 64 or 128), grouped value heads (the kernels
read q/k head ``j // G``); not Gated DeltaNet-2's gates, cuts or packed
sequences.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from deltajax import common
from deltajax.mosaic import chunk_backward
from deltajax.mosaic import compat
from deltajax.mosaic import intra
from deltajax.mosaic import output
from deltajax.mosaic import reverse
from deltajax.mosaic import scan
from deltajax.mosaic import ut_backward
from deltajax.mosaic import ut
from deltajax.pallas import core as pallas_core
from deltajax.pallas import intra as pallas_intra
from deltajax.pallas import ops as pallas_ops
from deltajax.pallas import ut as pallas_ut

MIN_CAPABILITY = (9, 0)
CHUNK = ut.C
MAX_HEAD_DIM = 128


class _BackwardKernel(NamedTuple):
  """A backward kernel with a Mosaic GPU form."""
  keyword: str  # of pallas.ops.backward, for the Pallas kernel it replaces
  mosaic: Callable
  args: tuple[str, ...]  # the Pallas kernel's that the Mosaic one takes


class _WFromT(NamedTuple):
  """W left to the reverse pass (:func:`reverse.specialized`), which forms
  it from T and beta."""
  t: jax.Array
  beta: jax.Array


def _w_u(mg, k, v, g, b, t, *, values, deferred):
  """:func:`ut.w_u`, or with ``deferred`` its inputs for the reverse
  pass."""
  if deferred:
    return _WFromT(t, b), None
  return ut.w_u(mg, k, v, g, b, t, values=values)


def _reverse(mg, q, k, w, g, d_o, d_delta_local, d_final, scale, decayed,
             maps=None, deltas=True, **options):
  """:func:`reverse.backward` on the Pallas pass's arguments: per channel
  (``decayed``: ``(Q e^g, K e^{g_C - g})``; g at each chunk's end), those
  in place of q and k; :func:`reverse.specialized` where W is left to it
  (it forms dDelta_local too; without ``deltas`` it writes no dDelta).
  With ``maps`` (of the forward's pieces but the first, ``[P - 1, B, HV,
  K, K]``), in those pieces (:func:`_reverse_in_pieces`)."""
  if isinstance(w, _WFromT):
    run = functools.partial(reverse.specialized, mg, q, k, w.t, g, w.beta,
                            d_o, scale=scale, deltas=deltas)
  else:
    if decayed is not None:
      q, k = decayed
    run = functools.partial(reverse.backward, mg, q, k, w, g, d_o,
                            d_delta_local, scale=scale,
                            per_channel=decayed is not None, **options)
  if maps is None:
    return run(d_final)
  return _reverse_in_pieces(run, d_final, maps, q.shape[1] // CHUNK)


def _reverse_in_pieces(run, d_final, maps, n_chunks):
  """The reverse pass ``run`` in the forward's pieces, side by side: a
  local pass gives each piece but the first its own share of its entry
  state's cotangent ``D``; carried back from the last piece, the cotangent
  leaving piece ``p - 1`` is ``M_p^T (that leaving p) + D_p``; then each
  piece runs from the cotangent leaving it."""
  count, bsz = maps.shape[0] + 1, d_final.shape[0]
  length = n_chunks // count
  local = run(jnp.zeros((bsz * (count - 1), *d_final.shape[1:]),
                        d_final.dtype),
              pieces=scan.Pieces(count - 1, length, start=1), local=True)
  by_piece = lambda x: jnp.moveaxis(
      x.reshape(bsz, count - 1, *x.shape[1:]), 1, 0)
  first, later = common.piece_entry_states(
      d_final, jnp.swapaxes(maps, -1, -2)[::-1], by_piece(local)[::-1])
  exits = jnp.concatenate([first[None], later[::-1]])
  d_delta, d_next, d_initial = run(
      jnp.moveaxis(exits, 0, 1).reshape(-1, *d_final.shape[1:]),
      pieces=scan.Pieces(count, length))
  return d_delta, d_next, d_initial[::count]


class _Output(NamedTuple):
  """The output's backward left to :func:`chunk_backward.chunk_backward`
  (in place of its share of dk): its inputs that ut_backward lacks."""
  q: jax.Array
  d_o: jax.Array
  scale: float


def _output(mg, q, k, g, states, delta, d_o, *, scale, fused, **options):
  """:func:`output.output_backward`, or with ``fused`` its inputs for
  :func:`_ut` (:func:`chunk_backward.chunk_backward` forms its results
  and ut_backward's)."""
  if fused:
    return None, None, None, _Output(q, d_o, scale)
  return output.output_backward(mg, q, k, g, states, delta, d_o, scale=scale,
                                **options)


def _ut(mg, k, v, g, b, t, states, d_next, delta, d_delta, dk_out, dg_out,
        kr):
  """:func:`ut_backward.ut_backward` on the Pallas kernel's arguments (per
  channel too: dk_out and dg_out None, dM returned after dg); read keys
  ``kr`` (Gated DeltaNet-2's) are refused. Where the output's backward was
  left to it (:class:`_Output`), :func:`chunk_backward.chunk_backward`,
  with dq last."""
  if kr is not None:
    raise ValueError("the Mosaic GPU ut_backward has no read keys")
  if isinstance(dk_out, _Output):
    dq, dk, dv, db, da = chunk_backward.chunk_backward(
        mg, dk_out.q, k, v, g, b, t, states, d_next, dk_out.d_o,
        scale=dk_out.scale)
    return dk, dv, db, da, dq
  return ut_backward.ut_backward(mg, k, v, g, b, t, states, d_next, delta,
                                 d_delta, dk_out, dg_out)


def _intra(mg, *, kr, **kwargs):
  """:func:`intra.backward` for every chunk, then the Pallas
  :func:`deltajax.pallas.intra.backward` by blocks where the gate is not
  gentle (its arguments; read keys are refused)."""
  if kr is not None:
    raise ValueError("the Mosaic GPU intra backward has no read keys")
  done = intra.backward(mg, *(kwargs[n] for n in _INTRA_ARGS),
                        scale=kwargs["scale"])
  return pallas_intra.backward(**kwargs, kr=None, done=done)


_INTRA_ARGS = ("q", "k", "g", "b", "a", "states", "d_o", "delta", "d_m",
               "dk", "dg")

_BACKWARD_KERNELS = {
    "w_u": _BackwardKernel("w_u", _w_u, ("k", "v", "g", "b", "t")),
    "output": _BackwardKernel(
        "output_backward", _output,
        ("q", "k", "g", "states", "delta", "d_o", "scale")),
    "reverse": _BackwardKernel(
        "backward_scan", _reverse,
        ("q", "k", "w", "g", "d_o", "d_delta_local", "d_final", "scale",
         "decayed")),
    "ut": _BackwardKernel(
        "ut_backward", _ut,
        ("k", "v", "g", "b", "t", "states", "d_next", "delta",
         "d_delta", "dk_out", "dg_out", "kr")),
    "intra": _BackwardKernel(
        "intra_backward", _intra,
        (*_INTRA_ARGS, "cuts", "dkr", "kr", "scale", "chunk_size", "launch",
         "interpret", "dot")),
}
BACKWARD = tuple(_BACKWARD_KERNELS)
_PER_HEAD = ("w_u", "output", "reverse", "ut")  # those of a per-head gate
_PER_CHANNEL = ("w_u", "reverse", "ut", "intra")
INVERSES = ("pallas", "mosaic")
SCORES = ("pallas", "mosaic")


def gated_delta_mosaic(q, k, v, a, b, initial_state, cut, chunk_seq, *,
                       scale, chunk_size, schedule=None,
                       inverse="pallas", scores="pallas", backward=None,
                       narrow_dk=None, fused_reverse=None, fused_grads=None,
                       pieces=None, keep_gates=True):
  """Gated delta rule with Mosaic GPU kernels (:data:`registry.CONTRACT`).

  Args:
    q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``, ``HV = G H``; bfloat16 or
      float16 (the products take them as they are). K, V <= 128.
    a: ``[B, T, HV, W]`` log decay ``<= 0``: ``W = 1`` (Gated DeltaNet)
      or ``W = K`` (KDA, per key channel: schedule "one", the Pallas
      inverse, and of ``backward`` "w_u", "reverse", "ut" and "intra" in
      Mosaic GPU).
    b: ``[B, T, HV]`` beta.
    initial_state: ``[B, HV, K, V]``.
    cut, chunk_seq: must be None (no packed sequences).
    scale: Python float multiplying q.
    chunk_size: 64.
    schedule: the scan's (:data:`scan.SCHEDULES`): "one" warpgroup or
      "specialized" (three: state, output, TMA; the per-head gate only),
      with which the backward's reverse pass carries the transposed state
      too. None (the default): "specialized" for the per-head gate (0.256
      against 0.299 ms forward, 1.065 against 1.088 forward+backward at (4,
      4096, 16, 128) on the H200, RESULTS runs N and P), "one" per channel
      and under ``jax_enable_x64``.
    inverse: which kernel forms the UT inverse T (:data:`INVERSES`): the
      Pallas one (the default: 76 us against 161 at (4, 4096, 16, 128) on
      the H200, RESULTS run AA; 91.6 us since its blocks below the diagonal
      take three TF32 passes, run AB) or :func:`ut.inverse`.
    scores: per channel, which kernel forms the gate, the decayed operands
      and the scores of the chunks whose gate falls gently (:data:`SCORES`):
      the Pallas first pass of :func:`deltajax.pallas.intra.forward` (the
      default) or :func:`intra.forward` (by blocks of key channels: 0.585
      against 0.628 ms forward at (4, 4096, 16, 128), 0.399 against 0.384
      at K = 64, RESULTS run Y, when its operands were rounded to 16 bits
      once, which put A and P 2.4e-3 relative RMS from the Pallas pass's
      float32 ones; in two halves each since, 0.646 against 0.628 and
      0.423 against 0.391 ms, RESULTS run Z); the Pallas second pass
      forms the others' scores.
    backward: which of the backward's kernels run in Mosaic GPU (a subset
      of :data:`BACKWARD`: W and U, the output's backward, the reverse state
      pass, the backward through the UT transform, per channel the
      scores' backward); the others are the Pallas ones, as is the rest of
      the backward. None (the default): all of them (per channel, KDA's
      forward+backward 0.61-0.71x jla's at five shapes on the H200,
      RESULTS run Z; its da 6.9e-3 from float64 against 3.2e-3 with the
      Pallas scores' backward, whose products take TF32 operands). The
      Mosaic GPU backward through the UT transform needs
      neither W nor U, so with it :func:`ut.w_u` forms W alone, for the
      reverse pass.
    narrow_dk: the output's backward hands its share of dk to ut_backward
      in q's 16-bit dtype instead of float32 (half its HBM traffic, one more
      rounding). True needs "output" and "ut" in ``backward``; None (the
      default) means True where they are. (Its share of dDelta stays
      float32: in bf16 it took da from 4.7e-2 to 5.4e-2 relative RMS at
      strong gates, tests/test_mosaic.py; the two narrowed together took 4 %
      off forward+backward at (4, 4096, 16, 128), RESULTS run M.)
    fused_reverse: the reverse pass in three warpgroups that forms W and
      dDelta_local itself (:func:`reverse.specialized`): :func:`ut.w_u`
      does not run and the output's backward writes no dDelta_local. True
      needs all of :data:`BACKWARD` and schedule "specialized"; None (the
      default) means True where they are (forward+backward on
      the H200: 1.054 against 1.112 ms
      at (4, 4096, 16, 128), 3.107 against 3.304 at (1, 8192, 96, 128),
      temporaries 483 against 613 MiB).
    fused_grads: the output's backward and the backward through the UT
      transform as one kernel of three warpgroups
      (:func:`chunk_backward.chunk_backward`), which forms Delta and dDelta
      again from the states and their cotangents and keeps the output's
      shares of dk and the gate in shared memory. True needs
      ``fused_reverse`` and the per-head gate. None (the default) means
      True where ``fused_reverse``
      is on and the gate is per head (forward+backward on the H200, RESULTS
      run AB: 0.915 against 0.973 ms at (4, 4096, 16, 128), 2.196 against
      2.327 at (2, 16384, 16, 128), temporaries 290 against 483 MiB).
    pieces: the scan and the reverse pass cut each sequence into this many
      equal runs of chunks, walked side by side: a first pass maps each
      run's entry state to its exit state (:func:`scan.piece_maps`), the
      maps are composed in order, and the scan walks every run from its
      entry state (the reverse pass: :func:`_reverse_in_pieces`). It must
      divide the number of chunks. None (the default):
      :func:`_default_pieces` (at (1, 65536, 16, 128) on the H200, 4:
      1.462 / 4.767 ms forward / forward+backward against 2.409 / 6.796
      for one piece, RESULTS run U).
    keep_gates: per channel, the forward under differentiation keeps g
      ``[B, HV, T, K]`` (the Pallas first pass writes it for every chunk)
      and the decayed ``Q e^g``, ``K e^{g_C - g}`` that its scan read, and
      the backward takes them instead of forming them again
      (:func:`deltajax.pallas.intra.chunk_gates`, 163 us of the step at (4,
      4096, 16, 128) in RESULTS run W), for more temporaries (g in float32,
      the two in 16 bits): 1.846 against 1.977 ms forward+backward at (4,
      4096, 16, 128) for 64 MiB more (RESULTS run X).

  Returns:
    ``(o [B, T, HV, V] in v's dtype, final_state [B, HV, K, V] in
    initial_state's dtype)``, differentiable (custom VJP).
  """
  if chunk_size != CHUNK:
    raise ValueError(f"impl='mosaic' needs chunk_size = {CHUNK}; got "
                     f"{chunk_size}")
  if cut is not None or chunk_seq is not None:
    raise ValueError("impl='mosaic' does not support segment_ids or "
                     "cu_seqlens")
  if isinstance(b, tuple):
    raise ValueError("impl='mosaic' has no Gated DeltaNet-2 gates")
  dims = (q.shape[-1], v.shape[-1])
  if max(dims) > MAX_HEAD_DIM:
    raise ValueError(f"impl='mosaic' supports head dims up to {MAX_HEAD_DIM}; "
                     f"got K = {dims[0]}, V = {dims[1]}")
  dtype = jnp.result_type(q, k, v)
  if jnp.dtype(dtype).itemsize != 2:
    raise ValueError(f"impl='mosaic' takes 16-bit q, k and v; got {dtype}")
  if schedule is None:
    schedule = _default_schedule(a.shape[-1] > 1)
  if schedule not in scan.SCHEDULES:
    raise ValueError(f"schedule: {schedule!r} is not one of "
                     f"{scan.SCHEDULES}")
  if inverse not in INVERSES:
    raise ValueError(f"inverse: {inverse!r} is not one of {INVERSES}")
  if scores not in SCORES:
    raise ValueError(f"scores: {scores!r} is not one of {SCORES}")
  if a.shape[-1] > 1 and (schedule, inverse) != ("one", "pallas"):
    raise ValueError(f"impl='mosaic' with a per-channel gate runs schedule "
                     f"'one' and the Pallas inverse; got {schedule!r}, "
                     f"{inverse!r}")
  if backward is None:
    # All of them; per channel, ut_backward at K = 128 too since its
    # registers were cut (2.621 against 2.885 ms forward+backward with the
    # Pallas one at (4, 4096, 16, 128) on the H200, RESULTS run W), and the
    # scores' backward since its reverse cumsum reads its triangle from
    # shared memory (finite and repeatable on the H200, RESULTS run Z).
    backward = BACKWARD
  unknown = set(backward) - set(BACKWARD)
  if unknown:
    raise ValueError(f"backward: unknown kernels {sorted(unknown)}; the "
                     f"choices are {BACKWARD}")
  narrow_dk = _option("narrow_dk", narrow_dk, ("output", "ut"), backward)
  if fused_reverse and schedule != "specialized":
    raise ValueError(f"fused_reverse needs schedule 'specialized'; got "
                     f"{schedule!r}")
  fused_reverse = _option("fused_reverse", fused_reverse, _PER_HEAD,
                          backward) and schedule == "specialized"
  if fused_grads is None:
    fused_grads = fused_reverse and a.shape[-1] == 1
  if fused_grads and not (fused_reverse and a.shape[-1] == 1):
    raise ValueError(f"fused_grads needs fused_reverse and the per-head "
                     f"gate; got fused_reverse={fused_reverse}, a "
                     f"{a.shape}")
  n_chunks = -(-q.shape[1] // CHUNK)
  if pieces is None:
    pieces = _default_pieces(v.shape[0] * v.shape[2] * -(-v.shape[3] // 64),
                             n_chunks)
  if not isinstance(pieces, int) or pieces < 1 or n_chunks % pieces:
    raise ValueError(f"pieces must be a positive int dividing the "
                     f"{n_chunks} chunks; got {pieces!r}")
  o, final = _mosaic(float(scale),
                     (schedule, inverse, pieces, scores, keep_gates),
                     (tuple(backward), narrow_dk, fused_reverse,
                      bool(fused_grads)),
                     *(x.astype(dtype) for x in (q, k, v)),
                     a.astype(jnp.float32), b.astype(jnp.float32),
                     initial_state.astype(jnp.float32))
  return o.astype(v.dtype), final.astype(initial_state.dtype)


def _default_schedule(per_channel):
  """The scan's schedule when none is asked for: three warpgroups for the
  per-head gate, but one per channel, and one under ``jax_enable_x64``
  (JAX's Mosaic GPU interpreter fails to trace the three warpgroups' loops
  there, mixing int32 and int64 loop counters)."""
  if per_channel or jax.config.jax_enable_x64:
    return "one"
  return "specialized"


def _default_pieces(ctas, n_chunks):
  """The scan's pieces per sequence when none are asked for, given its
  ``ctas`` (B HV V / 64) and chunks: 1 unless the CTAs leave most
  multiprocessors idle; then the largest power of two up to their ratio
  that divides the chunks and leaves pieces of 16 chunks at least."""
  sms = pallas_core.multiprocessors() or 0
  pieces = 1
  while (2 * pieces * ctas <= sms and n_chunks % (2 * pieces) == 0
         and n_chunks // (2 * pieces) >= 16):
    pieces *= 2
  return pieces


def _option(name, value, needs, backward):
  """A backward option that ``needs`` these Mosaic kernels: None means on
  where they are in ``backward``; True without them is refused."""
  present = set(needs) <= set(backward)
  if value and not present:
    raise ValueError(f"{name} needs {needs} in backward; got "
                     f"{tuple(backward)}")
  return present if value is None else bool(value)


def _width(d):
  """The kernels' head dim: 64 or 128 (wgmma tiles of 64)."""
  return common.round_up(d, 64)


def _mosaic_gpu():
  """Compiled on a GPU, interpreted elsewhere."""
  return compat.Mosaic(interpret=jax.default_backend() != "gpu")


def _inverse(mg, kind, k, g, beta, heads):
  """T of every chunk (``[B, HV, T, C]``) by the ``kind`` of
  :data:`INVERSES`."""
  if kind == "mosaic":
    return ut.inverse(mg, k, g, beta, heads=heads)
  config = pallas_core.Config().resolve()
  return pallas_ut.inverse(
      k=k, g=g, b=beta, cuts=None, a=None, heads=heads, chunk_size=CHUNK,
      launch=config.launch("inverse", per_channel=False),
      interpret=mg.interpret, dot=config.dot)


def _per_channel_inputs(mg, scale, q, k, a, b, *, scores, keep_g):
  """The per-channel scan's inputs from
  :func:`deltajax.pallas.ops.before_scan` (its first pass of the scores
  :func:`intra.forward` where ``scores`` is "mosaic"): ``(Q e^g, K e^g, g
  at each chunk's end [B, HV, T / C, K], beta, T, (K e^{g_C - g}, P),
  g_whole)``, P ``[B, HV, T, C]`` float32 with the scale; g_whole: with
  ``keep_g``, g ``[B, HV, T, K]``, else None."""
  first_pass = None
  if scores == "mosaic":
    first_pass = lambda q, k, a: intra.forward(mg, q, k, a, heads=a.shape[2],
                                               scale=scale)
  g_end, beta, _, (qg, kg, kd), t, p, g = pallas_ops.before_scan(
      scale, CHUNK, pallas_core.Config().resolve(), q, k, None, a, b,
      None, heads=a.shape[2], dtype=jnp.float32, first_pass=first_pass,
      keep_g=keep_g)
  return qg, kg, g_end, beta, t, (kd, p), g


def _entry_states(mg, k, v, t, g, beta, initial_state, *, pieces, mapped,
                  schedule, channel):
  """The state entering each of ``pieces`` equal runs of chunks of every
  sequence, ``[B pieces, HV, K, V]``: the initial state carried through
  the maps of the runs before it; and the maps ``M`` of the first
  ``mapped`` runs (``pieces - 1``, or all for the backward), ``[mapped, B,
  HV, K, K]``."""
  bsz = k.shape[0]
  length = k.shape[1] // CHUNK // pieces
  m, e = (jnp.moveaxis(x.reshape(bsz, mapped, *x.shape[1:]), 1, 0)
          for x in scan.piece_maps(mg, k, v, t, g, beta,
                                   pieces=scan.Pieces(mapped, length),
                                   schedule=schedule, channel=channel))
  last, entries = common.piece_entry_states(
      initial_state, m[:pieces - 1], e[:pieces - 1])
  entries = jnp.concatenate([entries, last[None]])
  return jnp.moveaxis(entries, 0, 1).reshape(-1, *entries.shape[2:]), m


def _padded(q, k, v, a, initial_state):
  """The inputs with their head dims zero-padded to the kernels' widths
  (:func:`_width`), the layout of every kernel, forward and backward; a
  per-channel gate too (a = 0 on the padded channels, whose keys are 0)."""
  kw, vw = _width(q.shape[-1]), _width(v.shape[-1])
  q, k = (common.pad_axis(x, 3, kw) for x in (q, k))
  if a.shape[-1] > 1:
    a = common.pad_axis(a, 3, kw)
  return (q, k, common.pad_axis(v, 3, vw), a,
          pallas_ops.pad_state(initial_state, kw, vw))


def _forward(plan, scale, q, k, v, a, b, initial_state, save, deltas=True):
  """The outputs and, with ``save``, the backward's residuals (Delta among
  them where ``deltas``), on inputs padded by :func:`_padded`."""
  schedule, inverse, pieces, scores, keep_gates = plan
  mg = _mosaic_gpu()
  n_k, n_v = q.shape[-1], v.shape[-1]
  q, k, vp, a, s0 = _padded(q, k, v, a, initial_state)
  g_whole = None
  if a.shape[-1] > 1:
    q, k, g, beta, t, channel, g_whole = _per_channel_inputs(
        mg, scale, q, k, a, b, scores=scores, keep_g=save and keep_gates)
  else:
    g, beta, _, _ = pallas_ops.gates(a, b, None, CHUNK, jnp.float32,
                                     q.shape[-1], mg.interpret)
    t, channel = _inverse(mg, inverse, k, g, beta, v.shape[2]), None
  maps = None
  if pieces > 1:
    s0, maps = _entry_states(mg, k, vp, t, g, beta, s0, pieces=pieces,
                             mapped=pieces if save else pieces - 1,
                             schedule=schedule, channel=channel)
  o, final, *saved = scan.forward(
      mg, q, k, vp, t, g, beta, s0, scale=scale, save=save, deltas=deltas,
      schedule=schedule, channel=channel,
      pieces=scan.Pieces(pieces, k.shape[1] // CHUNK // pieces))
  final = final[pieces - 1::pieces]  # the last piece's
  outputs = o[..., :n_v], final[..., :n_k, :n_v]
  if not save:
    return outputs, None
  states, delta = saved
  if maps is not None:  # those the backward's reverse pass reads
    maps = maps[1:]
  kept = None
  if g_whole is not None:  # Q e^g and K e^{g_C - g} with g
    kept = (g_whole, q, channel[0])
  return outputs, ((t, states, delta,
                    None if channel is None else channel[1], kept), maps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _mosaic(scale, plan, backward, q, k, v, a, b, initial_state):
  """:func:`gated_delta_mosaic` on 16-bit q, k, v and float32 a, b and
  initial state; scale, the forward's ``plan`` (the scan's schedule, the
  inverse, its pieces, the scores' kernel, keep_gates) and ``backward`` (its
  Mosaic kernels, narrow_dk, fused_reverse, fused_grads) are static."""
  del backward
  return _forward(plan, scale, q, k, v, a, b, initial_state,
                  save=False)[0]


def _fwd(scale, plan, backward, q, k, v, a, b, initial_state):
  # Delta is formed again by chunk_backward (fused_grads).
  outputs, (saved, maps) = _forward(plan, scale, q, k, v, a, b,
                                    initial_state, save=True,
                                    deltas=not backward[3])
  # The backward runs on the padded inputs: its kernels' widths too.
  q, k, v, a, initial_state = _padded(q, k, v, a, initial_state)
  return outputs, ((q, k, v, a, b, initial_state, None, None, None, saved),
                   maps)


def _in_mosaic(name, **options):
  """The backward kernel ``name`` of :data:`BACKWARD` under the signature of
  the Pallas kernel it replaces; ``options`` go to the Mosaic one."""
  kernel = _BACKWARD_KERNELS[name]

  def call(**kwargs):
    return kernel.mosaic(_mosaic_gpu(), **{
        **{n: kwargs[n] for n in kernel.args}, **options})
  return call


def _kernel_options(schedule, names, narrow_dk, fused_reverse, fused_grads):
  """The Mosaic backward kernels' options, by name: the reverse pass
  carrying ``dS^T`` where the scan's ``schedule`` carries ``S^T``; W alone
  from ut.w_u where the Mosaic ut_backward (which needs no U) takes it;
  with ``narrow_dk``, a 16-bit share of dk from the output's backward;
  with ``fused_reverse``, W and dDelta_local left to the reverse pass;
  with ``fused_grads``, the output's backward left to ut_backward. (The kernels that an option couples fall back to Pallas at the same head
  dims.)"""
  options = {name: {} for name in BACKWARD}
  options["reverse"]["transposed"] = schedule != "one"
  options["w_u"]["values"] = "ut" not in names
  options["w_u"]["deferred"] = fused_reverse
  options["output"]["narrow_dk"] = narrow_dk
  options["output"]["local_delta"] = not fused_reverse
  options["output"]["fused"] = fused_grads
  options["reverse"]["deltas"] = not fused_grads
  return options


def _bwd(scale, plan, backward, residuals, cotangents):
  names, narrow_dk, fused_reverse, fused_grads = backward
  residuals, maps = residuals
  if residuals[3].shape[-1] > 1:  # per channel: those that take its gate
    names = tuple(n for n in names if n in _PER_CHANNEL)
  options = _kernel_options(plan[0], names, narrow_dk, fused_reverse,
                            fused_grads)
  options["reverse"]["maps"] = maps
  config = pallas_core.Config().resolve()
  kernels = {_BACKWARD_KERNELS[name].keyword:
             _in_mosaic(name, **options[name]) for name in names}
  dq, dk, dv, da, db, d_initial = pallas_ops.backward(
      scale, CHUNK, config, residuals, cotangents, **kernels)[:6]
  n_k, n_v = cotangents[1].shape[-2:]  # the head dims before padding
  if da.shape[-1] > 1:
    da = da[..., :n_k]
  return (dq[..., :n_k], dk[..., :n_k], dv[..., :n_v], da, db,
          d_initial[..., :n_k, :n_v])


_mosaic.defvjp(_fwd, _bwd)
