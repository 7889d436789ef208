"""The standardization loss: normalization replaced by a loss that pushes activations towards
zero mean and unit variance (Collins, Balle, Shlens, "Accelerating Training of Deep Neural
Networks with a Standardization Loss", 2019, arXiv 1903.00925).

Section 3 of the paper treats each of a layer's n channels as one dimension of the
activation distribution, with the batch (and spatial) positions as its samples, as batch
normalization computes its statistics, and takes the KL divergence of a Gaussian with those
moments from N(0, I):

  L_std = 1/2 sum_i (mu_i^2 + sigma_i^2 - log sigma_i^2 - 1)

a sum over channels (and, in the total objective, over layers), weighted by lambda and added
to the primary loss; at inference the term is dropped and nothing is normalized.

In BERT (the paper has no Transformer experiments; this placement is lambjax's) every
LayerNorm of the embeddings and the encoder becomes `AffineNorm`: the LayerNorm's per-channel
scale and bias (the learned shift and scale the paper's BN and PointNet nets kept) with no
normalization. L_std attaches at one of two sites (`SITES`):

  residual       the tensor each removed LayerNorm normalized (PostLN: the embeddings' sum
                 and each residual sum; PreLN: the embeddings' sum, each sub-layer's input
                 and the final LayerNorm's);
  preactivation  each layer's FFN intermediate dense output before GELU, the paper's own
                 placement (section 3: a layer's activation before the nonlinearity).

Statistics are per channel over the batch's tokens, padding excluded, in float32; within a jitted,
data-parallel step they are the global batch's (XLA reduces over the sharded batch axis),
and with gradient accumulation each micro-batch's. log(sigma^2 + 1e-6) keeps a constant
channel finite. The MLM head's LayerNorm stays: it is part of the pretraining head, not the
encoder.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

LOG_VARIANCE_EPS = 1e-6
SITES = ("residual", "preactivation")


def standardization_loss(x: jax.Array, token_mask: jax.Array) -> jax.Array:
    """L_std of activations x [B, S, H] over the tokens where token_mask [B, S] is nonzero:
    1/2 sum over H of (mu^2 + sigma^2 - log(sigma^2 + eps) - 1), float32."""
    weights = token_mask.astype(jnp.float32)[..., None]
    count = jnp.maximum(jnp.sum(weights), 1.0)
    x = x.astype(jnp.float32)
    mean = jnp.sum(x * weights, axis=(0, 1)) / count
    variance = jnp.sum(jnp.square(x - mean) * weights, axis=(0, 1)) / count
    return 0.5 * jnp.sum(jnp.square(mean) + variance - jnp.log(variance + LOG_VARIANCE_EPS) - 1.0)


class AffineNorm(nn.Module):
    """A LayerNorm's place without the normalization: x * scale + bias, with the same
    parameters as the LayerNorm it replaces. Given a token mask (in training) it sows the
    standardization loss of its input into the `losses` collection."""

    features: int
    dtype: str
    param_dtype: str

    @nn.compact
    def __call__(self, x, token_mask=None):
        scale = self.param(
            "scale",
            nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
            (self.features,),
            self.param_dtype,
        )
        bias = self.param(
            "bias",
            nn.with_logical_partitioning(nn.initializers.zeros, ("norm",)),
            (self.features,),
            self.param_dtype,
        )
        if token_mask is not None:
            self.sow("losses", "standardization", standardization_loss(x, token_mask))
        return (x * scale + bias).astype(self.dtype)


def sown_total(variables: dict) -> jax.Array:
    """The sum of every loss a module sowed into `losses` (0 where none was)."""
    leaves = jax.tree.leaves(variables.get("losses", {}))
    return sum(leaves, jnp.zeros((), jnp.float32))


def check_site(site: str) -> None:
    """`config.standardization_loss.site`, one of `SITES`."""
    if site not in SITES:
        raise ValueError(
            f"config.standardization_loss.site={site!r}; valid: {', '.join(map(repr, SITES))}"
        )


def check(weight: float, phases) -> None:
    """`config.standardization_loss.weight` against the run's phase plans."""
    if weight < 0:
        raise ValueError(f"config.standardization_loss.weight={weight} must be >= 0")
    if weight > 0 and phases[0].model.normalization != "none":
        raise ValueError(
            f"config.standardization_loss.weight={weight} replaces the encoder's LayerNorms, "
            f"but the model has normalization='layer_norm'; set "
            f"--config.model.overrides.normalization=none (or the variant standardization_loss)"
        )
