"""Hyperparameter checks that hold for values injected by `optax.inject_hyperparams`.

`optax.inject_hyperparams(optim.lamb)(...)` passes every numeric argument, defaults
included, to the factory as an array: concrete when the state is initialised eagerly,
traced inside a jitted update. A traced value cannot be compared in Python, so it is not
checked; and a transform that a value switches on is kept for any array value, so that
init and update build the same chain (the same state tree).
"""

import jax


def is_traced(value) -> bool:
    """Whether `value` is abstract here (traced by jit), so Python cannot look at it."""
    return isinstance(value, jax.core.Tracer)


def is_python_zero(value) -> bool:
    """Whether `value` is 0 as a Python number: the term it scales can be left out. An
    array (an injected hyperparameter) keeps the term, whatever its value."""
    return isinstance(value, int | float) and value == 0


def check_hyperparameters(learning_rate, b1, b2, eps, weight_decay, max_global_norm=None):
    """ValueErrors that name the argument, for LAMB and LANS (traced values are skipped)."""

    def known(value):
        return not is_traced(value)

    if known(learning_rate) and not callable(learning_rate) and learning_rate < 0:
        raise ValueError(f"learning_rate={learning_rate} must be >= 0 (or an optax schedule)")
    for name, value in (("b1", b1), ("b2", b2)):
        if known(value) and not 0 <= value < 1:
            raise ValueError(f"{name}={value} must lie in [0, 1)")
    if known(eps) and eps < 0:
        raise ValueError(f"eps={eps} must be >= 0")
    if known(weight_decay) and weight_decay < 0:
        raise ValueError(f"weight_decay={weight_decay} must be >= 0")
    if known(max_global_norm) and max_global_norm is not None and max_global_norm <= 0:
        raise ValueError(f"max_global_norm={max_global_norm} must be > 0 (or None: no clipping)")
