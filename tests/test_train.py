"""The shared train step's loss: padded batches match Hugging Face's own loss; packed rows match padded ones."""

import torch

from vlm_pack import pack_batch_sequences
from vlm_pack.integrations.hf_model import ATTN_IMPLEMENTATION, register_attention
from vlm_pack.testing.tiny_models import tiny_model
from vlm_pack.integrations.torch_loop import batch_loss, train_step


def padded_batch():
    torch.manual_seed(0)
    ids = torch.randint(10, 1000, (3, 12))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    mask[2, 4:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :2] = -100  # a prompt that is not trained on
    return ids, mask, labels


def test_padded_loss_equals_hf_loss():
    model = tiny_model("llama")
    ids, mask, labels = padded_batch()
    expected = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    got = batch_loss(model, {"input_ids": ids, "attention_mask": mask, "labels": labels})
    assert torch.allclose(got, expected, atol=1e-6)
    per_sample = batch_loss(model, {"input_ids": ids, "attention_mask": mask, "labels": labels}, reduction="sample")
    assert not torch.allclose(per_sample, expected, atol=1e-3)  # rows have different loss-token counts


def test_packed_row_loss_equals_padded_loss_and_steps():
    register_attention()
    model = tiny_model("llama", attn_implementation=ATTN_IMPLEMENTATION)
    ids, mask, labels = padded_batch()
    padded = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    p = pack_batch_sequences(ids, labels, padding_mask=mask, pad_to_multiple_of=4)
    packed = {"input_ids": p.tokens, "labels": p.labels, "position_ids": p.position_ids, **p.attention_kwargs()}
    for reduction in ("token", "sample"):
        assert torch.allclose(batch_loss(model, packed, reduction), batch_loss(model, padded, reduction), atol=1e-5)
    before = [q.detach().clone() for q in model.parameters()]
    result = train_step(model, packed, torch.optim.SGD(model.parameters(), lr=0.1))
    assert result.loss > 0 and result.seconds > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
