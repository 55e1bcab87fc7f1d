"""Shared plumbing for the Pallas kernels: launch config, lowering, dots, masks, block specs.

Every kernel is lowered through Triton (``pallas.triton.CompilerParams``), or
run in Pallas interpret mode when no GPU is present (slow; for tests). Whether
to interpret is decided once, by :meth:`Config.resolve` at the entry
point, and passed down (:class:`Dot`, :func:`call`).

Triton limits shape the kernels: power-of-two loads and stores, 2-D dots with
every dimension >= 16, no slicing of values (slice refs with ``pl.ds``), no
scratch buffers, no reverse cumsum.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

SUB = 16  # the smallest block a Triton dot accepts
MIN_CAPABILITY = (8, 0)


PRECISIONS = ("tf32x3", "tf32", "ieee")  # of float32 dots on the GPU


def _power_of_two(x, least: int) -> bool:
  return (isinstance(x, int) and not isinstance(x, bool) and x >= least
          and x & (x - 1) == 0)


@dataclasses.dataclass(frozen=True)
class Launch:
  """Launch knobs of one kernel. ``block_v``, ``block_k``: V columns or key
  channels per program (or per inner step), None for kernels without one (or
  all of them); ``num_stages=None``: chosen from the tile sizes (the forward
  scan).

  Raises:
    ValueError: ``num_warps`` is not a power of two, ``num_stages`` not
      None or a positive int, a block not None or a power of two >= 16 (the
      smallest Triton dot).
  """
  num_warps: int = 4
  num_stages: int | None = 1
  block_v: int | None = None
  block_k: int | None = None

  def __post_init__(self):
    if not _power_of_two(self.num_warps, 1):
      raise ValueError(f"Launch.num_warps must be a power of two; got "
                       f"{self.num_warps!r}")
    if self.num_stages is not None and not (
        isinstance(self.num_stages, int)
        and not isinstance(self.num_stages, bool) and self.num_stages >= 1):
      raise ValueError(f"Launch.num_stages must be None or a positive int; "
                       f"got {self.num_stages!r}")
    for name in ("block_v", "block_k"):
      value = getattr(self, name)
      if value is not None and not _power_of_two(value, SUB):
        raise ValueError(f"Launch.{name} must be None or a power of two >= "
                         f"{SUB}; got {value!r}")


@dataclasses.dataclass(frozen=True)
class Config:
  """``impl="pallas"``'s config: every launch knob of its kernels
  (``step``: the decoding step's; ``channel``: a per-channel gate's, where
  they differ), with the defaults tuned on the H200 (benchmarks/RESULTS.md,
  benchmarks/profile_kernels.py). Frozen and hashable: a static argument
  under ``jit`` (``deltajax.gated_delta(..., impl="pallas",
  config=Config(...))``).

  ``interpret``: None picks interpret mode exactly when the default backend
  is not a GPU; :meth:`resolve` fixes it once per call of the entry point.
  ``precision``: float32 dots on the GPU (:data:`PRECISIONS`), "tf32x3"
  (three TF32 passes, about float32 accuracy), "tf32" or "ieee"; interpret
  mode computes exactly.

  Raises:
    ValueError: a kernel's field is not a :class:`Launch`, ``channel``
      names no kernel, ``interpret`` is not None or a bool, ``precision``
      is not one of :data:`PRECISIONS`.
  """
  inverse: Launch = Launch(num_warps=1, num_stages=1)
  intra: Launch = Launch(num_warps=4, num_stages=1, block_k=64)
  forward_scan: Launch = Launch(num_warps=4, num_stages=None, block_v=64)
  output: Launch = Launch(num_warps=4, num_stages=1, block_v=128)
  w_u: Launch = Launch(num_warps=4, num_stages=1)
  output_backward: Launch = Launch(num_warps=4, num_stages=2, block_v=64)
  backward_scan: Launch = Launch(num_warps=8, num_stages=1, block_v=64)
  ut_backward: Launch = Launch(num_warps=4, num_stages=2, block_v=64,
                               block_k=64)
  intra_backward: Launch = Launch(num_warps=4, num_stages=1, block_k=64)
  step: Launch = Launch(num_warps=4, num_stages=1, block_v=32)
  # A per-channel (KDA) gate's launches where they differ: its [C, K] gate
  # tiles are worked on by blocks of key channels.
  channel: tuple[tuple[str, Launch], ...] = (
      ("ut_backward", Launch(num_warps=4, num_stages=2, block_v=64,
                             block_k=32)),)
  interpret: bool | None = None
  precision: str = "tf32x3"

  def __post_init__(self):
    kernels = KERNELS
    for name in kernels:
      if not isinstance(getattr(self, name), Launch):
        raise ValueError(f"Config.{name} must be a Launch; got "
                         f"{getattr(self, name)!r}")
    if not isinstance(self.channel, tuple) or not all(
        isinstance(x, tuple) and len(x) == 2 and x[0] in kernels
        and isinstance(x[1], Launch) for x in self.channel):
      raise ValueError(f"Config.channel must be a tuple of (kernel, Launch) "
                       f"pairs, the kernels among {kernels}; got "
                       f"{self.channel!r}")
    if self.interpret is not None and not isinstance(self.interpret, bool):
      raise ValueError(f"Config.interpret must be None or a bool; got "
                       f"{self.interpret!r}")
    if self.precision not in PRECISIONS:
      raise ValueError(f"Config.precision must be one of {PRECISIONS}; got "
                       f"{self.precision!r}")

  def launch(self, kernel: str, per_channel: bool) -> Launch:
    """The launch of ``kernel`` for a per-channel gate or a per-head one."""
    if per_channel and kernel in dict(self.channel):
      return dict(self.channel)[kernel]
    return getattr(self, kernel)

  def resolve(self) -> Config:
    """This config with ``interpret`` decided (raises on a GPU too old)."""
    if self.interpret is not None:
      return self
    return dataclasses.replace(self, interpret=interpret_mode())

  @property
  def dot(self) -> Dot:
    return Dot(interpret=bool(self.interpret), precision=self.precision)


# The kernels of :class:`Config`, each with a :class:`Launch`.
KERNELS = tuple(f.name for f in dataclasses.fields(Config)
                if f.name not in ("channel", "interpret", "precision"))


def padded_dim(d: int) -> int:
  """Head dims are padded with zeros to a power of two of at least ``SUB``."""
  return max(SUB, 1 << (d - 1).bit_length())


def gpu_capability() -> tuple[int, int] | None:
  """Compute capability of the default device, or None when it is not a GPU."""
  if jax.default_backend() != "gpu":
    return None
  cc = getattr(jax.devices()[0], "compute_capability", None)
  if cc is None:
    return None
  major, minor = str(cc).split(".")
  return int(major), int(minor)


def multiprocessors() -> int | None:
  """Streaming multiprocessors of the default GPU (None off the GPU)."""
  if jax.default_backend() != "gpu":
    return None
  return getattr(jax.devices()[0], "core_count", None)


def interpret_mode() -> bool:
  """Kernels run in interpret mode when there is no GPU; raise on an old GPU."""
  cc = gpu_capability()
  if jax.default_backend() != "gpu":
    return True
  if cc is not None and cc < MIN_CAPABILITY:
    raise ValueError(
        f"impl='pallas' needs an NVIDIA GPU of compute capability >= 8.0 for "
        f"Triton lowering; this one is {cc[0]}.{cc[1]}. Use impl='chunked' "
        f"(impl='auto' does so on this GPU).")
  return False


def call(kernel, *, grid, inputs, outputs, launch: Launch, interpret: bool,
         name: str, aliases=None, as_tuple=False, **static):
  """``pl.pallas_call`` through Triton (or interpreted), with named refs.

  Args:
    kernel: called as ``kernel(**refs, **static)``, one keyword per input and
      output; an input given as None arrives as None (an optional input: the
      kernel takes its static fast path).
    inputs: ``{name: (array or None, BlockSpec)}``.
    outputs: ``{name: (ShapeDtypeStruct, BlockSpec)}``.
    aliases: ``{input name: output name}``: the output is written into the
      input's buffer (``input_output_aliases``; same shape and dtype).
    as_tuple: a tuple even for one output.

  Returns:
    the outputs, in the order of ``outputs`` (a tuple when there are several,
    or ``as_tuple``).
  """
  present = [n for n, (x, _) in inputs.items() if x is not None]
  absent = {n: None for n, (x, _) in inputs.items() if x is None}
  out_names = list(outputs)

  def body(*refs):
    kernel(**dict(zip(present + out_names, refs)), **absent, **static)

  one = len(out_names) == 1
  out_specs = [outputs[n][1] for n in out_names]
  out_shape = [outputs[n][0] for n in out_names]
  fn = pl.pallas_call(
      body, grid=grid, in_specs=[inputs[n][1] for n in present],
      out_specs=out_specs[0] if one else out_specs,
      out_shape=out_shape[0] if one else out_shape,
      interpret=interpret, name=name,
      input_output_aliases={present.index(i): out_names.index(o)
                            for i, o in (aliases or {}).items()},
      compiler_params=None if interpret else pl_triton.CompilerParams(
          num_warps=launch.num_warps, num_stages=launch.num_stages))
  with warnings.catch_warnings():
    # JAX 0.11 deprecates the Triton lowering of pallas_call in favour of
    # Mosaic GPU; deltajax asks for it explicitly.
    warnings.filterwarnings("ignore", category=DeprecationWarning,
                            message=".*[Tt]riton.*")
    result = fn(*[inputs[n][0] for n in present])
  if one:
    return (result,) if as_tuple else result
  return tuple(result)


def block(*shape):
  """A BlockSpec whose ``None`` entries are squeezed dimensions."""
  def spec(index_map):
    return pl.BlockSpec(tuple(pl.squeezed if d is None else d for d in shape),
                        index_map)
  return spec


def qk_head(j, groups: int):
  """The q/k head that value head ``j`` reads (GVA: ``j // groups``)."""
  return j if groups == 1 else j // groups


def accumulator(dtype):
  """float32, or float64 for float64 inputs."""
  return jnp.promote_types(dtype, jnp.float32)


@dataclasses.dataclass(frozen=True)
class Dot:
  """2-D matrix products with float32 accumulation (float64 for float64).

  16-bit operands use the tensor cores as they are. On the GPU, float32
  operands use ``precision`` (see :class:`Config`); in interpret mode
  every product is computed exactly (``Precision.HIGHEST``).
  """
  interpret: bool
  precision: str = "tf32x3"

  def __call__(self, a, b, *, trans_a=False, trans_b=False, precision=None):
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    algorithm = lax.Precision.HIGHEST
    if a.dtype == jnp.float32 and not self.interpret:
      algorithm = {"tf32x3": lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
                   "tf32": lax.DotAlgorithmPreset.TF32_TF32_F32,
                   "ieee": lax.Precision.HIGHEST}[precision or self.precision]
    return lax.dot_general(a, b, dims, precision=algorithm,
                           preferred_element_type=accumulator(a.dtype))

  def of_float32(self, dtype):
    """Products of float32 values formed from ``dtype`` inputs: one TF32
    pass for 16-bit inputs (whose own rounding is coarser), ``precision``
    otherwise."""
    low = jnp.dtype(dtype).itemsize < 4
    return lambda a, b, **kw: self(a, b, precision="tf32" if low else None,
                                   **kw)

  def split(self, dtype):
    """Like :meth:`of_float32`, but for 16-bit inputs three bf16 passes:
    each float32 operand split into its bf16 rounding and the bf16 rounding
    of the rest (16 mantissa bits), the product of the rests dropped: for
    the output kernel, where one TF32 pass of the same ``[C, C] x [C, V]``
    product spilled registers (faster on the H200: benchmarks/RESULTS.md)."""
    if jnp.dtype(dtype).itemsize >= 4 or self.interpret:
      return self.of_float32(dtype)

    def halves(x):
      high = x.astype(jnp.bfloat16)
      return high, (x - high.astype(x.dtype)).astype(jnp.bfloat16)

    def product(a, b, **kw):
      (a_hi, a_lo), (b_hi, b_lo) = halves(a), halves(b)
      return (self(a_hi, b_hi, **kw) + self(a_lo, b_hi, **kw)
              + self(a_hi, b_lo, **kw))
    return product


def blocks(size: int, block: int):
  """Static ref slices ``pl.ds`` covering ``range(size)`` in steps of ``block``."""
  block = min(size, block)
  return [pl.ds(i, block) for i in range(0, size, block)]


def iota(shape, axis):
  return lax.broadcasted_iota(jnp.int32, shape, axis)


def causal(c: int, *, strict: bool):
  """``[c, c]`` boolean mask: ``j < i`` (strict) or ``j <= i``."""
  i, j = iota((c, c), 0), iota((c, c), 1)
  return i > j if strict else i >= j


def last(x):
  """The last entry of ``x [C]`` (the last row ``[K]`` of ``x [C, K]``),
  without slicing a value."""
  return jnp.sum(jnp.where(iota(x.shape, 0) == x.shape[0] - 1, x, 0), axis=0)


def rows_of(x, i: int):
  """Rows ``16 i .. 16 i + 15`` of a value ``x [C, D]``: ``[16, D]`` (no
  slicing of values in Triton: a masked sum)."""
  n = x.shape[0] // SUB
  x = x.reshape(n, SUB, x.shape[1])
  return jnp.sum(jnp.where(iota(x.shape, 0) == i, x, 0), axis=0)


def cols_of(x, j: int):
  """Columns ``16 j .. 16 j + 15`` of a value ``x [16, C]``: ``[16, 16]``."""
  n = x.shape[1] // SUB
  x = x.reshape(SUB, n, SUB)
  return jnp.sum(jnp.where(iota(x.shape, 1) == j, x, 0), axis=1)


def place_rows(tiles, n: int):
  """``[16 n, D]`` from row tiles ``{i: [16, D]}`` (absent tiles are 0)."""
  d = next(iter(tiles.values())).shape[1]
  which = iota((n, SUB, d), 0)
  full = sum(jnp.where(which == i, x[None], 0) for i, x in tiles.items())
  return full.reshape(n * SUB, d)


def reverse_cumsum(x, dot: Dot):
  """``y_i = sum_{j >= i} x_j`` over the rows of ``x [C]`` or ``[C, K]`` (no
  reverse cumsum in Triton: a masked sum, for ``[C, K]`` a product with the
  upper triangle of ones).

  On the GPU a float32 ``x`` goes through the bf16 tensor cores in three
  passes: x split into three bf16 pieces of 8 mantissa bits each (24 in
  all), the ones exact, float32 accumulation (faster on the H200 than one
  exact CUDA-core product: benchmarks/RESULTS.md)."""
  c = x.shape[0]
  rows, cols = iota((c, c), 0), iota((c, c), 1)
  if x.ndim == 1:
    return jnp.sum(jnp.where(cols >= rows, x[None, :], 0), axis=1)
  if dot.interpret or x.dtype != jnp.float32:
    return dot(jnp.where(cols >= rows, 1, 0).astype(x.dtype), x,
               precision="ieee")
  upper = jnp.where(cols >= rows, 1, 0).astype(jnp.bfloat16)
  y, rest = 0, x
  for _ in range(3):
    piece = rest.astype(jnp.bfloat16)
    y += dot(upper, piece)
    rest = rest - piece.astype(x.dtype)
  return y


# A gate of width W in {1, K}: g is ``[C]`` (scalar gate, one decay per
# token) or ``[C, K]`` (per channel); cut counts are per token, ``[C]``. The
# helpers below let one kernel body serve both widths; for W = 1 they do
# exactly the scalar gate's work.


def per_channel(g) -> bool:
  """Whether the chunk's gate ``g`` (``[C]`` or ``[C, K]``) is per channel."""
  return len(g.shape) == 2


def on_keys(e, rows=None):
  """A per-token decay ``e`` (``[C]`` or ``[C, K]``), times the per-token
  ``rows [C]`` (or None), as a factor of ``[C, K]`` key rows."""
  if e.ndim == 1:
    return (e if rows is None else rows * e)[:, None]
  return e if rows is None else rows[:, None] * e


def on_state(e):
  """The chunk's state decay (a scalar, or ``[K]`` per channel) as a factor
  of the ``[K, V]`` state."""
  return e if e.ndim == 0 else e[:, None]


def key_sum(x, g):
  """``x [C, K]`` summed over K for a scalar gate ``g``; ``x`` as is for a
  per-channel one (a gate cotangent reduced to the gate's width)."""
  return x if per_channel(g) else jnp.sum(x, axis=-1)


def gate_total(x, g, keys_axis: int):
  """``x`` summed to the chunk-end gate's width: over every axis for a
  scalar gate g (a scalar), over all but ``keys_axis`` per channel (``[K]``)."""
  if not per_channel(g):
    return jnp.sum(x)
  return jnp.sum(x, axis=tuple(a for a in range(x.ndim) if a != keys_axis))


def decayed_dot(e, k, s, dot: Dot):
  """``(K * e) S`` for keys ``k [C, K]``, ``s [K, V]``: the decay ``e`` of
  :func:`on_keys` applied after the product for a scalar gate, to the keys
  (in k's dtype) for a per-channel one."""
  if e.ndim == 1:
    return e[:, None] * dot(k, s.astype(k.dtype))
  return dot((k * e).astype(k.dtype), s.astype(k.dtype))


def decayed_dot_t(e, k, x, dot: Dot):
  """``(K * e)^T X`` for ``k [C, K]``, ``x [C, V]``, like :func:`decayed_dot`."""
  if e.ndim == 1:
    return dot(k, (x * e[:, None]).astype(k.dtype), trans_a=True)
  return dot((k * e).astype(k.dtype), x.astype(k.dtype), trans_a=True)


def gate_spec(g, rows: int, index_map):
  """BlockSpec of the cumulative gate ``g``: ``[B, HV, T]`` (``rows`` tokens
  at ``index_map``'s block) or ``[B, HV, T, K]`` (the same tokens, every key
  channel)."""
  if g.ndim == 3:
    return block(None, None, rows)(index_map)
  return block(None, None, rows, g.shape[-1])(
      lambda *idx: (*index_map(*idx), 0))


# Masked decays. Within a chunk, g is the cumulative log gate and c the
# cumulative count of cuts (a cut discards the state carried into its token),
# both chunk-local; c is None when there are no cuts, and then these are the
# plain exponentials (no extra work). A decay spanning a cut is 0: the mask is
# applied to the exponent, before exp (above the diagonal the difference is
# positive and can overflow).


def masked_exp(x, mask):
  """``exp(x)`` where ``mask``, else 0, masked before ``exp``."""
  return jnp.exp(jnp.where(mask, x, -jnp.inf))


def _like(c, g):
  """Cut counts ``[C]`` broadcast against a gate ``[C]`` or ``[C, K]``."""
  return c if c.ndim == g.ndim else c[:, None]


def decay(g_i, g_j, mask, c_i=None, c_j=None):
  """``[C_i, C_j]``: ``exp(g_i - g_j)`` on ``mask`` where ``c_i == c_j``, else 0
  (a scalar gate).

  ``mask`` may be a Python bool (True: no causal mask, a block below the
  diagonal).
  """
  if c_i is not None:
    mask = mask & (c_i[:, None] == c_j[None, :])
  return masked_exp(g_i[:, None] - g_j[None, :], mask)


def from_start(g, c=None):
  """``[C]`` (``[C, K]`` per channel): the decay from the chunk's entry state
  to each token, ``exp(g)``; 0 from the first cut on."""
  if c is None:
    return jnp.exp(g)
  return masked_exp(g, _like(c == 0, g))


def to_end(g, g_end, c=None, c_end=None):
  """``[C]`` (``[C, K]``): the decay from each token to the chunk's end,
  ``exp(g_C - g)``; 0 for tokens before the chunk's last cut."""
  if c is None:
    return jnp.exp(g_end - g)
  return masked_exp(g_end - g, _like(c == c_end, g))


def over_chunk(g_end, c_end=None):
  """Scalar (``[K]``): the entry state's decay over the chunk, ``exp(g_C)``;
  0 when the chunk has a cut."""
  if c_end is None:
    return jnp.exp(g_end)
  return jnp.where(c_end == 0, jnp.exp(g_end), 0)
