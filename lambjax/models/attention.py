"""Scaled dot-product attention in the form each platform runs fastest.

`BertConfig.attention` picks one of four forms; all take queries, keys and values laid out
[B, S, heads, head_dim] and an `AttentionMask`, and return [B, S, heads, head_dim]:

  xla     einsum, softmax, dropout, einsum: materialises the [B, H, S, S] probabilities.
          Any platform and dtype, the only form with dropout on the probabilities.
  cudnn   cuDNN's fused (flash) attention through `jax.nn.dot_product_attention`: bfloat16
          or float16, head_dim a multiple of 8 and at most 128, GPU only. Padding goes in as
          sequence lengths (BERT's examples are right-padded: the real tokens come first),
          several examples packed in one row as a [B, 1, S, S] boolean mask.
  splash  Pallas splash attention (jax.experimental.pallas.ops.tpu.splash_attention), TPU
          only: padding and packing as segment ids; the mask's empty blocks are skipped.
  auto    cudnn on GPU and splash on TPU where `attention_dropout` is 0 (the kernels have no
          dropout: lambjax.train.variants.fast turns it off), else xla. `resolve` decides,
          once per run, and logs its choice in one line.

In every form a padding token is never attended to, so the real tokens' outputs agree; the
padding rows' own outputs differ between forms (cuDNN writes zeros there) and are never read
by the losses. Both kernels run per shard (`partitioned`): XLA cannot split a Pallas (Mosaic)
kernel over devices itself, and inside `shard_map` each device calls the kernel on its own
rows and heads. Neither kernel takes a dropout key: the private cuDNN entry point that has a
dropout rate compiles its seed into the call as a constant (the same mask at every step), so
lambjax does not use it.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from lambjax import sharding

FORMS = ("auto", "xla", "cudnn", "splash")
# The platform each kernel runs on (jax.default_backend()).
KERNEL_PLATFORM = {"cudnn": "gpu", "splash": "tpu"}
_MASKED = -1e9


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMask:
    """Which key each query may attend to, for a batch of rows.

    segment_ids: [B, S] int32, 0 for padding and k > 0 for the tokens of the k-th example
      of the row (1 everywhere on real tokens where each row holds one example).
    packed: whether a row may hold several examples (a static property of the data):
      without packing the mask needs only each row's length.
    """

    segment_ids: jax.Array
    packed: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @classmethod
    def from_input_mask(cls, input_mask) -> "AttentionMask":
        """One example per row: BERT's input mask (1 on real tokens, 0 on padding)."""
        return cls(segment_ids=(input_mask > 0).astype(jnp.int32), packed=False)

    def bias(self) -> jax.Array:
        """The additive float32 bias: [B, 1, 1, S] for one example per row, [B, 1, S, S]
        packed."""
        segments = self.segment_ids
        if not self.packed:
            return jnp.where(segments[:, None, None, :] > 0, 0.0, _MASKED).astype(jnp.float32)
        return jnp.where(self.allowed(), 0.0, _MASKED).astype(jnp.float32)

    def allowed(self) -> jax.Array:
        """[B, 1, S, S] boolean: query q may attend to key k (same example, not padding)."""
        q = self.segment_ids[:, None, :, None]
        k = self.segment_ids[:, None, None, :]
        return (q == k) & (k > 0)

    def lengths(self) -> jax.Array:
        """[B] int32: the real tokens of each row (right-padded rows)."""
        return jnp.sum(self.segment_ids > 0, axis=-1).astype(jnp.int32)


def check(form: str, attention_dropout: float, dtype: str, head_dim: int) -> None:
    """Raises ValueError naming the setting where `form` cannot run this model."""
    if form not in FORMS:
        raise ValueError(f"attention={form!r}; valid: {', '.join(FORMS)}")
    if form in KERNEL_PLATFORM and attention_dropout > 0:
        raise ValueError(
            f"attention={form!r} has no dropout but attention_dropout={attention_dropout}; "
            "set attention_dropout=0 (the 'fast' variant) or attention='xla'"
        )
    if form == "cudnn" and dtype not in ("bfloat16", "float16"):
        raise ValueError(f"attention='cudnn' computes in bfloat16 or float16, not dtype={dtype!r}")
    if form == "cudnn" and (head_dim % 8 or head_dim > 128):
        raise ValueError(
            f"attention='cudnn' needs head_dim a multiple of 8 and at most 128, not {head_dim}"
        )


def choose(form: str, attention_dropout: float, dtype: str, head_dim: int, platform: str):
    """(The concrete form for `platform` ('cpu', 'gpu', 'tpu'), why): `auto` decided, an
    explicit kernel checked against the platform. Raises ValueError naming the setting."""
    check(form, attention_dropout, dtype, head_dim)
    if form in KERNEL_PLATFORM:
        if KERNEL_PLATFORM[form] != platform:
            raise ValueError(
                f"attention={form!r} runs on {KERNEL_PLATFORM[form]} only, this is {platform}; "
                "valid here: 'auto', 'xla'"
            )
        return form, "chosen"
    if form == "xla":
        return form, "chosen"
    kernel = {value: key for key, value in KERNEL_PLATFORM.items()}.get(platform)
    if kernel is None:
        return "xla", f"no fused kernel on {platform}"
    if attention_dropout > 0:
        return "xla", f"attention_dropout={attention_dropout} (the {kernel} kernel has none)"
    try:
        check(kernel, attention_dropout, dtype, head_dim)
    except ValueError as e:
        return "xla", str(e)
    return kernel, f"{platform}, attention_dropout=0"


def resolve(config, platform: str | None = None):
    """`config` (a BertConfig) with its attention form decided for `platform` (default: JAX's
    backend), logged in one line where it was 'auto'."""
    platform = platform or jax.default_backend()
    chosen, why = choose(
        config.attention, config.attention_dropout, config.dtype, config.head_dim, platform
    )
    if config.attention == "auto":
        # Once per process: every phase resolves the same model fields.
        logging.log_first_n(logging.INFO, "attention='auto' -> %r: %s", 1, chosen, why)
    return dataclasses.replace(config, attention=chosen)


def xla_attention(q, k, v, mask: AttentionMask, *, dropout, einsum=jnp.einsum):
    """Einsum attention; `dropout(weights)` applies dropout to the probabilities. `einsum`
    computes its two contractions, "bqhd,bkhd->bhqk" (the scores) and "bhqk,bkhd->bqhd"
    (the outputs), e.g. a training method's emulated arithmetic."""
    logits = einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32)
    logits = logits / jnp.sqrt(jnp.float32(q.shape[-1])) + mask.bias()
    weights = dropout(jax.nn.softmax(logits, axis=-1))
    return einsum("bhqk,bkhd->bqhd", weights.astype(v.dtype), v)


def cudnn_attention(q, k, v, mask: AttentionMask, *, implementation: str = "cudnn"):
    """`jax.nn.dot_product_attention` with the padding as lengths (one example per row) or a
    boolean mask (packed rows). `implementation='xla'` runs the same call on any platform:
    the tests check cuDNN's semantics that way."""

    def per_shard(q, k, v, segment_ids):
        shard_mask = AttentionMask(segment_ids=segment_ids, packed=mask.packed)
        if mask.packed:
            return jax.nn.dot_product_attention(
                q, k, v, mask=shard_mask.allowed(), implementation=implementation
            )
        lengths = shard_mask.lengths()
        return jax.nn.dot_product_attention(
            q,
            k,
            v,
            query_seq_lengths=lengths,
            key_value_seq_lengths=lengths,
            implementation=implementation,
        )

    return partitioned(per_shard, q, k, v, mask.segment_ids)


def splash_block_sizes(seq_len: int):
    """Splash's blocks: 512 or the sequence where shorter (blocks must divide it)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    block = min(512, seq_len)
    return sk.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )


def _splash_kernel(num_heads: int, seq_len: int, interpret: bool):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    # Every query may see every key; the segment ids carry the padding and packing.
    full = sm.MultiHeadMask([sm.FullMask((seq_len, seq_len)) for _ in range(num_heads)])
    return sk.make_splash_mha(
        full,
        block_sizes=splash_block_sizes(seq_len),
        head_shards=1,
        q_seq_shards=1,
        interpret=interpret,
    )


def splash_attention(q, k, v, mask: AttentionMask, *, interpret: bool = False):
    """Pallas splash attention, vmapped over each shard's rows; `interpret=True` runs it on
    CPU."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    head_dim = q.shape[-1]
    scale = np.float32(1.0 / np.sqrt(head_dim)).astype(q.dtype)

    def per_shard(q, k, v, segment_ids):
        _, seq_len, num_heads, _ = q.shape  # this shard's heads
        kernel = _splash_kernel(num_heads, seq_len, interpret)

        def one_row(q, k, v, segments):  # [S, H, D] -> [H, S, D], the kernel's layout
            q, k, v = (jnp.swapaxes(x, 0, 1) for x in (q * scale, k, v))
            out = kernel(q, k, v, segment_ids=sk.SegmentIds(q=segments, kv=segments))
            return jnp.swapaxes(out, 0, 1)

        return jax.vmap(one_row)(q, k, v, segment_ids)

    return partitioned(per_shard, q, k, v, mask.segment_ids)


def partitioned(kernel, q, k, v, segment_ids):
    """`kernel(q, k, v, segment_ids)` under `shard_map` over the context mesh
    (`jax.set_mesh`; lambjax.train.loop sets the run's): each device runs it on its rows
    (the batch's mesh axes) and heads (the heads' axis) and XLA partitions nothing inside.
    Every axis goes manual, those of size 1 too (a Mosaic kernel lowers only where all are);
    those already manual (a step that runs in its own `shard_map`) stay so. With no context
    mesh (one device) the kernel runs as it is."""
    mesh = jax.sharding.get_abstract_mesh()
    free = tuple(a for a in mesh.axis_names if a not in mesh.manual_axes)
    if mesh.empty or not free:
        return kernel(q, k, v, segment_ids)
    qkv = sharding.logical_to_spec(("batch", "length", "heads", "kv"), q.shape, mesh)
    rows = jax.sharding.PartitionSpec(qkv[0], None)
    return jax.shard_map(
        kernel,
        in_specs=(qkv, qkv, qkv, rows),
        out_specs=qkv,
        axis_names=set(free),
        check_vma=False,
    )(q, k, v, segment_ids)


def attend(config, q, k, v, mask: AttentionMask, *, dropout, einsum=None):
    """Attention in the form `config` (a BertConfig) names; 'auto' is decided here for JAX's
    backend where `resolve` has not decided it already. `einsum` (None: `jnp.einsum`) runs
    the einsum form's two contractions; the fused kernels have none to replace."""
    form = config.attention
    if form == "auto":
        form, _ = choose(
            form, config.attention_dropout, config.dtype, config.head_dim, jax.default_backend()
        )
    if form == "xla":
        return xla_attention(q, k, v, mask, dropout=dropout, einsum=einsum or jnp.einsum)
    if einsum is not None:
        raise ValueError(
            f"attention={form!r} is a fused kernel with its own matmuls; an attention einsum "
            "(lambjax.models.encoder.LayerOptions.attention_einsum) needs attention='xla'"
        )
    if form == "cudnn":
        return cudnn_attention(q, k, v, mask).astype(v.dtype)
    if form == "splash":
        return splash_attention(q, k, v, mask).astype(v.dtype)
    raise ValueError(f"attention={form!r}; valid: {', '.join(FORMS)}")
