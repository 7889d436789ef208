"""The chunked-accumulation study's report: training with the papers' 8-bit arithmetic,
naive and chunked, against float32, and the variance a low-precision sum keeps.

Answers `{"kind": "chunked_accumulation", ...}` (studies/chunked_accumulation/config.py).
The trials are labelled (accumulation, seed); the report reads each one's held-out MLM
loss curve and applies the rule the study fixed before the runs:

  the papers' claim holds here  if naive ends above the float32 arm of the same seed by
                                more than `tolerance` and chunk64 within it;

worded as what the data allow: with fewer than curves.MIN_SEEDS seeds per arm a pattern is
a direction, not a measured effect, and where naive ends within the tolerance the verdict
says whether the accumulator could have lost anything at these lengths (the variance a
naive sum in it keeps, from the sweep below) rather than "no";

and runs the variance-retention sweep (lambjax.contrib.variance_retention): for each mantissa
width in `vrr.mantissas`, sums of `vrr.length` standard-normal terms in an e{exponent_bits}mM
accumulator, naive and in chunks of `vrr.chunk`, measured with lambjax.contrib.precision's
emulation and predicted. Its numbers are kept in DIR/variance_retention.json and reused while
the study's `vrr` settings are the same.

Written into DIR: the study's section of report.md, training_curves.png (held-out MLM loss
against step, one line per trial) and variance_retention.png (measured and predicted VRR
against the mantissa width).
"""

import json
import math
import re

from etils import epath

from lambjax.contrib import variance_retention
from lambjax.sweep import plots
from lambjax.train.metrics import format_duration
from studies import curves

VRR_FILE = "variance_retention.json"
# A naive sum keeping this much of its variance loses too little for chunks to recover.
RETAINED = 0.99
STYLES = {
    "float32": ("black", "o"),
    "naive": ("tab:red", "^"),
    "chunk64": ("tab:blue", "s"),
    "naive_e6m4": ("tab:orange", "v"),
    "chunk64_e6m4": ("tab:cyan", "D"),
}


def setting(overrides: dict) -> str | None:
    """A trial's accumulation setting (`chunked_accumulation.setting`; sweep.json files of
    earlier runs hold it as the model override `matmul_accumulation`)."""
    return overrides.get(
        "chunked_accumulation.setting", overrides.get("model.overrides.matmul_accumulation")
    )


def finals(directory: str, trials: dict) -> list[dict]:
    """One record per labelled trial: its labels, setting, eval curve and final loss."""
    result = []
    for name, trial, run in curves.labelled(directory, trials):
        finished = run["curve"] and trial.get("status") == "finished"
        result.append(
            {
                **trial["labels"],
                "name": name,
                "setting": setting(trial["overrides"]),
                "curve": run["curve"],
                "final": run["final"] if finished else None,
                "status": trial.get("status", ""),
                "wall_time_s": trial.get("wall_time_s"),
            }
        )
    return result


def verdict(records: list[dict], study: dict, retention: float | None = None) -> str:
    """The rule fixed in the study, applied to the seed-0 arms, in words no stronger than
    one seed per arm allows. `retention`: the variance a naive sum in the naive arm's
    accumulator keeps over the variance sweep's length (naive_retention), which says
    whether naive and chunked arithmetic could have differed at all."""
    by_arm = {r["accumulation"]: r["final"] for r in records if r["seed"] == 0}
    baseline, tolerance = by_arm.get(study["baseline"]), study["tolerance"]
    naive, chunked = by_arm.get("naive"), by_arm.get("chunk64")
    if None in (baseline, naive, chunked):
        return "Not every seed-0 arm has finished: no verdict."
    naive_gap, chunk_gap = naive - baseline, chunked - baseline
    gaps = (
        f"naive - float32 = {naive_gap:+.4f}, chunk64 - float32 = {chunk_gap:+.4f} "
        f"(tolerance {tolerance})"
    )
    seeds = len({r["seed"] for r in records if r["accumulation"] == "naive"})
    one_seed = (
        f" {'One seed' if seeds == 1 else f'{seeds} seeds'} per arm: the gaps' own noise is "
        "not measured, so this is a direction, not a measured effect."
        if seeds < curves.MIN_SEEDS
        else ""
    )
    if naive_gap > tolerance and chunk_gap <= tolerance:
        return (
            "**The claim's pattern appears here**: naive accumulation degrades and chunks of "
            f"64 recover it; {gaps}.{one_seed}"
        )
    if naive_gap <= tolerance and chunk_gap <= tolerance:
        if retention is None:
            return (
                "**Inconclusive**: naive accumulation ends within the tolerance of float32, "
                f"so chunking has nothing to recover; {gaps}; whether the accumulator could "
                "lose anything at these lengths is the variance sweep's question."
            )
        kept = (
            f"a naive sum in the accumulator keeps {retention:.4f} of its variance at "
            f"{study['vrr']['length']:,} terms"
        )
        if "tokens_per_weight_gradient" in study:
            kept += f" (the weight gradients here contract {study['tokens_per_weight_gradient']:,})"
        if retention >= RETAINED:
            return (
                "**Cannot test the claim at this size**: naive accumulation ends within the "
                f"tolerance of float32, so chunking has nothing to recover; {gaps}; {kept}, so "
                "naive and chunked arithmetic could hardly differ: a narrower accumulator or "
                "longer contractions would test the claim."
            )
        return (
            "**Not confirmed here**: naive accumulation trains as well as float32 although "
            f"{kept}; {gaps}.{one_seed}"
        )
    if chunk_gap > tolerance:
        return f"**Not confirmed here**: chunks of 64 do not recover float32; {gaps}.{one_seed}"
    return f"**Not confirmed here**: {gaps}.{one_seed}"


def naive_retention(rows: list[dict], study: dict) -> float | None:
    """The measured VRR of a naive sum in the naive arm's accumulator (its eXmM setting's
    mantissa width), from the variance sweep's rows; None where the sweep lacks it."""
    match = re.match(r"e\d+m(\d+)", study.get("arms", {}).get("naive", ""))
    if match is None:
        return None
    mantissa = int(match.group(1))
    return next((r["naive_measured"] for r in rows if r["mantissa_bits"] == mantissa), None)


def training_table(records: list[dict], study: dict) -> str:
    baseline = {r["seed"]: r["final"] for r in records if r["accumulation"] == study["baseline"]}
    lines = [
        "| accumulation | seed | setting | final held-out MLM loss "
        "| - float32 (same seed) | time | status |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in records:
        final, reference = r["final"], baseline.get(r["seed"])
        gap = "" if final is None or reference is None else f"{final - reference:+.4f}"
        time = format_duration(r["wall_time_s"]) if r["wall_time_s"] else ""
        lines.append(
            f"| {r['accumulation']} | {r['seed']} | `{r['setting']}` | "
            f"{'' if final is None else f'{final:.4f}'} | {gap} | {time} | {r['status']} |"
        )
    return "\n".join(lines)


def exploratory(records: list[dict], study: dict) -> str:
    """The arms outside the rule, as gaps to float32 (seed 0)."""
    by_arm = {r["accumulation"]: r["final"] for r in records if r["seed"] == 0}
    baseline = by_arm.get(study["baseline"])
    gaps = [
        f"{arm} - float32 = {by_arm[arm] - baseline:+.4f}"
        for arm in study.get("exploratory", [])
        if by_arm.get(arm) is not None and baseline is not None
    ]
    return f"Outside the rule (exploratory arms): {', '.join(gaps)}." if gaps else ""


def noise(records: list[dict], study: dict) -> str:
    runs = [r for r in records if r["accumulation"] == study["baseline"] and r["final"]]
    if len(runs) < 2:
        return ""
    finals_by_seed = ", ".join(f"seed {r['seed']}: {r['final']:.4f}" for r in runs)
    spread = max(r["final"] for r in runs) - min(r["final"] for r in runs)
    return f"Seed noise: the float32 arm ends at {finals_by_seed} (spread {spread:.4f})."


def vrr_rows(directory: str, settings: dict) -> list[dict]:
    """Measured and predicted VRR per mantissa width, naive and chunked (cached)."""
    path = epath.Path(directory) / VRR_FILE
    if path.exists():
        cached = json.loads(path.read_text())
        if cached.get("settings") == settings:
            return cached["rows"]
    length, chunk = settings["length"], settings["chunk"]
    rows = []
    for mantissa in settings["mantissas"]:
        row = {"mantissa_bits": mantissa}
        for arm, chunk_size in (("naive", None), ("chunked", chunk)):
            row[f"{arm}_measured"] = variance_retention.measured_vrr(
                length,
                mantissa,
                chunk_size,
                sums=settings["sums"],
                exponent_bits=settings["exponent_bits"],
                seed=settings["seed"],
            )
            row[f"{arm}_predicted"] = variance_retention.predicted_vrr(length, mantissa, chunk_size)
        rows.append(row)
    path.write_text(json.dumps({"settings": settings, "rows": rows}, indent=1))
    return rows


def vrr_table(rows: list[dict], settings: dict) -> str:
    lines = [
        f"| mantissa bits | naive measured | naive predicted | chunk {settings['chunk']} "
        f"measured | chunk {settings['chunk']} predicted |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['mantissa_bits']} | {row['naive_measured']:.4f} | "
            f"{row['naive_predicted']:.4f} | {row['chunked_measured']:.4f} | "
            f"{row['chunked_predicted']:.4f} |"
        )
    return "\n".join(lines)


def needed_mantissa(rows: list[dict], column: str, threshold: float = 0.99):
    """The fewest mantissa bits from which on every width keeps VRR >= threshold."""
    widths = [r["mantissa_bits"] for r in rows]
    for index, width in enumerate(widths):
        if all(r[column] >= threshold for r in rows[index:]):
            return width
    return None


def study_report(directory: str, trials: dict, study: dict) -> str:
    """The study's Markdown section; writes its plots into `directory`."""
    records = finals(directory, trials)
    settings = study["vrr"]
    rows = vrr_rows(directory, settings)
    plot_training(directory, records)
    plot_vrr(directory, rows, settings)
    needed = {
        column: needed_mantissa(rows, column)
        for column in ("naive_measured", "naive_predicted", "chunked_measured", "chunked_predicted")
    }
    lines = [
        "## Chunked accumulation: does 8-bit training with a 1-6-9 accumulator need chunks?",
        "",
        f"{study['num_steps']} steps at batch {study['batch_size']} "
        f"({study['tokens_per_weight_gradient']:,} tokens in each weight gradient's "
        "contraction); held-out MLM loss at the last step. The rule, fixed before the runs: "
        "the claim holds if naive ends above float32 (same seed) by more than the tolerance "
        "and chunk64 within it.",
        "",
        training_table(records, study),
        "",
        verdict(records, study, naive_retention(rows, study)),
    ]
    for extra in (exploratory(records, study), noise(records, study)):
        if extra:
            lines += ["", extra]
    lines += [
        "",
        f"### Variance retention: {settings['sums']:,} sums of {settings['length']:,} N(0, 1) "
        f"terms in e{settings['exponent_bits']}mM, naive and in chunks of {settings['chunk']}",
        "",
        vrr_table(rows, settings),
        "",
        "Fewest mantissa bits keeping VRR >= 0.99 at this length (and at every wider width): "
        f"naive {needed['naive_measured']} measured / {needed['naive_predicted']} predicted; "
        f"chunked {needed['chunked_measured']} measured / {needed['chunked_predicted']} "
        "predicted.",
        "",
        "Plots: training_curves.png, variance_retention.png",
    ]
    return "\n".join(lines)


def plot_training(directory: str, records: list[dict]) -> None:
    figure, axis = plots.pyplot().subplots(figsize=(7, 4.5))
    for r in records:
        color, marker = STYLES.get(r["accumulation"], ("tab:gray", "o"))
        steps = [s for s, _ in r["curve"]]
        losses = [loss for _, loss in r["curve"]]
        style = "-" if r["seed"] == 0 else ":"
        label = f"{r['accumulation']} (seed {r['seed']})"
        axis.plot(steps, losses, style, marker=marker, color=color, label=label)
    plots.finish(
        figure,
        axis,
        directory,
        "training_curves.png",
        xlabel="step",
        ylabel="held-out MLM loss",
        title="8-bit operands: naive accumulation against chunks of 64",
    )


def plot_vrr(directory: str, rows: list[dict], settings: dict) -> None:
    figure, axis = plots.pyplot().subplots(figsize=(7, 4.5))
    widths = [r["mantissa_bits"] for r in rows]
    for arm, color, label in (
        ("naive", "tab:red", "naive"),
        ("chunked", "tab:blue", f"chunks of {settings['chunk']}"),
    ):
        measured = [r[f"{arm}_measured"] for r in rows]
        predicted = [r[f"{arm}_predicted"] for r in rows]
        axis.plot(widths, measured, "o", color=color, label=f"{label}, measured")
        axis.plot(widths, predicted, "-", color=color, label=f"{label}, predicted")
    axis.axhline(1.0, color="gray", linewidth=0.8)
    axis.set_ylim(0, max(1.1, math.ceil(max(r["chunked_measured"] for r in rows) * 10) / 10))
    plots.finish(
        figure,
        axis,
        directory,
        "variance_retention.png",
        xlabel="accumulator mantissa bits (e6mM)",
        ylabel="variance retention ratio",
        title=f"Sums of {settings['length']:,} N(0, 1) terms",
    )
