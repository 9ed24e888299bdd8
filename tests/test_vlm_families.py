"""More VLM families exact under packing: a packed micro-batch through ``enable_packing`` + ``VLMPackingCollator``
equals each sample run ALONE through the stock model (``attn_implementation="sdpa"``, fp32 CPU).

Per family: logits and per-sample losses (plain shifted cross entropy on that sample alone) within the measured fp32
noise floor, parameter gradients of the summed per-sample losses within 1e-4 relative L2 (``tests/tolerance.py``); one corruption per family rule
must break the comparison; unsupported variants are refused. The families registered later (EDGE_FAMILIES) are
proven on edge_examples(): system prompts, a one-word answer, an image inside an assistant turn, text-only and
multi-image samples, with context-parallel alignment slots where the family allows them. Mixture-of-experts
families: routing is per token (covered by the logits); the router's auxiliary loss is proven against the padded
micro-batch in tests/test_router_loss.py.

Substituted (no hub here): each processor is assembled from the real Qwen tokenizer files plus the family's
image tokens, the family's own image-processor class built with tiny crop sizes, and a ChatML template (see
``vlm_pack/testing/families/`` per family). Models are tiny random ones built from config objects.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import GPT2Config

from vlm_pack.core.batch import packing_metadata
from vlm_pack.data.collator import VLMPackingCollator, model_inputs
from vlm_pack.testing.data import easy_vqa_examples, photo_examples, text_chat_examples
from vlm_pack.integrations.hf_model import enable_packing
from vlm_pack.models import UnsupportedModelError, get_family, path_refusal
from vlm_pack.testing.tiny_families import tiny_vlm, tiny_vlm_processor
from vlm_pack.testing.tiny_models import qwen_tokenizer, tiny_config

from tolerance import GRAD_REL_L2, NoiseFloor, fp64_copy, fp64_inputs, grad_errors
from version_gates import require_proven

MEASURED: dict[str, dict[str, float]] = {}  # family -> measured max errors (printed with -s; recorded in the notes)


pytestmark = pytest.mark.usefixtures("one_thread")


@dataclasses.dataclass
class Setup:
    family: str
    processor: object
    stock: torch.nn.Module  # the reference: stock transformers, sdpa, each sample alone
    packed: torch.nn.Module  # same weights, after enable_packing
    collator: VLMPackingCollator
    stock64: torch.nn.Module | None = None  # the stock model in fp64, made on first use: the fp32 noise floor

    def exact(self) -> torch.nn.Module:
        if self.stock64 is None:
            self.stock64 = fp64_copy(self.stock)
        return self.stock64


_SETUPS: dict[str, Setup] = {}


def setup_for(family: str) -> Setup:
    require_proven(family)
    if family not in _SETUPS:
        processor = tiny_vlm_processor(family)
        stock = tiny_vlm(family, processor, attn_implementation="sdpa")
        packed = enable_packing(tiny_vlm(family, processor, attn_implementation="sdpa"))
        collator = VLMPackingCollator(processor, max_length=2048, model_config=packed.config)
        _SETUPS[family] = Setup(family, processor, stock, packed, collator)
    return _SETUPS[family]


def mixed_examples(n: int, seed: int) -> list[dict]:
    """Photos (1-3 per sample, 56-84 px: different token counts), an easy-vqa image and a text-only chat."""
    examples = photo_examples(max(1, n - 2), seed=seed, max_side=56) + easy_vqa_examples(1, seed=seed)
    if n >= 3:
        examples.insert(1, text_chat_examples(1, seed=seed, max_turns=2)[0])
    return examples[:n]


def alone(setup: Setup, example: dict) -> tuple[dict, torch.Tensor]:
    """The sample as the processor encodes it ALONE (an unpacked batch of one, no padding) and its labels."""
    single = VLMPackingCollator(
        setup.processor, max_length=2048, pack_sequences_in_batch=False, model_config=setup.stock.config
    )([example])
    inputs = {k: v for k, v in model_inputs(single).items() if k != "attention_mask"}
    return inputs, single["labels"][0]


def shifted_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Plain HF causal-LM loss of ONE sample: mean cross entropy of logits[:-1] against labels[1:]."""
    return F.cross_entropy(logits[:-1], labels[1:], ignore_index=-100)


def text_rows(model, samples, **overrides):
    """Packed logits of ``samples`` (one row, boundaries passed) split per sample."""
    from vlm_pack import pack_batch_sequences

    width = max(len(s) for s in samples)
    padded = torch.zeros(len(samples), width, dtype=torch.long)
    mask = torch.zeros_like(padded)
    for row, sample in enumerate(samples):
        padded[row, :len(sample)], mask[row, :len(sample)] = sample, 1
    packed = pack_batch_sequences(padded, padding_mask=mask, pad_to_multiple_of=2)
    inputs = {"input_ids": packed.tokens, "position_ids": packed.position_ids, **packed.attention_kwargs(),
              **overrides}
    logits = model(**inputs, use_cache=False).logits[0]
    return [logits[start:start + len(s)] for start, s in zip(packed.cu_seqlens_padded.tolist(), samples)]


def packed_logits(model, batch: dict, **overrides) -> torch.Tensor:
    """Logits ``[T, V]`` of the packed row (``overrides`` replace forward arguments)."""
    return model(**{**model_inputs(batch), **overrides}, use_cache=False).logits.squeeze(0)


def references(setup: Setup, examples: list[dict]) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int],
                                                            SimpleNamespace]:
    """Each sample ALONE through the stock sdpa model: logits (detached), plain shifted cross entropy (graph
    kept), its number of targets, and the fp32 noise floors of logits and losses (the same samples through the
    stock model in fp64)."""
    logits, losses, targets = [], [], []
    floors = SimpleNamespace(logits=NoiseFloor("logits"), loss=NoiseFloor("per-sample loss"))
    for example in examples:
        inputs, labels = alone(setup, example)
        sample_logits = setup.stock(**inputs, use_cache=False).logits.squeeze(0)
        with torch.no_grad():
            logits64 = setup.exact()(**fp64_inputs(inputs), use_cache=False).logits.squeeze(0)
        logits.append(sample_logits.detach())
        losses.append(shifted_ce(sample_logits, labels))
        targets.append(int((labels[1:] != -100).sum()))
        floors.logits.observe(logits[-1], logits64)
        floors.loss.observe(losses[-1], shifted_ce(logits64, labels))
    return logits, losses, targets, floors


def logit_error(batch: dict, logits: torch.Tensor, refs) -> float:
    """Max |dlogit| of the packed row's samples against the per-sample reference logits."""
    meta = packing_metadata(batch)
    spans = zip(meta["cu_seqlens_padded"][:-1].tolist(), meta["seq_lengths"].tolist())
    return max((logits[s : s + n].detach() - ref).abs_().max().item() for (s, n), ref in zip(spans, refs[0]))


def errors(batch: dict, logits: torch.Tensor, refs) -> dict:
    """Max |dlogit| and max |dloss| of the packed row's samples against the per-sample references. The packed
    per-sample losses are the same plain shifted cross entropy, each sample's targets shifted inside it (one
    cross entropy over the row: slicing the logits per sample would make autograd fill T x V zeros per sample)."""
    meta = packing_metadata(batch)
    spans = list(zip(meta["cu_seqlens_padded"][:-1].tolist(), meta["seq_lengths"].tolist()))
    labels = batch["labels"][0]
    targets = torch.full_like(labels, -100)
    for start, length in spans:
        targets[start : start + length - 1] = labels[start + 1 : start + length]
    token_losses = F.cross_entropy(logits, targets, ignore_index=-100, reduction="none")
    losses = [token_losses[s : s + n].sum() / (targets[s : s + n] != -100).sum() for s, n in spans]
    return {
        "logit": logit_error(batch, logits, refs),
        "loss": max((loss.detach() - ref.detach()).abs().item() for loss, ref in zip(losses, refs[1])),
        "_losses": losses,
        "floors": refs[3],
    }


def compare(setup: Setup, examples: list[dict]) -> dict[str, float]:
    """Packed vs alone: max |dlogit|, max |dloss| per sample, |dloss| of the model's OWN loss on the batch vs
    the per-sample token mean, and the largest relative L2 gradient error of the summed per-sample losses."""
    batch = setup.collator(examples)
    assert "attention_mask" not in batch
    for model in (setup.stock, setup.packed):
        model.zero_grad()
    refs = references(setup, examples)
    output = setup.packed(**batch, use_cache=False)  # as Trainer calls it: labels and the metadata entry included
    result = errors(batch, output.logits.squeeze(0), refs)
    token_mean = sum(loss.detach() * n for loss, n in zip(refs[1], refs[2])) / sum(refs[2])
    result["own_loss"] = (output.loss.detach() - token_mean).abs().item()
    sum(refs[1]).backward()
    sum(result.pop("_losses")).backward()
    wanted = {name: p.grad for name, p in setup.stock.named_parameters() if p.grad is not None}
    assert all(p.grad is None or not p.grad.any() for name, p in setup.packed.named_parameters() if name not in wanted)
    result["grad_rel"] = max(grad_errors({name: p.grad for name, p in setup.packed.named_parameters()
                                          if name in wanted}, wanted).values())
    return result


def assert_exact(result: dict) -> None:
    """Logits and losses within the measured fp32 noise floor, gradients within GRAD_REL_L2 (tests/tolerance.py)."""
    floors = result["floors"]
    floors.logits.check(result["logit"], str(result))
    floors.loss.check(result["loss"], str(result))
    floors.loss.check(result.get("own_loss", 0.0), f"the model's own loss: {result}")
    assert result.get("grad_rel", 0.0) < GRAD_REL_L2, result


def exact_batch(setup: Setup, examples: list[dict]) -> tuple[dict, tuple]:
    """The packed batch of ``examples`` and each sample's references, the clean packed logits asserted exact: the
    comparison a corruption must then break."""
    refs = references(setup, examples)
    batch = setup.collator(examples)
    assert_exact(errors(batch, packed_logits(setup.packed, batch), refs))
    return batch, refs


def assert_packed_exact(setup: Setup, examples: list[dict], label: object = "edge") -> dict:
    """``examples`` packed against each sample alone (compare), printed with ``label`` (shown with -s) and asserted
    exact; the result."""
    result = compare(setup, examples)
    print(setup.family, label, result)
    assert_exact(result)
    return result


# ------------------------------------------------------------------ exactness, every family


# Together the families cover micro-batches 2..6 (with gradients); batches of 3+ mix image sizes, multi-image and
# text-only samples, and test_corruptions_are_caught checks such a 4-sample batch exact for every family.
EXACT_CASES = [
    ("llava_onevision", 4, 3), ("mistral3", 2, 1), ("internvl", 6, 2),
    ("idefics3", 3, 4), ("smolvlm", 5, 5), ("glm4v", 4, 6),
]
# Families registered later are proven on edge_examples() (a superset of the mixed batch) instead.
EDGE_FAMILIES = ["qwen3_vl_moe", "llava", "llava_next", "llava_next_video", "glm4v_moe", "qwen3_5_moe",
                 "aya_vision", "glm46v", "vipllava", "cohere2_vision", "video_llava", "deepseek_vl",
                 "deepseek_vl_hybrid", "lighton_ocr", "glm_ocr", "idefics2"]
FAMILIES = [family for family, _, _ in EXACT_CASES] + EDGE_FAMILIES
# Composite families whose language model is a separate registered text family (the others bring their own).
TEXT_BACKBONE_FAMILIES = [f for f in FAMILIES if f not in ("glm4v", "glm4v_moe", "glm46v", "glm_ocr", "qwen3_vl_moe",
                                                             "qwen3_5_moe")]


@pytest.mark.parametrize(("family", "micro_batch", "seed"), EXACT_CASES)
def test_packed_family_equals_each_sample_alone(family, micro_batch, seed):
    result = assert_packed_exact(setup_for(family), mixed_examples(micro_batch, seed), micro_batch)
    MEASURED.setdefault(family, {}).update({f"mb{micro_batch}_{k}": v for k, v in result.items()})


@pytest.mark.parametrize("family", [family for family, _, _ in EXACT_CASES])
def test_context_parallel_alignment_equals_each_sample_alone(family):
    """The mixed batch with each sample padded to a multiple of 4 (``context_parallel_size=2``): alignment slots
    between the samples change nothing (logits, losses, the model's own loss, gradients)."""
    setup = setup_for(family)
    collator = VLMPackingCollator(setup.processor, max_length=2048, model_config=setup.packed.config,
                                  context_parallel_size=2)
    setup = dataclasses.replace(setup, collator=collator)
    examples = mixed_examples(4, seed=8)
    meta = packing_metadata(collator(examples))
    assert not torch.equal(meta["cu_seqlens"], meta["cu_seqlens_padded"])  # alignment slots present
    assert_exact(compare(setup, examples))


def edge_examples() -> list[dict]:
    """What a real SFT micro-batch holds besides plain photo Q&A: a system prompt with a one-word answer, an image
    inside an assistant turn (multi-turn), a text-only chat with a system prompt, and a sample with images of two
    different sizes (so the samples' image-token counts and crop counts differ)."""
    from vlm_pack.testing.data import sample_photos

    photos = sample_photos(84)
    system = {"role": "system", "content": "You are a terse assistant."}

    def image(name: str, size: tuple[int, int]) -> dict:
        return {"type": "image", "image": photos[name].resize(size)}

    return [
        {"messages": [system, {"role": "user", "content": [image("astronaut", (56, 42)),
                                                            {"type": "text", "text": "Person?"}]},
                      {"role": "assistant", "content": "Yes"}]},
        {"messages": [{"role": "user", "content": "Show me a cat."},
                      {"role": "assistant", "content": [{"type": "text", "text": "Here:"}, image("chelsea", (42, 56))]},
                      {"role": "user", "content": "Thanks. Its colour?"},
                      {"role": "assistant", "content": "Tabby."}]},
        {"messages": [system, *text_chat_examples(1, seed=3, max_turns=2)[0]["messages"]]},
        {"messages": [{"role": "user", "content": [image("coffee", (84, 56)), image("rocket", (28, 70)),
                                                    {"type": "text", "text": "Compare them."}]},
                      {"role": "assistant", "content": "A cup of coffee; a rocket on its pad."}]},
    ]


@pytest.mark.parametrize("family", EDGE_FAMILIES)
def test_edge_batch_equals_each_sample_alone(family):
    """The edge batch (system prompts, one-word answer, an image inside an assistant turn, text-only, images of
    different sizes) packed with context-parallel alignment (each sample padded to a multiple of 4, as cp=2
    needs) where the family allows it, against each sample alone: logits, losses, the model's own loss, grads."""
    setup = setup_for(family)
    if path_refusal(setup.collator.family, "context_parallel") is None:
        collator = VLMPackingCollator(setup.processor, max_length=2048, model_config=setup.packed.config,
                                      context_parallel_size=2)
        setup = dataclasses.replace(setup, collator=collator)
    meta = packing_metadata(setup.collator(edge_examples()))
    aligned = setup.collator.pad_to_multiple_of > 1
    assert not aligned or not torch.equal(meta["cu_seqlens"], meta["cu_seqlens_padded"])  # alignment slots present
    result = assert_packed_exact(setup, edge_examples())
    MEASURED.setdefault(family, {}).update({f"edge_{k}": v for k, v in result.items()})


# ------------------------------------------------------------------ corruptions: each rule matters


BOUNDARY_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
# Families whose packed image layout only enable_packing's hook turns into model inputs (the stock model cannot take
# a packed batch without boundaries): their position rule is checked by their own corruption tests.
PACKED_LAYOUT_FAMILIES = ("mllama",)


def swap_examples(seed: int = 0) -> list[dict]:
    """Two single-image samples whose images have the SAME size (well-formed when swapped), a text-only one and
    a multi-image one."""
    from vlm_pack.testing.data import sample_photos

    pictures = sample_photos(84)
    first, second = (
        {"messages": [{"role": "user", "content": [{"type": "image", "image": pictures[name].resize((56, 42))},
                                                     {"type": "text", "text": "What is this?"}]},
                      {"role": "assistant", "content": f"This is {name}."}]}
        for name in ("astronaut", "chelsea")
    )
    text_only = text_chat_examples(1, seed=seed, max_turns=1)[0]
    return [first, text_only, second, photo_examples(1, seed=seed, max_side=56)[0]]


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_corruptions_are_caught(family):
    """On one batch (two single-image samples whose images have the same size, a text-only and a multi-image
    sample), each rule dropped breaks the comparison that the clean batch passes:
    * vision rows given to the wrong sample (the two same-size images swapped: a well-formed batch);
    * positions not restarted per sample (stock sdpa, boundaries read from position ids as HF does when no
      cu_seq_lens are passed: exact with per-sample positions, wrong with whole-row positions). Not for hybrid
      DeltaNet or short-convolution families, whose stock linear / conv layers cannot read boundaries from
      positions, nor PACKED_LAYOUT_FAMILIES (their restart has its own corruption test)."""
    setup = setup_for(family)
    examples = swap_examples()
    batch, refs = exact_batch(setup, examples)

    if family not in PACKED_LAYOUT_FAMILIES and not {"linear_attention", "conv"} & setup.collator.family.model.layer_kinds:
        no_kwargs = dict.fromkeys(BOUNDARY_KWARGS)
        refs[3].logits.check(logit_error(batch, packed_logits(setup.stock, batch, **no_kwargs), refs))
        whole_row = torch.arange(batch["input_ids"].shape[1]).expand_as(batch["position_ids"])
        not_restarted = packed_logits(setup.stock, batch, **no_kwargs, position_ids=whole_row)
        assert refs[3].logits.is_far(logit_error(batch, not_restarted, refs))

    swapped = swapped_vision(setup, batch, examples)  # sample 0's vision rows given to sample 2 and back
    assert refs[3].logits.is_far(logit_error(batch, packed_logits(setup.packed, swapped), refs))


def swapped_vision(setup: Setup, batch: dict, examples: list[dict]) -> dict:
    """The batch of swap_examples() with sample 0's vision rows given to sample 2 and back (same-size images: the
    batch stays well-formed)."""
    samples = setup.collator._encode_all(examples)[0]
    swapped = dict(batch)
    for key in (k for k in samples[0] if k not in setup.collator.token_keys):
        chunks = [sample.get(key) for sample in samples]
        chunks[0], chunks[2] = chunks[2], chunks[0]
        swapped[key] = torch.cat([chunk for chunk in chunks if chunk is not None])
        assert swapped[key].shape == batch[key].shape
    return swapped


@torch.no_grad()
def test_corruption_llava_onevision_one_image_count_for_the_whole_row():
    """batch_num_images must stay per sample (anyres crops for single-image samples only): one count for the
    packed row (what processing the concatenated text would give) makes the model refuse the batch."""
    setup = setup_for("llava_onevision")
    batch = setup.collator(swap_examples())
    assert len(batch["batch_num_images"]) == 3  # one count per sample holding images
    packed_logits(setup.packed, batch)  # the clean batch runs
    with pytest.raises(ValueError, match="Image features and image tokens do not match"):
        packed_logits(setup.packed, batch, batch_num_images=batch["batch_num_images"].sum().reshape(1))


@pytest.mark.parametrize("family", ["glm4v", "glm4v_moe", "glm46v", "glm_ocr", "qwen3_vl_moe", "qwen3_5_moe"])
@torch.no_grad()
def test_corruption_one_dimensional_positions(family):
    """GLM-4V's (and the MoE families') positions rule is "mrope": rows 1-3 from the model's own get_rope_index,
    per sample. Treating it as a 1-D family (every row the per-sample text arange: restarted per sample, but no
    3-D image grid) is caught."""
    setup = setup_for(family)
    examples = swap_examples()
    refs = references(setup, examples)
    batch = setup.collator(examples)
    assert batch["position_ids"].shape[0] == 4
    flat = batch["position_ids"][:1].expand_as(batch["position_ids"])
    assert not torch.equal(flat, batch["position_ids"])
    assert refs[3].logits.is_far(logit_error(batch, packed_logits(setup.packed, batch, position_ids=flat), refs))


@pytest.mark.parametrize("family", ["llava_next", "llava_next_video"])
@torch.no_grad()
def test_corruption_llava_next_image_sizes_follow_their_image(family):
    """LLaVA-NeXT: each image's row of pixel_values holds its anyres crops padded to the batch's largest count
    (the edge batch's 28x70 image has 3 real crops of 5) and its image_sizes row says how to unpad them. Sizes
    given to the wrong image (the two mirror-shaped images swapped: same crop count, same token count, so the
    batch stays well-formed) are caught."""
    setup = setup_for(family)
    examples = edge_examples()
    refs = references(setup, examples)
    batch = setup.collator(examples)
    real_crops = (batch["pixel_values"].flatten(2).abs().sum(-1) > 0).sum(1)
    assert real_crops.tolist() == [5, 5, 5, 3]  # one row per image, padded crops at the end of the last
    refs[3].logits.check(logit_error(batch, packed_logits(setup.packed, batch), refs))
    swapped = batch["image_sizes"][[1, 0, 2, 3]]
    assert swapped[0].tolist() == batch["image_sizes"][0].flip(0).tolist()
    assert refs[3].logits.is_far(logit_error(batch, packed_logits(setup.packed, batch, image_sizes=swapped), refs))


@torch.no_grad()
def test_corruption_deepseek_vl_hybrid_high_res_rows_follow_their_image():
    """DeepSeek-VL-Hybrid's high_res_pixel_values (the SAM tower's copy) have one row per image like pixel_values:
    the high-resolution rows of the two same-size images swapped alone (the SigLIP rows left in place) are caught."""
    setup = setup_for("deepseek_vl_hybrid")
    examples = swap_examples()
    refs = references(setup, examples)
    batch = setup.collator(examples)
    assert batch["high_res_pixel_values"].shape[0] == batch["pixel_values"].shape[0] == 5  # one row per image
    refs[3].logits.check(logit_error(batch, packed_logits(setup.packed, batch), refs))
    swapped = batch["high_res_pixel_values"][[1, 0, 2, 3, 4]]
    assert refs[3].logits.is_far(logit_error(batch, packed_logits(setup.packed, batch, high_res_pixel_values=swapped),
                                             refs))


@torch.no_grad()
def test_corruption_qwen3_5_moe_deltanet_state_carried_across_samples(monkeypatch):
    """Qwen3.5-MoE's DeltaNet layers must restart per sample: enable_packing installs the boundary-aware forward
    on its own MoE-model class, and the state carried over the whole row (boundaries ignored) is caught."""
    from vlm_pack.attention import gated_deltanet as gd
    from vlm_pack.attention import linear as la

    setup = setup_for("qwen3_5_moe")
    deltanets = [m for m in setup.packed.modules() if type(m).__name__ == "Qwen3_5MoeGatedDeltaNet"]
    assert deltanets and all(getattr(m.forward, "__vlm_pack_linear__", False) for m in deltanets)
    examples = edge_examples()
    refs = references(setup, examples)
    batch = setup.collator(examples)
    refs[3].logits.check(logit_error(batch, packed_logits(setup.packed, batch), refs))
    exact, total = gd.segmented_gated_delta_rule, batch["input_ids"].shape[1]
    whole_row = la.SegmentLayout.from_cu_seqlens(torch.tensor([0, total]), total)

    def carried(q, k, v, g, beta, layout):
        return exact(q, k, v, g, beta, whole_row)

    monkeypatch.setattr(gd, "segmented_gated_delta_rule", carried)
    assert refs[3].logits.is_far(logit_error(batch, packed_logits(setup.packed, batch), refs))


def test_internvl_tiles_split_by_image_tokens_or_refused(monkeypatch):
    """InternVL's pixel_values rows are tiles (per-image counts are not returned): without the family's
    "image_token" row rule the collator cannot attribute them and refuses, naming the key."""
    setup = setup_for("internvl")
    examples = mixed_examples(3, seed=2)
    monkeypatch.setattr(setup.collator, "encoding", dataclasses.replace(
        setup.collator.encoding, vision=dataclasses.replace(setup.collator.encoding.vision, rows={})))
    with pytest.raises(ValueError, match="processor output 'pixel_values' has shape"):
        setup.collator(examples)


# ------------------------------------------------------------------ refusals


@pytest.mark.parametrize("family", [f for f in FAMILIES if f in TEXT_BACKBONE_FAMILIES])
def test_unproven_language_model_is_refused(family):
    """The composite rule is proven with the family's proven text models only; any other language model, or a
    proven one with an unhandled feature (sliding layers), is refused by name."""
    config = setup_for(family).packed.config
    config = config.__class__.from_dict(config.to_dict())
    config.text_config = GPT2Config()
    with pytest.raises(UnsupportedModelError, match=rf"{family} model with language model 'gpt2' \(proven"):
        get_family(config)
    if family not in ("mistral3", "aya_vision", "cohere2_vision"):
        kind = "qwen3" if family == "lighton_ocr" else "qwen2"  # LightOnOCR's one proven language model
        config.text_config = tiny_config(kind)
        config.text_config.layer_types = ["sliding_attention", "full_attention"]
        with pytest.raises(UnsupportedModelError, match=rf"language model '{kind}' with layer types"):
            get_family(config)


@pytest.mark.parametrize(("config_class", "rule", "wrong"), [
    ("Qwen2_5OmniConfig", "the full Omni model .thinker . talker. is not proven", "wrong position"),
    ("GotOcr2Config", "chats cannot be encoded for GOT-OCR2", "the processor rejects every chat batch"),
])
def test_known_unproven_families_are_refused_with_the_missing_rule(config_class, rule, wrong):
    """Families whose exact packing needs a rule vlm_pack lacks: the refusal names the rule and what
    allow_unproven=True (causal, 1-D positions) would get wrong; with allow_unproven the warning says the same."""
    import transformers

    config = getattr(transformers, config_class)()
    with pytest.raises(UnsupportedModelError, match=rf"model_type '{config.model_type}': {rule}.*{wrong}"):
        get_family(config)
    with pytest.warns(UserWarning, match=rule):
        assert get_family(config, allow_unproven=True).name == f"unproven:{config.model_type}"


def test_got_ocr2_processor_rejects_chat_batches():
    """The measurement behind GOT-OCR2's missing rule: its processor (real class, Qwen tokenizer plus its image
    tokens, a ChatML template) rejects chat batches, with and without images, even with multi_page; so the collator
    cannot encode one even with allow_unproven=True."""
    from transformers import GotOcr2Config, GotOcr2ImageProcessor, GotOcr2Processor

    from vlm_pack.testing.tiny_families import chatml_template

    tokenizer = qwen_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<img>", "</img>", "<imgpad>"]},
                                 replace_extra_special_tokens=False)
    processor = GotOcr2Processor(image_processor=GotOcr2ImageProcessor(size={"height": 56, "width": 56}),
                                 tokenizer=tokenizer, chat_template=chatml_template("<img><imgpad></img>"))
    with pytest.warns(UserWarning, match="chats cannot be encoded for GOT-OCR2"):
        collator = VLMPackingCollator(processor, max_length=2048, model_config=GotOcr2Config(), allow_unproven=True)
    for multi_page in (False, True):
        processor.multi_page = multi_page
        for examples in (photo_examples(2, seed=2, max_side=56), text_chat_examples(2, seed=2)):
            with pytest.raises(ValueError, match="sample 0: the processor rejected it"):
                collator(examples)


def test_mistral3_with_an_unproven_language_model_is_refused():
    config = setup_for("mistral3").packed.config
    config = config.__class__.from_dict(config.to_dict())
    config.text_config = tiny_config("qwen2")  # a proven text family, but not proven as Mistral3's language model
    message = r"language model 'qwen2' \(proven language models for this family: mistral, mistral4\)"
    with pytest.raises(UnsupportedModelError, match=message):
        get_family(config)


# ------------------------------------------------------------------ Mistral text: sliding window inside each sample


def _windowed(kind: str, window: int | None, vocab_size: int):
    from transformers import Cohere2ForCausalLM, MistralForCausalLM

    from vlm_pack.testing.tiny_families import cohere2_text_config, mistral_text_config

    build = {"mistral": (mistral_text_config, MistralForCausalLM), "cohere2": (cohere2_text_config, Cohere2ForCausalLM)}
    config_fn, model_cls = build[kind]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        config = config_fn(vocab_size, sliding_window=window)
        return model_cls._from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()


@pytest.mark.parametrize("kind", ["mistral", "cohere2"])
def test_sliding_window_packed_equals_each_sample_alone(kind):
    """Mistral text, and Cohere 2 (Aya Vision's language model: windowed RoPE layers alternating with full layers
    without positions), with a window (4) shorter than every sample: the packed path applies it inside each sample
    like HF does (logits, losses, the model's own loss, gradients); without the window it would not match."""
    tokenizer = qwen_tokenizer()
    packed = enable_packing(_windowed(kind, 4, len(tokenizer)))
    collator = VLMPackingCollator(tokenizer, max_length=1024, model_config=packed.config)
    setup = Setup(kind, tokenizer, _windowed(kind, 4, len(tokenizer)), packed, collator)
    examples = text_chat_examples(3, seed=1, max_turns=2)
    MEASURED[kind] = assert_packed_exact(setup, examples, 3)
    with torch.no_grad():  # corruption: the same weights without the window (Cohere 2 needs one: never binding)
        batch = collator(examples)
        unwindowed = packed_logits(enable_packing(_windowed(kind, None if kind == "mistral" else 4096, len(tokenizer))),
                                   batch)
        refs = references(setup, examples)
        assert refs[3].logits.is_far(logit_error(batch, unwindowed, refs))


@pytest.mark.parametrize("family", FAMILIES)
def test_collator_stats_count_every_familys_images(family):
    """Images counted from the conversations, image tokens by the processor's placeholder id: not only for the
    Qwen families (whose image_grid_thw the count used to come from)."""
    setup = setup_for(family)
    examples = photo_examples(3, seed=2, max_side=84) + text_chat_examples(1, seed=2)
    stats = setup.collator(examples)["vlm_pack"]["stats"]
    assert stats.images == sum(isinstance(m["content"], list) and sum(p["type"] == "image" for p in m["content"])
                               for e in examples for m in e["messages"]) > 3  # one photo example holds two
    image_id = setup.processor.image_token_id
    want = sum(int((setup.collator([e])["input_ids"] == image_id).sum()) for e in examples[:3])  # each alone
    assert stats.image_tokens == want > 0
    assert setup.collator(text_chat_examples(2, seed=2))["vlm_pack"]["stats"].image_tokens == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_labels_carried_through_the_expansion_equal_the_processors_shifted_mask(family, monkeypatch):
    """transformers < 5.23 does not shift the assistant mask for expanded image placeholders; there the collator
    carries the tokenizer's mask of the unexpanded chat through the expansion (vlm_pack.core.versions GAPS). Where
    transformers shifts it (5.23+), both give the same labels, for every family, on the edge batch: its image
    inside an assistant turn puts labelled tokens after an expansion, where an unshifted mask would be off.
    Families whose expansion writes text (``EncodingRules.expansion_writes_text``) cannot be carried: refused there."""
    import vlm_pack.data.chat as chat
    from vlm_pack.core.versions import has

    if not has("processor_mask_shift"):
        pytest.skip("this transformers does not shift the mask: the carried mask is the collator's only one")
    import vlm_pack.data.collator as collator_module

    setup = setup_for(family)
    collator = setup.collator
    if collator.family.encoding.mask_before_expansion:
        pytest.skip(f"the {family} processor's mask is never shifted: the collator always carries it")
    shifted = collator(edge_examples())
    before_5_23 = lambda gap: gap != "processor_mask_shift" and has(gap)  # noqa: E731
    monkeypatch.setattr(chat, "has", before_5_23)
    if collator.family.encoding.expansion_writes_text:  # the carry must fail (the flag is true), so the collator refuses
        with pytest.raises(ValueError, match="cannot be carried"):
            collator(edge_examples())
        monkeypatch.setattr(collator_module, "has", before_5_23)
        with pytest.raises(ValueError, match=r"transformers>=5\.23"):
            VLMPackingCollator(setup.processor, max_length=2048, model_config=setup.packed.config)
        return
    carried = collator(edge_examples())
    assert torch.equal(carried["input_ids"], shifted["input_ids"])
    assert torch.equal(carried["labels"], shifted["labels"])
    media = torch.isin(shifted["input_ids"], torch.tensor(sorted(collator.unlabelled_ids)))
    assert ((shifted["labels"] != -100) & (media.long().cumsum(-1) > 0)).any()  # labels after an expansion
