"""One logger for the package, and a rank-0 helper so a message is printed once, not once per rank."""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("fullshard")
_seen: set[str] = set()


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
