"""impl="pallas" in Pallas interpret mode on the CPU (the GPU run: tests/test_gpu.py).

Small shapes: every kernel runs element by element here.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deltajax
from deltajax import pallas
from deltajax import registry
from deltajax import stages
from deltajax.pallas import core
from deltajax.pallas import intra
from deltajax.pallas import ut
import utils

pytestmark = pytest.mark.skipif(
    pallas.gpu_capability() is not None,
    reason="interpret-mode checks; on a GPU run tests/test_gpu.py")


def _inputs(shape, seed, per_channel=False):
  """numpy q, k (unit rows), v, a (GDN gate, or KDA's per channel), b in
  (0.05, 1.95), initial state; cotangents."""
  bsz, t, h, dk, dv = shape
  x = utils.random_inputs(seed, batch=bsz, length=t, heads=h, key_dim=dk,
                          value_dim=dv, state_scale=1.0,
                          per_channel=per_channel)
  x = x._replace(b=np.random.default_rng(seed).uniform(0.05, 1.95, x.b.shape))
  return tuple(x), utils.random_cotangents(seed, x)


def _value_and_grads(impl, args, cts, chunk_size):
  """Outputs and gradients under one jax.jit (interpret mode's time is
  compilation: one is faster than one per kernel)."""
  def run(args, cts):
    f = lambda *x: deltajax.gated_delta(
        *x[:5], initial_state=x[5], impl=impl, chunk_size=chunk_size,
        return_final_state=True)
    out, vjp = jax.vjp(f, *args)
    return out, vjp(tuple(c.astype(x.dtype) for c, x in zip(cts, out)))
  return jax.jit(run)(args, tuple(jnp.asarray(c) for c in cts))


# (B, T, H, K, V), chunk: T not a multiple of the chunk, head dims padded to a
# power of two (20 -> 32, 100 -> 128: two V blocks), one chunk of 16.
SHAPES = [((1, 50, 2, 20, 24), 32), ((2, 40, 1, 16, 100), 16),
          ((1, 16, 1, 32, 16), 16)]


# KDA (per channel): T not a multiple of the chunk with K, V padded (20, 24
# -> 32); K = V = 32 in chunks of two 16-blocks; a non-power-of-two K (48 ->
# 64).
KDA_CASES = [((1, 50, 1, 20, 24), 32, True),
             utils.slow((1, 64, 1, 32, 32), 32, True),
             ((2, 24, 1, 48, 16), 16, True)]


@pytest.mark.parametrize(
    "shape,chunk_size,per_channel",
    [(*x, False) for x in SHAPES] + KDA_CASES)
def test_pallas_matches_chunked_in_float64(shape, chunk_size, per_channel):
  """Outputs and every gradient (da per channel for KDA), float64."""
  args, cts = _inputs(shape, seed=sum(shape) + chunk_size,
                      per_channel=per_channel)
  with jax.enable_x64(True):
    args = tuple(jnp.asarray(x, jnp.float64) for x in args)
    got, got_grads = _value_and_grads("pallas", args, cts, chunk_size)
    ref, ref_grads = _value_and_grads("chunked", args, cts, chunk_size)
  for name, x, y in zip(("o", "final_state", "dq", "dk", "dv", "da", "db",
                         "dh0"), (*got, *got_grads), (*ref, *ref_grads)):
    err = np.max(np.abs(np.asarray(x) - np.asarray(y))) / np.max(np.abs(y))
    assert err < 1e-12, (name, err)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-4),
                                       (jnp.bfloat16, 0.008)])
def test_pallas_low_precision_matches_float64_reference(dtype, tol):
  """float32 and bf16 q, k, v (float32 gates and state) against float64 on the
  same rounded values; outputs and gradients come back in the input dtypes."""
  args, cts = _inputs((1, 70, 2, 32, 32), seed=7)
  args = (tuple(jnp.asarray(x, dtype) for x in args[:3])
          + tuple(jnp.asarray(x, jnp.float32) for x in args[3:]))
  got, got_grads = _value_and_grads("pallas", args, cts, 32)
  with jax.enable_x64(True):
    ref, ref_grads = _value_and_grads(
        "chunked", tuple(jnp.asarray(x, jnp.float64) for x in args), cts, 32)
  expected_dtypes = (dtype, jnp.float32) + tuple(x.dtype for x in args)
  for x, y, dt in zip((*got, *got_grads), (*ref, *ref_grads), expected_dtypes):
    assert x.dtype == dt
    rel = np.linalg.norm(np.asarray(x, np.float64) - y) / np.linalg.norm(y)
    assert rel < tol


def _block_inverse(a):
  """``(I + a)^-1`` from :func:`ut.inverse_blocks`, as one numpy matrix."""
  n = a.shape[0] // 16
  blocks = ut.inverse_blocks(
      lambda i, j: jnp.asarray(a[16 * i:16 * (i + 1), 16 * j:16 * (j + 1)]), n,
      core.Dot(interpret=True))
  return np.block([[np.asarray(blocks[i, j]) if j <= i else np.zeros((16, 16))
                    for j in range(n)] for i in range(n)])


@pytest.mark.parametrize("beta", [1.0, 1.99])
def test_inverse_is_stable_for_aligned_keys(beta):
  """Identical keys: a power series of A would cancel catastrophically."""
  c = 64
  rng = np.random.default_rng(3)
  k = np.tile(rng.standard_normal((1, 32)), (c, 1))
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  a = np.tril(beta * (k @ k.T), -1)
  expected = np.linalg.inv(np.eye(c) + a)
  got = _block_inverse(a.astype(np.float32))
  assert np.max(np.abs(got - expected)) < 1e-4 * np.max(np.abs(expected))


@pytest.mark.parametrize("c", [16, 32, 128])
def test_inverse_with_decay_in_float64(c):
  """Random keys and b, a strong decay; chunk sizes the other tests skip."""
  rng = np.random.default_rng(c)
  k = rng.standard_normal((c, 24))
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  g = np.cumsum(-rng.uniform(0, 0.5, c))
  a = np.tril(rng.uniform(0, 2, (c, 1)) * (k @ k.T)
              * np.exp(np.minimum(g[:, None] - g[None, :], 0)), -1)
  with jax.enable_x64(True):
    got = _block_inverse(a)
  np.testing.assert_allclose(got @ (np.eye(c) + a), np.eye(c), atol=1e-13)


def test_split_product_keeps_16_mantissa_bits():
  """Dot.split (the output's ``P Delta`` for 16-bit inputs on the GPU):
  three bf16 products of float32 values err by about 2^-16, where one bf16
  product errs by 2^-8; run as on the GPU (not interpreted), on the CPU."""
  rng = np.random.default_rng(0)
  p = rng.standard_normal((64, 64)).astype(np.float32)
  delta = rng.standard_normal((64, 32)).astype(np.float32)
  exact = p.astype(np.float64) @ delta.astype(np.float64)
  dot = core.Dot(interpret=False)
  rel = lambda x: np.sqrt(np.mean((np.asarray(x, np.float64) - exact) ** 2)
                          / np.mean(exact ** 2))
  split = rel(dot.split(jnp.bfloat16)(jnp.asarray(p), jnp.asarray(delta)))
  single = rel(dot(jnp.asarray(p, jnp.bfloat16),
                   jnp.asarray(delta, jnp.bfloat16)))
  assert split < 2.0 ** -14 and single > 2.0 ** -10, (split, single)


def test_reverse_cumsum_is_float32_accurate():
  """core.reverse_cumsum of a float32 ``[C, K]`` (da's last step) in three
  bf16 products, as on the GPU (not interpreted), on the CPU: within a few
  float32 roundings of the float64 sums, where two bf16 pieces are not."""
  rng = np.random.default_rng(1)
  x = rng.standard_normal((64, 32)).astype(np.float32) * np.exp(
      rng.uniform(-8, 8, (64, 1))).astype(np.float32)
  exact = np.cumsum(x[::-1].astype(np.float64), axis=0)[::-1]
  got = np.asarray(core.reverse_cumsum(jnp.asarray(x), core.Dot(False)),
                   np.float64)
  bound = np.cumsum(np.abs(x[::-1].astype(np.float64)), axis=0)[::-1]
  assert np.max(np.abs(got - exact) / bound) < 2.0 ** -21


def test_pallas_mixed_input_dtypes():
  """bf16 q, k with float32 v reach the kernels in one dtype (a Triton dot
  needs it), match chunked, and each gradient comes back in its input's
  dtype."""
  args, cts = _inputs((1, 40, 1, 16, 16), seed=11)
  dtypes = (jnp.bfloat16, jnp.bfloat16) + (jnp.float32,) * 4
  args = tuple(jnp.asarray(x, d) for x, d in zip(args, dtypes))
  q, k, v = stages.padded(*args[:3])
  assert q.dtype == k.dtype == v.dtype == jnp.float32
  got, got_grads = _value_and_grads("pallas", args, cts, 16)
  ref, ref_grads = _value_and_grads("chunked", args, cts, 16)
  for x, y, d in zip((*got, *got_grads), (*ref, *ref_grads),
                     (jnp.float32,) * 2 + dtypes):
    assert x.dtype == d
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    assert np.linalg.norm(x - y) / np.linalg.norm(y) < 1e-2


def test_pallas_rejects_small_chunks():
  args, _ = _inputs((1, 16, 1, 16, 16), seed=1)
  q, k, v, a, b, _ = (jnp.asarray(x, jnp.float32) for x in args)
  with pytest.raises(ValueError, match=r"chunk_size must be one of \(16, 32"):
    deltajax.gated_delta(q, k, v, a, b, impl="pallas", chunk_size=8)


def test_auto_is_not_pallas_without_gpu():
  for gate in registry.GATES:
    assert registry.select("auto", gate=gate, length=4096, chunk_size=64,
                           packed=False, grouped=False).name != "pallas"


# The implementation contract, called directly: GVA, cuts, packed sequences.


def _reference(q, k, v, a, b, initial_state, cut, chunk_seq, *, scale,
               chunk_size):
  """The definition, token by token in jnp (float64): per token, if cut,
  S = 0; S = S e^a; S = S + k (b (v - S^T k))^T; o = S^T (scale q). Value
  head j reads q/k head j // G; the sequences of ``chunk_seq`` (numpy) run
  one after another, each from its own initial state."""
  groups = v.shape[2] // q.shape[2]
  q, k = (jnp.repeat(x, groups, axis=2) for x in (q, k))
  if cut is None:
    cut = jnp.zeros(a.shape, bool)

  def run(s, q, k, v, a, b, cut):  # one row: [T, HV, ...], s [HV, K, V]
    def step(s, x):
      q, k, v, a, b, cut = x
      s = jnp.where(cut[:, :, None], 0, s) * jnp.exp(a)[:, :, None]
      residual = b[:, None] * (v - jnp.einsum("hkv,hk->hv", s, k))
      s = s + k[:, :, None] * residual[:, None, :]
      return s, jnp.einsum("hk,hkv->hv", scale * q, s)
    s, o = jax.lax.scan(step, s, (q, k, v, a, b, cut))
    return o, s

  if chunk_seq is None:
    return jax.vmap(run)(initial_state, q, k, v, a, b, cut)
  outputs, finals = [], list(initial_state)
  starts = [0] + [m for m in range(1, len(chunk_seq))
                  if chunk_seq[m] != chunk_seq[m - 1]] + [len(chunk_seq)]
  for lo, hi in zip(starts[:-1], starts[1:]):
    n, rows = int(chunk_seq[lo]), slice(lo * chunk_size, hi * chunk_size)
    o, finals[n] = run(initial_state[n],
                       *(x[0, rows] for x in (q, k, v, a, b, cut)))
    outputs.append(o)
  return jnp.concatenate(outputs)[None], jnp.stack(finals)


def _contract_inputs(seed, *, bsz, t, h, hv, d, chunk_size, cuts=False,
                     chunk_seq=None, n_seq=None, per_channel=False):
  """float64 inputs of the contract and cotangents. With ``cuts``: in the
  even value heads, random cuts and one at the first token of chunk 1 (and of
  chunk 0 in head 0); in the odd ones, at the second and the last token of
  chunk 0 only. With ``chunk_seq``: each sequence's
  last chunk ends with padding tokens (a = b = k = 0). ``per_channel``: a
  KDA gate ``[B, T, HV, K]`` (cuts are per token, equal across channels)."""
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((bsz, t, h, d))
  k = rng.standard_normal((bsz, t, h, d))
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  v = rng.standard_normal((bsz, t, hv, d))
  # Weak gates (mean 0.07 per token), so that the far corners of a chunk of
  # 64 count.
  a = -0.1 * np.logaddexp(0, rng.standard_normal(
      (bsz, t, hv, d if per_channel else 1)))
  b = rng.uniform(0.05, 1.5, (bsz, t, hv))
  n_seq = bsz if n_seq is None else n_seq
  s0 = 0.5 * rng.standard_normal((n_seq, hv, d, d))
  cut = None
  if cuts:
    cut = rng.uniform(size=(bsz, t, hv, 1)) < 0.1
    cut[:, :, 1::2] = False  # long uncut spans in the odd heads
    cut[:, chunk_size, ::2] = True
    cut[:, 0, 0] = True  # the initial state of head 0 is discarded
    cut[:, [1, chunk_size - 1], 1::2] = True
    cut = np.broadcast_to(cut, a.shape).copy()
  if chunk_seq is not None:
    ends = [m for m in range(len(chunk_seq))
            if m == len(chunk_seq) - 1 or chunk_seq[m + 1] != chunk_seq[m]]
    for m in ends:  # the last 3 tokens of the sequence are padding
      pad = slice((m + 1) * chunk_size - 3, (m + 1) * chunk_size)
      a[:, pad], b[:, pad], k[:, pad] = 0, 0, 0
    chunk_seq = np.asarray(chunk_seq, np.int32)
  cts = (rng.standard_normal((bsz, t, hv, d)),
         rng.standard_normal((n_seq, hv, d, d)))
  return (q, k, v, a, b, s0), cut, chunk_seq, cts


def _jit_vjp(fn, args, cts, cut, chunk_seq):
  """``(fn(*args, cut, chunk_seq), its VJP of cts)``, under one jax.jit
  (interpret mode's time is compilation: one is faster than one per kernel)."""
  def run(args, cts, cut, chunk_seq):
    out, pull = jax.vjp(lambda *x: fn(*x, cut, chunk_seq), *args)
    return out, pull(cts)
  return jax.jit(run)(args, cts, cut, chunk_seq)


def _check_contract(args, cut, chunk_seq, cts, chunk_size, tol=1e-10):
  scale = args[0].shape[-1] ** -0.5
  with jax.enable_x64(True):
    args = tuple(jnp.asarray(x, jnp.float64) for x in args)
    cts = tuple(jnp.asarray(x, jnp.float64) for x in cts)
    cut_j = None if cut is None else jnp.asarray(cut)
    seq_j = None if chunk_seq is None else jnp.asarray(chunk_seq)
    got, got_grads = _jit_vjp(
        lambda *x: pallas.gated_delta_pallas(*x, scale=scale,
                                             chunk_size=chunk_size),
        args, cts, cut_j, seq_j)
    ref, ref_grads = _jit_vjp(  # the layout of chunk_seq is static here
        lambda *x: _reference(*x[:-1], chunk_seq, scale=scale,
                              chunk_size=chunk_size),
        args, cts, cut_j, seq_j)
  for name, x, y in zip(("o", "final_state", "dq", "dk", "dv", "da", "db",
                         "dh0"), (*got, *got_grads), (*ref, *ref_grads)):
    assert x.shape == y.shape and x.dtype == y.dtype, (name, x.shape, y.shape)
    err = np.max(np.abs(np.asarray(x) - np.asarray(y))) / np.max(np.abs(y))
    assert err < tol, (name, err)
  if cut is not None:  # a cut token's gate is irrelevant
    assert np.all(np.asarray(got_grads[3])[cut] == 0)


# (B, T, H, HV, K = V), chunk, cuts, per-channel gate: GVA groups of 2,
# non-power-of-two head dims, every chunk size; the no-cut fast path once
# with GVA (the tests above run it without).
CONTRACT = [((2, 48, 2, 4, 20), 16, True, False),
            utils.slow((1, 64, 1, 2, 48), 32, True, False),
            ((1, 128, 2, 4, 20), 64, True, False),
            ((1, 64, 1, 2, 48), 32, False, False),
            utils.slow((2, 48, 2, 4, 20), 16, True, True),
            ((1, 64, 1, 2, 48), 32, True, True),
            ((1, 128, 1, 2, 20), 64, True, True),
            utils.slow((1, 64, 1, 2, 48), 32, False, True)]


@pytest.mark.parametrize("shape,chunk_size,cuts,per_channel", CONTRACT)
def test_contract_gva_cuts_chunk_sizes(shape, chunk_size, cuts, per_channel):
  bsz, t, h, hv, d = shape
  args, cut, _, cts = _contract_inputs(
      sum(shape) + chunk_size + cuts, bsz=bsz, t=t, h=h, hv=hv, d=d,
      chunk_size=chunk_size, cuts=cuts, per_channel=per_channel)
  _check_contract(args, cut, None, cts, chunk_size)


@pytest.mark.parametrize("per_channel", [False, True], ids=("gdn", "kda"))
@pytest.mark.parametrize("cuts", [utils.slow(False), True])
def test_contract_packed_sequences(cuts, per_channel):
  """Five sequences in seven chunks of 16: one of three chunks, one of one
  chunk, one without chunks (its state passes through), GVA (1, 2)."""
  chunk_seq = [0, 0, 0, 1, 3, 3, 4]
  args, cut, chunk_seq, cts = _contract_inputs(
      5 + cuts, bsz=1, t=16 * len(chunk_seq), h=1, hv=2, d=20, chunk_size=16,
      cuts=cuts, chunk_seq=chunk_seq, n_seq=5, per_channel=per_channel)
  _check_contract(args, cut, chunk_seq, cts, 16)


@pytest.mark.parametrize("packing", ["cu_seqlens", utils.slow("segment_ids")])
def test_kda_packed_through_the_api(packing):
  """``deltajax.kda(impl="pallas")`` with cu_seqlens (one sequence shorter
  than a chunk, one over two chunks) or segment_ids (cuts mid-chunk),
  grouped value heads, against impl="chunked" in float64."""
  x = utils.random_inputs(9, batch=1, length=40, heads=1, value_heads=2,
                          key_dim=20, value_dim=12, per_channel=True,
                          states=2 if packing == "cu_seqlens" else 1)
  packed = ({"cu_seqlens": jnp.asarray([0, 7, 40])} if packing == "cu_seqlens"
            else {"segment_ids": jnp.asarray([[0] * 7 + [1] * 20 + [2] * 13])})
  cts = utils.random_cotangents(9, x)

  def run(impl, args):
    def f(*x):
      return deltajax.kda(*x[:5], initial_state=x[5], impl=impl,
                          chunk_size=16, return_final_state=True, **packed)
    out, vjp = jax.vjp(f, *args)
    return out, vjp(tuple(jnp.asarray(c) for c in cts))

  with jax.enable_x64(True):
    args = tuple(jnp.asarray(t) for t in x)
    got, got_grads = jax.jit(functools.partial(run, "pallas"))(args)
    ref, ref_grads = jax.jit(functools.partial(run, "chunked"))(args)
  for name, g, r in zip(("o", "final_state", "dq", "dk", "dv", "da", "db",
                         "dh0"), (*got, *got_grads), (*ref, *ref_grads)):
    assert utils.relative_max_error(g, r) < 1e-10, (
        name, utils.relative_max_error(g, r))


def test_pallas_kda_strong_gates_are_stable():
  """Per-channel gates of -5 on every token of a chunk and -30 on single
  tokens, b near 2, aligned keys (:func:`utils.strong_kda_inputs`): the
  float32 kernels are finite and match the float64 reference. In chunks of
  64, a factorisation through the chunk's start would overflow
  (``exp(5 * 47)`` for the tile of blocks 3 and 2)."""
  x = utils.strong_kda_inputs(5, length=128, key_dim=16, value_dim=16,
                              chunk_size=64)
  cts = utils.random_cotangents(5, x)
  got, got_grads = _value_and_grads(
      "pallas", tuple(jnp.asarray(t, jnp.float32) for t in x), cts, 64)
  with jax.enable_x64(True):
    ref, ref_grads = _value_and_grads(
        "chunked", tuple(jnp.asarray(t, jnp.float64) for t in x), cts, 64)
  for name, g, r in zip(("o", "final_state", "dq", "dk", "dv", "da", "db",
                         "dh0"), (*got, *got_grads), (*ref, *ref_grads)):
    assert np.all(np.isfinite(np.asarray(g))), name
    assert utils.relative_rms_error(g, r) < 1e-3, (
        name, utils.relative_rms_error(g, r))


@pytest.mark.parametrize("over", [15, utils.slow(31)])
@pytest.mark.parametrize("fall", [utils.slow(0.99), 1.01])
def test_pallas_kda_at_the_factoring_bound(fall, over):
  """Channels whose gate falls by just under (fast path: factors near
  ``e^SPAN``) or just over (the next path) ``intra.SPAN`` over every 16-token
  block (``over=15`` steps) or every 32-token chunk (``over=31``: one
  reference for the chunk, or block by block), float32 against float64: the
  factoring keeps float32 precision at its bounds."""
  x = utils.random_inputs(4, batch=1, length=64, heads=1, key_dim=16,
                          value_dim=16, per_channel=True)
  a = np.array(x.a)
  a[..., :4] = -fall * intra.SPAN / over  # per token
  x = x._replace(a=a)
  cts = utils.random_cotangents(4, x)
  got, got_grads = _value_and_grads(
      "pallas", tuple(jnp.asarray(t, jnp.float32) for t in x), cts, 32)
  with jax.enable_x64(True):
    ref, ref_grads = _value_and_grads(
        "chunked", tuple(jnp.asarray(t, jnp.float64) for t in x), cts, 32)
  for name, g, r in zip(("o", "final_state", "dq", "dk", "dv", "da", "db",
                         "dh0"), (*got, *got_grads), (*ref, *ref_grads)):
    assert utils.relative_rms_error(g, r) < 1e-5, (
        name, utils.relative_rms_error(g, r))


@pytest.mark.parametrize("gate", ["head", "channel", "gdn2"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, utils.slow(jnp.float32)])
@pytest.mark.parametrize("features", ["plain", "gva_cuts_packed"])
def test_kernels_lower_for_triton(dtype, features, gate, hopper):
  """Every kernel, forward and backward, lowers through Pallas' Triton
  lowering for CUDA (jax.export on abstract shapes; no GPU needed). This
  checks the Triton-side rules the interpret-mode tests cannot (block
  shapes, dot shapes, no value slicing); compiling the Triton IR to PTX
  happens only on a GPU."""
  bsz, t, h, hv, d, c = (1, 96, 2, 4, 80, 32) if features != "plain" else (
      2, 128, 2, 2, 128, 64)
  f32 = jnp.float32
  width = 1 if gate == "head" else d
  shapes = [((bsz, t, h, d), dtype), ((bsz, t, h, d), dtype),
            ((bsz, t, hv, d), dtype), ((bsz, t, hv, width), f32),
            ((bsz, t, hv), f32), ((3 if features != "plain" else bsz, hv, d,
                                   d), f32)]
  args = [jax.ShapeDtypeStruct(s, dt) for s, dt in shapes]
  if gate == "gdn2":  # the erase and write gates in place of beta
    args[4] = (jax.ShapeDtypeStruct((bsz, t, hv, d), f32),
               jax.ShapeDtypeStruct((bsz, t, hv, d), f32))
  extra = [None, None]
  if features != "plain":
    extra = [jax.ShapeDtypeStruct((bsz, t, hv, width), jnp.bool_),
             jax.ShapeDtypeStruct((t // c,), jnp.int32)]
  config = pallas.Config(interpret=False)

  def loss(*x):
    o, final = pallas.gated_delta_pallas(*x[:6], *x[6:], scale=0.1,
                                         chunk_size=c, config=config)
    return jnp.sum(o.astype(f32)) + jnp.sum(final)

  fn = jax.value_and_grad(loss, argnums=tuple(range(6)))
  exported = jax.export.export(
      jax.jit(fn), platforms=["cuda"],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(
          "__gpu$xla.gpu.triton")])(*args, *extra)
  text = exported.mlir_module()
  per_channel = ("chunk_gates", "intra", "intra_blocks", "delta_backward",
                 "intra_backward", "intra_backward_blocks")
  for name in ("ut_inverse", "state_forward", "output", "ut_w_u",
               "state_backward", "ut_backward",
               *(per_channel if gate != "head" else ("output_backward",))):
    assert f'name = "deltajax_{name}"' in text, name


@pytest.mark.parametrize("per_channel", [False, utils.slow(True)],
                         ids=["gdn", "kda"])
def test_pallas_blocks_of_channels_change_nothing(per_channel):
  """The kernels that work by blocks of key channels (ut_backward, the intra
  kernels) or of value columns give, with blocks of 16, the outputs and
  gradients of one block, float64, with a cut and packed sequences."""
  bsz, t, h, d, c = 1, 64, 2, 48, 16
  x = utils.random_inputs(7, batch=bsz, length=t, heads=h, key_dim=d,
                          value_dim=32, per_channel=per_channel)
  a = np.asarray(x.a) if per_channel else np.asarray(x.a)[..., None]
  cut = np.zeros(a.shape, bool)
  cut[:, 37] = True
  chunk_seq = jnp.asarray([0, 0, 1, 1], jnp.int32)
  s0 = np.random.default_rng(7).standard_normal((2, h, d, 32))
  small = core.Launch(num_warps=4, num_stages=1, block_v=16, block_k=16)
  blocked = core.Config(
      interpret=True, forward_scan=small, backward_scan=small,
      ut_backward=small, intra=small, intra_backward=small,
      channel=(("ut_backward", small),))

  def loss(config, *args):
    o, final = pallas.gated_delta_pallas(
        *args, cut, chunk_seq, scale=0.3, chunk_size=c, config=config)
    return jnp.sum(o * jnp.cos(o)) + jnp.sum(final * jnp.sin(final))

  with jax.enable_x64(True):
    args = tuple(jnp.asarray(v, jnp.float64)
                 for v in (x.q, x.k, x.v, a, x.b, s0))
    grad = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(1, 7))),
                   static_argnums=0)
    ref = grad(core.Config(interpret=True), *args)
    got = grad(blocked, *args)
  for name, r, g in zip(("loss", "grads"), ref, got):
    for r_i, g_i in zip(jax.tree.leaves(r), jax.tree.leaves(g)):
      err = np.max(np.abs(np.asarray(g_i) - np.asarray(r_i)))
      assert err <= 1e-12 * np.max(np.abs(np.asarray(r_i))), (name, err)


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_pallas_full_forgets(per_channel):
  """``a = -inf`` on some tokens (clamped at the floor inside the gate
  kernel): outputs and every gradient as "chunked", float64, and da exactly
  0 there."""
  x = utils.random_inputs(11, batch=1, length=40, heads=2, key_dim=8,
                          value_dim=8, per_channel=per_channel)
  forget = np.arange(40) % 7 == 3
  mask = forget[:, None] if x.a.ndim == 3 else forget[:, None, None]
  x = x._replace(a=np.where(mask, -np.inf, x.a))
  cotangents = utils.random_cotangents(12, x)
  with jax.enable_x64(True):
    args = tuple(jnp.asarray(t, jnp.float64) for t in x)
    got, ref = (utils.vjp(functools.partial(utils.gated_delta, impl,
                                            chunk_size=16), args, cotangents)
                for impl in ("pallas", "chunked"))
  for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-10,
                               atol=1e-10)
  da = np.asarray(got[1][3])
  assert np.all(da[:, forget] == 0)
