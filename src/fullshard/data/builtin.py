"""What a run trains on when it names no data and no model: a generated corpus and a byte-level
tokenizer, both shipped with the code so the default run downloads nothing."""

from __future__ import annotations

import random


def builtin_corpus(num_docs: int = 5000, seed: int = 0) -> list[str]:
    """A generated corpus for the default run: short arithmetic facts, counting and templated
    sentences. It ships with the code (nothing to download) and has structure a tiny model
    learns within minutes, so the loss visibly falls."""
    rng = random.Random(seed)
    words = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
    names = ["Ada", "Alan", "Grace", "Edsger", "Barbara", "Donald", "Ken", "Dennis", "Linus", "Guido"]
    things = ["apples", "books", "stones", "shells", "coins", "keys", "cups", "maps"]
    places = ["the garden", "the library", "the harbour", "the market", "the attic", "the station"]
    docs = []
    for _ in range(num_docs):
        kind = rng.randrange(4)
        if kind == 0:
            a, b = rng.randrange(10), rng.randrange(10)
            docs.append(f"{a} plus {b} is {a + b}. {words[a]} plus {words[b]} is {a + b}.")
        elif kind == 1:
            start = rng.randrange(50)
            docs.append("counting: " + " ".join(str(start + i) for i in range(rng.randrange(4, 12))) + ".")
        elif kind == 2:
            name, n, thing, place = rng.choice(names), rng.randrange(2, 10), rng.choice(things), rng.choice(places)
            k = rng.randrange(1, n)
            docs.append(f"{name} found {words[n]} {thing} in {place}. {name} gave away {words[k]}, "
                        f"so {name} kept {words[n - k]} {thing}.")
        else:
            a, b = rng.randrange(2, 10), rng.randrange(2, 10)
            docs.append(f"{a} times {b} is {a * b}, and {a * b} minus {a} is {a * b - a}.")
    return docs


def byte_tokenizer():
    """A byte-level tokenizer that needs no download and no training: 256 byte tokens plus
    `<|endoftext|>`, saved with the exported model like any other HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                        pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    return tokenizer


def special_token_ids(tokenizer) -> dict:
    """The special-token ids a model config (and so its generation config) must share with its
    tokenizer: a config's defaults (LlamaConfig's bos 1, eos 2) would let `generate()` run past
    the tokenizer's end of text."""
    return {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id}
