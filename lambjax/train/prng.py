"""Which JAX PRNG implementation draws a run's training randomness (`config.prng_impl`).

The train step derives every random draw (dropout masks, progressive layer dropping,
Ouroboros's replays) from one key, `jax.random.key(seed, impl=...)`, folded with the phase,
the step and the micro-batch. The implementation travels with that typed key, so it applies
to this run's training keys only: parameter initialisation stays threefry (the same initial
parameters for every choice), and nothing else in the process is changed, as setting
`jax_default_prng_impl` would.

- `threefry` (the default): threefry2x32, the same bits on every backend and for every
  sharding of the batch.
- `rbg`: XLA's RngBitGenerator keyed through threefry (`split` and `fold_in` exact);
  faster on TPU and GPU, its bits depend on the backend.
- `unsafe_rbg`: RngBitGenerator throughout, `split` and `fold_in` included, which are
  approximations of threefry's; the fastest.

What each keeps (tests/train/test_runs.py, on XLA:CPU): a run resumes bitwise with each,
and gives the same losses on 1, 2 and 4 devices with each (docs/guide/configs.md).
"""

import jax

# config value -> jax's name of the implementation
IMPLS = {"threefry": "threefry2x32", "rbg": "rbg", "unsafe_rbg": "unsafe_rbg"}


def check(prng_impl) -> None:
    """ValueError naming config.prng_impl unless it is one of IMPLS."""
    if prng_impl not in IMPLS:
        raise ValueError(f"config.prng_impl={prng_impl!r}; valid: {', '.join(IMPLS)}")


def training_key(seed: int, prng_impl: str) -> jax.Array:
    """The typed key a run's training randomness derives from."""
    return jax.random.key(seed, impl=IMPLS[prng_impl])
