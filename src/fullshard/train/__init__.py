"""Training: config, data, the step, the loop, metrics. `fullshard train` is `train(load_config(...))`."""

from .config import ConfigError, TrainConfig, load_config
from .trainer import Trainer, train

__all__ = ["ConfigError", "TrainConfig", "Trainer", "load_config", "train"]
