"""Peers' fused losses on packed rows: Liger's fused linear cross entropy and Apple's Cut Cross-Entropy.

Both replace the model's forward on the instance (Trainer's ``use_liger_kernel`` calls Liger's
``_apply_liger_kernel_to_instance``; CCE's ``cce_patch``) and compute the loss from ``lm_head.weight`` and the final
hidden states with a whole-row label shift, so on vlm_pack rows (every sample start is -100) they are exact, and
vlm_pack's own chunked loss steps aside. Their kernels need a GPU: here recording fakes with the libraries' real
signatures (``liger_kernel.transformers.fused_linear_cross_entropy.LigerFusedLinearCrossEntropyLoss``:
``__init__(ignore_index, lse_square_scale, label_smoothing, reduction, softcap, ...)``, ``forward(lin_weight, _input,
target, bias=None)``; ``cut_cross_entropy.linear_cross_entropy(e, c, targets, bias, ignore_index, softcap, reduction,
shift, ...)``) compute the plain cross entropy they stand for. Proved: Trainer with gradient accumulation 2 equals
each sample alone through the stock model, the fake ran (and vlm_pack's chunked loss did not), and a PEFT adapter
on the head (which both would leave untrained) is refused.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F
from transformers import Trainer, TrainerCallback
from transformers.modeling_outputs import CausalLMOutputWithPast

import vlm_pack.core.chunked_loss as chunked_loss
from vlm_pack.integrations.hf_model import enable_packing

from tolerance import assert_grads_close
from test_chunked_loss import CHUNK, packed_batch, reference, samples, tiny
from test_trainer import training_args

CALLS: list[str] = []


class LigerFusedLinearCrossEntropyLoss(torch.nn.Module):
    """Fake of Liger's module (real signature); plain cross entropy of ``_input @ lin_weight.T``."""

    def __init__(self, ignore_index: int = -100, lse_square_scale: float = 0.0, label_smoothing: float = 0.0,
                 reduction: str = "mean", softcap: float | None = None, return_z_loss: bool = False):
        super().__init__()
        self.ignore_index, self.reduction, self.softcap = ignore_index, reduction, softcap

    def forward(self, lin_weight, _input, target, bias=None):
        CALLS.append("liger")
        logits = F.linear(_input, lin_weight, bias).float()
        return F.cross_entropy(logits, target, ignore_index=self.ignore_index, reduction=self.reduction)


def linear_cross_entropy(e, c, targets, bias=None, ignore_index=-100, softcap=None, reduction="mean", shift=0,
                         filter_eps="auto", accum_e_fp32=False, accum_c_fp32=False, filter_e_grad=True,
                         filter_c_grad=True, impl="cce", vocab_parallel_options=None):
    """Fake of Cut Cross-Entropy's function (real signature); ``shift`` drops the last slot of ``e`` and the first
    target over the whole row, as CCE does."""
    CALLS.append("cce")
    if shift:
        e, targets = e[..., :-shift, :], targets[..., shift:]
    logits = F.linear(e.reshape(-1, e.shape[-1]), c, bias).float()
    return F.cross_entropy(logits, targets.reshape(-1), ignore_index=ignore_index, reduction=reduction)


def liger_lce_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                      inputs_embeds=None, labels=None, use_cache=None, output_attentions=None,
                      output_hidden_states=None, cache_position=None, logits_to_keep=0, skip_logits=None, **kwargs):
    """Liger's Llama forward, as it computes the training loss (labels shifted over the whole row)."""
    items = kwargs.pop("num_items_in_batch", None)
    hidden = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=use_cache, **kwargs)[0]
    loss_fn = LigerFusedLinearCrossEntropyLoss(reduction="sum" if items is not None else "mean")
    loss = loss_fn(self.lm_head.weight, hidden[..., :-1, :].reshape(-1, hidden.shape[-1]), labels[..., 1:].reshape(-1))
    return CausalLMOutputWithPast(loss=loss if items is None else loss / items)


def cce_forward(self, input_ids=None, position_ids=None, labels=None, use_cache=None, **kwargs):
    """CCE's patched causal-LM forward, as it computes the training loss (``shift=1``)."""
    items = kwargs.pop("num_items_in_batch", None)
    hidden = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=use_cache, **kwargs)[0]
    loss = linear_cross_entropy(hidden, self.lm_head.weight, labels, shift=1,
                                reduction="sum" if items is not None else "mean")
    return CausalLMOutputWithPast(loss=loss if items is None else loss / items)


liger_lce_forward.__module__ = "liger_kernel.transformers.model.llama"
cce_forward.__module__ = "cut_cross_entropy.transformers.llama"


def apply_liger_kernel_to_instance(model, fused_linear_cross_entropy: bool = True, **kernels):
    """Fake of ``liger_kernel.transformers._apply_liger_kernel_to_instance`` (what Trainer calls)."""
    if fused_linear_cross_entropy:
        model.forward = types.MethodType(liger_lce_forward, model)


def cce_patch(model):
    model.forward = types.MethodType(cce_forward, model)
    return model


@pytest.fixture
def fake_liger(monkeypatch):
    package = types.ModuleType("liger_kernel")
    transformers_part = types.ModuleType("liger_kernel.transformers")
    transformers_part._apply_liger_kernel_to_instance = apply_liger_kernel_to_instance
    package.transformers = transformers_part
    monkeypatch.setitem(sys.modules, "liger_kernel", package)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", transformers_part)
    monkeypatch.setattr("transformers.integrations.liger.is_liger_kernel_available", lambda: True)


class Grads(TrainerCallback):
    grads = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def trainer_grads(model, items, tmp_path, **args):
    capture = Grads()
    dataset = [{"ids": ids, "labels": labels} for ids, labels in items]
    collate = lambda rows: packed_batch([(row["ids"], row["labels"]) for row in rows])  # noqa: E731
    Trainer(model=model, args=training_args(tmp_path, **args), train_dataset=dataset, data_collator=collate,
            callbacks=[capture]).train()
    return capture.grads


def two_windows():
    return samples(0) + samples(1)  # 8 samples: micro-batches of 4, gradient accumulation 2


@pytest.mark.parametrize("peer", ["liger", "cce"])
def test_peer_fused_loss_on_packed_rows_equals_each_sample_alone(peer, fake_liger, tmp_path, monkeypatch):
    items = two_windows()
    _, want = reference(tiny(), items)
    chunked = []
    original = chunked_loss.hidden_weighted_loss
    monkeypatch.setattr("vlm_pack.integrations.head_loss.hidden_weighted_loss",
                        lambda *a, **k: chunked.append(1) or original(*a, **k))
    model = enable_packing(tiny(), loss_chunk_tokens=CHUNK)
    CALLS.clear()
    if peer == "liger":
        grads = trainer_grads(model, items, tmp_path, use_liger_kernel=True)
    else:
        grads = trainer_grads(cce_patch(model), items, tmp_path)
    assert CALLS == [peer, peer] and not chunked  # the peer scored both micro-batches, vlm_pack stepped aside
    assert_grads_close(grads, want)


def test_peer_fused_loss_with_a_peft_head_is_refused():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(enable_packing(tiny()), LoraConfig(r=2, target_modules=["lm_head"]))
    apply_liger_kernel_to_instance(model.get_base_model())
    with pytest.raises(ValueError, match="Liger's fused linear cross entropy.*adapter would not be trained"):
        model(**packed_batch(samples()))
