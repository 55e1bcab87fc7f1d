"""The reverse state pass in Mosaic GPU: the state's cotangent, by chunks.

The transpose of :mod:`scan`'s state update, and the contract of
:func:`deltajax.pallas.reverse.backward`. One CTA (one warpgroup) per
(batch, value head, block of BV = 64 value columns) walks the chunks from
the last, with the cotangent ``dS [K, BV]`` of the chunk's exit state in
float32 registers (a wgmma accumulator). Per chunk (Gated DeltaNet's
chunkwise form; ``g`` the chunk-local cumulative gate)::

  dDelta = dDelta_local + e^{g_C - g} * (K dS)
  dS    <- e^{g_C} dS + Q^T (scale e^g * dO) - W^T dDelta

as wgmmas with 16-bit operands (``dS``, ``scale e^g * dO`` and ``-dDelta``
staged in shared memory) and float32 accumulation. Every exponent is
``<= 0``. TMA brings the next chunk's q, k, W, gate, dO and dDelta_local
into the other of two shared-memory slots meanwhile, and takes each
chunk's ``dS`` and dDelta out, both 16-bit:
:func:`deltajax.pallas.ut_backward.ut_backward` takes them to its products
so (the Pallas pass writes dDelta in float32 over
dDelta_local, in place; here, without aliasing, the 16-bit copy halves it).
:func:`backward` is the reverse pass of the one-warpgroup scan (under
``jax_enable_x64``, and for a per-channel gate).

:func:`specialized`, the reverse pass of the three-warpgroup scan (per
head), carries ``dS^T [BV, K]`` (every product's left operand in
registers: ``dS^T K^T``, then ``(scale e^g dO)^T Q - dDelta^T W``) and
forms what :func:`backward` reads from HBM: WG2 streams the chunks' q, k,
T, gate, beta and dO through two slots; WG1 forms each chunk's ``W = T
diag(b e^g) K`` and scores ``P = scale Gamma * Q K^T`` (16-bit, as
:func:`ut.w` and the output's backward form them) into the slot; WG0
carries ``dS^T`` with ``dDelta_local^T = dO^T P`` one more product of the
group that forms ``dS^T K^T``. So neither W nor the output's float32
dDelta_local goes through HBM, and it writes no dDelta:
:func:`deltajax.mosaic.chunk_backward.chunk_backward` forms it again.

Both passes walk pieces of the sequences as the scan does
(:class:`scan.Pieces`), each from its exit state's cotangent; a ``local``
pass writes nothing but each piece's entry cotangent.

A per-channel gate (KDA) comes as the Pallas kernels' decayed operands
(``per_channel`` of :func:`backward`), as the Pallas per-channel pass
takes them::

  dDelta = dDelta_local + (K e^{g_C - g}) dS
  dS    <- diag(e^{g_C}) dS + (Q e^g)^T (scale dO) - W^T dDelta

with ``e^{g_C}`` a ``[K]`` vector of the row layout scaling dS's rows: TMA
brings ``Q e^g`` and ``K e^{g_C - g}`` in place of q and k, and the gate at
the chunk's end in place of the gate: 217 KB of shared memory per CTA at
K = 128, as for the per-head gate.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from deltajax.mosaic import core
from deltajax.mosaic import scan
from deltajax.mosaic.core import COLS, ROWS, WGMMA
from deltajax.mosaic.scan import BOUNDS, BV, C

SLOTS = 2  # chunks of input tiles in flight
_INPUTS = 6  # TMA copies per chunk: q, k, W, the gate, dO, dDelta_local


class _Shared(NamedTuple):
  """Shared memory: per-slot input tiles, then the per-chunk tiles."""
  q: object       # [SLOTS, C, K] (per channel: Q e^g)
  k: object       # [SLOTS, C, K] (per channel: K e^{g_C - g})
  w: object       # [SLOTS, C, K]
  g: object       # [SLOTS, C] float32 (per channel [SLOTS, K]: g_C)
  d_o: object     # [SLOTS, C, BV]
  dd: object      # [SLOTS, C, BV] float32 dDelta_local
  ds: object      # [K, BV] dS's 16-bit copy
  read: object    # [C, BV] scale e^g * dO (per head)
  neg: object     # [C, BV] -dDelta
  out: object     # [C, BV] dDelta
  f: object       # [K, BV] float32: dS of a final, then an initial state
  loaded: object  # SLOTS barriers: a slot's tiles arrived
  final: object   # barrier: dS of a final state arrived
  bounds: object = None  # [SLOTS, BOUNDS] int32 packed: sequence bounds


def _exit_cotangent(mg, sh, slot, ds, final_at):
  """The cotangent of the state leaving the chunk in ``slot`` from ``ds``,
  the one entering the chunk after: packed (``sh.bounds``), its sequence's
  final state's (``final_at(seq)``, a GMEM ref) where the chunk ends
  one."""
  if sh.bounds is None:
    return ds

  def given():  # once sh.f's last entry cotangent has left
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    plgpu.copy_gmem_to_smem(final_at(sh.bounds[slot, 0]), sh.f, sh.final)
    plgpu.barrier_wait(sh.final)
    return mg.load(sh.f, WGMMA)

  return lax.cond(sh.bounds[slot, 2] != 0, given, lambda: ds)


def _store_entry_cotangent(sh, slot, ds, initial_at):
  """Packed (``sh.bounds``): ``ds``, the cotangent of the state entering
  the chunk in ``slot``, to its sequence's initial state's
  (``initial_at(seq)``, a GMEM ref) where the chunk starts one. What the
  walk carries on from there is never read: the chunk before is another
  sequence's last, which takes its own (:func:`_exit_cotangent`), in a
  piece's walk as in the composition of the pieces' cotangents."""
  if sh.bounds is None:
    return

  @pl.when(sh.bounds[slot, 1] != 0)
  def _store():
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    sh.f[...] = ds
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(sh.f, initial_at(sh.bounds[slot, 0]))


def _outputs(refs, local, deltas=True, packed=False):
  """``(d_delta_ref, d_next_ref, d_initial_ref, d_initials_ref, scratch)``
  (a ``local`` pass has only d_initial; without ``deltas``
  (:func:`specialized`'s), no d_delta; d_initials, the sequences', only
  ``packed``)."""
  if local:
    return None, None, refs[0], None, refs[1:]
  outs = refs[:2 + deltas + packed]
  if not deltas:
    outs = [None, *outs]
  return (*outs, *([] if packed else [None]), refs[2 + deltas + packed:])


def _body(mg, q_ref, k_ref, w_ref, g_ref, do_ref, dd_ref, dfinal_ref, *refs,
          groups, scale, per_channel, pieces, local, packed):
  bounds_ref, dfinals_ref, refs = ((*refs[:2], refs[2:]) if packed
                                   else (None, None, refs))
  d_delta_ref, d_next_ref, d_initial_ref, d_initials_ref, scratch = (
      _outputs(refs, local, packed=packed))
  sh = _Shared(*scratch)
  row, h, vb = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("v")
  (bi, first), n_chunks = pieces.rows(row), pieces.length
  hk, cols = lax.div(h, groups), pl.ds(vb * BV, BV)
  tile = (C, BV)

  def issue(n, slot):
    n = first + n
    tokens, arrived = pl.ds(n * C, C), sh.loaded.at[slot]
    copies = [(q_ref.at[bi, tokens, hk], sh.q),
              (k_ref.at[bi, tokens, hk], sh.k),
              (w_ref.at[bi, tokens, h], sh.w),
              (g_ref.at[bi, h, n if per_channel else tokens], sh.g),
              (do_ref.at[bi, tokens, h, cols], sh.d_o),
              (dd_ref.at[bi, tokens, h, cols], sh.dd)]
    if packed:
      copies.append((bounds_ref.at[n], sh.bounds))
    for src, dst in copies:
      plgpu.copy_gmem_to_smem(src, dst.at[slot], arrived)

  def begin(i):
    """``(n, slot, tokens)`` of the i-th chunk from the last, once its tiles
    are in, the next one's are on their way and chunk n + 1's stores have
    left."""
    n, slot = n_chunks - 1 - i, lax.rem(i, SLOTS)
    plgpu.barrier_wait(sh.loaded.at[slot])

    @pl.when(n > 0)
    def _prefetch():  # the other slot's last reader (chunk n + 1) is done
      issue(n - 1, 1 - slot)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    n = first + n
    return n, slot, pl.ds(n * C, C)

  def store(src, ref, at):
    """``src`` to ``ref.at[at]`` (not in a local pass)."""
    if not local:
      plgpu.copy_smem_to_gmem(src, ref.at[at])

  def factors(slot):
    """The chunk's per-head factors of dO and of ``K dS``: ``(scale e^g,
    e^{g_C - g})`` per row, ``[C, BV]``."""
    g, g_end = mg.load(sh.g.at[slot], ROWS), sh.g[slot, C - 1]
    return (core.rows(scale * jnp.exp(g), tile),
            core.rows(jnp.exp(g_end - g), tile))

  def decay(slot, ds):
    """``e^{g_C} dS``: per channel, ``e^{g_C} [K]`` scales dS's rows."""
    if per_channel:
      g_end = mg.load(sh.g.at[slot], ROWS)
      return core.rows(jnp.exp(g_end), ds.shape) * ds
    return jnp.exp(sh.g[slot, C - 1]) * ds

  def step(i, ds):
    n, slot, tokens = begin(i)
    ds = _exit_cotangent(mg, sh, slot, ds,
                         lambda m: state_at(dfinals_ref, m))
    sh.ds[...] = ds.astype(sh.ds.dtype)
    if per_channel:  # q and k come decayed
      on_kds, reads = 1.0, sh.d_o.at[slot]
    else:
      on_d_o, on_kds = factors(slot)
      d_o = mg.load(sh.d_o.at[slot], WGMMA).astype(jnp.float32)
      sh.read[...] = (on_d_o * d_o).astype(sh.read.dtype)
      reads = sh.read
    plgpu.commit_smem()
    store(sh.ds, d_next_ref, (bi, h, n, slice(None), cols))
    kds = mg.mm([(sh.k.at[slot], sh.ds)], tile)
    d_delta = mg.load(sh.dd.at[slot], WGMMA) + on_kds * kds
    # Per channel dO enters the product unscaled (exact in 16 bits) and the
    # sum is scaled after it, as in the Pallas pass: (scale dO) rounded to
    # 16 bits took dh0 at (1, 1024, 8, 128) past fla's 0.008 on the H200.
    unit = scale if per_channel else 1.0
    sh.out[...] = d_delta.astype(sh.out.dtype)
    sh.neg[...] = (-d_delta / unit).astype(sh.neg.dtype)
    plgpu.commit_smem()
    store(sh.out, d_delta_ref, (bi, tokens, h, cols))
    ds = entry(slot, unit * mg.mm([(core.T(sh.q.at[slot]), reads),
                                   (core.T(sh.w.at[slot]), sh.neg)], ds.shape,
                                  decay(slot, ds) / unit))
    if not local:
      _store_entry_cotangent(sh, slot, ds,
                             lambda m: state_at(d_initials_ref, m))
    return ds

  def entry(slot, ds):
    """The cotangent of the chunk's entry state, zero where its first token
    is a full forget (:func:`scan.forgets`)."""
    if per_channel:
      return scan.forgets(mg, ds, g_end=mg.load(sh.g.at[slot], ROWS))
    return scan.forgets(mg, ds, g_first=sh.g[slot, 0])

  # This CTA's columns of dS of state m.
  state_at = lambda ref, m=row: ref.at[m, h, :, cols]
  plgpu.copy_gmem_to_smem(state_at(dfinal_ref), sh.f, sh.final)
  issue(n_chunks - 1, 0)
  plgpu.barrier_wait(sh.final)
  ds = lax.fori_loop(0, n_chunks, step, mg.load(sh.f, WGMMA))
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  sh.f[...] = ds
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(sh.f, state_at(d_initial_ref))
  plgpu.wait_smem_to_gmem(0)


class _Formed(NamedTuple):
  """:func:`specialized`'s shared memory: per-slot input tiles, the tiles
  WG1 forms into the slot, then the per-chunk tiles."""
  q: object       # [SLOTS, C, K]
  k: object       # [SLOTS, C, K]
  t: object       # [SLOTS, C, C]
  g: object       # [SLOTS, C] float32
  beta: object    # [SLOTS, C] float32
  d_o: object     # [SLOTS, C, BV]
  w: object       # [SLOTS, C, K] W, formed by WG1
  p: object       # [SLOTS, C, C] P, formed by WG1
  kb: object      # [C, K] WG1's diag(b e^g) K
  ds: object      # [K, BV] dS's 16-bit copy
  f: object       # [BV, K] float32: dS^T of a final, then initial state
  loaded: object  # SLOTS barriers: a slot's tiles arrived
  formed: object  # SLOTS barriers: WG1 formed the slot's W and P
  free: object    # SLOTS barriers: WG0 and WG1 are done with the slot
  final: object   # barrier: dS^T of a final state arrived
  done: object    # barrier: every warpgroup is done
  bounds: object = None  # [SLOTS, BOUNDS] int32 packed: sequence bounds


def _specialized_body(mg, q_ref, k_ref, t_ref, g_ref, b_ref, do_ref,
                      dfinal_ref, *refs, groups, scale, pieces, local, packed):
  bounds_ref, dfinals_ref, refs = ((*refs[:2], refs[2:]) if packed
                                   else (None, None, refs))
  _, d_next_ref, d_initial_ref, d_initials_ref, scratch = _outputs(
      refs, local, deltas=False, packed=packed)
  sh = _Formed(*scratch)
  row, h, vb = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("v")
  (bi, first), n_chunks = pieces.rows(row), pieces.length
  hk, cols = lax.div(h, groups), pl.ds(vb * BV, BV)
  dtype = sh.q.dtype

  def at(i):
    """``(n, slot)`` of the i-th chunk from the last."""
    return first + n_chunks - 1 - i, lax.rem(i, SLOTS)

  def issue(i):
    n, slot = at(i)
    tokens, arrived = pl.ds(n * C, C), sh.loaded.at[slot]
    copies = [(q_ref.at[bi, tokens, hk], sh.q),
              (k_ref.at[bi, tokens, hk], sh.k),
              (t_ref.at[bi, h, tokens], sh.t),
              (g_ref.at[bi, h, tokens], sh.g),
              (b_ref.at[bi, h, tokens], sh.beta),
              (do_ref.at[bi, tokens, h, cols], sh.d_o)]
    if packed:
      copies.append((bounds_ref.at[n], sh.bounds))
    for src, dst in copies:
      plgpu.copy_gmem_to_smem(src, dst.at[slot], arrived)

  wg = lax.axis_index("wg")

  @pl.when(wg == 2)
  def _memory():
    mg.set_max_registers(40, action="decrease")
    for i in range(min(SLOTS, n_chunks)):
      issue(i)

    @pl.loop(SLOTS, n_chunks)
    def _refill(i):
      plgpu.barrier_wait(sh.free.at[lax.rem(i, SLOTS)])  # chunk i - SLOTS's
      issue(i)

    @pl.loop(max(n_chunks - SLOTS, 0), n_chunks)
    def _drain(i):  # observe the last chunks' releases too
      plgpu.barrier_wait(sh.free.at[lax.rem(i, SLOTS)])

  @pl.when(wg == 1)
  def _form():
    mg.set_max_registers(232, action="increase")

    @pl.loop(0, n_chunks)
    def _step(i):
      _, slot = at(i)
      plgpu.barrier_wait(sh.loaded.at[slot])  # and WG0 is done with the slot
      keys, square = sh.kb.shape, (C, C)
      g = mg.load(sh.g.at[slot], ROWS)
      k = mg.load(sh.k.at[slot], WGMMA).astype(jnp.float32)
      factor = mg.load(sh.beta.at[slot], ROWS) * jnp.exp(g)
      sh.kb[...] = (core.rows(factor, keys) * k).astype(dtype)
      plgpu.commit_smem()
      w, qk = mg.products([
          ([(sh.t.at[slot], sh.kb)], keys, None),
          ([(sh.q.at[slot], core.T(sh.k.at[slot]))], square, None)])
      gamma = scale * core.decay(mg, g, mg.load(sh.g.at[slot], COLS))
      sh.w.at[slot][...] = w.astype(dtype)
      sh.p.at[slot][...] = (gamma * qk).astype(dtype)
      plgpu.commit_smem()
      plgpu.barrier_arrive(sh.formed.at[slot])
      plgpu.barrier_arrive(sh.free.at[slot])

  @pl.when(wg == 0)
  def _state():
    mg.set_max_registers(232, action="increase")
    tile = (BV, C)
    per_column = lambda x: lax.broadcast_in_dim(x, tile, [1])
    # dS^T of state m's columns.
    state_at = lambda ref, m=row: ref.at[m, h, cols]

    def step(i, ds_t):
      n, slot = at(i)
      plgpu.barrier_wait(sh.loaded.at[slot])
      plgpu.barrier_wait(sh.formed.at[slot])
      ds_t = _exit_cotangent(mg, sh, slot, ds_t,
                             lambda m: state_at(dfinals_ref, m))
      g, g_end = mg.load(sh.g.at[slot], COLS), sh.g[slot, C - 1]
      ds_lo = ds_t.astype(dtype)
      d_o_t = mg.load(core.T(sh.d_o.at[slot]), WGMMA)
      kds_t, local_t = mg.products([
          ([(ds_lo, core.T(sh.k.at[slot]))], tile, None),
          ([(d_o_t, sh.p.at[slot])], tile, None)])
      d_delta_t = local_t + per_column(jnp.exp(g_end - g)) * kds_t
      read_t = per_column(scale * jnp.exp(g)) * d_o_t.astype(jnp.float32)

      def stores():  # once chunk n + 1's have left
        if local:
          return
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        mg.store_transposed(sh.ds, ds_lo)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(sh.ds, d_next_ref.at[bi, h, n, :, cols])

      (ds_t,) = mg.products(
          [([(read_t.astype(dtype), sh.q.at[slot]),
             ((-d_delta_t).astype(dtype), sh.w.at[slot])], ds_t.shape,
            jnp.exp(g_end) * ds_t)], meanwhile=stores)
      # Zero where the chunk's first token is a full forget: selected.
      ds_t = scan.forgets(mg, ds_t, g_first=sh.g[slot, 0])
      if not local:
        _store_entry_cotangent(sh, slot, ds_t,
                               lambda m: state_at(d_initials_ref, m))
      plgpu.barrier_arrive(sh.free.at[slot])
      return ds_t

    plgpu.copy_gmem_to_smem(state_at(dfinal_ref), sh.f, sh.final)
    plgpu.barrier_wait(sh.final)
    ds_t = lax.fori_loop(0, n_chunks, step, mg.load(sh.f, WGMMA))
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    sh.f[...] = ds_t
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(sh.f, state_at(d_initial_ref))
    plgpu.wait_smem_to_gmem(0)

  # Every warpgroup leaves together (as in scan's "specialized").
  plgpu.barrier_arrive(sh.done)
  plgpu.barrier_wait(sh.done)


def specialized(mg, q, k, t, g, b, d_o, d_final, *, scale, pieces=None,
                local=False, bounds=None, d_finals=None):
  """The per-head reverse pass of the three-warpgroup scan, carrying
  ``dS^T`` and forming W and dDelta_local itself.

  Args:
    mg: :class:`core.Mosaic`.
    q, k: ``[B, T, H, K]``, t: ``[B, HV, T, C]``
      (:func:`deltajax.pallas.ut.inverse`), d_o: ``[B, T, HV, V]``, one
      16-bit dtype; K in {64, 128}, V a multiple of 64, T a multiple of 64.
    g, b: ``[B, HV, T]`` float32: the chunk-local cumulative log gate, beta.
    d_final: ``[B P, HV, K, V]`` float32, the cotangent of each piece's
      exit state.
    scale: Python float multiplying q.
    pieces, local, bounds, d_finals: as for :func:`backward`.

  Returns:
    ``(None, d_next, d_initial)`` as :func:`backward` returns them, with no
    dDelta (:func:`deltajax.mosaic.chunk_backward.chunk_backward` forms it
    again), or with ``local`` ``d_initial``.
  """
  bsz, t_len, h, dk = k.shape
  heads, dv = d_o.shape[2:]
  dtype, packed = k.dtype, _packed(k, bounds, d_finals)
  pieces = _whole(pieces, t_len)
  transposed = lambda x: None if x is None else jnp.swapaxes(x, 2, 3)
  d_finals = transposed(d_finals)
  out_type = _out_type(None, dtype, (bsz, heads, t_len // C, dk, dv),
                       (d_final.shape[0], heads, dv, dk), local, d_finals)
  keys = core.smem((SLOTS, C, dk), dtype)
  square = core.smem((SLOTS, C, C), dtype)
  vec = plgpu.SMEM((SLOTS, C), jnp.float32)
  slots = plgpu.Barrier(num_arrivals=1, num_barriers=SLOTS)
  scratch = [keys, keys, square, vec, vec,
             core.smem((SLOTS, C, BV), dtype), keys, square,
             core.smem((C, dk), dtype), core.smem((dk, BV), dtype),
             core.smem((BV, dk), jnp.float32),
             plgpu.Barrier(num_arrivals=6 + packed, num_barriers=SLOTS),
             slots, plgpu.Barrier(num_arrivals=2, num_barriers=SLOTS),
             plgpu.Barrier(num_arrivals=1), plgpu.Barrier(num_arrivals=3),
             *_bounds_scratch(bounds)]
  body = lambda *refs: _specialized_body(mg, *refs, groups=heads // h,
                                         scale=scale, pieces=pieces,
                                         local=local, packed=packed)
  outs = mg.kernel(
      body, out_type=out_type, scratch_types=scratch,
      grid=(bsz * pieces.count, heads, dv // BV), grid_names=("b", "h", "v"),
      num_threads=3, thread_name="wg",
      kernel_name="deltajax_mosaic_reverse_specialized",
  )(q, k, t, g, b, d_o, transposed(d_final),
    *_packed_inputs(bounds, d_finals))
  *outs, d_initial = _initial_cotangents(outs, local, packed)
  d_initial = transposed(d_initial)
  if local:
    return d_initial
  return (None, *outs, d_initial)


def _whole(pieces, t_len):
  """``pieces``, or None: the whole sequence, one piece."""
  return scan.Pieces(1, t_len // C) if pieces is None else pieces


def _packed(k, bounds, d_finals):
  """Whether the pass is of packed sequences (their bounds and final
  cotangents come together, B = 1)."""
  if (bounds is None) != (d_finals is None):
    raise ValueError("packed sequences need both bounds and d_finals")
  if bounds is not None and k.shape[0] != 1:
    raise ValueError(f"packed sequences need B = 1; got {k.shape[0]}")
  return bounds is not None


def _bounds_scratch(bounds):
  """The shared memory of packed sequences' ``bounds``: one row per slot."""
  return [] if bounds is None else [plgpu.SMEM((SLOTS, BOUNDS), jnp.int32)]


def _packed_inputs(bounds, d_finals):
  """The kernel's inputs after d_final: packed, the bounds and the
  sequences' final cotangents."""
  return () if bounds is None else (bounds, d_finals)


def _out_type(d_delta, dtype, d_next, d_initial, local, d_finals=None):
  """The reverse pass's output types from their shapes: dDelta (where its
  shape is not None) and ``d_next`` (not in a ``local`` pass) in
  ``dtype``, ``d_initial`` float32, and packed (``d_finals``, not local)
  the sequences' initial cotangents, float32 as ``d_finals``."""
  initial = jax.ShapeDtypeStruct(d_initial, jnp.float32)
  if local:
    return [initial]
  deltas = [] if d_delta is None else [jax.ShapeDtypeStruct(d_delta, dtype)]
  sequences = [] if d_finals is None else [
      jax.ShapeDtypeStruct(d_finals.shape, jnp.float32)]
  return [*deltas, jax.ShapeDtypeStruct(d_next, dtype), initial, *sequences]


def _initial_cotangents(outs, local, packed):
  """The kernel's outputs with the initial cotangents the caller takes
  last: packed (not local), the sequences' in place of the pieces'."""
  if packed and not local:
    return (*outs[:-2], outs[-1])
  return outs


def backward(mg, q, k, w, g, d_o, d_delta_local, d_final, *, scale,
             per_channel=False, pieces=None, local=False, bounds=None,
             d_finals=None):
  """The state's cotangent at every chunk, and dDelta.

  Args:
    mg: :class:`core.Mosaic`.
    q, k: ``[B, T, H, K]``, w: ``[B, T, HV, K]``, d_o: ``[B, T, HV, V]``,
      one 16-bit dtype; K in {64, 128}, V a multiple of 64, T a multiple of
      64.
    g: ``[B, HV, T]`` float32 chunk-local cumulative log gate.
    d_delta_local: ``[B, T, HV, V]`` float32, the output's share of dDelta.
    d_final: ``[B P, HV, K, V]`` float32, the cotangent of the state
      leaving each of the ``P`` pieces.
    scale: Python float multiplying q.
    per_channel: for a per-channel gate: q and k are then ``Q e^g`` and
      ``K e^{g_C - g}`` (``[B, T, HV, K]``,
      :func:`deltajax.pallas.intra.chunk_gates`) and g the gate at each
      chunk's end, ``[B, HV, T / C, K]`` float32.
    pieces: :class:`scan.Pieces` walked side by side, each from its exit
      state's cotangent; None: the whole sequence, one piece.
    local: write nothing but ``d_initial`` (a piece's own share of its
      entry state's cotangent, from a zero ``d_final``).
    bounds, d_finals: None, or packed sequences (B = 1):
      :func:`scan.sequence_bounds` of the chunks and the cotangents of the
      sequences' final states ``[N, HV, K, V]`` float32: each enters the
      walk at its sequence's last chunk, and the cotangent leaving a
      sequence's first chunk is its initial state's (zeros carry on).

  Returns:
    ``(d_delta [B, T, HV, V], d_next [B, HV, T / C, K, V] (the cotangent of
    each chunk's exit state), both in k's dtype, d_initial [B P, HV, K, V]
    float32 (of each piece's entry state; packed, of each sequence's
    initial state, [N, HV, K, V]))``, or with ``local`` ``d_initial`` (the
    pieces').
  """
  bsz, t_len, h, dk = k.shape
  heads, dv = d_o.shape[2:]
  dtype, packed = k.dtype, _packed(k, bounds, d_finals)
  pieces = _whole(pieces, t_len)
  out_type = _out_type(d_o.shape, dtype, (bsz, heads, t_len // C, dk, dv),
                       d_final.shape, local, d_finals)
  keys = core.smem((SLOTS, C, dk), dtype)
  tile = core.smem((C, BV), dtype)
  scratch = [keys, keys, keys,
             plgpu.SMEM((SLOTS, dk if per_channel else C), jnp.float32),
             core.smem((SLOTS, C, BV), dtype),
             core.smem((SLOTS, C, BV), jnp.float32),
             core.smem((dk, BV), dtype), tile, tile, tile,
             core.smem((dk, BV), jnp.float32),
             plgpu.Barrier(num_arrivals=_INPUTS + packed, num_barriers=SLOTS),
             plgpu.Barrier(num_arrivals=1), *_bounds_scratch(bounds)]
  body = lambda *refs: _body(mg, *refs, groups=heads // h, scale=scale,
                             per_channel=per_channel, pieces=pieces,
                             local=local, packed=packed)
  outs = mg.kernel(
      body, out_type=out_type, scratch_types=scratch,
      grid=(bsz * pieces.count, heads, dv // BV), grid_names=("b", "h", "v"),
      kernel_name="deltajax_mosaic_reverse",
  )(q, k, w, g, d_o, d_delta_local, d_final,
    *_packed_inputs(bounds, d_finals))
  *outs, d_initial = _initial_cotangents(outs, local, packed)
  return d_initial if local else (*outs, d_initial)
