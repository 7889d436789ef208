"""Chunk-based low-precision accumulation, emulated: `chunked_dot(a, b, chunk_size=...,
accumulation_dtype=...)`.

A dot product accumulated in a narrow format loses small addends once the running sum is
large: an addend below half an ulp of the sum is rounded away entirely ("swamping"), and a
long same-sign sum stalls (4,096 ones added in float16 stop at 2,048). Wang et al. split the
sum into chunks, accumulate each chunk from zero, then add the chunk sums; every addition then
combines numbers of similar size, and 16-bit accumulators become usable for training (Wang,
Choi, Brand, Chen, Gopalakrishnan, "Training Deep Neural Networks with 8-bit Floating Point
Numbers", NeurIPS 2018, arXiv 1812.08011, section 3 "chunk-based accumulation", chunk length
64). Sakr et al. derive the accumulator precision each GEMM needs, with and without chunking
("Accumulation Bit-Width Scaling for Ultra-Low Precision Training of Deep Networks", ICLR
2019, arXiv 1901.06588).

`chunked_dot` computes `a @ b` (the last axis of `a` contracted with the first of `b`) as
those papers describe the arithmetic:

1. every product a_i * b_i is formed in float32 and rounded to `accumulation_dtype`;
2. within a chunk of `chunk_size` terms the products are added one after another, starting
   from zero, every partial sum rounded to `accumulation_dtype`;
3. the chunk sums are added one after another, in order, also rounded to
   `accumulation_dtype` after every addition (Wang et al. keep the inter-chunk sums in the
   same 16-bit format).

`chunk_size` equal to the contraction length (or None) is one chunk: plain, naive
low-precision accumulation. A contraction length that is not a multiple of `chunk_size` ends
with a shorter chunk (emulated as zero products, which leave a sum unchanged exactly).

Each addition is computed in float32 and rounded once to the accumulation format. For
float16 (11-bit significands) and bfloat16 (8-bit) that is the correctly rounded narrow sum:
double rounding through a format of p' >= 2p + 2 significand bits is innocuous for addition
(Figueroa, "When is double rounding innocuous?", SIGNUM Newsletter 30(3), 1995); float32 has
24 >= 2 * 11 + 2. Rounding uses the dtype cast, so float16 keeps gradual underflow (XLA's
`reduce_precision` would flush subnormals to zero).

This is an emulation for studying numerics, not a fast path: the additions run as a
`lax.scan` of `chunk_size` sequential steps (each adding one product to every chunk's partial
sum at once), then a scan over the chunks. It is jit-able and differentiable (the two
backward GEMMs, dx = g b^T and db = a^T g, are emulated the same way), and its memory is the
output's size times the number of chunks, never the M x K x N products at once. Expect it to
run one to two orders of magnitude slower than the platform's dot.
"""

import functools
import math

import jax
import jax.numpy as jnp

ACCUMULATION_DTYPES = ("float32", "float16", "bfloat16")


def _round_add(x: jax.Array, y: jax.Array, dtype) -> jax.Array:
    """x + y rounded once to `dtype` (x, y already in `dtype`; see the module docstring)."""
    return (x.astype(jnp.float32) + y.astype(jnp.float32)).astype(dtype)


def _emulated_matmul(a: jax.Array, b: jax.Array, chunk_size: int | None, dtype) -> jax.Array:
    """a [M, K] @ b [K, N] with the papers' accumulation; the result in `dtype`."""
    (rows, length), columns = a.shape, b.shape[1]
    chunk = length if chunk_size is None else min(chunk_size, length)
    num_chunks = -(-length // chunk)
    pad = num_chunks * chunk - length
    a = jnp.pad(a.astype(jnp.float32), ((0, 0), (0, pad)))
    b = jnp.pad(b.astype(jnp.float32), ((0, pad), (0, 0)))
    # Step j of the inner scan takes term j of every chunk: a [chunk, num_chunks, M] and
    # b [chunk, num_chunks, N], so all chunks accumulate side by side.
    a_steps = jnp.transpose(a.reshape(rows, num_chunks, chunk), (2, 1, 0))
    b_steps = jnp.transpose(b.reshape(num_chunks, chunk, columns), (1, 0, 2))

    def add_product(partial_sums, terms):
        a_j, b_j = terms
        products = (a_j[:, :, None] * b_j[:, None, :]).astype(dtype)  # formed in float32
        return _round_add(partial_sums, products, dtype), None

    zeros = jnp.zeros((num_chunks, rows, columns), dtype)
    chunk_sums, _ = jax.lax.scan(add_product, zeros, (a_steps, b_steps))

    def add_chunk(total, chunk_sum):
        return _round_add(total, chunk_sum, dtype), None

    total, _ = jax.lax.scan(add_chunk, jnp.zeros((rows, columns), dtype), chunk_sums)
    return total


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _matmul(a, b, chunk_size, dtype_name):
    out_dtype = jnp.promote_types(jnp.result_type(a, b), dtype_name)
    return _emulated_matmul(a, b, chunk_size, jnp.dtype(dtype_name)).astype(out_dtype)


def _matmul_fwd(a, b, chunk_size, dtype_name):
    return _matmul(a, b, chunk_size, dtype_name), (a, b)


def _matmul_bwd(chunk_size, dtype_name, residuals, g):
    # Wang et al. run all three GEMMs (forward, error, weight gradient) in the same
    # reduced-precision arithmetic; the weight gradient's contraction (over the batch) is the
    # longest and the most exposed to swamping.
    a, b = residuals
    da = _matmul(g.astype(a.dtype), b.T, chunk_size, dtype_name)
    db = _matmul(a.T, g.astype(b.dtype), chunk_size, dtype_name)
    return da.astype(a.dtype), db.astype(b.dtype)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def chunked_dot(
    a: jax.Array, b: jax.Array, *, chunk_size: int | None, accumulation_dtype
) -> jax.Array:
    """`a @ b` with chunk-based accumulation in `accumulation_dtype` (emulated).

    Args:
      a: [..., K].
      b: [K, ...].
      chunk_size: terms per chunk, a positive integer; None (or K) accumulates all K terms in
        one chunk, naive low-precision accumulation.
      accumulation_dtype: float32, float16 or bfloat16: the format every product and every
        partial sum is rounded to.

    Returns:
      a.shape[:-1] + b.shape[1:], the accumulated values exactly: in the operands' dtype
      promoted with `accumulation_dtype` (float16 operands, float32 accumulation: float32).

    References:
      Wang et al., NeurIPS 2018 (arXiv 1812.08011), section 3; Sakr et al., ICLR 2019
      (arXiv 1901.06588). The module docstring gives the exact arithmetic.
    """
    name = jnp.dtype(accumulation_dtype).name
    if name not in ACCUMULATION_DTYPES:
        raise ValueError(
            f"chunked_dot: accumulation_dtype={name!r}; valid: {list(ACCUMULATION_DTYPES)}"
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
    )
    return out.reshape(leading + trailing)


def parse_accumulation(spec: str) -> tuple[str, int | None] | None:
    """A model's `matmul_accumulation` setting: None for "float32" (the platform's own dot,
    which accumulates in float32), else (dtype, chunk_size or None) for "DTYPE" (one chunk:
    naive accumulation) or "DTYPE:chunk=N", DTYPE one of float32, float16, bfloat16."""
    if spec == "float32":
        return None
    name, _, option = spec.partition(":")
    chunk_size = None
    if option:
        key, _, value = option.partition("=")
        chunk_size = int(value) if key == "chunk" and value.isdigit() else 0
    if name not in ACCUMULATION_DTYPES or (option and not chunk_size):
        raise ValueError(
            f"matmul_accumulation={spec!r}; valid: 'float32' (the platform's dot), or DTYPE "
            f"(naive) or DTYPE:chunk=N (N > 0) for DTYPE in {list(ACCUMULATION_DTYPES)}, "
            f"e.g. 'float16:chunk=64'"
        )
    return name, chunk_size
