"""deltajax.hf against transformers' modules (their PyTorch code paths, on the CPU).

Tiny random configs (hidden 96; Qwen: 2 key heads, 4 value heads, K 16, V 24;
Kimi: 3 heads of 32) with every parameter perturbed away from its init.
"""

import json

import jax
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import deltajax
from deltajax import hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

HIDDEN, T, PREFILL = 96, 40, 20
QWEN = dict(hidden_size=HIDDEN, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=24, linear_conv_kernel_dim=4,
            rms_norm_eps=1e-6)
KIMI = dict(hidden_size=HIDDEN, linear_num_heads=3, linear_head_dim=32,
            linear_conv_kernel_dim=4, rms_norm_eps=1e-5)
# Two layers, the first linear attention: what save_pretrained writes.
MODEL = dict(vocab_size=64, num_hidden_layers=2, intermediate_size=64,
             num_attention_heads=2, num_key_value_heads=1, head_dim=16,
             layer_types=["linear_attention", "full_attention"])
KIMI_MODEL = dict(MODEL, num_key_value_heads=2, kv_lora_rank=16,
                  qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                  mlp_layer_types=["dense", "dense"], pad_token_id=0,
                  bos_token_id=1, eos_token_id=2)
del KIMI_MODEL["head_dim"]


def _spec(name):
  """``(config class, module class, causal LM class, builder, mixer attribute, config)``."""
  models = transformers.models
  return {
      "qwen3_next": (transformers.Qwen3NextConfig,
                     models.qwen3_next.modeling_qwen3_next
                     .Qwen3NextGatedDeltaNet,
                     transformers.Qwen3NextForCausalLM, hf.qwen3_next_layer,
                     "linear_attn", dict(QWEN, num_experts=0)),
      "qwen3_5": (transformers.Qwen3_5TextConfig,
                  models.qwen3_5.modeling_qwen3_5.Qwen3_5GatedDeltaNet,
                  transformers.Qwen3_5ForCausalLM, hf.qwen3_5_layer,
                  "linear_attn", QWEN),
      "kimi_linear": (transformers.KimiLinearConfig,
                      models.kimi_linear.modeling_kimi_linear
                      .KimiLinearDeltaAttention,
                      transformers.KimiLinearForCausalLM,
                      hf.kimi_linear_layer, "self_attn", KIMI),
  }[name]


NAMES = ("qwen3_next", "qwen3_5", "kimi_linear")


def _config(name, **extra):
  config_cls, *_, options = _spec(name)
  return config_cls(**options, **extra, **(
      KIMI_MODEL if name == "kimi_linear" else MODEL))


def _perturb(module, seed):
  """Moves every parameter away from its init (A_log, dt_bias, norm weights included)."""
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in module.named_parameters():
      noise = torch.randn(p.shape, generator=generator)
      if name.endswith("A_log"):
        p.copy_(0.5 * noise)                # rates exp(A_log) around 1
      elif name.endswith("dt_bias"):
        p.copy_(0.5 * noise - 1.0)
      elif p.ndim == 1:
        p.copy_(1.0 + 0.3 * noise)          # norm weights
      else:
        p.add_(0.3 * p.std() * noise)
  return module


def _rel_rms(y, ref):
  y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
  return float(np.sqrt(np.mean((y - ref) ** 2) / np.mean(ref ** 2)))


def _torch_forward(module, x, **kwargs):
  with torch.no_grad():
    return module(torch.from_numpy(np.asarray(x)), **kwargs).numpy()


@pytest.fixture(scope="module", params=NAMES)
def pair(request):
  """``(name, config, transformers module, deltajax layer)``; the layer is built from the config's ``to_dict()``."""
  config = _config(request.param)
  module = _perturb(_spec(request.param)[1](config, 0), seed=0).eval()
  layer = _spec(request.param)[3](config.to_dict(), module.state_dict(),
                                  chunk_size=16)
  return request.param, config, module, layer


def _x(seed=1, batch=2, t=T):
  return np.random.default_rng(seed).standard_normal(
      (batch, t, HIDDEN)).astype(np.float32)


def test_layer_equals_transformers(pair):
  _, _, module, layer = pair
  x = _x()
  error = _rel_rms(layer(jnp.asarray(x)), _torch_forward(module, x))
  assert error < 1e-5, error


def test_value_checks_reach_the_rule_under_checkify(pair):
  """A NaN in x makes q non-finite; checkify's error names q."""
  _, _, _, layer = pair
  x = jnp.asarray(_x()).at[0, 7, 5].set(jnp.nan)
  with deltajax.value_checks():
    error, _ = checkify.checkify(jax.jit(lambda x: layer(x)),
                                 errors=checkify.user_checks)(x)
  assert error.get().startswith("q must be finite; got q[0, 7,"), error.get()


def test_left_padding_mask_equals_transformers(pair):
  _, _, module, layer = pair
  x = _x(seed=2)
  mask = np.arange(T)[None, :] >= np.array([[0], [7]])
  ref = _torch_forward(module, x, attention_mask=torch.from_numpy(mask))
  y = layer(jnp.asarray(x), mask=jnp.asarray(mask))
  assert _rel_rms(y, ref) < 1e-5
  np.testing.assert_array_equal(np.asarray(y)[1, :7], 0)


def test_prefill_then_decoding_equals_the_full_call_and_transformers(pair):
  _, config, module, layer = pair
  x = _x(seed=3)
  y, cache = layer(jnp.asarray(x[:, :PREFILL]), cache=layer.init_cache(2))
  pieces = [y]
  for i in range(PREFILL, T):
    y, cache = layer(jnp.asarray(x[:, i:i + 1]), cache=cache)
    pieces.append(y)
  decoded = np.concatenate(pieces, axis=1)
  assert _rel_rms(decoded, layer(jnp.asarray(x))) < 1e-5
  assert _rel_rms(decoded, _torch_forward(module, x)) < 1e-5
  # transformers' own cached decoding gives the same tokens.
  torch_cache = transformers.DynamicCache(config=config)
  torch_pieces = [_torch_forward(module, x[:, :PREFILL], cache=torch_cache)]
  torch_pieces += [_torch_forward(module, x[:, i:i + 1], cache=torch_cache)
                   for i in range(PREFILL, T)]
  assert _rel_rms(decoded, np.concatenate(torch_pieces, axis=1)) < 1e-5
  np.testing.assert_allclose(
      cache.state, torch_cache.get_recurrent_state(0, state_idx=0).numpy(),
      rtol=1e-4, atol=1e-5)


def test_gradients_are_finite_and_an_optax_step_changes_the_loss(pair):
  _, _, _, layer = pair
  layer = nnx.clone(layer)
  x, target = jnp.asarray(_x(seed=4)), jnp.asarray(_x(seed=5))
  optimizer = nnx.Optimizer(layer, optax.adam(1e-3), wrt=nnx.Param)

  def loss_fn(layer):
    return jnp.mean((layer(x) - target) ** 2)

  loss_and_grads = nnx.jit(nnx.value_and_grad(loss_fn))
  loss, grads = loss_and_grads(layer)
  leaves = jax.tree.leaves(nnx.state(grads))
  assert leaves and all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)
  assert all(float(jnp.max(jnp.abs(g))) > 0 for g in leaves)
  optimizer.update(layer, grads)
  assert float(loss_and_grads(layer)[0]) != float(loss)


@pytest.mark.parametrize("name", NAMES)
def test_linear_attention_layers_reads_a_save_pretrained_checkpoint(name,
                                                                    tmp_path):
  *_, causal_lm, _, attribute, _ = _spec(name)
  torch.manual_seed(0)
  model = causal_lm(_config(name))
  mixer = _perturb(getattr(model.model.layers[0], attribute), seed=1).eval()
  model.save_pretrained(tmp_path)
  layers = hf.linear_attention_layers(tmp_path, dtype=jnp.float32,
                                      chunk_size=16)
  assert list(layers) == [0]
  x = _x(seed=6, t=24)
  assert _rel_rms(layers[0](jnp.asarray(x)), _torch_forward(mixer, x)) < 1e-5


def test_qwen3_5_multimodal_checkpoint_layout(tmp_path):
  """Keys under model.language_model.layers.N.linear_attn, config in text_config."""
  config = _config("qwen3_5")
  module = _perturb(_spec("qwen3_5")[1](config, 0), seed=2).eval()
  tensors = {f"model.language_model.layers.3.linear_attn.{k}": v.numpy()
             for k, v in module.state_dict().items()}
  tensors["model.language_model.layers.3.mlp.up_proj.weight"] = np.zeros(
      (4, 4), np.float32)
  safetensors_numpy.save_file(tensors, str(tmp_path / "model.safetensors"))
  (tmp_path / "config.json").write_text(json.dumps(
      {"model_type": "qwen3_5", "text_config": config.to_dict()}))
  layers = hf.linear_attention_layers(tmp_path, chunk_size=16)
  assert list(layers) == [3]
  x = _x(seed=7, t=24)
  assert _rel_rms(layers[3](jnp.asarray(x)), _torch_forward(module, x)) < 1e-5


def test_bfloat16_torch_tensors_are_read_exactly_and_run():
  config = _config("qwen3_5")
  module = _perturb(_spec("qwen3_5")[1](config, 0), seed=3).eval()
  state = {k: v.to(torch.bfloat16) for k, v in module.state_dict().items()}
  layer = hf.qwen3_5_layer(config, state, dtype=jnp.bfloat16, chunk_size=16)
  assert layer.A_log.dtype == jnp.bfloat16
  np.testing.assert_array_equal(
      np.asarray(layer.A_log[...], np.float32),
      state["A_log"].float().numpy())
  x = _x(seed=8)
  y = layer(jnp.asarray(x, jnp.bfloat16))
  assert y.dtype == jnp.bfloat16
  # transformers in bfloat16 is about 1e-2 from its float32 output, too.
  module.load_state_dict({k: v.float() for k, v in state.items()})
  assert _rel_rms(y.astype(jnp.float32), _torch_forward(module, x)) < 3e-2


@pytest.mark.parametrize("change, message", [
    (lambda s: s.pop("dt_bias"), r"missing \['dt_bias'\]"),
    (lambda s: s.update(extra=np.zeros(3)), r"unexpected \['extra'\]"),
    (lambda s: s.update(A_log=np.zeros(5)),
     r"state_dict\['A_log'\] must have shape \(4,\)"),
])
def test_bad_state_dicts_are_rejected(change, message):
  config = _config("qwen3_next")
  state = {k: v.numpy() for k, v in
           _spec("qwen3_next")[1](config, 0).state_dict().items()}
  change(state)
  with pytest.raises(ValueError, match=message):
    hf.qwen3_next_layer(config, state)


def test_config_errors_are_clear(tmp_path):
  with pytest.raises(ValueError, match="lacks"):
    hf.qwen3_5_layer({"hidden_size": HIDDEN}, {})
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
  with pytest.raises(ValueError, match="model_type 'llama'"):
    hf.linear_attention_layers(tmp_path)
