"""GPU checks of the kernels (``python -m pytest -m gpu -n 14 tests``, with
tests/test_gpu_fla.py: fla's grids through impl="auto").

16-bit inputs, float32 gates and initial state, run as users run them
(outside ``jax_enable_x64``), against the float64 chunked reference on the
same device and the same (rounded) values, with fla's tolerances (relative
RMS error): impl="pallas" on a grid of lengths and head dims, on KDA and on
Gated DeltaNet-2; impl="mosaic" on Hopper (Gated DeltaNet and KDA, the
forward outside differentiation, the one-warpgroup path of
``jax_enable_x64``, the scan in pieces); impl="auto"
on segment ids, under vmap and in pieces
(``parallel.gated_delta_in_pieces``); the decoding step's kernel in a
jitted loop at the benchmark's shape.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deltajax
from deltajax import mosaic
from deltajax import pallas
from deltajax.pallas import ut as pallas_ut
import utils

pytestmark = utils.GPU_TESTS

_needs_hopper = pytest.mark.skipif(
    pallas.gpu_capability() is None
    or pallas.gpu_capability() < mosaic.MIN_CAPABILITY,
    reason="impl='mosaic' needs Hopper (compute capability 9.0)")

TOLERANCES = dict(o=0.005, s=0.005, dq=0.008, dk=0.008, dv=0.008, dh0=0.008,
                  da=0.02, db=0.02, dw=0.02)


def _inputs(t, d, seed, bsz=2, h=2, hv=None, per_channel=False, gate_div=4.0,
            states=None, nonnegative_qk=False, beta_one=False):
  """float64 numpy ``(q, k, v, a, b, s0)`` and cotangents ``(d_o, d_s)``."""
  x = utils.random_inputs(seed, batch=bsz, length=t, heads=h, key_dim=d,
                          value_dim=d, per_channel=per_channel,
                          gate_scale=1 / gate_div, state_scale=0.1,
                          value_heads=hv, states=states,
                          nonnegative_qk=nonnegative_qk, beta_one=beta_one)
  return tuple(x), utils.random_cotangents(seed + 1, x)


def _run(impl, args, cotangents, pieces=None, **options):
  """``args``: ``(q, k, v, a, b, s0)``, or ``(q, k, v, a, b, w, s0)`` for
  Gated DeltaNet-2; ``impl``: a registry name, or a function ``(q, k, v,
  a, b, s0) -> (o, final state)``; ``pieces``: through
  :func:`deltajax.parallel.gated_delta_in_pieces` (not Gated DeltaNet-2)."""
  gdn2 = len(args) == 7
  rule = deltajax.gdn2 if gdn2 else deltajax.gated_delta
  if pieces is not None:
    rule = functools.partial(deltajax.parallel.gated_delta_in_pieces,
                             pieces=pieces)

  def f(*x):
    if callable(impl):
      return impl(*x)
    return rule(*x[:-1], initial_state=x[-1], impl=impl,
                return_final_state=True, **options)
  (o, s), vjp = jax.vjp(f, *args)
  grads = vjp(tuple(jnp.asarray(c, x.dtype) for c, x in zip(cotangents,
                                                              (o, s))))
  names = ("dq", "dk", "dv", "da", "db", *(("dw",) if gdn2 else ()), "dh0")
  out = dict(o=o, s=s, **dict(zip(names, grads)))
  return {n: np.asarray(x, np.float64) for n, x in out.items()}


def _gdn2_args(args, seed):
  """KDA's ``(q, k, v, a, b, s0)`` as Gated DeltaNet-2's ``(q, k, v, a,
  erase, write, s0)``: erase and write gates ``sigmoid(N(0, 1))`` per key
  and value channel."""
  q, k, v, a, _, s0 = args
  rng = np.random.default_rng(seed)
  erase, write = (1 / (1 + np.exp(-rng.standard_normal(x.shape)))
                  for x in (a, v))
  return q, k, v, a, erase, write, s0


def _check(impl, args, cts, dtype=jnp.bfloat16, label="", **options):
  """``impl`` outside ``jax_enable_x64`` (as users run it: its defaults
  there) against the float64 reference on the same rounded values."""
  low = tuple(jnp.asarray(x, dtype) for x in args[:3]) + tuple(
      jnp.asarray(x, jnp.float32) for x in args[3:])
  got = _run(impl, low, cts, **options)
  with jax.enable_x64(True):
    ref = _run("chunked", tuple(jnp.asarray(x, jnp.float64) for x in low), cts,
               **{n: x for n, x in options.items() if n != "pieces"})
  tolerances = {n: tol for n, tol in TOLERANCES.items() if n in got}
  errors = {n: np.linalg.norm(got[n] - ref[n]) / max(np.linalg.norm(ref[n]),
                                                      1e-30)
            for n in tolerances}
  print(f"{label}: " + " ".join(f"{n}={e:.1e}" for n, e in errors.items()))
  for n, tol in tolerances.items():
    assert np.all(np.isfinite(got[n])), n
    if np.linalg.norm(ref[n]) > 1e-12:  # da of a zeroed gate half, say
      assert errors[n] <= tol, (n, errors[n])


@pytest.mark.parametrize("keys", ["random", "aligned"])
def test_pallas_inverse_matches_float64(keys):
  """The Pallas UT inverse (impl="mosaic"'s too) on bf16 keys: T against
  float64 to its bf16 rounding, random keys with a decaying gate and b in
  (0, 2), and identical keys without decay at b = 1.99."""
  bsz, t, h, dk = 2, 1024, 4, 128
  rng = np.random.default_rng(5)
  k = rng.standard_normal((bsz, 1 if keys == "aligned" else t, h, dk))
  k = np.broadcast_to(k / np.linalg.norm(k, axis=-1, keepdims=True),
                      (bsz, t, h, dk))
  k = np.asarray(jnp.asarray(k, jnp.bfloat16), np.float64)
  if keys == "aligned":
    g, b = np.zeros((bsz, h, t)), np.full((bsz, h, t), 1.99)
  else:
    g = np.cumsum(-rng.uniform(0, 0.1, (bsz, h, t // 64, 64)), -1)
    g, b = g.reshape(bsz, h, t), rng.uniform(0, 2, (bsz, h, t))
  config = pallas.Config(interpret=False)
  got = pallas_ut.inverse(
      k=jnp.asarray(k, jnp.bfloat16), g=jnp.asarray(g, jnp.float32),
      b=jnp.asarray(b, jnp.float32), cuts=None, a=None, heads=h,
      chunk_size=64, launch=config.launch("inverse", per_channel=False),
      interpret=False, dot=config.dot)
  chunks = lambda x: x.reshape(*x.shape[:-1], t // 64, 64)
  kc = np.moveaxis(k.reshape(bsz, t // 64, 64, h, dk), 3, 1)
  gc, bc = chunks(g), chunks(b)
  a = np.tril(np.exp(gc[..., :, None] - gc[..., None, :])
              * (kc @ np.swapaxes(kc, -1, -2)), -1)
  want = np.linalg.inv(np.eye(64) + bc[..., None] * a)
  got = np.asarray(got, np.float64).reshape(want.shape)
  err = np.max(np.abs(got - want)) / np.max(np.abs(want))
  print(f"inverse {keys}: max error {err:.1e} of T's largest entry")
  assert err < 2 ** -8, err


@pytest.mark.parametrize("t,d", [(1, 64), (63, 100), (64, 128), (1000, 256),
                                 (4096, 128), (1000, 64)])
def test_pallas_bf16_matches_float64_reference(t, d):
  args, cts = _inputs(t, d, seed=t * 1000 + d)
  _check("pallas", args, cts, label=f"pallas T={t} D={d}")


@_needs_hopper
@pytest.mark.parametrize("t,d,hv", [(63, 100, None), (1000, 64, None),
                                    (4096, 128, None), (1000, 128, 4)])
def test_mosaic_bf16_matches_float64_reference(t, d, hv):
  """``impl="mosaic"`` (the three-warpgroup scan and the Mosaic GPU
  backward), grouped value heads in the last case."""
  args, cts = _inputs(t, d, seed=t * 1000 + d, hv=hv)
  _check("mosaic", args, cts, label=f"mosaic T={t} D={d} HV={hv}")


@_needs_hopper
@pytest.mark.parametrize("t,d,hv", [(1000, 64, None), (4096, 128, None),
                                    (1000, 128, 4)])
def test_mosaic_forward_alone_matches_float64_reference(t, d, hv):
  """The forward outside differentiation (its scan saves nothing, and
  publishes ``S^T`` and ``Delta^T`` as it carries them): o and the final
  state against float64, and as the training forward gives them."""
  args, _ = _inputs(t, d, seed=t * 1000 + d + 7, hv=hv)
  low = tuple(jnp.asarray(x, jnp.bfloat16) for x in args[:3]) + tuple(
      jnp.asarray(x, jnp.float32) for x in args[3:])
  run = lambda impl, *x: deltajax.gated_delta(
      *x[:-1], initial_state=x[-1], impl=impl, return_final_state=True)
  got = run("mosaic", *low)
  trained, _ = jax.vjp(functools.partial(run, "mosaic"), *low)
  with jax.enable_x64(True):
    ref = run("chunked", *(jnp.asarray(x, jnp.float64) for x in low))
  for name, x, y, z in zip("os", got, trained, ref):
    x, y, z = (np.asarray(w, np.float64) for w in (x, y, z))
    err = utils.relative_rms_error(x, z)
    print(f"mosaic forward alone T={t} D={d} HV={hv}: {name}={err:.1e}")
    assert np.all(np.isfinite(x)) and err <= TOLERANCES[name], (name, err)
    assert utils.relative_rms_error(x, y) < 1e-6, name


@_needs_hopper
@pytest.mark.parametrize("t,d,hv", [(64, 128, None), (1024, 64, None),
                                    (1024, 100, 4), (4096, 128, None)])
def test_mosaic_one_warpgroup_schedule_matches_float64_reference(t, d, hv):
  """The one-warpgroup scan and the backward's four kernels that go with
  it (the per-head path under ``jax_enable_x64``, traced so here; outside
  it the scan takes three warpgroups), called directly (T a multiple of
  the chunk), on one chunk, K = 64, a padded head dim with grouped value
  heads, and a long sequence."""
  def one(q, k, v, a, b, s0):
    with jax.enable_x64(True):
      return mosaic.gated_delta_mosaic(
          q, k, v, a[..., None], b, s0, None, None,
          scale=q.shape[-1] ** -0.5, chunk_size=mosaic.CHUNK)
  args, cts = _inputs(t, d, seed=t * 1000 + d + 7, hv=hv)
  _check(one, args, cts, label=f"one warpgroup T={t} D={d} HV={hv}")


@_needs_hopper
@pytest.mark.parametrize("per_channel", [False, True], ids=("gdn", "kda"))
@pytest.mark.parametrize("pieces", [2, 8])
def test_mosaic_pieces_match_float64_reference(pieces, per_channel):
  """The forward's scan cut into pieces walked side by side from entry
  states composed of the pieces' maps (``Config.pieces``), called
  directly: one sequence of 4096 tokens, two heads."""
  def cut(q, k, v, a, b, s0):
    return mosaic.gated_delta_mosaic(
        q, k, v, a if per_channel else a[..., None], b, s0, None, None,
        scale=q.shape[-1] ** -0.5, chunk_size=mosaic.CHUNK,
        config=mosaic.Config(pieces=pieces))
  args, cts = _inputs(4096, 128, seed=pieces, bsz=1, per_channel=per_channel)
  _check(cut, args, cts, label=f"pieces={pieces} per_channel={per_channel}")


@_needs_hopper
@pytest.mark.parametrize("t,d,hv,gate_div", [(63, 100, None, 4.0),
                                             (1024, 128, 8, 64.0)])
def test_kda_mosaic_matches_float64_reference(t, d, hv, gate_div):
  """KDA through impl="mosaic" (its per-channel scan between the Pallas
  gate, scores and inverse; the Pallas backward but for the Mosaic GPU
  reverse state pass, ut_backward and scores' backward), gradients
  included, fla's KDA inputs; grouped value heads and weak gates (the state
  kept across chunks) in the last case."""
  args, cts = _inputs(t, d, seed=t * 1000 + d, h=4, hv=hv, per_channel=True,
                      gate_div=gate_div, nonnegative_qk=True)
  _check("mosaic", args, cts, label=f"kda mosaic T={t} D={d} HV={hv}")


@_needs_hopper
@pytest.mark.parametrize("d", [64, 128])
def test_kda_mosaic_moderate_gates(d):
  """KDA through impl="mosaic" over 32 chunks of moderate gates (about -0.1
  a token, benchmark.py's: every chunk gentle, its gate falling by 4 to 9
  per channel), where the Mosaic GPU scores' backward takes every chunk."""
  args, cts = _inputs(2048, d, seed=d + 5, bsz=1, h=4, per_channel=True,
                      gate_div=8.0)
  _check("mosaic", args, cts, label=f"kda mosaic moderate gates D={d}")


@_needs_hopper
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_kda_mosaic_16_bit_at_fla_gates(dtype):
  """fla's KDA test in float16 and bfloat16 (B = 2, H = 3, D = 64, scale
  0.1, gates logsigmoid(N(0, 1)) with half of them 0, an initial state; T
  = 960, a multiple of the chunk, as the kernels are called directly)
  through impl="mosaic": the chunks' gates fall by 32 to 43 (93 % of
  them by 40 at most, which the Mosaic scores' backward factors through
  the midpoint gate), factors up to e^20, past float16's 65504 = e^11.1
  (float16 operands there gave Inf dq, dk, da and db)."""
  def run(q, k, v, a, b, s0):
    return mosaic.gated_delta_mosaic(q, k, v, a, b, s0, None, None,
                                     scale=0.1, chunk_size=mosaic.CHUNK)
  args, cts = _inputs(960, 64, seed=41, h=3, per_channel=True,
                      gate_div=1.0)
  rng = np.random.default_rng(42)
  a = np.where(rng.uniform(size=args[3].shape) < 0.5, 0.0, args[3])
  _check(run, (*args[:3], a, *args[4:]), cts, dtype=dtype, scale=0.1,
         label=f"kda mosaic {jnp.dtype(dtype).name} fla gates")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32],
                         ids=("bf16", "float32"))
def test_kda_pallas_matches_float64_reference(dtype):
  """KDA (per-channel gate) through the kernels at a training shape, fla's
  KDA inputs."""
  args, cts = _inputs(1024, 128, seed=11, bsz=2, h=4, per_channel=True,
                      nonnegative_qk=True)
  _check("pallas", args, cts, dtype=dtype, label=f"kda pallas {dtype}")


@pytest.mark.parametrize("impl,dtype", [
    ("pallas", jnp.bfloat16), ("pallas", jnp.float32),
    pytest.param("mosaic", jnp.bfloat16, marks=_needs_hopper),
    pytest.param("mosaic", jnp.float16, marks=_needs_hopper)],
    ids=("pallas-bf16", "pallas-float32", "mosaic-bf16", "mosaic-float16"))
def test_gdn2_matches_float64_reference(impl, dtype):
  """Gated DeltaNet-2 through the kernels at the KDA test's shape and
  inputs ("mosaic": KDA's Mosaic GPU kernels on the read keys)."""
  args, cts = _inputs(1024, 128, seed=12, bsz=2, h=4, per_channel=True,
                      nonnegative_qk=True)
  _check(impl, _gdn2_args(args, seed=13), cts, dtype=dtype,
         label=f"gdn2 {impl} {jnp.dtype(dtype).name}")


@pytest.mark.parametrize("chunk_size", [32, 64])
def test_kda_pallas_strong_gates(chunk_size):
  """Gates of -5 on every token of a chunk and -30 on single tokens, b near
  2, aligned keys (:func:`utils.strong_kda_inputs`): finite, and float32
  inputs match the float64 reference."""
  x = utils.strong_kda_inputs(3, batch=2, length=512, heads=2, key_dim=128,
                              value_dim=128, chunk_size=chunk_size)
  _check("pallas", tuple(x), utils.random_cotangents(4, x), dtype=jnp.float32,
         label=f"kda pallas strong gates C={chunk_size}",
         chunk_size=chunk_size)


@pytest.mark.parametrize("per_channel", [False, True], ids=("gdn", "kda"))
def test_auto_segment_ids(per_channel):
  """Documents of 100, 1, 300, 99, 500 and 24 tokens as segment_ids through
  "auto" (on Hopper the Mosaic GPU kernels; per channel the gate's kernel
  folds the cuts in and the scores' kernels unfold it between them)."""
  ids = np.repeat(np.arange(6), [100, 1, 300, 99, 500, 24])[None].repeat(2, 0)
  args, cts = _inputs(1024, 128, seed=7, per_channel=per_channel)
  _check("auto", args, cts, label="auto segment_ids",
         segment_ids=jnp.asarray(ids))


def test_auto_under_vmap():
  """jax.vmap over impl="auto" (on Hopper the Mosaic GPU kernels: the
  batching rule adds a grid axis) against the same call on the stacked
  batch, forward and gradients."""
  args, _ = _inputs(300, 128, seed=13, bsz=4)
  q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in args[:3])
  a, b = (jnp.asarray(x, jnp.float32) for x in args[3:5])

  def loss(q, k, v, a, b):
    o = deltajax.gated_delta(q, k, v, a, b)
    return jnp.sum(o.astype(jnp.float32) ** 2)
  grads = jax.jit(jax.grad(loss, argnums=range(5)))
  one = jax.jit(jax.vmap(
      lambda *x: grads(*(y[None] for y in x)), in_axes=0))(q, k, v, a, b)
  for got, want in zip(one, grads(q, k, v, a, b)):
    np.testing.assert_allclose(np.asarray(got[:, 0], np.float32),
                               np.asarray(want, np.float32), rtol=2e-2,
                               atol=2e-2 * float(np.max(np.abs(want))))


@pytest.mark.parametrize("per_channel", [False, True])
def test_auto_in_pieces(per_channel):
  """One sequence cut into 4 pieces run side by side, against one call of
  the float64 reference."""
  args, cts = _inputs(4096, 128, seed=11, bsz=1, per_channel=per_channel)
  _check("auto", args, cts, label=f"auto in 4 pieces, KDA {per_channel}",
         pieces=4)


def _decode(impl, state, tokens, state_indices=None):
  """``(o [B, T, HV, V], state)``: :func:`deltajax.gated_delta_step` over
  the T tokens ``(q, k, v, a, b, w)`` (``w`` None but for Gated
  DeltaNet-2) in a jitted ``lax.scan``; ``state_indices``: ``state`` is a
  pool."""
  def step(state, token):
    o, state = deltajax.gated_delta_step(state, *token[:5], w=token[5],
                                         state_indices=state_indices,
                                         impl=impl)
    return state, o

  @jax.jit
  def run(state, tokens):
    state, o = jax.lax.scan(step, state, tokens)
    return jnp.moveaxis(o, 0, 1), state

  return run(state, jax.tree.map(lambda x: jnp.moveaxis(x, 1, 0), tokens))


def _draft(impl, state, tokens, state_indices=None, length=4):
  """``(o, states)`` of :func:`deltajax.gated_delta_verify` on the first
  ``length`` tokens."""
  q, k, v, a, b, w = (None if y is None else y[:, :length] for y in tokens)
  return deltajax.gated_delta_verify(state, q, k, v, a, b, w=w,
                                     state_indices=state_indices, impl=impl)


# The pool of the pooled cases: 8 slots for B = 4 rows, one a padding row.
STEP_SLOTS = np.array([6, -1, 0, 3], np.int32)


@pytest.mark.parametrize("gate", ("gdn", "kda", "gdn2"))
@pytest.mark.parametrize("h, pooled", ((16, False), (8, True)),
                         ids=("H16", "H8_HV16_pool"))
def test_step_kernel_matches_jnp_and_float64(gate, h, pooled):
  """B = 4, HV = 16, K = V = 128 (benchmarks/benchmark.py's decoding step),
  32 steps with bf16 q, k, v, float32 gates and state, some a = -inf; dense,
  and on a pool of 8 slots (``state_indices``, a padding row) with grouped
  heads; and the verification kernel on the first 4 tokens."""
  x = utils.random_inputs(3 + h, batch=4, length=32, heads=h, key_dim=128,
                          value_dim=128, per_channel=gate != "gdn",
                          state_scale=0.1, value_heads=16,
                          states=8 if pooled else None)
  a, b, w = x.a.copy(), x.b, None
  a[:, 5, 3] = -np.inf
  if gate == "gdn2":
    rng = np.random.default_rng(h)
    b, w = rng.uniform(0, 1, x.a.shape), rng.uniform(0, 1, x.v.shape)
  slots = jnp.asarray(STEP_SLOTS) if pooled else None
  with jax.enable_x64(True):
    state = jnp.asarray(x.initial_state, jnp.float32)
    tokens = (*(jnp.asarray(y, jnp.bfloat16) for y in (x.q, x.k, x.v)),
              *(None if y is None else jnp.asarray(y, jnp.float32)
                for y in (a, b, w)))
    wide = jax.tree.map(lambda y: y.astype(jnp.float64), (state, tokens))
    ref = _decode("jnp", *wide, slots)
    got = _decode("pallas", state, tokens, slots)
    jnp_f32 = _decode("jnp", state, tokens, slots)
    draft = [_draft(impl, *args, slots) for impl, args in (
        ("jnp", wide), ("pallas", (state, tokens)), ("jnp", (state, tokens)))]
  # The kernel's float32 state is exact to rounding (about 6e-8 on the CPU);
  # o is rounded to bf16. jnp may use TF32 products on the GPU.
  for name, key, bound, r, g, j in zip(
      ("o", "s", "verify o", "verify states"), 2 * ("o", "s"),
      2 * (TOLERANCES["o"], 1e-5), (*ref, *draft[0]), (*got, *draft[1]),
      (*jnp_f32, *draft[2])):
    g, r, j = (np.asarray(y, np.float64) for y in (g, r, j))
    error, vs_jnp = (np.linalg.norm(g - y) / np.linalg.norm(y) for y in (r, j))
    print(f"step {gate} H={h} pooled={pooled} {name}: {error:.1e} against "
          f"float64, {vs_jnp:.1e} against jnp float32")
    assert error <= bound, (name, error)
    assert vs_jnp <= TOLERANCES[key], (name, vs_jnp)


@pytest.mark.parametrize("per_channel", (False, True), ids=("gdn", "kda"))
@pytest.mark.parametrize("impl", ("scan", "chunked", "pallas"))
def test_float32_is_float32(impl, per_channel):
  """float32 q, k, v, a, b and initial state: outputs, final state and every
  gradient within 1e-5 relative RMS of the float64 chunked reference on the
  same values. XLA's default precision (TF32 products on this GPU) gave
  about 1e-3 for the jnp implementations (chunked against scan: 7.4e-4 max
  abs); float32 rounding alone gives below 1e-6 on the CPU."""
  args, cts = _inputs(300, 64, seed=31, per_channel=per_channel)
  with jax.enable_x64(True):
    low = tuple(jnp.asarray(x, jnp.float32) for x in args)
    ref = _run("chunked", tuple(x.astype(jnp.float64) for x in low), cts)
    got = _run(impl, low, cts)
  errors = {n: np.linalg.norm(got[n] - ref[n]) / np.linalg.norm(ref[n])
            for n in ref}
  print(f"float32 {impl} {'kda' if per_channel else 'gdn'}: "
        + " ".join(f"{n}={e:.1e}" for n, e in errors.items()))
  assert all(e <= 1e-5 for e in errors.values()), errors
