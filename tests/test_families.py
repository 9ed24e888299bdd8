"""Family registry: text families exact under packing (vs each sample ALONE through the stock sdpa model),
and every refusal path (unknown family, unhandled config feature, missing model_config)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from vlm_pack import pack_batch_sequences, pad_multiple
from vlm_pack.integrations.hf_model import enable_packing
from vlm_pack.models import UnsupportedModelError, get_family, registered_families
from vlm_pack.testing.tiny_models import tiny_config, tiny_model

from tolerance import NoiseFloor, fp64_copy, max_abs

TEXT_FAMILIES = ("llama", "qwen2", "qwen3")


def _samples(seed: int, lengths=(7, 12, 5, 9)) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 5000, (n,), generator=generator) for n in lengths]


def _alone(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and the plain HF shifted cross entropy of one sample run alone."""
    logits = model(input_ids=ids[None], use_cache=False).logits[0]
    return logits, F.cross_entropy(logits[:-1], ids[1:])


def _packed(model, samples: list[torch.Tensor], pad_to_multiple_of: int = 2) -> torch.Tensor:
    width = max(len(s) for s in samples)
    padded = torch.zeros(len(samples), width, dtype=torch.long)
    mask = torch.zeros_like(padded)
    for row, sample in enumerate(samples):
        padded[row, : len(sample)] = sample
        mask[row, : len(sample)] = 1
    packed = pack_batch_sequences(padded, padding_mask=mask, pad_to_multiple_of=pad_to_multiple_of)
    logits = model(input_ids=packed.tokens, position_ids=packed.position_ids, use_cache=False,
                   **packed.attention_kwargs()).logits[0]
    bounds = packed.cu_seqlens_padded.tolist()
    return [logits[start:start + len(s)] for start, s in zip(bounds, samples)]


@pytest.mark.parametrize("family", TEXT_FAMILIES)
def test_text_family_packed_equals_each_sample_alone(family):
    _check_exact(family, pad_to_multiple_of=2)


@pytest.mark.parametrize("family", TEXT_FAMILIES)
def test_text_family_with_context_parallel_alignment(family):
    """Each sample padded to a multiple of 4 (``pad_multiple(context_parallel_size=2)``, what the collator does for
    cp=2): the alignment slots change nothing."""
    _check_exact(family, pad_to_multiple_of=pad_multiple(context_parallel_size=2))


def _check_exact(family: str, pad_to_multiple_of: int) -> None:
    stock = tiny_model(family, attn_implementation="sdpa")
    packed_model = enable_packing(tiny_model(family, attn_implementation="sdpa"))
    stock64, logit_floor, loss_floor = fp64_copy(stock), NoiseFloor("logits"), NoiseFloor("per-sample loss")
    samples = _samples(1)
    for sample, logits in zip(samples, _packed(packed_model, samples, pad_to_multiple_of)):
        reference, reference_loss = _alone(stock, sample)
        reference64, reference_loss64 = _alone(stock64, sample)
        logit_floor.observe(reference, reference64)
        loss_floor.observe(reference_loss, reference_loss64)
        logit_floor.check(max_abs(logits, reference))
        loss_floor.check(max_abs(F.cross_entropy(logits[:-1], sample[1:]), reference_loss))


def test_text_family_corruption_boundaries_dropped(boundaries_dropped):
    """Drop the boundaries (one segment over the whole row): the same comparison must fail."""
    stock = tiny_model("llama", attn_implementation="sdpa")
    packed_model = enable_packing(tiny_model("llama", attn_implementation="sdpa"))
    samples = _samples(1)
    errors = [(logits - _alone(stock, s)[0]).abs().max() for s, logits in zip(samples, _packed(packed_model, samples))]
    assert max(errors) > 1e-2


def test_registry_lists_each_family_with_its_proof():
    families = registered_families()
    assert {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", *TEXT_FAMILIES} <= families.keys()
    for spec in families.values():
        assert spec.proof.sft.startswith("tests/")
    assert families["qwen2_vl"].encoding.positions.rule == "mrope"
    assert families["llama"].encoding.positions.rule == "arange"


def test_unknown_family_is_refused():
    from transformers import GPT2Config

    with pytest.raises(UnsupportedModelError, match="model_type 'gpt2' is not a family vlm_pack has proven"):
        get_family(GPT2Config())


def test_text_config_of_a_vlm_is_refused():
    with pytest.raises(UnsupportedModelError, match="'qwen2_vl_text'.*not its text_config"):
        get_family(tiny_config("qwen2_vl").text_config)


def test_sliding_window_layers_are_refused_until_proven():
    config = tiny_config("qwen2")
    config.layer_types = ["sliding_attention", "full_attention"]
    with pytest.raises(UnsupportedModelError, match=r"qwen2 model with layer types \['sliding_attention'\]"):
        get_family(config)


def test_length_dependent_rope_is_refused():
    config = tiny_config("llama")
    config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(UnsupportedModelError, match=r"rope_type \['dynamic'\]"):
        get_family(config)


def test_enable_packing_refuses_and_opt_out_warns():
    model = tiny_model("llama")
    model.config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(UnsupportedModelError):
        enable_packing(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        enable_packing(model, allow_unproven=True)
    assert any("not proven exact" in str(w.message) for w in caught)
    assert model.config._attn_implementation == "vlm_pack_varlen"


def test_collator_refuses_unknown_family_and_missing_model_config(processor):
    from transformers import GPT2Config

    from vlm_pack.data.collator import VLMPackingCollator

    with pytest.raises(UnsupportedModelError, match="'gpt2'"):
        VLMPackingCollator(processor, max_length=64, model_config=GPT2Config())
    with pytest.raises(ValueError, match="multimodal processor but no model_config"):
        VLMPackingCollator(processor, max_length=64)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_5_text"])
def test_a_packed_forward_fills_no_cache_and_the_config_is_left_alone(family):
    """model(**batch) (Trainer, TRL) passes no use_cache: a packed row never fills a KV cache (a hybrid model's
    recurrent-state cache is refused outright), while the config keeps the user's use_cache (it is saved with every
    checkpoint; tests/test_trainer_eval.py reloads one)."""
    model = tiny_model(family, layers=2)
    before = model.config.to_json_string()
    enable_packing(model)
    assert model.config.to_json_string() == before and model.config.get_text_config().use_cache
    packed = pack_batch_sequences(torch.tensor([[5, 6, 7, 0], [8, 9, 10, 11]]), padding_mask=torch.tensor(
        [[1, 1, 1, 0], [1, 1, 1, 1]]))
    with torch.no_grad():
        out = model(input_ids=packed.tokens, position_ids=packed.position_ids, **packed.attention_kwargs())
        assert out.past_key_values is None
        assert model(input_ids=packed.tokens[:, :3]).past_key_values is not None  # an ordinary call still caches


def test_processor_of_another_family_is_refused(processor):
    """Qwen2-VL's processor emits per-token mm_token_type_ids, which Gemma 3 does not take: a clear error."""
    from vlm_pack.data.collator import VLMPackingCollator
    from vlm_pack.testing.data import photo_examples

    collator = VLMPackingCollator(processor, max_length=512, model_config=tiny_config("gemma3"))
    with pytest.raises(ValueError, match="'mm_token_type_ids' with one value per token, which the gemma3 family"):
        collator(photo_examples(2, seed=1, max_side=56))
