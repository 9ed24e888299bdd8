"""Tests for the planted bugs that survived the suite (issue 45), each by the input the suite lacked: the chunked
training loss of a mixture-of-experts model and of Gemma 3n's composite model (both were checked in eval mode
only), an unpacked batch of several rows through Llama 4's chunked attention, a ZeRO-3 parameter being gathered and a
frozen partitioned head, every guard at its bound on both sides (Llama 4's row limit, Phi-4's longrope limit,
PaliGemma 2's prefix window), text with edge whitespace beside a Gemma 4 tool call. The streaming ones are in
tests/test_streaming_survivors.py, Molmo 2's pooling bound in tests/test_molmo2_bound.py.
scripts/replay_mutants.sh plants each mutant (scripts/mutants/*.patch), runs its test here and expects it to fail.

References are independent: the stock model's own loss (training mode, the sample alone) or its logits per row.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch
from tolerance import GRAD_REL_L2, NoiseFloor, fp64_copy, max_abs

from vlm_pack.core.batch import METADATA_KEY
from vlm_pack.integrations.head_loss import DeferredLogits
from vlm_pack.integrations.hf_model import enable_packing


def _one_sample_row(ids: torch.Tensor) -> dict:
    """``ids`` [T] as a packed row of one sample, with its bookkeeping (what the collator gives)."""
    cu = torch.tensor([0, ids.numel()], dtype=torch.int32)
    return {"input_ids": ids[None], "labels": torch.cat([torch.tensor([-100]), ids[1:]])[None],
            "position_ids": torch.arange(ids.numel())[None], "cu_seq_lens_q": cu, "cu_seq_lens_k": cu,
            "max_length_q": ids.numel(), "max_length_k": ids.numel(),
            METADATA_KEY: {"cu_seqlens": cu, "cu_seqlens_padded": cu}}


def _training_losses(stock: torch.nn.Module, ids: torch.Tensor, **packing) -> tuple[float, float]:
    """(the stock model's own training loss on the sample alone, the enable_packing model's chunked one)."""
    packed = enable_packing(copy.deepcopy(stock), loss_chunk_tokens=5, **packing)
    stock.train()
    packed.train()
    want = stock(input_ids=ids[None], labels=ids[None], use_cache=False).loss
    out = packed(**_one_sample_row(ids), use_cache=False)
    assert isinstance(out.logits, DeferredLogits)  # the chunked path ran
    return want.item(), out.loss.item()


# ---------------------------------------------------------------- head_loss: training-mode chunked loss


def test_moe_chunked_training_loss_adds_the_router_loss_with_its_coefficient():
    """Mixtral in training mode with output_router_logits: the chunked loss is the model's own (cross entropy +
    router_aux_loss_coef x aux) to fp32 rounding; dropping the coefficient moves it by 0.5 x aux."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                           num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.5)
    torch.manual_seed(0)
    stock = MixtralForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    ids = torch.randint(0, 300, (23,), generator=torch.Generator().manual_seed(1))
    want, got = _training_losses(stock, ids, allow_unproven=True)
    assert abs(got - want) < GRAD_REL_L2 * want, (got, want)


def test_gemma3n_composite_chunked_training_loss_applies_the_text_softcap():
    """Gemma3nForConditionalGeneration in training mode, text softcap 3.0 (the composite config holds none of its
    own): the chunked loss equals the model's own; a softcap read from elsewhere does not."""
    from vlm_pack.testing.tiny_families import tiny_vlm, tiny_vlm_processor

    processor = tiny_vlm_processor("gemma3n")
    stock = tiny_vlm("gemma3n", processor)
    stock.config.get_text_config().final_logit_softcapping = 3.0
    ids = torch.randint(10, 4000, (19,), generator=torch.Generator().manual_seed(2))
    want, got = _training_losses(stock, ids)
    assert abs(got - want) < GRAD_REL_L2 * want, (got, want)


# ---------------------------------------------------------------- hf_model: Llama 4 chunks of an unpacked batch


def _llama4_text(**overrides):
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    from vlm_pack.testing.tiny_families import llama4_text_config

    torch.manual_seed(0)
    config = Llama4TextConfig(**llama4_text_config(4200, **overrides))
    return Llama4ForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()


def test_llama4_unpacked_batch_of_several_rows_chunks_each_row():
    """An unpacked batch (3 rows, no mask, no boundaries) through an enable_packing Llama 4: every row's logits are
    the row alone through the stock model (the chunk rule counts from each row's start)."""
    stock = _llama4_text()
    packed_model = enable_packing(copy.deepcopy(stock))
    stock64, floor = fp64_copy(stock), NoiseFloor("logits")
    rows = torch.randint(0, 4000, (3, 21), generator=torch.Generator().manual_seed(3))
    refs = []
    for row in rows:
        refs.append(stock(input_ids=row[None], use_cache=False).logits[0])
        floor.observe(refs[-1], stock64(input_ids=row[None], use_cache=False).logits[0])
    got = packed_model(input_ids=rows, use_cache=False).logits
    floor.check(max(max_abs(got[i], refs[i]) for i in range(len(rows))))


# ---------------------------------------------------------------- guards at their bound, both sides


def test_llama4_row_limit_is_floor_scale_minus_one_tokens():
    """Temperature tuning scales the query of row index i by 1 + attn_scale * log1p(floor((i + 1) / floor_scale))
    (transformers' Llama 4): 1 for every index of a row of floor_scale - 1 tokens, not for index floor_scale - 1.
    So a packed row of exactly floor_scale - 1 tokens runs, one of floor_scale tokens is refused."""
    floor_scale = 16
    scales = torch.log1p(torch.floor((torch.arange(floor_scale) + 1.0) / floor_scale))
    assert scales[:floor_scale - 1].abs().max() == 0 and scales[floor_scale - 1] > 0  # the bound, from the formula
    model = enable_packing(_llama4_text(floor_scale=floor_scale, attn_temperature_tuning=True))
    for length in (floor_scale - 1, floor_scale):
        ids = torch.randint(0, 4000, (length,), generator=torch.Generator().manual_seed(length))
        batch = {k: v for k, v in _one_sample_row(ids).items() if k not in ("labels", METADATA_KEY)}
        if length < floor_scale:
            model(**batch, use_cache=False)
        else:
            with pytest.raises(ValueError, match=rf"a packed Llama 4 row of {length} tokens.*floor_scale - 1 = "
                                                 rf"{floor_scale - 1} tokens"):
                model(**batch, use_cache=False)


def _phi4_hook(limit: int):
    from transformers import Phi4MultimodalModel

    from vlm_pack.models import phi4_multimodal

    module = torch.nn.Module()
    module.__class__ = type("Fake", (Phi4MultimodalModel,), {"__init__": lambda self: None})
    torch.nn.Module.__init__(module)
    module.config = types.SimpleNamespace(rope_parameters={"rope_type": "longrope",
                                                           "original_max_position_embeddings": limit})
    phi4_multimodal._prepare(module)
    return next(iter(module._forward_pre_hooks.values()))


@pytest.mark.parametrize("long_length, refused", [(24, False), (25, True)])
def test_phi4_longrope_limit_plus_one_beside_a_short_sample_is_refused(long_length, refused):
    """longrope switches to its long factors once a sequence reaches original_max_position_embeddings + 1 tokens
    (largest position + 1 > limit): a sample of exactly the limit beside a short one packs, limit + 1 is refused."""
    limit = 24
    hook = _phi4_hook(limit)
    lengths = [5, long_length]
    cu = torch.tensor([0, 5, 5 + long_length], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    kwargs = {"cu_seq_lens_q": cu, "position_ids": positions}
    if refused:
        with pytest.raises(ValueError, match=rf"mixes samples longer and not longer than "
                                             rf"original_max_position_embeddings={limit}"):
            hook(None, (), kwargs)
    else:
        assert hook(None, (), kwargs) is None


@pytest.mark.parametrize("prefix, refused", [(8, False), (9, True)])
def test_paligemma2_prefix_of_window_plus_one_is_refused(prefix, refused):
    """A Gemma 2 prefix (token type 0 before the suffix) of exactly sliding_window tokens packs; window + 1 is
    refused (two samples per row: the longest prefix counts)."""
    from vlm_pack.models.paligemma import _check_prefix_fits

    window = 8
    config = types.SimpleNamespace(text_config=types.SimpleNamespace(
        sliding_window=window, layer_types=["sliding_attention", "full_attention"]))
    config.get_text_config = lambda: config.text_config
    types_row = torch.tensor([[0] * 3 + [1] * 4 + [0] * prefix + [1] * 5])
    if refused:
        with pytest.raises(ValueError, match=rf"prefix \(images \+ prompt\) of {prefix} tokens > sliding_window="
                                             rf"{window}"):
            _check_prefix_fits(config, types_row)
    else:
        _check_prefix_fits(config, types_row)


# ---------------------------------------------------------------- zero3: gathered or not


class _Param(torch.nn.Parameter):
    """A parameter carrying DeepSpeed ZeRO-3's markers (``ds_id``, ``ds_status``)."""


def _zero3_param(status, requires_grad=True):
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    param = _Param(torch.zeros(2, 2), requires_grad=requires_grad)
    param.ds_id, param.ds_status = 7, getattr(ZeroParamStatus, status)
    return param


def test_zero3_inflight_parameter_is_not_gathered_yet_and_a_frozen_head_is_not_refused():
    """INFLIGHT (an all-gather under way) is not AVAILABLE: still partitioned. A partitioned head that takes a
    gradient is refused outside the forward; a frozen one (no gradient to place) is not."""
    pytest.importorskip("deepspeed")
    from vlm_pack.core.zero3 import partitioned, require_gathered

    assert partitioned(_zero3_param("INFLIGHT")) and partitioned(_zero3_param("NOT_AVAILABLE"))
    assert not partitioned(_zero3_param("AVAILABLE"))
    head = torch.nn.Linear(2, 2)
    require_gathered(head, {"weight": _zero3_param("NOT_AVAILABLE", requires_grad=False)})
    require_gathered(head, {"weight": _zero3_param("AVAILABLE")})
    with pytest.raises(ValueError, match=r"the LM head's weight \(Linear\) is partitioned by DeepSpeed ZeRO-3"):
        require_gathered(head, {"weight": _zero3_param("NOT_AVAILABLE")})


# ---------------------------------------------------------------- Gemma 4: text with edge whitespace beside a call


@pytest.mark.parametrize("text", ["Let me check.\n", " Let me check."])
def test_gemma4_text_with_edge_whitespace_beside_a_tool_call_is_labelled(text):
    """Gemma 4 trims the text it moves after the tool responses: text with a trailing newline or a leading space
    beside a call encodes like apply_chat_template and its trimmed text is labelled (not refused)."""
    from test_template_matrix import TEXT_BESIDE_CALL, TOOLS, _example, _labelled_runs, template
    from transformers import AutoTokenizer

    from vlm_pack.assets import qwen_tokenizer_path
    from vlm_pack.data.collator import VLMPackingCollator

    tokenizer = AutoTokenizer.from_pretrained(str(qwen_tokenizer_path()))
    chat = copy.deepcopy(TEXT_BESIDE_CALL)
    chat[1]["content"] = text
    collator = VLMPackingCollator(tokenizer, max_length=4096, chat_template=template("gemma4"))
    batch = collator([_example(chat, TOOLS)])
    assert batch["input_ids"][0].tolist() == tokenizer.apply_chat_template(
        chat, tools=TOOLS, chat_template=template("gemma4"), tokenize=True, return_dict=True)["input_ids"]
    assert "Let me check.<turn|>\n21 degrees.<turn|>\n" in _labelled_runs(tokenizer, batch)
