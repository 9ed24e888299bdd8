"""The chunked loss from hidden states (vlm_pack.core.chunked_loss, vlm_pack.integrations.head_loss) is exact and
never allocates the ``T x V`` logits.

Reference: each sample ALONE through a stock ``sdpa`` model, plain shifted cross entropy, summed over the samples and
divided by their label tokens. The packed side is an ``enable_packing`` model with small chunks (7 slots), so every
row spans several chunks whose edges fall inside samples. Heads covered: a plain head, a head with a bias, tied
embeddings, a head module that is not a plain ``nn.Linear`` (the recomputing path), a PEFT LoRA on ``lm_head``,
Cohere 2's ``logit_scale`` (Gemma's softcapping and the router aux loss run
through every family in tests/test_trainer.py and tests/test_router_loss.py). Corruptions (chunk targets off by one
slot at every chunk edge, on both paths; a labelled sample start) must break the comparison; a recording dispatch mode proves no tensor of ``T x V``
elements exists in a training step, through ``model(**batch)`` and through ``Trainer(compute_loss_func=...)``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Cohere2Config, LlamaConfig, Trainer

import vlm_pack
import vlm_pack.core.chunked_loss as chunked_loss
from vlm_pack.core.batch import METADATA_KEY
from vlm_pack.core.chunked_loss import LMHead, hidden_cross_entropy, hidden_weighted_loss
from vlm_pack.core.loss import packed_cross_entropy
from vlm_pack.integrations.hf_model import enable_packing
from vlm_pack.integrations.head_loss import DeferredLogits

from tolerance import GRAD_REL_L2, assert_grads_close, grad_errors

VOCAB, CHUNK = 97, 7
LENGTHS = (23, 9, 31, 16)  # 79 slots: 11+ chunks of 7 targets


def tiny(config_cls=LlamaConfig, **overrides):
    torch.manual_seed(0)
    config = config_cls(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, initializer_range=0.2,
                        attn_implementation="sdpa", **overrides)
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def samples(seed=0):
    generator = torch.Generator().manual_seed(seed)
    out = []
    for length in LENGTHS:
        ids = torch.randint(0, VOCAB, (length,), generator=generator)
        labels = ids.clone()
        labels[: length // 3] = -100  # a prompt
        out.append((ids, labels))
    return out


def packed_batch(items):
    cu = torch.tensor([0, *torch.tensor([len(i) for i, _ in items]).cumsum(0).tolist()], dtype=torch.int32)
    labels = torch.cat([label for _, label in items]).clone()
    labels[cu[:-1].long()] = -100  # Hugging Face's flattening rule: no sample start is a target
    return {"input_ids": torch.cat([i for i, _ in items])[None], "labels": labels[None],
            "position_ids": torch.cat([torch.arange(len(i)) for i, _ in items])[None],
            "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max(LENGTHS), "max_length_k": max(LENGTHS),
            METADATA_KEY: {"cu_seqlens_padded": cu, "cu_seqlens": cu}}


def reference(model, items):
    """(loss, grads): each sample alone through the stock model, token mean over all samples' targets."""
    sums, count = [], 0
    for ids, labels in items:
        logits = model(input_ids=ids[None], use_cache=False).logits[0]
        sums.append(F.cross_entropy(logits[:-1].float(), labels[1:], ignore_index=-100, reduction="sum"))
        count += int((labels[1:] != -100).sum())
    loss = torch.stack(sums).sum() / count
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def packed(model, batch):
    model.train()
    out = model(**batch)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def check(build, corrupt=None):
    items = samples()
    want_loss, want = reference(build(), items)
    model = enable_packing(build(), loss_chunk_tokens=CHUNK)
    batch = packed_batch(items)
    if corrupt is not None:
        corrupt(batch)
    out, got = packed(model, batch)
    assert isinstance(out.logits, DeferredLogits)  # the chunked path ran, no logits were made
    loss_error = abs(out.loss.item() - want_loss.item()) / want_loss.item()
    return loss_error, grad_errors(got, want)


HEADS = {
    "plain": lambda: tiny(),
    "bias": lambda: _with_head_bias(tiny()),
    "tied": lambda: tiny(tie_word_embeddings=True),
    "cohere_logit_scale": lambda: tiny(Cohere2Config, logit_scale=0.37, layer_types=["full_attention"]),
    "module_head": lambda: _wrapped_head(tiny()),
}


class _Projection(torch.nn.Module):
    """A head that is not a plain ``nn.Linear`` (as a PEFT or quantised head): the recomputing path."""

    def __init__(self, linear):
        super().__init__()
        self.linear = linear

    def forward(self, hidden):
        return self.linear(hidden)


def _wrapped_head(model):
    model.lm_head = _Projection(model.lm_head)
    model.config.tie_word_embeddings = False
    return model


def _with_head_bias(model):
    head = torch.nn.Linear(32, VOCAB, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.uniform_(-1, 1, generator=torch.Generator().manual_seed(1))
    model.lm_head = head
    return model


@pytest.mark.parametrize("head", sorted(HEADS))
def test_chunked_loss_equals_each_sample_alone(head):
    loss_error, errors = check(HEADS[head])
    assert loss_error < 1e-5
    assert max(errors.values()) < GRAD_REL_L2, errors
    if head == "tied":
        assert "model.embed_tokens.weight" in errors  # the shared weight gets the head's gradient too


def test_peft_lora_head_equals_each_sample_alone():
    from peft import LoraConfig, get_peft_model

    def build():
        torch.manual_seed(0)
        return get_peft_model(tiny(), LoraConfig(r=4, target_modules=["lm_head", "q_proj"], init_lora_weights=False))

    items = samples()
    want_loss, want = reference(build(), items)
    model = build()
    enable_packing(model.get_base_model(), loss_chunk_tokens=CHUNK)
    out, got = packed(model, packed_batch(items))
    assert abs(out.loss.item() - want_loss.item()) < 1e-5 * want_loss.item()
    assert any("lm_head.lora_B" in name for name in got)
    assert_grads_close(got, want)


def test_corruptions_are_caught(monkeypatch):
    """A sample start labelled (the row's whole-row shift then predicts across the boundary), and chunk targets
    off by one slot at chunk edges: both far outside the bound."""

    def label_a_start(batch):
        batch["labels"][0, LENGTHS[0]] = batch["input_ids"][0, LENGTHS[0]]

    loss_error, errors = check(HEADS["plain"], corrupt=label_a_start)
    assert loss_error > 1e-3 and max(errors.values()) > 100 * GRAD_REL_L2

    original = chunked_loss.chunk_bounds  # each chunk one slot too long: the next chunk's first target counted twice
    monkeypatch.setattr(chunked_loss, "chunk_bounds", lambda count, size: [
        (start, min(end + 1, count)) for start, end in original(count, size)])
    loss_error, errors = check(HEADS["plain"])  # the fused path: a wrong loss and wrong gradients
    assert loss_error > 1e-3 and max(errors.values()) > 100 * GRAD_REL_L2
    with pytest.raises(RuntimeError, match="size of tensor"):  # the recomputing path: more losses than targets
        check(HEADS["module_head"])


def test_core_reductions_equal_packed_cross_entropy():
    """hidden_cross_entropy == packed_cross_entropy on the full logits: token, sample, none; softcap and scale; and
    hidden_weighted_loss (both paths) == the weighted sum of the full per-token losses."""
    torch.manual_seed(0)
    head_module = torch.nn.Linear(16, VOCAB)
    hidden = torch.randn(1, 79, 16, requires_grad=True)
    labels = torch.randint(0, VOCAB, (1, 79))
    labels[0, :5] = -100
    cu = torch.tensor([0, 23, 32, 63, 79])
    for head in (LMHead(head_module), LMHead(head_module, scale=0.5, softcap=3.0)):
        for reduction in ("token", "sample", "none"):
            want = packed_cross_entropy(head(hidden), labels, cu, reduction=reduction)
            want_grads = torch.autograd.grad(want.sum(), [hidden, head_module.weight, head_module.bias])
            got = hidden_cross_entropy(hidden, head, labels, cu, reduction=reduction, chunk_tokens=CHUNK)
            got_grads = torch.autograd.grad(got.sum(), [hidden, head_module.weight, head_module.bias])
            assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
            for g, w in zip(got_grads, want_grads):
                assert (g - w).norm() <= GRAD_REL_L2 * w.norm()
        weights = torch.rand(1, 79, generator=torch.Generator().manual_seed(2))
        want = (packed_cross_entropy(head(hidden), labels, cu, reduction="none") * weights).sum()
        want_grads = torch.autograd.grad(want, [hidden, head_module.weight, head_module.bias])
        targets = chunked_loss.row_targets(labels, cu)
        for module in (head_module, _Projection(head_module)):
            got = hidden_weighted_loss(hidden, LMHead(module, head.scale, head.softcap), targets, weights,
                                       chunk_tokens=CHUNK)
            got_grads = torch.autograd.grad(got, [hidden, head_module.weight, head_module.bias])
            assert abs(got.item() - want.item()) <= 1e-6 * abs(want.item())
            for g, w in zip(got_grads, want_grads):
                assert (g - w).norm() <= GRAD_REL_L2 * w.norm()


class LargestTensors(TorchDispatchMode):
    """Records the largest number of elements of any tensor an operator returns."""

    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(value, torch.Tensor):
                self.largest = max(self.largest, value.numel())
        return out


def test_no_tensor_of_t_by_v_in_a_training_step(tmp_path):
    """model(**batch) and Trainer(compute_loss_func=vlm_pack.compute_loss_func): forward + backward never make
    a tensor of T x V elements (the logits); the largest is a chunk's or a weight's. The full path does."""
    items = samples()
    batch = packed_batch(items)
    slots = batch["input_ids"].numel()
    model = enable_packing(tiny(), loss_chunk_tokens=CHUNK)
    model.train()
    with LargestTensors() as mode:
        model(**batch).loss.backward()
    assert mode.largest < slots * VOCAB, mode.largest

    labels = batch.pop("labels")
    with LargestTensors() as mode:
        outputs = model(**batch)  # what Trainer sends with a compute_loss_func: no labels, the bookkeeping
        assert isinstance(outputs.logits, DeferredLogits)
        vlm_pack.compute_loss_func(outputs, labels, num_items_in_batch=None).backward()
    assert mode.largest < slots * VOCAB, mode.largest

    stock = enable_packing(tiny(), chunked_loss=False)
    stock.train()
    with LargestTensors() as mode:
        stock(**batch, labels=labels).loss.backward()
    assert mode.largest >= slots * VOCAB  # the check can see logits when they are there


def test_deferred_logits_are_the_logits_when_used():
    """A caller that uses the deferred logits as a tensor (a custom loss, a label smoother) gets the real ones."""
    batch = packed_batch(samples())
    labels = batch.pop("labels")
    model = enable_packing(tiny(), loss_chunk_tokens=CHUNK)
    model.train()
    deferred = model(**batch).logits
    stock = enable_packing(tiny(), chunked_loss=False)
    want = stock(**batch).logits
    assert deferred.shape == want.shape
    assert torch.allclose(deferred[:, 3:], want[:, 3:], atol=1e-6)
    assert torch.allclose(torch.log_softmax(deferred, -1), torch.log_softmax(want, -1), atol=1e-5)
    got = packed_cross_entropy(deferred, labels, batch["cu_seq_lens_q"])
    assert torch.allclose(got, packed_cross_entropy(want, labels, batch["cu_seq_lens_q"]), atol=1e-6)


def test_refusals_and_what_is_left_alone():
    batch = packed_batch(samples())
    model = enable_packing(tiny(), loss_chunk_tokens=CHUNK)
    model.train()
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(**batch, logits_to_keep=1)
    model.eval()  # evaluation without PackedEvaluation: the model's own loss and full logits
    with torch.no_grad():
        out = model(**batch)
    assert isinstance(out.logits, torch.Tensor) and out.logits.shape[-1] == VOCAB

    class Scaled(type(model)):
        logit_scale = 2.0

        def forward(self, input_ids=None, labels=None, **kwargs):
            """Generate with temperature=0.3 (a docstring is not code)."""
            out = super().forward(input_ids=input_ids, labels=labels, **kwargs)
            out.logits = out.logits + self.logit_scale  # a use of a logit field vlm_pack cannot follow
            return out

    Scaled.__name__ = "UnknownForCausalLM"
    with pytest.raises(ValueError, match="UnknownForCausalLM.forward uses 'logit_scale' other than as one factor"):
        enable_packing(Scaled(model.config))
    enable_packing(Scaled(model.config), chunked_loss=False)  # the model's own loss stays available


def test_heads_an_engine_shards():
    """DeepSpeed ZeRO-3 marks its parameters (``ds_id``, ``ds_status``; fakes here, the 2-process runs in
    tests/test_multiprocess.py train the real engine). A plain head gathered by DeepSpeed (inside the forward) takes
    the fused path unchanged; one still partitioned while its gradient is wanted (the loss runs after the forward:
    compute_loss_func) is refused, as is a partitioned head that is not a plain nn.Linear (its calls would gather
    per chunk), in training and in evaluation scoring."""
    status = pytest.importorskip("deepspeed.runtime.zero.partition_parameters").ZeroParamStatus
    torch.manual_seed(0)
    hidden = torch.randn(1, 40, 32, requires_grad=True)
    targets = torch.randint(0, VOCAB, (1, 40))
    linear = torch.nn.Linear(32, VOCAB, bias=False)
    want = hidden_weighted_loss(hidden, LMHead(linear), targets, chunk_tokens=CHUNK)
    linear.weight.ds_id, linear.weight.ds_status = 0, status.AVAILABLE  # gathered by DeepSpeed's forward
    got = hidden_weighted_loss(hidden, LMHead(linear), targets, chunk_tokens=CHUNK)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    linear.weight.ds_status = status.NOT_AVAILABLE
    with pytest.raises(ValueError, match="weight .Linear. is partitioned by DeepSpeed ZeRO-3 and this loss runs "
                                         "outside the model's forward.*chunked_loss=False"):
        hidden_weighted_loss(hidden, LMHead(linear), targets, chunk_tokens=CHUNK)

    class Wrapped(torch.nn.Module):  # what a PEFT wrapper looks like to the loss: not a plain nn.Linear
        def __init__(self):
            super().__init__()
            self.base = linear

        def forward(self, x):
            return self.base(x)

    linear.weight.ds_status = status.AVAILABLE
    for grad in (True, False):
        with torch.set_grad_enabled(grad), pytest.raises(ValueError, match="a Wrapped whose base.weight an engine "
                                                                            "shards.*chunked_loss=False"):
            hidden_cross_entropy(hidden, LMHead(Wrapped()), targets)
