"""Training metrics: throughput, MFU, peak memory; logged to the console (a tqdm bar and log lines),
metrics.jsonl, and TensorBoard, W&B or trackio when `train.report_to` names them; the loss plot.
A resumed run's metrics.jsonl holds each step once: records past the step it resumed from (the
steps a run trained after the checkpoint it fell back to) are dropped before it appends.

MFU (model FLOPs utilisation) uses the PaLM paper's count (Chowdhery et al. 2022, appendix B):
training a token costs `6 * N + 12 * L * H * S` FLOPs, N the parameter count (weights only:
6 = forward 2 + backward 4 multiply-adds per weight), L layers, H the hidden size, S the sequence
length (the attention score and value matmuls, forward and backward). Activation recomputation
is not counted, as the definition requires. MFU = tokens/s x FLOPs/token / (devices x peak FLOP/s).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch

from ..errors import ConfigError
from ..tensors import parameter_counts

# dense bf16 tensor-core peak per device, TFLOP/s (vendor data sheets, SXM parts)
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "L4": 121.0,
               "V100": 125.0, "MI300X": 1307.0}


def flops_per_token(num_params: int, num_layers: int, hidden_size: int, seq_len: int) -> float:
    return 6.0 * num_params + 12.0 * num_layers * hidden_size * seq_len


def model_flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """FLOPs per trained token for a transformers model (embedding lookups are not matmuls and are excluded)."""
    config = model.config.get_text_config()  # a vision-language model's language model sets the shape
    total, lookup = parameter_counts(model)
    return flops_per_token(total - lookup, config.num_hidden_layers, config.hidden_size, seq_len)


def peak_device_flops(configured_tflops: float | None = None) -> float | None:
    """Peak FLOP/s of one device: the configured value, or a known GPU's; None on CPU (no MFU)."""
    if configured_tflops:
        return configured_tflops * 1e12
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        for key, tflops in PEAK_TFLOPS.items():
            if key in name:
                return tflops * 1e12
    return None


def peak_memory_gb() -> float:
    """Peak accelerator memory allocated by this process, or its peak resident set on a CPU host."""
    if torch.accelerator.is_available():
        return torch.accelerator.max_memory_allocated() / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


class Throughput:
    """Tokens per second between two `tick`s, and MFU from it."""

    def __init__(self, flops_per_token: float, num_devices: int, peak_flops: float | None):
        self.flops_per_token = flops_per_token
        self.num_devices = num_devices
        self.peak_flops = peak_flops
        self._start = time.perf_counter()
        self._tokens = 0

    def add(self, tokens: int) -> None:
        self._tokens += tokens

    def tick(self) -> dict:
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()
        now = time.perf_counter()
        elapsed, tokens = now - self._start, self._tokens
        self._start, self._tokens = now, 0
        rate = tokens / elapsed if elapsed > 0 else 0.0
        mfu = rate * self.flops_per_token / (self.num_devices * self.peak_flops) if self.peak_flops else None
        return {"tokens_per_s": rate, "mfu": mfu}


# the trackers `train.report_to` may name -> the package each needs; each is used only when named (trackio
# copies W&B's module API: init / log / finish)
REPORTERS = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}


def check_report_to(names) -> None:
    """Every name in `train.report_to` is a known tracker whose package is installed (checked on
    every rank, and before launch, so a missing package never surfaces mid-run)."""
    for name in names:
        if name not in REPORTERS:
            raise ConfigError(f"train.report_to names {name!r}; known trackers: {sorted(REPORTERS)}")
        if importlib.util.find_spec(REPORTERS[name]) is None:
            raise ConfigError(f"train.report_to names {name!r} but the {REPORTERS[name]!r} package is not installed "
                              f"(pip install {REPORTERS[name]})")


class _TensorBoard:
    def __init__(self, output_dir: Path, initial_step: int = 0):
        from torch.utils.tensorboard import SummaryWriter

        # a resumed run drops what an earlier run logged past its checkpoint, as metrics.jsonl does
        purge_step = initial_step + 1 if initial_step else None
        self.writer = SummaryWriter(str(output_dir / "tensorboard"), purge_step=purge_step)

    def log(self, values: dict, step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class _RunTracker:
    """W&B or trackio: one run per training run, named after the output directory."""

    def __init__(self, module_name: str, output_dir: Path, config: dict | None):
        self.module = importlib.import_module(module_name)
        self.module.init(project="fullshard", name=output_dir.name, config=config)

    def log(self, values: dict, step: int) -> None:
        self.module.log(values, step=step)

    def close(self) -> None:
        self.module.finish()


def open_trackers(output_dir: Path, report_to=(), config: dict | None = None, initial_step: int = 0) -> list:
    check_report_to(report_to)
    return [_TensorBoard(output_dir, initial_step) if name == "tensorboard" else _RunTracker(name, output_dir, config)
            for name in report_to]


class MetricsLogger:
    """Rank 0 writes every record to `metrics.jsonl` and to the trackers, and shows a progress bar
    (loss, tokens/s, ETA) besides a log line per record; other ranks write nothing."""

    def __init__(self, output_dir: Path, total_steps: int, initial_step: int = 0, enabled: bool = True,
                 report_to=(), config: dict | None = None):
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        self._bar, self._trackers = None, []
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # a resumed run appends to the log of the run it continues; a fresh run starts a new one
        if initial_step:
            keep_records_up_to(self.path, initial_step)
        self._file = self.path.open("a" if initial_step else "w")
        self._trackers = open_trackers(Path(output_dir), report_to, config, initial_step)
        from tqdm import tqdm

        self._bar = tqdm(total=total_steps, initial=initial_step, desc="train", dynamic_ncols=True, file=sys.stdout,
                         mininterval=1.0, disable=None)  # None: no bar when stdout is not a terminal

    def step(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def log(self, record: dict,
            show: tuple[str, ...] = ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_gb")) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        numbers = {k: v for k, v in record.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
        for tracker in self._trackers:
            tracker.log(numbers, record["step"])
        shown = {k: record[k] for k in show if record.get(k) is not None}
        if self._bar is not None and shown:
            self._bar.set_postfix({k: f"{shown[k]:.4g}" for k in ("loss", "tokens_per_s") if k in shown}, refresh=False)
            self._bar.write(f"step {record['step']:>5}  " + "  ".join(f"{k} {v:.4g}" for k, v in shown.items()))

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        for tracker in self._trackers:
            tracker.close()
        self._file.close()


def read_metrics(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def keep_records_up_to(path: Path, step: int) -> None:
    """Drop the records past `step` from a metrics file (atomically: a new file renamed over it);
    a line a killed run left half-written goes too."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                kept.append(line)
        except (ValueError, AttributeError):
            continue
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


NO_PLOT = "no loss plot: matplotlib is not installed (pip install 'fullshard[plot]')"


def plot_loss(metrics_path: str | Path, png_path: str | Path, key: str = "loss") -> Path | None:
    """The training (and eval) loss against the step, as a PNG; None when matplotlib is missing
    (the caller says so with `NO_PLOT`: metrics.jsonl holds the same numbers). `key="reward"`: an RL
    run's mean reward instead."""
    records = read_metrics(metrics_path)
    if key == "reward":
        points = [(r["step"], r["reward"]) for r in records if r.get("kind") == "train"]
        return plot_lines(png_path, {"mean reward": (points, "-")}, ylabel="mean reward")
    lines = {"train loss": ([(r["step"], r["loss"]) for r in records if r.get("kind") == "train"], "-"),
             "eval loss": ([(r["step"], r["eval_loss"]) for r in records if r.get("kind") == "eval"], "o-")}
    return plot_lines(png_path, lines, ylabel="loss (nats / token)")


def plot_lines(png_path: str | Path, lines: dict[str, tuple[list[tuple[float, float]], str]], *,
               ylabel: str, xlabel: str = "step", title: str | None = None) -> Path | None:
    """`lines` ({label: ([(x, y), ...], matplotlib style)}) on one chart, as a PNG; empty lines are left
    out. None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, (points, style) in lines.items():
        if points:
            ax.plot(*zip(*points), style, label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return Path(png_path)
