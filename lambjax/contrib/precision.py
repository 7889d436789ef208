"""Chunk-based low-precision accumulation, emulated: `chunked_dot(a, b, chunk_size=...,
accumulation_dtype=..., operand_dtype=...)`.

A dot product accumulated in a narrow format loses small addends once the running sum is
large: an addend below half an ulp of the sum is rounded away entirely ("swamping"), and a
long same-sign sum stalls (4,096 ones added in float16 stop at 2,048). Wang et al. split the
sum into chunks, accumulate each chunk from zero, then add the chunk sums; every addition then
combines numbers of similar size, and 16-bit accumulators become usable for training (Wang,
Choi, Brand, Chen, Gopalakrishnan, "Training Deep Neural Networks with 8-bit Floating Point
Numbers", NeurIPS 2018, arXiv 1812.08011, section 3 "chunk-based accumulation", chunk length
64). Sakr et al. derive the accumulator precision each GEMM needs, with and without chunking
("Accumulation Bit-Width Scaling for Ultra-Low Precision Training of Deep Networks", ICLR
2019, arXiv 1901.06588); lambjax.contrib.variance_retention predicts the variance such sums keep.

`chunked_dot` computes `a @ b` (the last axis of `a` contracted with the first of `b`) as
those papers describe the arithmetic:

0. with `operand_dtype` (an 8-bit float: `float8_e5m2`, the papers' 1-5-2, or
   `float8_e4m3fn`), each operand is scaled by a power of two that brings its largest
   magnitude into [1, 2) and rounded to that format; the result is scaled back at the end
   (exactly: a power of two). The scaling keeps small values, errors and gradients above the
   format's underflow, the job loss scaling does in the papers, so that what is measured is
   the accumulation and not the 8-bit range;
1. every product a_i * b_i is formed in float32 (exact for 8-bit operands) and rounded to the
   accumulation format;
2. within a chunk of `chunk_size` terms the products are added one after another, starting
   from zero, every partial sum rounded to the accumulation format;
3. the chunk sums are added one after another, in order, also rounded to the accumulation
   format after every addition (Wang et al. keep the inter-chunk sums in the same 16-bit
   format).

The accumulation format is float32, float16, bfloat16, or `eXmY`: X exponent bits and Y
stored mantissa bits (with an implicit leading one), e.g. `e6m9`, Wang et al.'s 16-bit 1-6-9
accumulator. `eXmY` formats round with XLA's `reduce_precision`: round to nearest even, no
subnormals (a result below the smallest normal number, 2^(2 - 2^(X-1)), is flushed to
zero), overflow to infinity. float16 rounds with the dtype cast, which keeps its gradual
underflow.

`chunk_size` equal to the contraction length (or None) is one chunk: plain, naive
low-precision accumulation. A contraction length that is not a multiple of `chunk_size` ends
with a shorter chunk (emulated as zero products, which leave a sum unchanged exactly).

Each addition is computed in float32 and rounded once to the accumulation format. For
formats of at most 11 significand bits (float16, bfloat16, `eXmY` with Y <= 10) that is the
correctly rounded narrow sum: double rounding through a format of p' >= 2p + 2 significand
bits is innocuous for addition (Figueroa, "When is double rounding innocuous?", SIGNUM
Newsletter 30(3), 1995); float32 has 24 >= 2 * 11 + 2.

This is an emulation for studying numerics, not a fast path: the additions run as a
`lax.scan` of `chunk_size` sequential steps (each adding one product to every chunk's partial
sum at once), then a scan over the chunks. It is jit-able and differentiable (the two
backward GEMMs, dx = g b^T and db = a^T g, are emulated the same way, g in the operand format
too), and its memory is the output's size times the number of chunks, never the M x K x N
products at once. Expect it to run one to two orders of magnitude slower than the platform's
dot.
"""

import dataclasses
import functools
import math
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp

ACCUMULATION_DTYPES = ("float32", "float16", "bfloat16")  # and eXmY formats
OPERAND_DTYPES = ("float8_e5m2", "float8_e4m3fn")
MAX_MANTISSA_BITS = 10  # eXmY: where rounding a float32 sum once more is still exact
_CUSTOM = re.compile(r"e(\d+)m(\d+)")


@dataclasses.dataclass(frozen=True)
class Format:
    """An accumulation format: the dtype its values are held in and how a float32 value is
    rounded to it."""

    name: str
    storage: str  # the dtype values are held in between additions
    exponent_bits: int | None = None  # eXmY formats only
    mantissa_bits: int | None = None

    def round(self, x: jax.Array) -> jax.Array:
        """float32 `x` rounded to this format, held in `storage`."""
        if self.exponent_bits is None:
            return x.astype(self.storage)
        return jax.lax.reduce_precision(x, self.exponent_bits, self.mantissa_bits)


def accumulation_format(name: str) -> Format:
    """The format `name` names: float32, float16, bfloat16, or eXmY (2 <= X <= 8,
    1 <= Y <= 10), e.g. e6m9 for Wang et al.'s 1-6-9."""
    if name in ACCUMULATION_DTYPES:
        return Format(name, name)
    custom = _CUSTOM.fullmatch(name)
    if custom:
        exponent_bits, mantissa_bits = int(custom[1]), int(custom[2])
        if 2 <= exponent_bits <= 8 and 1 <= mantissa_bits <= MAX_MANTISSA_BITS:
            return Format(name, "float32", exponent_bits, mantissa_bits)
    raise ValueError(
        f"accumulation_dtype={name!r}; valid: {list(ACCUMULATION_DTYPES)} or eXmY with "
        f"2 <= X <= 8 exponent bits and 1 <= Y <= {MAX_MANTISSA_BITS} mantissa bits (e6m9: "
        f"the papers' 1-6-9)"
    )


def scale_to_unit(x: jax.Array) -> jax.Array:
    """The power of two that brings x's largest magnitude into [1, 2) (2 for all zeros,
    which stay zeros)."""
    _, exponent = jnp.frexp(jnp.max(jnp.abs(x)))  # max = m * 2^exponent, m in [0.5, 1)
    return jnp.ldexp(jnp.float32(1), 1 - exponent).astype(jnp.float32)


def quantize(x: jax.Array, operand_dtype: str | None) -> tuple[jax.Array, jax.Array]:
    """(x scaled and rounded to `operand_dtype`, in float32; the scale), or (x, 1)."""
    x = x.astype(jnp.float32)
    if operand_dtype is None:
        return x, jnp.float32(1)
    scale = scale_to_unit(x)
    return (x * scale).astype(operand_dtype).astype(jnp.float32), scale


def _round_add(x: jax.Array, y: jax.Array, fmt: Format) -> jax.Array:
    """x + y rounded once to `fmt` (x, y already in it; see the module docstring)."""
    return fmt.round(x.astype(jnp.float32) + y.astype(jnp.float32))


def _emulated_matmul(a, b, chunk_size: int | None, fmt: Format, operand_dtype) -> jax.Array:
    """a [M, K] @ b [K, N] with the papers' arithmetic; the result in float32."""
    (rows, length), columns = a.shape, b.shape[1]
    chunk = length if chunk_size is None else min(chunk_size, length)
    num_chunks = -(-length // chunk)
    pad = num_chunks * chunk - length
    a, a_scale = quantize(a, operand_dtype)
    b, b_scale = quantize(b, operand_dtype)
    a = jnp.pad(a, ((0, 0), (0, pad)))
    b = jnp.pad(b, ((0, pad), (0, 0)))
    # Step j of the inner scan takes term j of every chunk: a [chunk, num_chunks, M] and
    # b [chunk, num_chunks, N], so all chunks accumulate side by side.
    a_steps = jnp.transpose(a.reshape(rows, num_chunks, chunk), (2, 1, 0))
    b_steps = jnp.transpose(b.reshape(num_chunks, chunk, columns), (1, 0, 2))

    def add_product(partial_sums, terms):
        a_j, b_j = terms
        products = fmt.round(a_j[:, :, None] * b_j[:, None, :])  # formed in float32
        return _round_add(partial_sums, products, fmt), None

    zeros = jnp.zeros((num_chunks, rows, columns), fmt.storage)
    chunk_sums, _ = jax.lax.scan(add_product, zeros, (a_steps, b_steps))

    def add_chunk(total, chunk_sum):
        return _round_add(total, chunk_sum, fmt), None

    total, _ = jax.lax.scan(add_chunk, jnp.zeros((rows, columns), fmt.storage), chunk_sums)
    # One scale at a time: their product can leave float32's range where each does not.
    return total.astype(jnp.float32) / a_scale / b_scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _matmul(a, b, chunk_size, format_name, operand_dtype):
    fmt = accumulation_format(format_name)
    out_dtype = jnp.promote_types(jnp.result_type(a, b), fmt.storage)
    return _emulated_matmul(a, b, chunk_size, fmt, operand_dtype).astype(out_dtype)


def _matmul_fwd(a, b, chunk_size, format_name, operand_dtype):
    return _matmul(a, b, chunk_size, format_name, operand_dtype), (a, b)


def _matmul_bwd(chunk_size, format_name, operand_dtype, residuals, g):
    # Wang et al. run all three GEMMs (forward, error, weight gradient) in the same
    # reduced-precision arithmetic; the weight gradient's contraction (over the batch) is the
    # longest and the most exposed to swamping.
    a, b = residuals
    da = _matmul(g.astype(a.dtype), b.T, chunk_size, format_name, operand_dtype)
    db = _matmul(a.T, g.astype(b.dtype), chunk_size, format_name, operand_dtype)
    return da.astype(a.dtype), db.astype(b.dtype)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def chunked_dot(
    a: jax.Array,
    b: jax.Array,
    *,
    chunk_size: int | None,
    accumulation_dtype,
    operand_dtype: str | None = None,
) -> jax.Array:
    """`a @ b` with chunk-based accumulation in `accumulation_dtype` (emulated).

    Args:
      a: [..., K].
      b: [K, ...].
      chunk_size: terms per chunk, a positive integer; None (or K) accumulates all K terms in
        one chunk, naive low-precision accumulation.
      accumulation_dtype: float32, float16, bfloat16 or an eXmY format (e6m9: 1-6-9): the
        format every product and every partial sum is rounded to.
      operand_dtype: None (the operands as given), or float8_e5m2 / float8_e4m3fn: each
        operand scaled by a power of two and rounded to that format first.

    Returns:
      a.shape[:-1] + b.shape[1:], the accumulated values exactly: in the operands' dtype
      promoted with the format's storage dtype (float16 operands, float32 accumulation:
      float32; eXmY formats are held in float32).

    References:
      Wang et al., NeurIPS 2018 (arXiv 1812.08011), section 3; Sakr et al., ICLR 2019
      (arXiv 1901.06588). The module docstring gives the exact arithmetic.
    """
    name = accumulation_dtype if isinstance(accumulation_dtype, str) else None
    if name is None:
        name = jnp.dtype(accumulation_dtype).name
    try:
        accumulation_format(name)
    except ValueError as e:
        raise ValueError(f"chunked_dot: {e}") from None
    if operand_dtype is not None and operand_dtype not in OPERAND_DTYPES:
        raise ValueError(
            f"chunked_dot: operand_dtype={operand_dtype!r}; valid: None, {list(OPERAND_DTYPES)}"
        )
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0
    ):
        raise ValueError(
            f"chunked_dot: chunk_size={chunk_size!r} must be a positive integer or None"
        )
    if a.ndim < 1 or b.ndim < 1 or a.shape[-1] != b.shape[0]:
        raise ValueError(
            f"chunked_dot contracts a's last axis with b's first; got shapes {list(a.shape)} "
            f"and {list(b.shape)}"
        )
    leading, trailing, length = a.shape[:-1], b.shape[1:], a.shape[-1]
    out = _matmul(
        a.reshape(math.prod(leading), length),
        b.reshape(length, math.prod(trailing)),
        chunk_size,
        name,
        operand_dtype,
    )
    return out.reshape(leading + trailing)


class Accumulation(NamedTuple):
    """A parsed accumulation setting (lambjax.contrib.chunked_accumulation): chunked_dot's
    keyword arguments."""

    accumulation_dtype: str
    chunk_size: int | None
    operand_dtype: str | None = None


def parse_accumulation(spec: str) -> Accumulation | None:
    """An accumulation setting (`chunked_accumulation.setting`): None for "float32" (the
    platform's own dot, which accumulates in float32), else the emulation's settings for
    "FORMAT[:chunk=N][:operands=OPERAND]": FORMAT float32, float16, bfloat16 or eXmY; no
    chunk: naive accumulation; OPERAND float8_e5m2 or float8_e4m3fn (the papers' 8-bit
    products), e.g. "e6m9:chunk=64:operands=float8_e5m2"."""
    if spec == "float32":
        return None
    name, *options = spec.split(":")
    settings, valid = {}, True
    for option in options:
        key, _, value = option.partition("=")
        if key in settings or key not in ("chunk", "operands"):
            valid = False
        elif key == "chunk":
            valid &= value.isdigit() and int(value) > 0
            settings[key] = int(value) if value.isdigit() else 0
        else:
            valid &= value in OPERAND_DTYPES
            settings[key] = value
    try:
        accumulation_format(name)
    except ValueError:
        valid = False
    if not valid:
        raise ValueError(
            f"setting={spec!r}; valid: 'float32' (the platform's dot), or "
            f"FORMAT[:chunk=N][:operands=OPERAND] for FORMAT in {list(ACCUMULATION_DTYPES)} "
            f"or eXmY (X <= 8, Y <= {MAX_MANTISSA_BITS}), N > 0 (none: naive accumulation), "
            f"OPERAND in {list(OPERAND_DTYPES)}; e.g. 'float16:chunk=64', "
            f"'e6m9:chunk=64:operands=float8_e5m2'"
        )
    return Accumulation(name, settings.get("chunk"), settings.get("operands"))
