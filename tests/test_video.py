"""Video for the Qwen-VL families: a packed row mixing video, image and text-only samples equals each sample
run ALONE through the stock sdpa model (logits, plain HF shifted cross entropy, gradients).

Frames: scikit-image photos panned over time (a real moving picture, several sizes and frame counts).
Processor: the offline Qwen2-VL processor (real Qwen tokenizer, Qwen2-VL image/video processors); for
Qwen2.5-VL the same parts inside a ``Qwen2_5_VLProcessor``, which adds ``second_per_grid_ts``. Qwen3-VL and
Qwen3-VL-MoE: the offline ``Qwen3VLProcessor`` (``Qwen3VLVideoProcessor``), which writes each temporal patch of a
video as its own run of video tokens after its timestamp text (``<0.1 seconds>``); the model's ``get_rope_index``
splits ``video_grid_thw`` per frame to match, and the collator checks every video sample against that layout.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers

from vlm_pack.core.batch import packing_metadata
from vlm_pack.core.versions import has
from vlm_pack.data.chat import CHATML_TEMPLATE
from vlm_pack.data.collator import VLMPackingCollator, model_inputs
from vlm_pack.testing.data import photo_examples, sample_photos, text_chat_examples
from vlm_pack.integrations.hf_model import enable_packing
from vlm_pack.testing.tiny_families import tiny_vlm
from vlm_pack.testing.tiny_models import offline_qwen2vl_processor, offline_qwen3vl_processor, tiny_model

from tolerance import NoiseFloor, assert_grads_close, fp64_copy, fp64_inputs, max_abs


def clip(name: str, frames: int, side: int) -> np.ndarray:
    """``frames`` crops of a photo sliding to the right: T x side x side x 3 uint8."""
    photo = np.asarray(sample_photos(max_side=side + 4 * frames)[name])
    return np.stack([photo[:side, 4 * t:4 * t + side] for t in range(frames)])


def video_example(name: str, frames: int, side: int, with_image: bool = False) -> dict:
    content = [{"type": "video", "video": clip(name, frames, side)}, {"type": "text", "text": "What moves?"}]
    if with_image:
        content.insert(1, {"type": "image", "image": sample_photos(56)["coffee"]})
    return {"messages": [{"role": "user", "content": content},
                         {"role": "assistant", "content": "The view pans to the right."}]}


def examples() -> list[dict]:
    return [video_example("chelsea", 4, 56), photo_examples(1, seed=2, max_side=84)[0],
            text_chat_examples(1, seed=2)[0], video_example("rocket", 6, 84, with_image=True)]


# Before transformers 5.23 the collator carries the assistant mask through the expansion itself, which Qwen3-VL's
# timestamps between a video's frames do not allow: refused, naming the release (vlm_pack.core.versions.GAPS).
BEFORE_MASK_SHIFT = r"image runs for \d+ runs of image placeholders.*pip install -U 'transformers>=5\.23'"
QWEN3 = ("qwen3_vl", "qwen3_vl_moe")  # timestamps in the text, one run of video tokens per frame
pytestmark = pytest.mark.usefixtures("one_thread")


def processor_for(family: str):
    if family in QWEN3:
        return offline_qwen3vl_processor()
    processor = offline_qwen2vl_processor()
    if family == "qwen2_5_vl":
        return transformers.Qwen2_5_VLProcessor(image_processor=processor.image_processor,
                                                tokenizer=processor.tokenizer,
                                                video_processor=processor.video_processor,
                                                chat_template=CHATML_TEMPLATE)
    return processor


def model_for(family: str, processor, **options) -> torch.nn.Module:
    if family == "qwen3_vl_moe":
        return tiny_vlm(family, processor, layers=1, **options)
    return tiny_model(family, layers=1, **options)


def alone_loss_sum(model, collator, example, fp64: bool = False) -> tuple[torch.Tensor, torch.Tensor, int]:
    single = collator([example])
    inputs = fp64_inputs(model_inputs(single)) if fp64 else model_inputs(single)
    logits = model(**inputs, use_cache=False).logits[0]
    labels = single["labels"][0]
    return logits, F.cross_entropy(logits[:-1], labels[1:], ignore_index=-100, reduction="sum"), \
        int((labels[1:] != -100).sum())


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", *QWEN3])
def test_video_packed_equals_each_sample_alone(family):
    processor = processor_for(family)
    stock = model_for(family, processor, attn_implementation="sdpa")
    packed_model = enable_packing(model_for(family, processor, attn_implementation="sdpa"))
    packer = VLMPackingCollator(processor, max_length=1024, model_config=packed_model.config)
    alone = VLMPackingCollator(processor, max_length=1024, model_config=stock.config, pack_sequences_in_batch=False)
    batch_examples = examples()
    if family in QWEN3 and not has("processor_mask_shift"):
        with pytest.raises(ValueError, match=BEFORE_MASK_SHIFT):  # timestamps between frames: mask not carried
            packer(batch_examples)
        return
    batch = packer(batch_examples)
    assert batch["video_grid_thw"].shape[0] == 2 and (batch["mm_token_type_ids"] == 2).any()
    if family == "qwen2_5_vl":
        assert batch["second_per_grid_ts"].shape == (2,)
    if family in QWEN3:
        assert_timestamps_and_positions_per_sample(processor, stock, batch, alone, batch_examples)

    logits = packed_model(**model_inputs(batch), use_cache=False).logits[0]
    labels, starts = batch["labels"][0], batch["cu_seq_lens_q"][:-1].tolist()
    stock64, logit_floor, loss_floor = fp64_copy(stock), NoiseFloor("logits"), NoiseFloor("mean loss per sample")
    total, reference_total, tokens = 0.0, 0.0, 0
    for start, length, example in zip(starts, packing_metadata(batch)["seq_lengths"].tolist(), batch_examples):
        ref_logits, ref_sum, count = alone_loss_sum(stock, alone, example)
        with torch.no_grad():
            logits64, sum64, _ = alone_loss_sum(stock64, alone, example, fp64=True)
        logit_floor.observe(ref_logits, logits64)
        loss_floor.observe(ref_sum / max(count, 1), sum64 / max(count, 1))
        mine = logits[start:start + length]
        logit_floor.check(max_abs(mine, ref_logits), f"sample at {start}")
        mine_sum = F.cross_entropy(mine[:-1], labels[start + 1:start + length], ignore_index=-100, reduction="sum")
        loss_floor.check(abs(mine_sum.item() - ref_sum.item()) / max(count, 1), f"sample at {start}")
        total, reference_total, tokens = total + mine_sum, reference_total + ref_sum, tokens + count
    (total / tokens).backward()
    (reference_total / tokens).backward()
    reference_grads = {name: p.grad for name, p in stock.named_parameters() if p.grad is not None}
    assert_grads_close({name: p.grad for name, p in packed_model.named_parameters() if p.grad is not None},
                       reference_grads)


def assert_timestamps_and_positions_per_sample(processor, stock, batch, alone, examples) -> None:
    """Qwen3-VL layout in the packed row: each video sample holds one ``<t seconds>`` timestamp per temporal patch,
    each followed by that frame's run of video tokens, and no label anywhere in that span; every sample's mRoPE
    positions (temporal / height / width rows) are those the stock model's own ``get_rope_index`` gives the sample
    alone, and its text row restarts at 0."""
    tokenizer = processor.tokenizer
    frames = iter(batch["video_grid_thw"][:, 0].tolist())
    starts, ends = batch["cu_seq_lens_q"][:-1].tolist(), batch["cu_seq_lens_q"][1:].tolist()
    for start, end, example in zip(starts, ends, examples):
        ids, labels = batch["input_ids"][0, start:end], batch["labels"][0, start:end]
        videos = sum(p["type"] == "video" for m in example["messages"] if isinstance(m["content"], list)
                     for p in m["content"])
        stamped = re.findall(r"<(\d+\.\d) seconds><\|vision_start\|>(?:<\|video_pad\|>)+<\|vision_end\|>",
                             tokenizer.decode(ids))
        assert len(stamped) == sum(next(frames) for _ in range(videos)), tokenizer.decode(ids)
        assert stamped == sorted(stamped, key=float) and (not stamped or stamped[0] == "0.0")
        video = (ids == processor.video_token_id).nonzero().flatten()
        if videos:
            assert (labels[int(video[0]) - 8:int(video[-1]) + 2] == -100).all()  # timestamps, markers, frames
        single = alone([example])
        mrope, _ = stock.model.get_rope_index(
            single["input_ids"], mm_token_type_ids=single["mm_token_type_ids"],
            image_grid_thw=single.get("image_grid_thw"), video_grid_thw=single.get("video_grid_thw"))
        assert torch.equal(batch["position_ids"][1:, :, start:end], mrope), f"sample at {start}"
        assert torch.equal(batch["position_ids"][0, 0, start:end], torch.arange(end - start))


def test_video_tensors_attributed_to_the_wrong_sample_break_exactness():
    """Corruption: the two videos' grids swapped between samples -> the packed forward no longer matches."""
    processor = processor_for("qwen2_vl")
    stock = tiny_model("qwen2_vl", attn_implementation="sdpa", layers=1)
    packed_model = enable_packing(tiny_model("qwen2_vl", attn_implementation="sdpa", layers=1))
    packer = VLMPackingCollator(processor, max_length=1024, model_config=packed_model.config)
    alone = VLMPackingCollator(processor, max_length=1024, model_config=stock.config, pack_sequences_in_batch=False)
    pair = [video_example("chelsea", 4, 56), video_example("astronaut", 2, 84)]
    batch = packer(pair)
    first, second = batch["video_grid_thw"].prod(-1).tolist()
    pixels = batch["pixel_values_videos"]
    batch["pixel_values_videos"] = torch.cat([pixels[first:], pixels[:first]])  # videos' patches swapped
    batch["video_grid_thw"] = batch["video_grid_thw"].flip(0)
    try:
        logits = packed_model(**model_inputs(batch), use_cache=False).logits[0]
    except (RuntimeError, ValueError):
        return  # the model refuses the mismatched grids outright: also a detected corruption
    ref_logits = alone_loss_sum(stock, alone, pair[0])[0]
    assert (logits[: ref_logits.shape[0]] - ref_logits).abs().max() > 1e-3


def test_video_tokens_never_get_labels_and_files_are_refused():
    processor = processor_for("qwen2_vl")
    packer = VLMPackingCollator(processor, max_length=1024, model_config=tiny_model("qwen2_vl", layers=1).config)
    batch = packer([video_example("chelsea", 4, 56)])
    video_slots = batch["mm_token_type_ids"] == 2
    assert video_slots.sum() == batch["video_grid_thw"].prod(-1).sum() // 4
    assert (batch["labels"][video_slots] == -100).all()
    bad = video_example("chelsea", 4, 56)
    bad["messages"][0]["content"][0] = {"type": "video", "video": "clip.mp4"}
    with pytest.raises(ValueError, match="sample 0, turn 0: video given as a file.*pass its decoded frames"):
        packer([bad])


def test_video_refused_for_a_family_without_video_proof():
    processor = processor_for("qwen2_vl")
    packer = VLMPackingCollator(processor, max_length=1024, model_config=tiny_model("qwen3_5", layers=1).config)
    with pytest.raises(ValueError, match="sample 0: a video with a qwen3_5 model: video inputs .* not proven"):
        packer([video_example("chelsea", 4, 56)])


@pytest.fixture(scope="module")
def qwen3():
    """Qwen3-VL processor, stock model, packed model (same weights) and the fp64 stock model."""
    processor = processor_for("qwen3_vl")
    stock = model_for("qwen3_vl", processor)
    return processor, stock, enable_packing(model_for("qwen3_vl", processor)), fp64_copy(stock)


def corrupted_distance(qwen3, pair: list[dict], corrupt) -> tuple[float, NoiseFloor]:
    """Max |logit| distance between the second sample of a corrupted packed ``pair`` and that sample alone, and the
    fp32 noise floor of the stock model on it."""
    processor, stock, packed_model, stock64 = qwen3
    batch = VLMPackingCollator(processor, max_length=1024, model_config=packed_model.config)(pair)
    corrupt(batch)
    alone = VLMPackingCollator(processor, max_length=1024, model_config=stock.config, pack_sequences_in_batch=False)
    floor = NoiseFloor("logits")
    with torch.no_grad():
        reference = alone_loss_sum(stock, alone, pair[1])[0]
        floor.observe(reference, alone_loss_sum(stock64, alone, pair[1], fp64=True)[0])
        start = int(batch["cu_seq_lens_q"][1])
        logits = packed_model(**model_inputs(batch), use_cache=False).logits[0, start:start + reference.shape[0]]
    return max_abs(logits, reference), floor


@pytest.mark.skipif(not has("processor_mask_shift"), reason="transformers < 5.23: Qwen3-VL videos are refused "
                    "(test_video_packed_equals_each_sample_alone checks it)")
def test_qwen3_vl_video_corruptions_break_exactness(qwen3):
    """Each rule of the proof, broken on its own, moves the second sample's logits far outside the fp32 noise:
    its video patches taken from the other sample (two clips of the same shape, so nothing refuses the swap), and
    its frames' temporal positions collapsed onto the first frame's (the time axis the timestamps order)."""
    pair = [video_example("chelsea", 4, 56), video_example("astronaut", 4, 56)]

    def swap_videos(batch):
        pixels, half = batch["pixel_values_videos"], batch["pixel_values_videos"].shape[0] // 2
        batch["pixel_values_videos"] = torch.cat([pixels[half:], pixels[:half]])

    def collapse_time(batch):
        video = (batch["mm_token_type_ids"][0] == 2).nonzero().flatten()
        second = video[video >= int(batch["cu_seq_lens_q"][1])]
        positions = batch["position_ids"] = batch["position_ids"].clone()
        positions[1, 0, second] = int(positions[1, 0, second[0]])

    for corrupt in (swap_videos, collapse_time):
        distance, floor = corrupted_distance(qwen3, pair, corrupt)
        assert floor.is_far(distance), f"{corrupt.__name__}: {distance:.3g} within 10 x {floor.tolerance:.3g}"
    distance, floor = corrupted_distance(qwen3, pair, lambda batch: None)  # uncorrupted: within the noise
    floor.check(distance)


def test_video_layout_of_another_family_is_refused(qwen3):
    """Timestamps: a processor that writes no timestamps (Qwen2-VL's one run per video) for a Qwen3-VL model, or
    Qwen3-VL's per-frame runs for a Qwen2-VL model, would misplace every frame's positions: refused, naming it."""
    processor, stock, _, _ = qwen3
    clip = [video_example("chelsea", 4, 56)]
    packer = VLMPackingCollator(processor_for("qwen2_vl"), max_length=1024, model_config=stock.config)
    with pytest.raises(ValueError, match=r"sample 0: its video tokens form runs of \[8\] tokens, but the qwen3_vl "
                                         r"model's rope index expects one run per frame, each after its timestamp"):
        packer(clip)
    packer = VLMPackingCollator(processor, max_length=1024, model_config=tiny_model("qwen2_vl", layers=1).config)
    layout = (r"runs of \[4, 4\] tokens, but the qwen2_vl model's rope index expects one run per video "
              r"\(\[8\]\).*Qwen3VLProcessor")
    with pytest.raises(ValueError, match=layout if has("processor_mask_shift") else BEFORE_MASK_SHIFT):
        packer(clip)


def test_token_budget_planning_refuses_qwen3_vl_video(qwen3):
    """Token-budget plans count a video from its size; Qwen3-VL's timestamps make that count wrong: refused early."""
    from vlm_pack.budget.lengths import measure_lengths

    processor, stock, _, _ = qwen3
    collator = VLMPackingCollator(processor, max_length=1024, model_config=stock.config)
    with pytest.raises(ValueError, match="sample 0: token-budget planning cannot count a qwen3_vl video"):
        measure_lengths([video_example("chelsea", 4, 56)], collator, progress=False)
    assert measure_lengths(examples()[1:3], collator, progress=False).tokens.tolist() == [
        collator([e])["input_ids"].shape[1] for e in examples()[1:3]]  # images and text still plan exactly
