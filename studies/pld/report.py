"""The PLD study's report: steps and training time to the PostLN baseline's best held-out
MLM loss (studies/pld/config.py).

The trials are labelled (arm, gamma, lr, seed): arm `postln` (the baseline), `pld` (PreLN
with progressive layer dropping, one grid per gamma) or `preln` (PreLN alone). The report
reads them by a rule fixed before the runs:

  baseline  the seed-0 PostLN trial with the lowest best held-out MLM loss; that loss is
            the target, and its steps to the target are the baseline's steps;
  PLD       per gamma, the learning rate that reaches the target in the fewest steps (a
            trial that misses it counts as never; ties and misses go to the lower best
            held-out loss);
  PreLN     PreLN alone at each PLD arm's learning rate, and at its own best.

Steps to the target are read as studies.curves reads them. The step time of an arm is
its round-robin time where DIR/step_times.json exists (`studies/pld/benchmark.py --sweep
DIR`: one step of each arm in turn in one process, so every arm sees the same load), and the
training time to the target is then the steps times it; without that file, the trial's
median logged step time and its logged step times added up (compiling and evaluating not
counted either way). The report says which it used. Trials repeated with another seed get a
table of their own: best loss per seed and its gap to the repeated PostLN trial of that seed
(the held-out split is masked by the run's seed, so losses compare within a seed).

Written into DIR: the study's section of report.md, pld_loss_vs_steps.png and
pld_loss_vs_time.png (held-out loss of the chosen trials against steps and training time,
the target as a line) and pld_learning_rates.png (best held-out loss against the learning
rate, one line per arm).
"""

import math
import statistics

from lambjax.sweep import plots
from lambjax.train.metrics import format_duration
from studies import curves
from studies.curves import number, rank, steps_to_target, time_at

LAYERS_RUN = "train/pld_layers_run"
COLORS = {"postln": "tab:red", "preln": "tab:blue", "pld": "tab:green"}


def points(directory: str, trials: dict, timed: dict | None = None) -> list[dict]:
    """One record per labelled trial: labels, curve, best and final loss, step times (the
    round-robin ones of `timed`, curves.step_times, where it has the trial's arm)."""
    result = []
    for name, trial, run in curves.labelled(directory, trials):
        layers_run = [r[LAYERS_RUN] for _, r in run["records"] if LAYERS_RUN in r]
        point = {
            **trial["labels"],
            "name": name,
            **{key: run[key] for key in ("curve", "times", "best", "final", "step_time")},
            "layers_run": statistics.mean(layers_run) if layers_run else None,
            "status": trial.get("status", ""),
        }
        arm = curves.arm_of(trial["labels"])
        if timed and arm in timed["step_time_s"]:
            point["step_time"] = timed["step_time_s"][arm]
            point["times"] = curves.uniform_times(run["times"], point["step_time"])
        result.append(point)
    return result


def baseline(grid: list[dict]) -> dict | None:
    """The PostLN trial with the lowest best held-out loss."""
    postln = [p for p in grid if p["arm"] == "postln" and math.isfinite(p["best"])]
    return min(postln, key=lambda p: p["best"]) if postln else None


def arms(grid: list[dict], target: float, gammas) -> list[tuple[str, dict]]:
    """(row label, chosen point), in the report's order: per gamma, PLD at its best rate
    and PreLN alone at that rate; then PreLN at its own best."""
    rows = []
    preln = {p["lr"]: p for p in grid if p["arm"] == "preln"}
    for gamma in gammas:
        pld = [p for p in grid if p["arm"] == "pld" and p.get("gamma") == gamma]
        if not pld:
            continue
        chosen = min(pld, key=lambda p: rank(p, target))
        rows.append((f"PreLN + PLD, gamma {gamma}, best lr", chosen))
        if chosen["lr"] in preln:
            rows.append((f"PreLN alone at that lr ({chosen['lr']:g})", preln[chosen["lr"]]))
    if preln:
        rows.append(("PreLN alone, best lr", min(preln.values(), key=lambda p: rank(p, target))))
    return rows


def comparison_table(base: dict, rows: list[tuple[str, dict]], target: float) -> str:
    base_steps = steps_to_target(base["curve"], target)
    base_time = time_at(base["times"], base_steps)
    header = [
        "arm",
        "lr",
        "steps to target",
        "fewer steps",
        "training time to target",
        "faster",
        "step time",
        "step time ratio",
        "layers run",
        "best loss",
        "final loss",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label, p in [("PostLN baseline, best lr", base), *rows]:
        steps = steps_to_target(p["curve"], target)
        seconds = time_at(p["times"], steps) if steps is not None else None
        layers = "" if p["layers_run"] is None else f"{p['layers_run']:.2f}"
        cells = [
            label,
            f"{p['lr']:g}",
            "-" if steps is None else str(steps),
            "" if steps is None else f"{base_steps / steps:.2f}x",
            "-" if seconds is None else f"{seconds:.1f} s",
            "" if seconds is None else f"{base_time / seconds:.2f}x",
            number(1000 * p["step_time"], ".0f", " ms"),
            number(p["step_time"] / base["step_time"], ".2f"),
            layers,
            number(p["best"], ".4f"),
            number(p["final"], ".4f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def grid_table(grid: list[dict], target: float, study: dict) -> str:
    """Every seed-0 trial: steps to the target / best held-out loss, by arm and lr."""
    rates = sorted({p["lr"] for p in grid})
    header = ["arm", *(f"lr {lr:g}" for lr in rates)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    groups = [("postln", None), *(("pld", g) for g in study["gammas"]), ("preln", None)]
    for arm, gamma in groups:
        mine = {p["lr"]: p for p in grid if p["arm"] == arm and p.get("gamma") == gamma}
        if not mine:
            continue
        cells = [curves.grid_cell(mine.get(lr), target) for lr in rates]
        lines.append(f"| {arm_name(arm, gamma)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def seed_table(every: list[dict]) -> str | None:
    """The trials run at more than one seed: best held-out loss per seed, and its gap to
    the repeated PostLN trial of the same seed. The held-out split is masked by the run's
    seed, so losses compare within a seed, not across seeds."""
    groups = {}
    for p in every:
        groups.setdefault((p["arm"], p.get("gamma"), p["lr"]), {})[p["seed"]] = p
    repeated = {key: by_seed for key, by_seed in groups.items() if len(by_seed) > 1}
    if not repeated:
        return None
    seeds = sorted({seed for by_seed in repeated.values() for seed in by_seed})
    postln = next((by_seed for (arm, _, _), by_seed in repeated.items() if arm == "postln"), {})
    header = ["arm", "lr", *(f"seed {seed}" for seed in seeds)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (arm, gamma, lr), by_seed in repeated.items():
        cells = []
        for seed in seeds:
            p, base = by_seed.get(seed), postln.get(seed)
            if p is None:
                cells.append("")
            elif not p["curve"]:
                cells.append(f"({p['status'] or 'not run'})")
            elif arm == "postln" or base is None or not math.isfinite(base["best"]):
                cells.append(number(p["best"], ".4f"))
            else:
                cells.append(f"{number(p['best'], '.4f')} ({p['best'] - base['best']:+.4f})")
        lines.append(f"| {arm_name(arm, gamma)} | {lr:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def reading_note(every: list[dict], base: dict, rows: list[tuple[str, dict]]) -> str:
    """The evaluation interval and the seeds behind the table (curves.reading_note)."""
    chosen = [base, *(p for _, p in rows)]
    seeds = curves.fewest_seeds(chosen, every, ("arm", "gamma", "lr"))
    return curves.reading_note(chosen, seeds)


def timing_note(timed: dict | None) -> str:
    """Where the step times come from."""
    if timed is None:
        return (
            "Times: the trials' logged step times added up to the step (no compilation, no "
            "evaluation), at whatever load each trial ran; step time: the median logged step."
        )
    low, high = sorted(timed["load_average"])
    return (
        f"Times: each arm's step time timed round-robin ({timed['rounds']} rounds of one "
        f"step of each arm in one process, the median; load average {low:.1f}-{high:.1f}; "
        f"{curves.STEP_TIMES_FILE}), times the steps; PLD's at theta_bar."
    )


def study_report(directory: str, trials: dict, study: dict) -> str:
    """The study's Markdown section; writes its plots into `directory`."""
    timed = curves.step_times(directory)
    every = points(directory, trials, timed)
    grid = [p for p in every if p["seed"] == 0]
    base = baseline(grid)
    lines = ["## PLD against the PostLN baseline: steps and time to its best held-out loss", ""]
    if base is None:
        return "\n".join([*lines, "No PostLN trial has a held-out loss yet."])
    target = base["best"]
    rows = arms(grid, target, study["gammas"])
    lines += [
        f"Target: the PostLN baseline's best held-out MLM loss, {target:.4f} (its lr "
        f"{base['lr']:g}, the lowest of its grid). PLD: theta_bar {study['theta_bar']}, "
        f"DeepSpeed's depth rule; every trial {study['num_steps']:,} steps. `-` = target "
        f"not reached. {timing_note(timed)} Layers run: the trial's mean over its logged "
        "steps.",
        "",
        comparison_table(base, rows, target),
        "",
        reading_note(every, base, rows),
        "",
        f"The paper's claim: PLD reaches its PostLN baseline's downstream accuracy "
        f"{study['paper_speedup']}x faster.",
        "",
        "Every trial (steps to the target / best held-out MLM loss):",
        "",
        grid_table(grid, target, study),
        "",
    ]
    seeds = seed_table(every)
    if seeds:
        lines += [
            "Repeated with another seed: best held-out loss (and its gap to PostLN of the "
            "same seed; the held-out masking follows the seed, so compare within a column):",
            "",
            seeds,
            "",
        ]
    chosen = [("PostLN baseline", base), *rows]
    gammas = list(study["gammas"])
    plot_curves(directory, chosen, target, gammas)
    plot_learning_rates(directory, grid, gammas)
    seconds = sum(t.get("wall_time_s") or 0.0 for t in trials.values())
    done = sum(t.get("status") == "finished" for t in trials.values())
    lines += [
        f"{done} of {len(trials)} trials finished; their wall times add up to "
        f"{format_duration(seconds)} (trials that ran side by side overlap).",
        "",
        "Plots: pld_loss_vs_steps.png, pld_loss_vs_time.png, pld_learning_rates.png",
    ]
    return "\n".join(lines)


def color(point: dict, gammas: list[str]) -> str:
    """The arm's colour; PLD's second gamma its own."""
    if point["arm"] == "pld" and point.get("gamma") != gammas[0]:
        return "tab:olive"
    return COLORS[point["arm"]]


def plot_curves(directory: str, chosen: list, target: float, gammas: list[str]) -> None:
    plt = plots.pyplot()
    for by_time in (False, True):
        figure, axis = plt.subplots(figsize=(7, 4.5))
        for label, p in chosen:
            curve = [(s, loss) for s, loss in p["curve"] if math.isfinite(loss)]
            xs = [time_at(p["times"], s) if by_time else s for s, _ in curve]
            axis.plot(
                xs,
                [loss for _, loss in curve],
                "--" if label.startswith("PreLN alone") else "-",
                marker="o",
                markersize=3,
                color=color(p, gammas),
                label=label if "at that lr" in label else f"{label} ({p['lr']:g})",
            )
        axis.axhline(target, color="gray", linestyle=":", label=f"target {target:.3f}")
        plots.finish(
            figure,
            axis,
            directory,
            f"pld_loss_vs_{'time' if by_time else 'steps'}.png",
            xlabel="training time (s)" if by_time else "step",
            ylabel="held-out MLM loss",
            title=f"Held-out MLM loss against {'training time' if by_time else 'steps'}",
        )


def plot_learning_rates(directory: str, grid: list[dict], gammas: list[str]) -> None:
    figure, axis = plots.pyplot().subplots(figsize=(7, 4.5))
    for arm, gamma in [("postln", None), *(("pld", g) for g in gammas), ("preln", None)]:
        mine = [p for p in grid if p["arm"] == arm and p.get("gamma") == gamma]
        mine = sorted((p for p in mine if math.isfinite(p["best"])), key=lambda p: p["lr"])
        if not mine:
            continue
        axis.plot(
            [p["lr"] for p in mine],
            [p["best"] for p in mine],
            "-o",
            color=color(mine[0], gammas),
            label=arm_name(arm, gamma),
        )
    axis.set_xscale("log", base=2)
    plots.finish(
        figure,
        axis,
        directory,
        "pld_learning_rates.png",
        xlabel="peak learning rate",
        ylabel="best held-out MLM loss",
        title="Best held-out loss against the learning rate",
        minor_grid=True,
    )


def arm_name(arm: str, gamma: str | None) -> str:
    return {"postln": "PostLN", "preln": "PreLN"}.get(arm, f"PreLN + PLD, gamma {gamma}")
