"""The equal-compute study's report: FLOPs, steps and training time to a fixed held-out MLM
loss for PLD and MSLT against a PostLN baseline (studies/equal_compute/config.py).

The trials are labelled (arm, lr, seed). By a rule fixed before the runs, each arm is read
at the learning rate whose seed-0 trial reaches the target with the fewest FLOPs (a trial
that never does counts as infinitely many; ties and misses go to the lower best held-out
loss), and its seeds at that rate give its spread. An arm's FLOPs to the target add up its
steps' model FLOPs (lambjax.train.throughput's count): the full model's for postln and
preln, PLD's logged layers run per log window (train/pld_layers_run), each MSLT stage's
(its depth, its frozen layers forward only) and then the full model's. Every arm's cap is
the same budget of FLOPs.

A speed-up is the baseline's mean FLOPs to the target over the arm's; it reads as a verdict
(studies.curves.seed_verdict) only where both were run with 3 seeds ("none yet" before),
against the larger of the two seed ranges, and every seed reached the target (else the
verdict says how many did). Where a seed missed at an arm's chosen rate, the rule runs the
rate below it with every seed too (the config's `fallback`), and a second table reads each
arm at its fastest rate that every seed reached. Training time is the trials' logged step times
added up (compiling and evaluating not counted; trials that shared the machine measured its
load too): a second reading, not the verdict.

Written into DIR: the study's section of report.md, equal_compute_loss_vs_flops.png (the
held-out loss of each arm's chosen trials against FLOPs, the target as a line) and
equal_compute_learning_rates.png (FLOPs to the target against the learning rate per arm).
"""

import math
import statistics

from lambjax.sweep import plots, runner
from studies import curves
from studies.curves import number, steps_to_target, time_at

LAYERS_RUN = "train/pld_layers_run"
COLORS = {"postln": "tab:red", "preln": "tab:blue", "pld": "tab:green", "mslt": "tab:purple"}
NAMES = {
    "postln": "PostLN (baseline)",
    "preln": "PreLN",
    "pld": "PreLN + PLD",
    "mslt": "PostLN, MSLT stages",
}


def cumulative_flops(arm: str, rows: list[tuple[int, dict]], flops: dict) -> dict[int, float]:
    """Step -> model FLOPs of the trial's steps up to it, at every step `rows` logs."""
    full, layer = flops["full"], flops["layer"]
    result, total, previous = {}, 0.0, 0
    for step, record in rows:
        if arm == "pld" and LAYERS_RUN in record:
            per_step = full - (flops["num_layers"] - record[LAYERS_RUN]) * layer
            total += (step - previous) * per_step
        elif arm == "mslt":
            total = mslt_flops(step, flops)
        else:
            total = step * full
        result[step], previous = total, step
    return result


def mslt_flops(step: int, flops: dict) -> float:
    """FLOPs of MSLT's first `step` steps: equal stages at their own cost, then full."""
    each, total = flops["stage_steps"], 0.0
    for cost in flops["stages"]:
        taken = min(each, step)
        total, step = total + taken * cost, step - taken
    return total + step * flops["full"]


def flops_at(cumulative: dict[int, float], step: int | None) -> float:
    """FLOPs to `step` (an evaluation step, which is always a log step here); inf for None."""
    if step is None:
        return math.inf
    logged = [s for s in cumulative if s <= step]
    return cumulative[max(logged)] if logged else math.inf


def points(directory: str, trials: dict, study: dict, target: float) -> list[dict]:
    result = []
    for name, trial, run in curves.labelled(directory, trials):
        arm = trial["labels"]["arm"]
        steps = steps_to_target(run["curve"], target)
        cumulative = cumulative_flops(arm, run["records"], study["flops"])
        result.append(
            {
                **trial["labels"],
                "name": name,
                "curve": run["curve"],
                "best": run["best"],
                "steps": steps,
                "flops": flops_at(cumulative, steps) / study["budget_flops"],
                "cumulative": cumulative,
                "seconds": time_at(run["times"], steps) if steps else math.inf,
                "status": trial.get("status", ""),
            }
        )
    return result


def rank(point: dict) -> tuple:
    return (point["flops"], point["best"] if math.isfinite(point["best"]) else math.inf)


def ended(point: dict) -> bool:
    """Whether the trial has ended (finished, diverged, or failed); a running or pending
    one is left out of every choice."""
    return point["status"] in runner.ENDED or point["status"].startswith("failed")


def chosen(every: list[dict]) -> dict[str, list[dict]]:
    """Arm -> the ended trials of its chosen rate (seed 0's best of those that ended),
    every seed, seed 0 first."""
    every = [p for p in every if ended(p)]
    result = {}
    for arm in NAMES:
        grid = [p for p in every if p["arm"] == arm and p["seed"] == 0]
        if not grid:
            continue
        best = min(grid, key=rank)
        same = [p for p in every if p["arm"] == arm and p["lr"] == best["lr"]]
        result[arm] = sorted(same, key=lambda p: p["seed"])
    return result


def reliable(every: list[dict]) -> dict[str, list[dict]]:
    """Arm -> the trials of its rate with the fewest mean FLOPs to the target among the
    rates that at least MIN_SEEDS seeds ran to their end, every one reaching it."""
    every = [p for p in every if ended(p)]
    result = {}
    for arm in NAMES:
        by_rate = {}
        for p in every:
            if p["arm"] == arm:
                by_rate.setdefault(p["lr"], []).append(p)
        full = [
            runs
            for runs in by_rate.values()
            if len(runs) >= curves.MIN_SEEDS and all(math.isfinite(p["flops"]) for p in runs)
        ]
        if full:
            best = min(full, key=lambda runs: summary(runs, "flops")[0])
            result[arm] = sorted(best, key=lambda p: p["seed"])
    return result


def fallback_settings(every: list[dict]) -> dict:
    """The config's `fallback` by its rule: arm -> the rate below its chosen one in its
    grid, where a seed that ran to its end missed the target at the chosen rate."""
    fallback = {}
    for arm, runs in chosen(every).items():
        if all(math.isfinite(p["flops"]) for p in runs):
            continue
        grid = {p["lr"] for p in every if p["arm"] == arm and p["seed"] == 0}
        lower = [rate for rate in grid if rate < runs[0]["lr"]]
        if lower:
            fallback[arm] = max(lower)
    return fallback


def stage2_settings(every: list[dict]) -> tuple[dict, dict]:
    """Stage 2's settings by the rule fixed before stage 1 (studies/equal_compute/config.py):
    `extensions`, one more rate (x2 or /2) beyond a grid edge an arm's best sits at, or
    beyond both where none of its rates reached the target; `best`, the rate of every arm
    that reached it, rerun with the other seeds."""
    extensions, best = {}, {}
    for arm in NAMES:
        grid = [p for p in every if p["arm"] == arm and p["seed"] == 0]
        if not grid or not all(ended(p) for p in grid):
            continue
        chosen_point = min(grid, key=rank)
        reached = math.isfinite(chosen_point["flops"])
        extension = curves.grid_extension(
            [p["lr"] for p in grid], chosen_point["lr"] if reached else None
        )
        if extension:
            extensions[arm] = extension
        if reached:
            best[arm] = chosen_point["lr"]
    return extensions, best


def summary(runs: list[dict], key: str) -> tuple[float, float]:
    """(mean, range) of `key` over runs that all reached the target; (inf, nan) else."""
    values = [p[key] for p in runs]
    if not values or not all(math.isfinite(v) for v in values):
        return math.inf, math.nan
    return statistics.fmean(values), max(values) - min(values)


def comparison_table(arms: dict[str, list[dict]]) -> str:
    header = [
        "arm",
        "lr",
        "seeds",
        "FLOPs to target (of the budget)",
        "speed-up in FLOPs",
        "verdict",
        "steps to target",
        "training time to target",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    base = arms.get("postln")
    base_mean, base_range = summary(base, "flops") if base else (math.inf, math.nan)
    for arm, runs in arms.items():
        mean, spread = summary(runs, "flops")
        per_seed = ", ".join(number(p["flops"], ".3f") for p in runs)
        speedup = base_mean / mean if math.isfinite(mean) and math.isfinite(base_mean) else math.nan
        verdict = "baseline"
        seeds = min(len(runs), len(base or []))
        reached = sum(math.isfinite(p["flops"]) for p in runs)
        if reached < len(runs):
            verdict = f"{reached} of {len(runs)} seeds reached the target"
        elif arm != "postln" and not base:
            verdict = "none yet (no baseline rate)"
        elif arm != "postln" and seeds < curves.MIN_SEEDS:
            verdict = f"none yet ({seeds} seed{'s' if seeds != 1 else ''})"
        elif arm != "postln" and not math.isfinite(base_mean):
            verdict = "- (a baseline seed missed)"
        elif arm != "postln":
            band = max(base_range, spread)
            verdict = curves.seed_verdict(mean - base_mean, band, seeds, "the seed range")
        steps = ", ".join("-" if p["steps"] is None else str(p["steps"]) for p in runs)
        seconds = ", ".join(number(p["seconds"], ".0f", " s") for p in runs)
        lines.append(
            f"| {NAMES[arm]} | {runs[0]['lr']:g} | {len(runs)} | {per_seed} "
            f"(mean {number(mean, '.3f')}, range {number(spread, '.3f')}) | "
            f"{number(speedup, '.2f', 'x')} | {verdict} | {steps} | {seconds} |"
        )
    return "\n".join(lines)


def grid_table(every: list[dict], study: dict) -> str:
    rates = sorted({p["lr"] for p in every})
    header = ["arm", *(f"lr {r:g}" for r in rates)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for arm in NAMES:
        grid = {p["lr"]: p for p in every if p["arm"] == arm and p["seed"] == 0}
        if not grid:
            continue
        cells = []
        for rate in rates:
            p = grid.get(rate)
            if p is None:
                cells.append("")
            elif not ended(p):
                cells.append(f"({p['status'] or 'not run'})")
            else:
                steps = "-" if p["steps"] is None else str(p["steps"])
                cells.append(f"{steps} / {number(p['flops'], '.3f')} / {number(p['best'], '.3f')}")
        lines.append(f"| {NAMES[arm]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def study_report(directory: str, trials: dict, study: dict) -> str:
    target = study["target_loss"]
    every = points(directory, trials, study, target)
    arms = chosen(every)
    caps = ", ".join(f"{NAMES[a]} {c}" for a, c in study["caps"].items() if a in NAMES)
    lines = [
        "## Equal compute: PLD and MSLT against PostLN at the same FLOPs",
        "",
        f"Target: held-out MLM loss <= {target} (fixed before the runs). Every arm's cap is "
        f"the same {study['budget_flops']:.3g} FLOPs, in its own steps: {caps}. FLOPs below "
        "are fractions of that budget.",
        "",
        "Each arm at its best learning rate (seed 0's fewest FLOPs to the target), every seed "
        "at that rate:",
        "",
        comparison_table(arms),
    ]
    fallback = fallback_settings(every)
    if fallback:
        full = reliable(every)
        lines += [
            "",
            "A seed missed the target at a chosen rate, so the rule ran the rate below it with "
            "every seed too. Each arm at its fastest rate that every seed reached (an arm "
            "without one is left out):",
            "",
            comparison_table(full) if full else "(none yet: no rate has 3 seeds that all did)",
        ]
    lines += [
        "",
        "Every seed-0 trial: steps to the target / FLOPs to it / best held-out loss (`-`: not "
        "reached within the cap):",
        "",
        grid_table(every, study),
        "",
        curves.reading_note(
            [p for runs in arms.values() for p in runs],
            min((len(r) for r in arms.values()), default=0),
        ),
        "",
        f"The papers' speed-ups: PLD {study['paper_speedups']['pld']}x, MSLT "
        f"{study['paper_speedups']['mslt']}x (wall time at BERT size; here FLOPs at 12 layers of "
        "the tiny width).",
    ]
    for other in study.get("other_targets", []):
        lines += [
            "",
            f"At target {other}:",
            "",
            comparison_table(chosen(points(directory, trials, study, other))),
        ]
    extensions, best = stage2_settings(every)
    lines += [
        "",
        "Stage 2 by its rule (the config's `extensions`, `best` and `fallback`, committed "
        "before their trials run; arms whose grid has not finished are left out):",
        "",
        f"    extensions={extensions!r},",
        f"    best={best!r},",
        f"    fallback={fallback!r},",
    ]
    plot_curves(directory, arms, study, target)
    plot_learning_rates(directory, every)
    lines += ["", "Plots: equal_compute_loss_vs_flops.png, equal_compute_learning_rates.png"]
    return "\n".join(lines)


def plot_curves(directory: str, arms: dict, study: dict, target: float) -> None:
    figure, axis = plots.pyplot().subplots(figsize=(7, 4.5))
    for arm, runs in arms.items():
        for p in runs:
            xs = [flops_at(p["cumulative"], s) / study["budget_flops"] for s, _ in p["curve"]]
            label = f"{NAMES[arm]}, lr {p['lr']:g}" if p["seed"] == runs[0]["seed"] else None
            axis.plot(xs, [v for _, v in p["curve"]], color=COLORS[arm], alpha=0.8, label=label)
    axis.axhline(target, color="black", linestyle="--", label=f"target {target}")
    plots.finish(
        figure,
        axis,
        directory,
        "equal_compute_loss_vs_flops.png",
        xlabel="model FLOPs (fraction of the budget)",
        ylabel="held-out MLM loss",
        title="Held-out loss against compute, each arm at its best rate",
    )


def plot_learning_rates(directory: str, every: list[dict]) -> None:
    figure, axis = plots.pyplot().subplots(figsize=(7, 4.5))
    for arm in NAMES:
        grid = sorted(
            (p for p in every if p["arm"] == arm and p["seed"] == 0), key=lambda p: p["lr"]
        )
        reached = [p for p in grid if math.isfinite(p["flops"])]
        axis.plot(
            [p["lr"] for p in reached],
            [p["flops"] for p in reached],
            "o-",
            color=COLORS[arm],
            label=NAMES[arm],
        )
        missed = [p for p in grid if not math.isfinite(p["flops"]) and p["curve"]]
        axis.plot([p["lr"] for p in missed], [1.0] * len(missed), "x", color=COLORS[arm])
    axis.set_xscale("log")
    plots.finish(
        figure,
        axis,
        directory,
        "equal_compute_learning_rates.png",
        xlabel="peak learning rate",
        ylabel="FLOPs to target (fraction of the budget; x: missed)",
        title="Learning-rate grids",
        minor_grid=True,
    )
