"""Where metrics go: TensorBoard and `metrics.jsonl` (every scalar), and the console (one
readable line per log interval, a summary per phase).

For a gs:// workdir both files are written in a local folder that is mirrored into the
bucket (`storage.Mirror`): at every `flush` (the trainer flushes before each checkpoint, so
the bucket's metrics always reach the last checkpoint) and every `sync_interval_s` seconds.
"""

import json
import os
import time

import jax
import numpy as np
from absl import logging
from clu import metric_writers, parameter_overview
from etils import epath

from lambjax import storage


class JsonlWriter(metric_writers.MetricWriter):
    """Appends every scalar write as one JSON line: easy to read back in tests and scripts."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # Line-buffered: what was logged survives a kill -9.
        self._file = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115

    def write_scalars(self, step, scalars):
        record = {"step": int(step), "time": time.time()}
        record.update({k: float(np.asarray(v)) for k, v in scalars.items()})
        self._file.write(json.dumps(record) + "\n")

    def write_summaries(self, step, values, metadata=None):
        pass

    def write_images(self, step, images):
        pass

    def write_videos(self, step, videos):
        pass

    def write_audios(self, step, audios, *, sample_rate):
        pass

    def write_texts(self, step, texts):
        pass

    def write_histograms(self, step, arrays, num_buckets=None):
        pass

    def write_pointcloud(self, step, point_clouds, *, point_colors=None, configs=None):
        pass

    def write_hparams(self, hparams):
        pass

    def flush(self):
        self._file.flush()

    def close(self):
        self._file.close()


class MirroredWriter(metric_writers.MultiWriter):
    """Writers of a local folder that `mirror` copies into the workdir's bucket."""

    def __init__(self, writers, mirror: storage.Mirror):
        super().__init__(writers)
        self.mirror = mirror

    def write_scalars(self, step, scalars):
        super().write_scalars(step, scalars)
        self.mirror.sync(force=False)

    def flush(self):
        super().flush()
        self.mirror.sync()

    def close(self):
        super().close()
        self.mirror.sync()
        self.mirror.remove_local()


def create_writer(
    workdir: str, sync_interval_s: float = 30.0, extra=()
) -> metric_writers.MetricWriter:
    """TensorBoard event files and `metrics.jsonl` in the workdir, and the `extra` writers
    (experiment tracking: lambjax.train.tracking), on process 0 only."""
    if jax.process_index() > 0:
        return metric_writers.MultiWriter([])
    if not storage.is_remote(workdir):
        return metric_writers.MultiWriter(
            [
                metric_writers.SummaryWriter(workdir),
                JsonlWriter(os.path.join(workdir, "metrics.jsonl")),
                *extra,
            ]
        )
    mirror = storage.Mirror(workdir, sync_interval_s)
    mirror.fetch("metrics.jsonl")  # a resumed run continues it
    local = os.fspath(mirror.local)
    return MirroredWriter(
        [
            metric_writers.SummaryWriter(local),
            JsonlWriter(os.path.join(local, "metrics.jsonl")),
            *extra,
        ],
        mirror,
    )


def local_logdir(writer, workdir: str) -> str:
    """Where TensorFlow-based writers (the profiler) may write: the workdir, or for a gs://
    workdir the local folder that is mirrored into it."""
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
