r"""The dataset build's throughput (MB/s) and peak memory, against the in-process builder.

  python benchmarks/prepare.py --baseline_src=/tmp/lambjax-old [--sizes=20,80] [--out=DIR]

For each corpus size (in files of ~2.3 MB: 20 files ~45 MB, 80 files ~180 MB) it runs, as
a user would, `python -m lambjax.prepare` with the default config's data settings (both
phases, seq 128 and 512) on 1 worker and on one worker per core, and the baseline: the
in-process builder of an older lambjax source tree (`--baseline_src`, e.g. `git worktree
add /tmp/lambjax-old bad948e`), which reads the whole corpus into process 0. Each run
starts from an empty data_dir. Peak memory is the largest sum of resident memory over the
whole process tree (Beam's worker processes included), sampled every 0.2 s. It prints
one line per run and the ratios against the baseline of the same corpus.

The corpus recipe (not committed, regenerated the same each time): file i holds CPython's
pydoc topics (pydoc_data.topics, the `embedded` source) as blank-line separated documents,
five copies of them in an order shuffled with seed i.
"""

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COPIES_PER_FILE = 5

BASELINE_PROGRAM = """
import sys
from lambjax import data
config = data.default_config()
config.source, config.data_dir = sys.argv[1], sys.argv[2]
config.vocab_size = int(sys.argv[3])
for seq in (128, 512):
    prepared = data.prepare(config, seq)
    print(seq, prepared.num_examples("train"), prepared.num_examples("validation"))
"""


def write_corpus(directory: str, num_files: int) -> int:
    """Writes the recipe's corpus; returns its size in bytes."""
    from pydoc_data import topics

    documents = [text.strip() for _, text in sorted(topics.topics.items()) if text.strip()]
    os.makedirs(directory, exist_ok=True)
    total = 0
    for index in range(num_files):
        order = documents * COPIES_PER_FILE
        random.Random(index).shuffle(order)
        text = "\n\n".join(order) + "\n"
        with open(os.path.join(directory, f"part-{index:05d}.txt"), "w", encoding="utf-8") as f:
            f.write(text)
        total += len(text.encode())
    return total


def measure(command: list[str], env: dict, cwd: str) -> tuple[float, float, str]:
    """(wall seconds, peak MB of the process tree, the command's last output line)."""
    start = time.monotonic()
    process = subprocess.Popen(
        command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    root, peak = psutil.Process(process.pid), 0
    while process.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
            peak = max(peak, sum(_rss(p) for p in tree))
        except psutil.NoSuchProcess:
            pass
        time.sleep(0.2)
    output = process.stdout.read().strip().splitlines()
    if process.returncode:
        raise SystemExit(f"{' '.join(command)} failed with status {process.returncode}")
    return time.monotonic() - start, peak / 1e6, output[-1] if output else ""


def _rss(process: psutil.Process) -> int:
    try:
        return process.memory_info().rss
    except psutil.NoSuchProcess:
        return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline_src", help="source tree of the in-process builder")
    parser.add_argument("--sizes", default="20,80", help="corpus sizes, in files of ~2.3 MB")
    parser.add_argument("--workers", default=f"1,{os.cpu_count()}", help="DirectRunner workers")
    parser.add_argument("--vocab_size", type=int, default=4096)  # configs/default.py's
    parser.add_argument("--out", default=None, help="where corpora and datasets go")
    args = parser.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="lambjax-prepare-bench-")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    print(f"machine: {os.cpu_count()} cores; results under {out}")
    for num_files in (int(s) for s in args.sizes.split(",")):
        corpus = os.path.join(out, f"corpus-{num_files}")
        megabytes = write_corpus(corpus, num_files) / 1e6
        source = f"text:{corpus}/*.txt"
        baseline = None
        if args.baseline_src:
            data_dir = tempfile.mkdtemp(dir=out, prefix="baseline-")
            command = [sys.executable, "-c", BASELINE_PROGRAM, source, data_dir]
            command.append(str(args.vocab_size))
            seconds, peak, last = measure(
                command, {**env, "PYTHONPATH": args.baseline_src}, args.baseline_src
            )
            baseline = (seconds, peak)
            print(
                f"{num_files} files, {megabytes:.0f} MB, in-process builder: {seconds:.0f} s, "
                f"{megabytes / seconds:.2f} MB/s, peak {peak:.0f} MB ({last})"
            )
        for workers in (int(w) for w in args.workers.split(",")):
            data_dir = tempfile.mkdtemp(dir=out, prefix=f"beam{workers}-")
            command = [
                sys.executable,
                "-m",
                "lambjax.prepare",
                "--config=configs/default.py",
                f"--config.data.source={source}",
                f"--config.data.data_dir={data_dir}",
                f"--config.data.vocab_size={args.vocab_size}",
                f"--beam_pipeline_options=direct_num_workers={workers}",
            ]
            seconds, peak, last = measure(command, env, REPO)
            ratios = ""
            if baseline:
                ratios = (
                    f"; {baseline[0] / seconds:.2f}x the baseline's speed, "
                    f"{peak / baseline[1]:.2f}x its peak memory"
                )
            print(
                f"{num_files} files, {megabytes:.0f} MB, Beam {workers} worker(s): "
                f"{seconds:.0f} s, {megabytes / seconds:.2f} MB/s, peak {peak:.0f} MB{ratios}"
            )
            print(f"  {last}")


if __name__ == "__main__":
    main()
