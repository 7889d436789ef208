"""Test-wide set-up for tests/ and studies/: 8 fake CPU devices, so sharding runs as it would
on a TPU host, and malloc keeps freed memory (as `lambjax.main` does on CPU) before JAX
starts its threads; and the data_dirs that runs share. Shared helpers are in
tests/helpers.py."""

import os

import pytest

from lambjax import host_memory

host_memory.retain_freed_memory()

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")  # TensorFlow 2.21's import notice

import jax  # noqa: E402

from tests.helpers import COMPILATION_CACHE  # noqa: E402

jax.config.update("jax_platforms", "cpu")
# The tests' programs reach the cache that the runs they start share (tests/helpers.py:
# `environment`): a program that another test compiled already is read back, not compiled.
jax.config.update("jax_compilation_cache_dir", COMPILATION_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A data_dir for the datasets that one test module's runs build and share."""
    return str(tmp_path_factory.mktemp("datasets"))


@pytest.fixture(scope="session")
def study_data_dir(tmp_path_factory):
    """One data_dir for every study's smallest form: the CPU studies share one dataset
    (studies.common.cpu_study_config), so the whole suite builds it once."""
    return str(tmp_path_factory.mktemp("study-datasets"))
