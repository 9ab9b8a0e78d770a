"""One logger for the package: a rank-0 helper so a message every rank shares is printed once, not once
per rank, and `warn_rank` for what one rank does on its own (it says so itself, naming its rank; under
`fullshard train` every rank's stderr is the launcher's console)."""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("fullshard")
_seen: set[str] = set()


def _not_torchao_import_noise(record: logging.LogRecord) -> bool:
    """Importing torchao (PEFT imports it when installed) logs lines that bury fullshard's one-line
    errors in every process: a warning per CUDA kernel library a CPU build cannot load (mxfp8, CUTLASS
    sm90a; float8 training needs none of them), and torch's deprecation notice for each Enum torchao
    registers as a pytree constant."""
    message = record.getMessage()
    return not ((message.startswith("Failed to load") and ".so" in message)
                or "is an Enum subclass and is now natively supported by torch.compile" in message)


for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).addFilter(_not_torchao_import_noise)


def _ensure_handler() -> None:
    # library code only logs; a handler is added once so messages show without the user configuring logging
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[fullshard] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def log_rank0(message: str, level: int = logging.INFO, once: bool = False) -> None:
    """Log `message` on rank 0 only (`once`: only the first time this message is seen in this process)."""
    from .distributed import get_rank

    if get_rank() != 0 or (once and message in _seen):
        return
    _seen.add(message)
    _ensure_handler()
    logger.log(level, message)


def warn_rank0(message: str, once: bool = True) -> None:
    log_rank0(message, logging.WARNING, once=once)


def warn_rank(message: str) -> None:
    """Warn from this rank, whichever it is: a fallback this rank alone takes (its own file missing)
    is said by the rank that takes it, not by rank 0, which did not."""
    from .distributed import get_rank, get_world_size

    _ensure_handler()
    logger.warning(f"rank {get_rank()}: {message}" if get_world_size() > 1 else message)
