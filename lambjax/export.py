r"""Export a training run's newest checkpoint as a Hugging Face `transformers` BERT.

  python -m lambjax.export --workdir=WORKDIR --out=DIR [--overwrite]

DIR then loads with `transformers.BertForPreTraining.from_pretrained(DIR)` and
`AutoTokenizer.from_pretrained(DIR)`: `config.json`, `model.safetensors`, and the run's
vocabulary as `vocab.txt`, `tokenizer.json` (the `tokenizers` WordPiece tokenizer lambjax
trains and reads with), `tokenizer_config.json` and `special_tokens_map.json`, so that
transformers tokenizes as the run did (its lower-casing, its special tokens, the model's
maximum length). The newest checkpoint is that of the last phase (in the run's
`phase_order`) that has a readable one (a checkpoint whose arrays differ from the digests its
save recorded is refused, with a line, like an unreadable one); the arrays are read onto the
host, whatever mesh wrote them.
Paths may be relative, absolute or gs:// URLs (written in a local folder, then copied). A DIR
that holds files is refused unless --overwrite.
"""

import json
import tempfile

from absl import flags

from lambjax import cli, console

_WORKDIR = flags.DEFINE_string("workdir", None, "A lambjax training workdir.")
_OUT = flags.DEFINE_string("out", None, "Directory to write the transformers checkpoint to.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace the files of a non-empty --out.")
flags.mark_flags_as_required(["workdir", "out"])


def export_workdir(workdir: str, out: str, *, overwrite: bool = False) -> str:
    """Exports the newest checkpoint of a training workdir; returns what was exported."""
    from etils import epath

    from lambjax import storage
    from lambjax.models import hf
    from lambjax.models.config import BertConfig
    from lambjax.train import checkpointing

    workdir, out = storage.resolve(workdir), storage.resolve(out)
    storage.check_reachable(workdir, "--workdir")
    storage.check_reachable(out, "--out")
    if not epath.Path(workdir).is_dir():
        raise FileNotFoundError(f"--workdir={workdir}: no such directory")
    out_path = epath.Path(out)
    if out_path.exists() and not out_path.is_dir():
        raise FileExistsError(f"--out={out} is a file; give a directory (new or empty)")
    if out_path.is_dir() and any(out_path.iterdir()) and not overwrite:
        raise FileExistsError(
            f"--out={out} holds files; give an empty or new directory, or add --overwrite"
        )
    meta, params = checkpointing.latest_params(workdir)
    config = BertConfig.from_dict(meta["model_config"])
    vocab = meta.get("vocab_file")
    vocab = vocab if vocab and epath.Path(vocab).exists() else None
    with tempfile.TemporaryDirectory() as scratch, storage.local_folder(out) as target:
        local_vocab = storage.local_copy(vocab, scratch) if vocab else None
        hf.to_transformers(config, params, target, vocab_file=local_vocab)
        if vocab:
            lower_case = json.loads(meta["config"])["data"]["lower_case"]
            hf.save_tokenizer(target, local_vocab, lower_case, config.max_position_embeddings)
    tokenizer = (
        "with its tokenizer" if vocab else f"without a tokenizer ({meta.get('vocab_file')} is gone)"
    )
    source = f"{meta['phase']} (step {meta['step']}) of {workdir}"
    return f"{source} ({config.num_layers} layers) -> {out}, {tokenizer}"


def main(argv):
    if len(argv) > 1:
        cli.fail("lambjax.export", f"unexpected arguments: {argv[1:]}")
    console.setup()
    try:
        print(export_workdir(_WORKDIR.value, _OUT.value, overwrite=_OVERWRITE.value))
    except (OSError, ValueError) as error:
        cli.fail("lambjax.export", str(error))


def run() -> None:
    """The `lambjax-export` command (setup.py's console script)."""
    cli.run(main, "lambjax.export", "lambjax.export")


if __name__ == "__main__":
    run()
