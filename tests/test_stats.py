"""`vlm-pack stats`: numbers users plug in, a real PNG, pack-size advice."""

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vlm_pack.cli.main import main
from vlm_pack.cli.stats import analyse_lengths, suggest_pack_size

SAMPLE = Path(__file__).resolve().parents[1] / "examples" / "data" / "sft_sample.jsonl"


def test_known_lengths_reports():
    lengths = np.array([5, 3, 3, 2, 2, 1])  # 16 tokens
    small, large = analyse_lengths(lengths, [8, 16], global_batch_size=12)
    assert (small.stats.num_packs, small.stats.packing_efficiency) == (2, 100.0)
    assert small.stats.packing_factor == 3.0 and small.micro_batches_per_step == 4.0
    assert (large.stats.num_packs, large.stats.packing_efficiency) == (1, 100.0)
    assert small.fill.tolist() == [1.0, 1.0]
    assert suggest_pack_size([small, large]) == 8


def test_pack_sizes_below_longest_sample_are_skipped_or_rejected():
    assert [r.stats.pack_size for r in analyse_lengths(np.array([9, 1]), [4, 16], global_batch_size=1)] == [16]
    with pytest.raises(ValueError, match="longest sample has 9 tokens"):
        analyse_lengths(np.array([9, 1]), [4, 8], global_batch_size=1)


def test_suggests_most_efficient_when_none_reaches_target():
    lengths = np.array([6, 6, 6])
    reports = analyse_lengths(lengths, [8, 13], global_batch_size=1)  # 75% and ~69%
    assert suggest_pack_size(reports) == 8


def test_cli_on_shipped_jsonl_writes_png(tmp_path, capsys):
    png = tmp_path / "stats.png"
    assert main(["stats", str(SAMPLE), "--pack-sizes", "2048", "4096", "--plot", str(png),
                 "--global-batch-size", "64"]) == 0
    out = capsys.readouterr().out
    assert "| 2048 |" in out and "| 4096 |" in out and "suggested pack size:" in out
    image = Image.open(png)
    assert image.size[0] >= 800 and image.size[1] >= 300
    pixels = np.asarray(image.convert("L"))
    assert pixels.std() > 5  # drawn content, not a blank canvas


def test_cli_on_npy_lengths(tmp_path, capsys):
    path = tmp_path / "lengths.npy"
    np.save(path, np.array([5, 3, 3, 2, 2, 1]))
    assert main(["stats", str(path), "--pack-sizes", "8", "--plot", str(tmp_path / "p.png")]) == 0
    assert "| 8 | 2 | 3.00 | 100.00 |" in capsys.readouterr().out


def test_cli_rejects_bad_lengths_file(tmp_path, capsys):
    path = tmp_path / "lengths.npy"
    np.save(path, np.array([[1.5, 2.0]]))
    assert main(["stats", str(path), "--plot", str(tmp_path / "p.png")]) == 2
    assert "1-D integer array" in capsys.readouterr().err
