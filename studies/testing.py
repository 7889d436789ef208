"""What the study tests share: a study's sweep directory made up from given curves, for its
report's rules (in-process, no training), and its smallest form run end to end through
`python -m lambjax.sweep` and `report`, as its README's commands run it."""

import json
import os
import sys

from lambjax import cli
from lambjax.sweep import spec
from tests.helpers import REPO, run


def study_module(config: str):
    """The study's config module, from its path under the repository root."""
    return cli.load_module(os.path.join(REPO, config))[0]


def curve_records(curve, step_time=0.1, **logged) -> list[dict]:
    """A trial's metrics.jsonl as the training loop writes it, logging every step up to the
    curve's last: the training loss, the step time (none in the first window, which holds
    the compilation) and `logged` fields; the held-out loss (and an accuracy that rises as
    it falls) at the curve's steps."""
    evals = dict(curve)
    records = []
    for step in range(1, max(evals) + 1):
        record = {"step": step, "train/loss": 7.0, **logged}
        if step > 1:
            record["train/step_time_s"] = step_time
        if step in evals:
            record["eval/mlm_loss"] = evals[step]
            record["eval/mlm_accuracy"] = max(0.0, min(1.0, (8.0 - evals[step]) / 8.0))
        records.append(record)
    return records


def write_sweep(directory, config: str, arg: str, metrics) -> dict:
    """The finished sweep of the study `config` at size `arg`, as `python -m lambjax.sweep`
    leaves it (sweep.json with the study's dict, a workdir per trial), each trial's
    metrics.jsonl the records `metrics(trial)` gives; returns sweep.json's content."""
    module = study_module(config)
    records = {}
    for trial in spec.trials(module.get_config(arg), module.get_sweep(arg)):
        (directory / trial.name).mkdir(parents=True)
        lines = "".join(json.dumps(r) + "\n" for r in metrics(trial))
        (directory / trial.name / "metrics.jsonl").write_text(lines)
        records[trial.name] = {
            "overrides": trial.overrides,
            **({"labels": trial.labels} if trial.labels else {}),
            "status": "finished",
            "wall_time_s": 1.0,
        }
    state = {"config": f"{config}:{arg}", "flags": [], "trials": records}
    state["study"] = module.get_study(arg)
    (directory / "sweep.json").write_text(json.dumps(state, indent=2))
    return json.loads(json.dumps(state))


def run_study(config: str, workdir, data_dir: str, *, devices: int = 1, timeout=1200):
    """A study's `smoke` size through `python -m lambjax.sweep` (two trials at a time) and
    `report`, as its README commands run it. Checks every trial finished, the study's dict
    reached sweep.json and the report printed what it wrote; returns (sweep.json, report.md).
    """
    command = [sys.executable, "-m", "lambjax.sweep", f"--config={config}:smoke"]
    command += [f"--workdir={workdir}", f"--config.data.data_dir={data_dir}", "--parallel=2"]
    run(command, devices, timeout=timeout)
    state = json.loads((workdir / "sweep.json").read_text())
    assert state["study"] == json.loads(json.dumps(study_module(config).get_study("smoke")))
    assert {t["status"] for t in state["trials"].values()} == {"finished"}
    result = run([sys.executable, "-m", "lambjax.sweep", "report", str(workdir)], 1)
    report = (workdir / "report.md").read_text()
    assert report.split("\n", 2)[2].strip() in result.stdout
    return state, report
