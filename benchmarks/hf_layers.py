"""Real-model linear-attention layers on the GPU: deltajax.hf against transformers (+ fla).

    python -m benchmarks.hf_layers [--lengths 4096 32768] [--reps 10]
        [--models qwen3_next kimi_linear] [--impl auto] [--no-torch]

A Qwen3-Next-80B-sized Gated DeltaNet layer (hidden 2048, 16 key heads, 32
value heads, d 128) and a Kimi-Linear-sized KDA layer (hidden 2304, 32
heads, d 128), bf16, B = 1: forward and forward+backward of transformers'
module (its fla fast path when fla is installed) and of the deltajax layer
built from the same weights by ``deltajax.hf`` (under ``jax.jit``), timed
the same way (``benchmark.median_ms``), the relative RMS difference of
their outputs, and decoding time per token (deltajax: one-token calls with
the cache, jitted).
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.benchmark import median_ms
from deltajax import hf

MODELS = {
    "qwen3_next": dict(hidden_size=2048, linear_num_key_heads=16,
                       linear_num_value_heads=32, linear_key_head_dim=128,
                       linear_value_head_dim=128, linear_conv_kernel_dim=4,
                       num_experts=0),
    "kimi_linear": dict(hidden_size=2304, linear_num_heads=32,
                        linear_head_dim=128, linear_conv_kernel_dim=4,
                        num_key_value_heads=32, kv_lora_rank=16,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                        mlp_layer_types=["dense"], num_hidden_layers=1),
}


def torch_module(name, torch, transformers):
  """transformers' layer (CUDA, bf16), seeded, and the config's dict."""
  torch.manual_seed(0)
  if name == "qwen3_next":
    config = transformers.Qwen3NextConfig(**MODELS[name])
    module = (transformers.models.qwen3_next.modeling_qwen3_next
              .Qwen3NextGatedDeltaNet(config, 0))
  else:
    config = transformers.KimiLinearConfig(**MODELS[name])
    module = (transformers.models.kimi_linear.modeling_kimi_linear
              .KimiLinearDeltaAttention(config, 0))
    initialise_kimi_gate(torch, module.forget_gate)
  return module.to("cuda", torch.bfloat16), config.to_dict()


def initialise_kimi_gate(torch, gate):
  """Kimi's gate parameters as its model's init sets them (the bare module
  leaves ``A_log`` and ``dt_bias`` as ``torch.empty``: values up to 1e38
  that made transformers' output NaN): rates ``exp(A_log)`` uniform in
  [1, 16], ``softplus(dt_bias)`` log-uniform in [1e-3, 0.1]."""
  with torch.no_grad():
    gate.A_log.copy_(torch.empty_like(gate.A_log).uniform_(1, 16).log())
    dt = torch.empty_like(gate.dt_bias).uniform_(-6.9078, -2.3026).exp()
    gate.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))


def time_torch(torch, module, x, dy, reps):
  x = torch.tensor(x, device="cuda", dtype=torch.bfloat16, requires_grad=True)
  dy = torch.tensor(dy, device="cuda", dtype=torch.bfloat16)
  sync = lambda _: torch.cuda.synchronize()
  with torch.no_grad():
    y = module(x).float().cpu().numpy()
    t_fwd = median_ms(lambda: module(x), reps, sync)
  t_bwd = median_ms(lambda: module(x).backward(dy), reps, sync)
  return t_fwd, t_bwd, y


def time_deltajax(layer, x, dy, reps):
  x, dy = jnp.asarray(x, jnp.bfloat16), jnp.asarray(dy, jnp.bfloat16)
  graph, params = nnx.split(layer)
  fwd = jax.jit(lambda p, x: nnx.merge(graph, p)(x))
  loss = lambda p, x: jnp.sum(nnx.merge(graph, p)(x).astype(jnp.float32)
                              * dy.astype(jnp.float32))
  fwd_bwd = jax.jit(jax.grad(loss, argnums=(0, 1)))
  y = np.asarray(fwd(params, x), np.float32)
  return (median_ms(lambda: fwd(params, x), reps),
          median_ms(lambda: fwd_bwd(params, x), reps), y)


def decode_us(layer, hidden, steps=64):
  graph, params = nnx.split(layer)
  tokens = jnp.asarray(np.random.default_rng(2).standard_normal(
      (steps, 1, 1, hidden)), jnp.bfloat16)

  @jax.jit
  def decode(params, cache):
    def step(cache, token):
      y, cache = nnx.merge(graph, params)(token, cache=cache)
      return cache, y[0, 0, 0]
    return jax.lax.scan(step, cache, tokens)

  cache = layer.init_cache(1)
  return median_ms(lambda: decode(params, cache), 10) * 1e3 / steps


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--lengths", nargs="*", type=int, default=(4096, 32768))
  parser.add_argument("--reps", type=int, default=10)
  parser.add_argument("--models", nargs="*", default=tuple(MODELS))
  parser.add_argument("--impl", default="auto",
                      help="the rule's implementation in the deltajax layers "
                      "(e.g. pallas: KDA's kernels, which auto does not take "
                      "yet)")
  parser.add_argument("--no-torch", action="store_true",
                      help="time deltajax only (transformers builds the "
                      "weights)")
  args = parser.parse_args()
  import torch
  import transformers
  try:  # fla's GDN backward refuses Hopper with Triton < 3.7.1 (its #640);
    import fla.ops.common.chunk_o  # timing only
    fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1 = True
  except ImportError:
    pass
  print(f"jax {jax.__version__}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, {jax.devices()[0].device_kind}")
  print("| layer | T | transformers fwd / fwd+bwd ms | deltajax fwd / fwd+bwd "
        "ms | deltajax / transformers | y rel. RMS |\n|---|---|---|---|---|---|")
  for name in args.models:
    module, config = torch_module(name, torch, transformers)
    state = {k: v.float().cpu().numpy() for k, v in module.state_dict().items()}
    build = hf.qwen3_next_layer if name == "qwen3_next" else hf.kimi_linear_layer
    layer = build(config, state, dtype=jnp.bfloat16, impl=args.impl)
    hidden = MODELS[name]["hidden_size"]
    # deltajax first, so that its numbers survive a time limit reached while
    # fla compiles and tunes for a new shape.
    print(f"{name}: deltajax decoding {decode_us(layer, hidden):.1f} us/token",
          file=sys.stderr, flush=True)
    for t in args.lengths:
      rng = np.random.default_rng(t)
      x, dy = (rng.standard_normal((1, t, hidden)).astype(np.float32)
               for _ in range(2))
      got = time_deltajax(layer, x, dy, args.reps)
      print(f"{name} T={t}: deltajax {got[0]:.2f} / {got[1]:.2f} ms",
            file=sys.stderr, flush=True)
      if args.no_torch:
        continue
      ref = time_torch(torch, module, x, dy, args.reps)
      err = float(np.linalg.norm(got[2] - ref[2]) / np.linalg.norm(ref[2]))
      print(f"| {name} | {t} | {ref[0]:.2f} / {ref[1]:.2f} | {got[0]:.2f} / "
            f"{got[1]:.2f} | {got[0] / ref[0]:.2f} / {got[1] / ref[1]:.2f} | "
            f"{err:.1e} |", flush=True)

if __name__ == "__main__":
  main()
