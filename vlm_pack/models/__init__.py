"""Model-family registry: what vlm_pack has PROVEN about each Hugging Face family, in one place per family.

Packing is exact only if four rules hold for the model at hand: attention never crosses a sample boundary
(and keeps the family's own pattern inside a sample), positions restart per sample, labels shift inside each
sample, and the loss is normalised like unpacked training. How a family meets them differs (1-D positions or
mRoPE from the model's own ``get_rope_index``; purely causal attention or bidirectional image blocks; full,
sliding or linear-attention layers), so each family registers a :class:`FamilySpec` from its own module
(``vlm_pack/models/<family>.py``), one record per job (``spec.py``), and everything else reads the record it needs:

    data layer        -> EncodingRules (per-token keys, positions, how vision rows split, unlabelled markup)
    enable_packing    -> ModelRules (attention rule, layer kinds, setup hook, loss rule, config checks)
    every other path  -> Proof via :func:`require_proven` (the training paths proven, :data:`PATHS`, or refused)

A model whose family is not registered, or whose config turns on something the spec does not cover, is
refused with an :class:`UnsupportedModelError` naming the family and the missing piece; ``allow_unproven=True``
lets such a model through with a warning (the user then owns the proof). The same holds per training path: a
registered family is proven for in-batch SFT (``Proof.sft``) and for the paths its ``Proof.proven`` names, each with the
test that shows it; any other (family, path) pair is refused by name when the trainer / collator / setup is
built (``allow_unproven=True`` where that entry point offers it: a warning instead), and a pair that cannot work
(:func:`path_refusal`: e.g. linear-attention layers split across ranks) is refused with the reason, always.
"""

from .registry import (
    UnsupportedModelError, UnsupportedVersionError, check_config, families_proven, get_family, path_refusal,
    register_family, registered_families, require_proven, text_backbone, text_config, version_problems,
)
from .spec import (
    PATH_TITLES, PATHS, STATIC_ROPE_TYPES, TEXT_ENCODING, EncodingRules, FamilySpec, ImageBlockRule, ModelRules,
    Positions, Proof, RowUnit, TrainingPath, VisionRows,
)

# The shipped families: each module registers its specs when imported (after the registry above is complete).
from . import (  # noqa: F401
    aria, aya_vision, deepseek_vl, ernie4_5_vl_moe, fast_vlm, gemma3, gemma3n, gemma4, gemma4_unified, glm4v,
    glm4v_moe, glm46v, glm_ocr, granite4_vision, granite_docling, hunyuan_vl, hyperclovax_vision_v2, idefics2,
    idefics3, internvl, kimi_k25, lfm2_vl, lfm3_vl, lighton_ocr, llama, llama4, llava, llava_onevision, minicpmv4_6,
    minicpmv4_7, mistral, mistral4, mllama, molmo2, nemotron_h_omni, ovis2, paddleocr_vl, paligemma, perception_lm,
    phi4_multimodal, qianfan_ocr, qwen2_audio, qwen3_5, qwen3_5_moe, qwen3_vl_moe, qwen_omni, qwen_vl, video_llama_3,
)

__all__ = [
    "PATHS",
    "PATH_TITLES",
    "STATIC_ROPE_TYPES",
    "TEXT_ENCODING",
    "EncodingRules",
    "FamilySpec",
    "ImageBlockRule",
    "ModelRules",
    "Positions",
    "Proof",
    "RowUnit",
    "TrainingPath",
    "UnsupportedModelError",
    "UnsupportedVersionError",
    "VisionRows",
    "check_config",
    "families_proven",
    "get_family",
    "path_refusal",
    "register_family",
    "registered_families",
    "require_proven",
    "text_backbone",
    "text_config",
    "version_problems",
]
