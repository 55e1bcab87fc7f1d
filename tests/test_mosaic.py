"""impl="mosaic" in the Mosaic GPU interpreter on the CPU (the GPU run:
tests/test_gpu.py).

The interpreter checks the kernels' data movement and arithmetic, not their
register layouts or wgmma operand forms (deltajax/mosaic/core.py): the
tests that lower for CUDA check those, without a GPU. The products take
16-bit operands, so every check is at fla's tolerances against float64 on
the same rounded inputs. Each path runs on small shapes: the per-head
three-warpgroup path (outside ``jax_enable_x64``, as ``impl="auto"`` runs
it), the one-warpgroup path of ``jax_enable_x64``, the per-channel (KDA)
path, and the scan in pieces (:class:`deltajax.mosaic.Config`).
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deltajax
from deltajax import common
from deltajax import pallas
from deltajax import mosaic
from deltajax.mosaic import chunk_backward
from deltajax.mosaic import compat
from deltajax.mosaic import core
from deltajax.mosaic import intra
from deltajax.mosaic import ops
from deltajax.mosaic import output
from deltajax.mosaic import reverse
from deltajax.mosaic import scan
from deltajax.mosaic import ut
from deltajax.mosaic import ut_backward
import reference
import utils

pytestmark = pytest.mark.skipif(
    pallas.gpu_capability() is not None,
    reason="interpreter checks; on a GPU run tests/test_gpu.py")

TOLERANCES = dict(o=0.005, s=0.005, dq=0.008, dk=0.008, dv=0.008, da=0.02,
                  db=0.02, dh0=0.008)


@functools.partial(jax.jit, static_argnames=("impl", "config"))
def _vjp(args, cts, options, *, impl, config):
  """``args``: gated_delta's ``(q, k, v, a, b, initial_state)``, or gdn2's
  with the write gate w before the state."""
  rule = deltajax.gdn2 if len(args) == 7 else deltajax.gated_delta
  f = lambda *x: rule(*x[:-1], initial_state=x[-1], impl=impl,
                      return_final_state=True, config=config, **options)
  out, vjp = jax.vjp(f, *args)
  return out, vjp(tuple(c.astype(x.dtype) for c, x in zip(cts, out)))


def _tolerances(args):
  """fla's tolerance of each output and gradient (``dw``: gdn2's)."""
  if len(args) == 6:
    return TOLERANCES
  return {**{n: t for n, t in TOLERANCES.items() if n != "dh0"}, "dw": 0.02,
          "dh0": TOLERANCES["dh0"]}


def _value_and_grads(impl, args, cts, config=None, options=None):
  """``{name: float64 numpy}``: outputs and gradients, under one jit (one
  compilation for the tests of one shape); ``options``: gated_delta's
  packing arrays (segment_ids, cu_seqlens)."""
  out, grads = _vjp(args, tuple(jnp.asarray(c) for c in cts),
                    dict(options or {}), impl=impl, config=config)
  return {n: np.asarray(x, np.float64)
          for n, x in zip(_tolerances(args), (*out, *grads))}


def _args(x, dtype=jnp.bfloat16):
  """q, k, v in ``dtype``, the gates and initial state float32."""
  return (tuple(jnp.asarray(t, dtype) for t in x[:3])
          + tuple(jnp.asarray(t, jnp.float32) for t in x[3:]))


def _check(x, dtype=jnp.bfloat16, tolerances=None, x64=True,
           config=None, options=None):
  """Mosaic on q, k, v in ``dtype`` against the token recurrence
  (``impl="scan"``) in float64 on the same values; ``x``: gated_delta's
  inputs (:class:`utils.Inputs`) or gdn2's (w before the state);
  under ``jax_enable_x64`` (``x64``: the kernels' int32 indexing holds
  there, and the scan takes one warpgroup) or outside it (as ``"auto"``
  runs: three warpgroups); ``options``: packing (numpy segment_ids or
  cu_seqlens); ``tolerances``: fla's (:func:`_tolerances`) unless given."""
  cts = utils.random_cotangents(1, utils.Inputs(*x[:5], x[-1]))
  args = _args(x, dtype)
  with jax.enable_x64(x64):
    got = _value_and_grads("mosaic", args, cts, config, options)
  with jax.enable_x64(True):
    ref = _value_and_grads(
        "scan", tuple(jnp.asarray(t, jnp.float64) for t in args), cts,
        options=options)
  for name, tol in (tolerances or _tolerances(x)).items():
    assert np.all(np.isfinite(got[name])), name
    err = utils.relative_rms_error(got[name], ref[name])
    assert err < tol, (name, err)


def _kernel_names(jaxpr):
  """The names of the kernels a jaxpr launches, in order (nested jaxprs
  too)."""
  names = []
  for eqn in jaxpr.eqns:
    name = str(eqn.params.get("name", ""))
    if name.startswith("deltajax_"):
      names.append(name)
    for param in eqn.params.values():
      inner = getattr(param, "jaxpr", None)
      if inner is not None:
        names += _kernel_names(getattr(inner, "jaxpr", inner))
  return names


def _selects(jaxpr, shape):
  """How many ``select_n`` of ``shape`` a jaxpr holds (nested jaxprs too)."""
  count = 0
  for eqn in jaxpr.eqns:
    count += (eqn.primitive.name == "select_n"
              and tuple(eqn.outvars[0].aval.shape) == tuple(shape))
    for param in eqn.params.values():
      inner = getattr(param, "jaxpr", None)
      if inner is not None:
        count += _selects(getattr(inner, "jaxpr", inner), shape)
  return count


def test_default_path_matches_float64():
  """``impl="mosaic"`` as ``impl="auto"`` runs it on Hopper, outside
  ``jax_enable_x64``: the three-warpgroup scan, reverse pass and
  chunk_backward. float16 q, k, v as in fla's GDN grid (beta = 1, strong
  gates, one value head's gates zeroed); grouped value heads (dq and dk
  per value head in 16 bits, summed in float32); T = 130, three chunks
  (the kernels' two slots of input tiles reused; the last chunk padded);
  K = 100 and V = 40 padded to 128 and 64."""
  x = utils.random_inputs(11, batch=1, length=130, heads=1, value_heads=2,
                          key_dim=100, value_dim=40, gate_scale=10.0,
                          beta_one=True, state_scale=0.1)
  a = x.a.copy()
  a[:, :, :1] = 0
  _check(x._replace(a=a), dtype=jnp.float16, x64=False)


def test_mosaic_matches_float64():
  """The per-head path under ``jax_enable_x64``: the one-warpgroup scan
  and the backward's four kernels (W, the output's backward with its 16-bit
  share of dk, the reverse pass carrying dS, ut_backward); grouped value
  heads, T = 40 (one chunk, padded), K = 100 padded to 128."""
  _check(utils.random_inputs(3, batch=1, length=40, heads=1, value_heads=2,
                             key_dim=100, value_dim=64, gate_scale=0.25,
                             state_scale=0.1))


def test_mosaic_full_forgets():
  """a = -inf (clamped at the floor) inside a chunk, at a chunk's first
  token and at the last token: the state is forgotten there, as in float64
  (impl="auto" sends such calls here on Hopper)."""
  x = utils.random_inputs(5, batch=1, length=128, heads=1, key_dim=64,
                          value_dim=64, gate_scale=0.25, state_scale=0.1)
  a = x.a.copy()
  a[:, [30, 64, 127]] = -np.inf
  _check(x._replace(a=a))


def test_mosaic_strong_gates_stay_finite():
  """a = -5 on every token of the first chunk and -30 on single tokens, b
  near 2, nearly aligned keys: every exponent is <= 0, nothing overflows.
  The bf16 roundings cost more here (impl="pallas" has the same errors: o
  7e-3, da 3.5e-2). The shape of test_mosaic_full_forgets (one
  compilation)."""
  x = utils.strong_kda_inputs(5, length=128, key_dim=64, value_dim=64)
  a = np.where(np.arange(128)[None, :, None] < 64, -5.0, x.a[..., 0])
  a[:, 70] = a[:, 100] = -30.0
  _check(x._replace(a=a, initial_state=0.1 * x.initial_state),
         tolerances=dict.fromkeys(TOLERANCES, 0.05))


# Documents of B = 2 rows of T = 192 (three chunks of 64), by their
# lengths: of one token (at a chunk's first token and inside one), ending
# at a chunk's end (63 from token 1, 64) and crossing chunk borders (65,
# 63 from token 129).
_DOCUMENTS = ((1, 63, 65, 63), (64, 1, 64, 63))
SEGMENT_IDS = np.array([np.repeat(np.arange(len(d)), d) for d in _DOCUMENTS])


def _packed_inputs(seed, per_channel, **shape):
  """Inputs for :data:`SEGMENT_IDS` with grouped value heads (HV = 2H)."""
  return utils.random_inputs(seed, batch=2, length=192, heads=1,
                             value_heads=2, per_channel=per_channel,
                             gate_scale=0.1, state_scale=0.1, **shape)


def test_mosaic_segment_ids_match_float64():
  """segment_ids with Gated DeltaNet's gate: each document from a zero
  state, the cuts folded into the gate
  (:func:`deltajax.mosaic.ops.cut_into_gate`); weak gates, so that a state
  that crossed a cut would show. Outputs, final states and every gradient
  against the scan in float64, K = 64, V = 32 (padded to 64). The
  one-warpgroup path: the folded gate is data, which the three-warpgroup
  kernels take as they are (they match here too, at six times the
  interpreter's time)."""
  x = _packed_inputs(41, False, key_dim=64, value_dim=32)
  _check(x, options=dict(segment_ids=SEGMENT_IDS))
  # The same kernels as an unpacked call's, forward and backward, on
  # either path.
  def kernels(options):
    loss = lambda *z: deltajax.gated_delta(
        *z[:5], initial_state=z[5], impl="mosaic", **options).sum()
    return _kernel_names(jax.make_jaxpr(jax.grad(loss, argnums=range(6)))(
        *_args(x)).jaxpr)
  for x64 in (True, False):
    with jax.enable_x64(x64):
      unpacked = kernels({})
      assert unpacked and kernels(dict(segment_ids=SEGMENT_IDS)) == unpacked


def test_mosaic_per_channel_segment_ids_match_float64():
  """segment_ids with KDA's gate: the Pallas scores and T take the folded
  cuts as full forgets, the Mosaic GPU scan, reverse pass, ut_backward and
  scores' backward; the scores' kernels unfold the gate between the cuts
  and mask the pairs across them, so that the whole-chunk passes take the
  chunks with cuts (the Pallas passes by blocks only where the gate falls
  steeply between cuts)."""
  x = _packed_inputs(43, True, key_dim=64, value_dim=64)
  _check(x, options=dict(segment_ids=SEGMENT_IDS))
  # No select over a's [B, T, HV, K] (an HBM pass over the per-channel
  # gate): the gate's kernel folds the cuts in, and the scores' backward
  # gives da 0 at them, exactly.
  loss = lambda *z: deltajax.gated_delta(
      *z[:5], initial_state=z[5], impl="mosaic",
      segment_ids=SEGMENT_IDS).astype(jnp.float32).sum()
  grad = jax.grad(loss, argnums=range(6))
  assert _selects(jax.make_jaxpr(grad)(*_args(x)).jaxpr, x.a.shape) == 0
  _check_da_at_cuts(x)


def _check_da_at_cuts(x):
  """da of :data:`SEGMENT_IDS`' call through ``"mosaic"``: 0 exactly at
  the cuts (and not all 0 elsewhere)."""
  loss = lambda *z: deltajax.gated_delta(
      *z[:5], initial_state=z[5], impl="mosaic",
      segment_ids=SEGMENT_IDS).astype(jnp.float32).sum()
  da = np.asarray(jax.jit(jax.grad(loss, argnums=3))(*_args(x)))
  starts = np.asarray(common.segment_starts(jnp.asarray(SEGMENT_IDS)))
  assert np.all(da[starts] == 0) and np.mean(da[~starts] != 0) > 0.9


def test_mosaic_per_channel_segment_ids_at_steep_gates():
  """segment_ids where chunks holding cuts also have a gate that falls
  steeply (by 50 on 8 channels at one token: not gentle): the Pallas
  passes by blocks rewrite them on the folded gate, da 0 at the cuts."""
  x = _packed_inputs(45, True, key_dim=64, value_dim=64)
  a = x.a.copy()
  a[:, [20, 100], :, :8] = -50.0
  x = x._replace(a=a)
  _check(x, options=dict(segment_ids=SEGMENT_IDS))
  _check_da_at_cuts(x)


# Sequences of 1, 0, 63, 64 and 65 tokens: the last two cross chunk borders
# in the packed input (the layout is chunk-aligned), the empty one keeps its
# initial state.
_CU_SEQLENS = np.cumsum([0, 1, 0, 63, 64, 65])


def _cu_seqlens_inputs(seed, per_channel):
  """Inputs for :data:`_CU_SEQLENS`: grouped value heads, K = 60 and V = 40
  padded, a state per sequence."""
  return utils.random_inputs(seed, batch=1, length=int(_CU_SEQLENS[-1]),
                             heads=1, value_heads=2, key_dim=60,
                             value_dim=40, per_channel=per_channel,
                             gate_scale=0.1, state_scale=0.1, states=5)


@pytest.mark.parametrize("per_channel, x64, check", [
    (False, True, False),
    pytest.param(False, True, True, marks=pytest.mark.slow),
    pytest.param(True, True, True, marks=pytest.mark.slow),
    pytest.param(False, False, True, marks=pytest.mark.slow)],
    ids=["gdn-kernels", "gdn", "kda", "gdn-3wg"])
def test_mosaic_cu_seqlens_match_float64(per_channel, x64, check):
  """cu_seqlens (B = 1, per-sequence initial and final states,
  :data:`_CU_SEQLENS`), each sequence from its own initial state. The Mosaic
  GPU kernels of an unpacked call run them, the scan and the reverse pass
  entering and leaving each sequence at its chunks' bounds; on the
  one-warpgroup path (``jax_enable_x64``), per head and per channel, and
  the three-warpgroup one. (The default run checks the values in pieces:
  test_automatic_pieces_pad_the_chunks.)"""
  cu = _CU_SEQLENS
  x = _cu_seqlens_inputs(45, per_channel)
  if check:
    _check(x, x64=x64, options=dict(cu_seqlens=cu))

  def kernels(options):
    loss = lambda *z: deltajax.gated_delta(
        *z[:5], initial_state=z[5][:1 + 4 * bool(options)], impl="mosaic",
        **options).sum()
    return _kernel_names(jax.make_jaxpr(jax.grad(loss, argnums=range(6)))(
        *_args(x)).jaxpr)
  with jax.enable_x64(x64):
    assert kernels(dict(cu_seqlens=cu)) == kernels({})


@pytest.mark.parametrize("per_channel, x64, pieces, lengths", [
    pytest.param(False, True, 4, (100, 30, 120, 70), marks=pytest.mark.slow),
    (False, False, 2, (60, 70)),
    pytest.param(True, True, 4, (100, 30, 120, 70), marks=pytest.mark.slow)],
    ids=["gdn-4", "gdn-3wg-2", "kda-4"])
def test_mosaic_cu_seqlens_in_pieces_match_float64(per_channel, x64, pieces,
                                                   lengths):
  """cu_seqlens with the row in pieces walked side by side
  (``Config(pieces=...)``, ``"auto"``'s choice where the CTAs leave most
  multiprocessors idle, as a packed row of few heads does): sequences of
  100, 30, 120 and 70 tokens lay out as chunks ``[0 0 1 2 2 3 3 3]`` (the
  last one padding), so that in four pieces of two chunks a piece holds a
  whole sequence, one starts two, one ends a sequence and starts another,
  and one starts none and enters from the pieces' maps; on the
  three-warpgroup path, sequences of 60 and 70 tokens as chunks ``[0 1 1
  1]`` in two pieces, the second sequence crossing the border. The map
  pass enters a sequence as ``[0 | S0]``, the reverse pass carries zeros
  out of a sequence's first chunk, and each sequence's states and
  cotangents come out of the piece that holds its bounds."""
  cu = np.cumsum((0, *lengths))
  x = utils.random_inputs(51, batch=1, length=int(cu[-1]), heads=1,
                          value_heads=1, key_dim=64, value_dim=64,
                          per_channel=per_channel, gate_scale=0.05,
                          state_scale=0.1, states=len(lengths))
  _check(x, x64=x64, config=mosaic.Config(pieces=pieces),
         options=dict(cu_seqlens=cu))


# Three documents in T = 192 (three chunks of 64), the first one chunk 0,
# with a NaN in the middle one: name -> (the cuts' kind, the last
# document's first token, the tokens that keep their values), as
# tests/test_features.py's BOUNDARIES at chunks of 64.
_BOUNDARIES = {
    "segment_ids": ("segment_ids", 128, np.r_[0:64, 128:192]),
    "a=-inf": ("a=-inf", 128, np.r_[0:64, 128:192]),
    # The chunk of a cut carries the entry state's NaN across it (K e^g S,
    # with e^g = 0 past the cut): the final state and the last chunk leak.
    "segment_ids inside a chunk": ("segment_ids", 160, np.r_[0:64]),
}
_LEAKS = {
    "segment_ids inside a chunk": "a cut inside a chunk multiplies the "
                                  "entry state by a zero decay",
}


def _isolation_cases():
  """(gate, boundary, x64): by default the cuts per head and per channel;
  under ``-m slow`` the rest (a = -inf runs the kernels of segment_ids,
  which the kernels take as a gate at the floor; the cut inside a chunk,
  known to leak; the three-warpgroup schedule's at 40 s)."""
  for gate in ("gdn", "kda"):
    for boundary in _BOUNDARIES:
      marks = []
      if boundary in _LEAKS:  # checked to leak with -m slow
        marks.append(pytest.mark.xfail(strict=True, reason=_LEAKS[boundary]))
      if boundary != "segment_ids":
        marks.append(pytest.mark.slow)
      yield pytest.param(gate, boundary, True, marks=marks,
                         id=f"{gate}-{boundary}")
  # The three-warpgroup scan and reverse pass (per head, outside x64).
  yield pytest.param("gdn", "segment_ids", False, marks=pytest.mark.slow,
                     id="gdn-segment_ids-3wg")


@pytest.mark.parametrize("gate,boundary,x64", _isolation_cases())
def test_mosaic_non_finite_document_leaves_the_others_alone(gate, boundary,
                                                            x64):
  """A NaN in the middle one of three documents cut at chunk boundaries
  (:data:`_BOUNDARIES`): the others' outputs, the final state and the
  gradients of their inputs and of the initial state equal those of clean
  inputs (row 0 clean, row 1 with the NaN, in one call): the kernels select
  a zero state where a chunk's first token is a full forget, and a zero
  cotangent carried back across it, never multiply by a zero decay."""
  kind, second, others = _BOUNDARIES[boundary]
  x = utils.random_inputs(47, batch=1, length=192, heads=1, value_heads=2,
                          key_dim=64, value_dim=64, per_channel=gate == "kda",
                          gate_scale=0.1, state_scale=0.1)
  x = type(x)(*(np.concatenate([t, t]) for t in x))
  tokens = np.arange(192)
  ids = (tokens >= 64).astype(int) + (tokens >= second)
  options = dict(segment_ids=np.stack([ids, ids]))
  if kind == "a=-inf":
    a = x.a.copy()
    a[:, [64, second]] = -np.inf
    x, options = x._replace(a=a), None
  v = x.v.copy()
  v[1, 70, 1, 3] = np.nan
  x = x._replace(v=v)
  cts = tuple(np.concatenate([c[:1], c[:1]])
              for c in utils.random_cotangents(1, x))
  with jax.enable_x64(x64):
    got = _value_and_grads("mosaic", _args(x), cts, options=options)
  for name, g in got.items():
    if g.shape[1] == 192:  # per token
      g = g[:, others]
    assert np.all(np.isfinite(g)), name
    np.testing.assert_allclose(g[1], g[0], rtol=1e-6, atol=1e-6,
                               err_msg=name)


@pytest.mark.parametrize("per_channel", [
    False, pytest.param(True, marks=pytest.mark.slow)], ids=("gdn", "kda"))
def test_mosaic_non_finite_sequence_leaves_the_others_alone(per_channel):
  """cu_seqlens: a NaN in the middle one of three sequences (of 64, 70 and
  58 tokens): the others' outputs and gradients, the other sequences'
  final states and the cotangents of their initial states equal those of
  clean inputs: the scan and the reverse pass select the states and
  cotangents at the sequences' bounds, never multiply them."""
  cu = np.array([0, 64, 134, 192])
  x = utils.random_inputs(49, batch=1, length=192, heads=1, key_dim=64,
                          value_dim=64, per_channel=per_channel,
                          gate_scale=0.1, state_scale=0.1, states=3)
  v = x.v.copy()
  v[0, 100, 0, 3] = np.nan
  cts = utils.random_cotangents(1, x)
  options = dict(cu_seqlens=cu)
  with jax.enable_x64(True):  # the one-warpgroup path: fastest interpreted
    clean, got = (_value_and_grads("mosaic", _args(y), cts, options=options)
                  for y in (x, x._replace(v=v)))
  others = np.r_[0:64, 134:192]
  for name, g in got.items():
    c = clean[name]
    if g.shape[:2] == (1, 192):  # per token
      g, c = g[:, others], c[:, others]
    else:  # per sequence
      g, c = g[[0, 2]], c[[0, 2]]
    assert np.all(np.isfinite(g)), name
    np.testing.assert_allclose(g, c, rtol=1e-6, atol=1e-6, err_msg=name)


@pytest.mark.slow
def test_mosaic_pieces_match_float64():
  """The one-warpgroup scan cut into four pieces (``Config(pieces=4)``;
  ``"auto"``'s choice where the scan's CTAs leave most multiprocessors
  idle), KDA's: the map pass of the first three, their composition, the
  scan from each piece's entry state, and the backward's reverse pass in
  pieces on the states it saves. T = 250 (four chunks, the last padded),
  grouped value heads, K != V (V = 128: two V blocks), the gates' scales
  spread over the key channels."""
  x = utils.random_inputs(31, batch=1, length=250, heads=1, value_heads=2,
                          key_dim=64, value_dim=128, per_channel=True,
                          gate_scale=0.25, state_scale=0.1)
  _check(x._replace(a=x.a * np.geomspace(1e-3, 0.3, 64)),
         config=mosaic.Config(pieces=4))


def _pieces_inputs():
  """T = 128 (two chunks), K = 128, V = 64, weak gates."""
  return utils.random_inputs(17, batch=1, length=128, heads=1, key_dim=128,
                             value_dim=64, gate_scale=0.01, state_scale=0.1)


def test_config_pieces_run_the_map_pass():
  """``config=Config(pieces=2)`` cuts the sequence into two pieces (the map
  pass runs; one piece off the GPU by default: the other tests); pieces
  that do not divide the chunks are refused."""
  kernels = lambda config: _kernel_names(jax.make_jaxpr(
      lambda *z: deltajax.gated_delta(*z[:5], initial_state=z[5],
                                      impl="mosaic", config=config))(
                                          *_args(_pieces_inputs())).jaxpr)
  assert "deltajax_mosaic_maps" not in kernels(None)
  assert "deltajax_mosaic_maps" in kernels(mosaic.Config(pieces=2))
  with pytest.raises(ValueError, match="pieces = 3 must divide the 2 chunks"):
    kernels(mosaic.Config(pieces=3))


@pytest.mark.slow
def test_config_pieces_match_float64():
  """Two pieces on the default path: the three-warpgroup scan in two pieces
  (its map pass in two warpgroups), the three-warpgroup reverse pass in
  pieces (the second piece's local pass first), against float64: K = 128,
  V = 64, so that the map pass's identity takes two of its three value
  blocks; weak gates, so that the state and its cotangent cross the pieces
  (the default run checks the same kernels on packed sequences:
  test_mosaic_cu_seqlens_in_pieces_match_float64)."""
  _check(_pieces_inputs(), x64=False, config=mosaic.Config(pieces=2))


def _compiled_inputs(monkeypatch, t, kv_heads, value_heads, dim,
                     per_channel):
  """Traces the default path as compiled for the GPU (the interpreter
  off): abstract ``(q, k, v, a, b, h0)`` at ``[1, t, ., dim]``."""
  monkeypatch.setattr(ops, "_mosaic_gpu",
                      lambda: core.Mosaic(interpret=False))
  shape = lambda *s, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(s, dtype)
  f32 = lambda *s: shape(*s, dtype=jnp.float32)
  keys = shape(1, t, kv_heads, dim)
  return (keys, keys, shape(1, t, value_heads, dim),
          f32(1, t, value_heads, dim if per_channel else 1),
          f32(1, t, value_heads), f32(1, value_heads, dim, dim))


@pytest.mark.parametrize("per_channel", [False, True], ids=("gdn", "kda"))
def test_pieces_lower_for_the_gpu(per_channel, monkeypatch, hopper):
  """The whole forward and backward in two pieces lowers for CUDA under
  ``jax_enable_x64``: the arrays the wrappers create between the kernels
  (the map pass's identity, the local reverse pass's zero cotangent) stay
  float32, which the interpreter does not check (a float64 one failed
  every GPU test of the pieces)."""
  args = _compiled_inputs(monkeypatch, 256, 1, 2, 128, per_channel)

  def loss(*x):
    o, final = mosaic.gated_delta_mosaic(*x, None, None, scale=0.1,
                                         chunk_size=64,
                                         config=mosaic.Config(pieces=2))
    return o.astype(jnp.float32).sum() + final.sum()

  with jax.enable_x64(True):
    jax.jit(jax.grad(loss, argnums=range(6))).trace(*args).lower(
        lowering_platforms=("cuda",))


@pytest.mark.parametrize("per_channel, x64, pieces", [
    (False, False, 2), (False, True, 1), (True, True, 2)],
    ids=("gdn-3wg-2", "gdn-1", "kda-2"))
def test_packed_lowers_for_the_gpu(per_channel, x64, pieces, monkeypatch, hopper):
  """Packed sequences (``chunk_seq``) forward and backward lower for CUDA
  on each path, whole and in pieces (the map pass entering sequences too):
  the chunks' sequence bounds copied with their tiles, the states loaded
  and stored under conditions, in the shared memory that the lowering
  checks."""
  *args, _ = _compiled_inputs(monkeypatch, 256, 1, 2, 128, per_channel)
  states = jax.ShapeDtypeStruct((3, 2, 128, 128), jnp.float32)
  chunk_seq = jax.ShapeDtypeStruct((4,), jnp.int32)

  def loss(*x):
    o, final = mosaic.gated_delta_mosaic(*x[:6], None, x[6], scale=0.1,
                                         chunk_size=64,
                                         config=mosaic.Config(pieces=pieces))
    return o.astype(jnp.float32).sum() + final.sum()

  with jax.enable_x64(x64):
    jax.jit(jax.grad(loss, argnums=range(6))).trace(
        *args, states, chunk_seq).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("gate", ["gdn", "kda", "gdn2"])
def test_cuts_lower_for_the_gpu(gate, monkeypatch, hopper):
  """Cuts (``segment_ids``) forward and backward lower for CUDA on the
  default path: per channel, the scores' backward with the cut counts
  (their per-row and per-column tiles, the sums over the square's columns
  that find each row's segment; one tile read in both layouts failed JAX
  0.11's layout inference), with Gated DeltaNet-2's read keys too."""
  args = _compiled_inputs(monkeypatch, 256, 1, 2, 128, gate != "gdn")
  if gate == "gdn2":  # (erase, write) in beta's place
    args = (*args[:4], (args[3], args[3]), args[5])
  cut = jax.ShapeDtypeStruct(args[3].shape, jnp.bool_)

  def loss(*x):
    o, final = mosaic.gated_delta_mosaic(*x, None, scale=0.1, chunk_size=64)
    return o.astype(jnp.float32).sum() + final.sum()

  jax.jit(jax.grad(loss, argnums=range(6))).trace(*args, cut).lower(
      lowering_platforms=("cuda",))


@pytest.mark.parametrize("packed", [utils.slow(False, id="rows"),
                                    pytest.param(True, id="cu_seqlens")])
def test_automatic_pieces_pad_the_chunks(packed, monkeypatch):
  """Automatic pieces that do not divide the chunks (two, of the three
  chunks of T = 130 or the seven of :data:`_CU_SEQLENS`' layout, with
  grouped value heads and padded head dims) pad them with chunks that leave
  the state as it is (a = 0, beta 0; packed, the last sequence's), against
  float64."""
  monkeypatch.setattr(ops, "_default_pieces", lambda ctas, n_chunks: 2)
  if packed:
    _check(_cu_seqlens_inputs(53, False),
           options=dict(cu_seqlens=_CU_SEQLENS))
  else:
    _check(utils.random_inputs(53, batch=1, length=130, heads=1, key_dim=64,
                               value_dim=64, gate_scale=0.1, state_scale=0.1))


def test_default_pieces(monkeypatch):
  """One piece unless the scan's CTAs fill at most half of the
  multiprocessors; then the largest power of two that fits and leaves 16
  chunks a piece at least (off the GPU, one)."""
  assert ops._default_pieces(32, 1024) == 1  # no GPU here
  monkeypatch.setattr(ops.pallas_core, "multiprocessors", lambda: 132)
  assert ops._default_pieces(32, 1024) == 4  # (1, 65536, 16, 128)
  assert ops._default_pieces(64, 256) == 2  # (2, 16384, 16, 128)
  assert ops._default_pieces(192, 128) == 1  # (1, 8192, 96, 128)
  assert ops._default_pieces(8, 64) == 4  # 16 chunks a piece
  assert ops._default_pieces(8, 96) == 4  # 4 x 24 chunks, not 8 x 12
  assert ops._default_pieces(8, 95) == 4  # padded to 96
  assert ops._default_pieces(8, 31) == 1


def test_mosaic_per_channel_matches_float64():
  """KDA (per-channel gate): the Pallas gate, scores and inverse, the
  one-warpgroup scan, and the backward with the Mosaic W, reverse pass,
  ut_backward and scores' backward. The gates' scales spread over the key
  channels, from a state kept over many chunks to one forgotten within a
  chunk, so that the state's decay per row matters (channel 0's decay on
  every row took the final state to 0.41 relative RMS error, o to 0.055;
  in the reverse pass, dk to 0.23, the next chunk's decay dh0 to 2.4e-2).
  T = 150 (three chunks, the last padded), K = 100 and V = 48 padded to
  128 and 64."""
  x = utils.random_inputs(7, batch=1, length=150, heads=1, key_dim=100,
                          value_dim=48, per_channel=True, state_scale=0.1)
  _check(x._replace(a=x.a * np.geomspace(1e-3, 0.3, 100)))


def test_mosaic_gdn2_matches_float64():
  """Gated DeltaNet-2: KDA's kernels on the read keys ``kr = erase * k``
  (the scan's ``Kr e^g``, W and A's rows: the Mosaic GPU ut_backward and
  scores' backward take kr and give its cotangent) and ``write * v``.
  Grouped value heads (kr per value head), T = 100 (two chunks, the last
  padded), K = 48 and V = 40 padded to 64; outputs and all seven
  gradients."""
  x = utils.random_inputs(17, batch=1, length=100, heads=1, value_heads=2,
                          key_dim=48, value_dim=40, per_channel=True,
                          state_scale=0.1)
  rng = np.random.default_rng(17)
  erase, write = (rng.uniform(0.0, 1.0, y.shape) for y in (x.a, x.v))
  _check((*x[:4], erase, write, x.initial_state), x64=False)


def test_mosaic_per_channel_strong_gates_stay_finite():
  """KDA with a = -5 on every token and channel (the state forgotten within
  a few tokens), b near 2 and nearly aligned keys: nothing overflows, and
  the results keep fla's tolerances, as impl="pallas"'s do. The shape of
  test_mosaic_per_channel_matches_float64 (one compilation)."""
  x = utils.strong_kda_inputs(7, length=150, key_dim=100, value_dim=48)
  _check(x._replace(a=np.full_like(x.a, -5.0),
                    initial_state=0.1 * x.initial_state))


def test_mosaic_per_channel_float16_gates_past_float16():
  """KDA in float16 at fla's KDA gates (logsigmoid(N(0, 1)),
  half of them 0): on some channel each chunk's gate falls by 35 to 40,
  within the span that the scores' backward factors through the midpoint
  gate (so the Mosaic kernel takes every chunk), with factors up to e^20,
  past float16's 65504 = e^11.1 (float16 operands there gave Inf dq, dk,
  da and db). Against the plain scan in float64 at fla's tolerances."""
  dtype = jnp.float16
  x = utils.random_inputs(24, batch=1, length=128, heads=1, key_dim=64,
                          value_dim=64, per_channel=True)
  rng = np.random.default_rng(24)
  a = np.where(rng.uniform(size=x.a.shape) < 0.5, 0.0, x.a)
  g = np.cumsum(a.reshape(2, ut.C, 64), axis=1)
  falls = np.max(g[:, 0] - g[:, -1], axis=-1)
  assert np.all((falls > 35) & (falls <= pallas.intra.SPAN)), falls
  args = (*(jnp.asarray(t, dtype) for t in x[:3]),
          *(jnp.asarray(t, jnp.float32) for t in x._replace(a=a)[3:]))
  d_o, d_s = utils.random_cotangents(25, x)
  cts = (np.asarray(jnp.asarray(d_o, dtype), np.float64), d_s)
  scale = 64 ** -0.5
  got = jax.tree.leaves(utils.vjp(
      lambda *z: deltajax.kda(*z[:5], scale=scale, initial_state=z[5],
                              return_final_state=True, impl="mosaic"),
      args, cts))
  with jax.enable_x64(True):
    want = jax.tree.leaves(utils.vjp(
        lambda q, *z: reference.plain_scan(q * scale, *z),
        tuple(jnp.asarray(t, jnp.float64) for t in args), cts))
  for name, y, ref in zip(TOLERANCES, got, want):
    y = np.asarray(y, np.float64)
    assert np.all(np.isfinite(y)), name
    err = utils.relative_rms_error(y, ref)
    assert err < TOLERANCES[name], (name, err)


def _reverse_reference(qg, kd, w, g_end, d_o, d_delta_local, d_final, scale):
  """:func:`reverse.backward`'s per-channel contract in float64: ``(d_delta,
  d_next, d_initial)``."""
  qg, kd, w, g_end, d_o, ds = (np.asarray(x, np.float64) for x in (
      qg, kd, w, g_end, d_o, d_final))
  c = scan.C
  d_delta = np.array(d_delta_local, np.float64)
  d_next = np.empty((*g_end.shape, ds.shape[-1]))
  for n in reversed(range(g_end.shape[2])):
    rows = slice(n * c, n * c + c)
    d_next[:, :, n] = ds
    d_delta[:, rows] += np.einsum("bthk,bhkv->bthv", kd[:, rows], ds)
    ds = (np.exp(g_end[:, :, n])[..., None] * ds
          + scale * np.einsum("bthk,bthv->bhkv", qg[:, rows], d_o[:, rows])
          - np.einsum("bthk,bthv->bhkv", w[:, rows], d_delta[:, rows]))
  return d_delta, d_next, ds


@pytest.mark.parametrize("dk,dv", [(64, 128), (128, 64)])
def test_reverse_per_channel_matches_float64(dk, dv):
  """The reverse pass on a per-channel gate's decayed operands, three chunks
  of strong gates (:func:`utils.strong_kda_inputs`: some channels forgotten
  within the first chunk, others at single tokens, the rest kept), against
  float64 on the same 16-bit operands (2.3e-3 relative RMS error at most;
  dS's rows decayed by channel 0's e^{g_C} took dDelta to 3.8e-2, by the
  next chunk's e^{g_C} d_initial to 5.3e-2)."""
  x = utils.strong_kda_inputs(dk + dv, length=192, heads=2, key_dim=dk,
                              value_dim=dv)
  c, rng = scan.C, np.random.default_rng(dk)
  g = np.cumsum(x.a.reshape(1, -1, c, 2, dk), axis=2).reshape(x.a.shape)
  g_end = g[:, c - 1::c]
  bf16 = lambda y: jnp.asarray(y, jnp.bfloat16)
  normal = lambda *shape: rng.standard_normal(shape)
  args = (bf16(x.q * np.exp(g)),
          bf16(x.k * np.exp(np.repeat(g_end, c, axis=1) - g)),
          bf16(0.1 * normal(1, 192, 2, dk)),
          jnp.asarray(np.moveaxis(g_end, 1, 2), jnp.float32),
          bf16(0.1 * normal(1, 192, 2, dv)),
          jnp.asarray(0.1 * normal(1, 192, 2, dv), jnp.float32),
          jnp.asarray(normal(1, 2, dk, dv), jnp.float32))
  mg = core.Mosaic(interpret=True)
  got = reverse.backward(mg, *args, scale=0.1, per_channel=True)
  for name, x, want in zip(("d_delta", "d_next", "d_initial"), got,
                           _reverse_reference(*args, scale=0.1)):
    err = utils.relative_rms_error(np.asarray(x, np.float64), want)
    assert err < 5e-3, (name, err)


def _per_channel_ut_inputs(seed, heads, value_heads, dk, dv, length=128):
  """bf16 operands of a per-channel ut_backward (strong gates:
  :func:`utils.strong_kda_inputs`, with a = -5 on every token of a fifth of
  the channels) and float32 g (chunk-local cumulative) and beta."""
  x = utils.strong_kda_inputs(seed, length=length, heads=value_heads,
                              key_dim=dk, value_dim=dv)
  c, rng = ut.C, np.random.default_rng(seed)
  a = x.a.copy()
  a[..., -(dk // 5):] = -5.0
  g = np.cumsum(a.reshape(1, -1, c, value_heads, dk), axis=2)
  g = np.moveaxis(g.reshape(a.shape), 1, 2)
  n = length // c
  bf16 = lambda y: jnp.asarray(y, jnp.bfloat16)
  normal = lambda *shape: rng.standard_normal(shape)
  t = np.tril(0.3 * normal(1, value_heads, n, c, c), -1) + np.eye(c)
  return dict(
      k=bf16(x.k[:, :, :heads]), v=bf16(x.v), g=jnp.asarray(g, jnp.float32),
      b=jnp.asarray(np.moveaxis(x.b, 1, 2), jnp.float32),
      t=bf16(t.reshape(1, value_heads, length, c)),
      states=bf16(normal(1, value_heads, n, dk, dv)),
      d_next=bf16(normal(1, value_heads, n, dk, dv)),
      delta=bf16(normal(1, length, value_heads, dv)),
      d_delta=bf16(normal(1, length, value_heads, dv)))


@pytest.mark.parametrize("read_keys", [False, True], ids=("kda", "gdn2"))
def test_ut_backward_per_channel_matches_the_pallas_one(read_keys):
  """The per-channel Mosaic ut_backward on strong gates against the Pallas
  kernel in float64 on the same 16-bit operands (W and U from T): dk, dv,
  db, the cumulative gate's dg and dM, with grouped value heads (1.9e-3
  relative RMS error at most: the 16-bit roundings of dX, dW and dM's
  bracket), and the per-channel W of :func:`ut.w`; with Gated DeltaNet-2's
  read keys kr (per value head: W's keys), dkr too."""
  heads, value_heads, dk, dv = 1, 2, 128, 64
  x = _per_channel_ut_inputs(dk + dv + value_heads, heads, value_heads, dk,
                             dv)
  w_keys = x["k"]
  if read_keys:
    erase = np.random.default_rng(5).uniform(0.0, 1.0, (*x["v"].shape[:3],
                                                        dk))
    x["kr"] = w_keys = jnp.asarray(
        erase * np.repeat(np.asarray(x["k"], np.float64), value_heads, 2),
        jnp.bfloat16)
  mg = core.Mosaic(interpret=True)
  got = ut_backward.ut_backward(mg, **x)
  got += (ut.w(mg, w_keys, *(x[n] for n in ("g", "b", "t")),
               heads=value_heads),)
  with jax.enable_x64(True):
    wide = {n: jnp.asarray(y, jnp.float64) for n, y in x.items()}
    config = pallas.Config(interpret=True)
    launch = lambda name: config.launch(name, per_channel=True)
    shared = dict(cuts=None, chunk_size=ut.C, interpret=True,
                  dot=config.dot)
    w, u = pallas.ut.w_u(
        k=wide.get("kr", wide["k"]),
        **{n: wide[n] for n in ("v", "g", "b", "t")},
        launch=launch("w_u"), **shared)
    want = pallas.ut_backward.ut_backward(
        **wide, w=w, u=u, dk_out=None, dg_out=None,
        launch=launch("ut_backward"), **shared)
  names = ("dk", "dv", "db", "dg", "dm", *(("dkr",) if read_keys else ()))
  assert len(got) == len(want) + 1
  for name, y, ref in zip((*names, "w"), got, (*want, w)):
    assert y.shape == ref.shape, name
    err = utils.relative_rms_error(np.asarray(y, np.float64),
                                   np.asarray(ref, np.float64))
    assert err < 5e-3, (name, err)


def test_per_channel_ut_backward_has_no_races():
  """The interpreter's race detector finds no race in the per-channel
  ut_backward at K = V = 128: the gate's tile, copied in after the value
  blocks (with Gated DeltaNet-2's read keys in the tile they are decayed
  in), is read once its copy has arrived. (The interpreter copies at once
  and runs a warpgroup as one thread: neither a copy out's wait nor a
  warpgroup barrier is checked.)"""
  x = _per_channel_ut_inputs(5, 1, 1, 128, 128)
  mg = core.Mosaic(interpret=True, detect_races=True)
  for kr in (None, x["k"]):
    jax.block_until_ready(ut_backward.ut_backward(mg, **x, kr=kr))
    assert not compat.races_found()


def test_chunk_backward_has_no_races():
  """The interpreter's race detector finds no race between chunk_backward's
  three warpgroups at K = V = 128 (tiles one writes and another reads,
  tiles reused: v's for dv once WG0 has read v); it does when WG1 writes dv
  over v without waiting for Delta (checked)."""
  rng = np.random.default_rng(3)
  bf16 = lambda *s: jnp.asarray(0.1 * rng.normal(size=s), jnp.bfloat16)
  g = -np.cumsum(0.1 * rng.random((1, 1, 64)), axis=-1)
  args = (bf16(1, 64, 1, 128), bf16(1, 64, 1, 128), bf16(1, 64, 1, 128),
          jnp.asarray(g, jnp.float32),
          jnp.asarray(rng.random((1, 1, 64)), jnp.float32),
          bf16(1, 1, 64, 64), bf16(1, 1, 1, 128, 128),
          bf16(1, 1, 1, 128, 128), bf16(1, 64, 1, 128))
  mg = core.Mosaic(interpret=True, detect_races=True)
  jax.block_until_ready(chunk_backward.chunk_backward(mg, *args, scale=0.1))
  assert not compat.races_found()


def test_schedule():
  """Three warpgroups for the per-head gate; one per channel, and under
  x64, which the interpreter cannot trace with three (tests here run the
  kernels under x64 too)."""
  assert ops._schedule(per_channel=False) == "specialized"
  assert ops._schedule(per_channel=True) == "one"
  with jax.enable_x64(True):
    assert ops._schedule(per_channel=False) == "one"


def _intra_inputs(seed, heads, value_heads, dk, dv, length=192,
                  dtype=jnp.bfloat16, gate_scale=0.05):
  """Arguments of :func:`deltajax.pallas.intra.backward` (``dtype`` where
  16-bit, else float32) over three chunks: the first two gentle (``a =
  gate_scale logsigmoid(N(0, 1))``; a_0 below the floor on a quarter of
  the channels in the first), the third not (a = -190 on one token of a
  quarter of the channels)."""
  rng = np.random.default_rng(seed)
  c, n = ut.C, length // ut.C
  normal = lambda *shape: rng.standard_normal(shape)
  a = -gate_scale * np.logaddexp(0.0, normal(1, length, value_heads, dk))
  a[:, 0, :, :dk // 4] = -300.0
  a[:, 2 * c + 5, :, dk // 4:dk // 2] = -190.0
  g = np.cumsum(np.maximum(a, -200.0).reshape(1, n, c, value_heads, dk),
                axis=2)
  g = np.moveaxis(g.reshape(a.shape), 1, 2)
  low = lambda y: jnp.asarray(y, dtype)
  f32 = lambda y: jnp.asarray(y, jnp.float32)
  return dict(
      q=low(normal(1, length, heads, dk)),
      k=low(normal(1, length, heads, dk) / np.sqrt(dk)), g=f32(g),
      b=f32(rng.uniform(0.1, 1.99, (1, value_heads, length))), a=f32(a),
      states=low(normal(1, value_heads, n, dk, dv)),
      d_o=low(normal(1, length, value_heads, dv)),
      delta=low(normal(1, length, value_heads, dv)),
      d_m=f32(normal(1, value_heads, length, c)),
      dk=f32(normal(1, length, value_heads, dk)),
      dg=f32(normal(1, value_heads, length, dk)))


# (H, HV, K, V, 16-bit dtype, gate scale, read keys): in float16 the gentle
# chunks' gates fall by about 30 on some channel, factors up to e^15 either
# side of the midpoint, past float16's e^11.1 (float16 operands gave Inf and
# NaN); Gated DeltaNet-2's read keys per value head.
_INTRA_CASES = [(1, 2, 128, 128, jnp.bfloat16, 0.05, False),
                (1, 1, 64, 64, jnp.float16, 0.5, False),
                (1, 2, 64, 64, jnp.bfloat16, 0.05, True)]


def test_intra_backward_has_no_races():
  """The interpreter's race detector finds no race in the scores' backward
  at K = V = 128: its value blocks' tiles reloaded once read, and dk_in and
  dg_in (and Gated DeltaNet-2's dkr_in, where dkr is staged) arriving in
  their place after the last."""
  x = _intra_inputs(6, 1, 1, 128, 128)
  mg = core.Mosaic(interpret=True, detect_races=True)
  for read_keys in (None, (x["k"], x["dk"])):
    x["kr"], x["dkr"] = read_keys or (None, None)
    jax.block_until_ready(intra.backward(
        mg, *(x[n] for n in ops._INTRA_ARGS), scale=0.3))
    assert not compat.races_found()


@pytest.mark.parametrize("heads,value_heads,dk,dv,dtype,gate_scale,read_keys",
                         _INTRA_CASES)
def test_intra_backward_matches_the_pallas_one(heads, value_heads, dk, dv,
                                               dtype, gate_scale, read_keys):
  """The scores' backward through the Mosaic GPU kernel (every chunk through
  its midpoint gate; the Pallas pass by blocks after it where the gate
  falls steeply) against the Pallas kernel in float64 on the same 16-bit
  operands: dq, dk, da, db, with grouped value heads in one case, a below
  the floor at a gentle chunk's first token (its da is 0) and a chunk that
  is not gentle; with Gated DeltaNet-2's read keys kr (A's rows), dkr
  too."""
  x = _intra_inputs(dk + dv + value_heads, heads, value_heads, dk, dv,
                    dtype=dtype, gate_scale=gate_scale)
  x["kr"] = x["dkr"] = None
  if read_keys:
    rng = np.random.default_rng(dk)
    erase = rng.uniform(0.0, 1.0, x["dk"].shape)
    x["kr"] = jnp.asarray(
        erase * np.repeat(np.asarray(x["k"], np.float64), value_heads, 2),
        dtype)
    x["dkr"] = jnp.asarray(rng.standard_normal(x["dk"].shape), jnp.float32)
  config = pallas.Config(interpret=True)
  shared = dict(cuts=None, chunk_size=ut.C, interpret=True, dot=config.dot,
                launch=config.launch("intra_backward", per_channel=True),
                scale=0.3)
  got = ops._intra(core.Mosaic(interpret=True), **x, **shared)
  with jax.enable_x64(True):
    want = pallas.intra.backward(
        **{n: None if y is None else jnp.asarray(y, jnp.float64)
           for n, y in x.items()}, **shared)
  assert len(got) == len(want) == 4 + read_keys
  for name, y, ref in zip(("dq", "dk", "da", "db", "dkr"), got, want):
    assert y.shape == ref.shape, name
    err = utils.relative_rms_error(np.asarray(y, np.float64),
                                   np.asarray(ref, np.float64))
    assert err < 5e-3, (name, err)
  assert not np.any(np.asarray(got[2])[0, 0, :, :dk // 4])


def test_interpreter_needs_a_thread_per_warpgroup(monkeypatch):
  """With fewer XLA CPU threads than a kernel's warpgroups and their caller,
  the interpreter would wait forever at the first barrier: refused."""
  monkeypatch.setenv("NPROC", "3")
  with pytest.raises(RuntimeError, match="needs 4; this process has 3"):
    core._check_interpreter_threads(3)
  core._check_interpreter_threads(2)


@pytest.mark.parametrize("cpus,started,nproc,expected", [
    (2, False, None, "4"), (8, False, None, None), (2, True, None, None),
    (2, False, "16", "16")])
def test_threads_reserved_before_the_runtime_starts(cpus, started, nproc,
                                                   expected, monkeypatch):
  """deltajax's import gives XLA's CPU runtime the interpreter's threads on a
  machine of fewer CPUs, unless the runtime has started or NPROC is set."""
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(cpus)))
  monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: started)
  if nproc is None:
    monkeypatch.delenv("NPROC", raising=False)
  else:
    monkeypatch.setenv("NPROC", nproc)
  compat.reserve_interpreter_threads()
  assert os.environ.get("NPROC") == expected


@pytest.mark.parametrize("per_channel", [False, True], ids=("gdn", "kda"))
def test_default_kernels_are_the_same_compiled_and_interpreted(
    per_channel, monkeypatch):
  """The compiled default forward and backward launch the same kernels
  compiled for the GPU and in the interpreter (the interpreted tests run
  what ``impl="auto"`` runs on Hopper), at K = V = 32 too: every kernel in
  its Mosaic GPU form, the per-head gate's backward through the
  three-warpgroup reverse pass and chunk_backward (and no W, output
  backward or ut_backward kernel), the per-channel gate's through the
  one-warpgroup reverse pass, ut_backward and the scores' backward."""
  args = _compiled_inputs(monkeypatch, 128, 1, 1, 32, per_channel)

  def loss(*x):
    o, final = mosaic.gated_delta_mosaic(*x, None, None, scale=0.1,
                                         chunk_size=64)
    return o.astype(jnp.float32).sum() + final.sum()

  def kernels(interpret):
    monkeypatch.setattr(ops, "_mosaic_gpu",
                        lambda: core.Mosaic(interpret=interpret))
    return _kernel_names(
        jax.make_jaxpr(jax.grad(loss, argnums=range(6)))(*args).jaxpr)

  compiled = kernels(False)
  assert compiled == kernels(True)
  per_head = {"deltajax_mosaic_reverse_specialized",
              "deltajax_mosaic_chunk_backward"}
  unfused = {"deltajax_mosaic_w", "deltajax_mosaic_reverse",
             "deltajax_mosaic_ut_backward"}
  if per_channel:
    assert unfused | {"deltajax_mosaic_intra_backward"} <= set(compiled)
    assert not per_head & set(compiled)
  else:
    assert per_head <= set(compiled)
    assert not (unfused | {"deltajax_mosaic_output_backward"}) & set(
        compiled)


@pytest.mark.parametrize("option,message", [
    (dict(chunk_size=32), "chunk_size must be one of"),
    (dict(key_dim=256), "head dims up to 128"),
    (dict(dtype=jnp.float32), "q, k and v must be bfloat16 or float16"),
])
def test_mosaic_refuses_what_it_lacks(option, message):
  option = dict(option)
  dtype = option.pop("dtype", jnp.bfloat16)
  shape = dict(key_dim=option.pop("key_dim", 64),
               per_channel=option.pop("per_channel", False))
  x = utils.random_inputs(0, batch=1, length=64, heads=1, value_dim=64,
                          **shape)
  with pytest.raises(ValueError, match=message):
    deltajax.gated_delta(*(jnp.asarray(t, dtype) for t in x[:3]),
                         *(jnp.asarray(t, jnp.float32) for t in x[3:5]),
                         impl="mosaic", **option)


def _lowerings(schedule):
  """``[(fn, abstract args)]``: the kernels of ``schedule``'s path, each
  at K = V = 128 (two V blocks) with grouped value heads, and at the other
  widths where they differ."""
  mg = core.Mosaic(interpret=False)
  shape = lambda *s, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(s, dtype)
  f32 = lambda *s: shape(*s, dtype=jnp.float32)
  keys, vec = shape(1, 128, 1, 128), f32(1, 2, 128)
  values, chunk_t = shape(1, 128, 2, 128), shape(1, 2, 128, 64)
  states = shape(1, 2, 2, 128, 128)
  decayed = lambda dk: shape(1, 128, 2, dk)
  scan_args = (keys, keys, values, chunk_t, vec, vec, f32(1, 2, 128, 128))
  sequences = (shape(2, scan.BOUNDS, dtype=jnp.int32), f32(3, 2, 128, 128))
  forward = lambda save, pieces=None: lambda *x: scan.forward(
      mg, *x, scale=0.1, save=save, schedule=schedule, pieces=pieces)
  in_pieces = lambda local: (scan.Pieces(1, 1, start=1) if local
                             else scan.Pieces(2, 1))
  kernels = [
      (forward(True), scan_args),
      (forward(False), scan_args),
      # The scan in two pieces, and the map pass of the first.
      (forward(True, scan.Pieces(2, 1)),
       (*scan_args[:-1], f32(2, 2, 128, 128))),
      (lambda *x: scan.piece_maps(mg, *x, pieces=scan.Pieces(1, 1),
                                  schedule=schedule),
       (keys, values, chunk_t, vec, vec)),
      # Packed sequences (three: their bounds and initial states) in two
      # pieces, and the map pass entering them.
      (lambda *x: scan.forward(mg, *x[:7], scale=0.1, save=True,
                               schedule=schedule, pieces=scan.Pieces(2, 1),
                               bounds=x[7], initials=x[8]),
       (*scan_args[:-1], f32(2, 2, 128, 128), *sequences)),
      (lambda *x: scan.piece_maps(mg, *x[:5], pieces=scan.Pieces(1, 1),
                                  schedule=schedule, bounds=x[5],
                                  initials=x[6]),
       (keys, values, chunk_t, vec, vec, *sequences))]
  if schedule == "specialized":
    reverse_args = (keys, keys, chunk_t, vec, vec, values)
    return kernels + [
        # ... and their reverse pass.
        (lambda *x: reverse.specialized(mg, *x[:7], scale=0.1,
                                        pieces=scan.Pieces(2, 1),
                                        bounds=x[7], d_finals=x[8]),
         (*reverse_args, f32(2, 2, 128, 128), *sequences)),
        # The reverse pass forming W and dDelta_local, whole and in two
        # pieces (and the second's local pass).
        (lambda *x: reverse.specialized(mg, *x, scale=0.1),
         (*reverse_args, f32(1, 2, 128, 128))),
        *((lambda *x, local=local: reverse.specialized(
            mg, *x, scale=0.1, local=local, pieces=in_pieces(local)),
           (*reverse_args, f32(2 - local, 2, 128, 128)))
          for local in (False, True)),
        # The chunk-parallel backward (K, V in {64, 128}; 226 KB of shared
        # memory at K = V = 128).
        *((lambda *x: chunk_backward.chunk_backward(mg, *x, scale=0.1),
           (shape(1, 128, 1, dk), shape(1, 128, 1, dk), shape(1, 128, 2, dv),
            vec, vec, chunk_t, shape(1, 2, 2, dk, dv),
            shape(1, 2, 2, dk, dv), shape(1, 128, 2, dv)))
          for dk, dv in ((64, 64), (128, 128), (128, 64), (64, 128)))]
  reverse_args = (keys, keys, values, vec, values, f32(1, 128, 2, 128))
  return kernels + [
      # The packed sequences' reverse pass in two pieces.
      (lambda *x: reverse.backward(mg, *x[:7], scale=0.1,
                                   pieces=scan.Pieces(2, 1), bounds=x[7],
                                   d_finals=x[8]),
       (*reverse_args, f32(2, 2, 128, 128), *sequences)),
      # Per channel (K = 64 and 128, the decays of the state's rows a [K]
      # vector of the row layout): the scan on Q e^g, K e^g, v, T, g at the
      # chunks' ends, beta, the state, K e^{g_C - g} and P; its map pass.
      *((lambda *x: scan.forward(mg, *x[:7], scale=0.1, save=True,
                                 channel=x[7:]),
         (decayed(dk), decayed(dk), values, chunk_t, f32(1, 2, 2, dk), vec,
          f32(1, 2, dk, 128), decayed(dk), f32(1, 2, 128, 64)))
        for dk in (64, 128)),
      *((lambda *x: scan.piece_maps(mg, *x[:5], pieces=scan.Pieces(1, 1),
                                    channel=x[5:]),
         (decayed(dk), values, chunk_t, f32(1, 2, 2, dk), vec, decayed(dk),
          f32(1, 2, 128, 64)))
        for dk in (64, 128)),
      (lambda *x: output.output_backward(mg, *x, scale=0.1),
       (keys, keys, vec, states, values, values)),
      # W per head and per channel (g [B, HV, T, K]).
      (lambda *x: ut.w(mg, *x, heads=2), (keys, vec, vec, chunk_t)),
      *((lambda *x: ut.w(mg, *x, heads=2),
         (shape(1, 128, 1, dk), f32(1, 2, 128, dk), vec, chunk_t))
        for dk in (64, 128)),
      # ut_backward per head, dk_out 16-bit as the output's backward
      # writes it, and per channel.
      (lambda *x: ut_backward.ut_backward(mg, *x),
       (keys, values, vec, vec, chunk_t, states, states, values, values,
        values, vec)),
      *((lambda *x: ut_backward.ut_backward(mg, *x),
         (shape(1, 128, 1, dk), values, f32(1, 2, 128, dk), vec, chunk_t,
          shape(1, 2, 2, dk, 128), shape(1, 2, 2, dk, 128), values, values))
        for dk in (64, 128)),
      # ... with Gated DeltaNet-2's read keys.
      (lambda *x: ut_backward.ut_backward(mg, *x[:-1], kr=x[-1]),
       (keys, values, f32(1, 2, 128, 128), vec, chunk_t, states, states,
        values, values, decayed(128))),
      # The scores' backward per channel: q, k, g, b, a, S, dO, Delta, dM,
      # dk_in, dg_in.
      *((lambda *x: intra.backward(mg, *x, scale=0.1),
         (shape(1, 128, 1, dk), shape(1, 128, 1, dk), f32(1, 2, 128, dk),
          vec, f32(1, 128, 2, dk), shape(1, 2, 2, dk, 128), values, values,
          f32(1, 2, 128, 64), f32(1, 128, 2, dk), f32(1, 2, 128, dk)))
        for dk in (64, 128)),
      # ... with Gated DeltaNet-2's read keys and the share of their
      # cotangent.
      (lambda *x: intra.backward(mg, *x, scale=0.1),
       (keys, keys, f32(1, 2, 128, 128), vec, f32(1, 128, 2, 128), states,
        values, values, f32(1, 2, 128, 64), f32(1, 128, 2, 128),
        f32(1, 2, 128, 128), decayed(128), f32(1, 128, 2, 128))),
      # The per-channel reverse pass: Q e^g, K e^{g_C - g}, W, g at the
      # chunks' ends, dO, dDelta_local, dS.
      *((lambda *x: reverse.backward(mg, *x, scale=0.1, per_channel=True),
         (decayed(dk), decayed(dk), decayed(dk), f32(1, 2, 2, dk), values,
          f32(1, 128, 2, 128), f32(1, 2, dk, 128)))
        for dk in (64, 128)),
      # The per-head reverse pass in two pieces, and the second's local
      # pass; whole.
      *((lambda *x, local=local: reverse.backward(
          mg, *x, scale=0.1, local=local, pieces=in_pieces(local)),
         (*reverse_args, f32(2 - local, 2, 128, 128)))
        for local in (False, True)),
      (lambda *x: reverse.backward(mg, *x, scale=0.1),
       (*reverse_args, f32(1, 2, 128, 128)))]


@pytest.mark.parametrize("schedule", ["one", "specialized"])
def test_kernels_lower_for_the_gpu(schedule):
  """The kernels of each schedule's path lower to Mosaic GPU for CUDA
  here, without a GPU: Mosaic GPU's layout inference and wgmma operand
  checks run (what the interpreter skips). Lowering also checks that each
  kernel's shared memory fits in 227 KB (the per-channel scan at K = 128:
  218 KB, the per-channel reverse pass 217 KB, chunk_backward 226 KB; the
  rest: :func:`test_ut_backward_shared_memory`). Under
  ``jax_enable_x64``, as the other tests run them: an array the wrappers
  create (the map pass's identity, say) must not come out float64. The last kernel under vmap too (impl="auto" runs
  them so on Hopper): a grid axis more."""
  kernels = _lowerings(schedule)
  for fn, args in kernels:
    with jax.enable_x64(True):
      jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  fn, args = kernels[-1]
  batched = [jax.ShapeDtypeStruct((3, *x.shape), x.dtype) for x in args]
  jax.jit(jax.vmap(fn)).trace(*batched).lower(lowering_platforms=("cuda",))


def test_ut_backward_shared_memory():
  """At K = V = 128 two CTAs of ut_backward fit on an H200 multiprocessor
  (228 KB, 1 KB of it reserved per CTA: 113 KB each) per channel, the
  gate's tile loaded after the value blocks, in the place of their tiles
  (103 KB with dM staged in 16 bits; 143 KB beside them), and per head:
  97 KB with bfloat16 dk_out and dk, 105 KB with grouped value heads'
  float32 dk; so do two of the scores' backward. Gated DeltaNet-2's read
  keys take one CTA a multiprocessor: a float32 tile more for dkr in
  ut_backward (135 KB), kr's tile and dkr_in's in the scores' backward
  (135 KB, 151 KB with grouped value heads). Measured from the lowering for
  CUDA."""
  mg = core.Mosaic(interpret=False)
  shape = lambda *s, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(s, dtype)
  fn = lambda *x: ut_backward.ut_backward(mg, *x)
  vec, values = shape(1, 2, 128, dtype=jnp.float32), shape(1, 128, 2, 128)
  # t, states, d_next, delta, d_delta.
  chunks = (shape(1, 2, 128, 64), shape(1, 2, 2, 128, 128),
            shape(1, 2, 2, 128, 128), values, values)
  per_channel = lambda *kr: compat.shared_memory_bytes(
      lambda *x: ut_backward.ut_backward(mg, *x[:9], kr=(x[9:] or [None])[0]),
      shape(1, 128, 1, 128), values,
      shape(1, 2, 128, 128, dtype=jnp.float32), vec, *chunks, *kr)
  assert per_channel() <= 103 * 1024 + 64, per_channel()
  assert per_channel(shape(1, 128, 2, 128)) <= 135 * 1024 + 64
  per_head = lambda heads, dtype: compat.shared_memory_bytes(
      fn, shape(1, 128, heads, 128), values, vec, vec, *chunks,
      shape(1, 128, 2, 128, dtype=dtype), vec)
  assert per_head(2, jnp.bfloat16) <= 99_352
  assert per_head(1, jnp.bfloat16) <= 107_544
  # The scores' backward per channel (64 key channels a CTA, its value
  # blocks' tiles then dk_in and dg_in in one region): 111 KB with 16-bit
  # dq and dk, two CTAs; 127 KB with grouped value heads' float32 ones;
  # the same with float16 inputs (bfloat16 operands).
  f32 = lambda *s: shape(*s, dtype=jnp.float32)
  for dtype in (jnp.bfloat16, jnp.float16):
    low = lambda *s, dtype=dtype: shape(*s, dtype=dtype)
    intra_bytes = lambda heads, kr=False, low=low: (
        compat.shared_memory_bytes(
            lambda *x: intra.backward(mg, *x, scale=0.1),
            low(1, 128, 1, 128), low(1, 128, 1, 128),
            f32(1, heads, 128, 128), f32(1, heads, 128),
            f32(1, 128, heads, 128), low(1, heads, 2, 128, 128),
            low(1, 128, heads, 128), low(1, 128, heads, 128),
            f32(1, heads, 128, 64), f32(1, 128, heads, 128),
            f32(1, heads, 128, 128),
            *((low(1, 128, heads, 128), f32(1, 128, heads, 128)) if kr
              else ())))
    assert intra_bytes(1) <= 113 * 1024, (dtype, intra_bytes(1))
    assert intra_bytes(2) <= 127 * 1024 + 64, (dtype, intra_bytes(2))
    assert intra_bytes(1, True) <= 135 * 1024 + 64
    assert intra_bytes(2, True) <= 151 * 1024 + 64
