"""Math shared by every implementation: dtypes, padding, chunking, gates, packing.

Conventions used throughout deltajax (what ``api`` passes to every
implementation; see :data:`deltajax.registry.CONTRACT`):

* Arrays use fla's layout: q, k ``[B, T, H, K]``, v ``[B, T, HV, V]`` with
  ``HV = G H`` value heads (grouped value heads; value head ``j`` reads
  query/key head ``j // G``).
* The gate ``a`` (log decay, ``<= 0``, finite) is carried as
  ``[B, T, HV, W]`` with ``W = 1`` for Gated DeltaNet's scalar gate and
  ``W = K`` for KDA's per-channel gate, so that the same broadcasting code
  serves both.
* ``cut`` (bool, a's shape, or None) marks tokens before which the state is
  discarded: the start of a packed document (``segment_ids``). A full
  forget (``a = -inf``, clamped at :data:`LOG_DECAY_FLOOR`) discards it
  too: scan and chunked make it a cut with ``a = 0`` (:func:`token_step`,
  :meth:`ChunkGate.of`); the GPU kernels keep it clamped.
* ``chunk_seq`` (int32 ``[T / C]``, or None) gives, for inputs packed with
  ``cu_seqlens`` (B = 1), the sequence that owns each chunk; ``api`` lays
  the tokens out so that every sequence starts at a chunk boundary.
* The state is ``[N, HV, K, V]`` (the papers' ``S^T``, keys by values), with
  ``N = B``, or the number of sequences when ``chunk_seq`` is given.
* ``q`` arrives unscaled; implementations multiply by ``scale``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

SUB = 16  # block size of the blocked triangular inverse

# Every implementation clamps the log decay at this floor (a = -inf forgets
# fully; :func:`floored`): exp(-200) is 0 in float32 and negligible in
# float64, and finite gates keep the cumulative sums free of inf - inf. A
# token at the floor is a cut inside a chunk (:meth:`ChunkGate.of`), so that
# the gates after it keep their precision instead of sitting 200 below the
# chunk's start.
LOG_DECAY_FLOOR = -200.0


def floored(a: jax.Array) -> jax.Array:
  """The log decay clamped at :data:`LOG_DECAY_FLOOR` (its gradient is 0
  below the floor)."""
  return jnp.maximum(a, LOG_DECAY_FLOOR)


def compute_dtype(*arrays) -> jnp.dtype:
  """float32, or float64 when any input is float64 (under ``jax_enable_x64``)."""
  return jnp.promote_types(jnp.result_type(*arrays), jnp.float32)


# Every matrix product of the jnp implementations goes through :func:`mm` or
# :func:`einsum`. XLA's default precision takes TF32 (10-bit mantissas) for
# float32 products on NVIDIA GPUs of compute capability >= 8.0, errors near
# 1e-3; HIGHEST keeps them float32 there, and changes nothing for float64 or
# on the CPU. 16-bit inputs are computed in float32 (:func:`compute_dtype`).
PRECISION = lax.Precision.HIGHEST


def mm(x: jax.Array, y: jax.Array) -> jax.Array:
  """``x @ y`` (``[..., M, K] x [..., K, N]``) at :data:`PRECISION`."""
  return jnp.matmul(x, y, precision=PRECISION)


def einsum(subscripts: str, *operands) -> jax.Array:
  """``jnp.einsum`` at :data:`PRECISION`."""
  return jnp.einsum(subscripts, *operands, precision=PRECISION)


def pad_axis(x: jax.Array, axis: int, size: int) -> jax.Array:
  """Zero-pads ``x`` along ``axis`` up to ``size`` (no-op when already there)."""
  extra = size - x.shape[axis]
  if extra == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths)


def round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def repeat_heads(x: jax.Array, groups: int) -> jax.Array:
  """``[B, T, H, ...]`` -> ``[B, T, H G, ...]``: head ``j`` of the result is head ``j // G``.

  For the jnp implementations only (the kernels read the groups through
  their index maps); autodiff through it sums the group's cotangents.
  """
  return x if groups == 1 else jnp.repeat(x, groups, axis=2)


def to_chunks(x: jax.Array, chunk_size: int) -> jax.Array:
  """``[B, T, H, ...]`` -> chunk-major ``[N, B, H, C, ...]`` (T a multiple of C)."""
  b, t, h = x.shape[:3]
  x = x.reshape(b, t // chunk_size, chunk_size, h, *x.shape[3:])
  return jnp.moveaxis(x, (1, 3), (0, 2))


def from_chunks(x: jax.Array) -> jax.Array:
  """Inverse of :func:`to_chunks`: ``[N, B, H, C, ...]`` -> ``[B, N*C, H, ...]``."""
  n, b, h, c = x.shape[:4]
  x = jnp.moveaxis(x, (0, 2), (1, 3))
  return x.reshape(b, n * c, h, *x.shape[4:])


def causal_mask(c: int, *, strict: bool) -> jax.Array:
  """``[C, C]`` boolean: ``j < i`` when ``strict`` else ``j <= i``."""
  i = jnp.arange(c)
  return (i[:, None] > i[None, :]) if strict else (i[:, None] >= i[None, :])


def drop(mask, x: jax.Array) -> jax.Array:
  """``x`` zeroed where ``mask`` (None: nowhere), by selection: where a cut
  stops a state, a non-finite state does not survive as it would a
  multiplication by a zero decay (NaN * 0 is NaN)."""
  return x if mask is None else jnp.where(mask, 0, x)


def _masked_exp(x: jax.Array, mask) -> jax.Array:
  """``exp(x)`` where ``mask``, else 0; masked *before* ``exp``: where the
  mask is off, ``x`` can be large and positive."""
  return jnp.exp(jnp.where(mask, x, -jnp.inf))


class StateCuts(NamedTuple):
  """Where cuts stop a chunk's entry state and the tokens' writes to its
  exit state, for :func:`drop` (every field None without cuts).

  Attributes:
    entry: ``[..., W, 1]``: the rows of the entry state (per channel) that a
      cut at the chunk's first token discards: the chunk never reads them.
    stopped: ``[..., W, 1]``: the rows of the entry state that a cut in the
      chunk stops before its end: they do not reach the exit state.
    unread: ``[..., C, 1]``: the tokens at or after a token cut in every
      channel, which separates them from the entry state (cuts of single
      channels at different tokens do not: the UT transform mixes the
      channels).
    unwritten: ``[..., C, 1]``: the tokens that a cut in every channel
      separates from the chunk's end.
  """
  entry: jax.Array | None
  stopped: jax.Array | None
  unread: jax.Array | None
  unwritten: jax.Array | None


class ChunkGate(NamedTuple):
  """A chunk's log gate in cumulative form, with its cuts.

  ``g`` ``[..., C, W]`` is the chunk-local cumulative sum of ``a``; ``n``
  (same shape, or None) the chunk-local cumulative count of cuts. The decay
  from token ``j`` to token ``i >= j`` is ``exp(g_i - g_j)`` when no cut lies
  in ``(j, i]`` (``n_i == n_j``) and 0 otherwise. Every decay factor of the
  chunked algorithm comes from here, masked before ``exp``.
  """
  g: jax.Array
  n: jax.Array | None

  @classmethod
  def of(cls, a, cut, axis: int) -> "ChunkGate":
    """Cumulative sums of ``a`` and of the cuts along the chunk's token ``axis``.

    A token whose ``a`` is at :data:`LOG_DECAY_FLOOR` (a full forget) counts
    as a cut with ``a = 0``.
    """
    forget = a <= LOG_DECAY_FLOOR
    cut = forget if cut is None else cut | forget
    # int16: a chunk has at most 256 tokens.
    n = jnp.cumsum(cut.astype(jnp.int16), axis=axis, dtype=jnp.int16)
    return cls(jnp.cumsum(jnp.where(forget, 0.0, a), axis=axis), n)

  def _end(self, x):
    return x[..., -1:, :]

  def from_start(self) -> jax.Array:
    """``[..., C, W]``: decay of the chunk's entry state up to each token."""
    return _masked_exp(self.g, True if self.n is None else self.n == 0)

  def to_end(self) -> jax.Array:
    """``[..., C, W]``: decay from each token to the chunk's end."""
    mask = True if self.n is None else self.n == self._end(self.n)
    return _masked_exp(self._end(self.g) - self.g, mask)

  def total(self) -> jax.Array:
    """``[..., W]``: the entry state's decay over the whole chunk."""
    return self.from_start()[..., -1, :]

  def state_cuts(self) -> StateCuts:
    """The chunk's :class:`StateCuts`."""
    n = self.n
    if n is None:
      return StateCuts(None, None, None, None)
    rows = lambda x: x[..., None]
    tokens = lambda x: jnp.all(x, axis=-1, keepdims=True)
    whole = tokens(jnp.diff(n, axis=-2, prepend=0) > 0)  # tokens cut whole
    return StateCuts(rows(n[..., 0, :] > 0), rows(n[..., -1, :] > 0),
                     jnp.cumsum(whole, axis=-2) > 0,
                     tokens(n != self._end(n)))

  def between(self, strict: bool) -> jax.Array:
    """``[..., C, C, W]``: decay from token ``j`` to ``i`` on the causal triangle."""
    mask = causal_mask(self.g.shape[-2], strict=strict)[:, :, None]
    if self.n is not None:
      mask = mask & (self.n[..., :, None, :] == self.n[..., None, :, :])
    return _masked_exp(self.g[..., :, None, :] - self.g[..., None, :, :], mask)


def _roll_rows(x: jax.Array, d) -> jax.Array:
  """``y[..., i, :] = x[..., i - d, :]`` along the chunk axis (wrapping around;
  the wrapped rows are masked by the callers)."""
  return jnp.roll(x, d, axis=-2)


class _ChannelBlocks(NamedTuple):
  """The per-channel decay of one chunk, in pieces that never hold ``[C, C, K]``.

  The chunk is cut into sub-chunks of ``S`` tokens (16-token diagonal
  blocks, as KDA's chunkwise form takes them: Kimi Linear, 2025). Pairs inside a sub-chunk (offsets ``d = i - j < S``)
  take ``exp(g_i - g_j)`` per element, one offset at a time (:meth:`band`,
  formed where it is used). Block row ``I`` (the tokens of sub-chunk ``I``
  against every earlier sub-chunk) factors through ``r_I``, the log gate at
  the last token before sub-chunk ``I``: ``exp(g_i - r_I) exp(r_I - g_j)``,
  both exponents ``<= 0``, so no exponent of a positive number is ever
  taken, however strong the gate.
  """
  gate: ChunkGate
  sub: int

  def rows(self) -> range:
    """The block rows with earlier sub-chunks: ``1 .. C / S - 1``."""
    return range(1, self.gate.g.shape[-2] // self.sub)

  def row_factors(self, row: int) -> tuple[jax.Array, jax.Array]:
    """``(exp(g_i - r), exp(r - g_j))`` ``[..., S, K]`` and ``[..., row S, K]``.

    ``i`` runs over sub-chunk ``row``, ``j`` over the tokens before it, and
    ``r`` is the gate at token ``row S - 1``; zero across a cut.
    """
    g, n = self.gate
    start, stop = row * self.sub, (row + 1) * self.sub
    ref = g[..., start - 1:start, :]
    after, before = g[..., start:stop, :], g[..., :start, :]
    if n is None:
      return jnp.exp(after - ref), jnp.exp(ref - before)
    n_ref = n[..., start - 1:start, :]
    return (_masked_exp(after - ref, n[..., start:stop, :] == n_ref),
            _masked_exp(ref - before, n[..., :start, :] == n_ref))

  def band(self, d) -> jax.Array:
    """``[..., C, K]``: the decay from token ``i - d`` to ``i`` in one sub-chunk.

    ``d`` may be traced (the offsets run in a ``fori_loop``, so that one
    offset's ``[..., C, K]`` temporaries are live at a time).
    """
    g, n = self.gate
    pos = jnp.arange(g.shape[-2])
    same = ((pos >= d) & (pos // self.sub == (pos - d) // self.sub))[:, None]
    if n is not None:
      same = same & (n == _roll_rows(n, d))
    return _masked_exp(g - _roll_rows(g, d), same)

  def band_index(self, strict: bool):
    """Static ``(rows, cols, offsets)`` of the in-sub-chunk pairs ``j <= i``."""
    c = self.gate.g.shape[-2]
    i, d = np.meshgrid(np.arange(c), np.arange(int(strict), self.sub),
                       indexing="ij")
    keep = (i - d >= 0) & ((i - d) // self.sub == i // self.sub)
    return i[keep], (i - d)[keep], d[keep]


def _channel_scores(x, y, blocks: _ChannelBlocks, strict: bool):
  """:func:`decayed_scores` for a per-channel gate, from :class:`_ChannelBlocks`."""
  c, sub = x.shape[-2], blocks.sub
  rows = [jnp.zeros((*x.shape[:-2], sub, c), x.dtype)]
  for i in blocks.rows():
    left, right = blocks.row_factors(i)
    block = einsum("...ik,...jk->...ij", x[..., i * sub:(i + 1) * sub, :]
                   * left, y[..., :i * sub, :] * right)
    rows.append(pad_axis(block, -1, c))
  scores = jnp.concatenate(rows, axis=-2)

  def diagonal(d, diagonals):
    values = jnp.sum(x * _roll_rows(y, d) * blocks.band(d), axis=-1)
    return lax.dynamic_update_slice_in_dim(diagonals, values[..., None], d, -1)

  diagonals = lax.fori_loop(0, sub, diagonal,
                            jnp.zeros((*x.shape[:-1], sub), x.dtype))
  i, j, d = blocks.band_index(strict)
  return scores.at[..., i, j].add(diagonals[..., i, d])


def _channel_scores_vjp(d_scores, x, y, blocks: _ChannelBlocks, strict: bool):
  """``(dx, dy)`` of :func:`_channel_scores`."""
  sub = blocks.sub
  dx, dy = jnp.zeros_like(x), jnp.zeros_like(y)
  for i in blocks.rows():
    left, right = blocks.row_factors(i)
    rows = slice(i * sub, (i + 1) * sub)
    d_block = d_scores[..., rows, :i * sub]
    dx = dx.at[..., rows, :].set(mm(d_block, y[..., :i * sub, :] * right)
                                 * left)
    dy = dy.at[..., :i * sub, :].add(
        mm(jnp.swapaxes(d_block, -1, -2), x[..., rows, :] * left) * right)
  i, j, d = blocks.band_index(strict)
  d_diagonals = jnp.zeros((*x.shape[:-1], sub), x.dtype).at[..., i, d].set(
      d_scores[..., i, j])

  def diagonal(d, grads):
    dx, dy = grads
    part = lax.dynamic_slice_in_dim(d_diagonals, d, 1, -1) * blocks.band(d)
    return dx + part * _roll_rows(y, d), dy + _roll_rows(part * x, -d)

  return lax.fori_loop(0, sub, diagonal, (dx, dy))


def decayed_scores(x, y, gate: ChunkGate, *, strict: bool) -> jax.Array:
  """``A[i, j] = sum_k x[i, k] y[j, k] decay_k(j -> i)`` on the causal triangle.

  Args:
    x, y: ``[..., C, K]``.
    gate: the chunk's :class:`ChunkGate`, ``W`` in ``{1, K}``.
    strict: keep ``j < i`` (the UT system) instead of ``j <= i`` (the output).

  Returns:
    ``[..., C, C]``. For a scalar gate this is ``Gamma * (x y^T)``. For a
    per-channel gate every exponent taken is ``<= 0`` (:class:`_ChannelBlocks`),
    so strong KDA gates never overflow, and no ``[C, C, K]`` tensor is formed.
  """
  if gate.g.shape[-1] == 1:
    return einsum("...ik,...jk->...ij", x, y) * gate.between(strict)[..., 0]
  return _channel_scores(x, y, _ChannelBlocks(gate, min(SUB, x.shape[-2])),
                         strict)


def decayed_scores_vjp(d_scores, x, y, gate: ChunkGate, *, strict: bool):
  """Cotangents of :func:`decayed_scores`.

  Returns ``(dx, dy, dg_x, dg_y)``, all ``[..., C, K]``. Each term is
  ``x_ik y_jk exp(g_ik - g_jk)``, so the gate cotangents are per channel
  ``x * dx`` and ``-y * dy`` (whatever reference point the pieces used);
  :func:`reduce_gate` sums them over ``K`` for a scalar gate.
  """
  if gate.g.shape[-1] == 1:
    d = d_scores * gate.between(strict)[..., 0]
    dx = einsum("...ij,...jk->...ik", d, y)
    dy = einsum("...ij,...ik->...jk", d, x)
  else:
    dx, dy = _channel_scores_vjp(
        d_scores, x, y, _ChannelBlocks(gate, min(SUB, x.shape[-2])), strict)
  return dx, dy, x * dx, -y * dy


def reduce_gate(dg: jax.Array, gate_width: int) -> jax.Array:
  """Sums a per-channel gate cotangent ``[..., K]`` to ``[..., W]``."""
  if gate_width == 1:
    return jnp.sum(dg, axis=-1, keepdims=True)
  return dg


def piece_entry_states(initial_state, m, e):
  """The states entering consecutive pieces of a sequence, each of which
  maps the state ``S`` entering it to ``M S + E`` as it leaves.

  Args:
    initial_state: ``[..., K, V]``, the state entering the first piece.
    m, e: ``[P, ..., K, K]``, ``[P, ..., K, V]``: the pieces' maps in order.

  Returns:
    ``(the state leaving the last piece, entry states [P, ..., K, V])``.
  """
  def enter(state, map_):
    m, e = map_
    return mm(m, state) + e, state
  return lax.scan(enter, initial_state, (m, e))


def invert_unit_lower(a: jax.Array) -> jax.Array:
  """``(I + A)^-1`` for strictly lower triangular ``A`` ``[..., C, C]``.

  Blocked forward substitution in matmuls, as the Pallas UT kernel does
  (pallas/ut.py): the ``SUB x SUB`` diagonal blocks row by row, then each
  block row ``i`` from the rows above it,
  ``T[i, :i] = -T_ii A[i, :i] T[:i, :i]``. Exact for a unit triangle (no
  pivoting, never singular) and, unlike a power series in ``A``, accurate for
  aligned keys with ``b`` near 2. It replaces ``lax.linalg.triangular_solve``,
  whose batched CPU kernel in jaxlib 0.10 deadlocks when two solves run at
  once (both Eigen pool threads wait in ``lapack_strsm_ffi``).
  """
  c = a.shape[-1]
  sub = min(c, SUB)
  n = c // sub
  blocks = a.reshape(*a.shape[:-2], n, sub, n, sub)
  diag = jnp.stack([blocks[..., i, :, i, :] for i in range(n)], axis=-3)
  eye = jnp.eye(sub, dtype=a.dtype)
  t_diag = jnp.broadcast_to(eye, diag.shape)
  for r in range(1, sub):
    # Row r of (I + A_ii)^-1 is e_r - A_ii[r, :r] T[:r]; rows < r are final.
    row = eye[r] - einsum("...j,...jk->...k", diag[..., r, :], t_diag)
    t_diag = t_diag.at[..., r, :].set(row)
  t = t_diag[..., 0, :, :]
  for i in range(1, n):
    rows = a[..., i * sub:(i + 1) * sub, :i * sub]
    t_ii = t_diag[..., i, :, :]
    below = -mm(t_ii, mm(rows, t))
    t = jnp.concatenate([
        jnp.concatenate([t, jnp.zeros((*t.shape[:-1], sub), a.dtype)], -1),
        jnp.concatenate([below, t_ii], -1)], -2)
  return t


def erase_write(b):
  """``(erase, write)`` gates of ``b``: beta ``[...]`` both erases (key side)
  and writes (value side), as ``[..., 1]``; Gated DeltaNet-2's pair
  ``(erase [..., K], write [..., V])`` as is."""
  return b if isinstance(b, tuple) else (b[..., None], b[..., None])


def token_step(state, q, k, v, a, b, cut=None):
  """One token of the gated delta rule (KDA's recurrence: Kimi Linear, 2025).

  Args:
    state: ``[..., K, V]`` (the papers' ``S^T``).
    q, k: ``[..., K]``, ``q`` already scaled.
    v: ``[..., V]``.
    a: ``[..., W]`` log decay, ``W`` in ``{1, K}``.
    b: ``[...]`` beta, or Gated DeltaNet-2's ``(erase [..., K], write [...,
      V])`` (:func:`erase_write`).
    cut: ``[..., W]`` bool or None: discard the state before this token
      (as a full forget, ``a`` at :data:`LOG_DECAY_FLOOR`, does).

  Returns:
    ``(new_state, o)`` with ``o`` ``[..., V]``. Decay, then predict, then
    correct: the prediction reads the already decayed state,
    ``u = write * v - S^T (erase * k)``, ``S += k u^T``.
  """
  forget = a <= LOG_DECAY_FLOOR  # a full forget is a cut (as ChunkGate.of)
  cut = forget if cut is None else cut | forget
  # The state is reset by selection, then decayed: a non-finite state does
  # not survive a cut, nor does its cotangent reach the gate.
  state = drop(cut[..., :, None], state) * jnp.exp(a)[..., :, None]
  if isinstance(b, tuple):
    erase, write = b
    residual = write * v - einsum("...kv,...k->...v", state, erase * k)
  else:
    residual = b[..., None] * (v - einsum("...kv,...k->...v", state, k))
  state = state + k[..., :, None] * residual[..., None, :]
  o = einsum("...k,...kv->...v", q, state)
  return state, o


# --- Packed sequences (cu_seqlens) ------------------------------------------


class Layout(NamedTuple):
  """Where the tokens of packed sequences go so that each starts a chunk.

  Attributes:
    slot: ``[T_total]`` int32, each token's position in the laid-out stream.
    source: ``[N_chunks C]`` int32, the token at each position of the
      laid-out stream, ``T_total`` where it is padding.
    chunk_seq: ``[N_chunks]`` int32, the sequence that owns each chunk.
    empty: ``[N]`` bool, sequences of length 0 (their final state is their
      initial state).
  """
  slot: jax.Array
  source: jax.Array
  chunk_seq: jax.Array
  empty: jax.Array


def _pool_slots(state_indices, pool_size: int):
  """``state_indices`` with padding rows (negative) moved past the pool, where
  a read gives zeros and a write is dropped."""
  return jnp.where(state_indices < 0, pool_size, state_indices)


def pool_rows(pool, state_indices):
  """The rows ``[B, ...]`` of a pool ``[P, ...]`` at the slots
  ``state_indices`` ``[B]``; zeros at padding rows (negative)."""
  return pool.at[_pool_slots(state_indices, pool.shape[0])].get(
      mode="fill", fill_value=0)


def with_pool_rows(pool, state_indices, rows):
  """``pool`` with ``rows`` ``[B, ...]`` in the slots ``state_indices``
  (none at padding rows)."""
  return pool.at[_pool_slots(state_indices, pool.shape[0])].set(
      rows.astype(pool.dtype), mode="drop")


def zero_padding_rows(x, state_indices):
  """``x`` ``[B, ...]`` with the padding rows (negative slots) zeroed."""
  keep = (state_indices >= 0).reshape(-1, *(1,) * (x.ndim - 1))
  return jnp.where(keep, x, 0)


def layout_chunks(total: int, n_seq: int, chunk_size: int) -> int:
  """Chunks of the packed layout: each sequence pads at most ``C - 1`` tokens."""
  return max(1, (total + n_seq * (chunk_size - 1)) // chunk_size)


def chunk_layout(cu_seqlens: jax.Array, total: int, chunk_size: int) -> Layout:
  """The chunk-aligned layout of sequences ``[cu[n], cu[n+1])`` of ``total`` tokens.

  ``cu_seqlens`` may be traced: the layout's size,
  :func:`layout_chunks` chunks, depends only on ``total``, N and C. Chunks
  past the last sequence's belong to it and hold padding only.
  """
  cu = cu_seqlens.astype(jnp.int32)
  n_chunks = layout_chunks(total, cu.shape[0] - 1, chunk_size)
  lengths = cu[1:] - cu[:-1]
  chunks = (lengths + chunk_size - 1) // chunk_size
  first_chunk = jnp.cumsum(chunks) - chunks
  token = jnp.arange(total, dtype=jnp.int32)
  seq = jnp.searchsorted(cu, token, side="right") - 1
  slot = first_chunk[seq] * chunk_size + token - cu[seq]
  chunk_seq = jnp.searchsorted(first_chunk, jnp.arange(n_chunks),
                               side="right") - 1
  # A traced cu_seqlens that breaks its contract gives garbage but never an
  # out-of-bounds access: the gathers above clamp their indices, those
  # through ``slot`` and ``source`` fill zeros past the end, and chunk_seq,
  # which the Pallas kernels use unchecked to index the states, is clipped
  # to [0, N): searchsorted in an unsorted first_chunk promises no range.
  chunk_seq = jnp.clip(chunk_seq, 0, cu.shape[0] - 2).astype(jnp.int32)
  position = jnp.arange(n_chunks * chunk_size, dtype=jnp.int32)
  seq = chunk_seq[position // chunk_size]
  offset = position - first_chunk[seq] * chunk_size
  token = cu[seq] + offset
  inside = ((offset >= 0) & (offset < lengths[seq]) & (token >= 0)
            & (token < total))
  source = jnp.where(inside, token, total)
  return Layout(slot, source, chunk_seq, lengths == 0)


def _gather_tokens(x: jax.Array, index: jax.Array) -> jax.Array:
  """``x[:, index]`` along the token axis, zeros where ``index`` is past it."""
  return jnp.take(x, index, axis=1, mode="fill", fill_value=0)


@jax.custom_vjp
def to_layout(x: jax.Array, layout: Layout) -> jax.Array:
  """``[1, T_total, ...]`` -> ``[1, N_chunks C, ...]``: the tokens of packed
  sequences in the chunk-aligned layout, zeros between them.

  A gather, and so is its transpose (:func:`from_layout`): a scatter into
  the layout, or the scatter-add that autodiff makes of a gather, takes XLA
  on the GPU longer than the kernels that read the layout.
  """
  return _gather_tokens(x, layout.source)


@jax.custom_vjp
def from_layout(y: jax.Array, layout: Layout) -> jax.Array:
  """``[1, N_chunks C, ...]`` -> ``[1, T_total, ...]``: the tokens back out
  of the chunk-aligned layout (the transpose of :func:`to_layout`)."""
  return _gather_tokens(y, layout.slot)


to_layout.defvjp(lambda x, layout: (to_layout(x, layout), layout),
                 lambda layout, ct: (from_layout(ct, layout), None))
from_layout.defvjp(lambda y, layout: (from_layout(y, layout), layout),
                   lambda layout, ct: (to_layout(ct, layout), None))


def segment_starts(segment_ids: jax.Array) -> jax.Array:
  """Bool ``[B, T]``: the tokens whose segment id differs from the previous token's.

  Only the changes matter: an id that comes back after another one starts a
  new segment.
  """
  change = segment_ids[:, 1:] != segment_ids[:, :-1]
  return jnp.concatenate([jnp.zeros_like(change[:, :1]), change], axis=1)


def sequence_bounds(chunk_seq: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(starts, ends)``, ``[N_chunks]`` bool: the chunks where a sequence starts, ends."""
  change = chunk_seq[1:] != chunk_seq[:-1]
  one = jnp.ones((1,), bool)
  return jnp.concatenate([one, change]), jnp.concatenate([change, one])


def scan_chunks(step, initial_state, xs, chunk_seq, enter=None):
  """``lax.scan`` of ``step(state, x) -> (state, y)`` over chunks, sequence by sequence.

  Args:
    step: one chunk; ``state`` ``[B, HV, K, V]``.
    enter: None, or ``enter(state, x)``: the state the chunk uses, from the
      one that arrives (what ``step`` gets and the entry states hold).
    initial_state: ``[N, HV, K, V]``.
    xs: per-chunk inputs, leading axis ``N_chunks``.
    chunk_seq: None (``N = B``, one sequence per row) or ``[N_chunks]``
      int32 (``B = 1``): the state entering a sequence's first chunk is its
      initial state, its final state the one leaving its last chunk.

  Returns:
    ``(final_state [N, HV, K, V], (entry_states, ys))``, the entry states
    ``[N_chunks, B, HV, K, V]`` being the ones each chunk used.
  """
  def entered(state, x):
    if enter is not None:
      state = enter(state, x)
    new_state, y = step(state, x)
    return new_state, (state, y)

  if chunk_seq is None:
    return lax.scan(entered, initial_state, xs)
  n_seq = initial_state.shape[0]
  starts, ends = sequence_bounds(chunk_seq)

  def packed(carry, x):
    state, finals = carry
    x, seq, start, end = x
    state = jnp.where(start, initial_state[seq][None], state)
    state, out = entered(state, x)
    finals = finals.at[jnp.where(end, seq, n_seq)].set(state[0], mode="drop")
    return (state, finals), out

  (_, finals), out = lax.scan(
      packed, (initial_state[:1], jnp.zeros_like(initial_state)),
      (xs, chunk_seq, starts, ends))
  return finals, out


def scan_chunks_reverse(step, d_final, xs, chunk_seq):
  """The reverse of :func:`scan_chunks` for a backward pass.

  ``step(d_exit, x) -> (d_entry, y)`` takes the cotangent of a chunk's exit
  state to that of its entry state. Returns ``(d_initial [N, HV, K, V], ys)``.
  """
  if chunk_seq is None:
    return lax.scan(step, d_final, xs, reverse=True)
  n_seq = d_final.shape[0]
  starts, ends = sequence_bounds(chunk_seq)

  def packed(carry, x):
    d_carry, d_initial = carry
    x, seq, start, end = x
    d_exit = d_carry + jnp.where(end, d_final[seq][None], 0)
    d_entry, out = step(d_exit, x)
    d_initial = d_initial.at[jnp.where(start, seq, n_seq)].add(
        d_entry[0], mode="drop")
    return (jnp.where(start, 0, d_entry), d_initial), out

  (_, d_initial), out = lax.scan(
      packed, (jnp.zeros_like(d_final[:1]), jnp.zeros_like(d_final)),
      (xs, chunk_seq, starts, ends), reverse=True)
  return d_initial, out
