"""Pretraining examples from documents: the original BERT recipe, or full-sentence packing.

BERT recipe (Google's create_pretraining_data): each document is split into sentences;
sentences are gathered into chunks of a target length (shorter with `short_seq_prob`);
segment A is the first part of a chunk, and B either its rest or (50%, and always for a
one-sentence chunk) text from a random other document; the pair is truncated to fit
[CLS] A [SEP] B [SEP]. Packing mode (no NSP): full sentences, across documents, packed into
[CLS] ... [SEP] of the maximum length.

Examples are token ids without masking: masking is applied dynamically when reading.
"""

import dataclasses
import random
import re

import numpy as np

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n\s*\n")


@dataclasses.dataclass(frozen=True)
class ExampleOptions:
    max_seq_length: int
    next_sentence_prediction: bool = True
    short_seq_prob: float = 0.1
    cls_id: int = 2
    sep_id: int = 3


def split_sentences(document: str) -> list[str]:
    text = re.sub(r"[ \t]*\n(?![ \t]*\n)[ \t]*", " ", document)  # join wrapped lines
    return [s.strip() for s in _SENTENCE_END.split(text) if s.strip()]


def tokenize_documents(documents: list[str], tokenizer) -> list[list[list[int]]]:
    """Documents -> sentences -> token ids (one batched, multi-threaded encode)."""
    sentences = [split_sentences(d) for d in documents]
    flat = [s for doc in sentences for s in doc]
    encoded = tokenizer.encode_batch(flat, add_special_tokens=False) if flat else []
    ids = iter(e.ids for e in encoded)
    return [[s for s in (next(ids) for _ in doc) if s] for doc in sentences]


def create_examples(
    documents: list[list[list[int]]], options: ExampleOptions, seed: int
) -> tuple[list[dict], dict]:
    """All examples of `documents` (lists of tokenized sentences); returns (examples, skips)."""
    rng = random.Random(seed)
    min_tokens = 2 if options.next_sentence_prediction else 1
    kept = [d for d in documents if sum(len(s) for s in d) >= min_tokens]
    skipped = (
        {"documents too short": len(documents) - len(kept)} if len(kept) < len(documents) else {}
    )
    if options.next_sentence_prediction:
        examples = []
        for index in range(len(kept)):
            examples += _bert_examples(kept, index, options, rng)
    else:
        examples = _packed_examples(kept, options)
    rng.shuffle(examples)
    return examples, skipped


def _example(tokens_a, tokens_b, is_random_next, options: ExampleOptions) -> dict:
    ids = [options.cls_id, *tokens_a, options.sep_id]
    segments = [0] * len(ids)
    if tokens_b:
        ids += [*tokens_b, options.sep_id]
        segments += [1] * (len(tokens_b) + 1)
    return {
        "input_ids": np.asarray(ids, np.int32),
        "segment_ids": np.asarray(segments, np.int32),
        "next_sentence_label": np.int32(is_random_next),
    }


def _bert_examples(documents, index, options: ExampleOptions, rng: random.Random) -> list[dict]:
    document = documents[index]
    max_num_tokens = options.max_seq_length - 3
    target_length = max_num_tokens
    if rng.random() < options.short_seq_prob:
        target_length = rng.randint(2, max_num_tokens)
    examples, chunk, chunk_length, i = [], [], 0, 0
    while i < len(document):
        chunk.append(document[i])
        chunk_length += len(document[i])
        if i == len(document) - 1 or chunk_length >= target_length:
            a_end = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
            tokens_a = [t for s in chunk[:a_end] for t in s]
            # A corpus of one document has no other document to draw a random next from.
            is_random_next = len(documents) > 1 and (len(chunk) == 1 or rng.random() < 0.5)
            if is_random_next:
                tokens_b = _random_continuation(
                    documents, index, max(1, target_length - len(tokens_a)), rng
                )
                i -= len(chunk) - a_end  # the unused sentences start the next chunk
            else:
                tokens_b = [t for s in chunk[a_end:] for t in s]
            _truncate_pair(tokens_a, tokens_b, max_num_tokens, rng)
            if tokens_a and tokens_b:
                examples.append(_example(tokens_a, tokens_b, is_random_next, options))
            chunk, chunk_length = [], 0
        i += 1
    return examples


def _random_continuation(documents, index, target_length, rng: random.Random) -> list[int]:
    for _ in range(10):
        other = rng.randint(0, len(documents) - 1)
        if other != index:
            break
    document = documents[other]
    tokens = []
    for sentence in document[rng.randint(0, len(document) - 1) :]:
        tokens += sentence
        if len(tokens) >= target_length:
            break
    return tokens


def _truncate_pair(tokens_a, tokens_b, max_num_tokens, rng: random.Random) -> None:
    while len(tokens_a) + len(tokens_b) > max_num_tokens:
        longer = tokens_a if len(tokens_a) > len(tokens_b) else tokens_b
        if rng.random() < 0.5:
            del longer[0]
        else:
            longer.pop()


def _packed_examples(documents, options: ExampleOptions) -> list[dict]:
    capacity = options.max_seq_length - 2
    examples, current = [], []
    for document in documents:
        for sentence in document:
            sentence = sentence[:capacity]
            if current and len(current) + len(sentence) > capacity:
                examples.append(_example(current, [], False, options))
                current = []
            current += sentence
    if current:
        examples.append(_example(current, [], False, options))
    return examples


def build_shard(job) -> tuple[list[dict], dict]:
    """Tokenizes and builds one shard of documents (runs in a worker process)."""
    import tokenizers

    documents, vocab, lower_case, options, seed = job
    tokenizer = tokenizers.BertWordPieceTokenizer(vocab, lowercase=lower_case)
    return create_examples(tokenize_documents(documents, tokenizer), options, seed)
