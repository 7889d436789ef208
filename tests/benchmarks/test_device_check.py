"""`python -m benchmarks.device_check` runs as one command at tiny size on CPU with only what
an accelerator image has (everything else is blocked from importing), prints its checks,
steps and profiles as JSON lines and a table, and refuses bad flags in one line."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from benchmarks import device_check, kernel_check, trace_summary
from lambjax.train.config import optimizer_config
from tests.helpers import REPO

# What an accelerator image lacks: the training stack's and the interop's packages.
NOT_ON_THE_IMAGE = (
    "tensorflow",
    "tensorflow_datasets",
    "grain",
    "ml_collections",
    "apache_beam",
    "clu",
    "transformers",
    "torch",
)
WITHOUT_THEM = """
import importlib.abc, runpy, sys

BLOCKED = set(sys.argv.pop(1).split(","))


class NotOnTheImage(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is not on the accelerator image")
        return None


sys.meta_path.insert(0, NotOnTheImage())
runpy.run_module("benchmarks.device_check", run_name="__main__", alter_sys=True)
"""


def run_without_the_training_stack(*flags) -> subprocess.CompletedProcess:
    # As a user starts it: one CPU device (not the 8 the test process fakes).
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO, "XLA_FLAGS": ""}
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_THEM, ",".join(NOT_ON_THE_IMAGE), *flags],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )


@pytest.mark.slow
@pytest.mark.compat
@pytest.mark.skipif(
    jax.__version_info__ < (0, 11),
    reason="the accelerator images run jax 0.11: the compatibility tier runs it there",
)
def test_the_tiny_check_runs_without_the_training_stack(tmp_path):
    out = tmp_path / "out"
    result = run_without_the_training_stack(
        "--preset=tiny", "--steps=2", "--profile-steps=1", "--kernel-batch=1",
        "--vocab-size=512", "--time-budget=3600", f"--out={out}",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    saved = (out / "results.jsonl").read_text().splitlines()
    assert records == [json.loads(line) for line in saved]
    assert records[0]["check"] == "environment" and records[0]["backend"] == "cpu"
    kernels = [r for r in records if r["check"] == "kernel"]
    assert [(r["seq"], r["rows"]) for r in kernels] == [
        (128, "padded"), (128, "packed"), (512, "padded"), (512, "packed"),
    ]  # fmt: skip
    assert all(r["ok"] and r["dq_rel_err"] < 3e-2 for r in kernels)
    steps = [r for r in records if r["check"] == "step"]
    assert sorted((r["phase"], r["grad_accum"], r["layers"]) for r in steps) == sorted(
        [(phase, 1, "grouped") for phase in (1, 2)]
        + [
            (phase, accum, layers)
            for phase in (1, 2)
            for accum in (1, 4)
            for layers in ("unrolled", "scan")
        ]
    )
    for r in steps:
        assert r["ok"] and r["attention_ran"] == "xla" and r["seq_per_s"] > 0
        assert r["sequences_per_step"] == {1: 8, 2: 2}[r["phase"]] * r["grad_accum"]
        assert r["xla_flops"] > 0 and r["mfu"] is None  # no CPU peak known
    profiled = [r for r in steps if "profile" in r]
    assert [(r["phase"], r["grad_accum"], r["layers"]) for r in profiled] == [
        (1, 1, "unrolled"),
        (2, 1, "unrolled"),
    ]
    for r in profiled:
        assert r["profile"]["kernels_per_step"] > 0
        assert sum(r["profile"]["ms_per_step_by_class"].values()) > 0
        assert 0 <= r["profile"]["idle_share"] <= 1
    assert "| phase | attention | accum |" in result.stdout
    assert "10 step configurations measured, 0 checks failed" in result.stdout


def test_no_step_starts_after_the_time_budget(monkeypatch, capsys):
    monkeypatch.setattr(kernel_check, "check", lambda *args: {"ok": True})
    assert device_check.main(["--preset=tiny", "--time-budget=0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    printed = [json.loads(line) for line in lines if line.startswith("{")]
    records = [r for r in printed if r["check"] == "step"]
    assert [(r["phase"], r["grad_accum"], r["layers"]) for r in records] == [
        (1, 1, "unrolled"), (2, 1, "unrolled"), (1, 1, "grouped"), (2, 1, "grouped"),
        (1, 1, "scan"), (2, 1, "scan"), (1, 4, "unrolled"), (2, 4, "unrolled"),
        (1, 4, "scan"), (2, 4, "scan"),
    ]  # fmt: skip
    assert all(r["skipped"] == "time budget" for r in records)


@pytest.mark.parametrize(
    "flag,message",
    [
        ("--phases=1,3", "--phases='1,3': each must be one of (1, 2)"),
        ("--grad-accum=0", "--grad-accum='0': each must be > 0"),
        ("--layers=unrolled,stacked", "each must be one of ['unrolled', 'grouped', 'scan']"),
        ("--steps=0", "--steps=0: must be > 0"),
        ("--preset=huge", "invalid choice: 'huge'"),
    ],
)
def test_bad_flags_are_refused_in_one_line(flag, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        device_check.main([flag])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_its_lamb_is_nvidias_recipe():
    assert vars(device_check.NVIDIA_LAMB) == dict(optimizer_config("lamb"))


def test_a_profile_is_summarized_by_kernel_class(tmp_path):
    step = jax.jit(lambda x: jnp.tanh(x @ x.T).sum(axis=0))
    x = jnp.ones((64, 64))
    step(x).block_until_ready()
    with jax.profiler.trace(str(tmp_path)):
        for _ in range(2):
            x = step(x)[None].repeat(64, 0)
        x.block_until_ready()
    summary = trace_summary.summarize(trace_summary.latest_xplane(str(tmp_path)), steps=2)
    assert summary["kernels_per_step"] >= 1
    assert summary["top_ops"][0][1] > 0
    assert all(not name.startswith("end:") for name, _ in summary["top_ops"])
    assert 0 <= summary["idle_share"] <= 1
    assert trace_summary.kernel_class("__cudnn$fmha_fwd") == "attention (fused)"
    assert trace_summary.kernel_class("nvjet_hsh_128x256_gemm") == "matmul"
    assert trace_summary.kernel_class("loop_multiply_fusion") == "elementwise fusion"
