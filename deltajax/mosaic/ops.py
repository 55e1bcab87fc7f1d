"""``impl="mosaic"``: Gated DeltaNet and KDA as Mosaic GPU kernels (Hopper).

One path per call, fixed by the gate's kind and ``jax_enable_x64``
(:func:`_schedule`); :class:`Config` holds what a caller may tune. The
products run on the tensor cores with 16-bit operands, so q, k and v must
be 16-bit (the registry refuses float32 and float64 ones: ``wide=False``);
gates, beta, the state and every accumulation are float32. Every kernel
works on the inputs with their head dims zero-padded to 64 or 128
(:func:`_padded`), forward and backward.

Per-head gate (Gated DeltaNet: Yang, Kautz & Hatamizadeh, ICLR 2025).
Forward: the UT inverse T of every chunk (the Pallas kernel
:func:`deltajax.pallas.ut.inverse`, parallel over chunks) ->
:func:`scan.forward`, the state scan and the output fused, sequential over
chunks, in three warpgroups (schedule "specialized": the state's, the
output's, the loads'). Backward (:func:`deltajax.stages.backward` on this
module's stages): the reverse state pass in three
warpgroups that forms W and the output's share of dDelta itself
(:func:`reverse.specialized`), then the output's backward and the backward
through the UT transform as one kernel of three warpgroups
(:func:`chunk_backward.chunk_backward`) that forms Delta and dDelta again
from the chunk states and their cotangents: the forward saves T and the
chunk-entry states, no Delta.

Under ``jax_enable_x64`` (JAX's Mosaic GPU interpreter cannot trace the
three warpgroups' loops there) the scan runs in one warpgroup (schedule
"one") and the backward in four kernels: W (:func:`ut.w`), the output's
backward (:func:`output.output_backward`), the reverse state pass
(:func:`reverse.backward`) and the backward through the UT transform
(:func:`ut_backward.ut_backward`), on the T, chunk states and Delta the
forward saves.

Per-channel gate (KDA: Kimi Linear, 2025; ``a [B, T, HV, K]``): the Pallas
kernels form the gate, the decayed operands ``Q e^g``, ``K e^g``, ``K
e^{g_C - g}``, the intra-chunk scores and T
(:func:`deltajax.pallas.ops.before_scan`), as ``impl="pallas"`` does; the
scan and the output are :func:`scan.forward`'s in schedule "one". The
forward under differentiation keeps the gate and the decayed operands for
the backward. The backward is :func:`deltajax.stages.backward` on
those residuals (with P) with W, the reverse state pass and the backward
through the UT transform in Mosaic GPU (:func:`ut.w`,
:func:`reverse.backward` on the decayed operands,
:func:`ut_backward.ut_backward` on the gate's tile) and the scores'
backward through each chunk's midpoint gate (:func:`intra.backward`),
followed by the Pallas pass by blocks where the gate falls steeply; the
output's share of dDelta (``P^T dO``) is the Pallas kernel's.

Few long sequences (CTAs filling at most half the multiprocessors) are
cut into equal pieces of chunks walked side by side (:attr:`Config.pieces`,
by default :func:`_default_pieces`): the pieces' affine maps
(:func:`scan.piece_maps`) composed into each piece's entry state for the
scan, and in the backward a local reverse pass per piece whose shares of
the entry cotangents are carried back through the maps' transposes before
the reverse pass walks every piece (:func:`_reverse_in_pieces`).

Cuts (``segment_ids``) are folded into the gate, a full forget at every
cut token (:func:`cut_into_gate`): the same kernels, the same work, the
decays across a cut 0 in float32. Per channel the Pallas kernel that forms
the gate folds them in (no pass over a of its own), and the scores'
kernels, forward and backward, factor each chunk through its gate unfolded
between the cuts, masking the pairs across them (:func:`_folded`): a chunk
holding a cut is taken whole as any other. Packed sequences (``cu_seqlens``:
``chunk_seq``, each sequence's chunks in a run of their own, with its own
initial and final state): the scan takes each chunk's sequence bounds
(:func:`scan.sequence_bounds`) with its tiles, enters a sequence's first
chunk from its initial state and writes the state leaving its last chunk;
the reverse pass does the transpose (the final state's cotangent entering
the last chunk, the initial state's leaving the first). The row may run
in pieces as any other: a map pass enters a sequence as ``[0 | S0]``, so
that a piece's map forgets what came before it. Every other stage works
per chunk, as unpacked.

Gated DeltaNet-2 (``b = (erase, write)``) runs on the per-channel kernels:
the read keys ``kr = erase * k`` and the values ``write * v``, beta 1
(:func:`deltajax.stages.read_keys`); the Pallas pass forms ``Kr e^g`` for
the scan, and W, the backward through the UT transform and the scores'
backward take kr (A's rows and W's keys) and give their shares of its
cotangent.

Supported: the per-head and per-channel gates and Gated DeltaNet-2's,
``chunk_size = 64``, head dims up to 128, grouped value heads (the kernels
read q/k head ``j // G``), cuts and packed sequences.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp

from deltajax import common
from deltajax import stages
from deltajax.mosaic import chunk_backward
from deltajax.mosaic import core
from deltajax.mosaic import intra
from deltajax.mosaic import output
from deltajax.mosaic import reverse
from deltajax.mosaic import scan
from deltajax.mosaic import ut
from deltajax.mosaic import ut_backward
from deltajax.pallas import core as pallas_core
from deltajax.pallas import intra as pallas_intra
from deltajax.pallas import ops as pallas_ops
from deltajax.pallas import ut as pallas_ut

MIN_CAPABILITY = (9, 0)
CHUNK = ut.C
MAX_HEAD_DIM = 128


@dataclasses.dataclass(frozen=True)
class Config:
  """``impl="mosaic"``'s config (``deltajax.gated_delta(...,
  impl="mosaic", config=Config(...))``). Frozen and hashable: a static
  argument under ``jit``.

  Attributes:
    pieces: the pieces per sequence that the scan and the reverse pass cut
      each sequence into, equal runs of chunks walked side by side (a first
      pass maps each piece's entry state to its exit state,
      :func:`scan.piece_maps`; the maps are composed in order; the scan
      walks every piece from its entry state). It must divide the call's
      number of chunks (``ceil(T / 64)``, with ``cu_seqlens`` those of
      the chunk-aligned layout, :func:`deltajax.common.layout_chunks`;
      checked by :func:`gated_delta_mosaic`). None (the default):
      automatic, :func:`_default_pieces` (one unless the scan's CTAs leave
      most multiprocessors idle), the chunks padded to a multiple of it.

  Raises:
    ValueError: ``pieces`` is not None or a positive int.
  """
  pieces: int | None = None

  def __post_init__(self):
    pieces = self.pieces
    if pieces is not None:
      if (isinstance(pieces, bool) or not isinstance(pieces, numbers.Integral)
          or pieces < 1):
        raise ValueError(f"Config.pieces must be None or a positive int; got "
                         f"{pieces!r}")
      object.__setattr__(self, "pieces", int(pieces))


def gated_delta_mosaic(q, k, v, a, b, initial_state, cut, chunk_seq, *,
                       scale, chunk_size, config=None):
  """Gated delta rule with Mosaic GPU kernels (:data:`registry.CONTRACT`).

  The kernels that run follow from the gate and ``jax_enable_x64`` (the
  module's docstring): per head, the three-warpgroup scan, reverse pass
  and chunk-parallel backward; under ``jax_enable_x64`` and per channel,
  the one-warpgroup scan and the backward's four kernels.

  Args:
    q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``, ``HV = G H``; bfloat16 or
      float16 (the products take them as they are). K, V <= 128.
    a: ``[B, T, HV, W]`` log decay ``<= 0``: ``W = 1`` (Gated DeltaNet) or
      ``W = K`` (KDA, per key channel).
    b: ``[B, T, HV]`` beta, or Gated DeltaNet-2's pair ``(erase [B, T, HV,
      K], write [B, T, HV, V])`` (with W = K).
    initial_state: ``[N, HV, K, V]`` (N = B without chunk_seq).
    cut: None or bool of a's shape (:data:`registry.CONTRACT`): folded
      into the gate (:func:`_folded`) inside the custom VJP, whose backward
      gives a's cotangent 0 at every cut.
    chunk_seq: None or int32 ``[T / 64]`` (B = 1): packed sequences.
    scale: Python float multiplying q.
    chunk_size: 64.
    config: :class:`Config` (None: the defaults).

  Returns:
    ``(o [B, T, HV, V] in v's dtype, final_state [N, HV, K, V] in
    initial_state's dtype)``, differentiable (custom VJP).

  Raises:
    TypeError: ``config`` is not a :class:`Config`.
    ValueError: ``chunk_size`` is not 64, head dims above 128, q, k, v
      not 16-bit, or ``config.pieces`` does not divide the chunks.
  """
  if config is None:
    config = Config()
  if not isinstance(config, Config):
    raise TypeError(f"impl='mosaic' takes config=deltajax.mosaic.Config; "
                    f"got {type(config).__name__}")
  if chunk_size != CHUNK:
    raise ValueError(f"impl='mosaic' needs chunk_size = {CHUNK}; got "
                     f"{chunk_size}")
  dims = (q.shape[-1], v.shape[-1])
  if max(dims) > MAX_HEAD_DIM:
    raise ValueError(f"impl='mosaic' supports head dims up to {MAX_HEAD_DIM}; "
                     f"got K = {dims[0]}, V = {dims[1]}")
  dtype = jnp.result_type(q, k, v)
  if jnp.dtype(dtype).itemsize != 2:
    raise ValueError(f"impl='mosaic' takes 16-bit q, k and v; got {dtype}")
  b, kr, v = stages.read_keys(b, q, k, v)
  t_len = q.shape[1]
  n_chunks = t_len // CHUNK
  pieces = config.pieces
  if pieces is None:
    pieces = _default_pieces(v.shape[0] * v.shape[2] * -(-v.shape[3] // 64),
                             n_chunks)
    # Chunks of padding (a = 0, beta 0: the state passes as it is) make
    # the automatic pieces divide the chunks.
    padded = common.round_up(n_chunks, pieces) * CHUNK
    q, k, v, a, b, kr, cut = (
        None if x is None else common.pad_axis(x, 1, padded)
        for x in (q, k, v, a, b, kr, cut))
    if chunk_seq is not None:  # the last sequence's
      chunk_seq = jnp.pad(chunk_seq, (0, padded // CHUNK - n_chunks),
                          mode="edge")
  elif n_chunks % pieces:
    raise ValueError(f"config.pieces = {pieces} must divide the {n_chunks} "
                     f"chunks of T = {t_len}")
  o, final = _mosaic(float(scale), (_schedule(a.shape[-1] > 1), pieces),
                     *(x.astype(dtype) for x in (q, k, v)),
                     a.astype(jnp.float32), b.astype(jnp.float32),
                     initial_state.astype(jnp.float32),
                     None if kr is None else kr.astype(dtype), chunk_seq, cut)
  if chunk_seq is not None:  # a sequence without chunks keeps its state
    final = jnp.where(stages.unvisited(chunk_seq, final.shape[0]),
                      initial_state.astype(jnp.float32), final)
  return o[:, :t_len].astype(v.dtype), final.astype(initial_state.dtype)


def cut_into_gate(a, cut):
  """The log decay ``a`` with the cuts folded in: a full forget (a at
  :data:`common.LOG_DECAY_FLOOR`) at every cut token. Every decay across a
  cut then holds a factor ``e^-200``, 0 in float32 (below its smallest
  subnormal), so the kernels' products stop there: the chunk's entry state
  does not reach the tokens after the cut nor its exit state, the tokens
  before it do not reach those after it, in the scores, in T and in the
  state's update, forward and backward, with no more data or work in any
  kernel. The gradient of a at a cut is 0, as below the floor
  (:func:`deltajax.stages.backward`; per channel, the scores' backward).
  A full forget is a cut in the contract too
  (:meth:`deltajax.common.ChunkGate.of`). ``cut`` None: a as it is. Where it falls on a chunk's
  first token the scans and reverse passes also select a zero entry state
  and cotangent (:func:`scan.forgets`), so that a non-finite one stays
  behind."""
  return a if cut is None else jnp.where(cut, common.LOG_DECAY_FLOOR, a)


def mark_forgets(g_end, a, cuts):
  """Per channel: the gate at each chunk's end ``g_end [B, HV, T / C, K]``
  at ``-inf`` where the chunk's first token is a full forget (``a [B, T,
  HV, K]`` at :data:`common.LOG_DECAY_FLOOR`, or a cut of the counts
  ``cuts``, :func:`_folded`), its decay still 0: the kernels select a
  zero state there (:func:`scan.forgets`)."""
  first = jnp.moveaxis(a[:, ::CHUNK], 1, 2) <= common.LOG_DECAY_FLOOR
  if cuts is not None:
    first |= (cuts[:, :, ::CHUNK] > 0)[..., None]
  return jnp.where(first, -jnp.inf, g_end)


def _schedule(per_channel):
  """The scan's schedule (:data:`scan.SCHEDULES`): three warpgroups for the
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
  that leaves pieces of 16 chunks at least (the caller pads the chunks to
  a multiple of it)."""
  sms = pallas_core.multiprocessors() or 0
  pieces = 1
  while 2 * pieces * ctas <= sms and n_chunks // (2 * pieces) >= 16:
    pieces *= 2
  return pieces


def _width(d):
  """The kernels' head dim: 64 or 128 (wgmma tiles of 64)."""
  return common.round_up(d, 64)


def _mosaic_gpu():
  """Compiled on a GPU, interpreted elsewhere."""
  return core.Mosaic(interpret=jax.default_backend() != "gpu")


def _pallas_config():
  """The Pallas kernels' config (launches tuned on the H200)."""
  return pallas_core.Config().resolve()


def _inverse(mg, k, g, beta, heads):
  """T of every chunk (``[B, HV, T, C]``), by the Pallas kernel."""
  config = _pallas_config()
  return pallas_ut.inverse(
      k=k, g=g, b=beta, cuts=None, a=None, heads=heads, chunk_size=CHUNK,
      launch=config.launch("inverse", per_channel=False),
      interpret=mg.interpret, dot=config.dot)


def _per_channel_inputs(scale, q, k, kr, a, b, cuts, *, keep_g):
  """The per-channel scan's inputs from
  :func:`deltajax.pallas.ops.before_scan`: ``(Q e^g, Kr e^g, g at each
  chunk's end [B, HV, T / C, K], beta, T, (K e^{g_C - g}, P), g_whole)``
  (Kr: the read keys kr, or K), P ``[B, HV, T, C]`` float32 with the
  scale; g_whole: with ``keep_g``, g ``[B, HV, T, K]``, else None.
  ``cuts``: the counts of the cuts that the gate's kernel folds in
  (:func:`_folded`)."""
  g_end, beta, _, (qg, kg, kd), t, p, g = pallas_ops.before_scan(
      scale, CHUNK, _pallas_config(), q, k, kr, a, b, None,
      heads=a.shape[2], dtype=jnp.float32, keep_g=keep_g, folded=cuts)
  return qg, kg, g_end, beta, t, (kd, p), g


def _entry_states(mg, k, v, t, g, beta, initial_state, *, pieces, mapped,
                  schedule, channel, sequences):
  """The state entering each of ``pieces`` equal runs of chunks of every
  row, ``[B pieces, HV, K, V]``: the initial state carried through the
  maps of the runs before it; and the maps ``M`` of the first ``mapped``
  runs (``pieces - 1``, or all for the backward), ``[mapped, B, HV, K,
  K]``. ``sequences``: packed sequences' ``bounds`` and ``initials``
  (:func:`scan.piece_maps`), or {}."""
  bsz = k.shape[0]
  length = k.shape[1] // CHUNK // pieces
  m, e = (jnp.moveaxis(x.reshape(bsz, mapped, *x.shape[1:]), 1, 0)
          for x in scan.piece_maps(mg, k, v, t, g, beta,
                                   pieces=scan.Pieces(mapped, length),
                                   schedule=schedule, channel=channel,
                                   **sequences))
  last, entries = common.piece_entry_states(
      initial_state, m[:pieces - 1], e[:pieces - 1])
  entries = jnp.concatenate([entries, last[None]])
  return jnp.moveaxis(entries, 0, 1).reshape(-1, *entries.shape[2:]), m


def _padded(q, k, v, a, initial_state, kr):
  """The inputs with their head dims zero-padded to the kernels' widths
  (:func:`_width`), the layout of every kernel, forward and backward; a
  per-channel gate too (a = 0 on the padded channels, whose keys are 0),
  and the read keys kr (None stays None)."""
  kw, vw = _width(q.shape[-1]), _width(v.shape[-1])
  q, k = (common.pad_axis(x, 3, kw) for x in (q, k))
  if a.shape[-1] > 1:
    a = common.pad_axis(a, 3, kw)
  return (q, k, common.pad_axis(v, 3, vw), a,
          stages.pad_state(initial_state, kw, vw), stages.pad_keys(kr, k))


def _forward(plan, scale, q, k, v, a, b, initial_state, kr, chunk_seq, cuts,
             save):
  """The outputs and, with ``save``, the backward's residuals, on inputs
  padded by :func:`_padded`; ``chunk_seq``: packed sequences, or None;
  ``cuts``: :func:`_folded`."""
  schedule, pieces = plan
  mg = _mosaic_gpu()
  n_k, n_v = q.shape[-1], v.shape[-1]
  q, k, vp, a, s0, kr = _padded(q, k, v, a, initial_state, kr)
  g_whole = None
  if a.shape[-1] > 1:
    q, k, g, beta, t, channel, g_whole = _per_channel_inputs(
        scale, q, k, kr, a, b, cuts, keep_g=save)
    g = mark_forgets(g, a, cuts)
  else:
    g, beta, _, _ = stages.gates(a, b, None, CHUNK, jnp.float32,
                                 q.shape[-1], mg.interpret)
    t, channel = _inverse(mg, k, g, beta, v.shape[2]), None
  sequences = {}
  if chunk_seq is not None:  # the row enters from the first sequence's
    sequences = dict(bounds=_bounds(chunk_seq), initials=s0)
    s0 = jnp.zeros((1, *s0.shape[1:]), s0.dtype)
  maps = None
  if pieces > 1:
    s0, maps = _entry_states(mg, k, vp, t, g, beta, s0, pieces=pieces,
                             mapped=pieces if save else pieces - 1,
                             schedule=schedule, channel=channel,
                             sequences=sequences)
  o, final, *saved = scan.forward(
      mg, q, k, vp, t, g, beta, s0, scale=scale, save=save,
      schedule=schedule, channel=channel,
      pieces=scan.Pieces(pieces, k.shape[1] // CHUNK // pieces), **sequences)
  if chunk_seq is None:
    final = final[pieces - 1::pieces]  # the last piece's
  outputs = o[..., :n_v], final[..., :n_k, :n_v]
  if not save:
    return outputs, None
  states, delta = saved  # delta None in schedule "specialized"
  if maps is not None:  # those the backward's reverse pass reads
    maps = maps[1:]
  kept = None
  if g_whole is not None:  # Q e^g and K e^{g_C - g} with g
    kept = (g_whole, q, channel[0])
  return outputs, (dict(t=t, states=states, delta=delta,
                        p=None if channel is None else channel[1],
                        kept=kept), maps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _mosaic(scale, plan, q, k, v, a, b, initial_state, kr, chunk_seq, cut):
  """:func:`gated_delta_mosaic` on 16-bit q, k, v (and read keys kr, or
  None) and float32 a, b and initial state, packed sequences' chunk_seq
  or None, cuts or None; scale and ``plan`` (the scan's schedule, its
  pieces) are static."""
  a, cuts = _folded(a, cut)
  return _forward(plan, scale, q, k, v, a, b, initial_state, kr, chunk_seq,
                  cuts, save=False)[0]


def _fwd(scale, plan, q, k, v, a, b, initial_state, kr, chunk_seq, cut):
  # The backward's da is 0 where a is at the floor (stages.backward), so at
  # the cuts folded into a per head, and at those folded into g per channel
  # (the scores' backward): the fold needs no transpose of its own.
  a, cuts = _folded(a, cut)
  outputs, (saved, maps) = _forward(plan, scale, q, k, v, a, b,
                                    initial_state, kr, chunk_seq, cuts,
                                    save=True)
  # The backward runs on the padded inputs: its kernels' widths too.
  q, k, v, a, initial_state, kr = _padded(q, k, v, a, initial_state, kr)
  return outputs, (stages.Residuals(q, k, v, a, b, initial_state, cut=None,
                                    chunk_seq=chunk_seq, kr=kr, **saved),
                   maps, cuts)


def _folded(a, cut):
  """``(a, cuts)``: per head, a with the cuts folded in
  (:func:`cut_into_gate`) and None; per channel, a as it is and the cut
  counts (:func:`deltajax.stages.cut_counts`, ``[B, HV, T]``, or None):
  the Pallas kernels that form the gate fold them in
  (:func:`deltajax.pallas.intra.forward`'s ``folded``), with no pass of
  their own over a, and the scores' kernels, forward and backward, unfold
  it between the cuts (the rest take the folded gate alone)."""
  if a.shape[-1] == 1:
    return cut_into_gate(a, cut), None
  return a, stages.cut_counts(cut, CHUNK)


def _bounds(chunk_seq):
  """The kernels' sequence bounds of packed sequences (None: unpacked)."""
  return None if chunk_seq is None else scan.sequence_bounds(chunk_seq)


# The backward's stages (:class:`stages.Stages`) in Mosaic GPU, under their
# keyword arguments (the Pallas launch ones are not read).


def _w_u(mg, *, k, v, g, b, t, fused, **_):
  """W from :func:`ut.w` (the Mosaic ut_backward forms U's share itself:
  None in its place), or where ``fused`` neither: the reverse pass
  (:func:`reverse.specialized`) forms W from T and beta."""
  del v
  if fused:
    return None, None
  return ut.w(mg, k, g, b, t, heads=t.shape[1]), None


def _output(mg, *, q, k, g, states, delta, d_o, scale, fused, **_):
  """:func:`output.output_backward`, or where ``fused`` nothing: the reverse
  pass forms dDelta_local, :func:`_ut` (:func:`chunk_backward.chunk_backward`)
  the rest."""
  if fused:
    return None, None, None, None
  return output.output_backward(mg, q, k, g, states, delta, d_o, scale=scale)


def _reverse(mg, *, q, k, w, t, b, g, d_o, d_delta_local, d_final, scale,
             decayed, chunk_seq, maps, a, folded, **_):
  """:func:`reverse.backward`: per channel (``decayed``: ``(Q e^g, K
  e^{g_C - g})``; g at each chunk's end) those in place of q and k;
  :func:`reverse.specialized` where W is left to it (w None: it forms W
  from t and beta b, dDelta_local too, and writes no dDelta). With
  ``maps`` (of the forward's pieces but the first, ``[P - 1, B, HV, K,
  K]``), in those pieces (:func:`_reverse_in_pieces`). With ``chunk_seq``,
  ``d_final [N, HV, K, V]`` holds the packed sequences' final states'
  cotangents, each entering at its sequence's last chunk (the row's exit
  cotangent is zero), and the initial states' come back."""
  sequences = {}
  if chunk_seq is not None:
    sequences = dict(bounds=_bounds(chunk_seq), d_finals=d_final)
    d_final = jnp.zeros((1, *d_final.shape[1:]), d_final.dtype)
  if w is None:
    run = functools.partial(reverse.specialized, mg, q, k, t, g, b, d_o,
                            scale=scale, **sequences)
  else:
    if decayed is not None:
      q, k = decayed
      g = mark_forgets(g, a, folded)
    run = functools.partial(reverse.backward, mg, q, k, w, g, d_o,
                            d_delta_local, scale=scale,
                            per_channel=decayed is not None, **sequences)
  if maps is None:
    return run(d_final)
  d_delta, d_next, d_initial = _reverse_in_pieces(run, d_final, maps,
                                                  q.shape[1] // CHUNK)
  if chunk_seq is None:  # the first piece's
    d_initial = d_initial[::maps.shape[0] + 1]
  return d_delta, d_next, d_initial


def _reverse_in_pieces(run, d_final, maps, n_chunks):
  """The reverse pass ``run`` in the forward's pieces, side by side: a
  local pass gives each piece but the first its own share of its entry
  state's cotangent ``D``; carried back from the last piece, the cotangent
  leaving piece ``p - 1`` is ``M_p^T (that leaving p) + D_p``; then each
  piece runs from the cotangent leaving it (``run``'s outputs)."""
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
  return run(jnp.moveaxis(exits, 0, 1).reshape(-1, *d_final.shape[1:]),
             pieces=scan.Pieces(count, length))


def _ut(mg, *, k, v, g, b, t, states, d_next, delta, d_delta, dk_out,
        dg_out, kr, q=None, d_o=None, scale=None, **_):
  """:func:`ut_backward.ut_backward` on the stage's arguments (per channel
  too: dk_out and dg_out None, dM returned after dg, then with read keys
  ``kr`` their share of dkr). Where the output's backward was left to it
  (a per-head gate with dk_out None),
  :func:`chunk_backward.chunk_backward` on q, d_o and scale, with dq
  last."""
  if dk_out is None and g.ndim == 3:
    dq, dk, dv, db, da = chunk_backward.chunk_backward(
        mg, q, k, v, g, b, t, states, d_next, d_o, scale=scale)
    return dk, dv, db, da, dq
  return ut_backward.ut_backward(mg, k, v, g, b, t, states, d_next, delta,
                                 d_delta, dk_out, dg_out, kr)


def _intra(mg, *, folded=None, **kwargs):
  """:func:`intra.backward` for every chunk, then the Pallas
  :func:`deltajax.pallas.intra.backward` by blocks where the gate is not
  gentle (its arguments); ``folded``: the counts of the cuts folded into
  g (:func:`_folded`), or None."""
  done = intra.backward(
      mg, *(kwargs[n] for n in _INTRA_ARGS),
      cuts=None if folded is None else folded.astype(jnp.float32),
      scale=kwargs["scale"])
  return pallas_intra.backward(**{**kwargs, "cuts": folded}, done=done,
                               folded=folded is not None)


_INTRA_ARGS = ("q", "k", "g", "b", "a", "states", "d_o", "delta", "d_m",
               "dk", "dg", "kr", "dkr")


def _bwd(scale, plan, residuals, cotangents):
  schedule, _ = plan
  residuals, maps, cuts = residuals
  mg = _mosaic_gpu()
  # The three-warpgroup scan's backward: W and dDelta_local formed in the
  # reverse pass, the output's backward in chunk_backward.
  fused = schedule == "specialized"
  dq, dk, dv, da, db, d_initial, _, _, dkr = stages.backward(
      stages.Stages(
          w_u=functools.partial(_w_u, mg, fused=fused),
          output_backward=functools.partial(_output, mg, fused=fused),
          reverse=functools.partial(_reverse, mg, maps=maps,
                                    a=residuals.a, folded=cuts),
          ut_backward=functools.partial(_ut, mg),
          intra_backward=functools.partial(_intra, mg, folded=cuts)),
      scale, CHUNK, _pallas_config(), residuals, cotangents)
  n_k, n_v = cotangents[1].shape[-2:]  # the head dims before padding
  if da.shape[-1] > 1:
    da = da[..., :n_k]
  if dkr is not None:
    dkr = dkr[..., :n_k]
  return (dq[..., :n_k], dk[..., :n_k], dv[..., :n_v], da, db,
          d_initial[..., :n_k, :n_v], dkr, None, None)


_mosaic.defvjp(_fwd, _bwd)
