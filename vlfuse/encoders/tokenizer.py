"""Tokenizers: the pretrained encoder's, or a word-level one built from the training questions."""

from __future__ import annotations

from collections import Counter
from functools import partial
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from vlfuse.encoders.hub import load_named
from vlfuse.errors import first_line

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]


def build_word_tokenizer(questions: Iterable[str], max_length: int) -> PreTrainedTokenizerFast:
    """A lower-casing word-level tokenizer whose vocabulary is every word of ``questions``.

    Words are ordered by frequency, then alphabetically, so the same questions always give the
    same ids. Each question is wrapped as ``[CLS] words [SEP]``.
    """
    normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    pre_tokenizer = pre_tokenizers.Whitespace()
    counts: Counter[str] = Counter()
    for question in questions:
        counts.update(word for word, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(question)))
    words = sorted(counts, key=lambda w: (-counts[w], w))
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + words)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])]
    )
    return _with_special_tokens(tokenizer, max_length)


def word_tokenizer_from_json(text: str, max_length: int) -> PreTrainedTokenizerFast:
    """The word-level tokenizer whose ``backend_tokenizer.to_str()`` is ``text`` (JSON: read, nothing run)."""
    return _with_special_tokens(Tokenizer.from_str(text), max_length)


def _with_special_tokens(tokenizer: Tokenizer, max_length: int) -> PreTrainedTokenizerFast:
    """``tokenizer`` as transformers' fast tokenizer, with the special tokens of :data:`SPECIAL_TOKENS`."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        model_max_length=max_length,
    )


def load_tokenizer(name_or_dir: str):
    """A saved or pretrained tokenizer, by hub name, local directory or ``package:`` name (no code
    that a folder names is run: ``trust_remote_code=False``)."""
    return load_named(partial(AutoTokenizer.from_pretrained, trust_remote_code=False), name_or_dir, "a tokenizer")


TOKENIZER_FILE_BYTES = (1 << 20, 256)
"""A saved tokenizer's files may hold 1 MiB plus 256 bytes per word embedding of its model (BERT's
tokenizer.json: 15 bytes a token, XLM-R's: 68): a larger file is refused before it is parsed."""


def load_saved_tokenizer(folder: Path, vocab_size: int | None = None):
    """The tokenizer a model folder saved in ``folder``, read from local files only, with no code run;
    with ``vocab_size`` (the model's word embeddings: the text encoder's, or a caption decoder's), a
    ``ValueError`` when a file is larger than such a tokenizer needs (:data:`TOKENIZER_FILE_BYTES`)
    or the tokenizer gives larger ids."""
    if vocab_size is not None:
        base, per_token = TOKENIZER_FILE_BYTES
        limit = base + per_token * vocab_size
        for file in sorted(Path(folder).iterdir()):
            if file.is_file() and file.stat().st_size > limit:
                raise ValueError(f"{file} is {file.stat().st_size:,} bytes, more than the {limit:,} a tokenizer of "
                                 f"{vocab_size:,} tokens may need")
    try:
        tokenizer = load_named(
            partial(AutoTokenizer.from_pretrained, trust_remote_code=False, local_files_only=True), str(folder), "a tokenizer"
        )
    except ValueError:
        raise
    except Exception as err:  # the tokenizers library's own errors, e.g. a negative token id
        raise ValueError(f"{folder} cannot be read as a tokenizer: {first_line(err)}") from None
    largest = max(tokenizer.get_vocab().values(), default=-1)
    if vocab_size is not None and largest >= vocab_size:
        raise ValueError(f"{folder} gives token ids up to {largest}, but the model has {vocab_size} word embeddings")
    return tokenizer
