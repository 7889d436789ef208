"""The Ouroboros study's report: the held-out MLM loss of training with delayed gradients
(K modules on K - 1 stages) against ordinary backpropagation (studies/ouroboros/config.py).

The trials are labelled (modules, replay, warmup, seed). The rule, fixed by the study
before its runs:

  baseline   the K = 1 trial of seed 0;
  tolerance  the spread of the K = 1 seeds (seed 0 and the study's `noise_seed`: their
             gap), in final held-out MLM loss for the final loss, in best for the best;
  verdict    an arm is comparable where its gap to the baseline is within the tolerance,
             better where it is lower by more, worse where it is higher by more.

The verdict is read as studies.curves.seed_verdict reads it: from fewer than
curves.MIN_SEEDS K = 1 seeds the tolerance is one sample of the seed's effect (which also
moves with the held-out set's masks), so every gap is reported as `inconclusive`, with its
size in tolerances, not as better, worse or comparable.

Written into DIR: the study's section of report.md and ouroboros_loss_vs_steps.png (the
held-out loss of every trial against the step; the last half of the run on its own panel).
"""

import math

from lambjax.sweep import plots
from lambjax.train.metrics import format_duration
from studies import curves
from studies.curves import number

VERDICTS = ("better", "comparable", "worse")


def points(directory: str, trials: dict) -> list[dict]:
    """One record per labelled trial: labels, held-out curve, best and final loss."""
    result = []
    for name, trial, run in curves.labelled(directory, trials):
        finished = bool(run["curve"]) and trial.get("status") == "finished"
        result.append(
            {
                **trial["labels"],
                "name": name,
                **{key: run[key] for key in ("curve", "best", "step_time")},
                "final": run["final"] if finished else math.nan,
                "status": trial.get("status", ""),
            }
        )
    return result


def baselines(grid: list[dict], noise_seed: int) -> tuple[dict | None, dict | None]:
    """(the K = 1 trial of seed 0, the K = 1 trial of `noise_seed`); None where missing."""
    synchronous = {p["seed"]: p for p in grid if p["modules"] == 1}
    return synchronous.get(0), synchronous.get(noise_seed)


def synchronous_seeds(grid: list[dict]) -> list[dict]:
    """The K = 1 trials with a held-out loss, one per seed."""
    return [p for p in grid if p["modules"] == 1 and p["curve"]]


def tolerances(synchronous: list[dict]) -> dict:
    """{'final': .., 'best': ..}: the spread (largest minus smallest) of the K = 1 seeds in
    each; nan with fewer than two."""
    if len(synchronous) < 2:
        return {"final": math.nan, "best": math.nan}
    return {
        key: max(p[key] for p in synchronous) - min(p[key] for p in synchronous)
        for key in ("final", "best")
    }


def verdict(gap: float, tolerance: float, seeds: int) -> str:
    """The gap against the K = 1 seeds' spread (`seeds` of them), as
    curves.seed_verdict reads it; `-` where either is unknown."""
    return curves.seed_verdict(gap, tolerance, seeds, noun="the seed gap")


def arm_name(point: dict) -> str:
    if point["modules"] == 1:
        return f"K = 1, seed {point['seed']}"
    warm = f", {point['warmup']} synchronous steps first" if point["warmup"] else ""
    return f"K = {point['modules']}, {point['replay']}{warm}"


def comparison_table(grid: list[dict], base: dict, tolerance: dict, seeds: int) -> str:
    header = [
        "arm",
        "final loss",
        "gap",
        "verdict (final)",
        "best loss",
        "gap",
        "verdict (best)",
        "step time",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for p in grid:
        cells = [arm_name(p)]
        for key in ("final", "best"):
            gap = p[key] - base[key]
            cells += [number(p[key], ".4f"), number(gap, "+.4f")]
            cells.append("baseline" if p is base else verdict(gap, tolerance[key], seeds))
        cells.append(
            number(1000 * p["step_time"], ".0f") + (" ms" if math.isfinite(p["step_time"]) else "")
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def seeds_note(seeds: int) -> str:
    """What the tolerance can carry, by the number of K = 1 seeds behind it."""
    if seeds >= curves.MIN_SEEDS:
        return "An arm beyond the tolerance reads better or worse, within it comparable."
    return (
        f"From {seeds} K = 1 seed{'s' if seeds != 1 else ''} the tolerance is one sample of "
        f"the seed's effect, so no arm reads better, worse or comparable (that needs "
        f"{curves.MIN_SEEDS} seeds): each gap is given as a multiple of it."
    )


def curve_table(grid: list[dict]) -> str:
    """The held-out loss of every trial at every evaluation."""
    steps = sorted({s for p in grid for s, _ in p["curve"]})
    lines = ["| step | " + " | ".join(arm_name(p) for p in grid) + " |"]
    lines.append("|---|" + "---|" * len(grid))
    for step in steps:
        row = [number(dict(p["curve"]).get(step, math.nan), ".4f") for p in grid]
        lines.append(f"| {step} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def study_report(directory: str, trials: dict, study: dict) -> str:
    """The study's Markdown section; writes its plot into `directory`."""
    grid = points(directory, trials)
    base, _ = baselines(grid, study["noise_seed"])
    lines = ["## Ouroboros against ordinary backpropagation: held-out MLM loss", ""]
    if base is None or not base["curve"]:
        return "\n".join([*lines, "The K = 1 baseline (seed 0) has no held-out loss yet."])
    synchronous = synchronous_seeds(grid)
    tolerance = tolerances(synchronous)
    lines += [
        f"Every trial {study['num_steps']:,} steps with the same schedule (the rate decays to "
        f"0 at the last step) on {study['devices']} devices; K = {study['modules']} on "
        f"{study['modules'] - 1} pipeline stages. Baseline: K = 1, seed 0. Tolerance (the "
        f"spread of the {len(synchronous)} K = 1 seeds): {number(tolerance['final'], '.4f')} "
        f"in final, {number(tolerance['best'], '.4f')} in best held-out MLM loss. "
        f"{seeds_note(len(synchronous))} Step time: the median logged step (fake devices "
        "sharing the host's cores: not a speed measurement).",
        "",
        comparison_table(grid, base, tolerance, len(synchronous)),
        "",
        "The paper's claim: comparable or better accuracy than ordinary backpropagation.",
        "",
        "Held-out MLM loss at every evaluation:",
        "",
        curve_table(grid),
        "",
    ]
    plot_curves(directory, grid)
    seconds = sum(t.get("wall_time_s") or 0.0 for t in trials.values())
    done = sum(t.get("status") == "finished" for t in trials.values())
    lines += [
        f"{done} of {len(trials)} trials finished; their wall times add up to "
        f"{format_duration(seconds)} (trials that ran side by side overlap).",
        "",
        "Plot: ouroboros_loss_vs_steps.png",
    ]
    return "\n".join(lines)


def style(point: dict) -> tuple[str, str]:
    """(colour, line style): K = 1 black, stale blue, current orange; warm-up dashed."""
    if point["modules"] == 1:
        return ("black" if point["seed"] == 0 else "gray"), "-"
    color = "tab:blue" if point["replay"] == "stale" else "tab:orange"
    return color, "--" if point["warmup"] else "-"


def plot_curves(directory: str, grid: list[dict]) -> None:
    figure, axes = plots.pyplot().subplots(1, 2, figsize=(11, 4.5))
    last = max((s for p in grid for s, _ in p["curve"]), default=0)
    for axis, start in zip(axes, (0, last // 2), strict=True):
        for p in grid:
            curve = [(s, loss) for s, loss in p["curve"] if s >= start and math.isfinite(loss)]
            color, line = style(p)
            axis.plot(
                [s for s, _ in curve],
                [loss for _, loss in curve],
                line,
                marker="o",
                markersize=3,
                color=color,
                label=arm_name(p),
            )
        axis.set_xlabel("step")
        axis.set_ylabel("held-out MLM loss")
        axis.grid(True, alpha=0.3)
    axes[0].set_title("Held-out MLM loss")
    axes[1].set_title("The second half")
    axes[0].legend(fontsize="small")
    figure.tight_layout()
    plots.save(figure, directory, "ouroboros_loss_vs_steps.png")
