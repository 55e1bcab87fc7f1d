"""The gated delta rule across devices, with ``jax.shard_map`` over a user's mesh.

Batch and head sharding need no communication: every (sequence, head) pair
is independent. Under ``jax.jit``, :func:`deltajax.gated_delta` with inputs
sharded over B or H already compiles without gathers for impl "scan" and
"chunked". :func:`gated_delta_sharded` does the same explicitly with
``shard_map``; it is what impl "pallas" needs, since XLA cannot partition a
``pallas_call``.

Sequence (context) parallelism splits T into one segment per device.
Because the state update is affine in the state, a segment maps its initial
state to its final state as ``S_out = F S_in + G`` (``F`` is ``K x K``), and
each of its outputs is ``o_t = o_t^0 + P_t S_in`` with ``o^0`` the output
from the zero state and ``P_t = scale q_t^T F_{<=t}`` (``F_{<=t}`` the
transition from the segment's start through token t). The recurrence acts
on every value column on its own, so one call of :func:`deltajax.gated_delta`
per device on the batch stacked twice, values ``v`` then ``0`` from initial
states ``0`` then ``I``, yields all four: outputs ``o^0`` then ``P`` and
final states ``G`` then ``F``.
The devices then compose the small ``(F, G)`` pairs by a scan across
devices (``log2(D)`` rounds of ``ppermute``) into the state that enters each
segment, and correct their outputs with one matmul. A second local pass from the true state would cost
a whole pass more, since ``F`` is needed either way.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from deltajax import api
from deltajax import common


def gated_delta_sharded(q, k, v, a, b, *, mesh, batch_axis=None,
                        head_axis=None, scale=None, initial_state=None,
                        return_final_state=False, segment_ids=None,
                        impl="auto", chunk_size=64, w=None):
  """:func:`deltajax.gated_delta` with B and/or H split over axes of ``mesh``.

  Each device runs its slice with no communication.

  Args:
    q, k, v, a, b, initial_state: as for :func:`deltajax.gated_delta`, in the
      ``[B, T, H, ...]`` form (``a`` of q's shape is KDA's per-channel gate).
    mesh: a ``jax.sharding.Mesh``.
    batch_axis, head_axis: mesh axis names that split B and H (None: not
      split); B and H must be divisible by their sizes.
    scale, return_final_state, segment_ids, impl, chunk_size: as for
      :func:`deltajax.gated_delta`.
    w: None, or Gated DeltaNet-2's write gate ``[B, T, HV, V]``; then ``b``
      is its erase gate ``[B, T, HV, K]`` (:func:`deltajax.gdn2`).

  Returns:
    ``o`` ``[B, T, HV, V]`` or ``(o, final_state)``, sharded like the inputs.
  """
  o, final_state = _across_devices(
      q, k, v, a, b, w, initial_state, segment_ids, mesh=mesh,
      batch_axis=batch_axis, seq_axis=None, head_axis=head_axis, scale=scale,
      impl=impl, chunk_size=chunk_size)
  return (o, final_state) if return_final_state else o


def gated_delta_sequence_parallel(q, k, v, a, b, *, mesh, axis_name,
                                  scale=None, initial_state=None,
                                  return_final_state=False, segment_ids=None,
                                  impl="auto", chunk_size=64, batch_axis=None,
                                  head_axis=None, w=None):
  """:func:`deltajax.gated_delta` with T split across the devices of a mesh axis.

  Device ``d`` of ``axis_name`` holds tokens ``[d T / D, (d + 1) T / D)``;
  ``D`` must divide T (and ``T / D`` is best a multiple of ``chunk_size``).

  Cost per device, against one device running the whole sequence: its
  segment on twice the batch (value width ``max(K, V)``); ``log2(D) + 1``
  exchanges of ``[B, H, K, K + V]`` (or less) with a neighbour, each with
  ``[K, K] x [K, K + V]`` matmuls per (batch, head); and one
  ``[T / D, K] x [K, V]`` matmul per (batch, head). Gradients are those of
  autodiff through this computation.

  Args:
    q, k, v, a, b, initial_state: as for :func:`deltajax.gated_delta`, in the
      ``[B, T, H, ...]`` form (``a`` of q's shape is KDA's per-channel gate).
    mesh: a ``jax.sharding.Mesh``.
    axis_name: the mesh axis that splits T.
    scale, return_final_state, segment_ids, impl, chunk_size: as for
      :func:`deltajax.gated_delta` (packed documents by ``segment_ids``; a
      document may span devices). ``cu_seqlens`` is not supported here:
      pass its documents as ``segment_ids`` of one row.
    batch_axis, head_axis: optional further mesh axes that split B and H.
    w: None, or Gated DeltaNet-2's write gate ``[B, T, HV, V]``; then ``b``
      is its erase gate ``[B, T, HV, K]`` (:func:`deltajax.gdn2`).

  Returns:
    ``o`` ``[B, T, HV, V]`` or ``(o, final_state)``, as
    :func:`deltajax.gated_delta` returns them.
  """
  o, final_state = _across_devices(
      q, k, v, a, b, w, initial_state, segment_ids, mesh=mesh,
      batch_axis=batch_axis, seq_axis=axis_name, head_axis=head_axis,
      scale=scale, impl=impl, chunk_size=chunk_size)
  return (o, final_state) if return_final_state else o


def gated_delta_in_pieces(q, k, v, a, b, *, pieces, scale=None,
                          initial_state=None, return_final_state=False,
                          segment_ids=None, impl="auto", chunk_size=64,
                          w=None):
  """:func:`deltajax.gated_delta` with T cut into pieces run side by side.

  For calls whose few (batch, head) pairs leave most of a GPU idle in the
  sequential state scan: the sequence is cut into ``pieces`` equal runs of
  tokens, which become rows of one batched call on this device; each run's
  affine map from its entry state (as :func:`gated_delta_sequence_parallel`
  forms it across devices) is composed by a scan over the pieces, and the
  outputs corrected with one matmul. Exact: the same result as one call up
  to rounding.

  Cost, against one call: the whole sequence on twice the batch (value
  width ``max(K, V)``), which the kernels run ``pieces`` times more in
  parallel and with ``pieces`` times fewer sequential steps; ``pieces - 1``
  compositions of ``[K, K] x [K, K + V]`` per (batch, head); one
  ``[T, K] x [K, V]`` product per (batch, head). Gradients are those of
  autodiff through this computation. On the H200 with ``impl="mosaic"``
  it was slower than one call at every shape timed
  (benchmarks/RESULTS.md); ``"mosaic"`` cuts such sequences itself inside
  its kernels (``deltajax.mosaic.Config.pieces``), without the doubled
  batch.

  Args:
    q, k, v, a, b, initial_state, scale, return_final_state, segment_ids,
      impl, chunk_size: as for :func:`deltajax.gated_delta`, in the
      ``[B, T, H, ...]`` form (``a`` of q's shape is KDA's per-channel
      gate); a document of ``segment_ids`` may span pieces. T is padded at
      its end to a multiple of ``pieces * chunk_size`` with tokens that
      leave the state unchanged.
    pieces: the number of runs of tokens (>= 1).
    w: None, or Gated DeltaNet-2's write gate ``[B, T, HV, V]``; then ``b``
      is its erase gate ``[B, T, HV, K]`` (:func:`deltajax.gdn2`).

  Returns:
    ``o`` ``[B, T, HV, V]`` or ``(o, final_state)``, as
    :func:`deltajax.gated_delta` returns them.
  """
  if not isinstance(pieces, int) or pieces < 1:
    raise ValueError(f"pieces must be a positive int; got {pieces!r}")
  q, k, v, a, b = (jnp.asarray(x) for x in (q, k, v, a, b))
  w = None if w is None else jnp.asarray(w)
  if segment_ids is not None:
    segment_ids = jnp.asarray(segment_ids)
  options = dict(scale=scale, impl=impl, chunk_size=chunk_size)
  _check_inputs(q, k, v, a, b, w, initial_state, segment_ids, options)
  o, final_state = _in_pieces(q, k, v, a, b, w,
                              _initial_state(q, k, v, initial_state),
                              segment_ids, pieces=pieces, **options)
  return (o, final_state) if return_final_state else o


@functools.partial(jax.jit, static_argnames=("pieces", "scale", "impl",
                                             "chunk_size"))
def _in_pieces(q, k, v, a, b, w, initial_state, segment_ids, *, pieces,
               scale, impl, chunk_size):
  """:func:`gated_delta_in_pieces` on checked inputs."""
  if pieces == 1:
    return _rule(q, k, v, a, b, w, initial_state=initial_state,
                 segment_ids=segment_ids, return_final_state=True,
                 scale=scale, impl=impl, chunk_size=chunk_size)
  bsz, t = q.shape[:2]
  length = common.round_up(t, pieces * chunk_size) // pieces
  # Zero keys and gates leave the state unchanged; their outputs are dropped.
  as_rows = lambda x: None if x is None else common.pad_axis(
      x, 1, pieces * length).reshape(bsz * pieces, length, *x.shape[2:])
  carries = None
  if segment_ids is not None:
    # A piece continues its predecessor's document unless one starts at its
    # first token (the padding continues the last document).
    ids = jnp.pad(segment_ids, ((0, 0), (0, pieces * length - t)),
                  mode="edge").reshape(bsz, pieces, length)
    carries = jnp.concatenate(
        [jnp.ones((bsz, 1), bool), ids[:, 1:, 0] == ids[:, :-1, -1]],
        axis=1).reshape(-1)
    segment_ids = ids.reshape(bsz * pieces, length)
  o_zero, p, f, g = _segment_affine_map(
      *map(as_rows, (q, k, v, a, b, w)), segment_ids, carries, scale=scale,
      impl=impl, chunk_size=chunk_size)
  by_piece = lambda x: jnp.moveaxis(x.reshape(bsz, pieces, *x.shape[1:]), 1,
                                    0)
  final_state, entry = common.piece_entry_states(initial_state, by_piece(f),
                                                 by_piece(g))
  o = o_zero + common.einsum(
      "bthk,bhkv->bthv", p,
      jnp.moveaxis(entry, 0, 1).reshape(bsz * pieces, *entry.shape[2:]))
  o = o.reshape(bsz, pieces * length, *o.shape[2:])[:, :t]
  return o.astype(v.dtype), final_state


def _rule(q, k, v, a, b, w, **options):
  """:func:`deltajax.gated_delta`, or :func:`deltajax.gdn2` with the write
  gate ``w``."""
  if w is None:
    return api.gated_delta(q, k, v, a, b, **options)
  return api.gdn2(q, k, v, a, b, w, **options)


def _across_devices(q, k, v, a, b, w, initial_state, segment_ids, *, mesh,
                    batch_axis, seq_axis, head_axis, **options):
  """Checks the global inputs, then runs :func:`_shard_mapped`."""
  q, k, v, a, b = (jnp.asarray(x) for x in (q, k, v, a, b))
  w = None if w is None else jnp.asarray(w)
  if segment_ids is not None:
    segment_ids = jnp.asarray(segment_ids)
  _check_inputs(q, k, v, a, b, w, initial_state, segment_ids, options)
  _check_axes(q, mesh, batch_axis=batch_axis, head_axis=head_axis,
              axis_name=seq_axis)
  if seq_axis is not None and q.shape[1] % mesh.shape[seq_axis]:
    raise ValueError(
        f"T = {q.shape[1]} is not divisible by the {mesh.shape[seq_axis]} "
        f"devices of mesh axis {seq_axis!r}. Pad the sequence at its end "
        f"with tokens a = 0, b = 0 (they leave the state unchanged) and drop "
        f"their outputs.")
  return _shard_mapped(q, k, v, a, b, w,
                       _initial_state(q, k, v, initial_state), segment_ids, mesh=mesh, batch_axis=batch_axis, seq_axis=seq_axis,
                       head_axis=head_axis, **options)


def _check_inputs(q, k, v, a, b, w, initial_state, segment_ids,
                  options) -> None:
  """Raises :func:`deltajax.gated_delta`'s (or gdn2's) errors for the
  global shapes."""
  shapes = [None if x is None else jax.ShapeDtypeStruct(jnp.shape(x),
                                                        jnp.result_type(x))
            for x in (q, k, v, a, b, w, initial_state, segment_ids)]
  jax.eval_shape(
      lambda *x: _rule(*x[:6], initial_state=x[6], segment_ids=x[7],
                       **options),
      *shapes)
  if q.ndim != 4:
    raise ValueError(f"across devices, q, k must have shape [B, T, H, K]; got "
                     f"q {tuple(q.shape)}")


def _check_axes(q, mesh, **axes) -> None:
  """Checks that the named axes exist, are distinct and divide B and H."""
  named = {role: axis for role, axis in axes.items() if axis is not None}
  for role, axis in named.items():
    if axis not in mesh.axis_names:
      raise ValueError(f"{role}={axis!r} is not an axis of the mesh; its axes "
                       f"are {mesh.axis_names}")
  if len(set(named.values())) != len(named):
    raise ValueError(f"the mesh axes must be distinct; got {named}")
  for role, size in (("batch_axis", q.shape[0]), ("head_axis", q.shape[2])):
    if role in named and size % mesh.shape[named[role]]:
      raise ValueError(
          f"{role}={named[role]!r} has {mesh.shape[named[role]]} devices, "
          f"which do not divide {'B' if role == 'batch_axis' else 'H'} = "
          f"{size}")


def _initial_state(q, k, v, initial_state):
  """``initial_state`` in the compute dtype, zeros ``[B, HV, K, V]`` when None."""
  dtype = common.compute_dtype(q, k, v)
  if initial_state is None:
    return jnp.zeros((q.shape[0], v.shape[2], q.shape[3], v.shape[3]), dtype)
  return jnp.asarray(initial_state).astype(dtype)


def _specs(a, b, w, *, batch_axis, seq_axis, head_axis):
  """PartitionSpecs of ``(q, k, v, a, b, w, state, segment_ids)``."""
  x = P(batch_axis, seq_axis, head_axis, None)
  gate = lambda g: x if g.ndim == 4 else P(batch_axis, seq_axis, head_axis)
  return (x, x, x, gate(a), gate(b), None if w is None else x,
          P(batch_axis, head_axis, None, None), P(batch_axis, seq_axis))


def _reshard(xs, mesh, specs):
  """Lays ``xs`` out as ``specs`` say over the mesh's Explicit axes.

  shard_map requires this of Explicit axes (the default of
  ``jax.make_mesh``); over Auto axes it reshards the inputs itself.
  """
  explicit = {name for name, kind in zip(mesh.axis_names, mesh.axis_types)
              if kind == AxisType.Explicit}
  if not explicit:
    return xs
  return tuple(
      x if x is None else jax.reshard(x, NamedSharding(
          mesh, P(*(axis if axis in explicit else None for axis in spec))))
      for x, spec in zip(xs, specs))


@functools.partial(jax.jit, static_argnames=(
    "mesh", "batch_axis", "seq_axis", "head_axis", "scale", "impl",
    "chunk_size"))
def _shard_mapped(q, k, v, a, b, w, initial_state, segment_ids, *, mesh,
                  batch_axis, seq_axis, head_axis, scale, impl, chunk_size):
  """shard_map of gated_delta, or of :func:`_segment` when T is split."""
  options = dict(scale=scale, impl=impl, chunk_size=chunk_size)
  if seq_axis is None:
    per_device = lambda q, k, v, a, b, w, s, ids: _rule(
        q, k, v, a, b, w, initial_state=s, segment_ids=ids,
        return_final_state=True, **options)
  else:
    per_device = functools.partial(_segment, axis_name=seq_axis, **options)
  specs = _specs(a, b, w, batch_axis=batch_axis, seq_axis=seq_axis,
                 head_axis=head_axis)
  if segment_ids is None:
    specs = (*specs[:7], None)
  # check_vma=True would need every pallas_call output to declare the mesh
  # axes it varies over; the tests compare the gradients of the unchecked
  # mode with the single-device ones.
  return jax.shard_map(
      per_device, mesh=mesh, in_specs=specs, out_specs=(specs[2], specs[6]),
      check_vma=False)(*_reshard((q, k, v, a, b, w, initial_state,
                                  segment_ids), mesh, specs))


def _segment(q, k, v, a, b, w, initial_state, segment_ids, *, axis_name,
             scale, impl, chunk_size):
  """One device's segment: local shapes ``[B, T/D, H, ...]``.

  Returns ``o`` ``[B, T/D, HV, V]`` and the final state ``[B, HV, K, V]`` of
  the whole sequence, which the last device computes. With ``segment_ids``,
  a document that starts at this device's first token cuts the state that
  enters it: the segment's map from its entry state is then zero.
  """
  carries = None
  if segment_ids is not None:
    previous_last = lax.ppermute(
        segment_ids[:, -1], axis_name,
        [(i, i + 1) for i in range(lax.axis_size(axis_name) - 1)])
    carries = ((lax.axis_index(axis_name) == 0)
               | (previous_last == segment_ids[:, 0]))
  o_zero, p, f, g = _segment_affine_map(q, k, v, a, b, w, segment_ids,
                                        carries, scale=scale, impl=impl,
                                        chunk_size=chunk_size)
  s_in = _segment_initial_state(f, g, initial_state, axis_name)
  o = o_zero + common.einsum("bthk,bhkv->bthv", p, s_in)
  is_last = lax.axis_index(axis_name) == lax.axis_size(axis_name) - 1
  final_state = lax.psum(jnp.where(is_last, common.mm(f, s_in) + g, 0),
                         axis_name)
  return o.astype(v.dtype), final_state


def _segment_affine_map(q, k, v, a, b, w, segment_ids, carries, *, scale,
                        impl, chunk_size):
  """The segment as an affine function of its initial state ``S_in``.

  ``carries`` (``[B]`` bool or None) says whether ``S_in`` enters each row
  (False: a document starts at the segment's first token).

  The recurrence acts on every value column on its own, so one call on the
  batch stacked twice gives both parts: rows ``[:B]`` carry v from the zero
  state, rows ``[B:]`` zero values from the identity (value widths padded
  to ``max(K, V)``, so that a kernel limited to ``V <= K`` still takes it).

  Returns ``(o_zero, p, f, g)``: ``[B, T, HV, V]``, ``[B, T, HV, K]`` in v's
  dtype, ``[B, HV, K, K]``, ``[B, HV, K, V]`` in the compute dtype, with
  outputs ``o_zero + p S_in`` and final state ``f S_in + g``.
  """
  dtype = common.compute_dtype(q, k, v)
  bsz, t, hv, dv = v.shape
  dk = q.shape[-1]
  width = max(dk, dv)
  twice = lambda x: None if x is None else jnp.concatenate([x, x])
  # The zero values are in v's dtype: 16-bit inputs keep the 16-bit kernels.
  values = jnp.concatenate([common.pad_axis(v, 3, width),
                            jnp.zeros((bsz, t, hv, width), v.dtype)])
  if w is not None:  # the write gate of the padded columns is irrelevant
    w = twice(common.pad_axis(w, 3, width))
  identity = jnp.broadcast_to(jnp.eye(dk, width, dtype=dtype),
                              (bsz, hv, dk, width))
  if carries is not None:
    identity = identity * carries[:, None, None, None].astype(dtype)
  states = jnp.concatenate([jnp.zeros_like(identity), identity])
  o, s = _rule(twice(q), twice(k), values, twice(a), twice(b), w,
               scale=scale, initial_state=states, return_final_state=True,
               segment_ids=twice(segment_ids), impl=impl,
               chunk_size=chunk_size)
  return (o[:bsz, ..., :dv], o[bsz:, ..., :dk], s[bsz:, ..., :dk],
          s[:bsz, ..., :dv])


def _segment_initial_state(f, g, initial_state, axis_name):
  """The state entering this device's segment ``[B, H, K, V]``.

  A Hillis-Steele scan across devices: after the round with shift ``2^r``,
  device d holds the map of segments ``max(0, d - 2^{r+1} + 1) .. d``
  (composing ``(F, G)`` after ``(F', G')`` gives ``(F F', F G' + G)``); a
  last shift by one hands each device the state after the segments before
  it. ``log2(D)`` rounds of ``ppermute``, measured faster than all-gathering
  every map (benchmarks/RESULTS.md).
  """
  n = lax.axis_size(axis_name)
  index = lax.axis_index(axis_name)
  shift = 1
  while shift < n:
    f_prev, g_prev = lax.ppermute(
        (f, g), axis_name, [(i, i + shift) for i in range(n - shift)])
    has_prev = index >= shift
    f, g = (jnp.where(has_prev, common.mm(f, f_prev), f),
            jnp.where(has_prev, common.mm(f, g_prev) + g, g))
    shift *= 2
  after = lax.ppermute(common.mm(f, initial_state) + g, axis_name,
                       [(i, i + 1) for i in range(n - 1)])
  return jnp.where(index == 0, initial_state, after)
