"""The fields of a fine-tuning config and their checks.

Defaults are Google BERT's published recipes (run_squad.py / run_classifier.py and their
README): SQuAD lr 3e-5, 2 epochs, batch 24, sequence 384, doc stride 128, query 64, n-best 20,
answer length 30; GLUE lr 2e-5, 3 epochs, batch 32, sequence 128; linear warmup over the first
10% of the steps then linear decay to 0; AdamW (weight decay 0.01 except biases and
LayerNorm, gradient clipping at norm 1.0).
"""

import ml_collections

from lambjax import ranges
from lambjax.finetune import glue
from lambjax.finetune.errors import FinetuneError
from lambjax.train import config as train_config

SQUAD_TASKS = ("squad_v1.1", "squad_v2.0")
# The BertConfig fields a fine-tuning run may change (None: the checkpoint's / preset's).
MODEL_FIELDS = {
    "hidden_dropout": float,
    "attention_dropout": float,
    "dtype": str,
    "scan_layers": bool,
    "remat": bool,
}


def base_config() -> ml_collections.ConfigDict:
    optimizer = train_config.optimizer_config("adamw")
    return ml_collections.ConfigDict(
        {
            "task": "",  # squad_v1.1 | squad_v2.0 | a GLUE task
            # workdir:PATH (a lambjax pretraining run: its latest finished phase and its
            # vocabulary) | hf:PATH (a transformers BERT directory with vocab.txt) |
            # scratch:PRESET (random weights: tiny, mini, base, large)
            "init": "scratch:tiny",
            # A vocab.txt overriding the checkpoint's; for scratch:, "" trains a WordPiece
            # vocabulary of `vocab_size` on the training texts.
            "vocab": "",
            "vocab_size": 4096,
            # None: the checkpoint's setting, else the vocabulary's case (a vocabulary
            # without upper-case tokens is uncased). A mismatch is reported.
            "lower_case": ml_collections.FieldReference(None, field_type=bool),
            # Fields of BertConfig to override (dropout, dtype, scan_layers, remat).
            "model": {
                name: ml_collections.FieldReference(None, field_type=kind)
                for name, kind in MODEL_FIELDS.items()
            },
            "data": {
                "train": "",  # a file (SQuAD JSON, GLUE TSV) or tfds:NAME:SPLIT
                "eval": "",
                "eval_mismatched": "",  # MNLI's second dev set
                "tfds_data_dir": ml_collections.FieldReference(None, field_type=str),
            },
            "max_seq_length": 128,
            # SQuAD
            "doc_stride": 128,
            "max_query_length": 64,
            "n_best_size": 20,
            "max_answer_length": 30,
            "null_score_diff_threshold": 0.0,  # v2.0: answer "" above these null odds
            # Training
            "global_batch_size": 32,
            "eval_batch_size": 64,
            "num_epochs": 3.0,
            "num_steps": 0,  # > 0 overrides num_epochs
            "learning_rate": 2e-5,
            "warmup_fraction": 0.1,
            "optimizer": optimizer,  # name: adamw | lamb | lans
            "mesh": {"data": -1, "fsdp": 1, "tensor": 1},
            "seed": 42,
            "log_every_steps": 50,
            "eval_every_steps": 0,  # 0: evaluate at the end only
            "checkpoint_every_steps": 500,
            "max_checkpoints_to_keep": 2,
            # Also write the fine-tuned model as a transformers directory (PostLN models).
            "export_transformers": True,
        }
    )


# Numeric fields with a range: (field, interval, integer) (lambjax.ranges).
RANGES = (
    ("learning_rate", "(0, inf)", False),
    ("warmup_fraction", "[0, 1]", False),
    ("num_epochs", "[0, inf)", False),
    ("num_steps", "[0, inf)", True),
    ("vocab_size", "[1, inf)", True),
    ("null_score_diff_threshold", "(-inf, inf)", False),
    ("seed", "[0, inf)", True),
    ("eval_every_steps", "[0, inf)", True),
    ("max_checkpoints_to_keep", "[1, inf)", True),
)
OPTIMIZER_RANGES = (
    ("b1", "[0, 1)"),
    ("b2", "[0, 1)"),
    ("eps", "(0, inf)"),
    ("weight_decay", "[0, inf)"),
    ("max_global_norm", "(0, inf)"),
)


def _check_range(field: str, value, interval: str, integer: bool) -> None:
    try:
        ranges.check(field, value, interval, integer=integer)
    except ValueError as error:
        raise FinetuneError(str(error)) from None


def validate(config, num_data_parallel: int, process_count: int) -> None:
    if config.task not in SQUAD_TASKS and config.task not in glue.TASKS:
        raise FinetuneError(
            f"config.task={config.task!r}; valid: {' '.join(SQUAD_TASKS + tuple(glue.TASKS))}"
        )
    for field in ("train", "eval"):
        if not config.data[field]:
            raise FinetuneError(f"config.data.{field} is empty: give a file or tfds:NAME:SPLIT")
    if config.task == "mnli" and not config.data.eval_mismatched:
        raise FinetuneError("config.data.eval_mismatched is empty: MNLI scores dev_mismatched too")
    positive = (
        "max_seq_length",
        "global_batch_size",
        "eval_batch_size",
        "log_every_steps",
        "checkpoint_every_steps",
        "n_best_size",
        "max_answer_length",
        "doc_stride",
        "max_query_length",
    )
    for name in positive:
        if int(config[name]) <= 0:
            raise FinetuneError(f"config.{name}={config[name]} must be a positive integer")
    for name, interval, integer in RANGES:
        _check_range(f"config.{name}", config[name], interval, integer)
    for name, interval in OPTIMIZER_RANGES:
        value = config.optimizer[name]
        if value is not None:
            _check_range(f"config.optimizer.{name}", value, interval, False)
    for name in ("hidden_dropout", "attention_dropout"):
        if config.model[name] is not None:
            _check_range(f"config.model.{name}", config.model[name], "[0, 1)", False)
    if config.num_steps <= 0 and config.num_epochs <= 0:
        raise FinetuneError(f"config.num_epochs={config.num_epochs} must be > 0 (or num_steps)")
    if not 0 <= config.warmup_fraction <= 1:
        raise FinetuneError(f"config.warmup_fraction={config.warmup_fraction} must lie in [0, 1]")
    for name in ("global_batch_size", "eval_batch_size"):
        size = config[name]
        if size % num_data_parallel or size % process_count:
            raise FinetuneError(
                f"config.{name}={size} must be a multiple of the {num_data_parallel} "
                f"data-parallel devices and of the {process_count} processes"
            )
    if config.optimizer.name not in ("adamw", "lamb", "lans"):
        raise FinetuneError(
            f"config.optimizer.name={config.optimizer.name!r}; valid: adamw, lamb, lans"
        )
    kind, _, value = config.init.partition(":")
    if kind not in ("workdir", "hf", "tf", "scratch") or not value:
        raise FinetuneError(
            f"config.init={config.init!r}; valid: workdir:PATH, hf:PATH, tf:PATH, scratch:PRESET"
        )
