"""What the study reports read off their trials: each labelled trial's held-out loss curve
and logged step times, steps and training time to a target loss.

Steps to a target are the first evaluation at or below it, exact only to the evaluation
interval (`target_bracket`, `ratio_range`); a gap to a baseline reads as better or worse
only against a noise band measured from at least MIN_SEEDS seeds (`seed_verdict`).
Training time adds up the trial's logged step times (`train/step_time_s`, each the mean of
its log window) to that step: compiling and evaluating are not counted, and the first
window, which holds the compilation and has no step time, is counted at the next window's
rate.

Trials that ran side by side, or at different times, logged their step times at whatever
load the machine had then; `studies/pld/benchmark.py --sweep DIR` times one step of each
arm in turn in one process instead and writes DIR/step_times.json, which `step_times` reads
(arms named by `arm_of`).
"""

import json
import math
import statistics
from collections.abc import Iterator

from etils import epath

from lambjax.train.metrics import read_jsonl

LOSS, STEP_TIME = "eval/mlm_loss", "train/step_time_s"
STEP_TIMES_FILE = "step_times.json"
# Fewer runs than this per arm give no spread to read a gap against: a gap is a verdict
# only where the baseline was run with at least this many seeds.
MIN_SEEDS = 3
# Labels that leave the cost of a step alone: trials that differ only in them are one arm.
COST_FREE_LABELS = ("lr", "seed")


def records(workdir: str) -> list[tuple[int, dict]]:
    """A trial's metrics.jsonl as (step, record), in step order; [] before it has any."""
    path = epath.Path(workdir) / "metrics.jsonl"
    return sorted(read_jsonl(str(path)).items()) if path.exists() else []


def labelled(directory: str, trials: dict) -> Iterator[tuple[str, dict, dict]]:
    """(name, trial, run) of each labelled trial of a sweep directory, where `run` holds its
    held-out loss `curve`, its training `times` (log step -> seconds), its median
    `step_time`, its `best` and `final` held-out loss and its metrics `records`."""
    for name, trial in trials.items():
        if trial.get("labels"):
            yield name, trial, read_run(f"{directory}/{name}")


def read_run(workdir: str) -> dict:
    rows = records(workdir)
    curve = [(step, r[LOSS]) for step, r in rows if LOSS in r]
    step_times = [(step, r[STEP_TIME]) for step, r in rows if STEP_TIME in r]
    log_steps = [step for step, r in rows if any(k.startswith("train/") for k in r)]
    finite = [loss for _, loss in curve if math.isfinite(loss)]
    seconds = [s for _, s in step_times]
    return {
        "curve": curve,
        "times": cumulative_times(log_steps, step_times),
        "step_time": statistics.median(seconds) if seconds else math.nan,
        "best": min(finite) if finite else math.inf,
        "final": curve[-1][1] if curve else math.nan,
        "records": rows,
    }


def steps_to_target(curve: list[tuple[int, float]], target: float) -> int | None:
    """The first evaluated step at or below `target`; None if none is."""
    return next((step for step, loss in curve if loss <= target), None)


def target_bracket(curve: list[tuple[int, float]], target: float) -> tuple[int, int] | None:
    """(lo, hi): the target was first reached after step lo and at step hi, the evaluation
    before the first one at or below it (0 where that is the first) and that one; None if
    none is. A steps count read off evaluations is exact only to this interval."""
    hi = steps_to_target(curve, target)
    if hi is None:
        return None
    return max((step for step, _ in curve if step < hi), default=0), hi


def ratio_range(numerator: tuple[int, int], denominator: tuple[int, int]) -> tuple[float, float]:
    """The range of steps_a / steps_b that two target brackets allow: each count lies in
    (lo, hi], so the ratio lies between lo_a / hi_b and hi_a / lo_b (inf where lo_b is 0)."""
    (lo_a, hi_a), (lo_b, hi_b) = numerator, denominator
    return lo_a / hi_b, (hi_a / lo_b if lo_b else math.inf)


def seed_verdict(gap: float, band: float, seeds: int, noun: str = "the seed spread") -> str:
    """How a gap to the baseline reads against a noise band measured from `seeds` runs of
    it: `better` or `worse` where the gap is beyond the band, `comparable` within it; but
    where the band comes from fewer than MIN_SEEDS runs it is one or two samples of the
    noise and bounds nothing, so the reading is `inconclusive`, with the gap as a multiple
    of the band and its sign; `-` where either is unknown."""
    if not (math.isfinite(gap) and math.isfinite(band)):
        return "-"
    within = abs(gap) <= band
    if seeds >= MIN_SEEDS:
        return "comparable" if within else ("better" if gap < 0 else "worse")
    multiple = abs(gap) / band if band else math.inf
    sign = "" if within else (", lower" if gap < 0 else ", higher")
    return f"inconclusive ({multiple:.1f}x {noun}{sign})"


def fewest_seeds(chosen: list[dict], every: list[dict], labels: tuple[str, ...]) -> int:
    """The fewest seeds any chosen point's arm was run with: the points of `every` that
    share its `labels` (all but the seed)."""
    runs = [sum(all(q.get(k) == p.get(k) for k in labels) for q in every) for p in chosen]
    return min(runs, default=0)


def reading_note(points: list[dict], seeds: int) -> str:
    """What a report's steps and gaps can carry: the evaluation intervals of the `points`'
    curves (a steps count is exact only to its interval) and the seeds per arm (with fewer
    than MIN_SEEDS a gap between arms is a direction, not a verdict)."""
    intervals = set()
    for p in points:
        steps = [step for step, _ in p["curve"]]
        intervals |= {b - a for a, b in zip(steps, steps[1:], strict=False)}
    every = ", ".join(map(str, sorted(intervals))) or "-"
    note = f"Steps to a target are exact to the evaluation interval (every {every} steps)."
    if seeds < MIN_SEEDS:
        note += (
            f" {'One seed' if seeds == 1 else f'{seeds} seeds'} per arm: a gap between arms "
            f"is a direction, not a verdict, until {MIN_SEEDS} seeds give it a spread."
        )
    return note


def grid_extension(tried, best) -> tuple:
    """The values a stage 2 adds to a grid of `tried` values (learning rates, multipliers)
    by the studies' rule: one more step (x2 or /2) beyond the edge that `best`, the chosen
    value, sits at; beyond both edges where nothing reached the target (`best` None);
    nothing where the best lies inside the grid."""
    tried = sorted(tried)
    if best is None:
        return (tried[0] / 2, tried[-1] * 2)
    if len(tried) > 1 and best == tried[0]:
        return (tried[0] / 2,)
    if len(tried) > 1 and best == tried[-1]:
        return (tried[-1] * 2,)
    return ()


def cumulative_times(log_steps: list[int], step_times: list[tuple[int, float]]) -> dict:
    """Log step -> training seconds up to it: each window's steps times its step time; a
    window without one (the first: compilation) at the next measured window's."""
    measured = dict(step_times)
    result, previous, total = {}, 0, 0.0
    for index, step in enumerate(log_steps):
        seconds = measured.get(step)
        if seconds is None:
            later = [measured[s] for s in log_steps[index + 1 :] if s in measured]
            seconds = later[0] if later else math.nan
        total += (step - previous) * seconds
        result[step], previous = total, step
    return result


def time_at(times: dict, step: int) -> float:
    """Training seconds to `step`: at the last log step at or before it, plus the steps
    since at the next window's rate (exact when evaluations fall on log steps)."""
    before = [s for s in times if s <= step]
    after = [s for s in times if s > step]
    base_step = max(before, default=0)
    base = times.get(base_step, 0.0)
    if step == base_step or not after:
        return base
    following = min(after)
    rate = (times[following] - base) / (following - base_step)
    return base + (step - base_step) * rate


def arm_of(labels: dict) -> str:
    """The arm a labelled trial belongs to, for step times: its labels but the cost-free."""
    return ",".join(f"{k}={v}" for k, v in labels.items() if k not in COST_FREE_LABELS)


def step_times(directory: str) -> dict | None:
    """DIR/step_times.json, the step time of each arm timed round-robin (`arm` -> seconds
    under "step_time_s", with "rounds" and "load_average"), or None where it was not run."""
    path = epath.Path(directory) / STEP_TIMES_FILE
    return json.loads(path.read_text()) if path.exists() else None


def uniform_times(times: dict, step_time: float) -> dict:
    """Log step -> training seconds at one step time (in place of the logged ones)."""
    return {step: step * step_time for step in times}


def rank(point: dict, target: float) -> tuple:
    """A report's order for choosing among trials: fewer steps to the target first, then
    the lower best held-out loss (`point` holds a trial's `curve` and `best`)."""
    steps = steps_to_target(point["curve"], target)
    return (math.inf if steps is None else steps, point["best"])


def number(value: float, spec: str, unit: str = "") -> str:
    """`value` formatted, or `-` where it is not finite (no evaluation, or a divergence)."""
    return f"{value:{spec}}{unit}" if math.isfinite(value) else "-"


def grid_cell(point: dict | None, target: float) -> str:
    """A grid table's cell: steps to the target / best held-out loss ('-' steps where it
    is not reached), the trial's status where it has no evaluation, empty where absent."""
    if point is None:
        return ""
    if not point["curve"]:
        return f"({point['status'] or 'not run'})"
    steps = steps_to_target(point["curve"], target)
    return f"{'-' if steps is None else steps} / {number(point['best'], '.3f')}"
