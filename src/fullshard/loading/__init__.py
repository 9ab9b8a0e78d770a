"""Loading pretrained weights straight into FSDP2 shards.

Every rank reads only its own slice of each tensor (safetensors `get_slice`, memory-mapped
`.bin`, or DCP chunks), into a model built on the meta device and sharded before it ever held
a weight. Buffers, ties and strictness are handled in `materialize`; key renames and MoE expert
fusion follow transformers' own conversion tables (`convert`).
"""

from .errors import CheckpointError
from .load import LoadReport, from_pretrained, materialize_and_load
from .materialize import init_empty_model, meta_init
from .resolve import find_checkpoint_files, resolve_checkpoint_dir

__all__ = [
    "CheckpointError",
    "LoadReport",
    "find_checkpoint_files",
    "from_pretrained",
    "init_empty_model",
    "materialize_and_load",
    "meta_init",
    "resolve_checkpoint_dir",
]
