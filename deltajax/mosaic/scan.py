"""The fused forward in Mosaic GPU: the state scan and the output, by chunks.

One CTA per (batch, value head, block of BV = 64 value columns) walks the
chunks in order with the state ``S [K, BV]`` in float32 registers (a wgmma
accumulator). Per chunk (the UT form of Gated DeltaNet's chunkwise
algorithm: Yang, Kautz & Hatamizadeh, ICLR 2025; ``g`` the chunk-local
cumulative gate)::

  Delta = T diag(b) (V - (K e^g) S)              (= U - W S)
  O     = scale e^g * (Q S) + (scale Gamma * Q K^T) Delta
  S    <- e^{g_C} S + K^T (e^{g_C - g} Delta)

as wgmmas with 16-bit operands and float32 accumulation: ``K S`` (S's bf16
copy staged in shared memory), ``T Y``, the state update, ``Q K^T``, ``Q S``
(its rows scaled after) and ``P Delta``: P's two 16-bit halves against
Delta's 16-bit copy, the one the state update takes (rounding P too cost
1e-2 of o's relative error at b near 2 with aligned keys,
tests/test_mosaic.py). A per-channel gate's ``P Delta`` takes Delta's rest
as a third pass (two passes nearly doubled o's error with strong gates).
Every exponent is ``<= 0`` (``g`` falls within the chunk; above the
diagonal the difference is masked to ``-inf`` before ``exp``).

Two schedules of the same steps (:data:`SCHEDULES`):

* ``"one"``: one warpgroup does everything, in order; TMA brings the next
  chunk's q, k, v, T, gate and beta into the other of two shared-memory
  slots meanwhile;
* ``"specialized"``: three warpgroups: WG2 streams the chunks' tiles through
  two slots, WG0 carries ``S^T [BV, K]`` so that the products on the
  sequential path (``S^T K^T``, ``Y^T T^T``, ``E^T K``) take their left
  operands from registers, and publishes S's bf16 copy and Delta in shared
  memory while the update runs (two copies, alternating by chunk; without
  ``save``, as it carries them, transposed), WG1
  forms the scores and the output from them, two chunks behind WG0 at
  most. (One warpgroup carrying ``S^T`` alone was no faster than ``"one"``
  on the H200.)

A per-channel gate (KDA; schedule ``"one"`` only) comes as the Pallas
kernels' decayed operands and scores (``channel`` of :func:`forward`), as
the Pallas per-channel scan and output kernels take them::

  Delta = T diag(b) (V - (K e^g) S)
  O     = scale (Q e^g) S + P Delta
  S    <- diag(e^{g_C}) S + (K e^{g_C - g})^T Delta

with ``e^{g_C}`` a ``[K]`` vector of the row layout scaling S's rows. TMA
brings ``Q e^g``, ``K e^g`` and ``K e^{g_C - g}`` in place of q, k and the
gates, and P (float32, for its bf16 halves) into one slot of its own, the
next chunk's once this chunk's output has read it: 218 KB of shared memory
per CTA at K = 128 (179 KB for the per-head gate).

With ``save``, the kernel also writes what the backward reads, in v's
dtype: each chunk's entry state (``[B, HV, N, K, V]``) and, in schedule
``"one"``, Delta (the three-warpgroup schedule's backward,
:func:`deltajax.mosaic.chunk_backward.chunk_backward`, forms Delta again
from the states).

The grid's rows may be pieces of the sequences (:class:`Pieces`), each from
its own entry state. :func:`piece_maps` gives those: the same kernel with
K more value columns, the state from ``[I | 0]`` and v taken as zero in
the identity's columns (the columns of S evolve independently), and no
output (in the specialized schedule WG0 alone, with the loads' warpgroup),
leaves each piece's ``[M | E]``: ``S_exit = M S_entry + E``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from deltajax import common
from deltajax.mosaic import core
from deltajax.mosaic import ut
from deltajax.mosaic.core import COLS, ROWS, WGMMA

C = 64
BV = 64  # value columns per CTA
SLOTS = 2  # chunks of input tiles in flight
# TMA copies per chunk: q, k, v, T, the gate twice, beta (per channel: Q e^g,
# K e^g, v, T, K e^{g_C - g}, the gate at the chunk's end, beta).
_INPUTS = 7
SCHEDULES = ("one", "specialized")
# The words of a chunk's sequence bounds (:func:`sequence_bounds`): a TMA
# copy moves a multiple of 128 bytes.
BOUNDS = 32


class _Shared(NamedTuple):
  """Shared memory: per-slot input tiles, then the per-chunk tiles. A
  per-channel scan has none of :data:`_SCALAR_ONLY` (its output tile is
  ``y``), a scalar-gate one none of :data:`_CHANNEL_ONLY`, the specialized
  schedule none of :data:`_ONE_ONLY` and two of each :data:`_PUBLISHED`
  tile (a :class:`_Chunk` sees one of them)."""
  q: object       # [SLOTS, C, K] (per channel: Q e^g)
  k: object       # [SLOTS, C, K] (per channel: K e^g)
  kd: object      # [SLOTS, C, K] per channel: K e^{g_C - g}
  v: object       # [SLOTS, C, BV]
  t: object       # [SLOTS, C, C]
  g_rows: object  # [SLOTS, C] float32, read per row
  g_cols: object  # [SLOTS, C] float32, read per column
  g_end: object   # [SLOTS, K] float32 per channel: g at the chunk's end
  beta: object    # [SLOTS, C] float32
  bounds: object  # [SLOTS, BOUNDS] int32 packed: the chunk's sequence bounds
  s: object       # [K, BV] S's 16-bit copy ([BV, K] where carried)
  y: object       # [C, BV] diag(b) (V - (K e^g) S)
  d_hi: object    # [C, BV] Delta's 16-bit copy (Delta^T where carried)
  d_lo: object    # [C, BV] per channel: the rest of Delta
  e: object       # [C, BV] e^{g_C - g} Delta
  o: object       # [C, BV] the output tile
  f: object       # [K, BV] float32: an initial, then a final state
  p: object       # [C, C] float32 per channel: P (one slot, own barrier)
  loaded: object  # SLOTS barriers: a slot's tiles arrived
  s0: object      # barrier: the initial state arrived
  p_loaded: object  # barrier per channel: P arrived


# A per-channel scan reads its decays from the decayed operands and g_end;
# its output leaves through y (read by T Y before the output is stored).
_SCALAR_ONLY = ("g_rows", "g_cols", "e", "o")
_CHANNEL_ONLY = ("kd", "g_end", "p", "p_loaded", "d_lo")
# The specialized schedule forms Y and E in registers, and double-buffers
# what WG0 publishes for WG1 (and WG1's output tile), so that WG0 waits for
# WG1 to be done with chunk n - 2, not n - 1.
_ONE_ONLY = ("y", "e")
_PUBLISHED = ("s", "d_hi", "o")
# A map pass (:func:`piece_maps`) reads no queries and forms no output; in
# the specialized schedule it publishes nothing either.
_OUTPUT_ONLY = ("q", "o", "p", "p_loaded")
# Only with packed sequences (``chunk_seq``).
_PACKED_ONLY = ("bounds",)


class Pieces(NamedTuple):
  """Which runs of chunks the grid's rows walk: ``count`` pieces of each
  sequence, ``length`` chunks each; the grid's row ``b * count + p`` walks
  piece ``start + p``, from chunk ``(start + p) * length``."""
  count: int
  length: int
  start: int = 0

  def rows(self, row):
    """``(the sequence, the first chunk)`` of the grid's ``row``."""
    if (self.count, self.start) == (1, 0):
      # The whole sequence, indexed statically: JAX 0.10.2's interpreter
      # stalls in reverse.specialized when the first chunk is traced
      # (compiled, the H200 runs it in pieces at fla's tolerances).
      return row, 0
    piece = lax.rem(row, self.count) + self.start
    return lax.div(row, self.count), piece * self.length


def _roles(maps):
  """The specialized schedule's warpgroups by index: the state's, the
  output's (not in a map pass), the loads'."""
  return ("state", "memory") if maps else ("state", "output", "memory")


def _fields(per_channel, schedule, maps, packed):
  """The :class:`_Shared` fields that a scan of this gate and schedule (a
  map pass with ``maps``; ``packed``: of packed sequences) allocates."""
  absent = _SCALAR_ONLY if per_channel else _CHANNEL_ONLY
  if not packed:
    absent += _PACKED_ONLY
  if schedule != "one":
    absent += _ONE_ONLY
  if maps:
    absent += _OUTPUT_ONLY + (_PUBLISHED if schedule != "one" else ())
  return tuple(f for f in _Shared._fields if f not in absent)


def _shared(refs, per_channel, schedule, maps, packed):
  """``(_Shared, the remaining refs)`` from the kernel's scratch refs."""
  present = _fields(per_channel, schedule, maps, packed)
  named = dict(zip(present, refs))
  sh = _Shared(**{f: named.get(f) for f in _Shared._fields})
  if per_channel and not maps:
    sh = sh._replace(o=sh.y)
  return sh, refs[len(present):]


class _Chunk(NamedTuple):
  """One chunk's view of the kernel: refs, indices and its slot; ``values``
  (a map pass's) multiplies v: 0 in the identity's columns, else 1;
  ``carried``: S and Delta are published as WG0 carries them, ``S^T [BV,
  K]`` and ``Delta^T`` (the specialized schedule without ``save``)."""
  mg: object
  sh: _Shared
  slot: object
  tokens: object
  values: object = None
  carried: bool = False

  def published(self, ref):
    """A published tile (S's copy, Delta's) as a product's right
    operand: ``ref`` read transposed where it holds WG0's transpose."""
    return core.T(ref) if self.carried else ref

  @property
  def dtype(self):
    """The 16-bit dtype of the operands."""
    return self.sh.k.dtype

  def values_tile(self, layout):
    """This chunk's v tile in ``layout`` (a :class:`core.T` ref for
    V^T), float32."""
    v = self.mg.load(layout(self.sh.v.at[self.slot]), WGMMA).astype(
        jnp.float32)
    return v if self.values is None else self.values * v

  @property
  def per_channel(self):
    return self.sh.kd is not None

  def gates(self):
    """``(g [C] per row, g at the chunk's end)`` (a scalar gate's)."""
    return (self.mg.load(self.sh.g_rows.at[self.slot], ROWS),
            self.sh.g_rows[self.slot, C - 1])

  def delta(self, ks):
    """Delta from ``K S`` (float32 ``[C, BV]``; per channel ``(K e^g) S``),
    staged in ``d_hi`` (per channel its rest in ``d_lo``), and for a scalar
    gate its decay to the chunk's end in ``e``."""
    mg, sh, slot = self.mg, self.sh, self.slot
    g_row, g_end = (None, None) if self.per_channel else self.gates()
    tile = (C, BV)
    v = self.values_tile(lambda ref: ref)
    beta = mg.load(sh.beta.at[slot], ROWS)
    if g_row is not None:
      ks = core.rows(jnp.exp(g_row), tile) * ks
    sh.y[...] = (core.rows(beta, tile) * (v - ks)).astype(sh.y.dtype)
    plgpu.commit_smem()
    delta = mg.mm([(sh.t.at[slot], sh.y)], tile)
    if self.per_channel:
      sh.d_hi[...], sh.d_lo[...] = ut.halves(delta, sh.y.dtype)
    else:
      sh.d_hi[...] = delta.astype(sh.y.dtype)
    if g_row is not None:
      sh.e[...] = (delta * core.rows(jnp.exp(g_end - g_row), tile)).astype(
          sh.y.dtype)
    plgpu.commit_smem()

  def entry(self, s):
    """The state entering the chunk, ``s``, or zeros where the chunk's
    first token is a full forget (:func:`forgets`): selected, never
    multiplied by its zero decay, so a non-finite state stops there."""
    if self.per_channel:
      g_end = self.mg.load(self.sh.g_end.at[self.slot], ROWS)
      return forgets(self.mg, s, g_end=g_end)
    return forgets(self.mg, s, g_first=self.sh.g_rows[self.slot, 0])

  def decay(self, s):
    """``e^{g_C} S``: per channel, ``e^{g_C} [K]`` scales S's rows."""
    if self.per_channel:
      g_end = self.mg.load(self.sh.g_end.at[self.slot], ROWS)
      return core.rows(jnp.exp(g_end), s.shape) * s
    return jnp.exp(self.gates()[1]) * s

  def update(self, s, also=()):
    """``e^{g_C} S + K^T e`` (per channel ``diag(e^{g_C}) S + (K e^{g_C -
    g})^T Delta``, Delta's 16-bit rounding as in the Pallas scan), and the
    ``also`` products, waited for with it."""
    sh, slot = self.sh, self.slot
    pair = ((core.T(sh.kd.at[slot]), sh.d_hi) if self.per_channel
            else (core.T(sh.k.at[slot]), sh.e))
    return self.mg.products([([pair], s.shape, self.decay(s)), *also])

  def query_state(self):
    """The product ``Q S`` (per channel ``(Q e^g) S``; S staged)."""
    return [(self.sh.q.at[self.slot], self.published(self.sh.s))], (C,
                                                                   BV), None

  def scaled_query_state(self, qs, scale):
    """The output's inter-chunk part from :meth:`query_state`'s result:
    ``scale e^g * (Q S)`` (per channel ``scale (Q e^g) S``)."""
    if self.per_channel:
      return scale * qs
    g_row, _ = self.gates()
    return core.rows(scale * jnp.exp(g_row), qs.shape) * qs

  def queries(self):
    """The queries' products among the chunk's first ones (S staged):
    ``Q K^T`` (for the scores) and ``Q S`` for a scalar gate, ``(Q e^g) S``
    per channel."""
    if self.per_channel:
      return [self.query_state()]
    sh, slot = self.sh, self.slot
    return [([(sh.q.at[slot], core.T(sh.k.at[slot]))], (C, C), None),
            self.query_state()]

  def outputs(self, read, scale):
    """The product of the output from :meth:`queries`' results."""
    if self.per_channel:
      # As the Pallas per-channel output kernel: scale (Q e^g) S + P Delta,
      # P (scale included) from the Pallas intra.forward in float32.
      (qs,) = read
      plgpu.barrier_wait(self.sh.p_loaded)
      p = ut.halves(self.mg.load(self.sh.p, WGMMA), self.dtype)
    else:
      qk, qs = read
      p = self.scores(qk, scale)
    return self.p_delta(p), (C, BV), self.scaled_query_state(qs, scale)

  def scores(self, qk, scale):
    """``P = scale Gamma * Q K^T`` from ``qk``: its bf16 halves."""
    g_row, _ = self.gates()
    gamma = core.decay(self.mg, g_row,
                       self.mg.load(self.sh.g_cols.at[self.slot], COLS))
    return ut.halves(scale * gamma * qk, self.dtype)

  def p_delta(self, p):
    """The pairs of ``P Delta`` from P's halves and Delta's staged copy,
    with Delta's rest against P's first half per channel."""
    (p_hi, p_lo), sh = p, self.sh
    d_hi = self.published(sh.d_hi)
    rest = [] if sh.d_lo is None else [(p_hi, sh.d_lo)]
    return [(p_hi, d_hi), (p_lo, d_hi), *rest]

  def output(self, p, scale):
    """``O = scale e^g * (Q S) + P Delta`` (``p``: P's halves; Delta and S
    staged), its two products issued together."""
    qs, pd = self.mg.products([self.query_state(),
                               (self.p_delta(p), (C, BV), None)])
    return self.scaled_query_state(qs, scale) + pd

  def delta_transposed(self, ks_t):
    """``Delta^T = Y^T T^T`` from ``(K S)^T`` (float32 ``[BV, C]``), with
    ``Y^T = (V^T - (K S)^T e^g) diag(b)``: the specialized schedule's, every
    operand but T in registers."""
    mg, sh, slot = self.mg, self.sh, self.slot
    tile = (BV, C)
    cols = lambda x: lax.broadcast_in_dim(x, tile, [1])
    g_col = mg.load(sh.g_cols.at[slot], COLS)
    v_t = self.values_tile(core.T)
    beta = mg.load(sh.beta.at[slot], COLS)
    y_t = (cols(beta) * (v_t - cols(jnp.exp(g_col)) * ks_t)).astype(
        self.dtype)
    # Its operands are registers and T's slot, which nothing writes before
    # the update's meeting: no meeting here.
    return mg.mm([(y_t, core.T(sh.t.at[slot]))], tile, meet=False)

  def publish(self, s_t, delta_t):
    """S's and Delta's 16-bit copies in ``sh.s`` and ``sh.d_hi`` from WG0's
    ``S^T`` and ``Delta^T`` (16-bit): as they are where ``carried`` (WG1
    reads them transposed), else transposed (the layout that ``save``
    copies to HBM); commits every shared memory store so far."""
    for ref, x in ((self.sh.s, s_t), (self.sh.d_hi, delta_t)):
      if self.carried:
        ref[...] = x
      else:
        self.mg.store_transposed(ref, x)
    plgpu.commit_smem()

  def update_transposed(self, s_t, delta_t):
    """The product of ``S^T <- e^{g_C} S^T + (Delta^T e^{g_C - g}) K``."""
    mg, sh, slot = self.mg, self.sh, self.slot
    g_col, g_end = mg.load(sh.g_cols.at[slot], COLS), self.gates()[1]
    e_t = delta_t * lax.broadcast_in_dim(jnp.exp(g_end - g_col),
                                         delta_t.shape, [1])
    return ([(e_t.astype(self.dtype), sh.k.at[slot])], s_t.shape,
            jnp.exp(g_end) * s_t)

  def store_output(self, o, o_ref, at, in_flight=0):
    """``o`` to HBM through ``sh.o``, once at most ``in_flight`` of this
    thread's earlier stores are still reading shared memory."""
    plgpu.wait_smem_to_gmem(in_flight, wait_read_only=True)
    self.sh.o[...] = o.astype(self.sh.o.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(self.sh.o, o_ref.at[at])


def forgets(mg, s, *, g_first=None, g_end=None):
  """``s`` (a state or its cotangent, ``[K, BV]``, or transposed ``[BV,
  K]`` for a per-head gate) selected to zeros where the chunk's first token
  is a full forget: per head where the chunk-local cumulative gate there
  (``g_first``, the token's own) is at :data:`common.LOG_DECAY_FLOOR`; per
  channel by S's rows where ``g_end`` (the gate at the chunk's end, ``[K]``
  ROWS) is ``-inf``, the mark :func:`deltajax.mosaic.ops.mark_forgets`
  sets there (the floor at the end alone would not tell a forget at the
  first token from one later in the chunk)."""
  del mg
  if g_end is not None:
    forget = core.rows(g_end, s.shape) == -jnp.inf
  else:  # a whole tile: Mosaic GPU selects on no scalar condition
    forget = lax.broadcast_in_dim(g_first <= common.LOG_DECAY_FLOOR, s.shape,
                                  ())
  return jnp.where(forget, 0.0, s)


def _body(mg, q_ref, k_ref, v_ref, t_ref, g_ref, b_ref, s0_ref, *refs, groups,
          scale, save, schedule, per_channel, pieces, maps, packed):
  kd_ref, p_ref = refs[:2] if per_channel else (None, None)
  refs = refs[2:] if per_channel else refs
  bounds_ref, initials_ref, refs = ((*refs[:2], refs[2:]) if packed
                                    else (None, None, refs))
  o_ref, final_ref, *refs = (None, *refs) if maps else refs
  finals_ref, refs = ((refs[0], refs[1:]) if packed and not maps
                      else (None, refs))
  deltas = _saves_deltas(schedule)
  saved = (1 + deltas) if save else 0
  states_ref, delta_ref = (*refs[:saved], None, None)[:2]
  refs = refs[saved:]
  sh, sync = _shared(refs, per_channel, schedule, maps, packed)
  carried = _carried(schedule, save, maps)
  row, h, vb = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("v")
  (bi, first), n_chunks = pieces.rows(row), pieces.length
  hk, state_cols = lax.div(h, groups), pl.ds(vb * BV, BV)
  cols, values = state_cols, None
  if maps:  # the state's first K columns are the identity's, with v = 0
    identity = k_ref.shape[-1] // BV
    cols = pl.ds(jnp.maximum(vb - identity, 0) * BV, BV)
    values = jnp.minimum(lax.div(vb, identity), 1).astype(jnp.float32)

  def issue(n, slot):
    n = first + n
    tokens, arrived = pl.ds(n * C, C), sh.loaded.at[slot]
    copies = [] if maps else [(q_ref.at[bi, tokens, hk], sh.q)]
    copies += [(k_ref.at[bi, tokens, hk], sh.k),
               (v_ref.at[bi, tokens, h, cols], sh.v),
               (t_ref.at[bi, h, tokens], sh.t)]
    if per_channel:
      copies += [(kd_ref.at[bi, tokens, h], sh.kd),
                 (g_ref.at[bi, h, n], sh.g_end)]
    else:
      copies += [(g_ref.at[bi, h, tokens], sh.g_rows),
                 (g_ref.at[bi, h, tokens], sh.g_cols)]
    copies.append((b_ref.at[bi, h, tokens], sh.beta))
    if packed:
      copies.append((bounds_ref.at[n], sh.bounds))
    for src, dst in copies:
      plgpu.copy_gmem_to_smem(src, dst.at[slot], arrived)

  def issue_scores(n):
    """Chunk n's P (per channel) into its one slot."""
    plgpu.copy_gmem_to_smem(p_ref.at[bi, h, pl.ds((first + n) * C, C)],
                            sh.p, sh.p_loaded)

  def chunk(n):
    return _Chunk(mg, sh, lax.rem(n, SLOTS), pl.ds((first + n) * C, C),
                  values, carried)

  transposed = schedule != "one"  # carrying S^T
  # Columns ``c`` of state ``n`` of ``ref`` (rows of a transposed one).
  columns = lambda ref, n, c: ref.at[n, h, c] if transposed else (
      ref.at[n, h, :, c])

  def load_state(src):
    """The state tile ``src`` (GMEM) through ``sh.f``, once sh.f's last
    store has left."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    plgpu.copy_gmem_to_smem(src, sh.f, sh.s0)
    plgpu.barrier_wait(sh.s0)
    return mg.load(sh.f, WGMMA)

  def store_state(s, dst):
    """``s`` to the state tile ``dst`` (GMEM) through ``sh.f``."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    sh.f[...] = s
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(sh.f, dst)

  def enter(x, s):
    """The state entering chunk ``x`` from ``s``, the one leaving the chunk
    before: packed, where the chunk starts a sequence, that sequence's
    initial state (a map pass's ``[0 | S0]``: the entry state no longer
    counts); zeros at a full forget (:meth:`_Chunk.entry`)."""
    if packed:
      def initial():
        s0 = load_state(columns(initials_ref, sh.bounds[x.slot, 0], cols))
        return s0 if values is None else values * s0
      s = lax.cond(sh.bounds[x.slot, 1] != 0, initial, lambda: s)
    return x.entry(s)

  def leave(x, s):
    """Packed (not in a map pass): ``s``, the state leaving chunk ``x``, to
    its sequence's final state where the chunk ends one."""
    if finals_ref is not None:
      @pl.when(sh.bounds[x.slot, 2] != 0)
      def _store():
        store_state(s, columns(finals_ref, sh.bounds[x.slot, 0], cols))

  def publish_state(s):
    """S's 16-bit copy for the products (and to HBM with ``save``)."""
    sh.s[...] = s.astype(sh.s.dtype)
    plgpu.commit_smem()

  def save_chunk(n, x):
    if save:
      plgpu.copy_smem_to_gmem(x.sh.s,
                              states_ref.at[bi, h, first + n, :, cols])
      if deltas:
        plgpu.copy_smem_to_gmem(x.sh.d_hi,
                                delta_ref.at[bi, x.tokens, h, cols])

  def begin(n):
    """Chunk n of the one-warpgroup schedule, once its tiles are in, the
    next chunk's are on their way and chunk n - 1's stores have left."""
    x = chunk(n)
    plgpu.barrier_wait(sh.loaded.at[x.slot])

    @pl.when(n + 1 < n_chunks)
    def _prefetch():  # the other slot's last reader (chunk n - 1) is done
      issue(n + 1, 1 - x.slot)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    return x

  def initial_state():
    return load_state(columns(s0_ref, row, state_cols))

  def final_state(s):
    """``s`` to the row's final state, once every store has left."""
    store_state(s, columns(final_ref, row, state_cols))
    plgpu.wait_smem_to_gmem(0)

  if schedule == "one":
    def step(n, s):
      x = begin(n)
      s = enter(x, s)
      publish_state(s)
      ks, *read = mg.products([([(sh.k.at[x.slot], sh.s)], (C, BV), None),
                               *([] if maps else x.queries())])
      x.delta(ks)
      save_chunk(n, x)
      if maps:
        return x.update(s)[0]
      s, o = x.update(s, also=[x.outputs(read, scale)])
      leave(x, s)
      x.store_output(o, o_ref, (bi, x.tokens, h, cols))
      if per_channel:
        @pl.when(n + 1 < n_chunks)
        def _next_scores():  # this chunk's P was read (store_output syncs)
          issue_scores(n + 1)
      return s

    issue(0, 0)
    if per_channel and not maps:
      issue_scores(0)
    final_state(lax.fori_loop(0, n_chunks, step, initial_state()))
    return

  free, done = sync[0], sync[-1]
  s_ready, s_free = sync[1:3] if not maps else (None, None)
  wg = lax.axis_index("wg")

  def published(n):
    """Chunk n with its half of the published tiles, and that half."""
    half = lax.rem(n, 2)
    x = chunk(n)
    views = {f: getattr(sh, f).at[half] for f in _PUBLISHED}
    return x._replace(sh=sh._replace(**views)), half

  roles = _roles(maps)

  @pl.when(wg == roles.index("memory"))
  def _memory():
    mg.set_max_registers(40, action="decrease")
    for n in range(min(SLOTS, n_chunks)):
      issue(n, n)

    @pl.loop(SLOTS, n_chunks)
    def _refill(n):
      slot = lax.rem(n, SLOTS)
      plgpu.barrier_wait(free.at[slot])  # both readers of chunk n - SLOTS
      issue(n, slot)

    @pl.loop(max(n_chunks - SLOTS, 0), n_chunks)
    def _drain(n):  # observe the last chunks' releases too
      plgpu.barrier_wait(free.at[lax.rem(n, SLOTS)])

  @pl.when(wg == roles.index("state"))
  def _state():
    mg.set_max_registers(232, action="increase")

    def step(n, s_t):
      x, half = (chunk(n), None) if maps else published(n)
      plgpu.barrier_wait(sh.loaded.at[x.slot])
      s_t = enter(x, s_t)
      s_lo = s_t.astype(x.dtype)
      # Nothing writes K's slot before the update's meeting.
      (ks_t,) = mg.products([([(s_lo, core.T(sh.k.at[x.slot]))], (BV, C),
                              None)], meet=False)
      delta_t = x.delta_transposed(ks_t)
      if maps:
        (s_t,) = mg.products([x.update_transposed(s_t, delta_t)])
        plgpu.barrier_arrive(free.at[x.slot])
        return s_t

      def publish():  # while the update runs
        @pl.when(n >= 2)
        def _():  # WG1 is done with chunk n - 2's S and Delta
          plgpu.barrier_wait(s_free.at[half])

        x.publish(s_lo, delta_t.astype(x.dtype))
        plgpu.barrier_arrive(s_ready.at[half])

      (s_t,) = mg.products([x.update_transposed(s_t, delta_t)],
                           meanwhile=publish)
      leave(x, s_t)
      plgpu.barrier_arrive(free.at[x.slot])
      return s_t

    s = lax.fori_loop(0, n_chunks, step, initial_state())
    if not maps:
      for n in range(max(n_chunks - 2, 0), n_chunks):  # WG1's last releases
        plgpu.barrier_wait(s_free.at[n % 2])
    final_state(s)

  if not maps:
    @pl.when(wg == roles.index("output"))
    def _output():
      mg.set_max_registers(232, action="increase")

      @pl.loop(0, n_chunks)
      def _step(n):
        x, half = published(n)
        plgpu.barrier_wait(sh.loaded.at[x.slot])
        # Q's and K's slot are released after the output's meeting.
        qk = mg.mm([(sh.q.at[x.slot], core.T(sh.k.at[x.slot]))], (C, C),
                   meet=False)
        p = x.scores(qk, scale)
        plgpu.barrier_wait(s_ready.at[half])
        o = x.output(p, scale)
        save_chunk(n, x)
        if save:  # S and Delta stay until their copies have left
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        plgpu.barrier_arrive(s_free.at[half])
        plgpu.barrier_arrive(free.at[x.slot])
        # The other half's tile (chunk n - 1's output) may still be leaving.
        x.store_output(o, o_ref, (bi, x.tokens, h, cols), in_flight=1)

      plgpu.wait_smem_to_gmem(0)

  # Every warpgroup leaves together (jla saw illegal instructions on sm_90
  # when one exited while another still issued wgmmas).
  plgpu.barrier_arrive(done)
  plgpu.barrier_wait(done)


def forward(mg, q, k, v, t, g, b, initial_state, *, scale, save,
            schedule="one", channel=None, pieces=None, bounds=None,
            initials=None):
  """The outputs and final state (and with ``save`` the backward's inputs).

  Args:
    mg: :class:`core.Mosaic`.
    q, k: ``[B, T, H, K]``, v: ``[B, T, HV, V]``, one 16-bit dtype; K in
      {64, 128}, V a multiple of 64, T a multiple of 64.
    t: ``[B, HV, T, C]`` from :func:`deltajax.pallas.ut.inverse`.
    g, b: ``[B, HV, T]`` float32: the chunk-local cumulative log gate, beta.
    initial_state: ``[B P, HV, K, V]`` float32, the state entering each of
      the ``P = pieces.count`` pieces of each sequence.
    scale: Python float multiplying q.
    save: also return the chunk-entry states and Delta (None in
      schedule "specialized", whose backward forms it again).
    schedule: one of :data:`SCHEDULES`.
    channel: for a per-channel gate (schedule "one" only), ``(kd, p)``:
      ``K e^{g_C - g} [B, T, HV, K]`` in q's dtype and ``P = scale Gamma *
      Q K^T [B, HV, T, C]`` float32 (:func:`deltajax.pallas.intra.forward`);
      q and k are then ``Q e^g`` and ``K e^g`` (``[B, T, HV, K]``) and g
      the gate at each chunk's end, ``[B, HV, T / C, K]`` float32.
    pieces: :class:`Pieces` that cover the sequence, walked side by side
      from the given entry states; None: the whole sequence, one piece.
    bounds, initials: None, or packed sequences (B = 1):
      :func:`sequence_bounds` of the chunks and the sequences' initial
      states ``[N, HV, K, V]`` float32; a sequence's first chunk enters
      from its own (whatever the piece's entry state).

  Returns:
    ``(o [B, T, HV, V] in v's dtype, the state leaving each piece [B P, HV,
    K, V] float32)`` (packed, each sequence's final state ``[N, HV, K,
    V]``, undefined for one without chunks), then with ``save`` ``states
    [B, HV, T / C, K, V]`` and ``delta [B, T, HV, V]`` (or None) in v's
    dtype.
  """
  if pieces is None:
    pieces = Pieces(1, k.shape[1] // C)
  if pieces.count * pieces.length * C != k.shape[1]:
    raise ValueError(f"{pieces} do not cover T = {k.shape[1]}")
  _check_packed(k, bounds, initials)
  o, final, *rest = _launch(mg, q, k, v, t, g, b, initial_state, scale=scale,
                            save=save, schedule=schedule, channel=channel,
                            pieces=pieces, maps=False, bounds=bounds,
                            initials=initials)
  if bounds is not None:  # the sequences' final states, not the pieces'
    final, *rest = rest
  return (o, final, *rest)


def _check_packed(k, bounds, initials):
  """Packed sequences come as bounds and initial states together, B = 1."""
  if (bounds is None) != (initials is None):
    raise ValueError("packed sequences need both bounds and initials")
  if bounds is not None and k.shape[0] != 1:
    raise ValueError(f"packed sequences need B = 1; got {k.shape[0]}")


def sequence_bounds(chunk_seq):
  """int32 ``[T / C, BOUNDS]`` from ``chunk_seq [T / C]``: each chunk's
  sequence, whether it is the sequence's first chunk, whether its last,
  then zeros (one TMA copy per chunk, with its tiles)."""
  starts, ends = common.sequence_bounds(chunk_seq)
  bounds = jnp.stack([chunk_seq, starts, ends], axis=1).astype(jnp.int32)
  return common.pad_axis(bounds, 1, BOUNDS)


def piece_maps(mg, k, v, t, g, b, *, pieces, schedule="one", channel=None,
               bounds=None, initials=None):
  """Each piece's affine map from its entry state to its exit state, ``S ->
  M S + E``: the scan from ``[I | 0]`` on ``[0 | v]`` (its columns are
  independent), with no output.

  Args:
    mg, k, v, t, g, b, schedule: as for :func:`forward`.
    pieces: :class:`Pieces`, the runs of chunks to map (from the first).
    channel: per channel, ``(kd, p)`` as for :func:`forward` (P is not
      read); ``k`` is then ``K e^g``.
    bounds, initials: packed sequences, as for :func:`forward`: where a
      sequence starts, the map pass's state becomes ``[0 | S0]`` (its
      initial state S0), so that ``M`` is 0 past it and ``E`` carries S0.

  Returns:
    ``(M [B P, HV, K, K], E [B P, HV, K, V])`` float32.
  """
  bsz, _, _, dk = k.shape
  heads, dv = v.shape[2:]
  start = jnp.concatenate([jnp.eye(dk, dtype=jnp.float32),
                           jnp.zeros((dk, dv), jnp.float32)], axis=1)
  start = jnp.broadcast_to(start, (bsz * pieces.count, heads, dk, dk + dv))
  _check_packed(k, bounds, initials)
  (maps,) = _launch(mg, k, k, v, t, g, b, start, scale=1.0, save=False,
                    schedule=schedule, channel=channel, pieces=pieces,
                    maps=True, bounds=bounds, initials=initials)
  return maps[..., :dk], maps[..., dk:]


def _saves_deltas(schedule):
  """Whether ``save`` writes Delta: for the one-warpgroup schedule's
  backward; the three-warpgroup one's forms it again."""
  return schedule == "one"


def _carried(schedule, save, maps):
  """Whether WG0 publishes ``S^T`` and ``Delta^T`` as it carries them
  (:class:`_Chunk`): the specialized scan with an output and no saves."""
  return schedule == "specialized" and not (save or maps)


def _launch(mg, q, k, v, t, g, b, initial_state, *, scale, save, schedule,
            channel, pieces, maps, bounds=None, initials=None):
  """The scan kernel: ``(o, the pieces' final states, [packed: the
  sequences' final states], *saved)``, or with ``maps`` (the initial
  state's columns past v's the identity's) the pieces' final states
  alone."""
  if schedule not in SCHEDULES:
    raise ValueError(f"schedule: {schedule!r} is not one of {SCHEDULES}")
  per_channel, packed = channel is not None, bounds is not None
  if per_channel and schedule != "one":
    raise ValueError(f"schedule {schedule!r} has only the per-head gate; "
                     f"the per-channel one runs in schedule 'one'")
  bsz, t_len, h, dk = k.shape
  heads, dv = v.shape[2:]
  dtype = v.dtype
  transposed = schedule != "one"
  if transposed:  # the kernel carries S^T: [B, HV, V, K] in and out
    initial_state, initials = (None if x is None else jnp.swapaxes(x, 2, 3)
                               for x in (initial_state, initials))
  out_type = [jax.ShapeDtypeStruct(initial_state.shape, jnp.float32)]
  if not maps:
    out_type.insert(0, jax.ShapeDtypeStruct(v.shape, dtype))
    if packed:
      out_type.append(jax.ShapeDtypeStruct(initials.shape, jnp.float32))
  deltas = _saves_deltas(schedule)
  if save:
    out_type += [jax.ShapeDtypeStruct((bsz, heads, t_len // C, dk, dv), dtype),
                 *([jax.ShapeDtypeStruct(v.shape, dtype)] if deltas else [])]
  vec = plgpu.SMEM((SLOTS, C), jnp.float32)
  tile = core.smem((C, BV), dtype)
  copies = (2,) if transposed else ()  # of each _PUBLISHED tile
  published = core.smem((*copies, C, BV), dtype)
  keys = core.smem((SLOTS, C, dk), dtype)
  types = dict(
      q=keys, k=keys, kd=keys, v=core.smem((SLOTS, C, BV), dtype),
      t=core.smem((SLOTS, C, C), dtype), g_rows=vec, g_cols=vec,
      g_end=plgpu.SMEM((SLOTS, dk), jnp.float32), beta=vec,
      bounds=plgpu.SMEM((SLOTS, BOUNDS), jnp.int32),
      s=core.smem((*copies, *((BV, dk) if _carried(schedule, save, maps)
                              else (dk, BV))), dtype),
      y=tile, d_hi=published,
      d_lo=published, e=tile, o=published,
      f=core.smem((BV, dk) if transposed else (dk, BV), jnp.float32),
      p=core.smem((C, C), jnp.float32),
      loaded=plgpu.Barrier(num_arrivals=_INPUTS - maps + packed,
                           num_barriers=SLOTS),
      s0=plgpu.Barrier(num_arrivals=1), p_loaded=plgpu.Barrier(num_arrivals=1))
  scratch = [types[f] for f in _fields(per_channel, schedule, maps, packed)]
  threads = {}
  if schedule == "specialized":
    roles = _roles(maps)
    halves = [] if maps else [plgpu.Barrier(num_arrivals=1, num_barriers=2)]
    scratch += [plgpu.Barrier(num_arrivals=len(roles) - 1,
                              num_barriers=SLOTS), *halves, *halves,
                plgpu.Barrier(num_arrivals=len(roles))]
    threads = dict(num_threads=len(roles), thread_name="wg")
  body = lambda *refs: _body(mg, *refs, groups=heads // h, scale=scale,
                             save=save, schedule=schedule,
                             per_channel=per_channel, pieces=pieces,
                             maps=maps, packed=packed)
  rows = bsz * pieces.count
  outs = mg.kernel(
      body, out_type=out_type, scratch_types=scratch,
      grid=(rows, heads, initial_state.shape[-1 - transposed] // BV),
      grid_names=("b", "h", "v"),
      kernel_name="deltajax_mosaic_" + ("maps" if maps else "scan"),
      **threads,
  )(q, k, v, t, g, b, initial_state, *(channel or ()),
    *(() if bounds is None else (bounds, initials)))
  o, *outs = (None, *outs) if maps else outs
  # The pieces' final states (and packed, the sequences'), then the saves.
  count = 2 if packed and not maps else 1
  finals, saved = outs[:count], outs[count:]
  if transposed:
    finals = [jnp.swapaxes(x, 2, 3) for x in finals]
  if maps:
    return tuple(finals)
  return (o, *finals, *saved, *([None] if save and not deltas else []))
