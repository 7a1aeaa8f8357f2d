"""A character-level Hugging Face tokenizer built offline (no hub download).

Vocabulary: ``<pad>`` = 0, ``<eos>`` = 1, ``<unk>`` = 2, then one id per character of the
alphabet in the order given (3, 4, ...). Every character is its own token; decoding joins tokens
without spaces. Encoding adds no special tokens. It is a real ``PreTrainedTokenizerFast``, so it
round-trips through ``save_pretrained`` / ``AutoTokenizer.from_pretrained`` like any other.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, UNK_TOKEN)  # ids 0, 1, 2


def build_char_tokenizer(alphabet: str) -> PreTrainedTokenizerFast:
    """A left-padding tokenizer with one token per character of ``alphabet``.

    ``alphabet`` must be non-empty and free of repeated characters. Characters outside it
    encode to ``<unk>``. ``len(tokenizer)`` is ``len(alphabet) + 3``: the vocabulary size a
    model built for it needs.
    """
    if not alphabet:
        raise ValueError("alphabet must not be empty")
    repeated = sorted({c for c in alphabet if alphabet.count(c) > 1})
    if repeated:
        raise ValueError(f"alphabet repeats characters {repeated!r}")

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for char in alphabet:
        vocab[char] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK_TOKEN))
    # "[\s\S]" rather than "." so that a newline is a token of its own as well.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side="left",
    )


def is_char_tokenizer(tokenizer) -> bool:
    """Whether ``tokenizer`` is one of ``build_char_tokenizer``'s (a word-level vocabulary of
    single characters): a character outside its alphabet can only become ``<unk>``."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and isinstance(backend.model, models.WordLevel)
