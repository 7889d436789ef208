"""lambjax's XLA flags: each parses in this jaxlib (which stops at start-up on an unknown
flag), and the user's own XLA_FLAGS win."""

import os
import subprocess
import sys

import pytest

from lambjax import xla_flags

PROGRAM = "import jax, jax.numpy as jnp; print(jax.jit(lambda x: x + 1)(jnp.ones(2)).sum())"


def run_with_xla_flags(flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=120
    )


def test_every_shipped_flag_parses():
    shipped = " ".join(xla_flags.merged("", platform) for platform in xla_flags.FLAGS)
    assert xla_flags.flag_names(shipped) == {
        name for flags in xla_flags.FLAGS.values() for name in flags
    }
    result = run_with_xla_flags(shipped)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "4.0"
    # The check has teeth: a flag jaxlib does not know (one renamed since) stops the process.
    result = run_with_xla_flags("--xla_gpu_enable_address_computation_fusion=true")
    assert result.returncode != 0
    assert "xla_gpu_enable_address_computation_fusion" in result.stderr


def test_user_flags_win_and_are_kept():
    user = "--xla_gpu_enable_while_loop_double_buffering=false --xla_dump_to=/tmp/dump"
    flags = xla_flags.merged(user, "gpu")
    assert flags.startswith(user)
    assert flags.count("xla_gpu_enable_while_loop_double_buffering") == 1
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in flags
    assert "--xla_gpu_enable_dynamic_slice_fusion=true" in flags
    assert xla_flags.merged(user, "cpu") == user


@pytest.mark.parametrize("platform,expected", [("cuda", "O1"), ("cpu", None)])
def test_apply_sets_the_platforms_flags_and_level(monkeypatch, platform, expected):
    import jax

    monkeypatch.setattr(jax.config, "update", lambda name, value: levels.append((name, value)))
    levels, environ = [], {"XLA_FLAGS": "--xla_dump_to=/tmp/dump"}
    xla_flags.apply(platform, environ)
    if expected:
        assert levels == [("jax_optimization_level", expected)]
        assert "xla_gpu_enable_latency_hiding_scheduler=true" in environ["XLA_FLAGS"]
    else:
        assert levels == [] and environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/dump"
    # The user's JAX_OPTIMIZATION_LEVEL is left to JAX.
    levels.clear()
    xla_flags.apply(platform, {"JAX_OPTIMIZATION_LEVEL": "O0"})
    assert levels == []
