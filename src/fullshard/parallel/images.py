"""Ranks without images in a VLM's forward: the same collectives as ranks with them, the same gradients
as one process.

A transformers VLM runs its vision tower only when `pixel_values` is given. Sharded, the tower's units
are all-gathered in forward (and their gradients reduce-scattered in backward) only on the ranks whose
batch holds an image: a rank with none skips those collectives and the ranks hang (NCCL) or mismatch
(gloo). The fix follows `ep_lists.agree_on_expert_calls`: before each forward the data-parallel ranks
exchange one flag each (one all-reduce); if some rank has images, a rank without them runs the model's
own `get_image_features` on a stand-in image right after its input embedding (where the real forward
runs the tower, so the collectives come in the same order) and adds 0 x the outputs the real forward
consumes (`pooler_output` and any further feature field, such as Qwen3-VL's deepstack features, not
the diagnostic `last_hidden_state` / `hidden_states` / `attentions`) to the embeddings. Its gradients
are exact zeros, so FSDP's sum is the image ranks' gradient, as in one process; and the stand-in
reaches exactly the parameters the real image path reaches. When no rank has an image, no rank runs
the tower: its parameters get no gradient at all (None), and AdamW leaves them and their state alone.

The stand-in is the last image input this rank saw; a rank that has seen none gets one from the first
rank that has one (one broadcast, once).
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..plan.towers import find_towers

DIAGNOSTIC = ("last_hidden_state", "hidden_states", "attentions")


def agree_on_images(model: nn.Module, dp_mesh: DeviceMesh) -> None:
    """Make the data-parallel ranks of a sharded VLM run its vision path together (see the module
    docstring); nothing for a model without a vision tower or a mesh of one rank."""
    if dp_mesh.size() == 1 or not find_towers(model) or not callable(getattr(model, "get_image_features", None)):
        return
    embedding = model.get_input_embeddings()
    if embedding is None:
        return
    agreement = ImageAgreement(model, dp_mesh)
    model.register_forward_pre_hook(agreement.before_forward, with_kwargs=True)
    embedding.register_forward_hook(agreement.after_embedding)
    model._fullshard_image_agreement = agreement


class ImageAgreement:
    def __init__(self, model: nn.Module, dp_mesh: DeviceMesh):
        self.model = model
        self.mesh = dp_mesh
        self.groups = [dp_mesh.get_group(dim) for dim in range(dp_mesh.ndim)]
        self.image_keys = [name for name, p in inspect.signature(model.get_image_features).parameters.items()
                           if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
        self.stand_in: dict | None = None
        self.pending = False

    def _images_of(self, kwargs: dict) -> dict | None:
        pixels = kwargs.get("pixel_values")
        if pixels is None or pixels.numel() == 0:
            return None
        return {k: kwargs[k] for k in self.image_keys if kwargs.get(k) is not None}

    def before_forward(self, module: nn.Module, args, kwargs):
        images = self._images_of(kwargs)
        if images is not None:
            self.stand_in = {k: v.detach() if torch.is_tensor(v) else v for k, v in images.items()}
        device = next((v.device for v in (*args, *kwargs.values()) if torch.is_tensor(v)), torch.device("cpu"))
        flags = self._exchange(images is not None, self.stand_in is not None, device)
        has_images, has_stand_in = flags[0], flags[1]
        self.pending = bool(has_images.any()) and images is None
        if bool(has_images.any()) and bool((has_stand_in == 0).any()):  # the same answer on every rank
            self._share_stand_in(int(torch.nonzero(has_images)[0]), device)
        return None

    @torch.compiler.disable
    def _exchange(self, has_images: bool, has_stand_in: bool, device) -> torch.Tensor:
        """Every rank's two flags, in one all-reduce per mesh dim: (has images, has a stand-in) x rank."""
        size, index = self.mesh.size(), _flat_index(self.mesh)
        flags = torch.zeros(2, size, dtype=torch.int32, device=device)
        flags[0, index], flags[1, index] = int(has_images), int(has_stand_in)
        for group in self.groups:
            dist.all_reduce(flags, group=group)
        return flags.cpu()

    @torch.compiler.disable
    def _share_stand_in(self, source: int, device) -> None:
        """The image input of the first rank with images, to every rank (once: each keeps it)."""
        mesh = self.mesh if self.mesh.ndim == 1 else self.mesh._flatten()
        group = mesh.get_group()
        payload = [{k: v.cpu() if torch.is_tensor(v) else v for k, v in self.stand_in.items()}
                   if _flat_index(self.mesh) == source else None]
        dist.broadcast_object_list(payload, group_src=source, group=group, device=device)
        if self.stand_in is None:
            self.stand_in = payload[0]

    def after_embedding(self, module: nn.Module, args, output):
        if not self.pending:
            return output
        self.pending = False
        device = output.device
        stand_in = {k: v.to(device) if torch.is_tensor(v) else v for k, v in self.stand_in.items()}
        features = self.model.get_image_features(**stand_in, return_dict=True)
        used = consumed(features) or consumed(getattr(features, "last_hidden_state", None))
        zero = sum((t.float().sum() for t in used), torch.zeros((), device=device)) * 0.0
        return output + zero.to(output.dtype)


def consumed(features) -> list[torch.Tensor]:
    """The tensors of a `get_image_features` output a VLM's forward uses (see the module docstring)."""
    if torch.is_tensor(features):
        return [features]
    if isinstance(features, (list, tuple)):
        return [t for f in features for t in consumed(f)]
    if hasattr(features, "items"):
        return [t for k, v in features.items() if k not in DIAGNOSTIC and v is not None for t in consumed(v)]
    return []


def _flat_index(mesh: DeviceMesh) -> int:
    index = 0
    for dim in range(mesh.ndim):
        index = index * mesh.size(dim) + mesh.get_local_rank(dim)
    return index
