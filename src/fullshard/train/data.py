"""Training data: text, jsonl or a saved `datasets` dataset → tokens → packed sequences → the batches
of every step, split across data-parallel ranks.

The batch of step `s` is a pure function of (dataset, seed, s): the samples of an epoch are a
seeded permutation and step `s` takes the next `global_batch_size` of them. The data position
saved in a checkpoint is therefore just the step, and a resumed run continues with exactly the
batch the uninterrupted run would have seen next, on any number of ranks.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import ConfigError, DataSection

TEXT_SUFFIXES = {".txt", ".md"}
JSONL_SUFFIXES = {".jsonl", ".json"}


# ---------------------------------------------------------------------------------------------- text


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


def _read_jsonl(path: Path, text_field: str) -> list[str]:
    texts = []
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}:{line_no} is not valid JSON ({err.msg})") from None
        if not isinstance(record, dict) or text_field not in record:
            raise ConfigError(f"{path}:{line_no} has no field {text_field!r} (set data.text_field)")
        texts.append(str(record[text_field]))
    return texts


def read_texts(section: DataSection) -> list[str]:
    """The documents named by the data section, in a deterministic order."""
    if not section.path:
        return builtin_corpus()
    path = Path(section.path)
    if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()):
        return _read_hf_dataset(path, section.text_field)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    texts: list[str] = []
    for file in files:
        if file.suffix in JSONL_SUFFIXES:
            texts += _read_jsonl(file, section.text_field)
        elif file.suffix in TEXT_SUFFIXES or not path.is_dir():
            texts.append(file.read_text(encoding="utf-8"))
    if not texts:
        raise ConfigError(f"data.path={section.path!r} holds no .txt, .md or .jsonl files")
    return texts


def _read_hf_dataset(path: Path, text_field: str) -> list[str]:
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"data.path={str(path)!r} is a saved `datasets` dataset; install `datasets` to read it") from None
    dataset = datasets.load_from_disk(str(path))
    if isinstance(dataset, datasets.DatasetDict):
        dataset = dataset["train"] if "train" in dataset else next(iter(dataset.values()))
    if text_field not in dataset.column_names:
        raise ConfigError(f"dataset {str(path)!r} has no column {text_field!r} (columns: {dataset.column_names})")
    return list(dataset[text_field])


# ---------------------------------------------------------------------------------------------- tokens


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


@dataclass
class PackedData:
    """Fixed-length sequences cut from the concatenated token stream (documents joined by EOS)."""

    train: torch.Tensor  # (n, seq_len) int64
    eval: torch.Tensor  # (m, seq_len) int64

    def fingerprint(self) -> str:
        """Identifies the data a checkpoint was trained on, so a resume on other data is refused."""
        digest = hashlib.sha1()
        digest.update(str((tuple(self.train.shape), tuple(self.eval.shape))).encode())
        digest.update(self.train[:8].numpy().tobytes())
        return digest.hexdigest()[:16]


def pack(texts: list[str], tokenizer, seq_len: int, eval_fraction: float) -> PackedData:
    eos = tokenizer.eos_token_id
    stream: list[int] = []
    for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        stream += ids
        stream.append(eos)
    count = len(stream) // seq_len
    if count < 2:
        raise ConfigError(f"the data holds {len(stream)} tokens, fewer than two sequences of data.seq_len={seq_len}")
    sequences = torch.tensor(stream[: count * seq_len], dtype=torch.int64).view(count, seq_len)
    num_eval = round(count * eval_fraction)
    if eval_fraction > 0:
        num_eval = max(1, num_eval)
    return PackedData(train=sequences[: count - num_eval], eval=sequences[count - num_eval:])


def load_data(section: DataSection, tokenizer) -> PackedData:
    return pack(read_texts(section), tokenizer, section.seq_len, section.eval_fraction)


# ---------------------------------------------------------------------------------------------- batches


class StepBatches:
    """The micro-batches each rank trains on at each step.

    Each epoch drops the last partial global batch so a step never straddles two epochs; a
    dataset smaller than one global batch is an error naming both numbers.
    """

    def __init__(self, sequences: torch.Tensor, global_batch_size: int, micro_batch_size: int, dp_rank: int,
                 dp_size: int, seed: int = 0, shuffle: bool = True):
        if len(sequences) < global_batch_size:
            raise ConfigError(f"the data has {len(sequences)} training sequences, fewer than one "
                              f"train.global_batch_size={global_batch_size}")
        self.sequences = sequences
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed, self.shuffle = seed, shuffle
        self.steps_per_epoch = len(sequences) // global_batch_size
        self._epoch, self._order = -1, None

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            n = len(self.sequences)
            self._order = torch.randperm(n, generator=generator) if self.shuffle else torch.arange(n)
            self._epoch = epoch
        return self._order

    def global_indices(self, step: int) -> torch.Tensor:
        """The sample indices of the whole step, in rank order."""
        epoch, within = divmod(step, self.steps_per_epoch)
        start = within * self.global_batch_size
        return self._epoch_order(epoch)[start:start + self.global_batch_size]

    def micro_batches(self, step: int) -> list[dict]:
        per_rank = self.global_batch_size // self.dp_size
        mine = self.global_indices(step)[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank]
        batches = []
        for start in range(0, per_rank, self.micro_batch_size):
            ids = self.sequences[mine[start:start + self.micro_batch_size]]
            batches.append({"input_ids": ids, "labels": ids.clone()})
        return batches

    def step_hash(self, step: int) -> str:
        """A short id of the step's global batch, logged so two runs can be checked batch by batch."""
        return hashlib.sha1(self.sequences[self.global_indices(step)].numpy().tobytes()).hexdigest()[:12]


def eval_batches(sequences: torch.Tensor, micro_batch_size: int, dp_rank: int, dp_size: int, limit: int) -> list[dict]:
    """This rank's share of the first `limit` eval micro-batches (every rank the same count)."""
    micro_batch_size = min(micro_batch_size, len(sequences) // dp_size)  # a small eval set still gets used
    if micro_batch_size == 0:
        return []
    per_round = micro_batch_size * dp_size
    rounds = min(limit, len(sequences) // per_round)
    batches = []
    for r in range(rounds):
        start = r * per_round + dp_rank * micro_batch_size
        ids = sequences[start:start + micro_batch_size]
        batches.append({"input_ids": ids, "labels": ids.clone()})
    return batches
