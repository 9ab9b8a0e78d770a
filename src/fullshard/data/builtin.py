"""What a run trains on when it names no data and no model: a generated corpus and a byte-level
tokenizer, both shipped with the code so the default run downloads nothing."""

from __future__ import annotations

import random


def builtin_tokenizer(name: str):
    """What a built-in model reads text (and images) with: the byte tokenizer, or the tiny VLM's processor."""
    return tiny_vlm_processor() if name in BUILTIN_VLMS else byte_tokenizer()


def builtin_model_config(name: str, tokenizer, seq_len: int, sizes: dict):
    """The transformers config and model class of a built-in model (`sizes`: its BUILTIN_MODELS
    entry), its vocabulary and special tokens its tokenizer's (so generate() stops at its end of text)."""
    if name in BUILTIN_VLMS:
        from transformers import Qwen2VLForConditionalGeneration

        return tiny_vlm_config(tokenizer, seq_len, **sizes), Qwen2VLForConditionalGeneration
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=seq_len, **special_token_ids(tokenizer),
                       **sizes), LlamaForCausalLM


BUILTIN_MODELS = {
    # name -> LlamaConfig kwargs; vocab size comes from the tokenizer, max positions from data.seq_len
    "tiny-llama": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, tie_word_embeddings=False),
    "micro-llama": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, tie_word_embeddings=False),
    # a Qwen2-VL (data/builtin.py): its language model's sizes; without data.path it trains on generated pictures
    "tiny-qwen2-vl": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2),
}
BUILTIN_VLMS = ("tiny-qwen2-vl",)


def save_builtin_model(name: str, directory, seq_len: int = 256, seed: int = 0) -> None:
    """A built-in model as a local Hugging Face directory: its config, random weights (seeded) and
    tokenizer (or processor) beside them, which `from_pretrained` and `fullshard train` then read
    like any other directory."""
    import torch

    from ..errors import ConfigError

    if name not in BUILTIN_MODELS:
        raise ConfigError(f"{name!r} is no built-in model; the built-in models are {', '.join(BUILTIN_MODELS)}")
    tokenizer = builtin_tokenizer(name)
    config, model_class = builtin_model_config(name, tokenizer, seq_len, BUILTIN_MODELS[name])
    torch.manual_seed(seed)
    model_class(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def builtin_corpus(num_docs: int = 5000, seed: int = 0) -> list[str]:
    """A generated corpus for the default run: short arithmetic facts, counting and templated
    sentences. It ships with the code (nothing to download) and has structure a tiny model
    learns within minutes, so the loss visibly falls."""
    rng = random.Random(seed)
    words = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
    names = ["Ada", "Alan", "Grace", "Edsger", "Barbara", "Donald", "Ken", "Dennis", "Linus", "Guido"]
    things = ["apples", "books", "stones", "shells", "coins", "keys", "cups", "maps"]
    places = ["the garden", "the library", "the harbour", "the market", "the attic", "the station"]
    docs = []
    for _ in range(num_docs):
        kind = rng.randrange(4)
        if kind == 0:
            a, b = rng.randrange(10), rng.randrange(10)
            docs.append(f"{a} plus {b} is {a + b}. {words[a]} plus {words[b]} is {a + b}.")
        elif kind == 1:
            start = rng.randrange(50)
            docs.append("counting: " + " ".join(str(start + i) for i in range(rng.randrange(4, 12))) + ".")
        elif kind == 2:
            name, n, thing, place = rng.choice(names), rng.randrange(2, 10), rng.choice(things), rng.choice(places)
            k = rng.randrange(1, n)
            docs.append(f"{name} found {words[n]} {thing} in {place}. {name} gave away {words[k]}, "
                        f"so {name} kept {words[n - k]} {thing}.")
        else:
            a, b = rng.randrange(2, 10), rng.randrange(2, 10)
            docs.append(f"{a} times {b} is {a * b}, and {a * b} minus {a} is {a * b - a}.")
    return docs


def builtin_prompts(num_prompts: int = 2000, seed: int = 0) -> list[dict]:
    """The prompts of the built-in RL toy (`train.objective=grpo` without data): sums to answer,
    each with its `answer` column (what the built-in `accuracy` reward checks; the toy itself
    rewards answering in digits, which a random byte-level policy rarely does)."""
    rng = random.Random(seed)
    records = []
    for _ in range(num_prompts):
        a, b = rng.randrange(10), rng.randrange(10)
        records.append({"prompt": f"{a} plus {b} is", "answer": str(a + b)})
    return records


def byte_tokenizer():
    """A byte-level tokenizer that needs no download and no training: 256 byte tokens plus
    `<|endoftext|>`, saved with the exported model like any other HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                        pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    return tokenizer


def special_token_ids(tokenizer) -> dict:
    """The special-token ids a model config (and so its generation config) must share with its
    tokenizer: a config's defaults (LlamaConfig's bos 1, eos 2) would let `generate()` run past
    the tokenizer's end of text."""
    return {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id}


# ------------------------------------------------------------------------------------------ built-in VLM

VISION_TOKENS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
IMAGE_SIZE = 56  # pixels a side: a 4 x 4 grid of 14-pixel patches, 4 image tokens after the 2 x 2 merge
# Qwen2-VL's chat template, cut to what the built-in data uses: string or list-of-parts content, images as
# <|vision_start|><|image_pad|><|vision_end|> (the processor expands <|image_pad|> to the image's tokens)
QWEN2_VL_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220), "yellow": (230, 210, 20),
           "white": (250, 250, 250), "purple": (140, 40, 170)}
QUESTIONS = ("What is in the image?", "Describe the picture.", "What do you see?")


def tiny_vlm_processor():
    """The built-in VLM's processor: the byte tokenizer with Qwen2-VL's special tokens and chat
    template, and Qwen2-VL's image processor (PIL) making every image a 56 x 56 one."""
    from transformers import Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from .vision import image_only_processor_class

    tokenizer = byte_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tokenizer.eos_token = "<|im_end|>"  # as Qwen2-VL's: an answer ends its turn, where generate() stops
    tokenizer.chat_template = QWEN2_VL_TEMPLATE
    pixels = IMAGE_SIZE * IMAGE_SIZE
    images = Qwen2VLImageProcessorPil(min_pixels=pixels, max_pixels=pixels, patch_size=14, merge_size=2,
                                      temporal_patch_size=2)
    return image_only_processor_class(Qwen2VLProcessor)(images, tokenizer, chat_template=QWEN2_VL_TEMPLATE)


def tiny_vlm_config(processor, seq_len: int, **sizes):
    """A tiny Qwen2-VL: a 2-block vision tower over 14-pixel patches, merged 2 x 2 into a 2-layer
    language model with mRoPE; token ids and vocabulary from the built-in processor."""
    from transformers import Qwen2VLConfig

    tokenizer = processor.tokenizer
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    hidden = sizes.get("hidden_size", 64)
    text = dict(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=sizes.get("intermediate_size", 128),
                num_hidden_layers=sizes.get("num_hidden_layers", 2), num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=max(seq_len, 256), tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                **special_token_ids(tokenizer))
    vision = dict(depth=2, embed_dim=32, hidden_size=hidden, num_heads=2, mlp_ratio=2, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    return Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False,
                         **special_token_ids(tokenizer), **ids)


def draw_shape(shape: str, colour: str, rng: random.Random):
    """A 56 x 56 picture of one coloured shape on a grey background, placed and sized at random."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (90, 90, 90))
    size = rng.randrange(22, 40)
    x, y = rng.randrange(2, IMAGE_SIZE - size - 1), rng.randrange(2, IMAGE_SIZE - size - 1)
    box, fill = (x, y, x + size, y + size), COLOURS[colour]
    draw = ImageDraw.Draw(image)
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([(x + size // 2, y), (x, y + size), (x + size, y + size)], fill=fill)
    return image


def write_caption_set(directory, num_records: int = 600, seed: int = 0) -> None:
    """The built-in image-caption data: `num_records` pictures of coloured shapes (PNG files) and
    `captions.jsonl`, one conversation per picture asking what it shows and answering with the
    colour and the shape, images named relative to the JSONL file."""
    import json
    from pathlib import Path

    directory = Path(directory)
    (directory / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    with open(directory / "captions.jsonl", "w", encoding="utf-8") as out:
        for index in range(num_records):
            shape, colour = rng.choice(SHAPES), rng.choice(sorted(COLOURS))
            name = f"images/{index:05d}.png"
            draw_shape(shape, colour, rng).save(directory / name)
            messages = [{"role": "user", "content": [{"type": "image", "image": name},
                                                     {"type": "text", "text": rng.choice(QUESTIONS)}]},
                        {"role": "assistant", "content": [{"type": "text", "text": f"a {colour} {shape}"}]}]
            out.write(json.dumps({"messages": messages}) + "\n")
