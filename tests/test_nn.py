"""Tests of the Flax layers in deltajax.nn."""

import jax
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import deltajax
from deltajax import nn
import utils

LAYERS = (nn.GatedDeltaNet, nn.KimiDeltaAttention, nn.GatedDeltaNet2,
          nn.DeltaNet)
D_MODEL, HEADS = 32, 2


def _inputs(shape, seed=1, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(seed), shape, dtype)


def _layer(cls, **options):
  return cls(D_MODEL, HEADS, rngs=nnx.Rngs(0), **options)


@pytest.mark.parametrize("cls", LAYERS)
def test_output_shape_and_cache_shapes(cls):
  layer = _layer(cls, head_dim=8, value_head_dim=12, conv_size=3)
  x = _inputs((3, 10, D_MODEL))
  y = layer(x)
  assert y.shape == x.shape and y.dtype == jnp.float32
  cache = layer.init_cache(3)
  assert cache.conv.shape == (3, 2, HEADS * (8 + 8 + 12))
  assert cache.state.shape == (3, HEADS, 8, 12)
  assert cache.state.dtype == jnp.float32
  y, new_cache = layer(x, cache=cache)
  assert y.shape == x.shape
  assert jax.tree.map(jnp.shape, new_cache) == jax.tree.map(jnp.shape, cache)


def test_causal_depthwise_conv_matches_numpy_and_continues_from_history():
  x = np.asarray(_inputs((2, 9, 5)))
  kernel = np.asarray(_inputs((4, 5), seed=2))
  y, history = nn.causal_depthwise_conv(x, kernel, np.zeros((2, 3, 5), np.float32))
  expected = np.array([[np.convolve(x[b, :, c], kernel[::-1, c])[:9]
                        for c in range(5)] for b in range(2)]).transpose(0, 2, 1)
  np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(history, x[:, -3:])
  y_first, history = nn.causal_depthwise_conv(
      x[:, :6], kernel, np.zeros((2, 3, 5), np.float32))
  y_rest, _ = nn.causal_depthwise_conv(x[:, 6:], kernel, history)
  np.testing.assert_allclose(np.concatenate([y_first, y_rest], axis=1), y,
                             rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("cls, expected", [
    (nn.GatedDeltaNet, (2, 5, HEADS)),
    (nn.KimiDeltaAttention, (2, 5, HEADS, D_MODEL // HEADS)),
    (nn.GatedDeltaNet2, (2, 5, HEADS, D_MODEL // HEADS)),
    (nn.DeltaNet, (2, 5, HEADS)),
])
def test_log_decay_shape_and_sign(cls, expected):
  a = _layer(cls).log_decay(_inputs((2, 5, D_MODEL)))
  assert a.shape == expected and a.dtype == jnp.float32
  assert bool(jnp.all(a <= 0))
  if cls is nn.DeltaNet:
    assert bool(jnp.all(a == 0))
  else:
    assert bool(jnp.any(a < 0))


def test_initial_decay_rates():
  """softplus(dt_bias) lies in [1e-4, 0.1] and exp(A_log) in [1, 16]."""
  layer = nn.KimiDeltaAttention(64, 4, rngs=nnx.Rngs(3))
  dt = jax.nn.softplus(layer.dt_bias[...])
  assert layer.dt_bias.shape == (4, 16)
  assert bool(jnp.all((dt >= 1e-4 * 0.99) & (dt <= 0.1 * 1.01)))
  rate = jnp.exp(layer.A_log[...])
  assert bool(jnp.all((rate >= 1.0 * 0.999) & (rate <= 16.0 * 1.001)))


@pytest.mark.parametrize("cls", LAYERS)
def test_decoding_token_by_token_equals_one_call(cls):
  """Prefill of 5 tokens, 6 single-token steps, then a block of 8, under nnx.jit."""
  layer = _layer(cls, chunk_size=16)
  x = _inputs((2, 19, D_MODEL))
  full = layer(x)

  @nnx.jit
  def extend(layer, x, cache):
    return layer(x, cache=cache)

  cache = layer.init_cache(2)
  pieces = []
  for start, stop in [(0, 5), *((i, i + 1) for i in range(5, 11)), (11, 19)]:
    y, cache = extend(layer, x[:, start:stop], cache)
    pieces.append(y)
  np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), full,
                             rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cls", LAYERS)
def test_final_cache_state_matches_one_call(cls):
  """The state after a prefill equals the state after the same tokens one at a time."""
  layer = _layer(cls)
  x = _inputs((1, 7, D_MODEL))
  _, prefilled = layer(x, cache=layer.init_cache(1))
  cache = layer.init_cache(1)
  for i in range(7):
    _, cache = layer(x[:, i:i + 1], cache=cache)
  np.testing.assert_allclose(cache.state, prefilled.state, rtol=1e-5,
                             atol=1e-5)
  # The projections of one token and of seven round differently.
  np.testing.assert_allclose(cache.conv, prefilled.conv, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls", [nn.GatedDeltaNet, nn.KimiDeltaAttention,
                                 nn.GatedDeltaNet2])
def test_scan_and_chunked_layers_agree(cls):
  x = _inputs((2, 12, D_MODEL))
  y_scan = _layer(cls, impl="scan", chunk_size=16)(x)
  y_chunked = _layer(cls, impl="chunked", chunk_size=32)(x)
  np.testing.assert_allclose(y_scan, y_chunked, rtol=1e-5, atol=1e-5)


def test_output_is_causal():
  layer = _layer(nn.KimiDeltaAttention, chunk_size=16)
  x = _inputs((1, 12, D_MODEL))
  changed = x.at[:, 7:].set(_inputs((1, 5, D_MODEL), seed=2))
  np.testing.assert_allclose(layer(changed)[:, :7], layer(x)[:, :7],
                             rtol=1e-6, atol=1e-6)


def _mse_loss(layer, x, target):
  return jnp.mean((layer(x).astype(jnp.float32) - target) ** 2)


@pytest.mark.parametrize("cls", LAYERS)
def test_gradients_reach_every_parameter_and_are_finite(cls):
  layer = _layer(cls, chunk_size=16)
  x = _inputs((2, 20, D_MODEL))
  grads = nnx.grad(_mse_loss)(layer, x, _inputs((2, 20, D_MODEL), seed=2))
  for path, g in jax.tree_util.tree_leaves_with_path(nnx.state(grads)):
    name = jax.tree_util.keystr(path)
    assert bool(jnp.all(jnp.isfinite(g))), name
    assert float(jnp.max(jnp.abs(g))) > 0, name


@pytest.mark.parametrize("cls", LAYERS)
def test_optax_steps_reduce_the_loss_on_a_fixed_batch(cls):
  layer = _layer(cls, chunk_size=16)
  optimizer = nnx.Optimizer(layer, optax.adam(1e-2), wrt=nnx.Param)
  x = _inputs((4, 16, D_MODEL))
  target = 0.5 * _inputs((4, 16, D_MODEL), seed=2)

  @nnx.jit
  def train_step(layer, optimizer):
    loss, grads = nnx.value_and_grad(_mse_loss)(layer, x, target)
    optimizer.update(layer, grads)
    return loss

  losses = [float(train_step(layer, optimizer)) for _ in range(25)]
  assert losses[-1] < 0.6 * losses[0], losses


@pytest.mark.parametrize("cls", [nn.GatedDeltaNet, nn.KimiDeltaAttention])
def test_bfloat16_parameters_and_activations(cls):
  layer = _layer(cls, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                 chunk_size=16)
  reference = _layer(cls, chunk_size=16)
  nnx.update(reference, jax.tree.map(lambda p: p.astype(jnp.float32),
                                     nnx.state(layer, nnx.Param)))
  x = _inputs((2, 12, D_MODEL), dtype=jnp.bfloat16)
  y = layer(x)
  assert y.dtype == jnp.bfloat16
  expected = reference(x.astype(jnp.float32))
  np.testing.assert_allclose(y.astype(jnp.float32), expected, rtol=0.05,
                             atol=0.05 * float(jnp.max(jnp.abs(expected))))
  grads = nnx.grad(_mse_loss)(layer, x, jnp.zeros(x.shape, jnp.float32))
  for g in jax.tree.leaves(nnx.state(grads)):
    assert g.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(g)))
  cache = layer.init_cache(2)
  assert cache.conv.dtype == jnp.bfloat16 and cache.state.dtype == jnp.float32
  y_step, cache = layer(x[:, :1], cache=cache)
  assert y_step.dtype == jnp.bfloat16 and cache.state.dtype == jnp.float32


def test_bfloat16_cache_state_stays_bfloat16():
  """Prefill and a decoded token keep the cache's bfloat16 state, and the
  outputs stay near those of a float32 state."""
  layer = _layer(nn.KimiDeltaAttention)
  x = _inputs((2, 6, D_MODEL))
  outputs = {}
  for dtype in (jnp.float32, jnp.bfloat16):
    cache = layer.init_cache(2, state_dtype=dtype)
    y, cache = layer(x[:, :5], cache=cache)
    y_step, cache = layer(x[:, 5:], cache=cache)
    assert cache.state.dtype == dtype
    outputs[dtype] = y_step
  assert utils.relative_rms_error(outputs[jnp.bfloat16],
                                  outputs[jnp.float32]) < 1e-2


def test_allow_neg_eigval_doubles_beta():
  """With beta in (0, 2) the output differs, and decoding still matches."""
  layer = _layer(nn.GatedDeltaNet, allow_neg_eigval=True)
  plain = _layer(nn.GatedDeltaNet)
  x = _inputs((1, 6, D_MODEL))
  assert not np.allclose(layer(x), plain(x))
  cache, pieces = layer.init_cache(1), []
  for i in range(6):
    y, cache = layer(x[:, i:i + 1], cache=cache)
    pieces.append(y)
  np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), layer(x),
                             rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("options, message", [
    (dict(d_model=30, num_heads=4), "divisible"),
    (dict(conv_size=0), "conv_size"),
    (dict(impl="cuda"), "impl"),
])
def test_invalid_options_are_rejected(options, message):
  options = dict(dict(d_model=D_MODEL, num_heads=HEADS), **options)
  with pytest.raises(ValueError, match=message):
    nn.GatedDeltaNet(rngs=nnx.Rngs(0), **options)


def _grouped_as_ungrouped(layer):
  """A layer with H = HV heads that computes what the grouped ``layer`` does.

  Its q/k head ``j`` is the grouped layer's q/k head ``j // G`` (projection
  rows and convolution channels repeated); every other parameter is shared.
  """
  h, hv, dk = layer.num_heads, layer.num_v_heads, layer.head_dim
  plain = nn.GatedDeltaNet(D_MODEL, hv, rngs=nnx.Rngs(9), head_dim=dk,
                           value_head_dim=layer.value_head_dim,
                           chunk_size=layer.chunk_size)
  state = nnx.state(layer, nnx.Param)
  kernel = state["qkv_proj"]["kernel"][...]
  conv = state["conv_kernel"][...]
  def repeat_qk(w):  # [..., 2 H K + HV V] -> [..., 2 HV K + HV V]
    q, k, v = np.split(np.asarray(w), [h * dk, 2 * h * dk], axis=-1)
    expand = lambda z: np.repeat(z.reshape(*z.shape[:-1], h, dk), hv // h,
                                 axis=-2).reshape(*z.shape[:-1], hv * dk)
    return np.concatenate([expand(q), expand(k), v], axis=-1)
  state["qkv_proj"]["kernel"] = nnx.Param(jnp.asarray(repeat_qk(kernel)))
  state["conv_kernel"] = nnx.Param(jnp.asarray(repeat_qk(conv)))
  nnx.update(plain, state)
  return plain


def test_grouped_value_heads_read_key_head_j_over_g():
  layer = _layer(nn.GatedDeltaNet, num_v_heads=6, head_dim=8,
                 value_head_dim=4, chunk_size=16)
  cache = layer.init_cache(2)
  assert cache.conv.shape == (2, 3, 2 * HEADS * 8 + 6 * 4)
  assert cache.state.shape == (2, 6, 8, 4)
  assert layer.b_proj.kernel.shape == (D_MODEL, 6)
  assert layer.A_log.shape == layer.dt_bias.shape == (6,)
  x = _inputs((2, 11, D_MODEL))
  np.testing.assert_allclose(layer(x), _grouped_as_ungrouped(layer)(x),
                             rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cls", [nn.GatedDeltaNet, nn.KimiDeltaAttention])
def test_grouped_value_heads_decode_token_by_token(cls):
  layer = _layer(cls, num_v_heads=4, chunk_size=16)
  assert layer.log_decay(_inputs((1, 3, D_MODEL))).shape[2] == 4
  x = _inputs((2, 9, D_MODEL))
  cache, pieces = layer.init_cache(2), []
  for start, stop in [(0, 4), *((i, i + 1) for i in range(4, 9))]:
    y, cache = layer(x[:, start:stop], cache=cache)
    pieces.append(y)
  np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), layer(x),
                             rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cls", LAYERS)
def test_left_padding_gives_the_unpadded_outputs_and_zeros(cls):
  """Garbage at padded positions reaches neither the state nor the convolution."""
  layer = _layer(cls, num_v_heads=4, chunk_size=16)
  x = _inputs((2, 10, D_MODEL))
  mask = jnp.arange(10)[None, :] >= jnp.array([[0], [4]])
  y = layer(x, mask=mask)
  np.testing.assert_allclose(y[0], layer(x[:1])[0], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(y[1, 4:], layer(x[1:, 4:])[0], rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_array_equal(y[1, :4], 0)


@pytest.mark.parametrize("cls, output_gate", [
    (nn.GatedDeltaNet, "silu"), (nn.KimiDeltaAttention, "sigmoid"),
    (nn.DeltaNet, "sigmoid")])
def test_padding_inside_a_sequence_leaves_the_state_unchanged(cls,
                                                              output_gate):
  """[A, 3 pads, C]: C continues A's state, its window sees only zeros."""
  # conv_size 4: the 3 pads fill C's window.
  layer = _layer(cls, chunk_size=16, output_gate=output_gate)
  x = _inputs((1, 12, D_MODEL))
  mask = (jnp.arange(12) < 5) | (jnp.arange(12) >= 8)
  y, cache = layer(x, cache=layer.init_cache(1), mask=mask[None])
  y_a, after_a = layer(x[:, :5], cache=layer.init_cache(1))
  y_c, after_c = layer(x[:, 8:], cache=after_a._replace(
      conv=jnp.zeros_like(after_a.conv)))
  np.testing.assert_allclose(y[:, :5], y_a, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(y[:, 5:8], 0)
  np.testing.assert_allclose(y[:, 8:], y_c, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(cache.state, after_c.state, rtol=1e-5,
                             atol=1e-5)


def test_masked_decoding_step_keeps_the_state():
  layer = _layer(nn.KimiDeltaAttention)
  _, cache = layer(_inputs((2, 5, D_MODEL)), cache=layer.init_cache(2))
  y, stepped = layer(_inputs((2, 1, D_MODEL), seed=3), cache=cache,
                     mask=jnp.array([[False], [True]]))
  np.testing.assert_array_equal(y[0], 0)
  np.testing.assert_array_equal(stepped.state[0], cache.state[0])
  assert not np.allclose(stepped.state[1], cache.state[1])


def test_a_pool_continues_each_slot_as_a_dense_cache_would():
  """With state_indices the cache is a pool: a prefill of 4 tokens and 3
  single tokens (through gated_delta_step on the pool) continue slots 3 and
  0 from what they held, as a dense cache of those two sequences does; the
  padding row (-1) outputs zeros, and the other slots keep their values,
  under nnx.jit with the pool donated. Gated DeltaNet-2's layer: the step
  with its erase and write gates."""
  layer = _layer(nn.GatedDeltaNet2, chunk_size=16)
  x = _inputs((3, 7, D_MODEL))
  pool = jax.tree.map(lambda z: _inputs(z.shape, seed=z.ndim),
                      layer.init_cache(5))
  slots = jnp.array([3, -1, 0])
  dense = jax.tree.map(lambda z: z[jnp.array([3, 0])], pool)
  before = jax.tree.map(np.asarray, pool)

  @nnx.jit(donate_argnums=2)
  def extend(layer, x, pool, slots):
    return layer(x, cache=pool, state_indices=slots)

  for start, stop in [(0, 4), (4, 5), (5, 6), (6, 7)]:
    y, pool = extend(layer, x[:, start:stop], pool, slots)
    y_dense, dense = layer(x[::2, start:stop], cache=dense)
    np.testing.assert_allclose(y[::2], y_dense, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(y[1], 0)
  for got, want, was in zip(pool, dense, before):
    np.testing.assert_allclose(got[jnp.array([3, 0])], want, rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_array_equal(got[jnp.array([1, 2, 4])], was[[1, 2, 4]])


def test_segment_aware_conv_equals_separate_convs():
  x = _inputs((1, 9, 5))
  kernel = _inputs((3, 5), seed=2)
  ids = jnp.array([[0, 0, 0, 0, 7, 7, 2, 2, 2]])
  zeros = jnp.zeros((1, 2, 5))
  y, _ = nn.causal_depthwise_conv(x, kernel, zeros, ids)
  pieces = [nn.causal_depthwise_conv(x[:, a:b], kernel, zeros)[0]
            for a, b in [(0, 4), (4, 6), (6, 9)]]
  np.testing.assert_allclose(y, jnp.concatenate(pieces, axis=1), rtol=1e-6,
                             atol=1e-6)


@pytest.mark.parametrize("cls", LAYERS)
def test_packed_segments_equal_separate_sequences(cls):
  layer = _layer(cls, num_v_heads=4, chunk_size=16)
  x = _inputs((1, 21, D_MODEL))
  bounds = [(0, 7), (7, 9), (9, 21)]
  ids = jnp.concatenate([jnp.full((b - a,), i, jnp.int32)
                         for i, (a, b) in enumerate(bounds)])[None]
  separate = jnp.concatenate([layer(x[:, a:b]) for a, b in bounds], axis=1)
  np.testing.assert_allclose(layer(x, segment_ids=ids), separate, rtol=1e-5,
                             atol=1e-5)


@pytest.mark.parametrize("impl", (utils.slow("scan"), "chunked"))
@pytest.mark.parametrize("cls", LAYERS)
def test_a_non_finite_segment_leaves_the_others_alone(cls, impl):
  """A NaN in the middle one of three packed sequences (a chunk each): the
  other two's outputs are those of separate calls."""
  layer = _layer(cls, impl=impl, chunk_size=16)
  x = _inputs((1, 48, D_MODEL))
  ids = jnp.repeat(jnp.arange(3), 16)[None]
  y = layer(x.at[0, 20, 3].set(jnp.nan), segment_ids=ids)
  for start, stop in [(0, 16), (32, 48)]:
    np.testing.assert_allclose(y[:, start:stop], layer(x[:, start:stop]),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cls", LAYERS)
def test_a_segment_id_that_comes_back_starts_a_new_segment(cls):
  """As for the state, the convolution window restarts where the id changes."""
  layer = _layer(cls, chunk_size=16)
  x = _inputs((1, 12, D_MODEL))
  repeated = jnp.array([[0] * 5 + [1] * 2 + [0] * 5])
  numbered = jnp.array([[0] * 5 + [1] * 2 + [2] * 5])
  np.testing.assert_array_equal(layer(x, segment_ids=repeated),
                                layer(x, segment_ids=numbered))


def test_value_checks_reach_the_rule_under_checkify():
  """A NaN in x makes q non-finite; checkify's error names q."""
  layer = _layer(nn.GatedDeltaNet)
  x = _inputs((2, 10, D_MODEL))
  checked = checkify.checkify(jax.jit(lambda x: layer(x)),
                              errors=checkify.user_checks)
  with deltajax.value_checks():
    assert checked(x)[0].get() is None
    error = checked(x.at[1, 4, 3].set(jnp.nan))[0].get()
  assert error.startswith("q must be finite; got q[1, 4,"), error


def test_low_rank_gates_and_sigmoid_output_gate():
  layer = _layer(nn.KimiDeltaAttention, gate_rank=3, output_gate_rank=5,
                 output_gate="sigmoid")
  assert [l.kernel.shape for l in layer.a_proj.layers] == [(D_MODEL, 3),
                                                           (3, D_MODEL)]
  assert [l.kernel.shape for l in layer.g_proj.layers] == [(D_MODEL, 5),
                                                           (5, D_MODEL)]
  x = _inputs((1, 4, D_MODEL))
  h, dk = HEADS, D_MODEL // HEADS
  gate = layer.g_proj(x).reshape(1, 4, h, dk)
  o = layer.o_norm(jnp.ones((1, 4, h, dk)))
  np.testing.assert_allclose(layer._gated_norm(jnp.ones((1, 4, h, dk)), x),
                             o * jax.nn.sigmoid(gate), rtol=1e-6)


def test_l2_normalize_forms_agree():
  x = _inputs((3, 7))
  np.testing.assert_allclose(nn.l2_normalize(x, divide=True),
                             nn.l2_normalize(x), rtol=1e-6)
  np.testing.assert_allclose(nn.l2_normalize(x, divide=True),
                             x / jnp.sqrt(jnp.sum(x * x, -1, keepdims=True)
                                          + 1e-6), rtol=1e-7)


@pytest.mark.parametrize("options, error, message", [
    (dict(num_heads=0), ValueError, "num_heads"),
    (dict(num_v_heads=3), ValueError, "num_v_heads=3 must be a multiple"),
    (dict(chunk_size=8), ValueError, r"chunk_size must be one of \(16, 32"),
    (dict(chunk_size=128), ValueError, "chunk_size"),
    (dict(output_gate="relu"), ValueError, "output_gate"),
    (dict(gate_rank=0), ValueError, "gate_rank"),
    # Integer options refuse bools (True is no count) and non-integers.
    (dict(d_model=True), TypeError, "d_model must be an int; got bool True"),
    (dict(num_heads=True), TypeError, "num_heads must be an int; got bool"),
    (dict(num_v_heads=True), TypeError, "num_v_heads must be an int"),
    (dict(head_dim=True), TypeError, "head_dim must be an int"),
    (dict(value_head_dim=True), TypeError, "value_head_dim must be an int"),
    (dict(conv_size=True), TypeError, "conv_size must be an int"),
    (dict(gate_rank=True), TypeError, "gate_rank must be an int"),
    (dict(output_gate_rank=False), TypeError, "output_gate_rank must be an"),
    (dict(chunk_size=True), TypeError, "chunk_size must be an int"),
    (dict(head_dim=8.0), TypeError, "head_dim must be an int; got float"),
])
def test_invalid_layer_options_name_the_argument(options, error, message):
  options = dict(dict(d_model=D_MODEL, num_heads=HEADS), **options)
  with pytest.raises(error, match=message):
    nn.GatedDeltaNet(rngs=nnx.Rngs(0), **options)


@pytest.mark.parametrize("call, error, message", [
    (lambda l: l(_inputs((2, 5, D_MODEL + 1))), ValueError,
     r"x must have shape \[B, T, d_model\] with d_model=32"),
    (lambda l: l(_inputs((5, D_MODEL))), ValueError, "x must have shape"),
    (lambda l: l(_inputs((2, 5, D_MODEL)), cache=l.init_cache(3)),
     ValueError, r"cache must have .* batch size 2"),
    (lambda l: l(_inputs((2, 5, D_MODEL)), mask=jnp.ones((2, 4), bool)),
     ValueError, r"mask must have shape \[B, T\] = \(2, 5\)"),
    (lambda l: l(_inputs((2, 5, D_MODEL)), mask=jnp.ones((2, 5))),
     TypeError, "mask must have bool"),
    (lambda l: l(_inputs((2, 5, D_MODEL)),
                 segment_ids=jnp.zeros((5,), jnp.int32)),
     ValueError, r"segment_ids must have shape \[B, T\]"),
    (lambda l: l(_inputs((2, 5, D_MODEL)), segment_ids=jnp.zeros((2, 5))),
     TypeError, "segment_ids must have an integer dtype"),
    (lambda l: l(_inputs((2, 5, D_MODEL)), cache=l.init_cache(2),
                 segment_ids=jnp.zeros((2, 5), jnp.int32)),
     ValueError, "segment_ids .* cannot be combined with cache"),
    (lambda l: l.init_cache(True), TypeError, "batch_size must be an int"),
    (lambda l: l(_inputs((2, 1, D_MODEL)), state_indices=jnp.array([0, 1])),
     ValueError, "state_indices names the slots of a cache pool"),
    (lambda l: l(_inputs((2, 1, D_MODEL)), cache=l.init_cache(4),
                 state_indices=jnp.array([0.0, 1.0])),
     ValueError, r"state_indices must be an integer array of shape \[B\]"),
    (lambda l: l(_inputs((2, 1, D_MODEL)), cache=l.init_cache(4),
                 state_indices=jnp.array([2, 2])),
     ValueError, "state_indices.*name each slot at most once"),
    (lambda l: l(_inputs((2, 3, D_MODEL)), cache=l.init_cache(4),
                 state_indices=jnp.array([0, 4])),
     ValueError, "state_indices.*below the pool size P = 4"),
    (lambda l: l(_inputs((2, 1, D_MODEL)),
                 cache=l.init_cache(4)._replace(conv=l.init_cache(3).conv),
                 state_indices=jnp.array([0, 1])),
     ValueError, "cache must have conv .* for a pool of P"),
])
def test_invalid_call_arguments_name_the_argument(call, error, message):
  with pytest.raises(error, match=message):
    call(_layer(nn.GatedDeltaNet, num_v_heads=4))


def test_gated_deltanet2_layer_is_gdn2_of_its_gates(monkeypatch):
  """The layer's rule is deltajax.gdn2 with b = sigmoid(x W_b) per key
  channel and w = sigmoid(x W_w) per value channel."""
  layer = _layer(nn.GatedDeltaNet2, head_dim=8, value_head_dim=12)
  x = _inputs((2, 6, D_MODEL))
  erase, write = layer._write_strength(x)  # pylint: disable=protected-access
  assert erase.shape == (2, 6, HEADS, 8) and write.shape == (2, 6, HEADS, 12)
  assert layer.b_proj.kernel.shape == (D_MODEL, HEADS * 8)
  assert layer.w_proj.kernel.shape == (D_MODEL, HEADS * 12)
  seen, gdn2 = [], nn.api.gdn2

  def spy(*args, **options):
    seen.append(args)
    return gdn2(*args, **options)
  monkeypatch.setattr(nn.api, "gdn2", spy)
  layer(x)
  np.testing.assert_allclose(seen[0][4], erase, rtol=1e-6)
  np.testing.assert_allclose(seen[0][5], write, rtol=1e-6)
