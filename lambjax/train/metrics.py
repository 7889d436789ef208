"""Where metrics go: TensorBoard and `metrics.jsonl` (every scalar), and the console (one
readable line per log interval, a summary per phase).

For a gs:// workdir both files are written in a local folder that is mirrored into the
bucket (`storage.Mirror`): at every `flush` (the trainer flushes before each checkpoint, so
the bucket's metrics always reach the last checkpoint) and every `sync_interval_s` seconds.

A run that resumes from a checkpoint logs again the steps after it that the interrupted run
had logged already. `RunWriter.resume_from(step)` keeps each step once: it drops those rows
from metrics.jsonl (the file is rewritten beside itself and renamed over, so a kill leaves the
old file or the new one, never half of one) and marks the restart for TensorBoard with a
SessionLog START event at the next step, which makes TensorBoard discard the earlier run's
events from that step on (tensorboard/backend/event_processing/plugin_event_accumulator.py,
`_CheckForRestartAndMaybePurge`: a run's first START is its beginning, which lambjax writes
when a workdir gets its first events; each later one a restart). The sweep report reads
metrics.jsonl, so both show the same points.
"""

import json
import os
import socket
import time

import jax
import numpy as np
from absl import logging
from clu import parameter_overview
from etils import epath
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.plugins.scalar import summary_v2 as scalar_summary
from tensorboard.plugins.text import summary_v2 as text_summary
from tensorboard.summary.writer import record_writer

from lambjax import storage


class Writer:
    """Where a run's metrics go: every scalar logged at a step (`write_scalars`) and texts
    (`write_texts`: the parameter table). The writers below and the experiment trackers'
    (lambjax.train.tracking) are these; a scalars-only writer leaves `write_texts` as is."""

    def write_scalars(self, step: int, scalars: dict) -> None:
        raise NotImplementedError

    def write_texts(self, step: int, texts: dict[str, str]) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardWriter(Writer):
    """A TensorBoard event file, written without TensorFlow (whose import costs a run
    seconds): scalars as the scalars plugin's float32 tensor summaries (what
    `tf.summary.scalar` writes), texts as the text plugin's. Each write reaches the file at
    once, so what was logged survives a kill -9, as metrics.jsonl's rows do."""

    def __init__(self, logdir: str):
        # Named as TensorFlow names its event files, by the time it is made: TensorBoard reads
        # a folder's files in name order, so a resumed run's comes after the earlier run's.
        made = int(time.time())
        name = f"events.out.tfevents.{made:010d}.{socket.gethostname()}.{os.getpid()}.v2"
        self.path = os.path.join(logdir, name)
        self._file = open(self.path, "ab")  # noqa: SIM115 - closed by close()
        self._records = record_writer.RecordWriter(self._file)
        self._write(_event(file_version="brain.Event:2"))

    def write_scalars(self, step, scalars):
        self._write_summaries(
            step, [scalar_summary.scalar_pb(tag, np.asarray(v)) for tag, v in scalars.items()]
        )

    def write_texts(self, step, texts):
        self._write_summaries(step, [text_summary.text_pb(tag, v) for tag, v in texts.items()])

    def _write_summaries(self, step, summaries) -> None:
        values = [value for summary in summaries for value in summary.value]
        self._write(_event(step=int(step), summary=summary_pb2.Summary(value=values)))

    def _write(self, event) -> None:
        self._records.write(event.SerializeToString())
        self._file.flush()

    def close(self):
        self._file.close()


def _event(**fields):
    return event_pb2.Event(wall_time=time.time(), **fields)


class JsonlWriter(Writer):
    """Appends every scalar write as one JSON line: easy to read back in tests and scripts."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self._path = path
        self._file = self._open()

    def _open(self):
        # Line-buffered: what was logged survives a kill -9.
        return open(self._path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115

    def drop_after(self, step: int) -> int:
        """Removes the rows of steps after `step` (and a row cut short by a kill); returns
        how many rows were removed."""
        self._file.close()
        with open(self._path, encoding="utf-8") as f:
            rows = f.read().splitlines()
        kept = [row for row in rows if _step_of(row) is not None and _step_of(row) <= step]
        if len(kept) < len(rows):
            temporary = f"{self._path}.tmp"
            with open(temporary, "w", encoding="utf-8") as f:
                f.writelines(row + "\n" for row in kept)
            os.replace(temporary, self._path)
        self._file = self._open()
        return len(rows) - len(kept)

    def write_scalars(self, step, scalars):
        record = {"step": int(step), "time": time.time()}
        record.update({k: float(np.asarray(v)) for k, v in scalars.items()})
        self._file.write(json.dumps(record) + "\n")

    def flush(self):
        self._file.flush()

    def close(self):
        self._file.close()


def _step_of(row: str) -> int | None:
    try:
        return int(json.loads(row)["step"])
    except (ValueError, KeyError, TypeError):
        return None


class RunWriter(Writer):
    """The writers of a run's metrics (none on processes other than 0), each given every
    write."""

    def __init__(self, writers, jsonl: JsonlWriter | None = None, logdir=None, earlier=None):
        """`jsonl`: the metrics.jsonl writer among `writers`; `logdir`: the local folder of
        their TensorBoard writer; `earlier`: the name of the newest event file in the
        workdir before that writer was made (an earlier run's)."""
        self.writers = list(writers)
        self.jsonl, self.logdir, self._earlier_events = jsonl, logdir, earlier

    def write_scalars(self, step, scalars):
        for writer in self.writers:
            writer.write_scalars(step, scalars)

    def write_texts(self, step, texts):
        for writer in self.writers:
            writer.write_texts(step, texts)

    def flush(self):
        for writer in self.writers:
            writer.flush()

    def close(self):
        for writer in self.writers:
            writer.close()

    def resume_from(self, step: int) -> None:
        """The run continues after (global) `step`: rows of later steps, logged by an
        interrupted run, are dropped, and TensorBoard is told (see the module doc)."""
        if self.jsonl is None:
            return
        dropped = self.jsonl.drop_after(step)
        if dropped:
            logging.info(
                "metrics.jsonl: dropped %d rows after step %d, logged after the checkpoint this "
                "run resumes from (they are logged again).",
                dropped,
                step,
            )
            self._mark_restart(step)

    def _mark_restart(self, step: int) -> None:
        """SessionLog START at `step + 1`, in a file named to sort right after the
        interrupted run's newest event file, so before this process's (TensorBoard reads a
        folder's event files in name order; theirs are named by the time they were made)."""
        if self._earlier_events is not None:
            name = f"{self._earlier_events}.restart-{step}"
            write_session_start(os.path.join(self.logdir, name), step + 1)


def write_session_start(path: str, step: int) -> None:
    """An event file that holds one SessionLog START event at `step`. TensorBoard takes a
    run's first START for its beginning, and each later one for a restart at its step."""
    start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
    with open(path, "wb") as f:
        writer = record_writer.RecordWriter(f)
        for event in (_event(file_version="brain.Event:2"), _event(step=step, session_log=start)):
            writer.write(event.SerializeToString())


class MirroredWriter(RunWriter):
    """Writers of a local folder that `mirror` copies into the workdir's bucket."""

    def __init__(self, writers, jsonl: JsonlWriter, earlier, mirror: storage.Mirror):
        super().__init__(writers, jsonl, os.fspath(mirror.local), earlier)
        self.mirror = mirror

    def resume_from(self, step: int) -> None:
        super().resume_from(step)
        self.mirror.sync()

    def write_scalars(self, step, scalars):
        super().write_scalars(step, scalars)
        self.mirror.sync(force=False)

    def flush(self):
        super().flush()
        self.mirror.sync()

    def close(self):
        super().close()
        self.mirror.remove_local()  # after a last sync


def create_writer(workdir: str, sync_interval_s: float = 30.0, extra=()) -> RunWriter:
    """TensorBoard event files and `metrics.jsonl` in the workdir, and the `extra` writers
    (experiment tracking: lambjax.train.tracking), on process 0 only."""
    if jax.process_index() > 0:
        return RunWriter([])
    earlier = newest_event_file(workdir)  # before the TensorBoard writer makes its own
    local = workdir
    if storage.is_remote(workdir):
        mirror = storage.Mirror(workdir, sync_interval_s)
        mirror.fetch("metrics.jsonl")  # a resumed run continues it
        local = os.fspath(mirror.local)
    os.makedirs(local, exist_ok=True)
    if earlier is None:  # the run's beginning, for TensorBoard (see the module doc)
        earlier = FIRST_EVENTS
        write_session_start(os.path.join(local, earlier), 0)
    jsonl = JsonlWriter(os.path.join(local, "metrics.jsonl"))
    if not storage.is_remote(workdir):
        writers = [TensorBoardWriter(workdir), jsonl, *extra]
        return RunWriter(writers, jsonl, workdir, earlier)
    writers = [TensorBoardWriter(local), jsonl, *extra]
    return MirroredWriter(writers, jsonl, earlier, mirror)


# Sorts before the event files of TensorBoard's writers (named by the time they are made).
FIRST_EVENTS = "events.out.tfevents.0000000000.start"


def newest_event_file(folder: str) -> str | None:
    """The name of the TensorBoard event file in `folder` that sorts last, if any."""
    path = epath.Path(folder)
    if not path.is_dir():
        return None
    names = sorted(p.name for p in path.iterdir() if p.name.startswith("events.out.tfevents"))
    return names[-1] if names else None


def local_logdir(writer, workdir: str) -> str:
    """Where the profiler writes its traces: the workdir, or for a gs:// workdir the local
    folder that is mirrored into it (the bucket gets them through lambjax's path layer, as
    every file lambjax writes there)."""
    if isinstance(writer, MirroredWriter):
        return os.fspath(writer.mirror.local)
    return workdir


def format_duration(seconds: float) -> str:
    """3725 -> '1h02m', 125 -> '2m05s', 7.2 -> '7s'."""
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{seconds:02d}s"
    return f"{seconds}s"


def format_count(value: float) -> str:
    """12345 -> '12.3k', 2.5e6 -> '2.50M'."""
    if value >= 1e6:
        return f"{value / 1e6:.2f}M"
    if value >= 1e3:
        return f"{value / 1e3:.1f}k"
    return f"{value:.0f}"


def progress_line(
    phase: str, step: int, num_steps: int, train: dict, eta_phase=None, eta_run=None
) -> str:
    """One log interval for a person: where the run is, how it learns, how fast it goes.

    `train` holds the interval's means (loss, mlm_accuracy) and its throughput (tokens_per_s,
    and mfu where the devices' peak is known); the ETAs are in seconds.
    """
    parts = [
        f"{phase} step {step}/{num_steps}",
        f"loss {train['loss']:.4f}",
        f"mlm acc {100 * train['mlm_accuracy']:.1f}%",
    ]
    if "tokens_per_s" in train:
        parts.append(f"{format_count(train['tokens_per_s'])} tok/s")
    if "mfu" in train:
        parts.append(f"MFU {100 * train['mfu']:.1f}%")
    if eta_phase is not None:
        eta = f"ETA {format_duration(eta_phase)}"
        if eta_run is not None and eta_run > eta_phase:
            eta += f" (run ~{format_duration(eta_run)})"
        parts.append(eta)
    return " | ".join(parts)


def run_summary(phases: list[tuple], workdir: str, checkpoints: str) -> str:
    """The end of a run for a person: per (phase, step, seconds, eval metrics), one line."""
    lines = ["Summary:"]
    for name, step, seconds, eval_metrics in phases:
        line = f"  {name}: step {step}, {format_duration(seconds)} in this run"
        if eval_metrics:
            line += (
                f"; eval mlm loss {eval_metrics['mlm_loss']:.4f}, "
                f"mlm acc {100 * eval_metrics['mlm_accuracy']:.1f}%, "
                f"nsp acc {100 * eval_metrics['nsp_accuracy']:.1f}%"
            )
        lines.append(line)
    lines.append(f"  checkpoints: {checkpoints}")
    lines.append(f"  TensorBoard: tensorboard --logdir {workdir} (every scalar: metrics.jsonl)")
    return "\n".join(lines)


class MeanStepTime:
    """A phase's mean step time over the windows measured so far (each weighted by its steps;
    compilation and evaluations excluded by the throughput meter): the ETA it gives is
    steady where one window's rate jumps (a checkpoint, another process on the machine)."""

    def __init__(self):
        self._steps, self._seconds, self._last_step = 0, 0.0, None

    def update(self, step: int, step_time_s: float | None) -> float | None:
        """Adds the window that ends at `step` (None: not measured); the mean so far."""
        if step_time_s is not None and self._last_step is not None and step > self._last_step:
            steps = step - self._last_step
            self._steps += steps
            self._seconds += steps * step_time_s
        self._last_step = step
        return self._seconds / self._steps if self._steps else None


def log_parameters(params, model_config, workdir: str, writer) -> None:
    """The parameter table goes to WORKDIR/parameters.txt and TensorBoard (text); the console
    gets one line with the model's shape and size."""
    if jax.process_index() > 0:
        return
    table = parameter_overview.get_parameter_overview(params, include_stats=False)
    path = epath.Path(workdir) / "parameters.txt"
    storage.write_text(path, f"{model_config}\n\n{table}\n")
    indented = "\n".join("    " + line for line in f"{model_config}\n\n{table}".splitlines())
    writer.write_texts(0, {"parameters": indented})  # indented: preformatted in TensorBoard
    leaves = jax.tree.leaves(params)
    count = sum(int(np.prod(x.shape)) for x in leaves)
    size = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in leaves)
    c = model_config
    logging.info(
        "Model: %d layers, hidden %d, %d heads, FFN %d, vocab %d, %sLN: %s parameters (%s); "
        "table: %s",
        c.num_layers,
        c.hidden_size,
        c.num_heads,
        c.intermediate_size,
        c.vocab_size,
        "Post" if c.layer_norm == "post" else "Pre",
        format_count(count),
        format_bytes(size),
        path,
    )


def format_bytes(size: float) -> str:
    """4098056 -> '4.1 MB'."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size:.0f} B"


def eval_metrics_at(workdir: str, step: int) -> dict:
    """The evaluation metrics metrics.jsonl holds for (global) `step`; {} if none."""
    path = epath.Path(workdir) / "metrics.jsonl"
    if not path.exists():
        return {}
    record = read_jsonl(os.fspath(path)).get(step, {})
    return {k[len("eval/") :]: v for k, v in record.items() if k.startswith("eval/")}


def read_jsonl(path: str) -> dict[int, dict]:
    """metrics.jsonl as {step: merged record}; a later record of a step wins (resumed runs)."""
    records: dict[int, dict] = {}
    for line in epath.Path(path).read_text().splitlines():
        record = json.loads(line)
        records.setdefault(record["step"], {}).update(record)
    return records
