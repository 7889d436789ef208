"""The batch-scaling study's report: steps to a target held-out loss against batch size.

A study is a sweep whose config file also defines `get_study(arg)`; the sweep keeps that
dict in sweep.json and `python -m lambjax.sweep report DIR` adds its answer to the report.
This module answers `{"kind": "batch_scaling", ...}` (studies/batch_scaling/config.py):
the trials are labelled (optimizer, batch, lr_x, seed, warmup), learning-rate multipliers on
the square-root rule, and the arms are read off them by a rule fixed before the runs:

  sqrt rule  the multiplier (at the default warmup) best at the smallest batch, kept at
             every batch size: LAMB's claim, nothing re-tuned as the batch grows;
  tuned      the multiplier and warmup best at each batch size (Nado et al.'s fair
             comparison, Shallue et al.'s measure);

"best" is the fewest steps to the target, then the lower best held-out loss (a trial that
never reaches the target counts as infinitely many steps). Only seed 0 chooses; the other
seeds of a chosen point give its spread. Steps to the target are the first evaluation at or
below it, exact to the trial's evaluation interval: the speed-up table gives the range of
each ratio that the intervals allow.

Per optimizer, S(B) = S_min (1 + B_crit / B) (McCandlish et al. 2018) is fitted to the tuned
arm (least squares of S on 1/B), and set beside the gradient noise scale B_simple the
trials measured (train/noise_scale, averaged over each tuned trial's second half to the
target, the median over batch sizes).

Written into DIR: the study's section of report.md and steps_to_target.png (log-log, one
line per arm, the perfect-scaling line, the step budgets and the fits),
learning_rates.png (the rate each arm chose) and noise_scale.png (B_simple against the
held-out loss).
"""

import math
import statistics

from lambjax.sweep import plots
from lambjax.train.metrics import format_duration
from studies import curves
from studies.curves import steps_to_target

ARMS = ("sqrt rule", "tuned")
STYLES = {"lamb": ("tab:blue", "o"), "lans": ("tab:green", "s"), "adamw": ("tab:red", "^")}
NOISE = "train/noise_scale"
BATCH_LABEL = "batch size (sequences)"


def points(directory: str, trials: dict, target: float) -> list[dict]:
    """One record per labelled trial: its labels, learning rate, steps to target, losses."""
    result = []
    for name, trial, run in curves.labelled(directory, trials):
        curve = run["curve"]
        steps = steps_to_target(curve, target)
        noise = [(s, r[NOISE]) for s, r in run["records"] if NOISE in r]
        result.append(
            {
                **trial["labels"],
                "name": name,
                "learning_rate": trial["overrides"].get("phases.phase1.learning_rate"),
                "steps": steps,
                "bracket": curves.target_bracket(curve, target),
                "best": run["best"],
                "done": trial.get("status") == "finished",
                "status": trial.get("status", ""),
                "curve": curve,
                "noise": noise,
            }
        )
    return result


def rank(point: dict) -> tuple:
    """Fewer steps to the target first, then the lower best held-out loss."""
    steps = point["steps"] if point["steps"] is not None else math.inf
    return (steps, point["best"] if math.isfinite(point["best"]) else math.inf)


def arms(grid: list[dict], batch_sizes: list[int], warmup: int) -> dict:
    """(optimizer, arm) -> batch size -> the chosen point, from the seed-0 grid (see the
    module docstring); `warmup` is the default warmup the sqrt rule keeps."""
    result = {}
    for optimizer in dict.fromkeys(p["optimizer"] for p in grid):
        mine = [p for p in grid if p["optimizer"] == optimizer]
        at = {b: [p for p in mine if p["batch"] == b] for b in batch_sizes}
        at = {b: ps for b, ps in at.items() if ps}
        if not at:
            continue
        default = {b: [p for p in ps if p.get("warmup", warmup) == warmup] for b, ps in at.items()}
        smallest = default.get(min(at)) or at[min(at)]
        base = min(smallest, key=rank)["lr_x"]
        result[(optimizer, "sqrt rule")] = {
            b: p for b, ps in default.items() for p in ps if p["lr_x"] == base
        }
        result[(optimizer, "tuned")] = {b: min(ps, key=rank) for b, ps in at.items()}
    return result


def at_edge(point: dict, grid: list[dict]) -> bool:
    """Whether a chosen multiplier is the lowest or highest its (optimizer, batch) ran."""
    tried = [
        p["lr_x"]
        for p in grid
        if (p["optimizer"], p["batch"]) == (point["optimizer"], point["batch"])
    ]
    return len(tried) > 1 and point["lr_x"] in (min(tried), max(tried))


def stage2_settings(grid: list[dict], chosen: dict) -> tuple[dict, dict]:
    """Stage 2's settings by the rule fixed before stage 1 (studies/batch_scaling/config.py):
    `extensions`, one more multiplier (x2 or /2) beyond an edge the tuned choice sits at, or
    beyond both where no multiplier reached the target; `best`, the tuned multiplier of every
    (optimizer, batch) that reached it, to be rerun with the other warmups and seeds."""
    extensions, best = {}, {}
    for (optimizer, arm), by_batch in chosen.items():
        if arm != "tuned":
            continue
        for batch, p in sorted(by_batch.items()):
            if not p["done"]:
                continue
            tried = [q["lr_x"] for q in grid if (q["optimizer"], q["batch"]) == (optimizer, batch)]
            reached = p["steps"] is not None
            extension = curves.grid_extension(tried, p["lr_x"] if reached else None)
            if extension:
                extensions[(optimizer, batch)] = extension
            if reached:
                best[(optimizer, batch)] = p["lr_x"]
    return extensions, best


def fit(by_batch: dict) -> tuple[float, float, int] | None:
    """(S_min, B_crit, points) of S = S_min (1 + B_crit / B), least squares of S on 1/B over
    the batch sizes that reached the target; None with fewer than 3 or a non-positive S_min."""
    reached = [(b, p["steps"]) for b, p in sorted(by_batch.items()) if p["steps"]]
    if len(reached) < 3:
        return None
    xs = [1 / b for b, _ in reached]
    ys = [s for _, s in reached]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    s_min = my - slope * mx
    if s_min <= 0:
        return None
    return s_min, slope / s_min, len(reached)


def measured_noise(point: dict) -> float:
    """The trial's B_simple averaged over the second half of its steps to the target (to
    its end where it never reached it); nan where it logged none."""
    end = point["steps"] or max((s for s, _ in point["noise"]), default=0)
    values = [v for s, v in point["noise"] if end / 2 <= s <= end and math.isfinite(v)]
    return statistics.fmean(values) if values else math.nan


def study_report(directory: str, trials: dict, study: dict) -> str:
    """The study's Markdown section; writes its plots into `directory`."""
    target, batch_sizes = study["target_loss"], study["batch_sizes"]
    warmup = study["warmup_steps"]
    every = points(directory, trials, target)
    grid = [p for p in every if p["seed"] == 0]
    chosen = arms(grid, batch_sizes, warmup)
    budgets = study["budgets"]
    lines = [
        "## Batch scaling: steps to the target against batch size",
        "",
        f"Target: eval MLM loss <= {target} (fixed in the config before the runs). Each trial "
        f"warms up over {warmup} steps, then holds its learning rate, and ends at the first "
        "evaluation that reaches the target; its steps are capped at the batch size's budget "
        f"({', '.join(f'{b}: {budgets[str(b)]}' for b in batch_sizes)}). Learning rate = base x "
        "sqrt(batch / smallest batch) x lr_x. `sqrt rule` keeps the lr_x best at the smallest "
        "batch; `tuned` takes the best lr_x and warmup at each batch size. `-` = not reached "
        "within the budget; `(edge)` = the chosen lr_x is the lowest or highest run there.",
        "",
        arm_table(chosen, batch_sizes, grid),
        "",
        "Speed-up in steps to the target from each doubling of the batch (2.00 = perfect "
        "scaling; in brackets the range the evaluation intervals allow):",
        "",
        speedup_table(chosen, batch_sizes),
        "",
        "The tuned arm's S(B) = S_min (1 + B_crit / B), fitted, beside the gradient noise "
        "scale the same trials measured:",
        "",
        fit_table(chosen),
        "",
    ]
    spread = seed_table(every, chosen)
    if spread:
        lines += ["Seeds: each tuned point rerun with other seeds:", "", spread, ""]
    warmups = warmup_table(every, chosen)
    if warmups:
        lines += ["Warmups: each tuned point's multiplier with other warmups (seed 0):", ""]
        lines += [warmups, ""]
    for other in study.get("other_targets", []):
        others = [p for p in points(directory, trials, other) if p["seed"] == 0]
        lines += [
            f"At target {other} (the same choice rule, read off the same curves):",
            "",
            arm_table(arms(others, batch_sizes, warmup), batch_sizes, others),
            "",
        ]
    extensions, best = stage2_settings(grid, chosen)
    lines += [
        "Stage 2 by its rule (the config's `extensions` and `best`, committed before stage 2 "
        "runs):",
        "",
        f"    extensions={extensions!r},",
        f"    best={best!r},",
        "",
    ]
    plot_steps(directory, chosen, batch_sizes, budgets, target)
    plot_learning_rates(directory, chosen, batch_sizes)
    plot_noise(directory, chosen)
    seconds = sum(t.get("wall_time_s") or 0.0 for t in trials.values())
    done = sum(t.get("status") == "finished" for t in trials.values())
    lines.append(
        f"{done} of {len(trials)} trials finished; their wall times add up to "
        f"{format_duration(seconds)} (trials that ran side by side overlap)."
    )
    lines += ["", "Plots: steps_to_target.png, learning_rates.png, noise_scale.png"]
    return "\n".join(lines)


def arm_table(chosen: dict, batch_sizes: list[int], grid: list[dict]) -> str:
    header = ["optimizer", "arm", *(f"B={b}" for b in batch_sizes)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (optimizer, arm), by_batch in chosen.items():
        cells = []
        for b in batch_sizes:
            p = by_batch.get(b)
            if p is None:
                cells.append("")
            elif not p["done"] and not p["status"].startswith("failed"):
                cells.append(f"({p['status'] or 'not run'})")
            else:
                steps = "-" if p["steps"] is None else str(p["steps"])
                steps = "failed" if p["status"].startswith("failed") and not p["steps"] else steps
                edge = " (edge)" if arm == "tuned" and at_edge(p, grid) else ""
                warm = f", warmup {p['warmup']}" if arm == "tuned" and "warmup" in p else ""
                cells.append(f"{steps} / lr {p['learning_rate']:.3g}{warm}{edge}")
        lines.append(f"| {optimizer} | {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\nCells: steps to target / learning rate."


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


def fit_table(chosen: dict) -> str:
    lines = [
        "| optimizer | S_min (steps) | B_crit (fit) | batch sizes fitted | B_simple measured |",
        "|---|---|---|---|---|",
    ]
    for (optimizer, arm), by_batch in chosen.items():
        if arm != "tuned":
            continue
        fitted = fit(by_batch)
        noise = [measured_noise(p) for p in by_batch.values()]
        noise = [v for v in noise if math.isfinite(v)]
        measured = f"{statistics.median(noise):.0f}" if noise else "-"
        if fitted is None:
            lines.append(f"| {optimizer} | - | - | fewer than 3 reached | {measured} |")
        else:
            s_min, b_crit, count = fitted
            lines.append(f"| {optimizer} | {s_min:.0f} | {b_crit:.0f} | {count} | {measured} |")
    return "\n".join(lines)


LABELS = ("optimizer", "batch", "lr_x", "seed", "warmup")


def tuned_points(chosen: dict):
    """(optimizer, batch, point) of every tuned arm's choice, by optimizer and batch."""
    for (optimizer, arm), by_batch in chosen.items():
        if arm == "tuned":
            for batch, point in sorted(by_batch.items()):
                yield optimizer, batch, point


def varied(every: list[dict], point: dict, label: str) -> list[dict]:
    """The trials that differ from `point` in `label` alone (`point` among them), in that
    label's order."""
    same = [q for q in every if all(q.get(k) == point.get(k) for k in LABELS if k != label)]
    return sorted(same, key=lambda q: q.get(label, 0))


def seed_table(every: list[dict], chosen: dict) -> str:
    """Per tuned point with repeated seeds: each seed's steps, their mean and range."""
    lines = ["| optimizer | batch | steps by seed | mean (range) |", "|---|---|---|---|"]
    for optimizer, b, p in tuned_points(chosen):
        same = varied(every, p, "seed")
        if len(same) < 2:
            continue
        cells = ", ".join(f"{q['seed']}: {q['steps'] or '-'}" for q in same)
        reached = [q["steps"] for q in same if q["steps"]]
        summary = (
            f"{statistics.fmean(reached):.0f} ({min(reached)}-{max(reached)})"
            if len(reached) == len(same)
            else "-"
        )
        lines.append(f"| {optimizer} | {b} | {cells} | {summary} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def warmup_table(every: list[dict], chosen: dict) -> str:
    """Per tuned point run with other warmups (seed 0): each warmup's steps."""
    lines = ["| optimizer | batch | steps by warmup |", "|---|---|---|"]
    for optimizer, b, p in tuned_points(chosen):
        same = varied(every, p, "warmup")
        if len(same) < 2:
            continue
        cells = ", ".join(f"{q.get('warmup')}: {q['steps'] or '-'}" for q in same)
        lines.append(f"| {optimizer} | {b} | {cells} |")
    return "\n".join(lines) if len(lines) > 2 else ""


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


def plot_steps(directory, chosen, batch_sizes, budgets, target) -> None:
    plt = plots.pyplot()
    figure, axis = plt.subplots(figsize=(7, 5))
    caps = [budgets[str(b)] for b in batch_sizes]
    axis.plot(batch_sizes, caps, ":", color="gray", label="step budget")
    anchors = [
        by_batch[batch_sizes[0]]["steps"]
        for by_batch in chosen.values()
        if batch_sizes[0] in by_batch and by_batch[batch_sizes[0]]["steps"]
    ]
    if anchors:
        best = min(anchors)
        perfect = [best * batch_sizes[0] / b for b in batch_sizes]
        axis.plot(batch_sizes, perfect, "--", color="black", label="perfect scaling")
    for (optimizer, arm), by_batch in chosen.items():
        color, _ = STYLES.get(optimizer, ("tab:gray", "o"))
        xs = [b for b in batch_sizes if b in by_batch and by_batch[b]["steps"]]
        plot_arm(axis, optimizer, arm, xs, [by_batch[b]["steps"] for b in xs])
        missed = [b for b in batch_sizes if b in by_batch and not by_batch[b]["steps"]]
        missed = [b for b in missed if by_batch[b]["done"] or by_batch[b]["status"]]
        axis.plot(missed, [budgets[str(b)] for b in missed], "x", color=color, linestyle="")
        fitted = fit(by_batch) if arm == "tuned" else None
        if fitted:
            s_min, b_crit, _ = fitted
            curve = [s_min * (1 + b_crit / b) for b in batch_sizes]
            axis.plot(batch_sizes, curve, ":", color=color, alpha=0.6)
    batch_axis(axis, batch_sizes)
    axis.set_yscale("log", base=2)
    axis.yaxis.set_major_formatter(plt.FuncFormatter(lambda y, _: f"{y:g}"))
    plots.finish(
        figure,
        axis,
        directory,
        "steps_to_target.png",
        xlabel=BATCH_LABEL,
        ylabel=f"steps to eval MLM loss <= {target}",
        title="Steps to target (x: not within the budget; dotted: S(B) fits)",
        minor_grid=True,
    )


def plot_learning_rates(directory, chosen, batch_sizes) -> None:
    figure, axis = plots.pyplot().subplots(figsize=(7, 4.5))
    for (optimizer, arm), by_batch in chosen.items():
        xs = [b for b in batch_sizes if b in by_batch]
        plot_arm(axis, optimizer, arm, xs, [by_batch[b]["learning_rate"] for b in xs])
    batch_axis(axis, batch_sizes)
    axis.set_yscale("log")
    plots.finish(
        figure,
        axis,
        directory,
        "learning_rates.png",
        xlabel=BATCH_LABEL,
        ylabel="peak learning rate",
        title="Learning rate each arm used (sqrt rule: slope 1/2)",
        minor_grid=True,
    )


def plot_noise(directory, chosen) -> None:
    """B_simple against the held-out loss at the same step, for the tuned trials."""
    figure, axis = plots.pyplot().subplots(figsize=(7, 4.5))
    for (optimizer, arm), by_batch in chosen.items():
        if arm != "tuned":
            continue
        color, marker = STYLES.get(optimizer, ("tab:gray", "o"))
        xs, ys = [], []
        for p in by_batch.values():
            noise = dict(p["noise"])
            pairs = [(loss, noise[s]) for s, loss in p["curve"] if s in noise]
            xs += [loss for loss, v in pairs if math.isfinite(v) and v > 0]
            ys += [v for _, v in pairs if math.isfinite(v) and v > 0]
        axis.plot(xs, ys, marker, color=color, alpha=0.5, linestyle="", label=optimizer)
    axis.invert_xaxis()
    axis.set_yscale("log")
    plots.finish(
        figure,
        axis,
        directory,
        "noise_scale.png",
        xlabel="eval MLM loss (training goes right)",
        ylabel="B_simple (sequences)",
        title="Gradient noise scale B_simple during the tuned trials",
        minor_grid=True,
    )
