"""``vlm-pack doctor`` / ``python -m vlm_pack.cli.doctor``: what each attention backend would do on this machine, and why.

For bug reports: versions of the packages packing depends on, whether CUDA is visible, every varlen attention
backend's probe (a real import, so a broken wheel shows its error), what ``backend="auto"`` picks per device and
dtype, and the linear-attention (Gated DeltaNet) route.
"""

from __future__ import annotations

import argparse
import platform
import sys

from ..core.versions import warn_unproven_once

PACKAGES = ("torch", "transformers", "accelerate", "trl", "flash-attn", "transformer-engine",
            "flash-linear-attention", "megatron-core", "triton")


def _version(package: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def report() -> str:
    """The doctor's text (imports torch and probes every backend: seconds, not milliseconds)."""
    import torch

    from ..attention.varlen import BACKENDS, available_backends, select_backend
    from ..attention.linear import fla_error, select_linear_backend

    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if cuda else "none"
    lines = [f"python {platform.python_version()} on {platform.platform()}",
             *(f"{package}: {_version(package)}" for package in PACKAGES),
             f"CUDA available: {cuda} (device: {device})", "", "attention backends (varlen_attention):"]
    for name, status in available_backends().items():
        lines.append(f"  {name:<18} {'yes' if status.available else 'no ':<3}  {status.reason}")
    lines += ["", "backend='auto' picks:"]
    devices = ("cpu", "cuda") if cuda else ("cpu",)
    for dev in devices:
        for dtype in (torch.float32, torch.bfloat16):
            text, blocks = select_backend(dev, dtype), select_backend(dev, dtype, image_blocks=True)
            capped = select_backend(dev, dtype, softcap=True)
            lines.append(f"  {dev} {str(dtype).replace('torch.', ''):<9} -> {text} (with image blocks: {blocks}; "
                         f"with logit softcapping: {capped})")
    if not cuda:
        lines.append("  cuda: not visible here; on a GPU, fp16/bf16 go to the first available of "
                     f"{[b for b in BACKENDS if b not in ('flex', 'sdpa_segments')]}")
    fla = fla_error() if cuda else "not probed (CPU only: the exact torch path runs)"
    lines += ["", "linear attention (Gated DeltaNet):",
              f"  auto -> {select_linear_backend('cuda' if cuda else 'cpu')}; fla: {fla or 'usable'}"]
    newer = warn_unproven_once()
    lines += ["", f"proven releases: {newer}" if newer else "proven releases: the installed ones are in range"]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    print(report())
    return 0


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "doctor", help="print what each attention backend would do here, and why",
        description="Print the installed versions of torch, transformers and the optional kernels, each attention "
                    "backend's probe result (and why it is unavailable), what 'auto' picks per device and dtype, and "
                    "the Gated DeltaNet route: paste it into bug reports.")
    parser.set_defaults(func=run)


if __name__ == "__main__":
    sys.exit(run(argparse.Namespace()))
