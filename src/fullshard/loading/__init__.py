"""Loading pretrained weights straight into FSDP2 shards.

Every rank reads only its own slice of each tensor (memory-mapped safetensors or `.bin`, or DCP
chunks), into a model built on the meta device and sharded before it ever held a weight. The
loader runs in named phases over a `Source` per format (`load.py`, `source.py`, `dcp.py`);
buffers, ties and strictness are handled in `materialize`; key renames and MoE expert fusion
follow transformers' own conversion tables (`convert`). A model loaded on rank 0 only is sharded and
filled from there (`rank0`).
"""

from ..errors import LoadError
from .load import LoadReport, materialize_and_load
from .materialize import init_empty_model, meta_init
from .resolve import find_checkpoint_files, resolve_checkpoint_dir
from .source import checkpoint_dtype

__all__ = [
    "LoadError",
    "LoadReport",
    "checkpoint_dtype",
    "find_checkpoint_files",
    "init_empty_model",
    "materialize_and_load",
    "meta_init",
    "resolve_checkpoint_dir",
]
