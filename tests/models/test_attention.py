"""The attention forms against the einsum form (forward and gradients, with padding and
packing, at sequence 128 and 512), the choice of form per platform, and the train step
lowered for CUDA (cuDNN) and TPU (splash) on this CPU host."""

import contextlib
import functools
import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax._src.cudnn import fused_attention_stablehlo

from lambjax import sharding
from lambjax.models import attention
from lambjax.models.config import BertConfig
from lambjax.models.params import init_params, param_logical_axes
from lambjax.train import state as state_lib
from lambjax.train import step as step_lib
from lambjax.train.config import optimizer_config
from lambjax.train.optimizer import make_optimizer
from lambjax.train.state import TrainState
from tests.helpers import random_batch

HEADS, HEAD_DIM = 2, 16


def qkv(seq, batch=2, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    shape = (batch, seq, HEADS, HEAD_DIM)
    return tuple(jax.random.normal(k, shape, jnp.float32) for k in keys)


def right_padded(seq, lengths):
    """The input mask of rows with `lengths` real tokens first."""
    return (np.arange(seq)[None] < np.asarray(lengths)[:, None]).astype(np.int32)


def packed_segments(seq, example_lengths):
    """Segment ids of rows packing examples of the given lengths (1, 2, ...; 0 = padding)."""
    rows = []
    for lengths in example_lengths:
        row = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)])
        rows.append(np.pad(row, (0, seq - len(row))))
    return np.stack(rows).astype(np.int32)


def einsum_attention(q, k, v, mask):
    return attention.xla_attention(q, k, v, mask, dropout=lambda w: w)


def cudnn_semantics(q, k, v, mask):
    return attention.cudnn_attention(q, k, v, mask, implementation="xla")


def splash_interpreted(q, k, v, mask):
    return attention.splash_attention(q, k, v, mask, interpret=True)


def value_and_grads(form, q, k, v, mask, real):
    """The outputs on real tokens and the gradients of a fixed random projection of them."""
    cotangent = jax.random.normal(jax.random.key(9), q.shape)

    def loss(q, k, v):
        out = form(q, k, v, mask)
        return jnp.sum(out * cotangent * real[:, :, None, None]), out

    value_and_grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
    (_, out), grads = jax.jit(value_and_grad)(q, k, v)
    return out * real[:, :, None, None], grads


@pytest.mark.parametrize("form", [cudnn_semantics, splash_interpreted], ids=["cudnn", "splash"])
@pytest.mark.parametrize("seq,lengths", [(128, [128, 77]), (512, [375, 512])])
def test_padded_attention_matches_einsum(form, seq, lengths):
    q, k, v = qkv(seq)
    input_mask = right_padded(seq, lengths)
    mask = attention.AttentionMask.from_input_mask(jnp.asarray(input_mask))
    real = jnp.asarray(input_mask, jnp.float32)
    want_out, want_grads = value_and_grads(einsum_attention, q, k, v, mask, real)
    out, grads = value_and_grads(form, q, k, v, mask, real)
    np.testing.assert_allclose(out, want_out, atol=2e-5)
    for got, want in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(got, want, atol=2e-5)


@pytest.mark.parametrize(
    "form", [einsum_attention, cudnn_semantics, splash_interpreted], ids=["xla", "cudnn", "splash"]
)
def test_packed_rows_attend_within_each_example(form):
    """A row packing examples of 50, 40 and 30 tokens gives each example the attention it
    gets alone in its own right-padded row."""
    seq, lengths = 128, [50, 40, 30]
    q, k, v = qkv(seq, batch=1)
    segments = packed_segments(seq, [lengths])
    mask = attention.AttentionMask(jnp.asarray(segments), packed=True)
    out = jax.jit(form)(q, k, v, mask)[0]
    start = 0
    for n in lengths:
        alone = [x[:, start : start + n] for x in (q, k, v)]
        alone = [jnp.pad(x, ((0, 0), (0, seq - n), (0, 0), (0, 0))) for x in alone]
        single = attention.AttentionMask.from_input_mask(jnp.asarray(right_padded(seq, [n])))
        want = einsum_attention(*alone, single)[0, :n]
        np.testing.assert_allclose(out[start : start + n], want, atol=2e-5)
        start += n


def test_auto_picks_the_platform_kernel_without_attention_dropout():
    def choose(dropout, platform, dtype="bfloat16", head_dim=64):
        return attention.choose("auto", dropout, dtype, head_dim, platform)[0]

    assert choose(0.0, "gpu") == "cudnn"
    assert choose(0.0, "tpu") == "splash"
    assert choose(0.0, "cpu") == "xla"
    assert choose(0.1, "gpu") == "xla"
    assert choose(0.1, "tpu") == "xla"
    assert choose(0.0, "gpu", dtype="float32") == "xla"  # cuDNN computes in 16 bits
    assert choose(0.0, "gpu", head_dim=160) == "xla"
    # On this host the default stays the einsum form.
    assert attention.resolve(BertConfig(attention_dropout=0.0)).attention == "xla"


def test_kernels_refuse_attention_dropout_and_other_platforms():
    with pytest.raises(ValueError, match=r"attention='cudnn' has no dropout.*=0.1"):
        BertConfig(attention="cudnn", attention_dropout=0.1)
    with pytest.raises(ValueError, match=r"attention='splash' has no dropout.*=0.1"):
        BertConfig(attention="splash", attention_dropout=0.1)
    with pytest.raises(ValueError, match=r"attention='flash'; valid: auto, xla, cudnn, splash"):
        BertConfig(attention="flash")
    with pytest.raises(ValueError, match="bfloat16 or float16, not dtype='float32'"):
        BertConfig(attention="cudnn", attention_dropout=0.0, dtype="float32")
    config = BertConfig(attention="splash", attention_dropout=0.0)
    with pytest.raises(ValueError, match="runs on tpu only, this is cpu"):
        attention.resolve(config, "cpu")


# ----------------------------------------------------------------------------------------
# The train step lowered for the accelerators


def packed_batch(seq=128, batch=4, slots=3):
    """A batch with the features of packed rows (lambjax.data.packing); for its shapes."""
    rows = random_batch(batch=batch, seq=seq)
    return rows | {
        "positions": np.zeros((batch, seq), np.int32),
        "example_ids": np.ones((batch, seq), np.int32),
        "cls_positions": np.zeros((batch, slots), np.int32),
        "next_sentence_labels": np.zeros((batch, slots), np.int32),
        "nsp_weights": np.ones((batch, slots), np.float32),
    }


def lowered_train_step(config, platform, seq=128, packed=False, mesh=None, once=False):
    """The train step's text lowered for `platform`: as the trainer jits it on `mesh` (its
    state and batch sharded, the mesh the context one; `once`: gradient_reduction='once'),
    or with no mesh at all."""
    optimizer = make_optimizer(optimizer_config("lamb"), optax.constant_schedule(1e-3))
    state = jax.eval_shape(
        lambda key: TrainState.create(init_params(config, key), optimizer),
        jax.random.key(0),
    )
    batch_size = 4 if mesh is None else 2 * mesh.size
    rows = packed_batch(seq, batch_size) if packed else random_batch(batch=batch_size, seq=seq)
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), rows)
    step = functools.partial(
        step_lib.train_step,
        settings=step_lib.StepSettings(
            model_config=config,
            optimizer=optimizer,
            schedule=optax.constant_schedule(1e-3),
            grad_accum_steps=1,
            options=step_lib.StepOptions(gradient_reduction="once" if once else "each_microbatch"),
            mesh=mesh,
        ),
    )
    if mesh is None:
        traced = jax.jit(step).trace(state, batch, jax.random.key(1))
        return traced.lower(lowering_platforms=(platform,)).as_text()
    state_shardings = state_lib.shardings(
        state,
        param_axes=param_logical_axes(config),
        mesh=mesh,
        optimizer=optimizer,
        num_frozen_layers=0,
    )
    replicated = sharding.replicated(mesh)
    jitted = jax.jit(
        step,
        in_shardings=(state_shardings, sharding.batch_sharding(mesh), replicated),
        out_shardings=(state_shardings, replicated),
    )
    with jax.set_mesh(mesh):
        traced = jitted.trace(state, batch, jax.random.key(1))
    return traced.lower(lowering_platforms=(platform,)).as_text()


# The meshes the configs and variants produce on 1, 4 and 8 devices: data parallel (the
# default, mesh.data=-1), FSDP, data x tensor, all three.
MESHES = {
    "1": {"data": 1},
    "data4": {"data": 4},
    "fsdp4": {"fsdp": 4},
    "data8": {"data": 8},
    "fsdp8": {"fsdp": 8},
    "data4xtensor2": {"data": 4, "tensor": 2},
    "data2xfsdp2xtensor2": {"data": 2, "fsdp": 2, "tensor": 2},
}


def device_mesh(name):
    shape = MESHES[name]
    return sharding.make_mesh(shape, jax.devices()[: int(np.prod(list(shape.values())))])


def mesh_cases(names, fast):
    """(mesh, packed) cases, padded and packed rows on each mesh; those outside `fast` in
    the full tier only (each takes a few seconds, the matrix minutes)."""
    return [
        pytest.param(
            name,
            packed,
            marks=() if (name, packed) in fast else pytest.mark.slow,
            id=f"{name}-{'packed' if packed else 'padded'}",
        )
        for name in names
        for packed in (False, True)
    ]


def shard_shapes(text):
    """The [rows, S, heads, head_dim] blocks each fused call's shard_map hands a device (its
    first argument of rank 4: the queries)."""
    blocks = re.findall(r"sdy\.manual_computation\(.*?manual_axes=\{[^}]*\} \((.*?)\) \{", text)
    firsts = (re.search(r"tensor<(\d+)x(\d+)x(\d+)x(\d+)x\w+>", args) for args in blocks)
    return [tuple(int(d) for d in first.groups()) for first in firsts if first]


@pytest.fixture
def cudnn_version_check_passes(monkeypatch):
    """The cuDNN version check asks the GPU runtime; this host has none."""
    monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda *a, **k: 91000)


@pytest.mark.parametrize("scan_layers", [False, True], ids=["unrolled", "scan"])
def test_train_step_lowers_to_cudnn_fused_attention(cudnn_version_check_passes, scan_layers):
    config = BertConfig.preset(
        "tiny", vocab_size=128, attention="cudnn", attention_dropout=0.0, scan_layers=scan_layers
    )
    text = lowered_train_step(config, "cuda")
    forward = re.findall(r'custom_call @"?__cudnn\$fmha\w*Softmax"?\(', text)
    backward = re.findall(r'custom_call @"?__cudnn\$fmha\w*SoftmaxBackward"?\(', text)
    calls = 1 if scan_layers else config.num_layers  # one per layer, or one in the scan body
    assert (len(forward), len(backward)) == (calls, calls), (forward, backward)
    assert "dot_general" in text and "bhqk" not in text


def test_packed_rows_reach_cudnn_as_a_bias(cudnn_version_check_passes):
    """jax.nn.dot_product_attention takes padding as lengths only; packed rows go in as a
    [B, 1, S, S] mask, which it hands cuDNN as an additive bias (with its gradient)."""
    config = BertConfig.preset(
        "tiny", vocab_size=128, attention="cudnn", attention_dropout=0.0, scan_layers=False
    )
    text = lowered_train_step(config, "cuda", packed=True)
    forward = re.findall(r'custom_call @"?__cudnn\$fmha(\w*)Softmax"?\(', text)
    assert forward and all("Bias" in name for name in forward), forward


def test_train_step_lowers_to_splash_kernels():
    config = BertConfig.preset(
        "tiny", vocab_size=128, attention="splash", attention_dropout=0.0, scan_layers=False
    )
    text = lowered_train_step(config, "tpu")
    kernels = set(re.findall(r'kernel_name = "(\w+)"', text))
    assert kernels == {
        "splash_mha_fwd_segmented_residuals",
        "splash_mha_dkv_segmented_no_residuals",
        "splash_mha_dq_segmented_no_residuals",
    }
    # The kernels live in shared functions; each layer calls the forward and the backward.
    calls = re.findall(r"call @(_splash_attention\w*)\(", text)
    assert len(calls) == 2 * config.num_layers, calls


SPLASH_KERNELS = {
    "splash_mha_fwd_segmented_residuals",
    "splash_mha_dkv_segmented_no_residuals",
    "splash_mha_dq_segmented_no_residuals",
}


def splash_counts(text):
    """(the Mosaic kernels compiled, the calls of the functions that hold them)."""
    return (
        text.count("custom_call @tpu_custom_call("),
        len(re.findall(r"call @(_splash_attention\w*)\(", text)),
    )


def expected_shard(mesh, seq, config):
    rows = 2 * mesh.size // (mesh.shape["data"] * mesh.shape["fsdp"])
    return (rows, seq, config.num_heads // mesh.shape["tensor"], config.head_dim)


@pytest.mark.parametrize(
    "mesh_name, packed", mesh_cases(MESHES, fast={("data4xtensor2", False), ("fsdp4", True)})
)
def test_splash_partitions_over_every_mesh(mesh_name, packed):
    """Splash on a multi-chip TPU: each device runs the kernels on its rows and heads
    (shard_map); XLA cannot partition a Mosaic kernel, so without it lowering fails."""
    config = BertConfig.preset(
        "tiny", vocab_size=128, attention="splash", attention_dropout=0.0, scan_layers=False
    )
    mesh = device_mesh(mesh_name)
    text = lowered_train_step(config, "tpu", packed=packed, mesh=mesh)
    assert set(re.findall(r'kernel_name = "(\w+)"', text)) == SPLASH_KERNELS
    # Three kernels (forward, dkv, dq) in shared functions; each layer calls the forward
    # and the backward once.
    assert splash_counts(text) == (3, 2 * config.num_layers)
    # Per layer: the forward's shard_map and its transpose, each on one device's block (on
    # one device a shard_map lowers to its body).
    blocks = 0 if mesh.size == 1 else 2 * config.num_layers
    assert shard_shapes(text) == [expected_shard(mesh, 128, config)] * blocks


@pytest.mark.parametrize(
    "mesh_name", [pytest.param("data4", marks=pytest.mark.slow), "data4xtensor2"]
)
def test_splash_partitions_inside_the_once_reduction(mesh_name):
    """gradient_reduction='once' runs the step manual over `data` already; the kernel's
    shard_map takes the other axes."""
    config = BertConfig.preset(
        "tiny", vocab_size=128, attention="splash", attention_dropout=0.0, scan_layers=False
    )
    mesh = device_mesh(mesh_name)
    text = lowered_train_step(config, "tpu", packed=True, mesh=mesh, once=True)
    assert splash_counts(text) == (3, 2 * config.num_layers)
    assert expected_shard(mesh, 128, config) in shard_shapes(text)


def test_splash_without_a_context_mesh_does_not_partition():
    """The reason for the context mesh: jitted on 4 devices with none, splash cannot lower."""
    config = BertConfig.preset(
        "tiny", vocab_size=128, attention="splash", attention_dropout=0.0, scan_layers=False
    )
    mesh = device_mesh("data4")
    with pytest.raises(NotImplementedError, match="Mosaic kernels cannot be automatically"):
        with mock.patch.object(jax, "set_mesh", lambda mesh: contextlib.nullcontext()):
            lowered_train_step(config, "tpu", mesh=mesh)


@pytest.mark.parametrize(
    "mesh_name, packed",
    mesh_cases(["data4", "fsdp4", "data8", "data4xtensor2"], fast={("data4xtensor2", True)}),
)
def test_cudnn_partitions_over_multi_device_meshes(cudnn_version_check_passes, mesh_name, packed):
    """cuDNN on several GPUs: under shard_map each device's call is the cuDNN kernel itself
    on its block (without it JAX defers to custom partitioning rules that run only when a
    GPU compiles the step, where this host cannot look)."""
    config = BertConfig.preset(
        "tiny", vocab_size=128, attention="cudnn", attention_dropout=0.0, scan_layers=False
    )
    mesh = device_mesh(mesh_name)
    text = lowered_train_step(config, "cuda", packed=packed, mesh=mesh)
    forward = re.findall(r'custom_call @"?__cudnn\$fmha\w*Softmax"?\(', text)
    backward = re.findall(r'custom_call @"?__cudnn\$fmha\w*SoftmaxBackward"?\(', text)
    assert (len(forward), len(backward)) == (config.num_layers, config.num_layers)
    assert "CustomSPMDPartitioning" not in text
    assert shard_shapes(text) == [expected_shard(mesh, 128, config)] * (2 * config.num_layers)


def test_a_fused_kernel_refuses_an_attention_einsum():
    config = BertConfig(attention="splash", attention_dropout=0.0)
    q = jnp.ones((1, 8, 2, 4))
    mask = attention.AttentionMask.from_input_mask(jnp.ones((1, 8), jnp.int32))
    with pytest.raises(ValueError, match="attention='splash' is a fused kernel") as error:
        attention.attend(config, q, q, q, mask, dropout=lambda w: w, einsum=jnp.einsum)
    assert "needs attention='xla'" in str(error.value) and "\n" not in str(error.value)


def test_the_einsum_form_runs_the_given_einsum():
    specs = []

    def recording(spec, x, y):
        specs.append(spec)
        return jnp.einsum(spec, x, y)

    q = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))
    mask = attention.AttentionMask.from_input_mask(jnp.ones((1, 8), jnp.int32))
    out = attention.xla_attention(q, q, q, mask, dropout=lambda w: w, einsum=recording)
    np.testing.assert_array_equal(out, attention.xla_attention(q, q, q, mask, dropout=lambda w: w))
    assert specs == ["bqhd,bkhd->bhqk", "bhqk,bkhd->bqhd"]
