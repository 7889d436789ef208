"""WordPiece tokenization through `tokenizers`: a BERT vocab.txt, or one trained on the corpus.

Training streams the documents through `train_from_iterator`, so its memory is the
trainer's word counts, not the corpus. Vocabulary files are read and written through
etils' epath (local or gs://).
"""

from collections.abc import Callable, Iterable

import tokenizers
from etils import epath

from lambjax.data.sources import DataError

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def train_vocab(
    documents: list[str] | Callable[[], Iterable[str]],
    vocab_size: int,
    lower_case: bool,
    path: str,
) -> str:
    """Trains a WordPiece vocabulary on the documents and writes it to `path` (vocab.txt).

    `documents` is a list, or a function returning a fresh iterator over them (they are
    read twice, streamed).

    The same documents give the same file in every process. `tokenizers`' trainer numbers
    the continuation symbols (##x) in hash-map order, which changes from process to process,
    and breaks ties between equally frequent merges by those numbers
    (huggingface/tokenizers#1794). So a first pass finds the continuation symbols, and the
    second reserves them, sorted, ahead of everything it learns.
    """
    if vocab_size < len(SPECIAL_TOKENS) + 100:
        raise DataError(f"config.data.vocab_size={vocab_size} is too small (at least 105)")
    stream = documents if callable(documents) else (lambda: iter(documents))
    first = _train(stream(), vocab_size, lower_case, SPECIAL_TOKENS)
    continuation = sorted(token for token in first if token.startswith("##") and len(token) == 3)
    vocab = _train(stream(), vocab_size, lower_case, SPECIAL_TOKENS + tuple(continuation))
    epath.Path(path).write_text("".join(token + "\n" for token in vocab), encoding="utf-8")
    return path


def _train(documents, vocab_size: int, lower_case: bool, reserved: tuple[str, ...]) -> list[str]:
    """The trained vocabulary's tokens in id order, `reserved` first."""
    tokenizer = tokenizers.BertWordPieceTokenizer(lowercase=lower_case)
    tokenizer.train_from_iterator(
        documents,
        vocab_size=vocab_size,
        special_tokens=list(reserved),
        min_frequency=2,
        show_progress=False,  # its bars print blank lines where output is not a terminal
    )
    return [token for token, _ in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])]


def load(vocab_file: str, lower_case: bool) -> tokenizers.Tokenizer:
    """A BERT tokenizer for `vocab_file`; errors name the file and what is wrong."""
    path = epath.Path(vocab_file)
    if not path.is_file():
        raise DataError(f"config.data.vocab={vocab_file!r}: no such vocabulary file")
    tokens = read_vocab(vocab_file)
    missing = [t for t in ("[CLS]", "[SEP]", "[MASK]", "[PAD]", "[UNK]") if t not in tokens]
    if missing:
        raise DataError(f"vocabulary {vocab_file} lacks the special tokens {missing}")
    return from_vocab(tokens, lower_case)


def read_vocab(vocab_file: str) -> dict[str, int]:
    """token -> id of a vocab.txt (one token a line, ids in line order)."""
    try:
        lines = epath.Path(vocab_file).read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError as error:
        raise DataError(
            f"vocabulary {vocab_file} is not UTF-8 text (byte {error.start}: "
            f"{error.object[error.start : error.start + 1]!r}); a BERT vocab.txt holds one "
            f"token a line, in UTF-8"
        ) from None
    if lines and lines[-1] == "":
        lines.pop()
    vocab = {}
    for index, token in enumerate(lines):
        if token in vocab:  # ids would run one past the vocabulary's size, into no embedding
            raise DataError(
                f"vocabulary {vocab_file} holds the token {token!r} twice (lines "
                f"{vocab[token] + 1} and {index + 1}); a vocab.txt holds each token once"
            )
        vocab[token] = index
    return vocab


def vocabulary_is_cased(vocab_file: str) -> bool:
    """A vocabulary is cased if any of its ordinary tokens has an upper-case letter."""
    for token in read_vocab(vocab_file):  # DataError unless UTF-8 text
        token = token.strip()
        if not (token.startswith("[") and token.endswith("]")) and token != token.lower():
            return True
    return False


def from_vocab(vocab: dict[str, int], lower_case: bool) -> tokenizers.Tokenizer:
    return tokenizers.BertWordPieceTokenizer(vocab, lowercase=lower_case)


def special_ids(tokenizer) -> dict[str, int]:
    return {
        name: tokenizer.token_to_id(token)
        for name, token in (
            ("pad", "[PAD]"),
            ("unk", "[UNK]"),
            ("cls", "[CLS]"),
            ("sep", "[SEP]"),
            ("mask", "[MASK]"),
        )
    }
