"""Fine-tune a Qwen2-VL-family model with in-batch packing, driven by a YAML recipe.

    python examples/finetune_vlm_packed.py --config configs/qwen2vl_in_batch_packing.yaml [--steps N]

With ``model.checkpoint`` set to a local Hugging Face directory the real model and its processor are loaded;
otherwise a tiny random model and an offline processor (real Qwen tokenizer) are built, so this runs anywhere.
Set ``packing.pack_sequences_in_batch: false`` for the padded A/B baseline: same data, same loss definition.
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.utils.data import DataLoader

from vlm_pack.data.collator import VLMPackingCollator
from vlm_pack.cli.demo import demo_examples
from vlm_pack.integrations.hf_model import enable_packing
from vlm_pack.offline.recipe import Recipe
from vlm_pack.testing.tiny_models import offline_qwen2vl_processor, tiny_model
from vlm_pack.integrations.torch_loop import train


def load_model_and_processor(recipe: Recipe):
    if recipe.model.checkpoint:
        from transformers import AutoModelForImageTextToText, AutoProcessor

        processor = AutoProcessor.from_pretrained(recipe.model.checkpoint)
        model = AutoModelForImageTextToText.from_pretrained(recipe.model.checkpoint, dtype=torch.bfloat16)
        return enable_packing(model), processor
    return enable_packing(tiny_model(recipe.model.family, attn_implementation="sdpa", seed=recipe.train.seed)), \
        offline_qwen2vl_processor()


def load_examples(recipe: Recipe) -> list[dict]:
    if recipe.data.source == "demo_mix":
        return demo_examples(recipe.data.num_samples, recipe.train.seed)
    with open(recipe.data.source, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()][: recipe.data.num_samples]


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--steps", type=int, help="override train.steps (e.g. a short smoke run)")
    args = parser.parse_args(argv)
    recipe = Recipe.from_yaml(args.config)
    steps = args.steps or recipe.train.steps
    torch.manual_seed(recipe.train.seed)

    model, processor = load_model_and_processor(recipe)
    collator = VLMPackingCollator.from_config(processor, recipe.packing, model_config=model.config)
    loader = DataLoader(load_examples(recipe), batch_size=recipe.packing.micro_batch_size, shuffle=True,
                        collate_fn=collator, num_workers=recipe.train.num_workers, drop_last=True,
                        generator=torch.Generator().manual_seed(recipe.train.seed))
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.train.lr)
    losses = train(model, loader, optimizer, steps, reduction=recipe.train.loss_reduction,
                   desc="packed" if recipe.packing.pack_sequences_in_batch else "padded")
    print(f"trained {steps} steps; first loss {losses[0]:.4f}, last loss {losses[-1]:.4f}")
    return losses


if __name__ == "__main__":
    main()
