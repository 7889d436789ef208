"""Every command given bad input ends with one line naming it, exit status 2, no traceback.

Each command runs its bad inputs in children of one process (tests/command_cases.py), as
`python -m lambjax.COMMAND ARGS` would: binary and non-UTF-8 files where text is expected,
truncated JSON, an empty corpus, a fine-tuning workdir where a pretraining one is expected
and the reverse.
"""

import dataclasses
import json
import os

import jax
import optax
import pytest

from lambjax import cli
from lambjax.models import hf
from lambjax.models.config import BertConfig
from lambjax.models.params import init_params
from lambjax.train import checkpointing
from lambjax.train import workdir as workdir_lib
from lambjax.train.state import TrainState
from tests import helpers
from tests.finetune import generate

BINARY = bytes(range(256)) * 4  # NULs and bytes that are not UTF-8
LATIN_1 = "[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\ncafé\n".encode("latin-1")
TWICE = b"[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nthe\nof\nthe\n"  # ids one past its size


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("bad")
    files = {
        "binary": BINARY,
        "latin1_vocab.txt": LATIN_1,
        "twice_vocab.txt": TWICE,
        "empty/corpus.txt": b"",
        "truncated.json": b'{"version": "1.1", "data": [{"title": "x", "paragraphs": [{"con',
        "latin1.json": json.dumps({"version": "1.1", "data": []}).encode() + b"\xe9",
        "binary.tsv": BINARY,
        "empty.json": b"",
        "hf/config.json": b'{"hidden_size": 128, "num_hidden_lay',
        "hf/vocab.txt": LATIN_1,
        "sweep/sweep.json": b'{"config": "configs/default.py", "trials": {"a": {',
        "raises.py": b"def get_config(arg=None):\n    return {}['missing']\n",
        "get_sweep_raises.py": (
            b"from lambjax.train import config\n\n"
            b"def get_config(arg=None):\n    return config.base_config()\n\n"
            b"def get_sweep(arg=None):\n    return 1 / 0\n"
        ),
    }
    paths = {}
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        paths[name] = str(path)
    paths["root"] = str(root)
    paths["dev.json"] = generate.write_squad(root / "dev.json", 8, 1)
    paths["sst2.tsv"] = generate.write_sst2(root / "sst2.tsv", 8, 1)
    paths["pretraining"] = pretraining_workdir(root / "pretraining")
    paths["finetuning"] = finetuning_workdir(root / "finetuning")
    paths["hf"] = str(root / "hf")
    paths["hf_tiny"], paths["hf_shapes"] = published_checkpoints(root)
    paths["sweep"] = str(root / "sweep")
    (root / "truncated_config").mkdir()
    (root / "truncated_config" / "config.json").write_text('{"seed": 0, "model": {"pre')
    paths["truncated_config"] = str(root / "truncated_config")
    return paths


def pretraining_workdir(root) -> str:
    """What `lambjax.main` leaves after it accepted a run: the run's config.json."""
    root.mkdir()
    config = cli.load_config(os.path.join(helpers.REPO, "configs/default.py:runlocal"))
    workdir_lib.save_config(config.to_json_best_effort(), str(root))
    return str(root)


def published_checkpoints(root) -> tuple[str, str]:
    """A transformers checkpoint of a tiny BERT (uncased, 128 tokens), and a copy whose
    config.json gives another intermediate_size than its weights have."""
    model = BertConfig.preset("tiny", vocab_size=128, dtype="float32")
    params = jax.jit(init_params, static_argnums=0)(model, jax.random.key(0))
    vocab = root / "tiny_vocab.txt"
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab.write_text("\n".join(specials + [f"w{i}" for i in range(123)]) + "\n")
    tiny, shapes = root / "hf_tiny", root / "hf_shapes"
    for path in (tiny, shapes):
        hf.to_transformers(model, params, str(path), vocab_file=str(vocab))
    config = json.loads((shapes / "config.json").read_text())
    config["intermediate_size"] += 1
    (shapes / "config.json").write_text(json.dumps(config))
    return str(tiny), str(shapes)


def finetuning_workdir(root) -> str:
    """A fine-tuning run's checkpoint, written by its own checkpoint class."""
    model = BertConfig.preset("tiny", vocab_size=128, dtype="float32")
    params = jax.jit(init_params, static_argnums=0)(model, jax.random.key(0))
    meta = {
        "task": "sst2",
        "init": "scratch:tiny",
        "config": "{}",
        "model_config": dataclasses.asdict(model),
        "vocab_file": None,
        "lower_case": True,
    }
    ckpt = checkpointing.PhaseCheckpoints(str(root), "finetune", max_to_keep=1, async_save=False)
    ckpt.save(2, TrainState.create(params, optax.sgd(0.1)), {}, meta)
    ckpt.close()
    return str(root)


def main_cases(inputs, root) -> list[tuple[list[str], str]]:
    def main(*args, workdir=None):
        workdir = workdir or f"{root}/run"
        data_dir = f"--config.data.data_dir={root}/data"
        return ["--config=configs/default.py:runlocal", f"--workdir={workdir}", data_dir, *args]

    return [
        (main(f"--config.data.vocab={inputs['latin1_vocab.txt']}"), "is not UTF-8 text"),
        (main(f"--config.data.vocab={inputs['binary']}"), "is not UTF-8 text"),
        (main(f"--config.data.vocab={inputs['twice_vocab.txt']}"), "holds the token 'the' twice"),
        (main(f"--config.data.source=text:{inputs['root']}/empty/*.txt"), "holds no text"),
        (main(f"--config.data.source=text:{inputs['binary']}"), "decoded as UTF-8"),
        (main(workdir=inputs["finetuning"]), "holds a fine-tuning run"),
        (main("--config.mesh.dcn.data=2"), "mesh.dcn {'data': 2} spans 2 slices but the devices"),
        (main("--config.mesh.fsdp=2"), "the fixed axes multiply to 2, which does not divide 1"),
        (main(workdir=inputs["binary"]), "is a file"),
        (main(workdir=inputs["truncated_config"]), "config.json cannot be read"),
        ([f"--config={inputs['binary']}", "--workdir=x"], "is not a Python file"),
        (main("--config.phases.phase1.learning_rate=nan"), "learning_rate=nan must be"),
        (main("--config.data.masked_lm_prob=2.0"), "masked_lm_prob=2.0 must lie in (0, 1]"),
        ([f"--config={inputs['raises.py']}", "--workdir=x"], "get_config() raised KeyError"),
        *published_cases(inputs),
    ]


def published_cases(inputs) -> list[tuple[list[str], str]]:
    """`config.init` and `config.tracking`: each case's workdir must stay unwritten
    (test_a_bad_start_writes_nothing)."""

    def main(*args):
        workdir = f"--workdir={inputs['root']}/unwritten"
        return ["--config=configs/default.py:runlocal", workdir, *args]

    tiny = f"--config.init=hf:{inputs['hf_tiny']}"
    return [
        (main(f"--config.init=hf:{inputs['root']}/empty"), "neither a transformers"),
        (main(f"--config.init=tf:{inputs['hf_tiny']}"), "it looks like hf:"),
        (main(f"--config.init=hf:{inputs['binary']}"), "is not a directory"),
        (main("--config.init=scratch:tiny"), "valid: '' (random), hf:DIR, tf:DIR, workdir:PATH"),
        (main(f"--config.init=hf:{inputs['hf']}"), "config.init="),
        (main(f"--config.init=hf:{inputs['hf_shapes']}"), "has shape (512,), but its config"),
        (main(tiny, "--config.model.preset=mini"), "config.model contradicts"),
        (main(tiny, "--config.data.lower_case=false"), "which was trained with lower_case=True"),
        (main(tiny, f"--config.data.vocab={inputs['latin1_vocab.txt']}"), "is not the vocabulary"),
        (main("--config.tracking.backends=neptune"), "unknown 'neptune'"),
    ]


def prepare_cases(inputs, root) -> list[tuple[list[str], str]]:
    def prepare(*args):
        return ["--config=configs/default.py:runlocal", f"--config.data.data_dir={root}/d", *args]

    return [
        (prepare(f"--config.data.vocab={inputs['latin1_vocab.txt']}"), "is not UTF-8 text"),
        (prepare(f"--config.data.source=text:{inputs['root']}/empty/*.txt"), "holds no text"),
        (prepare(f"--config.data.source=text:{inputs['binary']}"), "decoded as UTF-8"),
        (["--config=configs/default.py:runlocal"], "give --workdir=DIR"),
        (prepare("--beam_pipeline_options=runner=DataflowRunner"), "needs project=..."),
        ([f"--config={inputs['binary']}"], "is not a Python file"),
        (prepare("--config.data.masked_lm_prob=2.0"), "masked_lm_prob=2.0 must lie in (0, 1]"),
        ([f"--config={inputs['raises.py']}", "--workdir=x"], "get_config() raised KeyError"),
    ]


def export_cases(inputs, root) -> list[tuple[list[str], str]]:
    out = f"--out={root}/export"
    return [
        ([f"--workdir={inputs['finetuning']}", out], "holds a fine-tuning run"),
        ([f"--workdir={inputs['pretraining']}", out], "no checkpoints under"),
        ([f"--workdir={inputs['binary']}", out], "no such directory"),
        ([f"--workdir={inputs['pretraining']}", f"--out={inputs['binary']}"], "is a file"),
    ]


def finetune_cases(inputs, root) -> list[tuple[list[str], str]]:
    def squad(train, *args, workdir=None):
        return [
            "--config=configs/finetune/squad.py",
            f"--workdir={workdir or f'{root}/finetune'}",
            "--config.init=scratch:tiny",
            f"--config.data.train={train}",
            f"--config.data.eval={inputs['dev.json']}",
            *args,
        ]

    sst2 = ["--config=configs/finetune/glue.py:sst2", f"--workdir={root}/sst2"]
    return [
        (squad(inputs["truncated.json"]), "truncated.json"),
        (squad(inputs["latin1.json"]), "latin1.json"),
        (squad(inputs["binary"]), "binary"),
        (squad(inputs["empty.json"]), "empty.json"),
        (squad(inputs["dev.json"], f"--config.vocab={inputs['latin1_vocab.txt']}"), "UTF-8"),
        (squad(inputs["dev.json"], f"--config.init=hf:{inputs['hf']}"), "config.json is not"),
        (squad(inputs["dev.json"], f"--config.init=workdir:{inputs['finetuning']}"),
         "is a fine-tuning run"),
        (squad(inputs["dev.json"], workdir=inputs["pretraining"]), "holds a pretraining run"),
        ([*sst2, "--config.init=scratch:tiny", f"--config.data.train={inputs['binary.tsv']}",
          f"--config.data.eval={inputs['sst2.tsv']}"], "binary.tsv"),
        (squad(inputs["dev.json"], "--config.learning_rate=inf"), "learning_rate=inf must be"),
        ([f"--config={inputs['raises.py']}", "--workdir=x"], "get_config() raised KeyError"),
    ]  # fmt: skip


def sweep_cases(inputs, root) -> list[tuple[list[str], str]]:
    return [
        ([f"--config={inputs['binary']}", f"--workdir={root}/sweep"], "is not a Python file"),
        (["report", inputs["sweep"]], "not valid JSON"),
        (["report", inputs["binary"]], inputs["binary"]),
        (["--config=configs/default.py", f"--workdir={inputs['binary']}"], "--workdir"),
        (["--config=configs/finetune/squad.py", "--workdir=x"], "defines no get_sweep()"),
        (["--config=configs/default.py", "--workdir=x", "--parallel=0"], "--parallel=0"),
        ([f"--config={inputs['get_sweep_raises.py']}", "--workdir=x"], "get_sweep() raised Zero"),
    ]


COMMANDS = {
    "lambjax.main": main_cases,
    "lambjax.prepare": prepare_cases,
    "lambjax.export": export_cases,
    "lambjax.finetune": finetune_cases,
    "lambjax.sweep": sweep_cases,
}


@pytest.fixture(scope="module")
def outcomes(inputs, tmp_path_factory) -> dict[str, list[str]]:
    """Every command's cases, run in one go: module -> a description of each failed case.

    A case passes if it ends with exit status 2 and one line `PROGRAM: error: ...` (its last)
    that holds the case's expected text, and prints no traceback."""
    root = tmp_path_factory.mktemp("runs")
    cases = [(m, args, want) for m, make in COMMANDS.items() for args, want in make(inputs, root)]
    codes, errors = helpers.run_command_cases(root, [(module, args) for module, args, _ in cases])
    failures = {module: [] for module in COMMANDS}
    for (module, args, expected), code, stderr in zip(cases, codes, errors, strict=True):
        error_lines = [line for line in stderr.splitlines() if ": error: " in line]
        ok = (
            code == 2
            and "Traceback" not in stderr
            and len(error_lines) == 1
            and stderr.strip().splitlines()[-1] == error_lines[0]
            and expected in error_lines[0]
        )
        if not ok:
            tail = "\n".join(stderr.strip().splitlines()[-3:])
            failures[module].append(f"{args[-1]} -> exit {code}, expected {expected!r}:\n{tail}")
    return failures


def test_a_bad_start_writes_nothing(outcomes, inputs):
    assert not os.path.exists(f"{inputs['root']}/unwritten")


@pytest.mark.parametrize("module", list(COMMANDS))
def test_bad_input_ends_in_one_line(outcomes, module):
    assert not outcomes[module], "\n\n".join(outcomes[module])
