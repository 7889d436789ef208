"""The standardization-loss study's report: per optimizer, steps and training time to the
LayerNorm model's best held-out MLM loss (studies/standardization_loss/config.py).

The trials are labelled (optimizer, arm, weight, seed): arm `layer_norm` (the baseline),
`none` (no normalization, weight 0), `residual` or `preactivation` (no normalization, the
standardization loss at that site and weight). The report reads them by a rule fixed before
the runs, per optimizer (seed 0):

  target    the LayerNorm trial's best held-out MLM loss (the paper's "baseline
            accuracy"); a second target, the no-normalization trial's best;
  each site the weight that reaches the target in the fewest steps (a trial that misses it
            counts as never; ties and misses go to the lower best held-out loss).

Steps and training time to a target are read as studies.curves reads them (compiling
and evaluating not counted). Beside each arm's steps as a multiple of LayerNorm's stands
the paper's (ResNet-50: batch norm 39.5K, the loss 40.0K, neither 89.4K steps).

Written into DIR: the study's section of report.md, standardization_loss_loss_vs_steps.png
and standardization_loss_loss_vs_time.png (held-out loss of the chosen trials, one panel per
optimizer, each target a line).
"""

import math

from lambjax.sweep import plots
from lambjax.train.metrics import format_duration
from studies import curves
from studies.curves import number, rank, steps_to_target, time_at

STD_LOSS = "train/standardization_loss"
ARM_NAMES = {
    "layer_norm": "LayerNorm",
    "none": "no normalization",
    "residual": "std loss, residual sums",
    "preactivation": "std loss, pre-activations",
}
COLORS = {
    "layer_norm": "tab:red",
    "none": "tab:gray",
    "residual": "tab:blue",
    "preactivation": "tab:green",
}
# The paper's arm each of ours stands for, for its steps ratio.
PAPER_ARM = {
    "layer_norm": "batch_norm",
    "none": "none",
    "residual": "standardization_loss",
    "preactivation": "standardization_loss",
}


def points(directory: str, trials: dict) -> list[dict]:
    """One record per labelled trial: labels, curve, best and final loss, step times, and
    the logged (unweighted) L_std at the first and last log step, where there is one."""
    result = []
    for name, trial, run in curves.labelled(directory, trials):
        std = [r[STD_LOSS] for _, r in run["records"] if STD_LOSS in r]
        result.append(
            {
                **trial["labels"],
                "name": name,
                **{key: run[key] for key in ("curve", "times", "best", "final", "step_time")},
                "std_loss": (std[0], std[-1]) if std else None,
                "status": trial.get("status", ""),
            }
        )
    return result


def arms(grid: list[dict], sites) -> tuple[float, float, list[tuple[str, dict]]] | None:
    """(target, second target, [(arm, chosen point)]) of one optimizer's trials: the
    LayerNorm and no-normalization trials, then each site at its best weight. None without
    a LayerNorm trial that has a held-out loss."""
    by_arm = {}
    for point in grid:
        by_arm.setdefault(point["arm"], []).append(point)
    layer_norm = [p for p in by_arm.get("layer_norm", []) if math.isfinite(p["best"])]
    if not layer_norm:
        return None
    target = layer_norm[0]["best"]
    rows = [("layer_norm", layer_norm[0])]
    none = by_arm.get("none", [])
    if none:
        rows.append(("none", none[0]))
    second = none[0]["best"] if none and math.isfinite(none[0]["best"]) else math.nan
    for site in sites:
        if by_arm.get(site):
            rows.append((site, min(by_arm[site], key=lambda p: rank(p, target))))
    return target, second, rows


def to_target(point: dict, target: float) -> tuple[int | None, float | None]:
    """(steps, training seconds) to `target`; (None, None) where it is not reached."""
    if not math.isfinite(target):
        return None, None
    steps = steps_to_target(point["curve"], target)
    return steps, None if steps is None else time_at(point["times"], steps)


def comparison_table(rows, target: float, second: float, paper_steps: dict) -> str:
    base_steps, base_time = to_target(rows[0][1], target)
    paper_base = paper_steps["batch_norm"]
    header = [
        "arm",
        "weight",
        "steps to target",
        "x LayerNorm's steps",
        "paper's x",
        "training time to target",
        "x LayerNorm's time",
        "steps to no-norm's best",
        "best loss",
        "final loss",
        "step time",
        "L_std first -> last",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for arm, p in rows:
        steps, seconds = to_target(p, target)
        second_steps, _ = to_target(p, second)
        std = p["std_loss"]
        cells = [
            ARM_NAMES[arm],
            f"{p['weight']:g}" if arm in ("residual", "preactivation") else "",
            "-" if steps is None else str(steps),
            "" if steps is None or base_steps is None else f"{steps / base_steps:.2f}",
            f"{paper_steps[PAPER_ARM[arm]] / paper_base:.2f}",
            "-" if seconds is None else f"{seconds:.1f} s",
            "" if seconds is None or not base_time else f"{seconds / base_time:.2f}",
            "-" if second_steps is None else str(second_steps),
            number(p["best"], ".4f"),
            number(p["final"], ".4f"),
            number(1000 * p["step_time"], ".0f", " ms"),
            "" if std is None else f"{std[0]:.0f} -> {std[1]:.0f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def grid_table(grid: list[dict], target: float, weights, sites) -> str:
    """Every loss trial of one optimizer: steps to the target / best held-out loss, by site
    and weight."""
    header = ["site", *(f"weight {w:g}" for w in weights)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for site in sites:
        mine = {p["weight"]: p for p in grid if p["arm"] == site}
        cells = [curves.grid_cell(mine.get(weight), target) for weight in weights]
        lines.append(f"| {site} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def study_report(directory: str, trials: dict, study: dict) -> str:
    """The study's Markdown section; writes its plots into `directory`."""
    all_seeds = points(directory, trials)
    every = [p for p in all_seeds if p["seed"] == 0]
    lines = [
        "## The standardization loss against LayerNorm and no normalization: steps and "
        "time to LayerNorm's best held-out loss",
        "",
    ]
    panels = []
    for optimizer, learning_rate in study["learning_rates"].items():
        grid = [p for p in every if p["optimizer"] == optimizer]
        found = arms(grid, study["sites"])
        lines += [f"### {optimizer} (learning rate {learning_rate:g})", ""]
        if found is None:
            lines += ["No LayerNorm trial has a held-out loss yet.", ""]
            continue
        target, second, rows = found
        panels.append((optimizer, target, second, rows))
        lines += [
            f"Target: the LayerNorm trial's best held-out MLM loss, {target:.4f}; second "
            f"target: the no-normalization trial's best, {number(second, '.4f')}. Each site "
            "at the weight that reaches the target in the fewest steps (misses and ties: "
            f"the lower best loss); every trial {study['num_steps']:,} steps. `-` = not "
            "reached. Times: the trials' logged step times added up to the step (no "
            "compilation, no evaluation). L_std: the unweighted loss, first and last "
            "logged.",
            "",
            comparison_table(rows, target, second, study["paper_steps"]),
            "",
            curves.reading_note(
                [p for _, p in rows],
                curves.fewest_seeds(
                    [p for _, p in rows], all_seeds, ("optimizer", "arm", "weight")
                ),
            ),
            "",
            "Every weight (steps to the target / best held-out MLM loss):",
            "",
            grid_table(grid, target, study["weights"], study["sites"]),
            "",
        ]
    paper = study["paper_steps"]
    lines += [
        f"The paper's claim (ResNet-50, steps to the batch-norm baseline's accuracy): batch "
        f"norm {paper['batch_norm']}K, the standardization loss "
        f"{paper['standardization_loss']}K, neither {paper['none']}K.",
        "",
    ]
    if panels:
        plot_curves(directory, panels)
    seconds = sum(t.get("wall_time_s") or 0.0 for t in trials.values())
    done = sum(t.get("status") == "finished" for t in trials.values())
    lines += [
        f"{done} of {len(trials)} trials finished; their wall times add up to "
        f"{format_duration(seconds)} (trials that ran side by side overlap).",
        "",
        "Plots: standardization_loss_loss_vs_steps.png, standardization_loss_loss_vs_time.png",
    ]
    return "\n".join(lines)


def plot_curves(directory: str, panels: list) -> None:
    plt = plots.pyplot()
    for by_time in (False, True):
        figure, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
        for axis, (optimizer, target, second, rows) in zip(axes[0], panels, strict=True):
            for arm, p in rows:
                curve = [(s, loss) for s, loss in p["curve"] if math.isfinite(loss)]
                xs = [time_at(p["times"], s) if by_time else s for s, _ in curve]
                weight = f" ({p['weight']:g})" if arm in ("residual", "preactivation") else ""
                axis.plot(
                    xs,
                    [loss for _, loss in curve],
                    marker="o",
                    markersize=2,
                    color=COLORS[arm],
                    label=ARM_NAMES[arm] + weight,
                )
            axis.axhline(target, color="tab:red", linestyle=":", label=f"target {target:.3f}")
            if math.isfinite(second):
                axis.axhline(second, color="gray", linestyle=":", label=f"no-norm's {second:.3f}")
            axis.set_xlabel("training time (s)" if by_time else "step")
            axis.set_ylabel("held-out MLM loss")
            axis.set_title(optimizer)
            axis.legend(fontsize="small")
            axis.grid(True, alpha=0.3)
        figure.tight_layout()
        name = f"standardization_loss_loss_vs_{'time' if by_time else 'steps'}.png"
        plots.save(figure, directory, name)
