r"""Export a training run's newest checkpoint as a Hugging Face `transformers` BERT.

  python -m lambjax.export --workdir=WORKDIR --out=DIR

DIR then loads with `transformers.BertForPreTraining.from_pretrained(DIR)`: `config.json`,
`model.safetensors`, and the run's `vocab.txt` when it still exists. The newest checkpoint is
that of the last phase (in the run's `phase_order`) that has one; the arrays are read onto
the host, whatever mesh wrote them.
"""

import os
import sys

from absl import app, flags

_WORKDIR = flags.DEFINE_string("workdir", None, "A lambjax training workdir.")
_OUT = flags.DEFINE_string("out", None, "Directory to write the transformers checkpoint to.")
flags.mark_flags_as_required(["workdir", "out"])


def export_workdir(workdir: str, out: str) -> str:
    """Exports the newest checkpoint of a training workdir; returns what was exported."""
    from lambjax.models import bert, hf
    from lambjax.train import checkpointing

    meta, params = checkpointing.latest_params(workdir)
    config = bert.BertConfig(**meta["model_config"])
    vocab = meta.get("vocab_file")
    hf.to_transformers(
        config, params, out, vocab_file=vocab if vocab and os.path.exists(vocab) else None
    )
    return f"{meta['phase']} of {workdir} ({config.num_layers} layers) -> {out}"


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    try:
        print(export_workdir(_WORKDIR.value, _OUT.value))
    except (FileNotFoundError, ValueError) as error:
        print(f"lambjax.export: error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    app.run(main)
