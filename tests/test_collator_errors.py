"""Bad input gets a clear ValueError naming the sample and the fix (or, for over-long samples, a counted drop)."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from vlm_pack.data.collator import VLMPackingCollator
from vlm_pack.testing.data import sample_photos
from vlm_pack.core.rope_index import MRopeIndex
from vlm_pack.testing.tiny_models import qwen_tokenizer, tiny_config


# ``processor``, ``qwen2_config`` and ``collator`` come from conftest.py.


@pytest.fixture(scope="module")
def photo():
    return sample_photos(56)["astronaut"]


def chat(question, answer="Fine.", images=None):
    example = {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}
    if images is not None:
        example["images"] = images
    return example


def good(photo):
    return chat([{"type": "image", "image": photo}, {"type": "text", "text": "Who?"}])


def test_more_placeholders_than_images(collator, photo):
    with pytest.raises(ValueError, match=r"sample 1: 2 image placeholders but 1 images"):
        collator([good(photo), chat("<image> and <image>?", images=[photo])])


def test_more_images_than_placeholders(collator, photo):
    with pytest.raises(ValueError, match=r"sample 2: 1 image placeholders but 2 images"):
        two_images_one_slot = chat([{"type": "image"}, {"type": "text", "text": "x"}], images=[photo, photo])
        collator([good(photo), good(photo), two_images_one_slot])


def test_placeholder_token_typed_in_text(collator, photo):
    with pytest.raises(ValueError, match=r"sample 1, turn 0: text contains the reserved placeholder '<\|image_pad\|>'"):
        collator([good(photo), chat("look: <|image_pad|>")])


@pytest.mark.parametrize(
    ("payload", "detail"),
    [
        (b"definitely not a png", "UnidentifiedImageError"),
        ("/no/such/image.png", "FileNotFoundError"),
        (3.5, "TypeError"),
    ],
)
def test_unreadable_image(collator, photo, payload, detail):
    bad = chat([{"type": "image", "image": payload}, {"type": "text", "text": "?"}])
    with pytest.raises(ValueError, match=rf"sample 1, turn 0: image could not be read \({detail}"):
        collator([good(photo), bad])


def test_overlong_sample_is_an_error_by_default(processor, qwen2_config, photo):
    collator = VLMPackingCollator(processor, max_length=40, model_config=qwen2_config)
    long = chat([{"type": "image", "image": photo}, {"type": "text", "text": "word " * 60}])
    with pytest.raises(ValueError, match=r"sample 1 has \d+ tokens \(images expanded\) > max_length=40"):
        collator([good(photo), long])


def test_overlong_sample_can_be_dropped_with_a_counted_warning(processor, qwen2_config, photo):
    collator = VLMPackingCollator(processor, max_length=40, model_config=qwen2_config, on_overlong="drop")
    big = sample_photos(112)["rocket"]
    long = chat([{"type": "image", "image": big}, {"type": "text", "text": "word " * 60}])
    kept = collator([good(photo)])
    with pytest.warns(UserWarning, match=r"dropped 1 of 3 samples longer than max_length=40 \(indices \[1\]\)"):
        batch = collator([good(photo), long, good(photo)])
    stats = batch["vlm_pack"]["stats"]
    assert stats.samples == 2 and stats.samples_dropped == 1
    # the dropped sample's image went with it: pixels and grids are those of the two kept samples only
    assert torch.equal(batch["pixel_values"], torch.cat([kept["pixel_values"]] * 2))
    assert torch.equal(batch["image_grid_thw"], torch.cat([kept["image_grid_thw"]] * 2))
    assert batch["input_ids"].shape[1] == 2 * kept["input_ids"].shape[1]


def test_all_samples_overlong(processor, qwen2_config, photo):
    collator = VLMPackingCollator(processor, max_length=8, model_config=qwen2_config, on_overlong="drop")
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="2 of 2 exceed max_length=8"):
        collator([good(photo), good(photo)])


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "Hello?"}],
        [{"role": "user", "content": "Hello?"}, {"role": "assistant", "content": "   "}],
        [{"role": "user", "content": "Hello?"}, {"role": "assistant", "content": []}],
    ],
)
def test_no_assistant_turn(collator, photo, messages):
    with pytest.raises(ValueError, match=r"sample 1: no assistant turn with content"):
        collator([good(photo), {"messages": messages}])


def test_empty_batch(collator):
    with pytest.raises(ValueError, match="empty batch"):
        collator([])


@pytest.mark.parametrize(
    ("example", "message"),
    [
        ({"text": "no messages"}, r"sample 0: expected \{'messages'"),
        ({"messages": [{"role": "user"}]}, r"sample 0, turn 0: each turn needs 'role' and 'content'"),
        ({"messages": [{"role": "user", "content": 7}]}, r"sample 0, turn 0: content must be a string or a list"),
        ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, r"sample 0, turn 0: unsupported content"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]}, r"needs a string 'text'"),
    ],
)
def test_malformed_examples(collator, example, message):
    with pytest.raises(ValueError, match=message):
        collator([example])


def test_mrope_processor_needs_model_config(processor):
    with pytest.raises(ValueError, match="pass model_config=model.config"):
        VLMPackingCollator(processor, max_length=512)


def test_image_given_to_a_text_tokenizer_collator(photo):
    collator = VLMPackingCollator(qwen_tokenizer(), max_length=512)
    with pytest.raises(ValueError, match="sample 0, turn 0: has an image but the collator was built with a text"):
        collator([good(photo)])


def test_processor_and_model_config_must_agree(processor):
    config = tiny_config("qwen2_vl")
    config.vision_config.spatial_merge_size = 4
    with pytest.raises(ValueError, match="merge_size=2 but model_config.vision_config.spatial_merge_size=4"):
        VLMPackingCollator(processor, max_length=512, model_config=config)


def test_text_config_instead_of_model_config(processor):
    with pytest.raises(ValueError, match="model_type 'qwen2_vl_text'.*not its text_config"):
        VLMPackingCollator(processor, max_length=512, model_config=tiny_config("qwen2_vl").text_config)
    with pytest.raises(ValueError, match="no vision_config"):
        MRopeIndex(tiny_config("llama"), "Qwen2VLModel")


def test_invalid_arguments(processor, qwen2_config):
    with pytest.raises(ValueError, match="on_overlong must be 'error' or 'drop'"):
        VLMPackingCollator(processor, max_length=512, model_config=qwen2_config, on_overlong="truncate")
    with pytest.raises(ValueError, match="max_length must be >= 1"):
        VLMPackingCollator(processor, max_length=0, model_config=qwen2_config)
    with pytest.raises(ValueError, match=r"cannot locate the assistant turns of the chat_template passed in.*does "
                                         r"not write an assistant message's text.*\{% generation %\}"):
        VLMPackingCollator(
            processor, max_length=512, model_config=qwen2_config,
            chat_template="{% for m in messages if m.role != 'assistant' %}{{ m.content }}{% endfor %}"
                          "{% if add_generation_prompt %}<|im_start|>assistant{% endif %}",
        )
    with pytest.raises(ValueError, match="context_parallel_size=0"):
        VLMPackingCollator(processor, max_length=512, model_config=qwen2_config, context_parallel_size=0)


def test_processor_rejection_names_the_sample(collator, photo):
    sliver = Image.new("RGB", (600, 2))  # aspect ratio 300: Qwen2-VL's resize refuses it
    with pytest.raises(ValueError, match="sample 1: the processor rejected it: absolute aspect ratio"):
        collator([good(photo), chat([{"type": "image", "image": sliver}])])


def test_template_without_assistant_markers_on_a_non_chatml_tokenizer():
    vocab = {"[UNK]": 0, "[PAD]": 1, "hello": 2}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")), unk_token="[UNK]", pad_token="[PAD]"
    )
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="chat template of TokenizersBackend for label masking: add_generation_prompt=True adds "
                                         "no assistant prompt"):
        VLMPackingCollator(tokenizer, max_length=512)
