"""The model's weight matmuls in bfloat16: float32 accumulation, and XLA:CPU's fast path.

`matmul(a, b)` is `a @ b` for 2-D operands of one dtype. In bfloat16 on CPU it runs every
matmul of the forward and the backward pass as bf16 x bf16 -> f32, rounding the result to
bfloat16 once. That is the form XLA:CPU runs with the processor's bfloat16 dot-product
instructions (AVX512_BF16), at about twice its float32 rate (docs/performance.md); bf16 x
bf16 -> bf16, what a plain bfloat16 matmul asks for, runs no faster than float32. Two more
forms fall off that path, and the backward pass avoids both:

- a left operand contracted on its leading axis (every weight gradient, x^T g): XLA:CPU
  converts both operands to float32 for it. The backward pass transposes x in memory first.
- a transpose that XLA can fold into the matmul: it folds it, and the matmul is the form
  above again. `transpose_copy` splits the rows before transposing, which XLA keeps a copy.
  A right operand that is a transposed view (`b.T`) can also lose the fast path where XLA
  lays it out column-major (the MLM decoder's did): `matmul_nt(a, b)` copies it first.

On other platforms (GPU, TPU), and in float32, it is a plain `a @ b`.

`dense_dot_general` is the Dense layers' form of it. A training method can give the encoder
other matmuls (lambjax.models.encoder.LayerOptions).
"""

import math

import jax
import jax.numpy as jnp


def transpose_copy(x: jax.Array) -> jax.Array:
    """x.T [K, M] of a 2-D x, as a row-major copy that XLA does not fold into a matmul."""
    rows, columns = x.shape
    block = next((d for d in (8, 4, 2) if rows % d == 0), None)
    if block is None:  # odd rows: a plain transpose (correct, on XLA:CPU's float32 path)
        return x.T
    return jnp.transpose(x.reshape(rows // block, block, columns), (2, 0, 1)).reshape(columns, rows)


def _dot_f32(a: jax.Array, b: jax.Array, b_contracting_axis: int) -> jax.Array:
    """a [M, K] x b (contracted on `b_contracting_axis`) -> [M, N], accumulated in float32."""
    dimensions = (((1,), (b_contracting_axis,)), ((), ()))
    return jax.lax.dot_general(a, b, dimensions, preferred_element_type=jnp.float32)


@jax.custom_vjp
def _bf16_cpu_matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    return _dot_f32(a, b, 0).astype(a.dtype)


def _bf16_cpu_matmul_fwd(a, b):
    return _bf16_cpu_matmul(a, b), (a, b)


def _bf16_cpu_matmul_bwd(residuals, g):
    a, b = residuals
    da = _dot_f32(g, b, 1)  # g [M, N] b^T
    db = _dot_f32(transpose_copy(a), g, 0)  # a^T [K, M] g
    return da.astype(a.dtype), db.astype(b.dtype)


_bf16_cpu_matmul.defvjp(_bf16_cpu_matmul_fwd, _bf16_cpu_matmul_bwd)


def _check_operands(name: str, a: jax.Array, b: jax.Array) -> None:
    if a.ndim != 2 or b.ndim != 2 or a.dtype != b.dtype:
        raise ValueError(
            f"{name} takes two 2-D operands of one dtype; got {a.dtype}{list(a.shape)} and "
            f"{b.dtype}{list(b.shape)}"
        )


def matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [M, K] @ b [K, N] in the operands' dtype (see the module docstring)."""
    _check_operands("matmul", a, b)
    if a.dtype != jnp.bfloat16:
        return a @ b
    return jax.lax.platform_dependent(a, b, cpu=_bf16_cpu_matmul, default=jnp.matmul)


def matmul_nt(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [M, K] @ b [N, K]^T, like `matmul(a, b.T)`; on CPU in bfloat16 with b^T copied
    row-major first (see the module docstring)."""
    _check_operands("matmul_nt", a, b)
    if a.dtype != jnp.bfloat16:
        return a @ b.T
    return jax.lax.platform_dependent(
        a,
        b,
        cpu=lambda a, b: _bf16_cpu_matmul(a, transpose_copy(b)),
        default=lambda a, b: a @ b.T,
    )


def dense_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    """`lax.dot_general` for Flax's Dense layers: in bfloat16 on CPU, one `matmul`.

    The Dense form (the inputs' trailing axes contracted with the kernel's leading axes, no
    batch axes) is flattened to 2-D there; any other form, dtype or platform runs
    `lax.dot_general` unchanged.
    """

    def plain(lhs, rhs):
        return jax.lax.dot_general(
            lhs, rhs, dimension_numbers, precision, preferred_element_type=preferred_element_type
        )

    (lhs_contracting, rhs_contracting), batch = dimension_numbers
    count = len(lhs_contracting)
    dense_form = (
        batch == ((), ())
        and tuple(lhs_contracting) == tuple(range(lhs.ndim - count, lhs.ndim))
        and tuple(rhs_contracting) == tuple(range(count))
    )
    if not dense_form or preferred_element_type is not None or lhs.dtype != jnp.bfloat16:
        return plain(lhs, rhs)
    if rhs.dtype != lhs.dtype:
        raise ValueError(f"dense_dot_general: inputs {lhs.dtype}, kernel {rhs.dtype}")

    def on_cpu(lhs, rhs):
        leading, features = lhs.shape[: lhs.ndim - count], rhs.shape[count:]
        contracted = math.prod(rhs.shape[:count])
        out = _bf16_cpu_matmul(lhs.reshape(-1, contracted), rhs.reshape(contracted, -1))
        return out.reshape(leading + features)

    return jax.lax.platform_dependent(lhs, rhs, cpu=on_cpu, default=plain)
