"""gated_delta_step's kernel (impl="pallas", Pallas interpret mode on the CPU)
against the float64 reference, the jnp step and a call over the sequence
(the GPU run: tests/test_gpu.py); the step on a pool of states,
gated_delta_verify and gated_delta_commit against the sequence call, and
16-bit states."""

import functools
import re

import jax
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np
import pytest

import deltajax
from deltajax import api
from deltajax import pallas
from deltajax.pallas import step as pallas_step
import reference
import utils

pytestmark = pytest.mark.skipif(
    pallas.gpu_capability() is not None,
    reason="interpret-mode checks; on a GPU run tests/test_gpu.py")

# (B, H, HV, K, V): powers of two; grouped value heads; dims the kernel pads
# (48 -> 64, 100 -> 128: four V blocks of 32).
SHAPES = [(2, 2, 2, 32, 64), (1, 2, 4, 64, 32), (2, 1, 2, 48, 100)]
GATES = ("gdn", "kda")


def _inputs(shape, gate, seed, length=1):
  """float64 numpy ``(q, k, v, a, b, s0)`` of ``length`` tokens."""
  bsz, h, hv, dk, dv = shape
  return utils.random_inputs(seed, batch=bsz, length=length, heads=h,
                             key_dim=dk, value_dim=dv,
                             per_channel=gate == "kda", value_heads=hv)


def _token(x, t=0):
  """``(state, q, k, v, a, b)``: token ``t`` of ``x``, with its initial state."""
  return (x.initial_state, *(y[:, t] for y in (x.q, x.k, x.v, x.a, x.b)))


def _reference(state, q, k, v, a, b):
  """The recurrence (float64 numpy) for one token; ``q`` scaled."""
  groups = v.shape[1] // q.shape[1]
  q, k = (np.repeat(y, groups, axis=1)[:, None] for y in (q, k))
  o, s = reference.ref_a(q * q.shape[-1] ** -0.5, k, v[:, None],
                         np.exp(a)[:, None], b[:, None], state)
  return o[:, 0], s


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_pallas_matches_float64_reference(x64, shape, gate):
  args = _token(_inputs(shape, gate, seed=sum(shape)))
  o, s = deltajax.gated_delta_step(*(jnp.asarray(y) for y in args),
                                   impl="pallas")
  ref_o, ref_s = _reference(*args)
  assert o.dtype == s.dtype == jnp.float64
  np.testing.assert_allclose(o, ref_o, rtol=0, atol=1e-12)
  np.testing.assert_allclose(s, ref_s, rtol=0, atol=1e-12)


@pytest.mark.parametrize("impl", ("jnp", "pallas"))
@pytest.mark.parametrize("gate", GATES)
def test_full_forget_at_the_floor(x64, gate, impl):
  """``a = -inf`` (one head, or half the channels) drops the state, even
  a non-finite one (NaN there)."""
  state, q, k, v, a, b = _token(_inputs(SHAPES[1], gate, seed=5))
  a, bad = a.copy(), state.copy()
  a[0, 1] = -np.inf
  bad[0, 1] = np.nan
  if gate == "kda":
    a[0, 2, ::2] = -np.inf
    bad[0, 2, ::2] = np.inf
  o, s = deltajax.gated_delta_step(
      *(jnp.asarray(y) for y in (bad, q, k, v, a, b)), impl=impl)
  ref_o, ref_s = _reference(state, q, k, v, a, b)
  assert np.all(np.isfinite(o)) and np.all(np.isfinite(s))
  np.testing.assert_allclose(o, ref_o, rtol=0, atol=1e-12)
  np.testing.assert_allclose(s, ref_s, rtol=0, atol=1e-12)


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16))
def test_pallas_matches_jnp(gate, dtype):
  """16-bit or float32 q, k, v with float32 gates and state: the two
  implementations compute from the same values in float32."""
  state, q, k, v, a, b = _token(_inputs(SHAPES[1], gate, seed=7))
  args = (jnp.asarray(state, jnp.float32),
          *(jnp.asarray(y, dtype) for y in (q, k, v)),
          *(jnp.asarray(y, jnp.float32) for y in (a, b)))
  o, s = deltajax.gated_delta_step(*args, impl="pallas")
  ref_o, ref_s = deltajax.gated_delta_step(*args, impl="jnp")
  assert (o.dtype, s.dtype) == (dtype, jnp.float32)
  bound = 1e-5 if dtype == jnp.float32 else 1e-2  # o rounded to bf16
  assert utils.relative_max_error(o, ref_o) < bound
  assert utils.relative_max_error(s, ref_s) < 1e-5


@pytest.mark.parametrize("gate", GATES)
def test_jitted_loop_matches_sequence_call(x64, gate):
  """Seven steps in a ``lax.scan`` equal ``gated_delta(impl="scan")``."""
  x = _inputs(SHAPES[1], gate, seed=11, length=7)
  q, k, v, a, b, s0 = (jnp.asarray(y) for y in x)

  @jax.jit
  def decode(state):
    def step(state, token):
      o, state = deltajax.gated_delta_step(state, *token, impl="pallas")
      return state, o
    tokens = tuple(jnp.moveaxis(y, 1, 0) for y in (q, k, v, a, b))
    state, o = jax.lax.scan(step, state, tokens)
    return jnp.moveaxis(o, 0, 1), state

  o, s = decode(s0)
  ref_o, ref_s = utils.gated_delta("scan", q, k, v, a, b, s0)
  np.testing.assert_allclose(o, ref_o, rtol=0, atol=1e-12)
  np.testing.assert_allclose(s, ref_s, rtol=0, atol=1e-12)


@pytest.mark.parametrize("gate", GATES)
def test_pallas_gradients_are_the_jnp_steps(x64, gate):
  args = tuple(jnp.asarray(y) for y in _token(_inputs(SHAPES[1], gate,
                                                      seed=13)))
  rng = np.random.default_rng(17)
  cotangents = (rng.standard_normal(args[3].shape),  # o, like v
                rng.standard_normal(args[0].shape))

  def grads(impl):
    step = functools.partial(deltajax.gated_delta_step, impl=impl)
    return utils.vjp(step, args, cotangents)[1]

  for got, ref in zip(grads("pallas"), grads("jnp")):
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-12)


def test_auto_takes_the_kernel_where_it_runs_compiled(monkeypatch):
  """The jnp step on the CPU; the kernel on an NVIDIA GPU (faked here)."""
  assert api._step_impl("auto") == "jnp"
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(pallas, "gpu_capability", lambda: (9, 0))
  assert api._step_impl("auto") == "pallas"
  monkeypatch.setattr(pallas, "gpu_capability", lambda: (7, 5))
  assert api._step_impl("auto") == "jnp"


# --- A pool of states, speculative decoding ---------------------------------

# B = 3 rows on a pool of P = 6 slots: row 1 is padding, slots 0, 2, 3 unused.
SLOTS = np.array([4, -1, 1], np.int32)
POOL_SIZE = 6


def _pool_inputs(gate, seed, length, value_heads=2):
  """float64 numpy ``(pool, (q, k, v, a, b, w))`` for the rows of :data:`SLOTS`:
  B = 3, H = 2, K = V = 16; ``w`` None but for "gdn2"."""
  x = utils.random_inputs(seed, batch=3, length=length, heads=2, key_dim=16,
                          value_dim=16, per_channel=gate != "gdn",
                          value_heads=value_heads, states=POOL_SIZE)
  b, w = x.b, None
  if gate == "gdn2":
    rng = np.random.default_rng(seed)
    b = rng.uniform(0.0, 1.0, x.a.shape)
    w = rng.uniform(0.0, 1.0, x.v.shape)
  return x.initial_state, (x.q, x.k, x.v, x.a, b, w)


def _sequence_call(tokens, s0):
  """``(o, final_state)`` of the sequence call (impl="scan") from ``s0``."""
  q, k, v, a, b, w = tokens
  if w is not None:
    return deltajax.gdn2(q, k, v, a, b, w, initial_state=s0, impl="scan",
                         return_final_state=True)
  return utils.gated_delta("scan", q, k, v, a, b, s0)


def _real_rows(x):
  return np.asarray(x)[SLOTS >= 0]


@pytest.mark.parametrize("impl", ("jnp", "pallas"))
def test_pool_step_matches_sequence_call(x64, impl):
  """Grouped heads (HV = 2 H): the rows step their slots; unused slots stay,
  and the padding row outputs zeros."""
  pool, tokens = _pool_inputs("gdn", seed=21, length=1, value_heads=4)
  q, k, v, a, b, _ = (None if y is None else y[:, 0] for y in tokens)
  o, new_pool = deltajax.gated_delta_step(pool, q, k, v, a, b,
                                          state_indices=SLOTS, impl=impl)
  ref_o, ref_s = _sequence_call(tokens, pool[np.maximum(SLOTS, 0)])
  np.testing.assert_allclose(_real_rows(o), _real_rows(ref_o[:, 0]), rtol=0,
                             atol=1e-12)
  np.testing.assert_allclose(np.asarray(new_pool)[[4, 1]], _real_rows(ref_s),
                             rtol=0, atol=1e-12)
  unused = [0, 2, 3, 5]
  np.testing.assert_array_equal(np.asarray(new_pool)[unused], pool[unused])
  np.testing.assert_array_equal(o[1], 0)


@pytest.mark.parametrize("dims", [(32, 64), (48, 100)], ids=["fits", "padded"])
@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16))
def test_pool_kernel_matches_jnp(dtype, dims):
  """The kernel steps the pool's slots in the pool's dtype (in place for
  head dims it runs as they are, through the B slots otherwise); padding
  rows and unused slots stay as they were."""
  dk, dv = dims
  x = utils.random_inputs(31, batch=3, length=1, heads=1, key_dim=dk,
                          value_dim=dv, per_channel=True, value_heads=2,
                          states=POOL_SIZE)
  pool = jnp.asarray(x.initial_state, dtype)
  token = tuple(jnp.asarray(y[:, 0], jnp.float32) for y in x[:5])
  o, new_pool = deltajax.gated_delta_step(pool, *token, state_indices=SLOTS,
                                          impl="pallas")
  ref_o, ref_pool = deltajax.gated_delta_step(pool, *token,
                                              state_indices=SLOTS, impl="jnp")
  assert new_pool.dtype == dtype
  assert utils.relative_max_error(o, ref_o) < 1e-5
  np.testing.assert_array_equal(o[1], 0)
  steps = np.asarray([4, 1])
  bound = 1e-5 if dtype == jnp.float32 else 1e-2  # a bf16 rounding apart
  assert utils.relative_max_error(new_pool[steps], ref_pool[steps]) < bound
  unused = np.asarray([0, 2, 3, 5])
  np.testing.assert_array_equal(new_pool[unused], pool[unused])


@pytest.mark.parametrize("pooled", (False, True), ids=["dense", "pool"])
@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16))
def test_step_kernel_lowers_for_triton(dtype, pooled, hopper):
  """The step lowers through Pallas' Triton lowering for CUDA, on the state
  in its own dtype: a pool's slots without a gather or scatter around it."""
  bsz, h, hv, d = 4, 2, 4, 64
  f32 = jax.ShapeDtypeStruct  # an abstract array
  state = f32((3 * bsz if pooled else bsz, hv, d, d), dtype)
  token = (f32((bsz, h, d), jnp.bfloat16), f32((bsz, h, d), jnp.bfloat16),
           f32((bsz, hv, d), jnp.bfloat16), f32((bsz, hv), jnp.float32),
           f32((bsz, hv), jnp.float32))
  slots = f32((bsz,), jnp.int32) if pooled else None
  step = functools.partial(pallas_step.gated_delta_step_pallas, scale=0.1,
                           dtype=jnp.float32,
                           config=pallas.Config(interpret=False))
  text = jax.export.export(
      jax.jit(lambda *x: step(*x[:6], state_indices=x[6]), donate_argnums=0),
      platforms=["cuda"], disabled_checks=[
          jax.export.DisabledSafetyCheck.custom_call(
              "__gpu$xla.gpu.triton")])(state, *token, slots).mlir_module()
  assert 'name = "deltajax_step"' in text
  assert ("gather" in text, "scatter" in text) == (False, False)


def test_donated_pool_is_updated_in_place():
  """No pool-sized buffer beyond the donated one: the step's temporaries
  hold the B slots, not the pool."""
  pool = jnp.zeros((64, 2, 32, 32))  # 512 KiB, 64 slots
  q, v, a = jnp.zeros((4, 2, 32)), jnp.zeros((4, 2, 32)), jnp.zeros((4, 2))
  step = jax.jit(lambda pool, slots: deltajax.gated_delta_step(
      pool, q, q, v, a, a, state_indices=slots), donate_argnums=0)
  memory = step.lower(pool, jnp.arange(4)).compile().memory_analysis()
  assert memory.alias_size_in_bytes == pool.nbytes
  assert memory.temp_size_in_bytes < pool.nbytes // 4


def test_repeated_slots_are_refused():
  pool, tokens = _pool_inputs("gdn", seed=22, length=1)
  q, k, v, a, b = (y[:, 0] for y in tokens[:5])
  step = functools.partial(deltajax.gated_delta_step, pool, q, k, v, a, b)
  for slots in ([1, 3, 1], [-1, 5, 6]):  # a repeat; past the pool
    bad = len(slots) - 1
    message = (rf"state_indices must be below the pool size P = 6 and name "
               rf"each slot at most once .*; got state_indices\[{bad}\]")
    with pytest.raises(ValueError, match=message):
      step(state_indices=np.array(slots))
  step(state_indices=np.array([-1, 2, -1]))  # padding rows may repeat
  with deltajax.value_checks():  # traced indices: checked under checkify
    error, _ = checkify.checkify(jax.jit(lambda i: step(state_indices=i)),
                                 errors=checkify.user_checks)(
                                     jnp.array([1, 3, 1]))
  assert re.search(r"state_indices must .*; got state_indices\[2\] = 1",
                   error.get())


@pytest.mark.parametrize("gate, length, pooled",
                         [("gdn", 8, True), ("kda", 1, False),
                          ("gdn2", 5, True)])
def test_verify_matches_sequence_call_and_steps(x64, gate, length, pooled):
  """Outputs and the last state against the sequence call; every state
  against as many steps of :func:`deltajax.gated_delta_step`."""
  pool, tokens = _pool_inputs(gate, seed=23, length=length)
  start = pool[np.maximum(SLOTS, 0)]
  options = dict(w=tokens[5], state_indices=SLOTS) if pooled else dict(
      w=tokens[5])
  o, states = deltajax.gated_delta_verify(pool if pooled else start,
                                          *tokens[:5], **options)
  assert o.shape == tokens[2].shape
  assert states.shape == (3, length, *pool.shape[1:])
  rows = _real_rows if pooled else np.asarray
  ref_o, ref_s = _sequence_call(tokens, start)
  np.testing.assert_allclose(rows(o), rows(ref_o), rtol=0, atol=1e-12)
  np.testing.assert_allclose(rows(states[:, -1]), rows(ref_s), rtol=0,
                             atol=1e-12)
  state = start
  for t in range(length):
    token = tuple(None if y is None else y[:, t] for y in tokens)
    _, state = deltajax.gated_delta_step(state, *token[:5], w=token[5])
    np.testing.assert_allclose(rows(states[:, t]), rows(state), rtol=0,
                               atol=1e-12)
  if pooled:
    np.testing.assert_array_equal(o[1], 0)
    np.testing.assert_array_equal(states[1], 0)


@pytest.mark.parametrize("dims", [(16, 16), (24, 20)], ids=["fits", "padded"])
@pytest.mark.parametrize("gate, pooled", [("gdn", False), ("kda", True),
                                          ("gdn2", True)])
def test_verify_kernel_matches_jnp(gate, pooled, dims):
  """The verification kernel (T = 3 tokens from one read of each state
  block) against the loop of jnp steps: outputs, every state (zeros in the
  padding row), and the gradients (through the jnp loop)."""
  dk, dv = dims
  x = utils.random_inputs(24, batch=3, length=3, heads=1, key_dim=dk,
                          value_dim=dv, per_channel=gate != "gdn",
                          value_heads=2, states=POOL_SIZE)
  rng = np.random.default_rng(24)
  w = rng.uniform(0.0, 1.0, x.v.shape) if gate == "gdn2" else None
  b = rng.uniform(0.0, 1.0, x.a.shape) if gate == "gdn2" else x.b
  state = x.initial_state if pooled else x.initial_state[:3]
  options = dict(w=None if w is None else jnp.asarray(w, jnp.float32),
                 state_indices=SLOTS if pooled else None)
  args = tuple(jnp.asarray(y, jnp.float32)
               for y in (state, x.q, x.k, x.v, x.a, b))

  def loss(impl, *args):
    o, states = deltajax.gated_delta_verify(*args, impl=impl, **options)
    return jnp.sum(o * o) + jnp.sum(jnp.sin(states)), (o, states)

  grad = lambda impl: jax.grad(functools.partial(loss, impl), has_aux=True,
                               argnums=tuple(range(6)))(*args)
  (got_grads, got), (ref_grads, ref) = grad("pallas"), grad("jnp")
  for x_, y in zip((*got, *got_grads), (*ref, *ref_grads)):
    assert utils.relative_max_error(x_, y) < 1e-5
  if pooled:
    np.testing.assert_array_equal(got[0][1], 0)
    np.testing.assert_array_equal(got[1][1], 0)


@pytest.mark.parametrize("pooled", (False, True), ids=["dense", "pool"])
def test_verify_kernel_lowers_for_triton(pooled, hopper):
  """Three draft tokens (not a power of two) lower through Pallas' Triton
  lowering for CUDA in one kernel, reading the pool's slots in place."""
  bsz, t, h, hv, d = 4, 3, 2, 4, 64
  f32 = jax.ShapeDtypeStruct  # an abstract array
  state = f32((3 * bsz if pooled else bsz, hv, d, d), jnp.float32)
  tokens = (f32((bsz, t, h, d), jnp.bfloat16), f32((bsz, t, h, d),
                                                   jnp.bfloat16),
            f32((bsz, t, hv, d), jnp.bfloat16), f32((bsz, t, hv, d),
                                                    jnp.float32),
            f32((bsz, t, hv), jnp.float32))
  slots = f32((bsz,), jnp.int32) if pooled else None
  verify = functools.partial(pallas_step.gated_delta_verify_pallas,
                             scale=0.1, dtype=jnp.float32,
                             config=pallas.Config(interpret=False))
  text = jax.export.export(
      jax.jit(lambda *x: verify(*x[:6], state_indices=x[6])),
      platforms=["cuda"], disabled_checks=[
          jax.export.DisabledSafetyCheck.custom_call(
              "__gpu$xla.gpu.triton")])(state, *tokens, slots).mlir_module()
  assert text.count('name = "deltajax_verify"') == 1
  assert ("gather" in text, "scatter" in text) == (False, False)


def test_commit_writes_the_last_accepted_state():
  """Row 0 accepts 2 of 3 tokens into slot 4; row 2 none (slot 1 stays);
  row 1 is padding."""
  pool, tokens = _pool_inputs("gdn", seed=25, length=3)
  pool = jnp.asarray(pool, jnp.float32)
  _, states = deltajax.gated_delta_verify(
      pool, *(jnp.asarray(y, jnp.float32) for y in tokens[:5]),
      state_indices=SLOTS)
  new_pool = deltajax.gated_delta_commit(pool, states, SLOTS,
                                         np.array([2, 3, 0]))
  expected = np.asarray(pool).copy()
  expected[4] = states[0, 1]
  np.testing.assert_array_equal(new_pool, expected)


def test_bfloat16_state_stays_bfloat16_and_accurate():
  """32 steps of KDA with a bfloat16 state against a float32 state: 9.6e-4
  relative RMS error for o and 1.9e-3 for the state here (docs/accuracy.md);
  a state rounded by truncation, or stepped in bfloat16, exceeds the
  bounds. verify rounds only its outputs: its states are its float32
  carry's, rounded."""
  pool, tokens = _pool_inputs("kda", seed=26, length=32)
  s0 = jnp.asarray(pool[:3], jnp.bfloat16)
  tokens = tuple(jnp.asarray(y, jnp.float32) for y in tokens[:5])

  @functools.partial(jax.jit, static_argnums=1)
  def decode(state, dtype):
    def step(state, token):
      o, state = deltajax.gated_delta_step(state, *token)
      return state, o
    xs = tuple(jnp.moveaxis(y, 1, 0) for y in tokens)
    return jax.lax.scan(step, state.astype(dtype), xs)

  s16, o16 = decode(s0, jnp.bfloat16)
  s32, o32 = decode(s0, jnp.float32)
  assert s16.dtype == jnp.bfloat16
  assert utils.relative_rms_error(o16, o32) < 2e-3
  assert utils.relative_rms_error(s16, s32) < 3.5e-3
  _, states16 = deltajax.gated_delta_verify(s0, *tokens)
  _, states32 = deltajax.gated_delta_verify(s0.astype(jnp.float32), *tokens)
  assert states16.dtype == jnp.bfloat16
  np.testing.assert_array_equal(states16, states32.astype(jnp.bfloat16))


def _bad_calls():
  """``{name: (error, message, call)}``: calls with one bad argument."""
  pool = jnp.zeros((6, 2, 8, 8))
  q, v, a = jnp.zeros((3, 2, 8)), jnp.zeros((3, 2, 8)), jnp.zeros((3, 2))
  step = functools.partial(deltajax.gated_delta_step, pool, q, q, v, a, a)
  verify = functools.partial(deltajax.gated_delta_verify, pool, q[:, None],
                             q[:, None], v[:, None], a[:, None], a[:, None])
  slots = jnp.array([0, 1, 2])
  states = jnp.zeros((3, 4, 2, 8, 8))
  return {
      "float slots": (TypeError, r"state_indices must be an integer array",
                      lambda: step(state_indices=jnp.zeros(3))),
      "slots [B, 1]": (ValueError, r"state_indices must have shape \[B\]",
                       lambda: step(state_indices=slots[:, None])),
      "pool [P, HV, V, K]": (ValueError, r"state must be a pool of shape "
                             r"\[P, HV, K, V\]", lambda: deltajax.
                             gated_delta_step(pool[..., :4], q, q, v, a, a,
                                              state_indices=slots)),
      "pool without slots": (ValueError, r"state must have shape \[B, HV, K, "
                             r"V\]", lambda: step()),
      "verify q [B, H, K]": (ValueError, r"q must have shape \[B, T, H, K\]",
                             lambda: deltajax.gated_delta_verify(
                                 pool, q, q, v, a, a, state_indices=slots)),
      "verify state": (ValueError, r"state must have shape \[B, HV, K, V\]",
                       lambda: verify()),
      "verify b [B, T, HV, K]": (ValueError, r"b must have shape \[B, T, HV\]",
                                 lambda: deltajax.gated_delta_verify(
                                     pool, q[:, None], q[:, None], v[:, None],
                                     a[:, None], q[:, None],
                                     state_indices=slots)),
      "commit accepted > T": (ValueError, r"accepted must be in \[0, T\] = "
                              r"\[0, 4\]; got accepted\[1\] = 5",
                              lambda: deltajax.gated_delta_commit(
                                  pool, states, slots, jnp.array([0, 5, 1]))),
      "commit states [B, HV, K, V]": (ValueError, r"states must have shape",
                                      lambda: deltajax.gated_delta_commit(
                                          pool, states[:, 0], slots, slots)),
      "commit int pool": (TypeError, r"pool must be a floating-point array",
                          lambda: deltajax.gated_delta_commit(
                              jnp.zeros((6, 2, 8, 8), jnp.int32), states,
                              slots, slots)),
  }


@pytest.mark.parametrize("name", tuple(_bad_calls()))
def test_bad_arguments_are_named(name):
  error, message, call = _bad_calls()[name]
  with pytest.raises(error, match=message):
    call()
