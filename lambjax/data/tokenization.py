"""WordPiece tokenization through `tokenizers`: a BERT vocab.txt, or one trained on the corpus."""

import os

import tokenizers

from lambjax.data.sources import DataError

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def train_vocab(documents: list[str], vocab_size: int, lower_case: bool, path: str) -> str:
    """Trains a WordPiece vocabulary on the documents and writes it to `path` (vocab.txt)."""
    if vocab_size < len(SPECIAL_TOKENS) + 100:
        raise DataError(f"config.data.vocab_size={vocab_size} is too small (at least 105)")
    tokenizer = tokenizers.BertWordPieceTokenizer(lowercase=lower_case)
    tokenizer.train_from_iterator(
        documents, vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), min_frequency=2
    )
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(token + "\n" for token, _ in vocab)
    return path


def load(vocab_file: str, lower_case: bool) -> tokenizers.Tokenizer:
    """A BERT tokenizer for `vocab_file`; errors name the file and what is wrong."""
    if not os.path.isfile(vocab_file):
        raise DataError(f"config.data.vocab={vocab_file!r}: no such vocabulary file")
    with open(vocab_file, encoding="utf-8") as f:
        tokens = {line.rstrip("\n") for line in f}
    missing = [t for t in ("[CLS]", "[SEP]", "[MASK]", "[PAD]", "[UNK]") if t not in tokens]
    if missing:
        raise DataError(f"vocabulary {vocab_file} lacks the special tokens {missing}")
    return tokenizers.BertWordPieceTokenizer(vocab_file, lowercase=lower_case)


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
