"""Data preparation: tokenization throughput and per-rank memory, fullshard against its peers.

- fullshard: `load_data` on 2 ranks; the node's first rank tokenizes (`datasets.map`, `num_proc`
  processes), packs and caches, the other waits, then both memory-map the packed rows;
- datasets.map: `load_dataset("json")` then `map(tokenize, batched=True)` in one process (the peer
  the issue names), no packing;
- python lists: the previous fullshard path, every document read into Python strings and the
  whole token stream built as a Python list, on every rank (one rank measured).

The JSONL is generated (templated sentences), the tokenizer a 4096-token BPE trained here on the
first documents, so nothing is downloaded. Memory is the peak anonymous memory of the measured
process above its baseline (`bench_loading.PeakSampler`; the page cache of memory-mapped files is
not counted, the map's worker processes are not either). Two corpus sizes show whether a rank's
memory grows with the corpus. Run: `.venv/bin/python bench/bench_data.py` (about 5 minutes on 2
CPU cores; `--docs 400000` for a ~0.5 GB file).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_loading import PeakSampler  # noqa: E402
from bench.report import markdown_table, write_section  # noqa: E402

MB = 1024 * 1024
WORDS = ("the a data model shard rank token batch step loss gradient memory cache file record layer weight "
         "optimizer checkpoint resume stream packed sequence document answer question train eval").split()


def write_corpus(path: Path, docs: int, seed: int = 0) -> int:
    """`docs` JSON Lines records of 60..400 words; returns the file size."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(docs):
            words = rng.choices(WORDS, k=rng.randrange(60, 400))
            f.write(json.dumps({"id": i, "text": f"Document {i}. " + " ".join(words) + "."}) + "\n")
    return path.stat().st_size


def train_tokenizer(corpus: Path, out: Path) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    texts = (json.loads(line)["text"] for _, line in zip(range(5000), open(corpus)))
    backend.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=4096, special_tokens=["<unk>", "<eos>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="<unk>",
                                        pad_token="<eos>")
    tokenizer.save_pretrained(out)
    return str(out)


def warm_corpus(corpus: str) -> str:
    """A 200-document copy: each method runs on it first, so one-off costs (lazy imports, first
    use of a reader) count for none of them."""
    warm = f"{corpus}.warm.jsonl"
    with open(corpus) as src, open(warm, "w") as dst:
        dst.writelines(line for _, line in zip(range(200), src))
    return warm


def _fullshard(corpus: str, tokenizer_dir: str, cache: str, seq_len: int) -> dict:
    """One rank of the fullshard run: time to usable rows, peak memory, rows seen."""
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from fullshard.train.config import DataSection
    from fullshard.train.data import load_data

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    load_data(DataSection(path=warm_corpus(corpus), cache_dir=f"{cache}_warm", seq_len=64), tokenizer)
    dist.barrier()
    with PeakSampler() as sampler:
        start = time.perf_counter()
        data = load_data(DataSection(path=corpus, cache_dir=cache, seq_len=seq_len, eval_fraction=0.0), tokenizer)
        dist.barrier()
        seconds = time.perf_counter() - start
        touched = int(data.train.take(range(0, len(data.train), max(1, len(data.train) // 64)))["input_ids"].sum())
    return {"seconds": seconds, "peak": sampler.delta, "rows": len(data.train), "touched": touched}


def _datasets_map(corpus: str, tokenizer_dir: str, cache: str) -> dict:
    import datasets
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    datasets.disable_progress_bars()

    def run(path: str, cache_dir: str):
        raw = datasets.load_dataset("json", data_files=[path], split="train", cache_dir=cache_dir)
        return raw.map(lambda b: tokenizer(b["text"]), batched=True, remove_columns=raw.column_names,
                       cache_file_name=f"{cache_dir}/map.arrow")

    run(warm_corpus(corpus), f"{cache}_warm")
    with PeakSampler() as sampler:
        start = time.perf_counter()
        tokens = run(corpus, cache)
        seconds = time.perf_counter() - start
    count = sum(len(b.column("input_ids").combine_chunks().flatten()) for b in tokens.with_format("arrow").iter(10000))
    return {"seconds": seconds, "peak": sampler.delta, "tokens": count}


def _python_lists(corpus: str, tokenizer_dir: str) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    with PeakSampler() as sampler:
        start = time.perf_counter()
        texts = [json.loads(line)["text"] for line in open(corpus) if line.strip()]
        stream: list[int] = []
        for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
            stream += ids + [tokenizer.eos_token_id]
        seconds = time.perf_counter() - start
    return {"seconds": seconds, "peak": sampler.delta, "tokens": len(stream)}


def _in_process(fn, *args) -> dict:
    """Run one measurement in a fresh process, so one method's freed memory does not hide another's."""
    from fullshard.testing import run_distributed

    return run_distributed(fn, 1, *args, timeout=900)[0]


def measure(root: Path, docs: int, seq_len: int) -> list[list]:
    from fullshard.testing import run_distributed

    corpus = root / f"corpus_{docs}.jsonl"
    size = write_corpus(corpus, docs)
    tokenizer_dir = train_tokenizer(corpus, root / "tokenizer")
    ranks = run_distributed(_fullshard, 2, str(corpus), tokenizer_dir, str(root / f"cache_{docs}"), seq_len,
                            timeout=900)
    peer = _in_process(_datasets_map, str(corpus), tokenizer_dir, str(root / f"peer_{docs}"))
    lists = _in_process(_python_lists, str(corpus), tokenizer_dir)
    tokens = peer["tokens"]
    label = f"{docs:,} docs, {size / MB:.0f} MiB"
    fs_seconds = max(r["seconds"] for r in ranks)
    rows = [[label, "fullshard (2 ranks, rank 0 tokenizes + packs)", f"{tokens / fs_seconds / 1e6:.2f}",
             f"{fs_seconds:.1f}", " / ".join(f"{r['peak'] / MB:.0f}" for r in ranks), "1.00"]]
    for name, result, count in (("datasets.map, 1 process", peer, 1), ("python lists (previous), per rank", lists, 1)):
        rows.append([label, name, f"{tokens / result['seconds'] / 1e6:.2f}", f"{result['seconds']:.1f}",
                     f"{result['peak'] / MB:.0f}", f"{result['seconds'] / fs_seconds:.2f}"])
    gc.collect()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--docs", type=int, nargs="+", default=[25_000, 100_000])
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for docs in args.docs:
            rows += measure(Path(tmp), docs, args.seq_len)
            print(markdown_table(HEADER, rows), flush=True)
    load = f"Load average at the end of the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores."
    table = markdown_table(HEADER, rows)
    if not args.no_write:
        write_section("data", "## Data preparation (tokenize + pack)\n\n" + __doc__.split("\n\n", 1)[1].rsplit(
            "Run:", 1)[0].strip() + "\n\n" + table + "\n\n" + load)


HEADER = ["corpus", "method", "M tokens/s", "seconds", "peak MiB per rank (above baseline)", "time vs fullshard"]

if __name__ == "__main__":
    main()
