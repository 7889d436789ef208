"""benchmarks/accelerator_step.py runs end to end on CPU with the tiny preset: JSON lines
with the configuration and its throughput; a bad list value is refused in one line."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import accelerator_step  # noqa: E402


def test_tiny_preset_phase2_with_accumulation(tmp_path, capsys):
    out = tmp_path / "steps.jsonl"
    accelerator_step.main(
        [
            "--presets=tiny",
            "--phases=2",
            "--optimizers=lamb",
            "--attention=auto",
            "--batch-per-device=1",
            "--grad-accum=2",
            "--steps=1",
            "--vocab-size=512",
            f"--out={out}",
        ]
    )
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert printed == [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["phase"], r["optimizer"], r["grad_accum"]) for r in printed] == [("2", "lamb", 2)]
    for record in printed:
        assert record["attention_ran"] == "xla"  # no fused kernel on CPU
        assert record["attention_dropout"] == 0.0
        assert record["global_batch"] == 1 * 2 * int(record["device"].split(" x ")[0])
        assert record["sequences_per_s"] > 0 and record["mfu"] is None  # no CPU peak known


@pytest.mark.parametrize(
    "flag,message",
    [
        ("--optimizers=lamb,sgd", "'sgd' is not one of ['adamw', 'lamb', 'lans']"),
        ("--attention=cudnn", "runs on gpu only, this is cpu"),
        ("--grad-accum=0", "0 is not one of positive integers"),
    ],
)
def test_bad_values_are_refused_in_one_line(flag, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        accelerator_step.main(["--presets=tiny", flag])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
