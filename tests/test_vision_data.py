"""Image-text conversations read with the model's processor: packed rows equal the documents alone
(Qwen2-VL's mRoPE, Gemma 3's bidirectional image blocks), labels on assistant text only, one error
naming the record and the image, once-per-node caching."""

import json
import random

import pytest
import torch
import torch.nn.functional as F

from fullshard.data.builtin import draw_shape, tiny_vlm_config, tiny_vlm_processor, write_caption_set
from fullshard.data.prepare import TOKENIZE_RUNS, prepare
from fullshard.data.rows import Rows
from fullshard.data.vision import RopeIndex, load_processor
from fullshard.errors import ConfigError
from fullshard.train.config import DataSection
from fullshard.train.loss import causal_lm_loss_sum

IGNORE = -100


def chat(*user_parts, answer="a red circle"):
    return {"messages": [{"role": "user", "content": list(user_parts)},
                         {"role": "assistant", "content": [{"type": "text", "text": answer}]}]}


def image(name):
    return {"type": "image", "image": name}


def text(words):
    return {"type": "text", "text": words}


def write_records(directory, records, images=4):
    rng = random.Random(0)
    (directory / "images").mkdir(parents=True, exist_ok=True)
    for i in range(images):
        draw_shape(rng.choice(["circle", "square"]), rng.choice(["red", "blue"]), rng).save(directory / f"images/{i}.png")
    path = directory / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


RECORDS = [chat(image("images/0.png"), text("What is it?")),
           chat(text("no picture here"), answer="then nothing"),
           chat(image("images/1.png"), text("and"), image("images/2.png"), answer="two shapes"),
           chat(text("look:"), image("images/3.png"), answer="a blue square")]


def rows_of(processor, path, tmp_path, rope=None, **section):
    section = DataSection(path=str(path), format="chat", cache_dir=str(tmp_path / "cache"), **{"seq_len": 160, **section})
    prepared = prepare(section, processor, section.path, tmp_path / "cache", rope)
    return Rows(prepared.dataset), prepared.info


def documents(rows, pad_id):
    """Each document of packed rows, the padding left out: (row index, start, end)."""
    found = []
    for r in range(len(rows)):
        row = rows.take([r])
        positions, ids = row["position_ids"][0], row["input_ids"][0]
        text_positions = positions[0] if positions.ndim == 2 else positions
        starts = (text_positions == 0).nonzero().flatten().tolist() + [len(text_positions)]
        found += [(r, a, b) for a, b in zip(starts, starts[1:]) if not (ids[a:b] == pad_id).all()]
    return found


def images_of(record, directory):
    from PIL import Image

    names = [p["image"] for t in record["messages"] for p in t["content"] if p["type"] == "image"]
    return [Image.open(directory / n).convert("RGB") for n in names]


def processor_inputs(processor, record, directory):
    """What the model's processor makes of one record: its chat template rendered, its images."""
    rendered = processor.apply_chat_template(record["messages"], tokenize=False)
    return processor(text=[rendered], images=images_of(record, directory) or None, add_special_tokens=False,
                     return_tensors="pt")


def alone_loss(model, inputs, labels):
    """The loss sum of one record through plain transformers: the processor's inputs, the model's own positions."""
    logits = model(**{k: v for k, v in inputs.items() if k != "labels"}).logits[0, :-1].float()
    return F.cross_entropy(logits, labels[1:], ignore_index=IGNORE, reduction="sum")


def check_packed_equals_alone(model, processor, tmp_path, rope=None, records=RECORDS, inputs_of=processor_inputs,
                              seq_len=160):
    path = write_records(tmp_path, records)
    rows, info = rows_of(processor, path, tmp_path, rope, seq_len=seq_len)
    assert len(rows) < len(records) and info["documents"] == len(records)  # packed: several documents a row
    docs = documents(rows, processor.tokenizer.pad_token_id)
    assert len(docs) == len(records)
    packed = causal_lm_loss_sum(model, rows.take(range(len(rows))), 0)
    total = 0.0
    for record, (r, a, b) in zip(records, docs):
        row = rows.take([r])
        inputs = inputs_of(processor, record, tmp_path)
        loss, ids = alone_loss(model, inputs, row["labels"][0, a:b]), inputs["input_ids"][0]
        assert torch.equal(ids, row["input_ids"][0, a:b])
        total = total + loss
    assert abs(float(packed) - float(total)) <= 1e-5 * float(total), (float(packed), float(total))
    return rows


def test_packed_rows_equal_the_documents_alone_qwen2_vl(tmp_path):
    """mRoPE: 4-row position ids built per document (text row restarting, rope rows from get_rope_index)."""
    torch.manual_seed(0)
    processor = tiny_vlm_processor()
    config = tiny_vlm_config(processor, 160)
    from transformers import Qwen2VLForConditionalGeneration

    model = Qwen2VLForConditionalGeneration._from_config(config).eval()
    with torch.no_grad():
        rows = check_packed_equals_alone(model, processor, tmp_path, RopeIndex.of(config))
        batch = rows.take(range(len(rows)))
        assert batch["position_ids"].shape[1] == 4
        # what the model makes of 2-D ids: no document mask and text rope on the images; it is not the same
        flat = {**batch, "position_ids": batch["position_ids"][:, 0]}
        flat_model = Qwen2VLForConditionalGeneration._from_config(config).eval()
        flat_model.load_state_dict(model.state_dict())
        from fullshard.data.rows import model_inputs

        inputs = {k: v for k, v in model_inputs(flat).items() if k != "labels"}
        inputs["position_ids"] = inputs["position_ids"][None].expand(3, *inputs["position_ids"].shape)
        wrong = F.cross_entropy(flat_model(**inputs, use_cache=False).logits[:, :-1].flatten(0, 1).float(),
                                batch["labels"][:, 1:].flatten(), ignore_index=IGNORE, reduction="sum")
        assert abs(float(wrong) - float(causal_lm_loss_sum(model, batch, 0))) > 1e-3


def gemma3_processor_and_model():
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor, PreTrainedTokenizerFast
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    from fullshard.data.builtin import byte_tokenizer

    base = byte_tokenizer()
    base.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>", "<start_of_image>",
                                                           "<end_of_image>", "<image_soft_token>"]})
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, eos_token="<|endoftext|>",
                                        pad_token="<|endoftext|>", extra_special_tokens={
                                            "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                            "image_token": "<image_soft_token>"})
    template = ("{% for message in messages %}<start_of_turn>{{ message['role'] }}\n{% for part in message['content'] %}"
                "{% if part['type'] == 'image' %}<start_of_image>{% else %}{{ part['text'] }}{% endif %}{% endfor %}"
                "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>assistant\n{% endif %}")
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 56, "width": 56}),
                                tokenizer=tokenizer, chat_template=template, image_seq_length=4)
    ids = tokenizer.convert_tokens_to_ids
    config = Gemma3Config(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=24,
                         layer_types=["sliding_attention", "full_attention"]),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=56, patch_size=14),
        mm_tokens_per_image=4, boi_token_index=ids("<start_of_image>"), eoi_token_index=ids("<end_of_image>"),
        image_token_index=ids("<image_soft_token>"))
    return processor, Gemma3ForConditionalGeneration._from_config(config).eval()


def test_packed_rows_equal_the_documents_alone_gemma3(tmp_path):
    """Gemma 3's image blocks attend bidirectionally, each inside its own document."""
    torch.manual_seed(0)
    processor, model = gemma3_processor_and_model()
    with torch.no_grad():
        rows = check_packed_equals_alone(model, processor, tmp_path)
        batch = rows.take(range(len(rows)))
        assert "token_type_ids" in batch
        # transformers' own masks read the sliding layers' image blocks at document-relative positions
        from fullshard.data.rows import model_inputs

        inputs = {k: v for k, v in model_inputs(batch).items() if k != "labels"}
        theirs = F.cross_entropy(model(**inputs, use_cache=False).logits[:, :-1].flatten(0, 1).float(),
                                 batch["labels"][:, 1:].flatten(), ignore_index=IGNORE, reduction="sum")
        assert abs(float(theirs) - float(causal_lm_loss_sum(model, batch, 0))) > 1e-3


def paligemma_processor_and_model():
    """A tiny PaliGemma: the byte tokenizer with PaliGemma's image, BOS and EOS tokens, SigLIP's image
    processor (28-pixel images, 4 tokens each) and a template rendering its native layout (the images
    and the question, then the answer: the processor adds BOS, newline and EOS)."""
    from transformers import (
        PaliGemmaConfig,
        PaliGemmaForConditionalGeneration,
        PaliGemmaProcessor,
        PreTrainedTokenizerFast,
    )
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    from fullshard.data.builtin import byte_tokenizer

    base = byte_tokenizer()
    base.add_special_tokens({"additional_special_tokens": ["<image>", "<bos>", "<eos>"]})
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, bos_token="<bos>",
                                        eos_token="<eos>", pad_token="<|endoftext|>")
    images = SiglipImageProcessorPil(size={"height": 28, "width": 28})
    images.image_seq_length = 4
    template = ("{% for message in messages %}{% for part in message['content'] %}{% if part['type'] == 'image' %}"
                "<image>{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endfor %}")
    processor = PaliGemmaProcessor(image_processor=images, tokenizer=tokenizer, chat_template=template)
    config = PaliGemmaConfig(
        text_config=dict(vocab_size=len(processor.tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14),
        projection_dim=32, hidden_size=32, image_token_index=processor.image_token_id,
        vocab_size=len(processor.tokenizer))
    return processor, PaliGemmaForConditionalGeneration._from_config(config).eval()


def paligemma_inputs(processor, record, directory):
    """What PaliGemma's processor makes of a conversation as it takes one for training: the prompt (the
    user turn) with the images and the answer as `suffix`; without an image (refused by the processor)
    its tokenizer's prompt/answer pair, the answer ending in EOS as the processor ends it."""
    turns = record["messages"]
    prompt = processor.apply_chat_template(turns[:1], tokenize=False, add_generation_prompt=True)
    answer = processor.apply_chat_template(turns, tokenize=False)[len(prompt):]
    images = images_of(record, directory)
    if images:
        return processor(text=[prompt], images=images, suffix=[answer], return_tensors="pt")
    return processor.tokenizer(text=[prompt], text_pair=[answer + processor.tokenizer.eos_token],
                               return_token_type_ids=True, add_special_tokens=False, return_tensors="pt")


TWO_TURNS = {"messages": [{"role": "user", "content": [image("images/2.png"), text("colour?")]},
                          {"role": "assistant", "content": [text("red")]},
                          {"role": "user", "content": [text("shape?")]},
                          {"role": "assistant", "content": [text("circle")]}]}


def test_paligemma_rows_are_its_processors_prefix_and_answer(tmp_path):
    """A prefix LM: token_type_ids as its processor gives them for prompt + answer (0: images and prompt,
    attended both ways; 1: the answer and after), labels on assistant text only, image tokens by id."""
    processor, _ = paligemma_processor_and_model()
    records = [*RECORDS, TWO_TURNS]
    rows, _ = rows_of(processor, write_records(tmp_path, records), tmp_path, packing=False)
    image_id, eos = processor.image_token_id, processor.tokenizer.eos_token
    for r, record in enumerate(records):
        row, theirs = rows.take([r]), paligemma_inputs(processor, record, tmp_path)
        n = theirs["input_ids"].shape[1]
        ids, types, labels = row["input_ids"][0], row["token_type_ids"][0], row["labels"][0]
        assert torch.equal(ids[:n], theirs["input_ids"][0]) and torch.equal(types[:n], theirs["token_type_ids"][0])
        assert (ids[:n] == image_id).sum() == 4 * len(images_of(record, tmp_path))  # each image its 4 tokens
        assert (labels[ids == image_id] == IGNORE).all() and (labels[types == 0] == IGNORE).all()
        answer = processor.tokenizer.decode(labels[labels != IGNORE], skip_special_tokens=False)
        if record is TWO_TURNS:  # the second question is no target, though after the prefix
            assert answer == "redcircle" + eos and (types[:n] == 1).sum() == len("redshape?circle") + 1
        else:  # one answer: the labels the processor gives (its answer tokens)
            assert answer == record["messages"][1]["content"][0]["text"] + eos
            assert torch.equal(labels[:n], torch.where(theirs["token_type_ids"][0] == 1, theirs["input_ids"][0], IGNORE))
    assert rows.take([0])["images"][0]["pixel_values"].shape == (1, 3, 28, 28)


def test_packed_rows_equal_the_documents_alone_paligemma(tmp_path):
    """transformers' PaliGemma mask ORs the prefix block into the causal mask and then ANDs the document
    mask of packed position ids: each document's prefix is its own bidirectional block."""
    torch.manual_seed(0)
    processor, model = paligemma_processor_and_model()
    with torch.no_grad():
        rows = check_packed_equals_alone(model, processor, tmp_path, records=[*RECORDS, TWO_TURNS],
                                         inputs_of=paligemma_inputs, seq_len=64)
        batch = rows.take(range(len(rows)))
        # the prefix mask matters: all zeros (the processor's answer-less output) attends both ways throughout
        causal = causal_lm_loss_sum(model, {**batch, "token_type_ids": torch.zeros_like(batch["token_type_ids"])}, 0)
        assert abs(float(causal) - float(causal_lm_loss_sum(model, batch, 0))) > 1e-3


def test_labels_are_the_assistant_text_only_never_image_tokens(tmp_path):
    processor = tiny_vlm_processor()
    path = write_records(tmp_path, RECORDS)
    rows, _ = rows_of(processor, path, tmp_path, packing=False)
    image_id = processor.image_token_id
    answers = []
    for r in range(len(rows)):
        row = rows.take([r])
        ids, labels = row["input_ids"][0], row["labels"][0]
        assert (ids == image_id).any() == bool(row["images"][0])  # the row's images are its documents'
        assert not (labels[ids == image_id] != IGNORE).any()
        answers.append(processor.tokenizer.decode(labels[labels != IGNORE]))
    assert answers == [f"{r['messages'][1]['content'][0]['text']}<|im_end|>\n" for r in RECORDS]
    grid = rows.take([2])["images"][0]["image_grid_thw"]
    assert grid.tolist() == [[1, 4, 4], [1, 4, 4]]


def test_truncation_keeps_whole_images(tmp_path):
    """An overlong conversation is cut before the first image it would split; the images before stay."""
    processor = tiny_vlm_processor()
    record = chat(image("images/0.png"), text("x" * 20), image("images/1.png"), text("y" * 20))
    path = write_records(tmp_path, [record, record])
    # <|im_start|> user\n <|vision_start|> 4 image tokens <|vision_end|> 20 x <|vision_start|>: the second image
    # starts at token 33, so 35 tokens would split it
    rows, info = rows_of(processor, path, tmp_path, seq_len=35, overlong="truncate", packing=False)
    row = rows.take([0])
    ids = row["input_ids"][0]
    assert info["truncated"] == 2 and (ids == processor.image_token_id).sum() == 4  # one whole image of 4 tokens
    assert (ids[33:] == processor.tokenizer.pad_token_id).all()  # cut at 33, the rest padding
    assert row["images"][0]["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert row["images"][0]["pixel_values"].shape[0] == 16


class FramesVideoProcessor:
    """Qwen2-VL's video processing of a clip of two equal frames (one temporal patch), without
    torchvision (which transformers' video processors need and this machine lacks): its image
    processor on the first frame, which fills a temporal patch with that frame twice."""

    merge_size = 2

    def __init__(self, images):
        self.images = images

    def __call__(self, videos, **kwargs):
        out = self.images([clip[0] for clip in videos], return_tensors="pt")
        return {"pixel_values_videos": out["pixel_values"], "video_grid_thw": out["image_grid_thw"]}


def video(*names):
    return {"type": "video", "video": list(names)}


def test_video_parts_are_read_as_frames_or_refused_in_one_line(tmp_path):
    """A video part is its decoded frames, given to the processor as `videos`: packed rows equal each
    document through plain transformers (video tokens never labelled, the clip's tensors and rope rows
    its own). A processor built without its video half (no torchvision) refuses a video in one line
    naming the record, even under `data.bad_images=drop`; so does a video given as a file."""
    from transformers import Qwen2VLForConditionalGeneration

    processor = tiny_vlm_processor()
    clip = video("images/0.png", "images/0.png")
    records = [chat(clip, text("What moves?"), answer="a red circle"), *RECORDS[:2],
               chat(image("images/1.png"), text("then"), clip, answer="both")]
    path = write_records(tmp_path / "refused", records)
    for bad_images in ("error", "drop"):
        with pytest.raises(ConfigError, match=r"data.jsonl:1 has a video, but this model's processor reads no "
                                              r"videos here \(its video processor needs torchvision"):
            rows_of(processor, path, tmp_path / "refused", bad_images=bad_images)
    as_file = write_records(tmp_path / "file", [chat({"type": "video", "video": "clip.mp4"})])
    with pytest.raises(ConfigError, match=r"data.jsonl:1 has a video part that is not a list of frame image paths"):
        rows_of(processor, as_file, tmp_path / "file")

    processor.video_processor = FramesVideoProcessor(processor.image_processor)
    torch.manual_seed(0)
    config = tiny_vlm_config(processor, 160)
    model = Qwen2VLForConditionalGeneration._from_config(config).eval()

    def inputs_of(processor, record, directory):
        from PIL import Image

        rendered = processor.apply_chat_template(record["messages"], tokenize=False)
        clips = [[Image.open(directory / f).convert("RGB") for f in p["video"]]
                 for t in record["messages"] for p in t["content"] if p["type"] == "video"]
        return processor(text=[rendered], images=images_of(record, directory) or None, videos=clips or None,
                         add_special_tokens=False, return_tensors="pt")

    with torch.no_grad():
        rows = check_packed_equals_alone(model, processor, tmp_path, RopeIndex.of(config), records=records,
                                         inputs_of=inputs_of)
    batch = rows.take(range(len(rows)))
    video_id = processor.video_token_id
    assert (batch["input_ids"] == video_id).sum() == 2 * 4  # two clips of one temporal patch, 2 x 2 merged
    assert not (batch["labels"][batch["input_ids"] == video_id] != IGNORE).any()
    grids = [g for b in batch["images"] if "video_grid_thw" in b for g in b["video_grid_thw"].tolist()]
    assert grids == [[1, 4, 4], [1, 4, 4]]


def test_bad_images_are_one_error_naming_record_and_file_or_dropped(tmp_path, caplog):
    processor = tiny_vlm_processor()
    missing = write_records(tmp_path, [RECORDS[0], chat(image("images/nowhere.png"))])
    with pytest.raises(ConfigError) as err:
        rows_of(processor, missing, tmp_path)
    assert f"{missing}:2" in str(err.value) and "nowhere.png" in str(err.value) and "\n" not in str(err.value)

    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "images").mkdir()
    (tmp_path / "broken" / "images" / "0.png").write_bytes(b"not a png")
    unreadable = write_records(tmp_path / "broken", [chat(image("images/0.png"))], images=0)
    with pytest.raises(ConfigError, match=r"data.jsonl:1 names image .*0.png, which cannot be read as an image"):
        rows_of(processor, unreadable, tmp_path / "broken")

    mismatch = write_records(tmp_path / "mismatch", [chat(image("images/0.png"), text("<|image_pad|> twice"))])
    with pytest.raises(ConfigError, match=r"data.jsonl:1 renders 2 image placeholder\(s\) .* for 1 image\(s\)"):
        rows_of(processor, mismatch, tmp_path / "mismatch")

    rows, info = rows_of(processor, write_records(tmp_path / "drop", [*RECORDS, chat(image("images/gone.png"))]),
                         tmp_path / "drop", bad_images="drop")
    assert info["broken"] == 1 and info["documents"] == len(RECORDS) and info["dropped"] == 0
    # the count said names every record of the file, the dropped one included
    import logging

    from fullshard.data.prepare import report_overlong
    from fullshard.log import logger
    from fullshard.train.config import DataSection

    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="fullshard"):
            report_overlong(info, DataSection(format="chat"), "data.jsonl")
    finally:
        logger.removeHandler(caplog.handler)
    assert f"data.jsonl: 1 of {len(RECORDS) + 1} conversations dropped for a missing" in caplog.text, caplog.text


def test_images_are_decoded_once_into_the_cache(tmp_path):
    processor = tiny_vlm_processor()
    write_caption_set(tmp_path, num_records=20)
    before = TOKENIZE_RUNS["count"]
    first, _ = rows_of(processor, tmp_path / "captions.jsonl", tmp_path)
    for png in (tmp_path / "images").glob("*.png"):
        png.unlink()  # the second run reads the cache, not the images
    second, _ = rows_of(processor, tmp_path / "captions.jsonl", tmp_path)
    assert TOKENIZE_RUNS["count"] == before + 1
    assert torch.equal(first.take([0])["images"][0]["pixel_values"], second.take([0])["images"][0]["pixel_values"])
    assert not [p for p in (tmp_path / "cache").iterdir() if ".tmp-" in p.name]


def test_a_model_directory_without_a_processor_is_one_line(tmp_path):
    config = tiny_vlm_config(tiny_vlm_processor(), 64)
    config.save_pretrained(tmp_path)
    with pytest.raises(ConfigError) as err:
        load_processor(str(tmp_path))
    assert str(tmp_path) in str(err.value) and "processor" in str(err.value) and "\n" not in str(err.value)
    tiny_vlm_processor().save_pretrained(tmp_path)  # the processor saved beside it: loads (without torchvision too)
    assert load_processor(str(tmp_path)).image_processor is not None
