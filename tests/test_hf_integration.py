"""Hugging Face models with the vlm_pack attention: packed rows give exactly the per-sample results."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM

from vlm_pack.integrations import hf_model as hf
from vlm_pack.integrations.hf_model import ATTN_IMPLEMENTATION, enable_packing, packing_attention_forward, register_attention
from vlm_pack.core.loss import packed_cross_entropy
from vlm_pack.core.packing import pack_batch_sequences

from tolerance import NoiseFloor, assert_grads_close, fp64_copy, max_abs

VOCAB = 97
LENGTHS = [5, 11, 1, 8]


def llama(attn_implementation: str, seed: int = 0, **overrides) -> LlamaForCausalLM:
    """A tiny fp32 Llama from a FRESH config (``_from_config`` writes the implementation into the config)."""
    register_attention()
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         initializer_range=0.2, **overrides)
    torch.manual_seed(seed)
    return LlamaForCausalLM._from_config(config, attn_implementation=attn_implementation).eval()


def samples(lengths=LENGTHS, seed=0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g) for n in lengths]


def padded(ids: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded [B, S] batch and its attention mask."""
    batch = torch.nn.utils.rnn.pad_sequence(ids, batch_first=True, padding_value=0)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(x) for x in ids], batch_first=True)
    return batch, mask


def per_sample_logits(model, ids) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(input_ids=x[None], use_cache=False).logits[0] for x in ids]


def stock_reference(stock, ids) -> tuple[list[torch.Tensor], NoiseFloor]:
    """Each sample ALONE through the stock model (fp32 logits) and the fp32 noise floor (same samples in fp64)."""
    floor, exact = NoiseFloor("logits"), fp64_copy(stock)
    expected = per_sample_logits(stock, ids)
    for logits, fp64 in zip(expected, per_sample_logits(exact, ids)):
        floor.observe(logits, fp64)
    return expected, floor


def packed_slices(batch):
    """(start, length) of each real sample inside the packed row."""
    starts = batch.cu_seqlens_padded[:-1].tolist()
    return list(zip(starts, batch.seq_lengths.tolist()))


def assert_packed_equals_per_sample(model, reference=None, multiple: int = 1) -> None:
    """Pack ``samples()`` (alignment ``multiple``), run ONE packed forward through ``model`` with the boundary
    kwargs, and compare every sample's logits with the stock ``reference`` (default: the tiny Llama with sdpa,
    same weights) run on it alone, within the measured fp32 noise floor."""
    ids = samples()
    tokens, mask = padded(ids)
    batch = pack_batch_sequences(tokens, attention_mask=mask, pad_to_multiple_of=multiple)
    with torch.no_grad():
        logits = model(input_ids=batch.tokens, position_ids=batch.position_ids, use_cache=False,
                       **batch.attention_kwargs()).logits[0]
    expected, floor = stock_reference(reference or llama("sdpa"), ids)
    for (start, n), want in zip(packed_slices(batch), expected):
        floor.check(max_abs(logits[start:start + n], want))


def test_name_with_flash_is_rejected():
    with pytest.raises(ValueError, match="flash"):
        register_attention("my_flash_varlen")


@pytest.mark.parametrize("multiple", [1, 4], ids=["m1", "m4"])
def test_packed_logits_equal_per_sample_logits(multiple):
    """The packer's PackedBatch (with alignment slots when m=4) through the model == samples one by one."""
    assert_packed_equals_per_sample(llama(ATTN_IMPLEMENTATION), multiple=multiple)


def test_plain_sdpa_with_all_ones_mask_cross_contaminates():
    """The trap: a packed row through sdpa WITH an all-ones attention_mask attends across samples."""
    ours, sdpa = llama(ATTN_IMPLEMENTATION), llama("sdpa")
    ids = samples()
    tokens, mask = padded(ids)
    batch = pack_batch_sequences(tokens, attention_mask=mask)
    expected, floor = stock_reference(sdpa, ids)
    expected = torch.cat(expected)
    with torch.no_grad():
        trapped = sdpa(input_ids=batch.tokens, position_ids=batch.position_ids,
                       attention_mask=torch.ones_like(batch.tokens), use_cache=False).logits[0]
        protected = ours(input_ids=batch.tokens, position_ids=batch.position_ids,
                         attention_mask=torch.ones_like(batch.tokens), use_cache=False,
                         **batch.attention_kwargs()).logits[0]
    first = LENGTHS[0]  # the first sample sees no other sample, even in the trap
    floor.check(max_abs(trapped[:first], expected[:first]))
    assert floor.is_far(max_abs(trapped[first:], expected[first:]))
    floor.check(max_abs(protected, expected))


def test_packed_position_ids_without_boundaries_are_still_exact(caplog):
    """No cu_seq_lens kwargs (e.g. DataCollatorWithFlattening defaults): boundaries come from position ids."""
    model = llama(ATTN_IMPLEMENTATION)
    ids = samples()
    tokens, mask = padded(ids)
    batch = pack_batch_sequences(tokens, attention_mask=mask)
    hf._warned_position_ids = False
    with caplog.at_level(logging.WARNING, logger="vlm_pack.integrations.hf_model"), torch.no_grad():
        logits = model(input_ids=batch.tokens, position_ids=batch.position_ids, use_cache=False).logits[0]
    expected, floor = stock_reference(llama("sdpa"), ids)
    floor.check(max_abs(logits, torch.cat(expected)))
    assert "cu_seq_lens_q" in caplog.text


def test_packed_training_step_gradients_equal_unpacked():
    """Packed loss + backward == HF's own loss on the padded batch (mean over loss tokens), parameter by parameter."""
    ours, sdpa = llama(ATTN_IMPLEMENTATION), llama("sdpa")
    ids = samples()
    tokens, mask = padded(ids)
    labels = tokens.masked_fill(mask == 0, -100)
    labels[:, :2] = -100  # an ignored prompt prefix
    batch = pack_batch_sequences(tokens, labels=labels, attention_mask=mask, pad_to_multiple_of=4)
    logits = ours(input_ids=batch.tokens, position_ids=batch.position_ids, use_cache=False,
                  **batch.attention_kwargs()).logits
    packed_cross_entropy(logits, batch.labels, batch.cu_seqlens_padded).backward()
    sdpa(input_ids=tokens, attention_mask=mask, labels=labels, use_cache=False).loss.backward()
    assert_grads_close({n: p.grad for n, p in ours.named_parameters()},
                       {n: q.grad for n, q in sdpa.named_parameters()})


def test_padded_unpacked_batch_matches_sdpa():
    """Without cu_seq_lens the dense path honours the padding mask transformers builds."""
    ours, sdpa = llama(ATTN_IMPLEMENTATION), llama("sdpa")
    tokens, mask = padded(samples())
    with torch.no_grad():
        got = ours(input_ids=tokens, attention_mask=mask, use_cache=False).logits
        expected = sdpa(input_ids=tokens, attention_mask=mask, use_cache=False).logits
        exact = fp64_copy(sdpa)(input_ids=tokens, attention_mask=mask, use_cache=False).logits
    real = mask.bool()
    floor = NoiseFloor("logits")
    floor.observe(expected[real], exact[real])
    floor.check(max_abs(got[real], expected[real]))


def test_generation_with_kv_cache_matches_sdpa():
    ours, sdpa = llama(ATTN_IMPLEMENTATION), llama("sdpa")
    prompt = samples([6])[0][None]
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(prompt, **kwargs), sdpa.generate(prompt, **kwargs))


def test_sliding_window_matches_sdpa():
    """Mistral-style sliding window (a Llama with sliding_window set): window kwarg honoured on the packed path."""
    from transformers import MistralConfig, MistralForCausalLM

    register_attention()
    models = []
    for impl in (ATTN_IMPLEMENTATION, "sdpa"):
        config = MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, sliding_window=3,
                               initializer_range=0.2)
        torch.manual_seed(0)
        models.append(MistralForCausalLM._from_config(config, attn_implementation=impl).eval())
    ours, sdpa = models
    assert_packed_equals_per_sample(ours, reference=sdpa)


def test_enable_packing_switches_a_built_model():
    model = llama("sdpa")
    assert enable_packing(model) is model
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION
    assert_packed_equals_per_sample(model)


def test_packed_row_with_padding_mask_is_refused():
    model = llama(ATTN_IMPLEMENTATION)
    tokens, mask = padded(samples())
    batch = pack_batch_sequences(tokens, attention_mask=mask)
    bad_mask = torch.ones_like(batch.tokens)
    bad_mask[0, -1] = 0
    with pytest.raises(ValueError, match="drop attention_mask"), torch.no_grad():
        model(input_ids=batch.tokens, position_ids=batch.position_ids, attention_mask=bad_mask, use_cache=False,
              **batch.attention_kwargs())


def test_attention_dropout_is_refused():
    model = llama(ATTN_IMPLEMENTATION, attention_dropout=0.1).train()
    with pytest.raises(NotImplementedError, match="attention_dropout"):
        model(input_ids=samples([4])[0][None], use_cache=False)


# ------------------------------------------------------------------------------------------ VLMs


def vlm_samples(config, seed=0):
    """Three text + image samples: (input_ids, mm_token_type_ids, pixel_values, image_grid_thw)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for before, (t, h, w), after in [(3, (1, 4, 4), 5), (2, (1, 2, 6), 1), (4, (1, 4, 2), 2)]:
        n_image = t * h * w // 4  # 2 x 2 spatial merge
        ids = torch.cat([torch.randint(0, 1000, (before,), generator=g), torch.tensor([config.vision_start_token_id]),
                         torch.full((n_image,), config.image_token_id), torch.tensor([config.vision_end_token_id]),
                         torch.randint(0, 1000, (after,), generator=g)])
        pixels = torch.randn(t * h * w, 3 * 2 * 14 * 14, generator=g, dtype=torch.float64)
        out.append((ids, (ids == config.image_token_id).int(), pixels, torch.tensor([[t, h, w]])))
    return out


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_vlm_packed_text_and_vision_equal_per_sample(family):
    """Text layers take the varlen path (cu_seq_lens from the forward kwargs, causal); the vision tower calls
    the same implementation once per image, non-causal, without boundaries (enable_packing keeps the text row's
    out of it, which transformers < 5.19 hands it), and takes the dense path.

    Run in float64: the comparison is then exact up to ~1e-12 (fp32 differs by ~2e-5 only through rounding of
    these tiny models' large activations)."""
    from vlm_pack.testing.tiny_models import tiny_model

    spy_name = f"vlm_pack_spy_{family}"
    register_attention(spy_name)
    calls = []

    def spy(module, query, key, value, attention_mask=None, **kwargs):
        calls.append((type(module).__name__, kwargs.get("cu_seq_lens_q") is not None,
                      kwargs.get("is_causal", getattr(module, "is_causal", True))))
        return packing_attention_forward(module, query, key, value, attention_mask, **kwargs)

    model = enable_packing(tiny_model(family, attn_implementation="sdpa").double(), spy_name)
    AttentionInterface.register(spy_name, spy)  # enable_packing registered packing_attention_forward under the name
    assert model.config.vision_config._attn_implementation == spy_name
    data = vlm_samples(model.config)
    per_sample, positions = [], []
    with torch.no_grad():
        for ids, types, pixels, grid in data:
            per_sample.append(model(input_ids=ids[None], mm_token_type_ids=types[None], pixel_values=pixels,
                                    image_grid_thw=grid, use_cache=False).logits[0])
            mrope, _ = model.model.get_rope_index(ids[None], types[None], image_grid_thw=grid)
            positions.append(torch.cat([torch.arange(len(ids)).view(1, 1, -1), mrope]))  # [4, 1, L]
        lengths = torch.tensor([len(d[0]) for d in data])
        cu = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).int()])
        calls.clear()
        packed = model(input_ids=torch.cat([d[0] for d in data])[None],
                       mm_token_type_ids=torch.cat([d[1] for d in data])[None],
                       pixel_values=torch.cat([d[2] for d in data]), image_grid_thw=torch.cat([d[3] for d in data]),
                       position_ids=torch.cat(positions, dim=2), use_cache=False, cu_seq_lens_q=cu,
                       cu_seq_lens_k=cu, max_length_q=int(lengths.max()), max_length_k=int(lengths.max()))
    torch.testing.assert_close(packed.logits[0], torch.cat(per_sample), atol=1e-9, rtol=0)
    text_calls = [c for c in calls if c[1]]
    vision_calls = [c for c in calls if not c[1]]
    assert len(text_calls) == model.config.text_config.num_hidden_layers
    assert vision_calls and all(not causal for _, _, causal in vision_calls)


# ------------------------------------------------------------------------------------------ GPU only


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("impl", [ATTN_IMPLEMENTATION, "flash_attention_2"])
def test_gpu_packed_bf16_logits_match_per_sample(impl):
    """On CUDA our implementation routes to a varlen kernel; where flash-attn is installed, transformers'
    own flash_attention_2 consumes the same cu_seq_lens_* kwargs natively."""
    if impl == "flash_attention_2":
        pytest.importorskip("flash_attn")
    model = llama(impl).cuda().bfloat16()
    ids = [x.cuda() for x in samples([64, 200, 3, 129])]
    tokens, mask = padded(ids)
    batch = pack_batch_sequences(tokens, attention_mask=mask)
    with torch.no_grad():
        logits = model(input_ids=batch.tokens, position_ids=batch.position_ids, use_cache=False,
                       **batch.attention_kwargs()).logits[0].float()
        expected = torch.cat([model(input_ids=x[None], use_cache=False).logits[0].float() for x in ids])
    torch.testing.assert_close(logits, expected, atol=5e-2, rtol=5e-2)
