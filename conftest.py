"""Test-wide set-up for tests/ and studies/: 8 fake CPU devices, so sharding runs as it would
on a TPU host, and malloc keeps freed memory (as `lambjax.main` does on CPU) before JAX
starts its threads; the data_dirs that runs share; and the order the files run in. Shared
helpers are in tests/helpers.py."""

import collections
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


# The suite's longest files, longest first (their tests' durations in the slow and fast
# tiers on the CPU VM's 2 cores, shared, 2026-12-02). With `--dist loadfile` a file runs
# whole on one worker, and the workers take the files in collection order: these start
# first, and the many short files even the two workers out at the end. (xdist's own order,
# the files with the most tests first, left files of 1 to 3 long tests, such as
# test_storage_faults.py and test_published_runs.py, for the end: pyproject.toml turns it
# off.)
LONGEST_FIRST = (
    "tests/train/test_runs.py",  # about 9 min on shared cores
    "tests/launch/test_local_pod.py",  # about 5 min
    "tests/train/test_layout.py",
    "tests/train/test_layer_schemes.py",
    "tests/train/test_step.py",
    "tests/train/test_layer_scheme_runs.py",
    "tests/contrib/test_ouroboros.py",
    "tests/finetune/test_runs.py",
    "tests/train/test_storage_faults.py",
    "tests/sweep/test_sweep.py",
    "tests/train/test_packing_runs.py",
    "studies/batch_scaling/test_batch_scaling.py",
    "tests/models/test_bert.py",
    "tests/train/test_published_runs.py",
    "tests/contrib/test_ouroboros_runs.py",
    "tests/train/test_cloud_storage.py",
    "tests/test_install.py",
    "tests/models/test_standardization.py",
    "tests/models/test_packing.py",
    "tests/models/test_attention.py",
    "tests/train/test_noise_scale.py",
    "tests/train/test_reduction.py",  # about 1 min
)


def pytest_collection_modifyitems(config, items):
    """The files of LONGEST_FIRST first, in its order; then the others, those with the most
    tests first (xdist's own order). A file's tests keep their order."""

    def path(item):
        return item.nodeid.split("::")[0]

    counts = collections.Counter(map(path, items))
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: (rank.get(path(item), len(rank)), -counts[path(item)]))
