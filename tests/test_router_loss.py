"""Mixture-of-experts router load-balancing loss under packing: a packed micro-batch gives the PADDED micro-batch's
total loss, aux loss and gradients, alignment slots excluded, for every registered MoE family.

Reference: the same samples as one right-padded micro-batch with its ``attention_mask`` through the stock sdpa model
(transformers' ``load_balancing_loss_func`` takes that mask to exclude padding): its aux loss is a mean over the real
tokens of the whole micro-batch, which is what a packed row holds. Packed rows carry alignment slots (CP / TP-SP
multiples of 4), which ``enable_packing`` keeps out of the aux loss (``vlm_pack.integrations.router_loss``); the
corruption counts them and must fail. Loss and aux within the fp32 noise floor measured against the fp64 reference,
gradients within ``GRAD_REL_L2`` (tests/tolerance.py). The aux coefficient is raised to 0.5 so that the aux term
weighs in the router gradients.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import vlm_pack.core.chunked_loss
from vlm_pack.core.batch import METADATA_KEY, model_inputs
from vlm_pack.data.collator import VLMPackingCollator
from vlm_pack.integrations.hf_model import enable_packing
from vlm_pack.integrations.router_loss import real_slot_mask
from vlm_pack.models import get_family, registered_families
from vlm_pack.testing.data import photo_examples, text_chat_examples
from vlm_pack.testing.tiny_families import tiny_vlm, tiny_vlm_processor
from vlm_pack.testing.tiny_models import qwen_tokenizer, tiny_model

from tolerance import NoiseFloor, fp64_copy, fp64_inputs, grad_errors, GRAD_REL_L2

pytestmark = pytest.mark.usefixtures("one_thread")

AUX_COEF = 0.5
# family -> (layers: at least one MoE layer of every kind the family has, alignment the family allows: 4 slots)
FAMILIES = {
    "qwen3_vl_moe": (1, {"context_parallel_size": 2}),
    "glm4v_moe": (2, {"context_parallel_size": 2}),  # layer 0 is dense (first_k_dense_replace=1)
    "qwen3_5_moe": (2, {"tensor_parallel_size": 4, "sequence_parallel": True}),  # DeltaNet + full; CP is refused
    "qwen3_next": (2, {"tensor_parallel_size": 4, "sequence_parallel": True}),
}
MEASURED: dict[str, dict[str, float]] = {}


@pytest.fixture(autouse=True)
def small_loss_chunks(monkeypatch):
    """16 slots per chunk of the chunked loss / slot scores (its floor), so every packed row spans several chunks."""
    monkeypatch.setattr(vlm_pack.core.chunked_loss, "DEFAULT_CHUNK_BYTES", 0)


@dataclasses.dataclass
class Setup:
    processor: object
    stock: torch.nn.Module
    packed: torch.nn.Module
    examples: list[dict]
    alignment: dict


def _router_loss_on(model: torch.nn.Module) -> torch.nn.Module:
    """output_router_logits=True and the aux coefficient in the config (and where the LM head copied it)."""
    text = model.config.get_text_config()
    text.output_router_logits, text.router_aux_loss_coef = True, AUX_COEF
    if hasattr(model, "router_aux_loss_coef"):
        model.router_aux_loss_coef = AUX_COEF
    return model


@functools.lru_cache(maxsize=None)
def build(family: str) -> Setup:
    """Stock and packed models of ``family`` (same weights, aux loss on), its processor and samples; once per module
    (tests that backpropagate zero the gradients first)."""
    layers, alignment = FAMILIES[family]
    if family == "qwen3_next":
        processor = qwen_tokenizer()
        make = lambda: tiny_model(family, layers=layers, vocab_size=len(processor))  # noqa: E731
        examples = text_chat_examples(4, seed=5, max_turns=2)
    else:
        processor = tiny_vlm_processor(family)
        make = lambda: tiny_vlm(family, processor, layers=layers)  # noqa: E731
        examples = photo_examples(2, seed=1, max_side=56) + text_chat_examples(2, seed=1, max_turns=2)
    stock = _router_loss_on(make())
    return Setup(processor, stock, enable_packing(_router_loss_on(make())), examples, alignment)


def collate(setup: Setup, model: torch.nn.Module, **options) -> dict:
    return VLMPackingCollator(setup.processor, max_length=2048, model_config=model.config, **options)(setup.examples)


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def router_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    errors = grad_errors(got, want)
    return max(error for name, error in errors.items() if ".gate." in name or name.endswith(".gate.weight"))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_router_loss_equals_the_padded_micro_batch(family):
    setup = build(family)
    setup.stock.zero_grad(set_to_none=True)
    setup.packed.zero_grad(set_to_none=True)
    padded = collate(setup, setup.stock, pack_sequences_in_batch=False)
    count = int((padded["labels"][:, 1:] != -100).sum())
    items = {"num_items_in_batch": 2 * count}  # as in a gradient-accumulation window of two micro-batches
    want = setup.stock(**model_inputs(padded, keep_labels=True), **items)
    with torch.no_grad():
        exact = fp64_copy(setup.stock)(**fp64_inputs(model_inputs(padded, keep_labels=True)), **items)
    aux_floor, loss_floor = NoiseFloor("router aux loss"), NoiseFloor("total loss")
    aux_floor.observe(want.aux_loss, exact.aux_loss)
    loss_floor.observe(want.loss, exact.loss)
    want.loss.backward()

    unaligned = collate(setup, setup.packed)
    with torch.no_grad():  # no alignment slots: already the padded value
        plain = setup.packed(**unaligned, **items)
    batch = collate(setup, setup.packed, **setup.alignment)  # model(**batch), as Trainer and TRL call it
    meta = batch[METADATA_KEY]
    assert not torch.equal(meta["cu_seqlens"], meta["cu_seqlens_padded"]), "the row must hold alignment slots"
    got = setup.packed(**batch, **items)
    got.loss.backward()
    errors = {"aux": abs(float(got.aux_loss.detach() - want.aux_loss.detach())),
              "loss": abs(float(got.loss.detach() - want.loss.detach())),
              "aux_unaligned": abs(float(plain.aux_loss - want.aux_loss)),
              "loss_unaligned": abs(float(plain.loss - want.loss)),
              "router_grad": router_error(grads(setup.packed), grads(setup.stock))}
    aux_floor.check(errors["aux"], "aligned row")
    loss_floor.check(errors["loss"], "aligned row")
    aux_floor.check(errors["aux_unaligned"], "row without alignment slots")
    loss_floor.check(errors["loss_unaligned"], "row without alignment slots")
    for name, error in grad_errors(grads(setup.packed), grads(setup.stock)).items():
        assert error < GRAD_REL_L2, f"gradient of {name}: relative L2 error {error:.3g}"

    # Corruption: alignment slots counted (the row's real boundaries taken to be its physical ones).
    counted = {**batch, METADATA_KEY: {**meta, "cu_seqlens": meta["cu_seqlens_padded"]}}
    with torch.no_grad():
        wrong = setup.packed(**counted, **items)
    errors["aux_slots_counted"] = abs(float(wrong.aux_loss - want.aux_loss))
    errors["loss_slots_counted"] = abs(float(wrong.loss - want.loss))
    assert aux_floor.is_far(errors["aux_slots_counted"]) and loss_floor.is_far(errors["loss_slots_counted"])
    with torch.no_grad():  # the aux loss is a statistic of the whole micro-batch, not a mean of per-sample ones
        single = VLMPackingCollator(setup.processor, max_length=2048, model_config=setup.stock.config,
                                    pack_sequences_in_batch=False)
        per_sample = torch.stack([setup.stock(**model_inputs(single([e]))).aux_loss for e in setup.examples])
    errors["aux_per_sample_mean"] = abs(float(per_sample.mean() - want.aux_loss.detach()))
    assert aux_floor.is_far(errors["aux_per_sample_mean"])
    MEASURED[family] = {**errors, "aux_tolerance": aux_floor.tolerance, "loss_tolerance": loss_floor.tolerance}


def test_every_registered_moe_family_is_covered_and_its_flag_accepted():
    moe = {name for name, spec in registered_families().items() if spec.model.router_loss_mask}
    assert moe == set(FAMILIES)
    config = tiny_model("qwen3_next", layers=2).config
    config.output_router_logits = True
    assert get_family(config).name == "qwen3_next"  # no longer refused


def test_real_slot_mask_rule_and_its_refusals():
    lengths = {"cu_seqlens": torch.tensor([0, 3, 8, 8]), "cu_seqlens_padded": torch.tensor([0, 4, 12, 16])}
    mask = real_slot_mask(lengths, 16)  # two samples (3 and 5 tokens, aligned to 4 and 8) and a 4-slot fill
    assert mask.tolist() == [[1, 1, 1, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0]]
    offline = {"cu_seqlens": torch.tensor([[0, 4, 12, 16, 16]], dtype=torch.int32),
               "cu_seqlens_argmin": torch.tensor([[4]]),
               "cu_seqlens_unpadded": torch.tensor([[0, 3, 8, 8, 8]], dtype=torch.int32),
               "cu_seqlens_unpadded_argmin": torch.tensor([[4]])}
    assert torch.equal(real_slot_mask(offline, 16), mask)
    with pytest.raises(ValueError, match=r"without its bookkeeping \(batch\['vlm_pack'\]\).*model\(\*\*batch\)"):
        real_slot_mask(None, 16)
    with pytest.raises(ValueError, match="offline pack without real boundaries.*pad_seq_to_mult >= 2"):
        real_slot_mask({"cu_seqlens": offline["cu_seqlens"], "cu_seqlens_argmin": offline["cu_seqlens_argmin"]}, 16)
    with pytest.raises(ValueError, match="row of 8 slots whose boundaries span 16: a context-parallel shard"):
        real_slot_mask(lengths, 8)


def test_packed_row_without_bookkeeping_is_refused_when_the_aux_loss_is_on():
    tokenizer = qwen_tokenizer()
    model = enable_packing(tiny_model("qwen3_next", layers=1, vocab_size=len(tokenizer)))
    batch = VLMPackingCollator(tokenizer, max_length=512, model_config=model.config)(text_chat_examples(2, seed=1))
    with torch.no_grad():
        model(**model_inputs(batch))  # aux loss off: nothing needed
        with pytest.raises(ValueError, match=r"output_router_logits=True on a packed row without its bookkeeping"):
            model(**model_inputs(batch), output_router_logits=True)
        ones = torch.ones_like(batch["input_ids"])  # an all-ones mask passes attention, but would count every slot
        with pytest.raises(ValueError, match=r"packed row given an attention_mask .*model\(\*\*batch\)"):
            model(**batch, attention_mask=ones, output_router_logits=True)


def test_trl_sft_trainer_router_loss_packed_equals_padded(tmp_path):
    """As TRL trains a MoE model: ``SFTTrainer.compute_loss`` turns the aux loss on from the config's coefficient and
    adds it through its fused LM head (``load_balancing_loss_func`` with the forward's ``attention_mask``). Reference:
    plain ``SFTTrainer`` on the padded micro-batch with the stock model; packed: ``PackedSFTTrainer`` on the row with
    CP alignment slots. Same loss and logged aux loss; the aux with slots counted is far off."""
    from test_trainer import sft_config
    from trl import SFTTrainer

    import vlm_pack

    setup = build("qwen3_vl_moe")
    args = sft_config(tmp_path, remove_unused_columns=False, dataset_kwargs={"skip_prepare_dataset": True})
    dataset = vlm_pack.to_hf_dataset(setup.examples)
    losses, aux = {}, {}
    for name, cls, model, options in (("padded", SFTTrainer, setup.stock, {"pack_sequences_in_batch": False}),
                                      ("packed", vlm_pack.PackedSFTTrainer, setup.packed, setup.alignment)):
        trainer = cls(model=model, args=args, train_dataset=dataset, processing_class=setup.processor,
                      data_collator=VLMPackingCollator(setup.processor, max_length=2048, model_config=model.config,
                                                       **options))
        assert trainer.aux_loss_enabled
        batch = trainer.data_collator(setup.examples)
        trainer.current_gradient_accumulation_steps = 2  # set by the training loop; divides the aux loss
        with torch.no_grad():
            losses[name] = trainer.compute_loss(model, batch, num_items_in_batch=40)
            aux[name] = trainer._metrics["eval"]["aux_loss"][-1]  # the tiny models are in eval mode (no dropout)
            if name == "packed":  # corruption: alignment slots counted
                meta = batch[METADATA_KEY]
                trainer.compute_loss(model, {**batch, METADATA_KEY: {**meta, "cu_seqlens": meta["cu_seqlens_padded"]}},
                                     num_items_in_batch=40)
                aux["counted"] = trainer._metrics["eval"]["aux_loss"][-1]
    floor = NoiseFloor("TRL loss")
    padded = collate(setup, setup.stock, pack_sequences_in_batch=False)
    with torch.no_grad():
        floor.observe(setup.stock(**model_inputs(padded, keep_labels=True), num_items_in_batch=40).loss,
                      fp64_copy(setup.stock)(**fp64_inputs(model_inputs(padded, keep_labels=True)),
                                             num_items_in_batch=40).loss)
    floor.check(abs(float(losses["packed"] - losses["padded"])), "TRL compute_loss")
    floor.check(abs(aux["packed"] - aux["padded"]), "TRL logged aux_loss")
    assert floor.is_far(abs(aux["counted"] - aux["padded"]))
    MEASURED["trl"] = {"loss": abs(float(losses["packed"] - losses["padded"])), "aux": abs(aux["packed"] - aux["padded"]),
                       "aux_slots_counted": abs(aux["counted"] - aux["padded"]), "tolerance": floor.tolerance}
