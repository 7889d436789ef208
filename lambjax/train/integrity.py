"""Digests that let a checkpoint prove its arrays are the ones that were saved.

A flipped bit in a checkpoint's data file is not always an error Orbax can see: the file
still decodes, to other numbers (a storage fault, a bad disk, a copy cut short and padded).
So each save records, in the checkpoint's `meta` item, a digest of every array of the state,
and a restore recomputes them on what it read and compares.

Why a digest of each array's values, computed on the device, and not of the host-local bytes
or of the files:
- a checkpoint restores onto any mesh (another device or host count), so a digest must not
  depend on how the array was split: here each element is hashed with its position in the
  whole array and the hashes are summed modulo 2**32, a sum that any split of the array
  gives alike, and an exact integer reduction that XLA computes the same way on any mesh;
- it is one read of the state in device memory, before the save starts (the values an
  asynchronous save then writes in the background are these), and a replicated result of
  two integers per array: every host of a pod holds the same digests without exchanging a
  byte, and no host reads back what it wrote (a per-file digest would download a whole
  checkpoint from a bucket after each save);
- the element hash (murmur3's finaliser) is a bijection of 32-bit words, so any change of a
  single element changes the digest; two independent sums make a chance agreement of
  several changed elements about 1 in 2**64.
The JSON items (`data`, `meta`) have no digest: damaged, they no longer parse.
"""

import jax
import jax.numpy as jnp
import numpy as np

DIGESTS = "state_digests"  # the key of the digests in a checkpoint's meta

_SEEDS = (0x9E3779B9, 0x7F4A7C15)


def _mix(x):
    """murmur3's 32-bit finaliser: a bijection of uint32 that spreads every input bit."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def _words(leaf) -> jax.Array:
    """The array's bits as uint32 words (one per element; two for 8-byte elements)."""
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        leaf = jax.random.key_data(leaf)
    leaf = jnp.asarray(leaf)
    if leaf.dtype == jnp.bool_:
        return leaf.astype(jnp.uint32)
    size = jnp.dtype(leaf.dtype).itemsize
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[size]
    return jax.lax.bitcast_convert_type(leaf, unsigned).astype(jnp.uint32)


def _position(words: jax.Array) -> jax.Array:
    """Each element's flat index in the whole array (uint32, wrapping past 2**32)."""
    index = jnp.zeros(words.shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(words.ndim)):
        iota = jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis)
        index = index + iota * jnp.uint32(stride % 2**32)
        stride *= words.shape[axis]
    return index


def _leaf_digest(leaf) -> jax.Array:
    words = _words(leaf)
    position = _position(words)
    return jnp.stack(
        [
            jnp.sum(_mix(words ^ _mix(position + jnp.uint32(seed))), dtype=jnp.uint32)
            for seed in _SEEDS
        ]
    )


_digest_tree = jax.jit(lambda tree: jax.tree.map(_leaf_digest, tree))


def leaf_name(path) -> str:
    """'params/encoder/...' of a pytree path: the same for a state, its abstract form, the
    checkpoint's metadata and the dict of numpy arrays it restores to on a host."""

    def name(key) -> str:
        for attribute in ("key", "name", "idx"):
            if hasattr(key, attribute):
                return str(getattr(key, attribute))
        return str(key)

    return "/".join(name(k) for k in path)


def digests(tree) -> dict[str, str]:
    """{array name: 16 hex digits} of every array of `tree` (jax arrays on any mesh, or
    numpy arrays); the same on every process."""
    computed = _digest_tree(tree)
    return {
        leaf_name(path): "".join(f"{int(w):08x}" for w in np.asarray(value.addressable_data(0)))
        for path, value in jax.tree_util.tree_leaves_with_path(computed)
    }


def differing(recorded: dict[str, str], tree) -> list[str]:
    """Names of the arrays of `tree` whose digest differs from `recorded` (arrays that
    `recorded` does not name are not checked)."""
    computed = digests(tree)
    return sorted(
        name for name in computed.keys() & recorded.keys() if computed[name] != recorded[name]
    )


def describe(names: list[str]) -> str:
    """'params/x and 2 more arrays differ from what was saved' (for a log line)."""
    if len(names) == 1:
        return f"{names[0]} differs from what was saved (its digest does not match)"
    return (
        f"{names[0]} and {len(names) - 1} more arrays differ from what was saved (their "
        "digests do not match)"
    )


class IntegrityError(ValueError):
    """A checkpoint whose arrays are not those it recorded at its save."""
