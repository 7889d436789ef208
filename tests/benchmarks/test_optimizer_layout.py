"""benchmarks/optimizer_layout.py counts and times the three layouts in one run; grouped,
the reductions are the stacked tree's."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import optimizer_layout  # noqa: E402


@pytest.mark.slow
def test_counts_and_times_every_layout(capsys):
    rows = optimizer_layout.main(["--model=tiny", "--steps=1", "--optimizers=lamb"])
    by_layout = {row["layout"]: row for row in rows}
    assert set(by_layout) == {"stacked", "per_layer", "grouped"}
    assert by_layout["per_layer"]["leaves"] == by_layout["grouped"]["leaves"] == 398
    assert by_layout["grouped"]["fusions_reduce"] == by_layout["stacked"]["fusions_reduce"]
    assert by_layout["per_layer"]["fusions"] > 10 * by_layout["stacked"]["fusions"]
    assert all(row["median_update_ms"] > 0 for row in rows)
    assert "| lamb | grouped |" in capsys.readouterr().out
