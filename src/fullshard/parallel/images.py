"""Ranks without images (or videos) in a VLM's forward: the same collectives as ranks with them, the
same gradients as one process.

A transformers VLM runs its vision tower only when `pixel_values` (for videos `pixel_values_videos`)
is given. Sharded, the tower's units are all-gathered in forward (and their gradients
reduce-scattered in backward) only on the ranks whose batch holds one: a rank with none skips those
collectives and the ranks hang (NCCL) or mismatch (gloo). The fix follows
`ep_lists.agree_on_expert_calls`: before each forward the data-parallel ranks exchange two flags per
modality each (one all-reduce); for each modality some rank has, a rank without it runs the model's
own `get_image_features` / `get_video_features` on a stand-in and adds 0 x the outputs the real
forward consumes (`pooler_output` and any further feature field, such as Qwen3-VL's deepstack
features, not the diagnostic `last_hidden_state` / `hidden_states` / `attentions`). Its gradients
are exact zeros, so FSDP's sum is the real ranks' gradient, as in one process; and the stand-in
reaches exactly the parameters the real path reaches. When no rank has a modality, no rank runs its
path: its parameters get no gradient at all (None), and AdamW leaves them and their state alone.

The collectives must come in the same order on every rank, and a model's forward runs its images'
path before its videos' (Video-LLaVA's through two towers). So a stand-in runs where the real call
would: right after the input embedding (its 0 x added to the embeddings) for the modalities before
this rank's first real one, and right after a real call (its 0 x added to that call's output) for
those that follow it.

The function run is the one the forward calls: the innermost module outside the towers defining it
(DeepSeek-VL and Janus define it on the inner model only), and its stand-in holds every input any
of the chain's signatures names (VideoLLaMA3's `image_merge_sizes`). The stand-in is the last input
of that modality this rank saw; a rank that has seen none gets one from the first rank that has one
(one broadcast, once per modality).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..plan.towers import find_towers

DIAGNOSTIC = ("last_hidden_state", "hidden_states", "attentions")
# (modality, the model's function, its pixel inputs: the name the function takes first, then
# deprecated names a forward still accepts: Video-LLaVA's processor gives `pixel_values_images`)
MODALITIES = (
    ("image", "get_image_features", ("pixel_values", "pixel_values_images")),
    ("video", "get_video_features", ("pixel_values_videos",)),
)


def agree_on_images(model: nn.Module, dp_mesh: DeviceMesh) -> None:
    """Make the data-parallel ranks of a sharded VLM run its vision path together (see the module
    docstring), images and videos; nothing for a model without a vision tower or a one-rank mesh."""
    if dp_mesh.size() == 1 or not find_towers(model):
        return
    modalities = [m for m in (Modality.of(model, *spec) for spec in MODALITIES) if m is not None]
    embedding = model.get_input_embeddings()
    if not modalities or embedding is None:
        return
    agreement = ImageAgreement(model, dp_mesh, modalities)
    model.register_forward_pre_hook(agreement.before_forward, with_kwargs=True)
    embedding.register_forward_hook(agreement.after_embedding)
    for modality in modalities[:-1]:  # a real call of the last one is followed by no stand-in
        agreement.follow_calls(modality)
    model._fullshard_image_agreement = agreement


def feature_function(model: nn.Module, name: str) -> tuple[nn.Module | None, list[str]]:
    """The module whose `name` (`get_image_features`...) the forward calls, the innermost outside
    the towers defining it, and every named input the chain of such modules takes."""
    towers = find_towers(model)
    inside = [*towers.vision, *towers.audio, *towers.projector, *towers.language]
    holders = [
        m
        for n, m in model.named_modules()
        if callable(getattr(type(m), name, None))
        and not any(n == t or n.startswith(t + ".") for t in inside)
    ]
    if not holders:
        return None, []
    keys = []
    for holder in holders:
        for key, p in inspect.signature(getattr(holder, name)).parameters.items():
            if (
                p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
                and key not in keys
                and key != "return_dict"
            ):
                keys.append(key)
    return holders[-1], keys


@dataclass(eq=False)
class Modality:
    name: str
    holder: nn.Module
    function: str
    pixels: tuple[str, ...]
    keys: list[str]
    stand_in: dict | None = field(default=None, repr=False)

    @classmethod
    def of(cls, model: nn.Module, name: str, function: str, pixels: tuple[str, ...]):
        holder, keys = feature_function(model, function)
        return None if holder is None else cls(name, holder, function, pixels, keys)

    def inputs_of(self, kwargs: dict) -> dict | None:
        """This modality's inputs in a forward's arguments (pixels under the function's name)."""
        pixels = next((kwargs[k] for k in self.pixels if kwargs.get(k) is not None), None)
        if pixels is None or pixels.numel() == 0:
            return None
        found = {
            k: kwargs[k] for k in self.keys if kwargs.get(k) is not None and k not in self.pixels
        }
        return {self.pixels[0]: pixels, **found}

    def features(self, stand_in: dict):
        return getattr(self.holder, self.function)(**stand_in, return_dict=True)


class ImageAgreement:
    def __init__(self, model: nn.Module, dp_mesh: DeviceMesh, modalities: list[Modality]):
        self.model = model
        self.mesh = dp_mesh
        self.groups = [dp_mesh.get_group(dim) for dim in range(dp_mesh.ndim)]
        self.modalities = modalities
        self.queue: list[
            tuple[Modality, bool]
        ] = []  # this forward's calls in order: (modality, real)
        self.running = False

    def before_forward(self, module: nn.Module, args, kwargs):
        inputs = [m.inputs_of(kwargs) for m in self.modalities]
        for modality, found in zip(self.modalities, inputs):
            if found is not None:
                modality.stand_in = {
                    k: v.detach() if torch.is_tensor(v) else v for k, v in found.items()
                }
        device = next(
            (v.device for v in (*args, *kwargs.values()) if torch.is_tensor(v)), torch.device("cpu")
        )
        flags = self._exchange(
            [(i is not None, m.stand_in is not None) for m, i in zip(self.modalities, inputs)],
            device,
        )
        self.queue = []
        for m, (modality, found) in enumerate(zip(self.modalities, inputs)):
            has, has_stand_in = flags[2 * m], flags[2 * m + 1]
            if not bool(has.any()):
                continue
            self.queue.append((modality, found is not None))
            if bool((has_stand_in == 0).any()):  # the same answer on every rank
                self._share_stand_in(modality, int(torch.nonzero(has)[0]), device)

    @torch.compiler.disable
    def _exchange(self, flags: list[tuple[bool, bool]], device) -> torch.Tensor:
        """Every rank's flags, in one all-reduce per mesh dim: (has it, has a stand-in) per modality
        x rank."""
        size, index = self.mesh.size(), _flat_index(self.mesh)
        out = torch.zeros(2 * len(flags), size, dtype=torch.int32, device=device)
        for m, (has, has_stand_in) in enumerate(flags):
            out[2 * m, index], out[2 * m + 1, index] = int(has), int(has_stand_in)
        for group in self.groups:
            dist.all_reduce(out, group=group)
        return out.cpu()

    @torch.compiler.disable
    def _share_stand_in(self, modality: Modality, source: int, device) -> None:
        """The input of the first rank with this modality, to every rank (once: each keeps it)."""
        mesh = self.mesh if self.mesh.ndim == 1 else self.mesh._flatten()
        group = mesh.get_group()
        payload = [
            {k: v.cpu() if torch.is_tensor(v) else v for k, v in modality.stand_in.items()}
            if _flat_index(self.mesh) == source
            else None
        ]
        dist.broadcast_object_list(payload, group_src=source, group=group, device=device)
        if modality.stand_in is None:
            modality.stand_in = payload[0]

    def _stand_ins(self, device) -> torch.Tensor | None:
        """Run the stand-ins at the queue's front, up to the next real call; 0 x their outputs."""
        zero = None
        while self.queue and not self.queue[0][1]:
            modality = self.queue.pop(0)[0]
            stand_in = {
                k: v.to(device) if torch.is_tensor(v) else v for k, v in modality.stand_in.items()
            }
            self.running = True
            try:
                features = modality.features(stand_in)
            finally:
                self.running = False
            used = consumed(features) or consumed(getattr(features, "last_hidden_state", None))
            total = sum((t.float().sum() for t in used), torch.zeros((), device=device)) * 0.0
            zero = total if zero is None else zero + total
        return zero

    def after_embedding(self, module: nn.Module, args, output):
        zero = self._stand_ins(output.device)
        return output if zero is None else output + zero.to(output.dtype)

    def follow_calls(self, modality: Modality) -> None:
        """After a real call of `modality`'s function, the stand-ins that follow it in the forward."""
        original = getattr(modality.holder, modality.function)

        @functools.wraps(original)
        def call(*args, **kwargs):
            features = original(*args, **kwargs)
            if self.running or not self.queue or self.queue[0] != (modality, True):
                return features
            self.queue.pop(0)
            anchor = consumed(features)
            zero = self._stand_ins(anchor[0].device if anchor else torch.device("cpu"))
            return features if zero is None else with_zero(features, zero)

        setattr(modality.holder, modality.function, call)


def consumed(features) -> list[torch.Tensor]:
    """The tensors of a features output a VLM's forward uses (see the module docstring)."""
    if torch.is_tensor(features):
        return [features]
    if isinstance(features, (list, tuple)):
        return [t for f in features for t in consumed(f)]
    if hasattr(features, "items"):
        return [
            t
            for k, v in features.items()
            if k not in DIAGNOSTIC and v is not None
            for t in consumed(v)
        ]
    return []


def with_zero(features, zero: torch.Tensor):
    """`features` with `zero` added to the first tensor the forward consumes (values unchanged)."""
    if torch.is_tensor(features):
        return features + zero.to(features.dtype)
    if isinstance(features, (list, tuple)):
        return type(features)([with_zero(features[0], zero), *features[1:]])
    if hasattr(features, "items"):
        key = next(k for k, v in features.items() if k not in DIAGNOSTIC and v is not None)
        features[key] = with_zero(features[key], zero)
    return features


def _flat_index(mesh: DeviceMesh) -> int:
    index = 0
    for dim in range(mesh.ndim):
        index = index * mesh.size(dim) + mesh.get_local_rank(dim)
    return index
