"""The fused attention kernels against lambjax's einsum form, forward and backward.

At BERT-large's heads (16 x 64) with bfloat16 operands, against the einsum form in float32,
on right-padded rows (one example each) and packed rows (several examples each); only the
real tokens count, as only they reach the losses. Run by benchmarks/device_check.py.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from lambjax.models import attention
from lambjax.models.config import BertConfig

HEADS, HEAD_DIM = 16, 64  # BERT-large's attention heads
# A bfloat16 kernel against the float32 einsum: errors of 1e-3 to 1e-2 are bfloat16's own.
TOLERANCE = 3e-2


def fused_form(platform: str) -> str | None:
    """The fused attention kernel of `platform`, None where it has none (CPU)."""
    return {where: form for form, where in attention.KERNEL_PLATFORM.items()}.get(platform)


def segment_ids(rng, batch: int, seq: int, packed: bool) -> np.ndarray:
    """[B, S] ids: right-padded rows of one example (lengths S/4..S, the first full), or
    rows of 2-4 packed examples followed by some padding."""
    if not packed:
        lengths = rng.integers(seq // 4, seq + 1, (batch,))
        lengths[0] = seq
        return (np.arange(seq)[None] < lengths[:, None]).astype(np.int32)
    rows = np.zeros((batch, seq), np.int32)
    for row in rows:
        ends = np.sort(rng.choice(np.arange(seq // 8, seq - 4), rng.integers(2, 5), replace=False))
        for example, (start, end) in enumerate(zip((0, *ends[:-1]), ends, strict=True)):
            row[start:end] = example + 1
    return rows


def fused_attention_fn(form: str | None):
    """(name, (q, k, v, mask) -> output) of the fused `form`; with none (CPU), the cuDNN
    call's XLA implementation (the same `jax.nn.dot_product_attention` semantics)."""
    if form is None:
        return "cudnn semantics (XLA)", functools.partial(
            attention.cudnn_attention, implementation="xla"
        )
    config = BertConfig(
        num_heads=HEADS,
        hidden_size=HEADS * HEAD_DIM,
        attention=form,
        attention_dropout=0.0,
        dtype="bfloat16",
    )
    return form, lambda q, k, v, mask: attention.attend(config, q, k, v, mask, dropout=None)


def relative_error(a, b, real) -> float:
    """Over the real tokens: a kernel's padding rows are free (cuDNN writes zeros there)."""
    a, b = (np.where(real, np.asarray(x, np.float64), 0.0) for x in (a, b))
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def check(form: str | None, seq: int, packed: bool, batch: int) -> dict:
    """The fused `form` (None: see `fused_attention_fn`) against the einsum form on random
    [batch, seq, 16, 64] operands: relative errors of the output and of dq, dk, dv."""
    name, fused = fused_attention_fn(form)
    rng = np.random.default_rng(seq + packed)
    mask = attention.AttentionMask(jnp.asarray(segment_ids(rng, batch, seq, packed)), packed)
    keys = jax.random.split(jax.random.key(seq), 4)
    q, k, v, cotangent = (
        jax.random.normal(key, (batch, seq, HEADS, HEAD_DIM), jnp.float32) for key in keys
    )
    real = np.asarray(mask.segment_ids > 0)[:, :, None, None]  # the losses read only these

    def loss(fn, q, k, v):
        out = jnp.where(real, fn(q, k, v, mask).astype(jnp.float32), 0.0)
        return jnp.sum(out * cotangent), out

    def einsum(q, k, v, mask):
        return attention.xla_attention(q, k, v, mask, dropout=lambda weights: weights)

    def run(fn, *operands):
        grad = jax.value_and_grad(functools.partial(loss, fn), (0, 1, 2), has_aux=True)
        (_, out), grads = jax.jit(grad)(*operands)
        return out, grads

    bf16 = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    out, grads = run(fused, *bf16)
    ref_out, ref_grads = run(einsum, q, k, v)
    errors = {"out_rel_err": relative_error(out, ref_out, real)}
    for label, g, ref in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        errors[f"{label}_rel_err"] = relative_error(g, ref, real)
    finite = all(np.isfinite(np.where(real, x, 0.0)).all() for x in (out, *grads))
    return {
        "form": name,
        "shape": [batch, seq, HEADS, HEAD_DIM],
        **{key: round(value, 6) for key, value in errors.items()},
        "ok": bool(finite and max(errors.values()) < TOLERANCE),
    }
