"""Tiny vision-language models of every image-text-to-text type transformers has, and inputs for them.

A type's tiny config is made generically from its default one (`shrink`: sizes, layers, image size,
vocabulary shrunk; dropout off), never from a per-family table. Image inputs are found the same way:
the model's own `get_image_features` signature says which layout it takes (Qwen's flattened patches
and grid, an image list per row, a plain batch of images), each candidate is tried on the tiny model,
and the number of rows its features give is the number of image tokens a row must hold.
"""

from __future__ import annotations

import inspect
import zlib

import torch
import transformers
from torch import nn

from ..packed_attention import has_image_blocks

VOCAB = 256  # room for the image / video / boundary tokens some configs place above 150
LAYERS = 2
IMAGE = 32
LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "encoder_layers",
              "num_decoder_layers", "depth", "vision_layers", "num_vision_layers")
SIZES = (
    (32, ("hidden_size", "n_embd", "d_model", "embed_dim", "hidden_dim", "dim", "vision_hidden_size",
          "text_hidden_size", "projector_hidden_size", "moe_intermediate_size", "shared_expert_intermediate_size",
          "out_hidden_size", "output_dim", "projection_dim", "mm_hidden_size", "output_channels",
          "codebook_dim", "downsample_hidden_size", "vision_output_dim", "projector_input_dim",
          "projector_output_dim", "mm_embed_dim", "output_proj_dims", "latent_channels",
          "image_token_embed_dim")),  # the last two: a VQ image generator's (Janus)
    (64, ("intermediate_size", "ffn_dim", "d_ff", "max_position_embeddings", "n_positions", "mlp_dim",
          "dense_intermediate_size", "shared_intermediate_size", "num_position_embeddings", "mm_posemb_size",
          "encoder_ffn_dim",
          "decoder_ffn_dim", "alignment_intermediate_size", "intermediate_size_mlp",
          "moe_shared_expert_intermediate_size", "projection_intermediate_size")),
    (LAYERS, LAYER_KEYS),
    (4, ("num_attention_heads", "n_head", "num_heads", "n_heads", "num_experts", "num_local_experts",
         "n_routed_experts", "linear_num_value_heads", "encoder_attention_heads", "decoder_attention_heads",
         "index_n_heads", "mamba_num_heads", "linear_num_heads")),
    (2, ("num_key_value_heads", "num_experts_per_tok", "num_kv_heads", "linear_num_key_heads",
         "pooling_kernel_size")),
    (8, ("head_dim", "kv_channels", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "patch_size",
         "linear_key_head_dim", "linear_value_head_dim", "index_head_dim", "linear_head_dim")),
    (16, ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "ssm_state_size")),  # qk: nope + rope head dims
    (IMAGE, ("image_size", "max_img_size")),
    (64, ("num_embeddings",)),  # a VQ image generator's codebook, channels, blocks (Janus)
    (32, ("base_channels",)),  # GroupNorm over 32 groups
    (1, ("num_res_blocks", "channel_multiplier")),
    ((IMAGE // 8) ** 2, ("mm_tokens_per_image", "num_image_tokens", "image_seq_length")),  # one per patch
)
SIZE = {key: value for value, keys in SIZES for key in keys}
IMAGE_TOKEN_KEYS = ("image_token_id", "image_token_index", "image_token", "image_patch_id")
VIDEO_TOKEN_KEYS = ("video_token_id", "video_token_index")


def vlm_types() -> dict[str, str]:
    """Every image-text-to-text type transformers maps, and its class name."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return dict(sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.items()))


def shrink(defaults: dict, layers: int | None = None) -> dict:
    """Overrides that make a config (as a dict) tiny, sub-configs included; no randomness in training."""
    out = {}
    layers = layers or next((defaults[k] for k in LAYER_KEYS if type(defaults.get(k)) is int), None)
    for key, value in defaults.items():
        if isinstance(value, dict) and (key.endswith("config") or key.endswith("_cfg")):
            # the whole default sub-config, shrunk: a sub-config given as a dict is built from its own
            # class's defaults, not the ones the parent gives it (PaliGemma's one key-value head)
            out[key] = {**value, **shrink(value)} if "model_type" in value else shrink(value)
        elif key in SIZE and (value is None or (type(value) is int and value > SIZE[key])):
            out[key] = SIZE[key]
        elif key in SIZE and isinstance(value, (list, tuple)) and value and all(type(v) is int for v in value):
            per_layer = layers and len(value) == layers > LAYERS  # one size per layer (Gemma 3n)
            out[key] = [min(v, SIZE[key]) for v in (value[:LAYERS] if per_layer else value)]
        elif "feature_layer" in key and (
                type(value) is int or isinstance(value, list) and all(type(v) is int for v in value)):
            # hidden states of the vision tower that feed the projector: inside the shrunk tower
            clamp = lambda v: max(-LAYERS, min(v, LAYERS - 1))  # noqa: E731
            out[key] = clamp(value) if type(value) is int else [clamp(v) for v in value]
        elif "vocab" in key and type(value) is int and value > VOCAB:
            out[key] = VOCAB
        elif key.endswith("token_id") and type(value) is int and value >= VOCAB:
            out[key] = VOCAB - 1 - (zlib.crc32(key.encode()) % 64)
        elif key.endswith(("token_index", "patch_id")) and type(value) is int and value >= VOCAB:
            out[key] = VOCAB - 1 - (zlib.crc32(key.encode()) % 64)
        elif key.endswith("grid_pinpoints") and value and all(isinstance(v, (list, tuple)) for v in value):
            # tiled-image resolutions (LLaVA-NeXT), multiples of one tile: the tile becomes IMAGE
            tile = min(min(v) for v in value)
            out[key] = [[side * IMAGE // tile for side in v] for v in value]
        elif key.endswith("patch_to_query_dict") and isinstance(value, dict):
            # query tokens per patch count (Aria's projector): the shrunk image's patches
            out[key] = {(IMAGE // SIZE["patch_size"]) ** 2: min(int(v) for v in value.values())}
        elif isinstance(value, float) and any(w in key for w in ("drop", "jitter", "noise")):
            out[key] = 0.0
        elif isinstance(value, list) and layers and len(value) == layers > LAYERS:
            out[key] = value[:LAYERS]
    if "use_cache" in defaults:
        out["use_cache"] = False
    heads, kv_heads = defaults.get("num_attention_heads"), defaults.get("num_key_value_heads")
    if type(heads) is int and heads == kv_heads and "num_attention_heads" in out:  # multi-head stays multi-head
        out["num_key_value_heads"] = out["num_attention_heads"]
    rope = defaults.get("rope_parameters")
    if isinstance(rope, dict) and isinstance(rope.get("mrope_section"), list):  # validated when built
        out["rope_parameters"] = {**rope, "mrope_section": mrope_sections({**defaults, **out}, rope)}
    return out


def mrope_sections(config: dict, rope: dict) -> list[int]:
    """Multimodal rope sections (t, h, w) splitting the rotary pairs of a (shrunk) config's head."""
    head_dim = config.get("qk_rope_head_dim") or config.get("head_dim") or \
        config["hidden_size"] // config["num_attention_heads"]
    factor = rope.get("partial_rotary_factor", config.get("partial_rotary_factor") or 1.0)
    pairs = int(head_dim * factor) // 2
    return [pairs - 2 * (pairs // 4), pairs // 4, pairs // 4]


def tiny_vlm_config(model_type: str):
    """The type's default config made tiny; distinct image / video token ids inside the vocabulary."""
    config_cls = transformers.CONFIG_MAPPING[model_type]
    defaults = config_cls().to_dict()
    for key, sub_cls in (getattr(config_cls, "sub_configs", None) or {}).items():
        if "vision" in key and defaults.get(key) is None and isinstance(sub_cls, type):
            defaults[key] = sub_cls().to_dict()  # a default config without its vision tower (Gemma 4)
    config = config_cls(**shrink(defaults))
    for sub in [config, *(getattr(config, k) for k in getattr(config, "sub_configs", {}) if getattr(config, k, None))]:
        fit_mrope(sub)
    ids = [getattr(config, k) for k in IMAGE_TOKEN_KEYS if type(getattr(config, k, None)) is int]
    if ids and ids[0] >= VOCAB:
        raise ValueError(f"image token {ids[0]} outside the shrunk vocabulary")
    return config


def fit_mrope(config) -> None:
    """Multimodal rope sections (t, h, w) that split the shrunk head's rotary pairs, for a config that
    takes them (its class exempts `mrope_section` from rope validation)."""
    if "mrope_section" not in getattr(type(config), "ignore_keys_at_rope_validation", ()):
        return
    rope = getattr(config, "rope_parameters", None)
    if not rope:
        return
    config.rope_parameters = {**rope, "mrope_section": mrope_sections(config.to_dict(), rope)}


def model_class(model_type: str) -> type[nn.Module]:
    return getattr(transformers, vlm_types()[model_type])


def image_token_id(config, keys=IMAGE_TOKEN_KEYS) -> int:
    for key in keys:
        value = getattr(config, key, None)
        if type(value) is int:
            return value
    kind = "image" if keys == IMAGE_TOKEN_KEYS else "video"
    raise ValueError(f"{type(config).__name__} names no {kind} token")


def vision_config(config):
    for key in ("vision_config", "vision_tower_config", "visual_config", "vit_config"):
        if getattr(config, key, None) is not None:
            return getattr(config, key)
    return config


def _first(config, keys, default):
    for key in keys:
        value = getattr(config, key, None)
        if value is not None:
            return value[0] if isinstance(value, (list, tuple)) else value
    return default


def features_holder(model: nn.Module, function: str = "get_image_features") -> tuple[nn.Module, list[str]]:
    """The module whose `function` the model's forward calls and every input it takes (what
    `parallel/images.py` runs): DeepSeek-VL defines it on its inner model only."""
    from ..parallel.images import feature_function

    holder, keys = feature_function(model, function)
    if holder is None:
        raise ValueError(f"{type(model).__name__} has no {function}")
    return holder, keys


def feature_params(model: nn.Module, function: str) -> set[str]:
    """The inputs a layout is made for: the model's own function's (its optional extras as the outer
    class takes them: LLaVA's inner `image_sizes` is Pixtral's), and those the one the forward calls
    requires (VideoLLaMA3's `image_merge_sizes`)."""
    holder = features_holder(model, function)[0]
    params = set(inspect.signature(getattr(model, function)).parameters) \
        if callable(getattr(type(model), function, None)) else set()
    inner = inspect.signature(getattr(holder, function)).parameters.items()
    return params | {k for k, p in inner if p.default is p.empty and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def candidate_image_inputs(model: nn.Module, images: int, generator: torch.Generator,
                           video: bool = False) -> list[dict]:
    """The image layouts `get_image_features` may take, for `images` random images, most likely first;
    `video`: the video layouts `get_video_features` may take (two frames each)."""
    vision = vision_config(model.config)
    params = feature_params(model, "get_video_features" if video else "get_image_features")
    channels = _first(vision, ("num_channels", "in_channels", "in_chans"), 3)
    size = _first(vision, ("image_size",), IMAGE)
    patch = _first(vision, ("patch_size",), 8)
    dtype = next(model.parameters()).dtype
    pixels_key, kind = ("pixel_values_videos", "video") if video else ("pixel_values", "image")
    out = []
    if f"{kind}_grid_thw" in params:
        merge = _first(vision, ("spatial_merge_size",), 2)
        temporal = _first(vision, ("temporal_patch_size",), 1)
        # a video: one temporal patch (Qwen's two frames; Qwen3-VL splits longer ones by timestamps)
        side = 2 * merge
        grid = torch.tensor([[1, side, side]] * images)
        merges = f"{kind}_merge_sizes"  # VideoLLaMA3
        extras = {merges: torch.tensor([merge] * images)} if merges in params else {}
        patches = images * side * side
        for shape in ((patches, channels * temporal * patch * patch), (patches, channels * 2 * patch * patch),
                      (patches, channels, patch, patch),
                      (1, patches, channels, patch, patch)):
            # flattened patches (Qwen, two frames where the config does not say), or each patch an image
            pixels = torch.randn(*shape, generator=generator)
            out.append({pixels_key: pixels.to(dtype), f"{kind}_grid_thw": grid, **extras})
    if video:  # a batch of clips, each a few frames (LLaVA's video models)
        clips = torch.randn(images, 2, channels, size, size, generator=generator)
        return out + [{pixels_key: clips.to(dtype)}]
    pixels = torch.randn(images, channels, size, size, generator=generator).to(dtype)
    extras = {}
    if "image_sizes" in params:
        extras["image_sizes"] = torch.tensor([[size, size]] * images)
    out.append({"pixel_values": pixels, **extras})
    masks = {k: torch.ones(images, size, size, dtype=torch.bool) for k in ("pixel_mask",) if k in params}
    out.append({"pixel_values": pixels, **extras, **masks})
    mask5 = {k: torch.ones(images, 1, size, size, dtype=torch.bool) for k in ("pixel_attention_mask",) if k in params}
    out.append({"pixel_values": pixels.unsqueeze(1), **extras, **mask5})
    if "spatial_shapes" in params:  # patches of any aspect ratio (SigLIP2's NaFlex): patch rows, grid, mask
        side = size // patch
        pixels = torch.randn(images, side * side, channels * patch * patch, generator=generator).to(dtype)
        out.append({"pixel_values": pixels, "spatial_shapes": torch.tensor([[side, side]] * images),
                    "pixel_attention_mask": torch.ones(images, side * side, dtype=torch.long)})
    if "image_position_ids" in params:  # patch rows and each patch's (x, y) (Gemma 4)
        side = size // patch
        pixels = torch.rand(images, side * side, channels * patch * patch, generator=generator).to(dtype)
        y, x = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
        positions = torch.stack([x.flatten(), y.flatten()], dim=-1)
        out.append({"pixel_values": pixels, "image_position_ids": positions.expand(images, -1, -1).clone()})
    if "image_sizes" in params:  # tiled images (LLaVA-NeXT): tiles per image from its size, the fewest that fit
        for tiles in range(2, 6):
            tiled = torch.randn(images, tiles, channels, size, size, generator=generator).to(dtype)
            out.append({"pixel_values": tiled, **extras})
    return out


def feature_rows(features) -> int:
    """Rows of image embeddings the model scatters into image tokens (pooler_output, cat over images)."""
    pooled = getattr(features, "pooler_output", None)
    pooled = features if pooled is None else pooled
    if isinstance(pooled, (list, tuple)):
        return sum(feature_rows(p) for p in pooled)
    return pooled.reshape(-1, pooled.shape[-1]).shape[0]


def find_image_inputs(model: nn.Module, images: int = 1, seed: int = 0,
                      video: bool = False) -> tuple[dict, int]:
    """A valid image input for `model` (`images` images) and how many image tokens it fills;
    `video`: a video input (clips of two frames) and its video tokens."""
    errors = []
    holder = features_holder(model, "get_video_features" if video else "get_image_features")[0]
    function = getattr(holder, "get_video_features" if video else "get_image_features")
    for inputs in candidate_image_inputs(model, images, torch.Generator().manual_seed(seed), video=video):
        try:
            with torch.no_grad():
                features = function(**inputs, return_dict=True)
            return inputs, feature_rows(features)
        except Exception as error:  # noqa: BLE001 - the next layout is tried, all reasons reported
            errors.append(f"{type(error).__name__}: {str(error).splitlines()[0][:100] if str(error) else ''}")
    raise ValueError(f"no {'video' if video else 'image'} layout fits: " + " | ".join(errors))


def build_vlm(model_type: str, seed: int = 0, config=None) -> nn.Module:
    torch.manual_seed(seed)
    model = model_class(model_type)._from_config(config or tiny_vlm_config(model_type), dtype=torch.float32)
    return model.train()


class VLMInputs:
    """Rows for one tiny model: text-only rows and rows holding one image (or, with `video`, one
    video), as a model's processor would give them (image tokens where the features go, labels on
    the text only)."""

    def __init__(self, model: nn.Module, seq_len: int = 24, video: bool = False):
        self.image_inputs, self.tokens = find_image_inputs(model)
        self.image_id = image_token_id(model.config)
        self.video_inputs, self.video_tokens, self.video_id = {}, 0, None
        if video:
            self.video_inputs, self.video_tokens = find_image_inputs(model, video=True)
            self.video_id = image_token_id(model.config, VIDEO_TOKEN_KEYS)
        self.seq_len = max(seq_len, self.tokens + 8, self.video_tokens + 8)
        special = {v for k, v in model.config.to_dict().items() if k.endswith(("token_id", "token_index"))
                   and type(v) is int}
        text_vocab = getattr(getattr(model.config, "text_config", model.config), "vocab_size", VOCAB)
        self.text_ids = torch.tensor([t for t in range(3, min(VOCAB, text_vocab)) if t not in special][:100])
        params = inspect.signature(model.forward).parameters
        # the name the model's processor gives the pixels (Video-LLaVA's `pixel_values_images`)
        self.pixels_key = "pixel_values_images" if "pixel_values_images" in params else "pixel_values"
        self.mm_token_type = "mm_token_type_ids" in params
        # `token_type_ids` as the model's processor gives them: Gemma 3's kind marks image tokens (1),
        # PaliGemma's the answer after a prefix attended both ways (0: image and prompt, 1: answer)
        self.token_types = None if "token_type_ids" not in params else "image" if has_image_blocks(model) else "prefix"

    def batch(self, with_image: list, rows: range | None = None, seed: int = 1) -> dict[str, torch.Tensor]:
        """Rows `rows` (default: all) of the batch with one row per flag (True: an image, "video": a
        video, False: text only); a row with an image (video) holds its tokens after two text tokens,
        and row r's image is the same whichever rows are taken."""
        rows = range(len(with_image)) if rows is None else rows
        generator = torch.Generator().manual_seed(seed)
        picks = torch.randint(0, len(self.text_ids), (len(with_image), self.seq_len), generator=generator)
        input_ids = self.text_ids[picks][rows.start:rows.stop]
        labels = input_ids.clone()
        image_rows = [r for r in rows if with_image[r] and with_image[r] != "video"]
        video_rows = [r for r in rows if with_image[r] == "video"]
        for r in image_rows:
            input_ids[r - rows.start, 2:2 + self.tokens] = self.image_id
            labels[r - rows.start, 2:2 + self.tokens] = -100
        for r in video_rows:
            input_ids[r - rows.start, 2:2 + self.video_tokens] = self.video_id
            labels[r - rows.start, 2:2 + self.video_tokens] = -100
        batch = {"input_ids": input_ids, "labels": labels}
        if self.mm_token_type:  # text 0, image 1, video 2
            video = (input_ids == (-1 if self.video_id is None else self.video_id)).long()
            batch["mm_token_type_ids"] = (input_ids == self.image_id).long() + 2 * video
        if self.token_types == "image":
            batch["token_type_ids"] = (input_ids == self.image_id).long()
        elif self.token_types == "prefix":  # the prompt is the image and four text tokens; labels on the answer
            prefix = 2 + self.tokens + 2
            batch["token_type_ids"] = (torch.arange(input_ids.shape[1]) >= prefix).long().expand_as(input_ids).clone()
            labels[:, :prefix] = -100
        if image_rows:
            batch.update(self.images(image_rows))
        if video_rows:
            batch.update(self.images(video_rows, self.video_inputs))
        return batch

    def images(self, rows: list[int], found: dict | None = None) -> dict[str, torch.Tensor]:
        """One image (video) per row in `rows`, in the layout found: the found one shifted by 0.1 x row."""
        out = {}
        for key, value in (self.image_inputs if found is None else found).items():
            if key.startswith("pixel_values"):
                name = self.pixels_key if key == "pixel_values" else key
                out[name] = torch.cat([value + 0.1 * r for r in rows])
            else:
                out[key] = torch.cat([value] * len(rows))
        return out
