"""In-batch packing core vs peers' real code, micro-batch 2..128, from padded and from per-sample input.

Peers (their code is read at run time, see ``benchmarks/peers.py``; nothing of it is stored here):

* Megatron-Bridge ``pack_batch_sequences`` (``training/vlm_step.py``, before upstream moved packing to collate
  time) and today's ``pack_right_padded_sequence_batch_to_mcore_thd`` / ``build_mcore_thd_sequence_batch_from_rows``
  (``data/packing/in_batch.py``);
* Hugging Face ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` (per-sample input only; it has no
  alignment, so that table runs at ``pad_to_multiple_of=1``).

Padded input: tokens, labels, loss_mask, position_ids and a padding mask ``[B, S]``, S=4096, each sequence
aligned to ``--multiple`` (4 = context parallel 2). Per-sample input: 1-D tensors (``set_format("torch")``) or
Python lists (a plain tokenised dataset) of input_ids and labels; positions restart per sample (Megatron-Bridge
needs them as input: built outside the timed call). Lengths are ShareGPT-like: lognormal, median 420 tokens,
sigma 1.1, clipped to [16, S] (a fit to public ShareGPT conversation lengths in the Qwen tokenizer).

Every output is checked equal to ours before timing. Calls are interleaved round-robin (the order rotates each
round); each round gives one paired ratio peer / ours; the table shows the median ratio and its 10th-90th
percentile spread (>1x: ours faster). One intra-op thread (``--threads`` to change it).
Run: ``python benchmarks/in_batch.py [--quick] [--device cuda]``; writes ``benchmarks/results/in_batch_<device>.md``.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from transformers import DataCollatorWithFlattening

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import DEFAULT_MB_GIT, megatron_bridge  # noqa: E402

from vlm_pack import pack_batch_sequences, pack_sequences  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SIZES = (2, 4, 8, 16, 32, 64, 128)


def sharegpt_like_lengths(batch: int, width: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(420), 1.1, size=batch).astype(int), 16, width)


def padded_batch(lengths: np.ndarray, width: int, device: str) -> dict[str, torch.Tensor]:
    cols = torch.arange(width)
    mask = (cols < torch.from_numpy(lengths)[:, None]).long()
    tokens = torch.randint(1, 150_000, (len(lengths), width)) * mask
    return {k: v.to(device) for k, v in {
        "tokens": tokens, "labels": torch.where(mask.bool(), tokens, -100), "loss_mask": mask.clone(),
        "position_ids": cols.expand(len(lengths), width).clone(), "mask": mask,
    }.items()}


def paired_ratios(fns: dict[str, Callable], rounds: int, device: str) -> dict[str, tuple[float, float, float, float]]:
    """Per function: (median seconds, median ratio fn / first fn, p10 ratio, p90 ratio), calls interleaved."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    names = list(fns)
    for fn in fns.values():
        for _ in range(5):
            fn()
    times = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            sync()
            start = time.perf_counter()
            fns[name]()
            sync()
            times[name].append(time.perf_counter() - start)
    base = np.asarray(times[names[0]])
    out = {}
    for name in names:
        ratio = np.asarray(times[name]) / base
        out[name] = (float(np.median(times[name])), *map(float, np.percentile(ratio, [50, 10, 90])))
    return out


def check_padded(ours, peer_old, peer_new, m: int) -> None:
    """All three give the same packed fields (Megatron-Bridge returns its own containers)."""
    tokens, labels, loss_mask, _, positions, cu, max_seqlen = peer_old
    assert torch.equal(ours.tokens, tokens) and torch.equal(ours.labels, labels)
    assert torch.equal(ours.loss_mask, loss_mask) and torch.equal(ours.position_ids, positions)
    assert torch.equal(ours.cu_seqlens_padded, cu) and ours.max_seqlen == int(max_seqlen)
    assert torch.equal(ours.tokens, peer_new["tokens"]) and torch.equal(ours.position_ids, peer_new["position_ids"])
    assert torch.equal(ours.cu_seqlens, peer_new["cu_seqlens_q"])
    if m > 1:
        assert torch.equal(ours.cu_seqlens_padded, peer_new["cu_seqlens_q_padded"])


def padded_section(mb: dict, sizes, width: int, m: int, rounds: int, device: str) -> list[str]:
    rows = ["| micro-batch | real tokens | ours (ms) | MB vlm_step (ms) | MB in_batch today (ms) | "
            "vlm_step / ours | in_batch / ours |", "|---|---|---|---|---|---|---|"]
    for size in sizes:
        lengths = sharegpt_like_lengths(size, width, seed=size)
        b = padded_batch(lengths, width, device)

        def ours():
            return pack_batch_sequences(b["tokens"], b["labels"], b["loss_mask"], position_ids=b["position_ids"],
                                        padding_mask=b["mask"], pad_to_multiple_of=m)

        def vlm_step():
            return mb["pack_batch_sequences"](b["tokens"], b["labels"], b["loss_mask"], None, b["position_ids"],
                                              pad_to_multiple_of=m, padding_mask=b["mask"])

        def in_batch():
            batch = {"input_ids": b["tokens"], "labels": b["labels"], "loss_mask": b["loss_mask"],
                     "position_ids": b["position_ids"], "attention_mask": b["mask"]}
            mb["pack_right_padded_sequence_batch_to_mcore_thd"](batch, pad_to_multiple_of=m, emit_padding_mask=True)
            return batch

        new = in_batch()
        new["tokens"] = new["input_ids"]
        check_padded(ours(), vlm_step(), new, m)
        r = paired_ratios({"ours": ours, "vlm_step": vlm_step, "in_batch": in_batch}, rounds, device)
        rows.append(f"| {size} | {int(lengths.sum())} | {r['ours'][0] * 1e3:.3f} | {r['vlm_step'][0] * 1e3:.3f} | "
                    f"{r['in_batch'][0] * 1e3:.3f} | {_ratio(r['vlm_step'])} | {_ratio(r['in_batch'])} |")
    return rows


def per_sample_section(mb: dict, sizes, width: int, rounds: int, device: str) -> list[str]:
    hf = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    rows = ["| micro-batch | input | ours (ms) | HF flattening (ms) | MB from rows (ms) | ours pad-then-pack (ms) | "
            "HF / ours | MB / ours | pad-then-pack / ours |", "|---|---|---|---|---|---|---|---|---|"]
    for size in sizes:
        lengths = sharegpt_like_lengths(size, width, seed=1000 + size).tolist()
        ids = [torch.randint(1, 150_000, (n,), device=device) for n in lengths]
        labels = [t.clone() for t in ids]
        positions = [torch.arange(n, device=device) for n in lengths]
        for kind in ("tensors", "lists"):
            if kind == "lists" and device != "cpu":
                continue
            feats = [{"input_ids": t if kind == "tensors" else t.tolist(),
                      "labels": lab if kind == "tensors" else lab.tolist()} for t, lab in zip(ids, labels)]
            as_tensor = (lambda v: v) if kind == "tensors" else (lambda v: torch.as_tensor(v))

            def ours(feats=feats):
                return pack_sequences([f["input_ids"] for f in feats], [f["labels"] for f in feats])

            def pad_then_pack(feats=feats, as_tensor=as_tensor):
                toks = [as_tensor(f["input_ids"]) for f in feats]
                labs = [as_tensor(f["labels"]) for f in feats]
                longest = max(t.shape[0] for t in toks)
                tok_pad = torch.nn.utils.rnn.pad_sequence(toks, batch_first=True, padding_value=0)
                lab_pad = torch.nn.utils.rnn.pad_sequence(labs, batch_first=True, padding_value=-100)
                mask = torch.arange(longest, device=tok_pad.device) < torch.tensor([t.shape[0] for t in toks],
                                                                                   device=tok_pad.device)[:, None]
                return pack_batch_sequences(tok_pad, lab_pad, padding_mask=mask)

            def flattening(feats=feats):
                return hf(feats)

            def from_rows(feats=feats, as_tensor=as_tensor):
                return mb["build_mcore_thd_sequence_batch_from_rows"](
                    [{"input_ids": as_tensor(f["input_ids"]), "labels": as_tensor(f["labels"]), "position_ids": p}
                     for f, p in zip(feats, positions)])

            got, ref, peer = ours(), flattening(), from_rows()
            assert torch.equal(got.tokens.cpu(), ref["input_ids"]) and torch.equal(got.position_ids.cpu(),
                                                                                    ref["position_ids"])
            assert got.cu_seqlens.tolist() == ref["cu_seq_lens_q"].tolist() and got.max_seqlen == ref["max_length_q"]
            assert torch.equal(got.tokens, peer["input_ids"]) and torch.equal(got.labels, peer["labels"])
            assert torch.equal(got.tokens, pad_then_pack().tokens)
            r = paired_ratios({"ours": ours, "hf": flattening, "mb": from_rows, "pad": pad_then_pack}, rounds, device)
            rows.append(f"| {size} | {kind} | {r['ours'][0] * 1e3:.3f} | {r['hf'][0] * 1e3:.3f} | "
                        f"{r['mb'][0] * 1e3:.3f} | {r['pad'][0] * 1e3:.3f} | {_ratio(r['hf'])} | {_ratio(r['mb'])} | "
                        f"{_ratio(r['pad'])} |")
    return rows


def _ratio(stats: tuple[float, float, float, float]) -> str:
    return f"{stats[1]:.2f}x ({stats[2]:.2f}-{stats[3]:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--multiple", type=int, default=4, help="pad_to_multiple_of for padded input (4 = CP 2)")
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--megatron-bridge", default=DEFAULT_MB_GIT, help="git dir of a Megatron-Bridge snapshot")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = (2, 8) if args.quick else SIZES
    rounds = 20 if args.quick else args.rounds
    mb, commits = megatron_bridge(args.megatron_bridge)
    device_name = (torch.cuda.get_device_name() if args.device == "cuda"
                   else f"CPU ({platform.machine()}, {os.cpu_count()} cores, {args.threads} intra-op thread)")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines = [
        f"# In-batch packing vs peers, S={args.width}, ShareGPT-like lengths", "",
        f"Device: {device_name}; load average at start {load:.2f}; torch {torch.__version__}; {rounds} interleaved "
        f"rounds per row. Ratios: peer time / our time per round, median (10th-90th percentile); >1x = ours faster.",
        f"Megatron-Bridge code read at run time: vlm_step.py at {commits['vlm_step.py']}, in_batch.py at "
        f"{commits['in_batch.py']}. Regenerate: `python benchmarks/in_batch.py`.", "",
        f"## From a padded [B, S] batch (4 fields + mask, pad_to_multiple_of={args.multiple})", "",
        *padded_section(mb, sizes, args.width, args.multiple, rounds, args.device), "",
        "## From per-sample input (input_ids + labels; pad_to_multiple_of=1, HF has no alignment)", "",
        "`lists`: Python lists of ids, taken as is by ours and HF; Megatron-Bridge and pad-then-pack need tensors, "
        "so their calls include `torch.as_tensor` per sample. "
        "pad-then-pack: right-pad with `pad_sequence`, then `pack_batch_sequences` (the old collator route).", "",
        *per_sample_section(mb, sizes, args.width, rounds, args.device), "",
    ]
    table = "\n".join(lines)
    print(table)
    if not args.quick:
        RESULTS.mkdir(parents=True, exist_ok=True)
        out = RESULTS / f"in_batch_{args.device}.md"
        out.write_text(table)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
