"""In-batch packing speed: ``pack_batch_sequences`` vs a per-row loop vs the copy bound, side by side.

* per-row loop: the straightforward implementation of the same semantics (one ``.item()`` per row to read its
  length, a slice copy per field, alignment padding, ``torch.cat``);
* copy bound: a ``torch.cat`` of each row's real tokens, once per field, with lengths already on the host —
  the least work any packer must do.

Fields packed: tokens, labels, loss_mask, position_ids. Lengths are long-tailed (lognormal) at S=4096.
Run: ``python benchmarks/in_batch.py [--device cuda] [--quick]``; writes ``benchmarks/results/in_batch_<device>.md``.
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import numpy as np
import torch

from vlm_pack import pack_batch_sequences

RESULTS = Path(__file__).resolve().parent / "results"


def make_batch(batch: int, width: int, device: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(width / 6), 0.9, size=batch).astype(int), 1, width)
    cols = torch.arange(width)
    mask = (cols < torch.from_numpy(lengths)[:, None]).long()
    tokens = torch.randint(1, 150_000, (batch, width)) * mask
    labels = torch.where(mask.bool(), tokens, -100)
    positions = cols.expand(batch, width).clone()
    return [t.to(device) for t in (tokens, labels, mask, positions, mask)], lengths


def per_row_loop(tokens, labels, loss_mask, position_ids, padding_mask, m):
    """The obvious implementation: read each row's length on the host, slice, pad, concatenate."""
    pieces = {"tokens": [], "labels": [], "loss_mask": [], "position_ids": []}
    fills = {"tokens": 0, "labels": -100, "loss_mask": 0}
    lengths = []
    for i in range(tokens.shape[0]):
        n = int(padding_mask[i].sum().item())
        if n == 0:
            continue
        padded = -(-n // m) * m
        lengths.append(padded)
        for name, value in (("tokens", tokens), ("labels", labels), ("loss_mask", loss_mask)):
            row = value[i, :n]
            if padded > n:
                row = torch.cat([row, row.new_full((padded - n,), fills[name])])
            pieces[name].append(row)
        pos = position_ids[i, :n]
        if padded > n:
            pos = torch.cat([pos, pos[-1] + torch.arange(1, padded - n + 1, device=pos.device)])
        pieces["position_ids"].append(pos)
    out = {k: torch.cat(v).unsqueeze(0) for k, v in pieces.items()}
    cu = torch.tensor([0] + lengths, device=tokens.device).cumsum(0).to(torch.int32)
    return out, cu


def copy_bound(fields, host_lengths):
    return [torch.cat([value[i, :n] for i, n in enumerate(host_lengths)]) for value in fields]


def time_side_by_side(fns: dict, device: str, min_time: float) -> dict[str, float]:
    """Median seconds per call of each function, calls interleaved round-robin so all share the same noise."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for fn in fns.values():
        for _ in range(3):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    start_all = time.perf_counter()
    while time.perf_counter() - start_all < min_time or len(times[next(iter(fns))]) < 7:
        for name, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t0)
    return {name: float(np.median(values)) for name, values in times.items()}


def count_syncs(fn) -> int:
    """Host syncs of one call, counted by CUDA's sync debug mode (warnings)."""
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--multiple", type=int, default=4, help="pad_to_multiple_of (4 = context parallel 2)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sizes = [2, 8] if args.quick else [2, 8, 32, 128]
    min_time = 0.3 if args.quick else 3.0
    name = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({platform.processor() or platform.machine()}, 1 thread)"

    rows = []
    for mbs in sizes:
        (tokens, labels, loss_mask, positions, mask), lengths = make_batch(mbs, args.width, args.device)

        def ours():
            return pack_batch_sequences(tokens, labels, loss_mask, position_ids=positions, padding_mask=mask,
                                        pad_to_multiple_of=args.multiple)

        # Same semantics: results must agree before anything is timed.
        packed = ours()
        loop_out, loop_cu = per_row_loop(tokens, labels, loss_mask, positions, mask, args.multiple)
        assert torch.equal(packed.tokens, loop_out["tokens"]) and torch.equal(packed.labels, loop_out["labels"])
        assert torch.equal(packed.position_ids, loop_out["position_ids"]) and torch.equal(packed.cu_seqlens_padded, loop_cu)

        host = lengths.tolist()
        timed = time_side_by_side({
            "ours": ours,
            "loop": lambda: per_row_loop(tokens, labels, loss_mask, positions, mask, args.multiple),
            "copy": lambda: copy_bound((tokens, labels, loss_mask, positions), host),
        }, args.device, min_time)
        t_ours, t_loop, t_copy = timed["ours"], timed["loop"], timed["copy"]
        syncs = count_syncs(ours) if args.device == "cuda" else None
        rows.append((mbs, int(lengths.sum()), t_ours, t_loop, t_copy, syncs))

    header = "| micro-batch | real tokens | ours (ms) | per-row loop (ms) | copy bound (ms) | loop / ours | ours / copy bound |"
    if args.device == "cuda":
        header += " host syncs (ours) |"
    lines = [f"# In-batch packing, S={args.width}, pad_to_multiple_of={args.multiple}", "", f"Device: {name}", "",
             header, "|" + "---|" * (header.count("|") - 1)]
    for mbs, real, t_ours, t_loop, t_copy, syncs in rows:
        line = (f"| {mbs} | {real} | {t_ours * 1e3:.3f} | {t_loop * 1e3:.3f} | {t_copy * 1e3:.3f} | "
                f"{t_loop / t_ours:.2f}x | {t_ours / t_copy:.2f}x |")
        if syncs is not None:
            line += f" {syncs} |"
        lines.append(line)
    table = "\n".join(lines)
    print(table)
    if not args.quick:
        RESULTS.mkdir(parents=True, exist_ok=True)
        out = RESULTS / f"in_batch_{args.device}.md"
        out.write_text(table + "\n")
        print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
