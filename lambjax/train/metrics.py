"""Metric writing: clu writers (TensorBoard + log) and a JSON-lines copy."""

import json
import os
import time

import jax
import numpy as np
from clu import metric_writers


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


def create_writer(workdir: str) -> metric_writers.MetricWriter:
    """TensorBoard + log on process 0 (and `metrics.jsonl`); log-only elsewhere."""
    if jax.process_index() > 0:
        return metric_writers.create_default_writer(workdir, just_logging=True)
    return metric_writers.MultiWriter(
        [
            metric_writers.create_default_writer(workdir, asynchronous=False),
            JsonlWriter(os.path.join(workdir, "metrics.jsonl")),
        ]
    )


def read_jsonl(path: str) -> dict[int, dict]:
    """metrics.jsonl as {step: merged record}; a later record of a step wins (resumed runs)."""
    records: dict[int, dict] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            records.setdefault(record["step"], {}).update(record)
    return records
