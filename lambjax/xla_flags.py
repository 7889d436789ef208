"""The XLA flags and JAX settings lambjax sets for each platform before JAX starts.

On GPU (what MaxText and NVIDIA's JAX-Toolbox run BERT-class models with):

  --xla_gpu_enable_latency_hiding_scheduler=true     overlaps collectives with compute
  --xla_gpu_enable_while_loop_double_buffering=true  the layer scan's next slice of
                                                     parameters is fetched while the current
                                                     layer computes
  --xla_gpu_enable_dynamic_slice_fusion=true         a scan's dynamic-(update-)slices fused
                                                     into their consumers, not copied (the
                                                     name that replaced
                                                     `address_computation_fusion`)
  jax_optimization_level=O1                          JAX-Toolbox's recommendation

On TPU and CPU none: libtpu's defaults already schedule for latency, and XLA:CPU has no
such passes.

The user's own settings win: a flag named in `XLA_FLAGS` keeps the user's value (lambjax adds
only the flags not named there), and `JAX_OPTIMIZATION_LEVEL` in the environment keeps
JAX's reading of it. jaxlib stops the process at start-up on a flag it does not know, so
every flag here is parse-tested (tests/test_xla_flags.py).
"""

import os

FLAGS = {
    "gpu": {
        "xla_gpu_enable_latency_hiding_scheduler": "true",
        "xla_gpu_enable_while_loop_double_buffering": "true",
        "xla_gpu_enable_dynamic_slice_fusion": "true",
    },
    "tpu": {},
    "cpu": {},
}
OPTIMIZATION_LEVEL = {"gpu": "O1"}


def flag_names(xla_flags: str) -> set[str]:
    """The flag names in an XLA_FLAGS string: `--a=1 --b` -> {'a', 'b'}."""
    names = set()
    for item in xla_flags.split():
        name = item.lstrip("-").split("=", 1)[0]
        if name:
            names.add(name)
    return names


def merged(user_flags: str, platform: str) -> str:
    """`user_flags` with lambjax's flags for `platform` added where the user names none."""
    named = flag_names(user_flags)
    added = [
        f"--{name}={value}" for name, value in FLAGS.get(platform, {}).items() if name not in named
    ]
    return " ".join([user_flags.strip(), *added]).strip()


def canonical_platform(platform: str) -> str:
    """JAX_PLATFORMS's spellings ('cuda', 'rocm') as JAX's backend names."""
    return {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)


def apply(platform: str, environ=os.environ) -> None:
    """Sets `XLA_FLAGS` (and JAX's optimization level) for `platform` in `environ`; must run
    before JAX starts its backend, which reads XLA_FLAGS once."""
    platform = canonical_platform(platform)
    flags = merged(environ.get("XLA_FLAGS", ""), platform)
    if flags:
        environ["XLA_FLAGS"] = flags
    level = OPTIMIZATION_LEVEL.get(platform)
    if level and "JAX_OPTIMIZATION_LEVEL" not in environ:
        import jax

        jax.config.update("jax_optimization_level", level)
