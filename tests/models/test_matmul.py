import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lambjax.models import matmul, pretraining
from lambjax.models.config import BertConfig
from lambjax.models.params import init_params


def bf16_values(shape, seed):
    """A bfloat16 array and the same values in float64."""
    x = jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.bfloat16)
    return x, np.asarray(x, np.float64)


def dot_operand_types(hlo: str, output_dimension: int | None = None) -> list[tuple[str, str]]:
    """The element types of every dot's two operands in compiled HLO text (only the dots
    with an output dimension of that size, if given)."""
    found = []
    for computation in hlo.split("\n\n"):  # names are local to a computation
        types = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", computation))
        dots = re.findall(
            r"= \w+\[([\d,]*)\]\{[^}]*\} dot\(%([\w.\-]+), %([\w.\-]+)\)", computation
        )
        for shape, a, b in dots:
            if output_dimension is None or str(output_dimension) in shape.split(","):
                found.append((types[a], types[b]))
    return found


@pytest.mark.parametrize("rows", [32, 12, 6, 7])  # blocks of 8, 4, 2; odd rows: plain transpose
def test_bfloat16_matmul_and_its_gradients_match_float64(rows):
    (a, a64), (b, b64), (c, c64) = (
        bf16_values(shape, seed) for seed, shape in enumerate([(rows, 48), (48, 40), (rows, 40)])
    )

    def loss(a, b):  # c weights the output, so the output's gradient is c
        return jnp.sum(matmul.matmul(a, b).astype(jnp.float32) * c.astype(jnp.float32))

    out = matmul.matmul(a, b)
    da, db = jax.jit(jax.grad(loss, argnums=(0, 1)))(a, b)
    assert out.dtype == da.dtype == db.dtype == jnp.bfloat16
    # Accumulated in float32 and rounded once to bfloat16 (relative error <= 2^-8).
    for got, expected in ((out, a64 @ b64), (da, c64 @ b64.T), (db, a64.T @ c64)):
        np.testing.assert_allclose(np.asarray(got, np.float64), expected, rtol=2**-8, atol=1e-6)


def test_matmul_nt_is_matmul_with_the_right_operand_transposed():
    (a, a64), (b, b64), (c, c64) = (
        bf16_values(shape, seed) for seed, shape in enumerate([(16, 24), (40, 24), (16, 40)])
    )

    def loss(a, b):  # c weights the output, so the output's gradient is c
        return jnp.sum(matmul.matmul_nt(a, b).astype(jnp.float32) * c.astype(jnp.float32))

    da, db = jax.grad(loss, argnums=(0, 1))(a, b)
    out = matmul.matmul_nt(a, b)
    for got, expected in ((out, a64 @ b64.T), (da, c64 @ b64), (db, c64.T @ a64)):
        np.testing.assert_allclose(np.asarray(got, np.float64), expected, rtol=2**-8, atol=1e-6)
    a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
    np.testing.assert_array_equal(matmul.matmul_nt(a32, b32), a32 @ b32.T)


def test_float32_matmul_is_a_plain_matmul():
    a, b = jnp.ones((4, 3)), jnp.arange(6.0).reshape(3, 2)
    np.testing.assert_array_equal(matmul.matmul(a, b), a @ b)


def test_every_bfloat16_dot_of_forward_and_backward_keeps_bfloat16_operands():
    # On XLA:CPU a bf16 dot that XLA cannot run natively gets float32 operands (converted):
    # twice as slow. The weight gradient (a^T g) is the one that needs the transpose copy.
    a, b = jnp.ones((256, 64), jnp.bfloat16), jnp.ones((64, 96), jnp.bfloat16)

    def loss(a, b):
        return jnp.sum(jnp.sin(matmul.matmul(a, b).astype(jnp.float32)))

    hlo = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(a, b).compile().as_text()
    types = dot_operand_types(hlo)
    assert len(types) == 3, hlo  # forward, input gradient, weight gradient
    assert set(types) == {("bf16", "bf16")}, types


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dense_layers_through_dense_dot_general_match_lax(dtype):
    x = jax.random.normal(jax.random.key(0), (2, 5, 4, 6)).astype(dtype)

    def layer(dot_general):  # the attention output's form: two contracted axes
        return nn.DenseGeneral(8, axis=(-2, -1), dtype=dtype, dot_general=dot_general)

    params = layer(jax.lax.dot_general).init(jax.random.key(1), x)

    def loss(dot_general, params, x):
        return jnp.sum(layer(dot_general).apply(params, x).astype(jnp.float32) ** 2)

    ours = jax.value_and_grad(lambda p: loss(matmul.dense_dot_general, p, x))(params)
    reference = jax.value_and_grad(lambda p: loss(jax.lax.dot_general, p, x))(params)
    tolerance = 1e-6 if dtype == jnp.float32 else 2e-2
    for got, expected in zip(jax.tree.leaves(ours), jax.tree.leaves(reference), strict=True):
        np.testing.assert_allclose(got, expected, rtol=tolerance, atol=tolerance)


def test_matmul_rejects_operands_it_does_not_take():
    with pytest.raises(ValueError, match=r"2-D operands of one dtype; got float32\[2, 3, 4\]"):
        matmul.matmul(jnp.ones((2, 3, 4)), jnp.ones((4, 5)))
    with pytest.raises(ValueError, match="bfloat16"):
        matmul.matmul(jnp.ones((2, 3), jnp.bfloat16), jnp.ones((3, 5)))
    with pytest.raises(ValueError, match=r"matmul_nt takes .* float32\[5, 3, 1\]"):
        matmul.matmul_nt(jnp.ones((2, 3)), jnp.ones((5, 3, 1)))


@pytest.mark.slow
def test_the_mlm_decoder_and_its_gradients_keep_bfloat16_operands():
    # Given x.T as a transposed view, XLA:CPU laid it out column-major and ran the
    # decoder's forward and input-gradient products in float32.
    config = BertConfig.preset("tiny", vocab_size=1000, dtype="bfloat16")
    params = init_params(config, jax.random.key(0))
    rng = np.random.default_rng(0)
    batch = {
        "input_ids": jnp.asarray(rng.integers(5, 1000, (4, 32)), jnp.int32),
        "input_mask": jnp.ones((4, 32), jnp.int32),
        "segment_ids": jnp.zeros((4, 32), jnp.int32),
        "masked_lm_positions": jnp.tile(jnp.arange(1, 33, 4, dtype=jnp.int32), (4, 1)),
        "masked_lm_ids": jnp.asarray(rng.integers(5, 1000, (4, 8)), jnp.int32),
        "masked_lm_weights": jnp.ones((4, 8), jnp.float32),
        "next_sentence_labels": jnp.zeros((4,), jnp.int32),
    }

    def loss(params):
        return pretraining.pretraining_stats(config, params, batch)["mlm_loss_sum"]

    hlo = jax.jit(jax.value_and_grad(loss)).lower(params).compile().as_text()
    types = dot_operand_types(hlo, output_dimension=1000)  # the vocabulary axis
    assert len(types) == 2, types  # logits [V, 32 positions]; the embeddings' gradient
    assert set(types) == {("bf16", "bf16")}, types
