"""Conversations with images, read with the model's own processor, labelled on the assistant's text.

A record is a chat whose turns carry content parts, the form transformers' processors' chat
templates take: `{"type": "image", "image": "path.png"}` beside `{"type": "text", "text": ...}`
(a relative path is relative to the data file's directory), and for a processor that takes videos
`{"type": "video", "video": ["frame0.png", "frame1.png", ...]}`: a video as its decoded frames (no
video file is decoded here: transformers decodes them with torchvision / PyAV). A processor whose
video half needs torchvision, which is not installed, is built for images only (`load_processor`),
and a record with a video is then one error saying so, never silently read without it. Each record is rendered with the
processor's chat template; the processor then loads the images (PIL), expands each image
placeholder to the image's tokens and tokenizes. The assistant turns are located by rendering
prefixes (`chat.assistant_spans`) and moved past the expanded placeholders before them; a token
is a target when it starts inside an assistant turn and is not an image token.

A prefix LM's processor (PaliGemma's kind: its `__call__` takes the answer apart from the prompt,
as `suffix`) is given the conversation as it takes it for training: the prompt (the images and the
text up to the first assistant turn) and the answer (the rest, which it ends with EOS), and marks
the answer in `token_type_ids` (0: the prefix, attended both ways; 1: the answer and after, causal).
Each document carries its own prefix block: transformers' mask for such a model ORs the prefix
block into the causal mask and then ANDs the document mask it reads from packed position ids, so
packed documents stay apart. Image tokens are the processor's image token ids, for every model.

A document is then its token ids and labels, the processor's per-token columns (`mm_token_type_ids`,
`token_type_ids`), for mRoPE models (Qwen2-VL family) its three rope rows from the model's own
`get_rope_index` run on the document alone, and its image tensors (`pixel_values`,
`image_grid_thw`, ...) as one safetensors blob, image-major (one row per image or per patch), so the
images of a packed row are the concatenation of its documents'. A conversation that does not fit
a row is cut, by `data.overlong=truncate`, before the first image it would split, keeping the
images before the cut. Everything here runs once per node, into the data cache (`prepare.py`).
"""

from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigError
from .chat import IGNORE_INDEX, ROLES, RecordError, assistant_spans
from .pack import IMAGES as IMAGE_KEY, ROPE_COLUMNS

PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")
# what a processor returns that is no per-token column nor image tensor (a prefix LM's processor
# returns its own labels too: ours come from the assistant turns)
TEXT_OUTPUTS = ("input_ids", "attention_mask", "offset_mapping", "text_replacement_offsets", "labels")


def is_multimodal(processor) -> bool:
    """Whether `processor` (what `load_processor` returns) reads images."""
    return getattr(processor, "image_processor", None) is not None


def answers_after_prefix(processor) -> bool:
    """Whether `processor` is a prefix LM's (PaliGemma's kind): it takes the answer apart from the prompt
    (`suffix`) and marks it in `token_type_ids` (1; 0 for the images and prompt, attended both ways)."""
    return "suffix" in inspect.signature(processor.__call__).parameters


def load_processor(name: str, trust_remote_code: bool = False):
    """The processor saved with a vision-language model (images, tokenizer, chat template). A model
    directory without one, or a processor that cannot be built here, is one `ConfigError` naming it.
    Without torchvision, a processor whose only need of it is its video half is built without that half."""
    import transformers
    from transformers import AutoProcessor
    from transformers.utils import is_torchvision_available

    if Path(name).is_dir() and not any((Path(name) / f).is_file() for f in PROCESSOR_FILES):
        raise ConfigError(f"model.name_or_path={name!r} is a vision-language model without a processor (none of "
                          f"{', '.join(PROCESSOR_FILES)}): save the model's processor beside it "
                          "(processor.save_pretrained)")
    try:
        processor = AutoProcessor.from_pretrained(name, trust_remote_code=trust_remote_code)
    except Exception as err:  # noqa: BLE001 - transformers raises many types here; each becomes one line
        cls = getattr(transformers, _saved_processor_class(name) or "-", None)
        if is_torchvision_available() or cls is None or "video_processor" not in cls.get_attributes():
            reason = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            needs = "" if is_torchvision_available() else " (torchvision is not installed: pip install torchvision)"
            raise ConfigError(f"model.name_or_path={name!r}: its processor cannot be loaded{needs}: {reason}") from None
        processor = image_only_processor_class(cls).from_pretrained(name, trust_remote_code=trust_remote_code)
    if not is_multimodal(processor):
        raise ConfigError(f"model.name_or_path={name!r} is a vision-language model but its directory has no image "
                          "processor (preprocessor_config.json / processor_config.json): save the model's processor "
                          "with it (processor.save_pretrained)")
    return processor


def image_only_processor_class(processor_class):
    """`processor_class` taking images and text only. transformers' Qwen2-VL family processors insist on
    a video processor, which exists only with torchvision; this same-named subclass leaves it out, so
    an image-only processor builds (and saves, as `processor_class`, the family's own name) without it."""
    attributes = [a for a in processor_class.get_attributes() if "video" not in a]

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        processor_class.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kwargs)

    def __reduce__(self):  # the class is made here, so a pickle (datasets' worker processes) makes it again
        return _rebuild_image_only, (processor_class, self.__dict__)

    if processor_class not in _IMAGE_ONLY:
        _IMAGE_ONLY[processor_class] = type(processor_class.__name__, (processor_class,), {
            "__init__": __init__, "get_attributes": classmethod(lambda cls: list(attributes)),
            "__reduce__": __reduce__, "__module__": __name__})
    return _IMAGE_ONLY[processor_class]


_IMAGE_ONLY: dict = {}


def _rebuild_image_only(processor_class, state: dict):
    cls = image_only_processor_class(processor_class)
    processor = cls.__new__(cls)
    processor.__dict__.update(state)
    return processor


def _saved_processor_class(name: str) -> str | None:
    import json

    for file in PROCESSOR_FILES:
        path = Path(name) / file
        if path.is_file():
            return json.loads(path.read_text()).get("processor_class")
    return None


def processor_id(processor) -> str:
    """What of a processor decides the data besides its tokenizer: its image processor's settings and class."""
    images = processor.image_processor
    return f"{type(processor).__name__} {type(images).__name__} {images.to_json_string()}"


def encode_images(tensors: dict[str, torch.Tensor]) -> bytes:
    """A document's image tensors as bytes for the cache (safetensors: reading them runs no code)."""
    from safetensors.torch import save

    return save({k: v.contiguous() for k, v in tensors.items()}) if tensors else b""


def decode_images(blobs) -> dict[str, torch.Tensor]:
    """The image tensors of several documents (or rows), concatenated image by image."""
    from safetensors.torch import load

    parts = [load(bytes(b)) for b in blobs if b is not None and len(b)]
    # images in some, videos in others; sorted: safetensors gives a file's keys in no fixed order, and
    # a row's tensors are hashed in key order (`PackedData.fingerprint`)
    keys = sorted({k for p in parts for k in p})
    return {k: torch.cat([p[k] for p in parts if k in p]) for k in keys}


class RopeIndex:
    """A document's mRoPE positions (3, tokens) from the model's own `get_rope_index`, run on the
    document alone, so a packed document is positioned as it would be unpacked. The method runs on
    a bare instance of the model's base class holding only its config (no weights)."""

    def __init__(self, config, model_class):
        self.config, self.model_class, self._owner = config, model_class, None

    @classmethod
    def of(cls, config) -> "RopeIndex | None":
        """The rope index of the model `config` describes, or None when its positions are 1-D."""
        from transformers import MODEL_MAPPING

        model_class = MODEL_MAPPING.get(type(config), None) if type(config) in MODEL_MAPPING else None
        return cls(config, model_class) if model_class is not None and hasattr(model_class, "get_rope_index") else None

    def __getstate__(self):
        return {"config": self.config, "model_class": self.model_class, "_owner": None}

    def __call__(self, ids: np.ndarray, token_types: np.ndarray, images: dict) -> np.ndarray:
        if self._owner is None:
            owner = self.model_class.__new__(self.model_class)
            torch.nn.Module.__init__(owner)
            owner.config, owner.rope_deltas = self.config, None
            self._owner = owner
        method = self._owner.get_rope_index
        accepted = inspect.signature(method).parameters
        inputs = {"input_ids": torch.as_tensor(ids)[None], "mm_token_type_ids": torch.as_tensor(token_types)[None],
                  **{k: v for k, v in images.items() if k in accepted and k.endswith("grid_thw")}}
        positions, _ = method(**inputs)
        return positions[:, 0].numpy()


class UnreadableVideo(RecordError):
    """A video this processor cannot read here: an error even under `data.bad_images=drop`."""


def vision_messages(row: int, messages) -> tuple[list[dict], list[str], list[list[str]]]:
    """A record's turns with their content parts (text, image or video; a string content is one text
    part), the image paths and each video's frame paths in order, checked."""
    if not isinstance(messages, list) or not messages:
        raise RecordError(row, "has no messages (a list of {role, content})")
    turns, paths, videos = [], [], []
    for turn in messages:
        if not isinstance(turn, dict) or turn.get("role") not in ROLES:
            raise RecordError(row, f"has a turn that is not {{role: {'/'.join(ROLES)}, content}}: {turn!r}")
        content = turn.get("content")
        if isinstance(content, str):
            turns.append({"role": turn["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise RecordError(row, f"has a turn whose content is neither text nor a list of parts: {turn!r}")
        parts = []
        for part in content:
            # rows read through Arrow carry every part's fields, the absent ones as None
            part = {k: v for k, v in part.items() if v is not None} if isinstance(part, dict) else part
            if not isinstance(part, dict) or part.get("type") not in ("text", "image", "video"):
                raise RecordError(row, f"has a content part that is neither {{type: text, text}}, "
                                       f"{{type: image, image: path}} nor {{type: video, video: [frame paths]}}: "
                                       f"{part!r}")
            if part["type"] == "video":
                frames = part.get("video")
                if not isinstance(frames, list) or not frames or not all(isinstance(f, str) for f in frames):
                    raise UnreadableVideo(row, f"has a video part that is not a list of frame image paths: {part!r} "
                                               "(no video file is decoded here: give its frames, decoded)")
                videos.append(frames)
            elif part["type"] == "image":
                if not isinstance(part.get("image"), str):
                    raise RecordError(row, f"has an image part without a file path: {part!r}")
                paths.append(part["image"])
            elif not isinstance(part.get("text"), str):
                raise RecordError(row, f"has a text part without text: {part!r}")
            parts.append(part)
        turns.append({"role": turn["role"], "content": parts})
    if not any(t["role"] == "assistant" for t in turns):
        raise RecordError(row, "is a conversation with no assistant turn (nothing to train on)")
    return turns, paths, videos


def open_image(row: int, path: Path):
    """The image at `path`, decoded, as RGB; a missing or unreadable file is a `RecordError` naming it."""
    from PIL import Image, UnidentifiedImageError

    if not path.is_file():
        raise RecordError(row, f"names image {path}, which does not exist")
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as err:
        raise RecordError(row, f"names image {path}, which cannot be read as an image: {err}") from None


class VisionTokenize:
    """The picklable batch function for image-text chat records (what `Tokenize` is for text):
    ids, labels, the processor's per-token columns, rope rows, the image tensors, and whether the
    record was truncated or dropped for a broken image (`data.bad_images=drop`)."""

    def __init__(self, processor, section, base_dir: Path, rope: RopeIndex | None):
        from .chat import chat_template_of

        self.processor, self.base_dir, self.rope = processor, Path(base_dir), rope
        self.field = section.messages_field
        self.seq_len, self.overlong = section.seq_len, section.overlong
        self.drop_broken = getattr(section, "bad_images", "error") == "drop"
        self.template = chat_template_of(processor, section.chat_template)
        self.prefix_lm = answers_after_prefix(processor)
        known = [i for k in ("image_token_ids", "video_token_ids") for i in getattr(processor, k, None) or []
                 if i is not None]
        self.image_ids = np.asarray(known, np.int64)
        probe = self._encode("ab", [(1, 2)], [])  # which per-token columns the processor gives
        self.columns = tuple(sorted([k for k, v in probe.items() if k not in TEXT_OUTPUTS and _per_token(v, None)]
                                    + (list(ROPE_COLUMNS) if rope is not None else [])))

    def __call__(self, batch: dict, indices: list[int]) -> dict:
        if self.field not in batch:
            raise RecordError(indices[0], f"has no field {self.field!r} (image-text records are chat messages)")
        documents = []
        for k, row in enumerate(indices):
            try:
                documents.append(self.document(row, batch[self.field][k]))
            except RecordError as error:
                if not self.drop_broken or isinstance(error, UnreadableVideo):
                    raise
                documents.append(None)
        out = {"input_ids": [], "labels": [], "truncated": [], "broken": [], IMAGE_KEY: [],
               **{c: [] for c in self.columns}}
        for doc in documents:
            out["broken"].append(doc is None)
            doc = doc or self._empty()
            out["truncated"].append(bool(doc.get("truncated", False)))
            for key in ("input_ids", "labels", IMAGE_KEY, *self.columns):
                out[key].append(doc[key])
        return out

    def _empty(self) -> dict:
        return {"input_ids": [], "labels": [], IMAGE_KEY: b"", "truncated": False, **{c: [] for c in self.columns}}

    def document(self, row: int, messages) -> dict:
        turns, names, clips = vision_messages(row, messages)
        files = [self._path(n) for n in names]
        images = [open_image(row, f) for f in files]
        videos = self._videos(row, clips)
        text, spans = assistant_spans(self.processor, self.template, turns, row)
        for kind, count in (("image", len(images)), ("video", len(videos))):
            placeholder = getattr(self.processor, f"{kind}_token", None)
            if placeholder and text.count(placeholder) != count:
                raise RecordError(row, f"renders {text.count(placeholder)} {kind} placeholder(s) {placeholder!r} "
                                       f"for {count} {kind}(s) ({', '.join(map(str, files)) or 'none'}): {kind} "
                                       "tokens must not appear in the text")
        try:
            encoded = self._encode(text, spans, images, videos)
        except (ValueError, IndexError, StopIteration) as err:
            raise RecordError(row, f"has image tokens that do not match its image(s) "
                                   f"({', '.join(map(str, files))}): {err}") from None
        ids = np.asarray(encoded["input_ids"][0], np.int64)
        columns = {k: np.asarray(v[0], np.int64) for k, v in encoded.items()
                   if k not in TEXT_OUTPUTS and _per_token(v, len(ids))}
        image_tensors = {k: torch.as_tensor(np.asarray(v)) for k, v in encoded.items()
                         if k not in TEXT_OUTPUTS and k not in columns}
        is_image = self._image_tokens(ids, columns)
        self._check_image_tokens(row, files, is_image, encoded, len(images) + len(videos))
        labels = (self._answer_labels if self.prefix_lm else self._labels)(ids, text, spans, encoded, is_image)
        if self.rope is not None:
            types = columns.get("mm_token_type_ids", is_image.astype(np.int64))
            columns.update(zip(ROPE_COLUMNS, self.rope(ids, types, image_tensors)))
        if tuple(sorted(columns)) != self.columns:
            raise RecordError(row, f"is processed into the columns {sorted(columns)}, not {list(self.columns)}")
        doc = {"input_ids": ids, "labels": labels, **columns}
        if len(ids) > self.seq_len:
            if self.overlong == "drop":
                return self._empty()
            cut, kept = self._cut(is_image)
            if videos and kept < len(images) + len(videos):  # a video's tensors are not re-made: cut
                cut, kept = int(np.argmax(is_image)), 0     # before the first image or video
            doc = {k: v[:cut] for k, v in doc.items()}
            image_tensors = self._first_images(images[:kept]) if kept < len(images) + len(videos) else image_tensors
            doc["truncated"] = True
        doc = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in doc.items()}
        doc[IMAGE_KEY] = encode_images(image_tensors)
        return doc

    def _path(self, name: str) -> Path:
        return Path(name).expanduser() if Path(name).expanduser().is_absolute() else self.base_dir / name

    def _videos(self, row: int, clips: list[list[str]]) -> list[list]:
        """Each video's frames, decoded; a processor without a video half here is one error."""
        if clips and getattr(self.processor, "video_processor", None) is None:
            from transformers.utils import is_torchvision_available

            why = "" if is_torchvision_available() else \
                " (its video processor needs torchvision, which is not installed: pip install torchvision)"
            raise UnreadableVideo(row, f"has a video, but this model's processor reads no videos here{why}")
        return [[open_image(row, self._path(f)) for f in frames] for frames in clips]

    def _encode(self, text: str, spans, images: list, videos: list = ()) -> dict:
        """The processor's encoding of a rendered conversation with its images: the whole text, or for a
        prefix LM the prompt (up to the first assistant turn) and the answer (the rest) as its processor
        takes them for training (it then puts its BOS after the last image, ends the prompt with a
        newline and the answer with EOS). Its processor refuses a conversation without an image; its
        tokenizer makes the same prompt/answer pair then, with the answer marked the same way."""
        options = dict(add_special_tokens=False, return_offsets_mapping=True)
        if not self.prefix_lm:
            media = {"videos": list(videos)} if videos else {}
            return self.processor(text=[text], images=images or None, return_text_replacement_offsets=True, **media,
                                  **options)
        prompt, answer = text[:spans[0][0]], text[spans[0][0]:]
        if images:
            return self.processor(text=[prompt], images=images, suffix=[answer], return_text_replacement_offsets=True,
                                  **options)
        tokenizer = self.processor.tokenizer
        return tokenizer(text=[prompt], text_pair=[answer + tokenizer.eos_token], return_token_type_ids=True, **options)

    def _image_tokens(self, ids: np.ndarray, columns: dict) -> np.ndarray:
        """The image (and video) tokens: the processor's image and video token ids (what each is expanded
        to and what the model scatters its features onto); `mm_token_type_ids` for a processor that
        names none."""
        if len(self.image_ids):
            return np.isin(ids, self.image_ids)
        types = columns.get("mm_token_type_ids")
        return types != 0 if types is not None else np.zeros(len(ids), bool)

    def _check_image_tokens(self, row: int, files, is_image: np.ndarray, encoded, count: int) -> None:
        """Every image expanded to tokens, none left over (a placeholder written in the text)."""
        runs = int((is_image & ~np.concatenate([[False], is_image[:-1]])).sum())
        replaced = len(encoded.get("text_replacement_offsets", [[]])[0])
        if count and (runs == 0 or replaced != count):
            raise RecordError(row, f"has image tokens that do not match its image(s) ({', '.join(map(str, files))}): "
                                   f"{replaced} placeholder(s) expanded for {count} image(s)")

    def _labels(self, ids: np.ndarray, text: str, spans, encoded, is_image: np.ndarray) -> np.ndarray:
        """Targets: tokens starting inside an assistant turn (moved past the expanded placeholders)
        that are no image tokens."""
        starts = np.asarray([start for start, _ in encoded["offset_mapping"][0]], np.int64)
        replacements = encoded.get("text_replacement_offsets", [[]])[0]
        ends = np.asarray([r["span"][1] for r in replacements], np.int64)
        gained = np.concatenate([[0], np.cumsum([(r["new_span"][1] - r["new_span"][0]) - (r["span"][1] - r["span"][0])
                                                 for r in replacements])]).astype(np.int64)
        trained = np.zeros(len(ids), bool)
        for start, end in spans:
            start, end = (c + gained[np.searchsorted(ends, c, side="right")] for c in (start, end))
            trained |= (starts >= start) & (starts < end)
        return np.where(trained & ~is_image, ids, IGNORE_INDEX)

    def _answer_labels(self, ids: np.ndarray, text: str, spans, encoded, is_image: np.ndarray) -> np.ndarray:
        """A prefix LM's targets: answer tokens (type 1, their offsets within the answer) that start inside
        an assistant turn; the EOS its processor ends the answer with belongs to a last assistant turn."""
        answer = np.asarray(encoded["token_type_ids"][0], np.int64) == 1
        starts = spans[0][0] + np.asarray([start for start, _ in encoded["offset_mapping"][0]], np.int64)
        trained = np.zeros(len(ids), bool)
        for start, end in spans:
            trained |= (starts >= start) & ((starts < end) | (end == len(text)))
        return np.where(trained & answer & ~is_image, ids, IGNORE_INDEX)

    def _cut(self, is_image: np.ndarray) -> tuple[int, int]:
        """Where an overlong document is cut (at most seq_len tokens, never inside an image) and how
        many images stay."""
        cut = self.seq_len
        while 0 < cut < len(is_image) and is_image[cut] and is_image[cut - 1]:
            cut -= 1
        starts = is_image & ~np.concatenate([[False], is_image[:-1]])
        return cut, int(starts[:cut].sum())

    def _first_images(self, images: list) -> dict:
        """The image tensors of the images kept by a cut (each image is processed on its own)."""
        if not images:
            return {}
        processed = self.processor.image_processor(images, return_tensors="pt")
        return {k: torch.as_tensor(v) for k, v in processed.items()}


def _per_token(value, length: int | None) -> bool:
    """Whether a processor output is a per-token column (a batch of token lists, as the tokenizer returns them)."""
    return (isinstance(value, list) and bool(value) and isinstance(value[0], list)
            and (length is None or len(value[0]) == length))
