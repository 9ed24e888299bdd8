"""Token-budget VLM packs: planning throughput (headers only), pack efficiency, and the comparison with
in-batch packing on the same data.

Data: a long-tail VLM chat mix built from the shipped real data. Images: the scikit-image photos resized to
``--distinct-images`` random sizes (64..1600 px per side, aspect 1:4..4:1), written as PNG files that samples
reference by path (the way datasets store images). Samples: 45% one image + an easy-vqa question, 15% 2-4
images, 40% text-only multi-turn chats (Zipf number of turns). Processor: the offline Qwen2-VL processor with
Qwen2-VL's patching and pixel bounds of 4..1024 merged tokens per image (min 56x56, max 896x896 pixels).

Measured (one process, this machine; interleaved where two things are compared):
1. planning samples/s (``measure_lengths``: chat template + tokenizer + image headers through the processor's
   resize rule) vs tokenising the same conversations' text alone (images dropped), vs the full processor
   (decoding and resizing pixels) on a subset;
2. token-budget plan at ``--pack-size``: packs, efficiency, samples per pack;
3. in-batch packing of the same samples at micro-batch ``--micro-batch`` (shuffled): padding fraction of a padded
   batch, and max / mean real tokens per step (the row length swings; a token-budget pack's width is fixed).

Run: ``python benchmarks/budget_packs.py`` (100k samples; writes ``benchmarks/results/budget_packs.md``);
``--samples 5000 --no-write`` for a quick look.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from vlm_pack.budget import measure_lengths, plan_token_budget_packs
from vlm_pack.data.collator import VLMPackingCollator
from vlm_pack.testing.data import _PHOTO_QUESTIONS, sample_photos, text_chat_examples
from vlm_pack.testing.tiny_models import offline_qwen2vl_processor, tiny_config

RESULTS = Path(__file__).resolve().parent / "results"


def write_images(folder: Path, count: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    photos = list(sample_photos(max_side=512).values())
    paths = []
    for i in range(count):
        side = int(rng.integers(64, 1601))
        aspect = float(np.exp(rng.uniform(np.log(0.25), np.log(4.0))))
        width, height = (side, max(16, round(side / aspect))) if aspect >= 1 else (max(16, round(side * aspect)), side)
        path = folder / f"img{i}.png"
        photos[i % len(photos)].resize((width, height)).save(path)
        paths.append(str(path))
    return paths


def vlm_mix(num: int, images: list[str], seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    questions = [q for q, _ in _PHOTO_QUESTIONS.values()]
    answers = [a for _, a in _PHOTO_QUESTIONS.values()]
    chats = text_chat_examples(max(1, int(0.4 * num)), seed=seed)
    out, chat = [], iter(chats)
    for _ in range(num):
        kind = rng.random()
        if kind < 0.4:
            out.append(next(chat, chats[0]))
            continue
        count = 1 if kind < 0.85 else int(rng.integers(2, 5))
        picks = rng.choice(len(images), size=count, replace=False)
        q = int(rng.integers(len(questions)))
        content = [{"type": "image", "path": images[p]} for p in picks] + [{"type": "text", "text": questions[q]}]
        answer = " ".join([answers[q]] * int(rng.zipf(1.8) % 12 + 1))
        out.append({"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]})
    return out


def text_only(example: dict) -> dict:
    return {"messages": [
        {"role": m["role"], "content": [p for p in m["content"] if p.get("type") != "image"]
         if isinstance(m["content"], list) else m["content"]} for m in example["messages"]]}


def timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=100_000)
    parser.add_argument("--distinct-images", type=int, default=400)
    parser.add_argument("--pack-size", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--processor-subset", type=int, default=300)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()

    processor = offline_qwen2vl_processor(min_pixels=56 * 56, max_pixels=896 * 896, full_vocabulary=True)
    collator = VLMPackingCollator(processor, max_length=1 << 20, model_config=tiny_config("qwen2_vl", full_vocabulary=True))
    with tempfile.TemporaryDirectory() as folder:
        images = write_images(Path(folder), args.distinct_images, seed=0)
        examples = vlm_mix(args.samples, images, seed=0)
        stripped = [text_only(e) for e in examples]

        # 1. planning throughput: headers vs text alone, interleaved, 2 rounds each
        plan_times, text_times = [], []
        for _ in range(2):
            plan_times += timed(lambda: measure_lengths(examples, collator, progress=False), 1)
            text_times += timed(lambda: measure_lengths(stripped, collator, progress=False), 1)
        lengths = measure_lengths(examples, collator, progress=False)
        subset = examples[: args.processor_subset]
        full_times = timed(lambda: [collator([e]) for e in subset], 1)
        check = measure_lengths(subset, collator, progress=False)
        exact = all(collator([e])["input_ids"].shape[1] == n for e, n in zip(subset[:50], check.tokens[:50]))

    plan_rate = args.samples / statistics.median(plan_times)
    text_rate = args.samples / statistics.median(text_times)
    full_rate = len(subset) / full_times[0]

    # 2. the token-budget plan (one small call first: the packing loops compile once per process)
    plan_token_budget_packs(lengths.__class__(*(a[:100] for a in (lengths.tokens, lengths.image_tokens,
                                                                  lengths.images))), args.pack_size, on_overlong="drop")
    start = time.perf_counter()
    plan = plan_token_budget_packs(lengths, args.pack_size, on_overlong="drop")
    bin_seconds = time.perf_counter() - start
    meta = plan.metadata()

    # 3. in-batch packing on the same samples (shuffled, micro-batch B)
    rng = np.random.default_rng(0)
    kept = np.setdiff1d(np.arange(lengths.tokens.size), np.array(plan.dropped, dtype=np.int64))
    order = rng.permutation(kept)
    steps = lengths.tokens[order[: order.size // args.micro_batch * args.micro_batch]].reshape(-1, args.micro_batch)
    per_step = steps.sum(1)
    padded_fraction = 1 - steps.sum() / (steps.max(1) * args.micro_batch).sum()

    lines = [
        "# Token-budget VLM packs (benchmarks/budget_packs.py)",
        "",
        f"Machine: {platform.processor() or platform.machine()}, 1 process. {args.samples} samples "
        f"({int((lengths.images > 0).sum())} with images, {int(lengths.images.sum())} image references to "
        f"{args.distinct_images} PNG files on disk), processor: Qwen2-VL rule, 4..1024 tokens per image.",
        "",
        "## Planning throughput",
        "",
        "| what | samples/s | vs text alone |",
        "|---|---|---|",
        f"| exact lengths, image headers only (`measure_lengths`) | {plan_rate:,.0f} | {text_rate / plan_rate:.2f}x slower |",
        f"| text alone (chat template + tokenizer, images dropped) | {text_rate:,.0f} | 1.00x |",
        f"| full processor (decode + resize pixels), {len(subset)} samples | {full_rate:,.0f} | "
        f"{text_rate / full_rate:.0f}x slower |",
        "",
        f"Runs (s): headers {', '.join(f'{t:.1f}' for t in plan_times)}; text {', '.join(f'{t:.1f}' for t in text_times)}. "
        f"Planned == materialised length on the first 50 samples: {exact}. Bin packing ({plan.algorithm}): "
        f"{bin_seconds * 1e3:.0f} ms.",
        "",
        f"## Packs of {args.pack_size} tokens vs in-batch packing (micro-batch {args.micro_batch})",
        "",
        "| layout | padding fraction | tokens per step: max / mean | samples per step |",
        "|---|---|---|---|",
        f"| padded micro-batch | {padded_fraction:.1%} | {per_step.max() / per_step.mean():.2f} "
        f"({per_step.max()} / {per_step.mean():.0f} real) | {args.micro_batch} |",
        f"| in-batch packing | 0% (plus alignment) | {per_step.max() / per_step.mean():.2f} "
        f"({per_step.max()} / {per_step.mean():.0f}) | {args.micro_batch} |",
        f"| token-budget packs | {1 - meta['packing_efficiency']:.2%} | 1.00 ({args.pack_size} / {args.pack_size}, "
        f"fixed width) | {meta['packing_factor']:.2f} (max {meta['max_samples_per_pack']}) |",
        "",
        f"Plan: {meta['num_packs']} packs, efficiency {meta['packing_efficiency']:.4f}, "
        f"{meta['num_dropped']} samples longer than a pack dropped.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "budget_packs.md").write_text(text)


if __name__ == "__main__":
    main()
