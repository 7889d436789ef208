"""The batch-scaling study's report: steps to a target held-out loss against batch size.

A study is a sweep whose config file also defines `get_study(arg)`; the sweep keeps that
dict in sweep.json and `python -m lambjax.sweep report DIR` adds its answer to the report.
This module answers `{"kind": "batch_scaling", ...}` (studies/batch_scaling/config.py):
the trials are labelled (optimizer, batch, lr_x, seed), learning-rate multipliers on the
square-root rule, and the arms are read off them by a rule fixed before the runs:

  sqrt rule  the multiplier the study declares for the optimizer (`rule_multipliers`), or
             the one best at the smallest batch, kept at every batch size;
  tuned      for the optimizers with a grid at every batch size (`tuned`), the multiplier
             best at each batch size;

"best" is the fewest steps to the target eval MLM loss, then the lower final loss (a trial
that never reaches the target counts as infinitely many steps). Steps to the target are
the first evaluation step whose eval MLM loss is at or below it (evaluations come every
1/evals_per_trial of the run, so a count is exact to that interval, and the speed-up table
gives the range of each ratio that the intervals allow).

Written into DIR: the study's section of report.md (a table per arm and batch size, the
noise band of the repeated seeds, the other targets), steps_to_target.png (log-log, one
line per arm, the perfect-scaling line and the sample budget), final_loss.png and
learning_rates.png (the multiplier-scaled learning rate each arm used).
"""

import math

from lambjax.sweep import plots
from lambjax.train.metrics import format_duration
from studies import curves
from studies.curves import steps_to_target

ARMS = ("sqrt rule", "tuned")
STYLES = {"lamb": ("tab:blue", "o"), "lans": ("tab:green", "s"), "adamw": ("tab:red", "^")}


def points(directory: str, trials: dict, target: float) -> list[dict]:
    """One record per labelled trial: its labels, learning rate, steps to target, losses."""
    result = []
    for name, trial, run in curves.labelled(directory, trials):
        curve = run["curve"]
        result.append(
            {
                **trial["labels"],
                "name": name,
                "learning_rate": trial["overrides"].get("phases.phase1.learning_rate"),
                "num_steps": trial["overrides"].get("phases.phase1.num_steps"),
                "steps": steps_to_target(curve, target),
                "bracket": curves.target_bracket(curve, target),
                "final": curve[-1][1] if curve else None,
                "done": trial.get("status") == "finished",
                "status": trial.get("status", ""),
                "curve": curve,
            }
        )
    return result


def rank(point: dict) -> tuple:
    """Fewer steps to the target first, then lower final loss; misses and failures last."""
    steps = point["steps"] if point["steps"] is not None else math.inf
    final = point["final"] if point["final"] is not None and point["done"] else math.inf
    return (steps, final if math.isfinite(final) else math.inf)


def arms(grid: list[dict], batch_sizes: list[int], study: dict | None = None) -> dict:
    """(optimizer, arm) -> batch size -> the chosen point, from the seed-0 grid.

    The sqrt rule keeps the multiplier `study["rule_multipliers"]` declares for the
    optimizer, else the one best at the smallest batch; the tuned arm (optimizers in
    `study["tuned"]`, all without a study) takes the best at each batch size.
    """
    study = study or {}
    declared = study.get("rule_multipliers", {})
    result = {}
    for optimizer in dict.fromkeys(p["optimizer"] for p in grid):
        mine = [p for p in grid if p["optimizer"] == optimizer]
        at = {b: [p for p in mine if p["batch"] == b] for b in batch_sizes}
        at = {b: ps for b, ps in at.items() if ps}
        if not at:
            continue
        base = declared.get(optimizer, min(at[min(at)], key=rank)["lr_x"])
        result[(optimizer, "sqrt rule")] = {
            b: p for b, ps in at.items() for p in ps if p["lr_x"] == base
        }
        if optimizer in study.get("tuned", [optimizer]):
            result[(optimizer, "tuned")] = {b: min(ps, key=rank) for b, ps in at.items()}
    return result


def base_check(grid: list[dict], batch_sizes: list[int], study: dict) -> str:
    """For the optimizers whose base is declared: is it the best of the grid at B0?"""
    lines = []
    for optimizer, declared in study.get("rule_multipliers", {}).items():
        at_b0 = [p for p in grid if p["optimizer"] == optimizer and p["batch"] == batch_sizes[0]]
        if len(at_b0) < 2:
            continue
        best = min(at_b0, key=rank)
        cells = ", ".join(
            f"lr_x {p['lr_x']}: {'-' if p['steps'] is None else p['steps']} steps, "
            f"final {p['final']:.3f}"
            for p in sorted(at_b0, key=lambda p: p["lr_x"])
            if p["final"] is not None
        )
        verdict = "the declared base" if best["lr_x"] == declared else "NOT the declared base"
        lines.append(
            f"- {optimizer} at B={batch_sizes[0]}: {cells}; best lr_x {best['lr_x']} "
            f"({verdict}, lr_x {declared})"
        )
    return "\n".join(lines)


def study_report(directory: str, trials: dict, study: dict) -> str:
    """The study's Markdown section; writes its plots into `directory`."""
    target, samples = study["target_loss"], study["samples"]
    batch_sizes = study["batch_sizes"]
    every = points(directory, trials, target)
    grid = [p for p in every if p["seed"] == 0]
    chosen = arms(grid, batch_sizes, study)
    lines = [
        "## Batch scaling: steps to the target against batch size",
        "",
        f"Target: eval MLM loss <= {target} (fixed in the config before the runs). Every "
        f"trial: {samples:,} sequences (num_steps = {samples:,} / batch). Learning rate = "
        "base x sqrt(batch / smallest batch) x lr_x; `sqrt rule` keeps one lr_x (declared, "
        "or the best at the smallest batch), `tuned` takes the best lr_x at each batch size "
        "(fewest steps to the target, then the lower final loss). `-` = target not "
        "reached within the budget; `(edge)` = the tuned lr_x is at the grid's edge.",
        "",
        arm_table(chosen, batch_sizes, study["multipliers"]),
        "",
        "Speed-up in steps to the target from each doubling of the batch (2.00 = perfect "
        "scaling; in brackets the range the evaluation intervals allow, since a count is "
        "exact only to its trial's interval, 1/evals_per_trial of its steps):",
        "",
        speedup_table(chosen, batch_sizes),
        "",
    ]
    check = base_check(grid, batch_sizes, study)
    if check:
        lines += ["The declared bases against their grid at the smallest batch:", "", check, ""]
    noise = noise_table(every)
    if noise:
        lines += ["Noise: the same trial (lr_x = 1) with other seeds:", "", noise, ""]
    for other in study.get("other_targets", []):
        others = points(directory, trials, other)
        lines += [
            f"At target {other} (same choice rule):",
            "",
            arm_table(arms([p for p in others if p["seed"] == 0], batch_sizes, study), batch_sizes),
            "",
        ]
    plot_steps(directory, chosen, batch_sizes, samples, target)
    plot_finals(directory, chosen, batch_sizes)
    plot_learning_rates(directory, chosen, batch_sizes)
    seconds = sum(t.get("wall_time_s") or 0.0 for t in trials.values())
    done = sum(t.get("status") == "finished" for t in trials.values())
    lines.append(
        f"{done} of {len(trials)} trials finished; their wall times add up to "
        f"{format_duration(seconds)} (trials that ran side by side overlap)."
    )
    lines.append("")
    lines.append("Plots: steps_to_target.png, final_loss.png, learning_rates.png")
    return "\n".join(lines)


def arm_table(chosen: dict, batch_sizes: list[int], multipliers=None) -> str:
    header = ["optimizer", "arm", *(f"B={b}" for b in batch_sizes)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (optimizer, arm), by_batch in chosen.items():
        cells = []
        for b in batch_sizes:
            p = by_batch.get(b)
            if p is None:
                cells.append("")
                continue
            if not p["done"] and not p["status"].startswith("failed"):
                cells.append(f"({p['status'] or 'not run'})")
                continue
            steps = "-" if p["steps"] is None else str(p["steps"])
            final = "failed" if not p["done"] else f"{p['final']:.3f}"
            edge = ""
            at_edge = p["lr_x"] in (min(multipliers or [0]), max(multipliers or [0]))
            if arm == "tuned" and len(multipliers or []) > 1 and at_edge:
                edge = " (edge)"
            cells.append(f"{steps} / {final} / lr {p['learning_rate']:.3g}{edge}")
        lines.append(f"| {optimizer} | {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\nCells: steps to target / final eval MLM loss / learning rate."


def speedup_table(chosen: dict, batch_sizes: list[int]) -> str:
    """Steps at one batch over steps at the next, and in brackets the range the two
    evaluation intervals allow (each count is exact only to its trial's interval)."""
    pairs = list(zip(batch_sizes, batch_sizes[1:], strict=False))
    header = ["optimizer", "arm", *(f"{a}->{b}" for a, b in pairs)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (optimizer, arm), by_batch in chosen.items():
        cells = []
        for a, b in pairs:
            pa, pb = by_batch.get(a), by_batch.get(b)
            if pa and pb and pa["steps"] and pb["steps"]:
                cell = f"{pa['steps'] / pb['steps']:.2f}"
                if pa.get("bracket") and pb.get("bracket"):
                    low, high = curves.ratio_range(pa["bracket"], pb["bracket"])
                    cell += f" ({low:.2f}-{high:.2f})"
                cells.append(cell)
            else:
                cells.append("")
        lines.append(f"| {optimizer} | {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def noise_table(every: list[dict]) -> str:
    """Per optimizer and batch size with repeated seeds (lr_x = 1): the spread."""
    repeated = {(p["optimizer"], p["batch"]) for p in every if p["seed"] != 0}
    if not repeated:
        return ""
    lines = [
        "| optimizer | batch | seeds | steps to target | final eval MLM loss |",
        "|---|---|---|---|---|",
    ]
    for optimizer, batch in sorted(repeated):
        runs = sorted(
            (p for p in every if (p["optimizer"], p["batch"]) == (optimizer, batch)),
            key=lambda p: p["seed"],
        )
        runs = [p for p in runs if p["lr_x"] == 1.0]
        steps = ", ".join("-" if p["steps"] is None else str(p["steps"]) for p in runs)
        finals = [p["final"] for p in runs if p["final"] is not None]
        spread = (
            f"{sum(finals) / len(finals):.3f} (range {max(finals) - min(finals):.3f})"
            if finals
            else ""
        )
        seeds = ", ".join(str(p["seed"]) for p in runs)
        lines.append(f"| {optimizer} | {batch} | {seeds} | {steps} | {spread} |")
    return "\n".join(lines)


def finished_or_failed(point: dict) -> bool:
    return point["done"] or point["status"].startswith("failed")


def batch_axis(axis, batch_sizes) -> None:
    """Log2 batch axis labelled with the batch sizes themselves."""
    axis.set_xscale("log", base=2)
    axis.set_xticks(batch_sizes, labels=[f"{b:,}" for b in batch_sizes])
    axis.minorticks_off()


def plot_arm(axis, optimizer: str, arm: str, xs, ys) -> None:
    """One arm's line: its optimizer's colour and marker, solid and filled when tuned."""
    color, marker = STYLES.get(optimizer, ("tab:gray", "o"))
    axis.plot(
        xs,
        ys,
        "-" if arm == "tuned" else "-.",
        marker=marker,
        color=color,
        markerfacecolor=color if arm == "tuned" else "white",
        label=f"{optimizer}, {arm}",
    )


def finish(figure, axis, batch_sizes, ylabel: str, title: str, directory: str, name: str):
    """The batch axis, labels, legend and grid; the figure saved as `name`."""
    batch_axis(axis, batch_sizes)
    axis.set_xlabel("batch size (sequences)")
    axis.set_ylabel(ylabel)
    axis.set_title(title)
    axis.legend(fontsize="small")
    axis.grid(True, which="both", alpha=0.3)
    figure.tight_layout()
    plots.save(figure, directory, name)


def plot_steps(directory, chosen, batch_sizes, samples, target) -> None:
    plt = plots.pyplot()
    figure, axis = plt.subplots(figsize=(7, 5))
    budget = [samples / b for b in batch_sizes]
    axis.plot(batch_sizes, budget, ":", color="gray", label="sample budget (all steps)")
    anchors = [
        by_batch[batch_sizes[0]]["steps"]
        for by_batch in chosen.values()
        if batch_sizes[0] in by_batch and by_batch[batch_sizes[0]]["steps"]
    ]
    if anchors:
        best = min(anchors)
        axis.plot(
            batch_sizes,
            [best * batch_sizes[0] / b for b in batch_sizes],
            "--",
            color="black",
            label="perfect scaling",
        )
    for (optimizer, arm), by_batch in chosen.items():
        color, _ = STYLES.get(optimizer, ("tab:gray", "o"))
        xs = [b for b in batch_sizes if b in by_batch and by_batch[b]["steps"]]
        plot_arm(axis, optimizer, arm, xs, [by_batch[b]["steps"] for b in xs])
        missed = [
            b
            for b in batch_sizes
            if b in by_batch and not by_batch[b]["steps"] and finished_or_failed(by_batch[b])
        ]
        axis.plot(
            missed, [samples / b for b in missed], "x", color=color, markersize=9, linestyle=""
        )
    axis.set_yscale("log", base=2)
    axis.yaxis.set_major_formatter(plt.FuncFormatter(lambda y, _: f"{y:g}"))
    ylabel = f"steps to eval MLM loss <= {target}"
    title = "Steps to target (x: not reached within the budget)"
    finish(figure, axis, batch_sizes, ylabel, title, directory, "steps_to_target.png")


def plot_finals(directory, chosen, batch_sizes) -> None:
    figure, axis = plots.pyplot().subplots(figsize=(7, 4.5))
    for (optimizer, arm), by_batch in chosen.items():
        xs = [b for b in batch_sizes if b in by_batch and by_batch[b]["final"] is not None]
        xs = [b for b in xs if math.isfinite(by_batch[b]["final"])]
        plot_arm(axis, optimizer, arm, xs, [by_batch[b]["final"] for b in xs])
    title = "Final held-out loss at the same sample budget"
    finish(figure, axis, batch_sizes, "final eval MLM loss", title, directory, "final_loss.png")


def plot_learning_rates(directory, chosen, batch_sizes) -> None:
    figure, axis = plots.pyplot().subplots(figsize=(7, 4.5))
    for (optimizer, arm), by_batch in chosen.items():
        xs = [b for b in batch_sizes if b in by_batch]
        plot_arm(axis, optimizer, arm, xs, [by_batch[b]["learning_rate"] for b in xs])
    axis.set_yscale("log")
    title = "Learning rate each arm used (sqrt rule: slope 1/2)"
    finish(figure, axis, batch_sizes, "peak learning rate", title, directory, "learning_rates.png")
