"""What every stage of the GPU check shares: its context (dry run or not, device, partial results), the real
length histogram, timing with peak memory, model FLOPs and the GPU's bf16 peak.

A stage is a module of this folder with ``run(ctx) -> Result``; it raises :class:`Skip` when something it needs
is missing (the reason goes into the report) and calls ``ctx.save(data)`` after every finished unit of work, so a
stage killed by its time box still leaves what it measured.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
LENGTHS_TSV = ROOT / "benchmarks" / "data" / "sharegpt_lengths.tsv"

# Dense bf16 tensor-core peak (TFLOP/s, no sparsity) by device name, most specific first.
BF16_PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0), ("H20", 148.0),
                    ("GH200", 989.0), ("B200", 2250.0), ("A100", 312.0), ("L40S", 362.0), ("A10G", 70.0))


class Skip(Exception):
    """The stage cannot run here; the message says why (a missing package, no CUDA device)."""


@dataclass
class Result:
    """A stage's section: markdown lines for the report and the numbers for the JSON. ``checks``: named
    pass / fail verdicts the report lists at the top."""

    markdown: list[str]
    data: dict[str, Any]
    checks: dict[str, bool] = field(default_factory=dict)


@dataclass
class Context:
    dry: bool
    device: str
    partial_path: Path | None = None
    deadline: float = math.inf

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def save(self, data: dict[str, Any]) -> None:
        """Record what the stage measured so far (read back if the stage dies or runs out of time)."""
        if self.partial_path is not None:
            tmp = self.partial_path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"partial": finite(data)}))
            os.replace(tmp, self.partial_path)

    def seconds_left(self) -> float:
        return self.deadline - time.monotonic()


def require(module: str, package: str | None = None) -> Any:
    """Import ``module`` or skip the stage naming the PyPI package (carried by scripts/gpu_wheels.sh)."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise Skip(f"needs {package or module} ({type(error).__name__}: {error})") from error


def require_cuda(ctx: Context) -> None:
    if ctx.cuda and not torch.cuda.is_available():
        raise Skip("no CUDA device visible (run `bash benchmarks/gpu/run.sh --dry-run` on a CPU machine)")


def finite(value: Any) -> Any:
    """JSON-safe copy: a non-finite float becomes the string 'nan' / 'inf' (visible, never a silent number)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    if isinstance(value, (np.floating, np.integer)):
        return finite(value.item())
    return value


# ---------------------------------------------------------------- real lengths

def sharegpt_histogram() -> tuple[np.ndarray, np.ndarray]:
    """(lengths, counts) of the shipped ShareGPT token-length histogram (benchmarks/sharegpt_lengths.py)."""
    table = np.loadtxt(LENGTHS_TSV, dtype=np.int64, ndmin=2)
    return table[:, 0], table[:, 1]


def draw_lengths(rng: np.random.Generator, budget: int, cap: int, floor: int = 8) -> list[int]:
    """Sample lengths from the real histogram (clipped to ``[floor, cap]``, as ``--max-seq-length`` truncation
    would) until they fill ``budget`` tokens; the last one is cut to fit."""
    lengths, counts = sharegpt_histogram()
    out, used = [], 0
    while used < budget:
        n = int(np.clip(rng.choice(lengths, p=counts / counts.sum()), floor, cap))
        n = min(n, budget - used)
        out.append(n)
        used += n
    return out


# ---------------------------------------------------------------- timing and memory

def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(fn: Callable[[], Any], device: str) -> tuple[float, float | None]:
    """(seconds, peak MiB allocated during the call; None on CPU) of one call of ``fn``."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    fn()
    synchronize(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None
    return seconds, peak


def timed_repeats(fn: Callable[[], Any], device: str, *, min_repeats: int = 10, max_repeats: int = 200,
                  max_seconds: float = 3.0, target_spread: float = 0.05) -> dict[str, float]:
    """Median milliseconds of ``fn`` over enough calls for a stated spread: CUDA events around each call on the GPU
    (no host sync inside the timed region), wall clock on CPU. Repeats until the interquartile range is within
    ``target_spread`` of the median (after ``min_repeats``), ``max_repeats`` or ``max_seconds``; returns
    ``{"ms", "spread", "repeats"}`` (spread: IQR / median, the figure the report states)."""
    times: list[float] = []
    start = time.perf_counter()
    while True:
        if device == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        else:
            tick = time.perf_counter()
            fn()
            times.append((time.perf_counter() - tick) * 1e3)
        q1, median, q3 = np.percentile(times, [25, 50, 75])
        spread = float((q3 - q1) / median) if median > 0 else 0.0
        if len(times) >= max_repeats or time.perf_counter() - start > max_seconds or (
                len(times) >= min_repeats and spread <= target_spread):
            return {"ms": float(median), "spread": spread, "repeats": len(times)}


def error_text(error: BaseException) -> str:
    """``Type: first line`` of an exception (what a report cell can hold)."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:240] if text else ''}"


@contextlib.contextmanager
def recorded(row: dict[str, Any], device: str):
    """Run one route / measurement; an exception is written into ``row["error"]`` (out-of-memory named as such),
    its traceback to the log, and the stage goes on with the next one."""
    try:
        yield row
    except Exception as error:  # noqa: BLE001 - recorded, never hidden
        print(f"--- recorded failure ({', '.join(f'{k}={v}' for k, v in row.items() if isinstance(v, (str, int)))}):",
              file=sys.stderr, flush=True)
        traceback.print_exc()
        row["error"] = ("out of memory: " if is_oom(error) else "") + error_text(error)
        release(device)


def is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower()


def release(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def bf16_peak_tflops(device: str) -> tuple[float | None, str]:
    """The GPU's dense bf16 peak and its name (None when the name is not in the table or on CPU)."""
    if device != "cuda":
        return None, "cpu"
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in BF16_PEAK_TFLOPS if key in name), None), name


def linear_weights(module: torch.nn.Module, *, vision: bool) -> int:
    """Multiply-adds per token of the ``nn.Linear`` layers of the language model (+ LM head), or of the vision
    tower (modules named ``visual``)."""
    total = 0
    for name, sub in module.named_modules():
        if isinstance(sub, torch.nn.Linear) and (".visual." in f".{name}.") == vision:
            total += sub.in_features * sub.out_features
    return total


def fmt(value: Any, spec: str = ".2f") -> str:
    if value is None:
        return "n/a"
    if isinstance(value, str):
        return value
    return format(value, spec)


def table(header: list[str], rows: list[list[Any]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(str(cell) for cell in row) + " |" for row in rows)]
