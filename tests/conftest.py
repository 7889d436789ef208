"""Fixtures of tests/ alone; the test-wide set-up (fake devices, malloc, data_dirs) is the
repository root's conftest.py, and shared helpers are in tests/helpers.py."""

import pytest


@pytest.fixture(scope="session")
def gcs_bucket(tmp_path_factory):
    """gs://lambjax-test on a local GCS emulator (tests/gcs_emulator.py), with this process
    and the commands it starts pointed at it."""
    from tests.gcs_emulator import Emulator

    emulator = Emulator(str(tmp_path_factory.mktemp("gcs")))
    emulator.use()
    yield emulator.create_bucket("lambjax-test")
    emulator.stop()
