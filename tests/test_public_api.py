"""Every name vlm_pack exports resolves (lazy ones included), and the console script lists its subcommands."""

import pytest

import vlm_pack
from vlm_pack.cli.main import SUBCOMMANDS, build_parser


# The names `from vlm_pack import ...` has offered since 0.1 (issue 29 moved their modules, not these names).
PUBLIC = [
    'ATTN_IMPLEMENTATION', 'BalancedBatchSampler', 'BalancedPackingSampler', 'CollatorStats',
    'METADATA_KEY', 'PackedBatch', 'PackedDataset', 'PackedEvaluation', 'PackedSFTDataset',
    'PackedSFTTrainer', 'PackedSeqParams', 'PackedSequenceSpecs', 'PackingConfig', 'SampleMeanLoss',
    'SamplePrediction', 'VLMPackingCollator', 'available_backends', 'compute_loss_func', 'enable_packing',
    'gather_from_context_parallel', 'get_packed_seq_params', 'model_inputs', 'pack_batch_sequences',
    'pack_sequences', 'packed_cross_entropy', 'pad_multiple', 'partition_for_context_parallel',
    'prepare_packed_sequence_data', 'reduce_per_sample_mean_loss', 'reduce_per_token_loss',
    'register_attention', 'shift_packed_labels', 'split_predictions', 'to_hf_dataset', 'varlen_attention',
]


def test_exports_are_kept():
    assert set(PUBLIC) <= set(vlm_pack.__all__)


@pytest.mark.parametrize("name", sorted(set(vlm_pack.__all__) | set(PUBLIC)))
def test_export_resolves(name):
    exec(f"from vlm_pack import {name}", {})
    assert getattr(vlm_pack, name) is not None


def test_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        vlm_pack.nope


def test_cli_has_every_subcommand():
    help_text = build_parser().format_help()
    assert all(name in help_text for name in SUBCOMMANDS)


def test_library_never_imports_the_fixtures():
    """Every module of the library but the demo (a user of it) imports without loading ``vlm_pack.testing``."""
    import pkgutil
    import subprocess
    import sys

    import vlm_pack

    modules = [m.name for m in pkgutil.walk_packages(vlm_pack.__path__, "vlm_pack.")
               if not m.name.startswith("vlm_pack.testing") and m.name not in ("vlm_pack.cli.demo", "vlm_pack.__main__")]
    code = ("import importlib, sys\n"
            f"for name in {modules!r}:\n    importlib.import_module(name)\n"
            "print(sorted(m for m in sys.modules if m.startswith('vlm_pack.testing')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
