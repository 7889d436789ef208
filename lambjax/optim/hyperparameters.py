"""Hyperparameter checks that hold for values injected by `optax.inject_hyperparams`.

`optax.inject_hyperparams(optim.lamb)(...)` passes every numeric argument, defaults
included, to the factory as an array of the parameters' dtype (or of its
`hyperparam_dtype`): concrete when the state is initialised eagerly, traced inside a
jitted update. A traced value cannot be compared in Python, so it is not checked; and a
transform that a value switches on is kept for any array value, so that init and update
build the same chain (the same state tree). A schedule (a callable) is not checked either.
"""

import jax
import jax.numpy as jnp
import numpy as np


def is_traced(value) -> bool:
    """Whether `value` is abstract here (traced by jit), so Python cannot look at it."""
    return isinstance(value, jax.core.Tracer)


def is_python_zero(value) -> bool:
    """Whether `value` is 0 as a Python number: the term it scales can be left out. An
    array (an injected hyperparameter) keeps the term, whatever its value."""
    return isinstance(value, int | float) and value == 0


def is_checkable(value) -> bool:
    """Whether Python can look at `value`: a number or a concrete array, not a schedule."""
    return value is not None and not callable(value) and not is_traced(value)


def real_value(value) -> float:
    """A number or concrete array as a float (the real part of a complex one: injected
    into a complex model, a hyperparameter is a complex array)."""
    return float(np.real(np.asarray(value)))


def check_decay_rate_precision(name: str, value) -> None:
    """b1 and b2 must not be held in fewer bits than float32: `optax.inject_hyperparams`
    casts them to the parameters' dtype, where 0.999 rounds to 1.0 (bfloat16)."""
    dtype = getattr(value, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        return
    if jnp.finfo(dtype).bits < 32:
        raise ValueError(
            f"{name} is a {dtype} array: optax.inject_hyperparams casts hyperparameters to "
            f"the parameters' dtype, where b1 and b2 lose their precision (b2 = 0.999 is 1.0 "
            f"in bfloat16); pass hyperparam_dtype=jnp.float32 to optax.inject_hyperparams"
        )


def check_hyperparameters(learning_rate, b1, b2, eps, weight_decay, max_global_norm=None):
    """ValueErrors that name the argument, for LAMB and LANS (traced values and schedules
    are skipped)."""
    if is_checkable(learning_rate) and real_value(learning_rate) < 0:
        raise ValueError(f"learning_rate={learning_rate} must be >= 0 (or an optax schedule)")
    for name, value in (("b1", b1), ("b2", b2)):
        check_decay_rate_precision(name, value)
        if is_checkable(value) and not 0 <= real_value(value) < 1:
            raise ValueError(f"{name}={value} must lie in [0, 1)")
    if is_checkable(eps) and real_value(eps) < 0:
        raise ValueError(f"eps={eps} must be >= 0")
    if is_checkable(weight_decay) and real_value(weight_decay) < 0:
        raise ValueError(f"weight_decay={weight_decay} must be >= 0 (or an optax schedule)")
    check_max_norm(max_global_norm, "max_global_norm", " (or None: no clipping)")


def check_max_norm(max_norm, argument: str, alternative: str = "") -> None:
    """A clipping threshold is a positive number (or None where clipping is optional)."""
    if callable(max_norm):
        raise ValueError(
            f"{argument}={max_norm!r}: a schedule is not supported here, as in "
            f"optax.clip_by_global_norm; give a number (optax.inject_hyperparams evaluates "
            f"a schedule given for it at every step and passes the number)"
        )
    if is_checkable(max_norm) and real_value(max_norm) <= 0:
        raise ValueError(f"{argument}={max_norm} must be > 0{alternative}")
