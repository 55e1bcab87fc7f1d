"""Flax layers from transformers checkpoints: Qwen3-Next, Qwen3.5, Kimi Linear.

Each function takes a layer's transformers config (the config object or its
``to_dict()``) and its parameters under the names of transformers' module
(numpy arrays or torch tensors) and returns a :mod:`deltajax.nn` layer that
computes what the transformers module computes::

    layer = qwen3_next_layer(config, Qwen3NextGatedDeltaNet(config, 0).state_dict())
    y = layer(x)                                   # x [B, T, hidden]
    y, cache = layer(x, cache=layer.init_cache(B))  # prefill, then decoding

* :func:`qwen3_next_layer`: ``Qwen3NextGatedDeltaNet``, whose q/k/v/z and
  b/a projections interleave the heads of each key head.
* :func:`qwen3_5_layer`: ``Qwen3_5GatedDeltaNet`` (and Qwen3.5-MoE's), with
  separate q/k/v, z, b and a projections.
* :func:`kimi_linear_layer`: ``KimiLinearDeltaAttention`` (KDA), with the
  low-rank per-channel gate ``f_b(f_a(x))`` and a sigmoid-gated output norm.
* :func:`linear_attention_layers`: every linear-attention layer of a
  checkpoint folder (``config.json`` and ``*.safetensors``).

The parameters are rearranged, not changed: the projections are
transformers' rows in deltajax's order (``[q | k | v]`` for the convolution,
value head ``j`` reading key head ``j // (HV / H)``). Neither transformers
nor torch is needed; reading checkpoints needs ``safetensors``
(``pip install deltajax[hf]``).
"""

from __future__ import annotations

import json
import pathlib
import re
from typing import Any, Callable, Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from deltajax import nn

__all__ = ["kimi_linear_layer", "linear_attention_layers", "qwen3_5_layer",
           "qwen3_next_layer"]

# Where a checkpoint keeps layer N's token mixer: Qwen3-Next and Qwen3.5's
# text models, Qwen3.5's multimodal models, Kimi Linear.
_LAYER_KEY = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\."
                        r"(linear_attn|self_attn)\.(.+)$")


def _config_dict(config) -> dict[str, Any]:
  """The text model's config as a dict, from a config object or a dict."""
  if hasattr(config, "to_dict"):
    config = config.to_dict()
  config = dict(config)
  text = config.get("text_config")
  return dict(text) if text else config


def _require(config: Mapping[str, Any], *names: str) -> list:
  missing = [n for n in names if config.get(n) is None]
  if missing:
    raise ValueError(f"the config lacks {missing}; pass the model's "
                     f"transformers config (or its to_dict())")
  return [config[n] for n in names]


def _check_activation(config: Mapping[str, Any]) -> None:
  act = config.get("hidden_act", "silu")
  if act not in ("silu", "swish"):
    raise ValueError(f"the short convolution's activation (hidden_act) must "
                     f"be silu; got {act!r}")


def _to_numpy(x) -> np.ndarray:
  """A numpy array from a numpy array or a torch tensor (without importing torch)."""
  if hasattr(x, "detach"):
    x = x.detach().cpu()
    if str(x.dtype) in ("torch.bfloat16", "torch.float16"):
      x = x.float()  # torch gives numpy no bfloat16; float32 holds it exactly
    x = x.numpy()
  return np.asarray(x)


def _checked_arrays(state_dict: Mapping[str, Any],
                    shapes: Mapping[str, tuple[int, ...]]) -> dict:
  """``{name: np.ndarray}``, raising ``ValueError`` for missing, extra or misshapen entries."""
  missing = sorted(set(shapes) - set(state_dict))
  unexpected = sorted(set(state_dict) - set(shapes))
  if missing or unexpected:
    raise ValueError(f"state_dict must have exactly the module's parameters "
                     f"{sorted(shapes)}; missing {missing}, unexpected "
                     f"{unexpected}")
  arrays = {name: _to_numpy(state_dict[name]) for name in shapes}
  for name, shape in shapes.items():
    if arrays[name].shape != tuple(shape):
      raise ValueError(f"state_dict[{name!r}] must have shape {tuple(shape)} "
                       f"for this config; got {arrays[name].shape}")
  return arrays


def _assign(variable: nnx.Variable, value: np.ndarray) -> None:
  """Sets a parameter (in its dtype) to ``value``, of the same shape."""
  if tuple(variable.shape) != value.shape:
    raise AssertionError(f"{variable.shape} != {value.shape}")
  variable.set_value(jnp.asarray(value, variable.dtype))


def _conv_kernel(weight: np.ndarray) -> np.ndarray:
  """torch's depthwise ``Conv1d`` weight ``[C, 1, W]`` -> deltajax's ``[W, C]``."""
  return weight[:, 0, :].T


def _gated_delta_net(config, weights: Mapping[str, np.ndarray], *, options
                     ) -> nn.GatedDeltaNet:
  """A :class:`deltajax.nn.GatedDeltaNet` for a Qwen layer, from torch-layout weights.

  ``weights``: ``qkv [2 H K + HV V, hidden]`` (rows ``[q | k | v]``),
  ``z [HV V, hidden]``, ``b``, ``a`` ``[HV, hidden]`` and the module's
  ``conv1d.weight``, ``dt_bias``, ``A_log``, ``norm.weight``,
  ``out_proj.weight``.
  """
  _check_activation(config)
  hidden, h, hv, dk, dv, width, eps = _require(
      config, "hidden_size", "linear_num_key_heads", "linear_num_value_heads",
      "linear_key_head_dim", "linear_value_head_dim",
      "linear_conv_kernel_dim", "rms_norm_eps")
  layer = nn.GatedDeltaNet(
      hidden, h, num_v_heads=hv, head_dim=dk, value_head_dim=dv,
      conv_size=width, norm_eps=eps, rngs=nnx.Rngs(0), **options)
  _assign(layer.qkv_proj.kernel, weights["qkv"].T)
  _assign(layer.conv_kernel, _conv_kernel(weights["conv1d.weight"]))
  _assign(layer.g_proj.kernel, weights["z"].T)
  _assign(layer.b_proj.kernel, weights["b"].T)
  _assign(layer.a_proj.kernel, weights["a"].T)
  _assign(layer.dt_bias, weights["dt_bias"])
  _assign(layer.A_log, weights["A_log"])
  _assign(layer.o_norm.scale, weights["norm.weight"])
  _assign(layer.o_proj.kernel, weights["out_proj.weight"].T)
  return layer


def _qwen_shapes(config, projections: Mapping[str, tuple[int, ...]]) -> dict:
  """The shapes of a Qwen Gated DeltaNet's parameters, given its input projections'."""
  hidden, h, hv, dk, dv, width = _require(
      config, "hidden_size", "linear_num_key_heads", "linear_num_value_heads",
      "linear_key_head_dim", "linear_value_head_dim",
      "linear_conv_kernel_dim")
  return {**projections, "conv1d.weight": (2 * h * dk + hv * dv, 1, width),
          "dt_bias": (hv,), "A_log": (hv,), "norm.weight": (dv,),
          "out_proj.weight": (hidden, hv * dv)}


def _layer_options(dtype, param_dtype, impl: str, chunk_size: int) -> dict:
  return dict(dtype=dtype, param_dtype=dtype if param_dtype is None
              else param_dtype, impl=impl, chunk_size=chunk_size)


def qwen3_next_layer(config, state_dict: Mapping[str, Any], *,
                     dtype=jnp.float32, param_dtype=None, impl: str = "auto",
                     chunk_size: int = 64) -> nn.GatedDeltaNet:
  """Qwen3-Next's ``Qwen3NextGatedDeltaNet`` as a :class:`deltajax.nn.GatedDeltaNet`.

  Args:
    config: ``Qwen3NextConfig`` or its ``to_dict()``.
    state_dict: ``in_proj_qkvz.weight``, ``in_proj_ba.weight``,
      ``conv1d.weight``, ``dt_bias``, ``A_log``, ``norm.weight``,
      ``out_proj.weight`` (numpy arrays or torch tensors).
    dtype: the activations' dtype; param_dtype: the parameters' (defaults to
      ``dtype``). impl, chunk_size: as for :func:`deltajax.gated_delta`.

  ``in_proj_qkvz`` holds, for each key head in turn, its q (K rows), k (K),
  its ``G = HV / H`` value heads' v (``G V``) and z (``G V``); ``in_proj_ba``
  holds each key head's ``G`` b rows, then its ``G`` a rows.
  """
  config = _config_dict(config)
  hidden, h, hv, dk, dv = _require(
      config, "hidden_size", "linear_num_key_heads", "linear_num_value_heads",
      "linear_key_head_dim", "linear_value_head_dim")
  if hv % h:
    raise ValueError(f"linear_num_value_heads={hv} must be a multiple of "
                     f"linear_num_key_heads={h}")
  g = hv // h
  arrays = _checked_arrays(state_dict, _qwen_shapes(config, {
      "in_proj_qkvz.weight": (2 * h * dk + 2 * hv * dv, hidden),
      "in_proj_ba.weight": (2 * hv, hidden)}))
  per_head = arrays.pop("in_proj_qkvz.weight").reshape(h, -1, hidden)
  q, k, v, z = np.split(per_head, np.cumsum([dk, dk, g * dv]), axis=1)
  b, a = np.split(arrays.pop("in_proj_ba.weight").reshape(h, 2 * g, hidden),
                  2, axis=1)
  rows = lambda w: w.reshape(-1, hidden)
  arrays.update(qkv=np.concatenate([rows(q), rows(k), rows(v)]), z=rows(z),
                b=rows(b), a=rows(a))
  return _gated_delta_net(config, arrays, options=_layer_options(
      dtype, param_dtype, impl, chunk_size))


def qwen3_5_layer(config, state_dict: Mapping[str, Any], *,
                  dtype=jnp.float32, param_dtype=None, impl: str = "auto",
                  chunk_size: int = 64) -> nn.GatedDeltaNet:
  """Qwen3.5's ``Qwen3_5GatedDeltaNet`` (also Qwen3.5-MoE's) as a :class:`deltajax.nn.GatedDeltaNet`.

  Args:
    config: ``Qwen3_5TextConfig``, ``Qwen3_5Config`` (its ``text_config`` is
      used) or their ``to_dict()``.
    state_dict: ``in_proj_qkv.weight``, ``in_proj_z.weight``,
      ``in_proj_b.weight``, ``in_proj_a.weight``, ``conv1d.weight``,
      ``dt_bias``, ``A_log``, ``norm.weight``, ``out_proj.weight``.
    dtype, param_dtype, impl, chunk_size: as for :func:`qwen3_next_layer`.
  """
  config = _config_dict(config)
  hidden, h, hv, dk, dv = _require(
      config, "hidden_size", "linear_num_key_heads", "linear_num_value_heads",
      "linear_key_head_dim", "linear_value_head_dim")
  arrays = _checked_arrays(state_dict, _qwen_shapes(config, {
      "in_proj_qkv.weight": (2 * h * dk + hv * dv, hidden),
      "in_proj_z.weight": (hv * dv, hidden),
      "in_proj_b.weight": (hv, hidden), "in_proj_a.weight": (hv, hidden)}))
  for name in ("qkv", "z", "b", "a"):
    arrays[name] = arrays.pop(f"in_proj_{name}.weight")
  return _gated_delta_net(config, arrays, options=_layer_options(
      dtype, param_dtype, impl, chunk_size))


def _kimi_config(config) -> tuple[int, int, int, int, float]:
  """``(hidden, H, K, conv width, eps)`` from a Kimi Linear config.

  transformers' ``KimiLinearConfig`` has ``linear_num_heads``,
  ``linear_head_dim``, ``linear_conv_kernel_dim``; the original checkpoints'
  ``config.json`` has them in ``linear_attn_config``.
  """
  config = _config_dict(config)
  _check_activation(config)
  nested = config.get("linear_attn_config") or {}
  for name, original in (("linear_num_heads", "num_heads"),
                         ("linear_head_dim", "head_dim"),
                         ("linear_conv_kernel_dim", "short_conv_kernel_size")):
    if config.get(name) is None and original in nested:
      config[name] = nested[original]
  return tuple(_require(config, "hidden_size", "linear_num_heads",
                        "linear_head_dim", "linear_conv_kernel_dim",
                        "rms_norm_eps"))


def _kimi_module_names(state_dict: Mapping[str, Any]) -> dict:
  """The original checkpoints' names -> ``KimiLinearDeltaAttention``'s.

  The checkpoints keep three convolutions (``q_conv1d``, ``k_conv1d``,
  ``v_conv1d``) and the forget gate's parameters at the top level.
  """
  renamed = dict(state_dict)
  convs = [f"{x}_conv1d.weight" for x in "qkv"]
  if all(name in renamed for name in convs):
    renamed["conv1d.weight"] = np.concatenate(
        [_to_numpy(renamed.pop(name)) for name in convs])
  for name in ("f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log"):
    if name in renamed:
      renamed[f"forget_gate.{name}"] = renamed.pop(name)
  return renamed


def kimi_linear_layer(config, state_dict: Mapping[str, Any], *,
                      dtype=jnp.float32, param_dtype=None, impl: str = "auto",
                      chunk_size: int = 64) -> nn.KimiDeltaAttention:
  """Kimi Linear's ``KimiLinearDeltaAttention`` as a :class:`deltajax.nn.KimiDeltaAttention`.

  Args:
    config: ``KimiLinearConfig``, its ``to_dict()`` or a checkpoint's
      ``config.json`` dict.
    state_dict: ``q_proj.weight``, ``k_proj.weight``, ``v_proj.weight``,
      ``conv1d.weight``, ``forget_gate.{f_a_proj.weight, f_b_proj.weight,
      dt_bias, A_log}``, ``b_proj.weight``, ``g_a_proj.weight``,
      ``g_b_proj.weight``, ``o_norm.weight``, ``o_proj.weight``; or the
      checkpoints' names (``q_conv1d.weight``, ..., ``f_a_proj.weight``, ...).
    dtype, param_dtype, impl, chunk_size: as for :func:`qwen3_next_layer`.

  The gate is ``-exp(A_log) softplus(f_b(f_a(x)) + dt_bias)`` per head and
  key channel, the output ``o_proj(o_norm(o) * sigmoid(g_b(g_a(x))))``.
  """
  hidden, h, dk, width, eps = _kimi_config(config)
  arrays = _checked_arrays(_kimi_module_names(state_dict), {
      "q_proj.weight": (h * dk, hidden), "k_proj.weight": (h * dk, hidden),
      "v_proj.weight": (h * dk, hidden),
      "conv1d.weight": (3 * h * dk, 1, width),
      "forget_gate.f_a_proj.weight": (dk, hidden),
      "forget_gate.f_b_proj.weight": (h * dk, dk),
      "forget_gate.dt_bias": (h * dk,), "forget_gate.A_log": (1, 1, h, 1),
      "b_proj.weight": (h, hidden), "g_a_proj.weight": (dk, hidden),
      "g_b_proj.weight": (h * dk, dk), "o_norm.weight": (dk,),
      "o_proj.weight": (hidden, h * dk)})
  layer = nn.KimiDeltaAttention(
      hidden, h, head_dim=dk, conv_size=width, norm_eps=eps, gate_rank=dk,
      output_gate_rank=dk, output_gate="sigmoid", l2_divide=True,
      rngs=nnx.Rngs(0), **_layer_options(dtype, param_dtype, impl,
                                         chunk_size))
  _assign(layer.qkv_proj.kernel, np.concatenate(
      [arrays[f"{x}_proj.weight"] for x in "qkv"]).T)
  _assign(layer.conv_kernel, _conv_kernel(arrays["conv1d.weight"]))
  for projection, names in ((layer.a_proj, ("forget_gate.f_a_proj",
                                            "forget_gate.f_b_proj")),
                            (layer.g_proj, ("g_a_proj", "g_b_proj"))):
    for linear, name in zip(projection.layers, names):
      _assign(linear.kernel, arrays[f"{name}.weight"].T)
  _assign(layer.dt_bias, arrays["forget_gate.dt_bias"].reshape(h, dk))
  _assign(layer.A_log, arrays["forget_gate.A_log"].reshape(h))
  _assign(layer.b_proj.kernel, arrays["b_proj.weight"].T)
  _assign(layer.o_norm.scale, arrays["o_norm.weight"])
  _assign(layer.o_proj.kernel, arrays["o_proj.weight"].T)
  return layer


# model_type -> the layer builder and the key that marks a linear-attention
# layer's parameters (Kimi Linear's full-attention layers are "self_attn" too).
_BUILDERS: dict[str, tuple[Callable, str, str]] = {
    "qwen3_next": (qwen3_next_layer, "linear_attn", "in_proj_qkvz.weight"),
    **{t: (qwen3_5_layer, "linear_attn", "in_proj_qkv.weight")
       for t in ("qwen3_5", "qwen3_5_text", "qwen3_5_moe",
                 "qwen3_5_moe_text")},
    "kimi_linear": (kimi_linear_layer, "self_attn", "b_proj.weight"),
}


def _safetensors_files(folder: pathlib.Path) -> list[pathlib.Path]:
  files = sorted(folder.glob("*.safetensors"))
  if not files:
    raise ValueError(f"no *.safetensors files in {folder}")
  return files


def _linear_attention_weights(folder: pathlib.Path, module: str
                              ) -> dict[int, dict[str, np.ndarray]]:
  """``{layer: {name: array}}`` for the keys ``...layers.N.<module>.<name>``.

  Reads only those tensors, file by file, with safetensors' numpy loader.
  """
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  layers: dict[int, dict[str, np.ndarray]] = {}
  for path in _safetensors_files(folder):
    with safe_open(str(path), framework="numpy") as f:
      for key in f.keys():
        match = _LAYER_KEY.match(key)
        if match and match.group(2) == module:
          layers.setdefault(int(match.group(1)), {})[match.group(3)] = (
              f.get_tensor(key))
  return layers


def linear_attention_layers(checkpoint_dir, dtype=jnp.float32, *,
                            param_dtype=None, impl: str = "auto",
                            chunk_size: int = 64) -> dict[int, nnx.Module]:
  """Every linear-attention layer of a Qwen3-Next, Qwen3.5 or Kimi Linear checkpoint.

  Args:
    checkpoint_dir: a folder with ``config.json`` and ``*.safetensors`` (as
      written by transformers' ``save_pretrained`` or downloaded from the
      Hub).
    dtype: the layers' activation dtype; param_dtype: their parameters'
      (defaults to ``dtype``). impl, chunk_size: as for
      :func:`deltajax.gated_delta`.

  Returns:
    ``{layer_index: layer}``, the layers whose parameters lie under
    ``model.layers.N.linear_attn.``, ``model.language_model.layers.N.
    linear_attn.`` or (Kimi Linear) ``model.layers.N.self_attn.``.
  """
  folder = pathlib.Path(checkpoint_dir)
  config = json.loads((folder / "config.json").read_text())
  model_type = config.get("model_type")
  if model_type not in _BUILDERS:
    raise ValueError(f"config.json has model_type {model_type!r}; supported: "
                     f"{sorted(_BUILDERS)}")
  build, module, marker = _BUILDERS[model_type]
  weights = _linear_attention_weights(folder, module)
  options = dict(dtype=dtype, param_dtype=param_dtype, impl=impl,
                 chunk_size=chunk_size)
  return {i: build(config, weights[i], **options) for i in sorted(weights)
          if marker in weights[i]}
