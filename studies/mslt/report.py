"""The MSLT study's report: steps and training time of each multi-stage arm to the
full-depth baseline's best held-out MLM loss (studies/mslt/config.py).

The trials are labelled (arm, lr, seed). The report reads them by a rule fixed before the
runs:

  baseline  the seed-0 baseline trial with the lowest best held-out MLM loss; that loss is
            the target, and its first evaluation at or below it gives the baseline's steps;
  each arm  its learning rate that reaches the target in the fewest steps (a trial that
            misses it counts as never; ties and misses go to the lower best held-out loss).

Steps and training time to the target are read as studies.curves reads them
(compiling and evaluating not counted). A stage's step time is the median of the logged
step times inside it (the stages are `num_steps` cut into equal shares, the last taking the
remainder, then the final all-layer phase), against the baseline's median step.

Written into DIR: the study's section of report.md, mslt_loss_vs_steps.png and
mslt_loss_vs_time.png (held-out loss of the chosen trials against steps and training time,
the target as a line).
"""

import math
import statistics

from lambjax.sweep import plots
from lambjax.train.metrics import format_duration
from studies import curves
from studies.curves import STEP_TIME, number, rank, steps_to_target, time_at

NAMES = {
    "baseline": "baseline (full depth)",
    "as_implemented": "MSLT as implemented",
    "nothing_frozen": "nothing frozen",
    "one_schedule": "one schedule",
    "decoder": "decoder trained",
}
COLORS = {
    "baseline": "tab:red",
    "as_implemented": "tab:blue",
    "nothing_frozen": "tab:orange",
    "one_schedule": "tab:green",
    "decoder": "tab:purple",
}


def points(directory: str, trials: dict) -> list[dict]:
    """One record per labelled trial: labels, curve, times, best and final loss, step
    times by logged step."""
    result = []
    for name, trial, run in curves.labelled(directory, trials):
        step_times = [(step, r[STEP_TIME]) for step, r in run["records"] if STEP_TIME in r]
        result.append(
            {
                **trial["labels"],
                "name": name,
                **{key: run[key] for key in ("curve", "times", "best", "final", "step_time")},
                "step_times": step_times,
                "status": trial.get("status", ""),
            }
        )
    return result


def baseline(grid: list[dict]) -> dict | None:
    """The baseline trial with the lowest best held-out loss."""
    mine = [p for p in grid if p["arm"] == "baseline" and math.isfinite(p["best"])]
    return min(mine, key=lambda p: p["best"]) if mine else None


def chosen_arms(grid: list[dict], target: float, arms: list[str]) -> list[dict]:
    """Each MSLT arm at its learning rate with the fewest steps to the target."""
    rows = []
    for arm in arms:
        mine = [p for p in grid if p["arm"] == arm and p["curve"]]
        if arm != "baseline" and mine:
            rows.append(min(mine, key=lambda p: rank(p, target)))
    return rows


def stages(study: dict) -> list[tuple[str, int, int]]:
    """(label, first step, last step) of each stage and the final phase, in global steps."""
    depths, num_steps = study["stage_depths"], study["num_steps"]
    share, extra = divmod(num_steps, len(depths))
    result, start = [], 0
    for index, depth in enumerate(depths):
        length = share + (extra if index == len(depths) - 1 else 0)
        trained = depth - (depths[index - 1] if index else 0)
        layers = f"{depth} layer{'s' if depth > 1 else ''}"
        result.append((f"{layers} ({trained} trained)", start + 1, start + length))
        start += length
    result.append(
        (f"final: {depths[-1]} layers (all trained)", start + 1, start + study["final_steps"])
    )
    return result


def stage_step_time(point: dict, first: int, last: int) -> float:
    """The median logged step time of the log windows ending inside [first, last]."""
    inside = [seconds for step, seconds in point["step_times"] if first <= step <= last]
    return statistics.median(inside) if inside else math.nan


def loss_at(curve: list[tuple[int, float]], step: int) -> float:
    """The held-out loss evaluated at `step`; NaN where there is none."""
    return next((loss for s, loss in curve if s == step), math.nan)


def comparison_table(base: dict, rows: list[dict], target: float, study: dict) -> str:
    base_steps = steps_to_target(base["curve"], target)
    base_time = time_at(base["times"], base_steps)
    at = study["num_steps"]
    header = [
        "arm",
        "lr",
        "steps to target",
        "fewer steps",
        "training time to target",
        "speed-up",
        "median step",
        "best loss",
        f"loss at step {at}",
        "final loss",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for p in [base, *rows]:
        steps = steps_to_target(p["curve"], target)
        seconds = time_at(p["times"], steps) if steps is not None else None
        cells = [
            NAMES.get(p["arm"], p["arm"]),
            f"{p['lr']:g}",
            "-" if steps is None else str(steps),
            "" if steps is None else f"{base_steps / steps:.2f}x",
            "-" if seconds is None else f"{seconds:.1f} s",
            "" if seconds is None else f"{base_time / seconds:.2f}x",
            number(1000 * p["step_time"], ".0f", " ms"),
            number(p["best"], ".4f"),
            number(loss_at(p["curve"], at), ".4f"),
            number(p["final"], ".4f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def stage_table(base: dict, rows: list[dict], study: dict) -> str:
    """Median step time per stage, and its ratio to the baseline's median step."""
    parts = stages(study)
    header = ["arm", *(label for label, _, _ in parts)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for p in rows:
        cells = []
        for _, first, last in parts:
            seconds = stage_step_time(p, first, last)
            ratio = seconds / base["step_time"]
            cells.append(f"{number(1000 * seconds, '.0f', ' ms')} ({number(ratio, '.2f')})")
        lines.append(f"| {NAMES.get(p['arm'], p['arm'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def study_report(directory: str, trials: dict, study: dict) -> str:
    """The study's Markdown section; writes its plots into `directory`."""
    every = points(directory, trials)
    grid = [p for p in every if p["seed"] == 0]
    base = baseline(grid)
    lines = ["## MSLT's design choices: steps and time to the baseline's best held-out loss", ""]
    if base is None:
        return "\n".join([*lines, "No baseline trial has a held-out loss yet."])
    target = base["best"]
    rows = chosen_arms(grid, target, study["arms"])
    depths = " -> ".join(map(str, study["stage_depths"]))
    lines += [
        f"Target: the baseline's best held-out MLM loss, {target:.4f} (its lr {base['lr']:g}, "
        f"{study['num_steps']:,} steps). MSLT arms: stages of {depths} layers over "
        f"{study['num_steps']:,} steps, then {study['final_steps']:,} steps of all layers. "
        "`-` = target not reached. Times: the trials' logged step times added up to the "
        "step (no compilation, no evaluation); speed-up: the baseline's training time to "
        "the target over the arm's.",
        "",
        comparison_table(base, rows, target, study),
        "",
        curves.reading_note(
            [base, *rows], curves.fewest_seeds([base, *rows], every, ("arm", "lr"))
        ),
        "",
        f"The paper's claim: more than 110% speed-up ({study['paper_speedup']}x) without "
        "significant degradation.",
        "",
        "Median step time per stage (ratio to the baseline's median step, "
        f"{1000 * base['step_time']:.0f} ms):",
        "",
        stage_table(base, rows, study),
        "",
    ]
    plot_curves(directory, [base, *rows], target)
    seconds = sum(t.get("wall_time_s") or 0.0 for t in trials.values())
    done = sum(t.get("status") == "finished" for t in trials.values())
    lines += [
        f"{done} of {len(trials)} trials finished; their wall times add up to "
        f"{format_duration(seconds)} (trials that ran side by side overlap).",
        "",
        "Plots: mslt_loss_vs_steps.png, mslt_loss_vs_time.png",
    ]
    return "\n".join(lines)


def plot_curves(directory: str, chosen: list[dict], target: float) -> None:
    plt = plots.pyplot()
    for by_time in (False, True):
        figure, axis = plt.subplots(figsize=(7, 4.5))
        for p in chosen:
            curve = [(s, loss) for s, loss in p["curve"] if math.isfinite(loss)]
            axis.plot(
                [time_at(p["times"], s) if by_time else s for s, _ in curve],
                [loss for _, loss in curve],
                marker="o",
                markersize=3,
                color=COLORS.get(p["arm"]),
                label=f"{NAMES.get(p['arm'], p['arm'])} ({p['lr']:g})",
            )
        axis.axhline(target, color="gray", linestyle=":", label=f"target {target:.3f}")
        plots.finish(
            figure,
            axis,
            directory,
            f"mslt_loss_vs_{'time' if by_time else 'steps'}.png",
            xlabel="training time (s)" if by_time else "step",
            ylabel="held-out MLM loss",
            title=f"Held-out MLM loss against {'training time' if by_time else 'steps'}",
        )
