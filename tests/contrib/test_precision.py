"""lambjax.contrib.precision.chunked_dot against an independent NumPy emulation of the papers'
scheme and a float64 reference (Wang et al. 2018, arXiv 1812.08011; Sakr et al. 2019,
1901.06588), and the encoder running it through lambjax.contrib.chunked_accumulation."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from lambjax.contrib import chunked_accumulation, precision
from lambjax.models import encoder, matmul
from lambjax.models.config import BertConfig
from lambjax.models.encoder import LayerOptions
from lambjax.models.params import init_params
from tests.helpers import random_batch

NUMPY_DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}


def numpy_round(x, exponent_bits, mantissa_bits):
    """float64 values rounded to (1, exponent_bits, mantissa_bits): to nearest even, no
    subnormals (flushed to zero, as XLA's reduce_precision does), overflow to infinity."""
    fraction, exponent = np.frexp(np.asarray(x, np.float64))
    significand = np.rint(np.ldexp(fraction, mantissa_bits + 1))  # ties to even
    rounded = np.ldexp(significand, exponent - mantissa_bits - 1)
    max_exponent = 2 ** (exponent_bits - 1) - 1
    rounded = np.where(
        np.abs(rounded) >= 2.0 ** (max_exponent + 1), np.copysign(np.inf, rounded), rounded
    )
    return np.where(np.abs(rounded) < 2.0 ** (1 - max_exponent), 0.0, rounded)


def rounding(format_name):
    """float64 -> float64 rounding to an accumulation format, written in NumPy."""
    if format_name in NUMPY_DTYPES:
        dtype = NUMPY_DTYPES[format_name]
        return lambda x: np.asarray(x, np.float64).astype(dtype).astype(np.float64)
    exponent_bits, mantissa_bits = (int(v) for v in format_name[1:].split("m"))
    return lambda x: numpy_round(x, exponent_bits, mantissa_bits)


def numpy_quantize(x, operand_dtype):
    """x scaled by the power of two that puts its largest magnitude in [1, 2), rounded to
    the 8-bit format by ml_dtypes; (values, scale)."""
    x = np.asarray(x, np.float32).astype(np.float64)
    if operand_dtype is None:
        return x, 1.0
    scale = 2.0 ** -np.floor(np.log2(np.max(np.abs(x))))
    dtype = getattr(ml_dtypes, operand_dtype)
    return (x * scale).astype(dtype).astype(np.float64), scale


def numpy_chunked_dot(a, b, chunk_size, format_name, operand_dtype=None):
    """The scheme written out in NumPy: operands scaled and rounded to 8 bits (if asked),
    products rounded to the accumulator, each chunk summed term by term from zero, then the
    chunk sums term by term; every sum computed in float64 and rounded to the accumulator
    (innocuous double rounding for these formats)."""
    to_format = rounding(format_name)
    a, a_scale = numpy_quantize(a, operand_dtype)
    b, b_scale = numpy_quantize(b, operand_dtype)
    length = a.shape[1]
    chunk_size = chunk_size or length
    total = np.zeros((a.shape[0], b.shape[1]))
    for start in range(0, length, chunk_size):
        partial = np.zeros_like(total)
        for i in range(start, min(start + chunk_size, length)):
            product = to_format(np.outer(a[:, i], b[i]).astype(np.float32))
            partial = to_format(partial + product)
        total = to_format(total + partial)
    return total / (a_scale * b_scale)


def uniform(shape, seed, dtype=jnp.float16):
    return jnp.asarray(np.random.default_rng(seed).uniform(size=shape), dtype)


def relative_error(out, reference):
    return np.max(np.abs(np.asarray(out, np.float64) - reference) / np.abs(reference))


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("chunk_size", [None, 7, 64])  # 7: a short last chunk
def test_chunked_dot_equals_an_independent_emulation_bitwise(dtype_name, chunk_size):
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.normal(size=(3, 200)), jnp.float32)
    b = jnp.asarray(rng.normal(size=(200, 5)), jnp.float32)
    out = jax.jit(
        lambda a, b: precision.chunked_dot(
            a, b, chunk_size=chunk_size, accumulation_dtype=dtype_name
        )
    )(a, b)
    assert out.dtype == jnp.float32
    expected = numpy_chunked_dot(a, b, chunk_size, dtype_name)
    np.testing.assert_array_equal(np.asarray(out), expected.astype(np.float32))


@pytest.mark.parametrize("operand_dtype", ["float8_e5m2", "float8_e4m3fn"])
@pytest.mark.parametrize("chunk_size", [None, 7, 64])
def test_8_bit_operands_and_a_1_6_9_accumulator_equal_numpy_bitwise(operand_dtype, chunk_size):
    # Wang et al.'s arithmetic: 8-bit operands, products and sums in (1, 6, 9). Operands of
    # very different magnitudes (1e-4 and 30): the power-of-two scaling keeps both in range.
    rng = np.random.default_rng(5)
    a = jnp.asarray(1e-4 * rng.normal(size=(4, 300)), jnp.float32)
    b = jnp.asarray(30 * rng.normal(size=(300, 6)), jnp.float32)
    out = jax.jit(
        lambda a, b: precision.chunked_dot(
            a, b, chunk_size=chunk_size, accumulation_dtype="e6m9", operand_dtype=operand_dtype
        )
    )(a, b)
    assert out.dtype == jnp.float32
    expected = numpy_chunked_dot(a, b, chunk_size, "e6m9", operand_dtype)
    np.testing.assert_array_equal(np.asarray(out), expected.astype(np.float32))
    # The 8-bit rounding is the only loss against float64 beyond the accumulation's: within
    # the 1-5-2 format's relative precision (2^-3) per operand, far from the exact product.
    exact = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    assert 0 < np.max(np.abs(out - exact)) < 0.5 * np.max(np.abs(exact))


def test_the_numpy_1_6_9_rounding_matches_its_format():
    # 1 + 2^-10 is a tie: to even (1); 1 + 3 * 2^-10 rounds up to 1 + 2^-8; the smallest
    # normal number is 2^-30, below it values flush to zero; the largest is 2^31 (2 - 2^-9).
    largest = 2.0**31 * (2 - 2**-9)
    values = [1 + 2**-10, 1 + 3 * 2**-10, 2.0**-30, 0.75 * 2.0**-30, largest, 2.0**32]
    expected = [1.0, 1 + 2**-8, 2.0**-30, 0.0, largest, np.inf]
    np.testing.assert_array_equal(numpy_round(values, 6, 9), expected)
    jax_rounded = jax.lax.reduce_precision(jnp.asarray(values, jnp.float32), 6, 9)
    np.testing.assert_array_equal(np.asarray(jax_rounded, np.float64), expected)


def test_8192_ones_stall_at_1024_in_1_6_9_and_chunks_of_64_recover_them():
    ones = jnp.ones((1, 8192), jnp.float32)
    kwargs = dict(accumulation_dtype="e6m9", operand_dtype="float8_e5m2")
    naive = precision.chunked_dot(ones, ones.T, chunk_size=None, **kwargs)
    chunked = precision.chunked_dot(ones, ones.T, chunk_size=64, **kwargs)
    assert float(naive[0, 0]) == 1024.0  # 1024 + 1 is a tie, to even: 1024 (ulp 2)
    assert float(chunked[0, 0]) == 8192.0


def test_float32_accumulation_equals_a_float32_dot_to_rounding():
    rng = np.random.default_rng(1)
    a = jnp.asarray(rng.normal(size=(4, 6, 96)), jnp.float32)  # leading axes kept
    b = jnp.asarray(rng.normal(size=(96, 3, 2)), jnp.float32)
    out = precision.chunked_dot(a, b, chunk_size=16, accumulation_dtype="float32")
    assert out.shape == (4, 6, 3, 2)
    exact = np.tensordot(np.asarray(a, np.float64), np.asarray(b, np.float64), axes=1)
    np.testing.assert_allclose(out, jnp.tensordot(a, b, axes=1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out, exact, rtol=1e-5, atol=1e-5)


def test_ones_stall_at_2048_in_float16_and_chunks_of_64_recover_4096():
    ones = jnp.ones((1, 4096), jnp.float16)
    naive = precision.chunked_dot(ones, ones.T, chunk_size=None, accumulation_dtype="float16")
    chunked = precision.chunked_dot(ones, ones.T, chunk_size=64, accumulation_dtype="float16")
    assert float(naive[0, 0]) == 2048.0  # 2048 + 1 rounds back to 2048 (ulp 2)
    assert float(chunked[0, 0]) == 4096.0


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_chunks_of_64_cut_the_error_of_one_long_accumulation_severalfold(dtype_name):
    # All-positive terms, contraction 2,048: the running sum grows, so naive accumulation
    # swamps the later products (studies/chunked_accumulation/benchmark.py: 16x less error for
    # float16, 27x for bfloat16).
    a, b = uniform((16, 2048), 2), uniform((2048, 8), 3)
    exact = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    errors = {
        chunk: relative_error(
            precision.chunked_dot(a, b, chunk_size=chunk, accumulation_dtype=dtype_name), exact
        )
        for chunk in (None, 64, 1)
    }
    assert errors[None] > 5 * errors[64], errors
    # Chunks of one term are one sequential sum again: both ends of the papers' U-shape.
    assert errors[1] == errors[None], errors


def test_gradients_are_the_emulated_backward_gemms():
    rng = np.random.default_rng(4)
    a = jnp.asarray(rng.normal(size=(6, 40)), jnp.float32)
    b = jnp.asarray(rng.normal(size=(40, 5)), jnp.float32)
    g = jnp.asarray(rng.normal(size=(6, 5)), jnp.float32)

    def loss(a, b, dtype_name):
        out = precision.chunked_dot(a, b, chunk_size=8, accumulation_dtype=dtype_name)
        return jnp.sum(out * g)

    da, db = jax.grad(loss, argnums=(0, 1))(a, b, "float32")
    np.testing.assert_allclose(da, g @ b.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(db, a.T @ g, rtol=1e-5, atol=1e-5)
    da16, db16 = jax.grad(loss, argnums=(0, 1))(a, b, "float16")
    np.testing.assert_array_equal(da16, numpy_chunked_dot(g, b.T, 8, "float16"))
    np.testing.assert_array_equal(db16, numpy_chunked_dot(a.T, g, 8, "float16"))

    def loss8(a, b):  # the error g in 8 bits too, as Wang et al.'s backward GEMMs
        out = precision.chunked_dot(
            a, b, chunk_size=8, accumulation_dtype="e6m9", operand_dtype="float8_e5m2"
        )
        return jnp.sum(out * g)

    da8, db8 = jax.grad(loss8, argnums=(0, 1))(a, b)
    np.testing.assert_array_equal(da8, numpy_chunked_dot(g, b.T, 8, "e6m9", "float8_e5m2"))
    np.testing.assert_array_equal(db8, numpy_chunked_dot(a.T, g, 8, "e6m9", "float8_e5m2"))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(chunk_size=0, accumulation_dtype="float16"), "chunk_size=0"),
        (dict(chunk_size=8, accumulation_dtype="int8"), "accumulation_dtype='int8'"),
        (dict(chunk_size=8, accumulation_dtype="e6m12"), "accumulation_dtype='e6m12'"),
        (
            dict(chunk_size=8, accumulation_dtype="e6m9", operand_dtype="float8"),
            "operand_dtype='float8'",
        ),
    ],
)
def test_bad_arguments_get_one_line_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        precision.chunked_dot(jnp.ones((2, 3)), jnp.ones((3, 4)), **kwargs)
    with pytest.raises(ValueError, match=r"shapes \[2, 3\] and \[4, 4\]"):
        precision.chunked_dot(
            jnp.ones((2, 3)), jnp.ones((4, 4)), chunk_size=2, accumulation_dtype="float16"
        )


@pytest.mark.parametrize(
    "spec, parsed",
    [
        ("float32", None),
        ("float16", ("float16", None, None)),
        ("bfloat16:chunk=32", ("bfloat16", 32, None)),
        ("e6m9:chunk=64:operands=float8_e5m2", ("e6m9", 64, "float8_e5m2")),
        ("e6m9:operands=float8_e4m3fn", ("e6m9", None, "float8_e4m3fn")),
    ],
)
def test_accumulation_settings(spec, parsed):
    assert precision.parse_accumulation(spec) == parsed


@pytest.mark.parametrize(
    "spec",
    [
        "float8",
        "float16:chunk=0",
        "float16:chunks=64",
        "fp16",
        "e6m11",  # past the mantissa where one float32 sum rounds exactly
        "e9m9",
        "e6m9:operands=int8",
        "e6m9:chunk=64:chunk=32",
    ],
)
def test_bad_accumulation_settings_are_refused(spec):
    with pytest.raises(ValueError, match="valid: 'float32'"):
        precision.parse_accumulation(spec)


SMALL_BERT = BertConfig(
    vocab_size=128,
    hidden_size=32,
    num_layers=1,
    num_heads=2,
    intermediate_size=64,
    dtype="float32",
    scan_layers=False,
)


@functools.cache
def small_bert_params():
    # Jitted: eager initialisation runs op by op. The same parameters for every accumulation.
    return jax.jit(init_params, static_argnums=0)(SMALL_BERT, jax.random.key(0))


def encoder_states(accumulation: str) -> np.ndarray:
    """The encoder's last hidden states for one small batch (forward only: the backward
    GEMMs are checked on chunked_dot itself above; the model's forward is where the
    routing happens)."""
    options = chunked_accumulation.layer_options(accumulation)
    batch = random_batch(seq=16, batch=4)
    forward = jax.jit(functools.partial(encoder.encoder_outputs, SMALL_BERT, options=options))
    inputs = (batch["input_ids"], batch["segment_ids"], batch["input_mask"])
    states, _ = forward(small_bert_params(), *inputs)
    return np.asarray(states)


def test_the_encoder_routes_its_matmuls_through_chunked_dot():
    states = encoder_states("float32")
    # Emulated float32 accumulation is the float32 model to rounding; float16 sums round at
    # 11 bits: close to it, and not equal.
    np.testing.assert_allclose(encoder_states("float32:chunk=8"), states, rtol=1e-5, atol=1e-5)
    states16 = encoder_states("float16:chunk=8")
    np.testing.assert_allclose(states16, states, rtol=1e-2, atol=1e-2)
    assert np.max(np.abs(states16 - states)) > 1e-5


def test_a_dot_general_in_the_layer_options_runs_the_encoder_layers_matmuls():
    """The options' matmul replaces the config's in each layer's six Dense layers (query,
    key, value, attention output, intermediate, output), and only there."""
    kernels = []

    def recording(lhs, rhs, *args, **kwargs):
        kernels.append(rhs.shape)
        return matmul.dense_dot_general(lhs, rhs, *args, **kwargs)

    batch = random_batch(seq=16, batch=4)
    inputs = (batch["input_ids"], batch["segment_ids"], batch["input_mask"])
    options = LayerOptions(dot_general=recording)
    forward = jax.jit(functools.partial(encoder.encoder_outputs, SMALL_BERT, options=options))
    states, _ = forward(small_bert_params(), *inputs)
    np.testing.assert_array_equal(states, encoder_states("float32"))
    heads = (2, 16)
    assert sorted(kernels) == sorted([(32, *heads)] * 3 + [(*heads, 32), (32, 64), (64, 32)]), (
        kernels
    )
