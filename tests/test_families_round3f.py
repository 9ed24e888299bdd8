"""Round-3 families (issue 39, part F): PaliGemma 2 (a Gemma 2 language model under PaliGemma's prefix-LM) and
MiniCPM-V 4.7 (MiniCPM-V 4.6 positioned by Canvas M-RoPE).

Same proof as tests/test_families_round3c.py: a packed micro-batch through ``enable_packing`` + ``VLMPackingCollator``
equals each sample run ALONE through the stock model (fp32 CPU): logits and per-sample losses within the measured fp32
noise floor, gradients within ``GRAD_REL_L2``; one corruption per family rule that must break the comparison.

PaliGemma 2's reference is the stock EAGER model: transformers refuses to build Gemma 2 under sdpa (SDPA has no
softcapping; ``test_paligemma2_reference_is_eager``), and eager is what applies every Gemma 2 rule. Its rules: the
attention-logit softcapping inside every attention backend the packed attention routes to (CPU exact path, flex, the
flash-attn fake; torch varlen and TransformerEngine refuse it by name), the sliding window counted from each sample's
start, the prefix block per sample in the sliding layers too, and the final logit softcapping in the chunked loss.

MiniCPM-V 4.7's reference is the stock sdpa model, which lays out each sample's canvas itself; its token-budget plans
equal the processor's lengths in tests/test_budget_packs.py (every family of ``vlm_pack.testing.tiny_families``).
Substituted (no hub here): ``vlm_pack/testing/tiny_families_round3c.py`` (PaliGemma 2) and
``vlm_pack/testing/tiny_families_round3f.py`` (MiniCPM-V 4.7).
"""

from __future__ import annotations

import pytest
import torch

from vlm_pack.attention import varlen as attention
from vlm_pack.attention.varlen import available_backends, dense_attention, select_backend, varlen_attention
from vlm_pack.data.collator import VLMPackingCollator
from vlm_pack.integrations import hf_model
from vlm_pack.integrations.hf_model import enable_packing
from vlm_pack.testing.tiny_families import tiny_vlm, tiny_vlm_processor

from test_attention import FakeKernels, cu_of, fake_machine, random_qkv, reference
from test_families_round3c import _paligemma_examples
from version_gates import require_proven
import test_vlm_families as families
from test_vlm_families import Setup, assert_exact, compare, errors, logit_error, packed_logits, references

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")]


# ------------------------------------------------------------------ PaliGemma 2 (Gemma 2 text)

_SETUPS: dict[str, Setup] = {}


def paligemma2() -> Setup:
    require_proven("paligemma")
    if "paligemma2" not in _SETUPS:
        processor = tiny_vlm_processor("paligemma2")
        stock = tiny_vlm("paligemma2", processor, attn_implementation="eager")
        packed = enable_packing(tiny_vlm("paligemma2", processor, attn_implementation="eager"))
        collator = VLMPackingCollator(processor, max_length=2048, model_config=packed.config)
        _SETUPS["paligemma2"] = Setup("paligemma2", processor, stock, packed, collator)
    return _SETUPS["paligemma2"]


def test_paligemma2_reference_is_eager():
    """transformers builds Gemma 2 under eager only (its sdpa path would drop the softcapping): the reference."""
    require_proven("paligemma")
    processor = tiny_vlm_processor("paligemma2")
    with pytest.raises(ValueError, match="Gemma2Model does not support an attention implementation through"):
        tiny_vlm("paligemma2", processor, attn_implementation="sdpa")
    text = paligemma2().stock.config.text_config
    assert text.model_type == "gemma2" and text.attn_logit_softcapping and text.final_logit_softcapping
    assert text.layer_types == ["sliding_attention", "full_attention"]
    assert text.query_pre_attn_scalar != text.head_dim


def test_paligemma2_packed_equals_each_sample_alone():
    """Logits, per-sample losses, the model's own (chunked, final-softcapped) loss and gradients of a packed
    micro-batch vs each sample alone through the stock eager model; multi-image samples of different sizes, one
    running past the sliding window after its prefix."""
    setup = paligemma2()
    examples = _paligemma_examples()
    lengths = [s["input_ids"].shape[1] for s in setup.collator._encode_all(examples)[0]]
    assert max(lengths) > setup.stock.config.text_config.sliding_window, lengths
    result = compare(setup, examples)
    print("paligemma2", result)
    assert_exact(result)


@torch.no_grad()
def test_paligemma2_each_rule_is_needed(monkeypatch):
    """Each Gemma 2 rule dropped breaks the comparison: the attention softcap, the sliding window, the window
    counted over the whole row (sliding layers reaching into the previous sample), the prefix block in the
    sliding layers, and the final logit softcap in the chunked loss."""
    setup = paligemma2()
    examples = _paligemma_examples()
    refs = references(setup, examples)
    batch = setup.collator(examples)
    assert_exact(errors(batch, packed_logits(setup.packed, batch), refs))
    plain = hf_model.varlen_attention
    row = torch.tensor([0, batch["input_ids"].shape[1]], dtype=torch.int32)

    def whole_row(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
        return plain(q, k, v, row, row, None, None, **kw) if kw["window"] else plain(q, k, v, cu_q, cu_k, max_q,
                                                                                    max_k, **kw)

    corruptions = {
        "softcap dropped": lambda *a, **k: plain(*a, **{**k, "softcap": None}),
        "window dropped": lambda *a, **k: plain(*a, **{**k, "window": None}),
        "window over the whole row": whole_row,
        "no prefix block in sliding layers": lambda *a, **k: plain(*a, **{**k, "block_ids": None}
                                                                   if k["window"] else k),
    }
    for name, corrupt in corruptions.items():
        monkeypatch.setattr(hf_model, "varlen_attention", corrupt)
        assert refs[3].logits.is_far(logit_error(batch, packed_logits(setup.packed, batch), refs)), name
    monkeypatch.undo()
    token_mean = sum(loss * n for loss, n in zip(refs[1], refs[2])) / sum(refs[2])
    chunked = enable_packing(tiny_vlm("paligemma2", setup.processor, attn_implementation="eager")).train()
    assert chunked._vlm_pack_logit_transform == {"scale": None, "softcap": 5.0}  # final_logit_softcapping, read by enable_packing
    refs[3].loss.check((chunked(**batch).loss - token_mean).abs().item(), "the chunked training loss")
    monkeypatch.setattr(chunked, "_vlm_pack_logit_transform", {"scale": None, "softcap": None})
    assert refs[3].loss.is_far((chunked(**batch).loss - token_mean).abs().item()), "final softcap dropped"


@torch.no_grad()
def test_paligemma2_prefix_longer_than_the_window_is_refused(monkeypatch):
    """transformers' sliding mask lets a prefix see itself past the window, the packed attention does not: a prefix
    longer than the window is refused by name, not approximated."""
    setup = paligemma2()
    batch = setup.collator(_paligemma_examples())
    monkeypatch.setattr(setup.packed.config.text_config, "sliding_window", 20)
    with pytest.raises(ValueError, match=r"PaliGemma 2 prefix .* of 34 tokens > sliding_window=20"):
        packed_logits(setup.packed, batch)


# ------------------------------------------------------------------ softcapping in every attention backend

SOFTCAP = 1.5


def _capped_case(dtype=torch.float32):
    cu = cu_of([9, 4, 13])
    q, k, v = (x * 3 for x in random_qkv(26, 26, 4, 2, 8, seed=7))  # scores well past the cap
    q, k, v = (x.to(dtype) for x in (q, k, v))
    want = reference(q, k, v, cu, cu, causal=True, window=(5, 5), scale=0.3, softcap=SOFTCAP)
    uncapped = reference(q, k, v, cu, cu, causal=True, window=(5, 5), scale=0.3)
    assert (want - uncapped).abs().max() > 0.1  # the cap bites
    return q, k, v, cu, want


@torch.no_grad()
def test_softcap_on_the_cpu_paths_and_flex(monkeypatch):
    """The exact per-segment path, its torch.compile variant (one row mask), the unpacked dense path and flex
    (eager here) apply the cap; each agrees with the float64 reference, and without the cap each would not."""
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(attention, "_flex_kernel", lambda device_type: flex_attention)
    q, k, v, cu, want = _capped_case()
    outs = {
        "sdpa_segments": varlen_attention(q, k, v, cu, cu, 13, 13, softmax_scale=0.3, window=(5, 5), softcap=SOFTCAP),
        "row mask": attention._sdpa_row_mask(q, k, v, cu, cu, True, 0.3, (5, 5), None, SOFTCAP),
        "flex": varlen_attention(q, k, v, cu, cu, 13, 13, softmax_scale=0.3, window=(5, 5), softcap=SOFTCAP,
                                 backend="flex"),
    }
    lone = q[:9].transpose(0, 1)[None], k[:9].transpose(0, 1)[None], v[:9].transpose(0, 1)[None]
    dense = dense_attention(*lone, softmax_scale=0.3, window=(5, 5), softcap=SOFTCAP)[0].transpose(0, 1)
    outs["dense (first sample)"] = torch.cat([dense, want[9:].float()])
    bound = float(want.abs().max()) * 2 ** -16  # 256 fp32 ulps of the output's scale (26 keys, fp32 sums)
    for name, out in outs.items():
        assert (out.double() - want).abs().max() < bound, name
    assert available_backends()["sdpa_segments"].softcap and available_backends()["flex"].softcap


def test_softcap_routing_and_refusals(monkeypatch):
    """On CUDA in half precision, "auto" sends a softcapped call to flash-attn (>= 2.6, the recording fake bound to
    its real signature receives ``softcap``), else to flex, never to torch varlen or TransformerEngine, which refuse
    it by name when forced (so does a flash-attn without the keyword)."""
    kernels = FakeKernels(monkeypatch)
    real = attention._auto_backend  # softcapped calls without image blocks resolved as on CUDA, the rest as before
    monkeypatch.setattr(attention, "_auto_backend", lambda d, dtype, blocks, softcap: (
        select_backend("cuda", dtype, softcap=True) if softcap and not blocks else real(d, dtype, blocks, softcap)))
    q, k, v, cu, want = _capped_case(torch.bfloat16)
    out = varlen_attention(q, k, v, cu, cu, 13, 13, softmax_scale=0.3, window=(5, 5), softcap=SOFTCAP)
    assert [(name, call["softcap"]) for name, call in kernels.calls] == [("flash_attn", SOFTCAP)]
    assert (out.double() - want).abs().max() <= float(want.abs().max()) * 2 ** -8  # the fake's bf16 rounding
    for backend in ("torch_varlen", "transformer_engine"):
        assert not available_backends()[backend].softcap
        with pytest.raises(ValueError, match=f"backend '{backend}' cannot apply attention-logit softcapping"):
            varlen_attention(q, k, v, cu, cu, 13, 13, softcap=SOFTCAP, backend=backend)
    assert [name for name, _ in kernels.calls] == ["flash_attn"]  # refused before any kernel ran
    assert select_backend("cuda", torch.bfloat16) == "flash_attn"
    fake_machine(monkeypatch, cuda=True, installed={"flash_attn", "transformer_engine"}, flash_softcap=False)
    assert "no softcap keyword" in available_backends()["flash_attn"].reason
    assert select_backend("cuda", torch.bfloat16, softcap=True) == "flex"
    assert select_backend("cuda", torch.bfloat16) == "flash_attn"
    with pytest.raises(ValueError, match="backend 'flash_attn' cannot apply attention-logit softcapping"):
        varlen_attention(q, k, v, cu, cu, 13, 13, softcap=SOFTCAP, backend="flash_attn")
    fake_machine(monkeypatch, cuda=True, installed={"transformer_engine"})
    assert select_backend("cuda", torch.float16, softcap=True) == "flex"
    assert select_backend("cpu", torch.bfloat16, softcap=True) == "sdpa_segments"


# ------------------------------------------------------------------ MiniCPM-V 4.7 (Canvas M-RoPE)


def _photos(*sizes: tuple[int, int]) -> dict:
    """One sample holding a shipped photo at each (width, height): 140 x 105 gives a source image plus a 2 x 2 grid
    of slices (a newline between the slice rows), 56 x 28 / 28 x 56 unsliced images of 4 x 12 / 12 x 4 patches."""
    from vlm_pack.testing.data import sample_photos

    pictures = list(sample_photos(140).values())
    content = [{"type": "image", "image": pictures[i].resize(size)} for i, size in enumerate(sizes)]
    return {"messages": [{"role": "user", "content": [*content, {"type": "text", "text": "What is this?"}]},
                         {"role": "assistant", "content": f"{len(sizes)} photos."}]}


def _canvas_examples() -> list[dict]:
    """Two samples holding a wide and a tall photo in opposite orders (the same pixel width: swappable; the same
    token counts, other canvases), a text-only chat and a sliced photo."""
    from vlm_pack.testing.data import text_chat_examples

    return [_photos((56, 28), (28, 56)), text_chat_examples(1, seed=0, max_turns=1)[0], _photos((28, 56), (56, 28)),
            _photos((140, 105))]


def test_minicpmv4_7_packed_equals_each_sample_alone():
    """Logits, per-sample losses, the model's own loss and gradients vs each sample alone through the stock sdpa
    model, whose forward lays out each sample's canvas itself (compute_3d_position_ids); the batch holds sliced
    images whose slices span several rows (newlines inside the canvas) and a text-only sample (1-D positions)."""
    setup = families.setup_for("minicpmv4_7")
    examples = families.edge_examples() + [_photos((140, 105))]
    batch = setup.collator(examples)
    newline = setup.stock.config.newline_id
    in_canvas = (batch["input_ids"] == newline) & (batch["position_ids"][1] != batch["position_ids"][0])
    assert batch["target_sizes"].shape[0] > batch["vlm_pack"]["stats"].images and in_canvas.any()
    nets = [m for m in setup.packed.modules() if type(m).__name__ == "Qwen3_5GatedDeltaNet"]
    assert nets and all(getattr(m.forward, "__vlm_pack_linear__", False) for m in nets)  # restarted per sample
    result = families.compare(setup, examples)
    print("minicpmv4_7", result)
    families.assert_exact(result)


@torch.no_grad()
def test_minicpmv4_7_canvas_per_sample_and_slices_per_sample_are_each_needed():
    """Caught: a sample's canvas laid out from the batch's slice sizes instead of its own (the rope index run per
    sample but handed every sample's target_sizes: sample 2 then reads sample 0's grids), 1-D
    positions (no canvas: what allow_unproven would give), and two same-size images' pixel columns and slice rows
    swapped between samples (MiniCPM-V 4.6's one-row rule). Not a corruption: the canvas laid out over the whole
    packed row, whose rotary positions are each sample's own plus one constant per sample (asserted), which rotary
    attention inside a sample cannot see (the per-sample layout is kept: it is what the model computes alone)."""
    from test_families_round3d import _joined

    from vlm_pack.core.batch import packing_metadata

    setup = families.setup_for("minicpmv4_7")
    examples = _canvas_examples()
    refs = families.references(setup, examples)
    batch = setup.collator(examples)
    families.assert_exact(families.errors(batch, families.packed_logits(setup.packed, batch), refs))
    samples = setup.collator._encode_all(examples)[0]
    meta = packing_metadata(batch)
    spans = list(zip(meta["cu_seqlens_padded"][:-1].tolist(), meta["seq_lengths"].tolist()))
    index = setup.collator.rope_index
    batch_grids = batch["position_ids"].clone()
    (start, length), ids = spans[2], samples[2]["input_ids"]
    batch_grids[:, :, start:start + length] = index(ids, samples[2]["mm_token_type_ids"], torch.ones_like(ids),
                                                    target_sizes=batch["target_sizes"])
    one_d = batch["position_ids"][:1].expand_as(batch["position_ids"])
    swapped = _joined(samples, [2, 1, 0, 3])
    for name, overrides in (("the batch's slice sizes", {"position_ids": batch_grids}),
                            ("1-D positions", {"position_ids": one_d}), ("slices swapped", swapped)):
        assert not all(torch.equal(value, batch[key]) for key, value in overrides.items()), name
        error = families.logit_error(batch, families.packed_logits(setup.packed, batch, **overrides), refs)
        assert refs[3].logits.is_far(error), name

    tokens = batch["input_ids"]
    whole_row = index(tokens, batch["mm_token_type_ids"], torch.ones_like(tokens), target_sizes=batch["target_sizes"])
    for start, length in spans:  # the rotary rows (T, H, W); the text row only marks the sample boundaries
        shift = whole_row[1:, :, start:start + length] - batch["position_ids"][1:, :, start:start + length]
        assert (shift == shift[0, 0, 0]).all()


def test_minicpmv4_7_refusals():
    """A config without the canvas marker ids, another language model, a video and context parallelism are refused
    by name; the family is no longer among the missing rules."""
    from transformers import GPT2Config

    from vlm_pack.models import UnsupportedModelError, get_family
    from vlm_pack.models.missing import MISSING_RULES

    assert "minicpmv4_7" not in MISSING_RULES
    setup = families.setup_for("minicpmv4_7")
    config = setup.packed.config.__class__.from_dict(setup.packed.config.to_dict())
    config.newline_id = None
    with pytest.raises(UnsupportedModelError, match=r"no canvas marker ids \['newline_id'\]"):
        get_family(config)
    config.text_config = GPT2Config()
    with pytest.raises(UnsupportedModelError, match=r"language model 'gpt2' \(proven language models"):
        get_family(config)
    with pytest.raises(UnsupportedModelError, match="context_parallel_size=2 with a minicpmv4_7 model"):
        VLMPackingCollator(setup.processor, max_length=64, model_config=setup.packed.config, context_parallel_size=2)
