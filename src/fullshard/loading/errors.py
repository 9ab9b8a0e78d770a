"""The loader's error type, raised on every rank together."""

from __future__ import annotations

from ..distributed import all_ranks_agree_ok


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded into this model; the message names the keys and files."""


def agree(ok: bool, message: str = "") -> None:
    """`all_ranks_agree_ok` that raises `CheckpointError`, so callers can catch loading failures by type."""
    all_ranks_agree_ok(ok, message, CheckpointError)
