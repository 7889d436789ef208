"""A sweep's results: a table and plots from each trial's metrics.jsonl.

  python -m lambjax.sweep report DIR

prints the table (overrides, final and best eval MLM accuracy and loss, steps, wall time)
and writes it to DIR/report.md, with DIR/eval_curves.png (eval MLM loss and accuracy
against step, one line per trial) and DIR/final_vs_<field>.png (the final eval MLM accuracy
and loss against each swept field). DIR may also be a single run's workdir. TensorBoard
pointed at DIR shows every trial.

A study's sweep (its config file defines `get_study(arg)`, kept in sweep.json) also gets the
section that answers its question: `study_report(directory, trials, study)` of the module
the study names under "report" (e.g. "studies.pld.report"), imported by name, so the command
runs where that module imports (the repository root, for the studies/ folder).
"""

import importlib
import json
import math
import os

from etils import epath

from lambjax.sweep.plots import pyplot, save
from lambjax.train.metrics import read_jsonl

ACCURACY, LOSS = "eval/mlm_accuracy", "eval/mlm_loss"


def summary(workdir: str) -> dict:
    """Steps, and final and best eval MLM accuracy and loss, of one run's metrics.jsonl."""
    path = epath.Path(workdir) / "metrics.jsonl"
    if not path.exists():
        return {"steps": 0, "final": {}, "best": {}}
    records = read_jsonl(str(path))
    evals = [(step, r) for step, r in sorted(records.items()) if ACCURACY in r]
    result = {"steps": max(records, default=0), "final": {}, "best": {}}
    if evals:
        result["final"] = {ACCURACY: evals[-1][1][ACCURACY], LOSS: evals[-1][1][LOSS]}
        result["best"] = {
            ACCURACY: max(r[ACCURACY] for _, r in evals),
            LOSS: min(r[LOSS] for _, r in evals),
        }
    return result


def trials_of(directory: str) -> dict[str, dict]:
    """name -> {"overrides", "wall_time_s", ...} of a sweep directory, or of one run."""
    sweep_file = epath.Path(directory) / "sweep.json"
    if sweep_file.exists():
        trials = json.loads(sweep_file.read_text())["trials"]
        return {name: {**t, **summary(f"{directory}/{name}")} for name, t in trials.items()}
    if (epath.Path(directory) / "metrics.jsonl").exists():
        name = os.path.basename(os.path.normpath(directory))
        return {name: {"overrides": {}, "status": "", "wall_time_s": None, **summary(directory)}}
    raise FileNotFoundError(f"{directory} holds neither sweep.json nor metrics.jsonl")


def study_of(directory: str) -> dict | None:
    """The config file's `get_study(arg)` the sweep kept in sweep.json, if any."""
    sweep_file = epath.Path(directory) / "sweep.json"
    if not sweep_file.exists():
        return None
    return json.loads(sweep_file.read_text()).get("study")


def columns(trial: dict) -> dict:
    """What a trial's row shows: its labels where it has them, else its overrides."""
    return trial.get("labels") or trial["overrides"]


def table(trials: dict[str, dict]) -> str:
    """A Markdown table, one row per trial, best final MLM accuracy first."""
    fields = list(dict.fromkeys(key for t in trials.values() for key in columns(t)))
    if not any(t.get("labels") for t in trials.values()):
        fields = sorted(fields)
    header = [
        *fields,
        "final acc",
        "best acc",
        "final loss",
        "best loss",
        "steps",
        "time",
        "status",
    ]
    rows = []
    order = sorted(trials.items(), key=lambda kv: -kv[1]["final"].get(ACCURACY, -math.inf))
    for _, trial in order:
        final, best = trial["final"], trial["best"]
        rows.append(
            [
                *(str(columns(trial).get(f, "")) for f in fields),
                _percent(final.get(ACCURACY)),
                _percent(best.get(ACCURACY)),
                _number(final.get(LOSS)),
                _number(best.get(LOSS)),
                str(trial["steps"]),
                _duration(trial.get("wall_time_s")),
                trial.get("status", ""),
            ]
        )
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def write_report(directory: str) -> str:
    """Writes report.md and the plots; returns the table."""
    trials = trials_of(directory)
    text = table(trials)
    name = os.path.basename(os.path.normpath(directory))
    plot_curves(directory, trials)
    plot_finals(directory, trials)
    study = study_of(directory)
    if study is not None:
        text = f"{study_answer(directory, trials, study)}\n\n## Every trial\n\n{text}"
    (epath.Path(directory) / "report.md").write_text(f"# Sweep {name}\n\n{text}\n")
    return text


def study_answer(directory: str, trials: dict, study: dict) -> str:
    """The section that answers a study's question: `study_report` of the module its config's
    get_study names under "report" (e.g. "studies.pld.report")."""
    name = study.get("report")
    if not name:
        raise ValueError(f"sweep.json's study names no report module: {study!r}")
    try:
        module = importlib.import_module(name)
    except ImportError as error:
        raise ValueError(
            f"cannot import the study's report module {name} ({error}); "
            "run the command from the repository root"
        ) from error
    return module.study_report(directory, trials, study)


def plot_curves(directory: str, trials: dict) -> None:
    plt = pyplot()
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, _ in trials.items():
        path = epath.Path(directory) / name / "metrics.jsonl"
        if not path.exists():
            path = epath.Path(directory) / "metrics.jsonl"  # a single run's workdir
        records = read_jsonl(str(path)) if path.exists() else {}
        evals = [(s, r) for s, r in sorted(records.items()) if ACCURACY in r]
        steps = [s for s, _ in evals]
        axes[0].plot(steps, [r[LOSS] for _, r in evals], marker="o", label=name)
        axes[1].plot(steps, [r[ACCURACY] for _, r in evals], marker="o", label=name)
    for axis, title in zip(axes, ("eval MLM loss", "eval MLM accuracy"), strict=True):
        axis.set_xlabel("step")
        axis.set_title(title)
    axes[1].legend(fontsize="small")
    figure.tight_layout()
    save(figure, directory, "eval_curves.png")


def plot_finals(directory: str, trials: dict) -> None:
    plt = pyplot()
    fields = sorted({key for t in trials.values() for key in columns(t)})
    for field in fields:
        points = [
            (columns(t)[field], t["final"][ACCURACY], t["final"][LOSS])
            for t in trials.values()
            if field in columns(t) and t["final"]
        ]
        if not points or not all(isinstance(p[0], int | float) for p in points):
            continue
        points.sort()
        figure, axes = plt.subplots(1, 2, figsize=(9, 3.5))
        axes[0].plot([p[0] for p in points], [p[2] for p in points], "o")
        axes[1].plot([p[0] for p in points], [p[1] for p in points], "o")
        for axis, title in zip(
            axes, ("final eval MLM loss", "final eval MLM accuracy"), strict=True
        ):
            axis.set_xlabel(field)
            axis.set_title(title)
        figure.tight_layout()
        save(figure, directory, f"final_vs_{field}.png")


def _percent(value) -> str:
    return "" if value is None else f"{100 * value:.2f}%"


def _number(value) -> str:
    return "" if value is None else f"{value:.4f}"


def _duration(seconds) -> str:
    if seconds is None:
        return ""
    from lambjax.train.metrics import format_duration

    return format_duration(seconds)
