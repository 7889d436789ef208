r"""Builds a config's pretraining data once, ahead of training: `python -m lambjax.prepare`.

  python -m lambjax.prepare --config=configs/default.py \
      (--workdir=DIR | --config.data.data_dir=DIR) [--config.data.source=text:GLOB ...] \
      [--beam_pipeline_options=KEY=VALUE,...]

It takes the same config and flags as `python -m lambjax.main`, builds the vocabulary
(`data.vocab=train`) and, for every phase's `max_seq_length`, the dataset of examples under
`data.data_dir` (a config that names none: the run's WORKDIR/data), so that training finds
exactly what it built; a progress line every few seconds, then one summary line (the full
log: prepare.log in the data directory). The build is one Apache Beam pipeline
(lambjax.data.beam_build). Its options read as
`tfds build --beam_pipeline_options`: by default the DirectRunner, one worker process per
core; `direct_num_workers=1` for one; `runner=DataflowRunner,project=P,region=R,
temp_location=gs://B/tmp` runs it on Dataflow (its workers install lambjax from this source
tree's setup.py unless `setup_file`, `requirements_file` or `sdk_container_image` is
given). A bad option ends the command with one line and exit status 2.
"""

import sys

from absl import app, flags
from ml_collections import config_flags

# cli: quiets TensorFlow; storage: before any gs:// access
from lambjax import cli, console, storage

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.")
_WORKDIR = flags.DEFINE_string(
    "workdir",
    None,
    "The run's workdir: a config that names no data.data_dir builds into WORKDIR/data, where "
    "`lambjax.main --workdir=WORKDIR` finds it.",
)
_BEAM_OPTIONS = flags.DEFINE_string(
    "beam_pipeline_options",
    None,
    "Apache Beam options, KEY=VALUE,... (e.g. direct_num_workers=1, or runner=DataflowRunner,"
    "project=P,region=R,temp_location=gs://B/tmp).",
)
flags.mark_flags_as_required(["config"])

PROGRAM = "lambjax.prepare"


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    console.setup()
    config = _CONFIG.value
    if not config.data.data_dir and not _WORKDIR.value:
        cli.fail(
            PROGRAM,
            "give --workdir=DIR (the run's data goes in DIR/data, where `lambjax.main "
            "--workdir=DIR` finds it) or --config.data.data_dir=DIR (data shared by runs)",
        )
    from lambjax import data
    from lambjax.data import beam_build, builder
    from lambjax.train import plan

    data_config = plan.run_data(config, workdir=_WORKDIR.value)  # WORKDIR/data by default
    lengths = sorted({config.phases[name].max_seq_length for name in config.phase_order})
    data_dir = data_config.data_dir
    built = []
    try:
        for flag, path in data.paths(data_config):
            storage.check_reachable(path, flag)
    except storage.StorageError as error:
        cli.fail(PROGRAM, str(error))
    try:
        beam_build.pipeline_options(_BEAM_OPTIONS.value, num_units=1)  # fail before any work
        data.check_config(data_config)
        console.log_to_file(data_dir, "prepare.log")
    except data.DataError as error:
        cli.fail(PROGRAM, str(error))
    except OSError as error:
        cli.fail(PROGRAM, f"--config.data.data_dir={data_dir}: {storage.reason(error)}")
    try:
        prepared = data.prepare_all(
            data_config,
            lengths,
            beam_options=_BEAM_OPTIONS.value,
            on_summary=lambda summary: built.append(builder.summary_line(summary, data_dir)),
        )
    except data.DataError as error:
        cli.fail(PROGRAM, str(error))
    if built:
        print(built[0])
    else:
        found = ", ".join(f"seq {s}: {p.directory}" for s, p in sorted(prepared.items()))
        print(f"prepare: nothing to build; already complete ({found})")
    sys.stdout.flush()


def run() -> None:
    """The `lambjax-prepare` command (setup.py's console script)."""
    cli.run(main, "lambjax.prepare", PROGRAM)


if __name__ == "__main__":
    run()
