"""`python -m lambjax.prepare` as a user runs it, and what training does with its result."""

import re
import sys

import jax
import pytest

from lambjax import cli, data
from lambjax.data import beam_build
from lambjax.train import phases, plan
from tests.helpers import run

CONFIG = "configs/default.py:runlocal"


def prepare_command(data_dir, *flags):
    return [
        sys.executable,
        "-m",
        "lambjax.prepare",
        f"--config={CONFIG}",
        f"--config.data.data_dir={data_dir}",
        *flags,
    ]


@pytest.mark.slow
def test_multi_host_run_stops_then_finds_what_prepare_built(tmp_path, monkeypatch):
    config = cli.load_config(CONFIG)
    config.data.data_dir = str(tmp_path)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(sys, "argv", ["lambjax.main", f"--config={CONFIG}", "--workdir=/w"])
    with pytest.raises(data.NotPrepared) as error:
        phases.prepare_vocabulary(config.data)
    message = str(error.value)
    assert "\n" not in message
    assert f"python -m lambjax.prepare --config={CONFIG} --workdir=/w`" in message

    result = run(prepare_command(tmp_path, "--beam_pipeline_options=direct_num_workers=1"), 1)
    summary = result.stdout.strip().splitlines()[-1]
    assert summary.startswith("prepare: ") and "train" in summary and str(tmp_path) in summary
    # What training reads, and may not build on 2 hosts:
    vocab_size = phases.prepare_vocabulary(config.data).size
    run_plan = plan.resolve(config, vocab_size=vocab_size, num_devices=1, process_count=2)
    for prepared in phases.prepare_data(run_plan).values():
        assert prepared.num_examples("train") > 0
    again = run(prepare_command(tmp_path), 1)
    assert "nothing to build" in again.stdout


def test_bad_beam_options_end_with_one_line(tmp_path):
    options = "--beam_pipeline_options=runner=SomeRunner"
    result = run(prepare_command(tmp_path, options), 1, check=False)
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last == (
        "lambjax.prepare: error: --beam_pipeline_options: runner='SomeRunner' is not a Beam "
        "runner; valid: DataflowRunner, DirectRunner, FlinkRunner, PortableRunner, PrismRunner, "
        "SparkRunner"
    )
    for spec, message in [
        ("runner=DataflowRunner,project=p,region=r", "needs temp_location=..."),
        ("direct_num_workers=0", "direct_num_workers=0 must be a positive integer"),
        ("direct_num_workers", "'direct_num_workers' is not KEY=VALUE"),
    ]:
        with pytest.raises(data.DataError, match=re.escape(message)):
            beam_build.pipeline_options(spec, num_units=4)
    options = beam_build.pipeline_options(None, num_units=3).get_all_options()
    assert options["runner"] == "DirectRunner" and options["direct_num_workers"] >= 1


@pytest.mark.slow
def test_prepare_into_a_bucket_and_a_missing_bucket(gcs_bucket):
    """gs:// data_dir on the GCS emulator: built there, complete; a missing bucket: one line."""
    from etils import epath

    data_dir = f"{gcs_bucket}/prepared"
    result = run(prepare_command(data_dir, "--beam_pipeline_options=direct_num_workers=1"), 1)
    assert result.stdout.strip().splitlines()[-1].startswith("prepare: ")
    built = [p.name for p in epath.Path(data_dir).glob("pretraining_examples/*/*/*")]
    assert built.count("dataset_info.json") == 2  # both sequence lengths, complete
    missing = run(prepare_command("gs://no-such-bucket/d"), 1, check=False)
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines()[-1] == (
        "lambjax.prepare: error: --config.data.data_dir=gs://no-such-bucket/d: bucket "
        "'no-such-bucket' does not exist (or is not visible)"
    )
