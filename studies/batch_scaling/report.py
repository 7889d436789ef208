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
never reaches the target counts as infinitely many steps). Only seed 0 chooses. Stage 2
reruns stage 1's choice at each (optimizer, batch) with two more seeds: those three give the
spread, the speed-ups and S(B) fits on their means, and the optimizers' order at each batch
size with whether their seed ranges overlap. Steps to the target are the first evaluation at
or below it, exact to the trial's evaluation interval: the speed-up table gives the range of
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

from lambjax.sweep import plots, runner
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
                "done": trial.get("status") in runner.ENDED,
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
    sets = seeded(every, warmup)
    spread = seed_table(sets, chosen)
    if spread:
        lines += [
            "Seeds: stage 1's best point of each optimizer and batch size (the config's "
            "`best`), rerun with seeds 1 and 2. `tuned choice` names seed 0's fastest point "
            "where the extensions or warmups moved it (one seed: within the spread below, "
            "that move is no finding):",
            "",
            spread,
            "",
            "Speed-up per doubling on the seeds' mean steps (in brackets the slowest seed "
            "over the fastest, and back):",
            "",
            seed_speedup_table(sets, batch_sizes),
            "",
            "S(B) fitted to the seeds' mean steps and to each seed alone, beside the noise "
            "scale the same trials measured:",
            "",
            seed_fit_table(sets),
            "",
        ]
        comparison = optimizer_comparison(sets, batch_sizes)
        if comparison:
            lines += [
                "The optimizers at each batch size, fastest first (`separate`: the faster "
                "one's slowest seed beats the slower one's fastest):",
                "",
                comparison,
                "",
            ]
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
        "The stage-2 rule on the grid as run so far (after stage 1: the config's `extensions` "
        "and `best`, committed before stage 2 runs; after stage 2: any further extension due):",
        "",
        f"    extensions={extensions!r},",
        f"    best={best!r},",
        "",
    ]
    plot_steps(directory, chosen, batch_sizes, budgets, target, sets)
    plot_learning_rates(directory, chosen, batch_sizes)
    plot_noise(directory, chosen)
    seconds = sum(t.get("wall_time_s") or 0.0 for t in trials.values())
    done = sum(t.get("status") in runner.ENDED for t in trials.values())
    diverged = sum(t.get("status") == "diverged" for t in trials.values())
    lines.append(
        f"{done} of {len(trials)} trials ended ({diverged} of them diverged); their wall "
        f"times add up to {format_duration(seconds)} (trials that ran side by side overlap)."
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


def median_noise(points) -> str:
    """The median of the trials' measured B_simple, formatted; `-` where none logged one."""
    noise = [measured_noise(p) for p in points]
    noise = [v for v in noise if math.isfinite(v)]
    return f"{statistics.median(noise):.0f}" if noise else "-"


def fit_table(chosen: dict) -> str:
    lines = [
        "| optimizer | S_min (steps) | B_crit (fit) | batch sizes fitted | B_simple measured |",
        "|---|---|---|---|---|",
    ]
    for (optimizer, arm), by_batch in chosen.items():
        if arm != "tuned":
            continue
        fitted = fit(by_batch)
        measured = median_noise(by_batch.values())
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


def seeded(every: list[dict], warmup: int) -> dict:
    """(optimizer, batch) -> the trials of the point that stage 2 reran with other seeds (the
    config's `best`: one lr_x at the default warmup), seed 0 first."""
    rates = {}
    for q in every:
        if q["seed"] != 0 and q.get("warmup", warmup) == warmup:
            rates.setdefault((q["optimizer"], q["batch"]), q["lr_x"])
    order = list(dict.fromkeys(q["optimizer"] for q in every))
    return {
        key: sorted(
            (
                q
                for q in every
                if (q["optimizer"], q["batch"]) == key
                and q["lr_x"] == lr_x
                and q.get("warmup", warmup) == warmup
            ),
            key=lambda q: q["seed"],
        )
        for key, lr_x in sorted(
            rates.items(), key=lambda item: (order.index(item[0][0]), item[0][1])
        )
    }


def seed_steps(trials: list[dict] | None) -> list[int] | None:
    """Every seed's steps to the target; None unless every seed ended and reached it."""
    if not trials or not all(q["done"] and q["steps"] for q in trials):
        return None
    return [q["steps"] for q in trials]


def seed_cell(trial: dict) -> str:
    """A trial's steps to the target, `-` where it ended without, its status before it ends."""
    if trial["steps"]:
        return str(trial["steps"])
    return "-" if trial["done"] else f"({trial['status'] or 'not run'})"


def seed_table(sets: dict, chosen: dict) -> str:
    """Per stage-2 point: each seed's steps, their mean and range, and whether seed 0's
    choice (the tuned arm, over the extensions and warmups too) is still this point."""
    lines = [
        "| optimizer | batch | lr_x | steps by seed | mean (range) | tuned choice (seed 0) |",
        "|---|---|---|---|---|---|",
    ]
    for (optimizer, batch), trials in sets.items():
        cells = ", ".join(f"{q['seed']}: {seed_cell(q)}" for q in trials)
        steps = seed_steps(trials)
        summary = f"{statistics.fmean(steps):.0f} ({min(steps)}-{max(steps)})" if steps else "-"
        tuned = chosen.get((optimizer, "tuned"), {}).get(batch)
        if tuned is None or (tuned["lr_x"], tuned.get("warmup")) == (
            trials[0]["lr_x"],
            trials[0].get("warmup"),
        ):
            choice = "this point"
        else:
            choice = (
                f"lr_x {tuned['lr_x']:g}, warmup {tuned.get('warmup')}: {tuned['steps'] or '-'}"
            )
        lines.append(
            f"| {optimizer} | {batch} | {trials[0]['lr_x']:g} | {cells} | {summary} | {choice} |"
        )
    return "\n".join(lines) if len(lines) > 2 else ""


def seed_speedup_table(sets: dict, batch_sizes: list[int]) -> str:
    """Per optimizer and doubling of the batch: the ratio of the seeds' mean steps, and in
    brackets the range the seeds span (the slowest seed over the fastest, and back)."""
    pairs = list(zip(batch_sizes, batch_sizes[1:], strict=False))
    header = ["optimizer", *(f"{a}->{b}" for a, b in pairs)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for optimizer in dict.fromkeys(key[0] for key in sets):
        cells = []
        for a, b in pairs:
            sa, sb = seed_steps(sets.get((optimizer, a))), seed_steps(sets.get((optimizer, b)))
            if sa and sb:
                mean = statistics.fmean(sa) / statistics.fmean(sb)
                low, high = curves.ratio_range((min(sa), max(sa)), (min(sb), max(sb)))
                cells.append(f"{mean:.2f} ({low:.2f}-{high:.2f})")
            else:
                cells.append("")
        lines.append(f"| {optimizer} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def seed_fit_table(sets: dict) -> str:
    """Per optimizer: S(B) fitted to the seeds' mean steps, and B_crit fitted to each seed's
    own steps alone, beside the noise scale those trials measured (median)."""
    lines = [
        "| optimizer | S_min (means) | B_crit (means) | B_crit by seed | B_simple measured |",
        "|---|---|---|---|---|",
    ]
    for optimizer in dict.fromkeys(key[0] for key in sets):
        mine = {b: trials for (o, b), trials in sets.items() if o == optimizer}
        complete = {b: seed_steps(trials) for b, trials in mine.items()}
        complete = {b: steps for b, steps in complete.items() if steps}
        means = fit({b: {"steps": statistics.fmean(steps)} for b, steps in complete.items()})
        by_seed = []
        for seed in sorted({q["seed"] for trials in mine.values() for q in trials}):
            own = {b: q for b, trials in mine.items() for q in trials if q["seed"] == seed}
            fitted = fit({b: q for b, q in own.items() if q["done"]})
            by_seed.append(f"{seed}: {fitted[1]:.0f}" if fitted else f"{seed}: -")
        measured = median_noise(q for trials in mine.values() for q in trials if q["done"])
        head = f"{means[0]:.0f} | {means[1]:.0f}" if means else "- | -"
        lines.append(f"| {optimizer} | {head} | {', '.join(by_seed)} | {measured} |")
    return "\n".join(lines)


def optimizer_comparison(sets: dict, batch_sizes: list[int]) -> str:
    """Per batch size: the optimizers by their seeds' mean steps, and whether each
    neighbour's seed range overlaps the next (a gap inside the seeds' spread is no ranking)."""
    lines = ["| batch | by mean steps (range) | ranges |", "|---|---|---|"]
    for b in batch_sizes:
        ranked = []
        for (optimizer, batch), trials in sets.items():
            steps = seed_steps(trials) if batch == b else None
            if steps:
                ranked.append((statistics.fmean(steps), min(steps), max(steps), optimizer))
        if len(ranked) < 2:
            continue
        ranked.sort()
        order = ", ".join(f"{o} {m:.0f} ({lo}-{hi})" for m, lo, hi, o in ranked)
        verdicts = [
            f"{faster[3]} / {slower[3]} {'overlap' if slower[1] <= faster[2] else 'separate'}"
            for faster, slower in zip(ranked, ranked[1:], strict=False)
        ]
        lines.append(f"| {b} | {order} | {'; '.join(verdicts)} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def warmup_table(every: list[dict], chosen: dict) -> str:
    """Per tuned point run with other warmups (seed 0): each warmup's steps."""
    lines = ["| optimizer | batch | steps by warmup |", "|---|---|---|"]
    for optimizer, b, p in tuned_points(chosen):
        same = varied(every, p, "warmup")
        if len(same) < 2:
            continue
        cells = ", ".join(f"{q.get('warmup')}: {seed_cell(q)}" for q in same)
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


def plot_steps(directory, chosen, batch_sizes, budgets, target, sets) -> None:
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
    for (optimizer, batch), trials in sets.items():
        steps = seed_steps(trials)
        if steps:
            mean = statistics.fmean(steps)
            spread = [[mean - min(steps)], [max(steps) - mean]]
            color, _ = STYLES.get(optimizer, ("tab:gray", "o"))
            axis.errorbar([batch], [mean], yerr=spread, fmt="_", color=color, capsize=4)
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
        title="Steps to target (x: missed; dotted: S(B) fits; bars: seeds' mean and range)",
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
