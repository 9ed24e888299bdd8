"""Stage g: ``torch.compile`` of a packed model on the device: recompiles over 20 packed batches (fixed width and
variable width) with dynamo's reasons, and the compiled / eager step ratio. The code is benchmarks/compile.py's
(tiny Qwen3 with ``enable_packing``, fp32 forward + backward), run on the GPU with inductor; the dry run traces
fixed-width rows with the ``eager`` backend (dynamo's guards and recompiles without inductor's compile time)."""

from __future__ import annotations

from benchmarks.gpu.common import Context, Result, recorded, require_cuda, table


def run(ctx: Context) -> Result:
    require_cuda(ctx)
    from benchmarks import compile as compile_benchmark

    batches, rounds, backend = (3, 1, "eager") if ctx.dry else (20, 2, "inductor")
    results, failed = [], []
    for mode in ("fixed",) if ctx.dry else ("fixed", "variable"):
        row = {"mode": mode}
        with recorded(row, ctx.device):
            results.append(compile_benchmark.run(mode, batches, rounds, backend, device=ctx.device))
        if "error" in row:
            failed.append(row)
        ctx.save({"backend": backend, "results": results, "failed": failed})
    lines = [f"{batches} packed rows per mode, backend `{backend}`, {rounds} interleaved timing round(s).", ""]
    lines += table(["rows", "widths", "first compile s", "recompiles (all / vlm_pack)", "per batch after the first",
                    "eager ms", "compiled ms", "compiled / eager"],
                   [[r["mode"], len(r["widths"]), r["first_compile_s"], f"{r['recompiles']} / {r['recompiles_vlm_pack']}",
                     r["recompiles_per_batch_after_first"], r["eager_step_ms"], r["compiled_step_ms"],
                     r["compiled_over_eager"]] for r in results])
    lines += ["", "Recompile reasons:", ""] + [f"- {r['mode']}: {reason}" for r in results for reason in r["reasons"]]
    lines += [f"- {r['mode']}: FAILED {r['error']}" for r in failed]
    checks = {f"{r['mode']}: no recompile after the second batch": not any(r["recompiles_per_batch_after_first"][1:])
              for r in results}
    checks.update({f"{r['mode']} ran": False for r in failed})
    return Result(lines, {"backend": backend, "results": results, "failed": failed}, checks)
