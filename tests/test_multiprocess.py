"""Two real processes (gloo, CPU): the training stacks users combine are exact, and the sampler works in Trainer.

One ``torch.distributed.run`` launch of tests/_multiprocess_worker.py runs every case in sequence (process start
and imports dominate the cost). Each exactness case compares rank 0's step-1 gradient (after DDP / FSDP's
reduction) or one SGD weight update (ZeRO hides ``.grad``) with every sample of the global batch run ALONE
through the stock sdpa model, loss = token mean over both ranks and the whole accumulation window
(tests/test_trainer.py's references): relative L2 < 1e-4 in fp32. Each case also reports the engine that really
ran, so a silent fallback (e.g. ``TrainingArguments(fsdp=...)`` runs DDP on CPU) cannot pass for another.
The sequence-parallel cases (DeepSpeed Ulysses, SP = 2, ZeRO-3, vlm_pack.sequence_parallel; one case per family,
all in this launch) run last and add about 35 s (5 original cases) + about 55 s (7 more families, measured on a
loaded 2-core machine) to the launch. Under ZeRO-3 (zero3 and every SP case) the loss is vlm_pack's chunked one on
the partitioned head (each result names what the forward returned); the planted lost head gradient and the refused
FSDP2 head sharded on its own add about 5 s.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from filelock import FileLock
from tolerance import GRAD_REL_L2

from vlm_pack.core.versions import has

DDP_CASES = ("ddp_vlm", "ddp_packed_dataset", "ddp_packed_sft", "ddp_token_budget")
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
# Ulysses through Trainer is refused before transformers 5.24 (vlm_pack.core.versions GAPS; tests/test_versions.py)
HAS_ULYSSES = HAS_DEEPSPEED and has("ulysses_trainer")
SP_CASES = ("sp_text", "sp_token_budget", "sp_video", "sp_qwen3_vl",
            *(f"sp_{family}" for family in ("qwen2", "qwen3", "mistral", "glm4v", "internvl", "llava_onevision",
                                            "mistral3", "idefics3")))
SP_CORRUPTIONS = ("sp_positions_not_restarted", "sp_loss_per_rank_mean", "sp_vision_tower_sliced",
                  "sp_cpu_without_use_cpu")
# ZeRO cases last: once ZeRO-3 is configured, transformers builds every later model partitioned; sequence
# parallelism (ZeRO-3, DeepSpeed's SP groups) after them.
STREAM_CASES = ("stream_2_files", "stream_error")
CASES = (*DDP_CASES, "ddp_per_rank_mean", "fsdp2", "fsdp2_sharded_head", "sampler", *STREAM_CASES,
         *(("zero2", "zero3", "zero3_head_grad_dropped") if HAS_DEEPSPEED else ()),
         *((*SP_CASES, *SP_CORRUPTIONS) if HAS_ULYSSES else ()))
pytestmark = pytest.mark.slow  # multi-process (CI runs slow tests too)
LAUNCH_TIMEOUT_S = 900  # generous: two processes import torch + transformers and train on a loaded 2-core box


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """One launch per session, also under pytest-xdist: the first worker to get here launches (both cores busy),
    another waits on the lock and reads the same file."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the session's directory, common to all its xdist workers
    output = shared / "multiprocess_results.json"
    with FileLock(str(shared / "multiprocess.lock")):
        if not output.exists():
            worker = Path(__file__).resolve().parent / "_multiprocess_worker.py"
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                       str(worker), str(output), *CASES]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
            if done.returncode != 0 or not output.exists():
                log = (done.stdout + done.stderr)[-6000:]
                pytest.fail(f"2-process worker failed (exit {done.returncode}):\n{log}")
    return json.loads(output.read_text())


@pytest.mark.parametrize("case", DDP_CASES)
def test_trainer_ddp_equals_each_sample_alone(results, case):
    """VLM collator, PackedDataset, PackedSFTDataset, token-budget packs: Trainer + DDP, default arguments."""
    got = results[case]
    assert got["engine"] == "DistributedDataParallel"
    assert got["error"] < GRAD_REL_L2, got


def test_token_mean_is_global_by_default_and_per_rank_mean_warns(results):
    """The PackedSFTDataset run again with ``average_tokens_across_devices=False``: the mean of per-rank token
    means, measurably wrong, and one warning naming the flag. The default is exact (above) and silent."""
    assert results["ddp_vlm"]["warnings"] == results["ddp_packed_sft"]["warnings"] == []
    per_rank = results["ddp_per_rank_mean"]
    assert per_rank["error"] > 1e-3, per_rank  # 1.6e-2 measured: the comparison detects the per-rank mean
    assert len(per_rank["warnings"]) == 1
    assert "average_tokens_across_devices=True" in per_rank["warnings"][0]


def test_fsdp2_fully_shard_equals_each_sample_alone(results):
    """Training mode, so the loss is vlm_pack's chunked one (the head sharded with the root: a plain weight inside
    the forward)."""
    got = results["fsdp2"]
    assert got["engine"].startswith("FSDP") and got["sharded"], got  # torch's fully_shard really ran
    assert got["head_loss"] == ["DeferredLogits"], got
    assert got["error"] < GRAD_REL_L2, got


def test_fsdp2_head_sharded_on_its_own_is_refused_by_name(results):
    """``fully_shard(model.lm_head)``: the head's weight is a DTensor when the loss reads it, so every chunk's call
    (and its recompute in the backward) would all-gather it; that 2-process run hung. Refused at the first loss,
    naming the head and the fixes."""
    refused = results["fsdp2_sharded_head"]["refused"]
    assert "FSDPLinear whose weight an engine shards" in refused, refused
    assert "enable_packing(model, chunked_loss=False)" in refused, refused


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed (the test extra installs it)")
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_through_trainer_equals_each_sample_alone(results, stage):
    """The chunked loss (logits deferred), under ZeRO-3 on the partitioned head: read once per loss inside the
    forward, its gradient reaching the partition."""
    got = results[f"zero{stage}"]
    assert (got["engine"], got["stage"]) == ("DeepSpeedEngine", stage)
    assert got["head_loss"] == ["DeferredLogits zero3" if stage == 3 else "DeferredLogits"], got
    assert got["error"] < GRAD_REL_L2, got


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed (the test extra installs it)")
def test_zero3_head_gradient_lost_is_caught(results):
    """Planted bug: the fused path's head gradient handed back as zeros under ZeRO-3 (0.22 measured)."""
    got = results["zero3_head_grad_dropped"]
    assert got["head_loss"] == ["DeferredLogits zero3"], got
    assert got["error"] > 1e-2, got


def test_balanced_sampler_in_trainer_covers_every_sample_once_and_resumes(results):
    """BalancedBatchSampler through Trainer on 2 ranks: 32 samples, 8 micro-batches of 2 per rank and epoch.
    Every epoch holds every sample exactly once across the ranks (none dropped by accelerate's re-sharding),
    epochs differ (set_epoch reaches the sampler), and a run resumed from the step-6 checkpoint (mid epoch 1)
    consumes exactly the micro-batches the uninterrupted run had left."""
    got = results["sampler"]
    assert got["batch_sampler"] == "BalancedBatchSampler"  # accelerate's wrapper passes it through
    assert got["steps"] == 8  # 2 epochs x 4 optimizer steps: len() is what Trainer planned with
    ranks = got["ranks"]
    assert all(len(rank["full"]) == 16 and all(len(mb) == 2 for mb in rank["full"]) for rank in ranks)
    epochs = [sorted(i for rank in ranks for mb in rank["full"][e * 8:(e + 1) * 8] for i in mb) for e in (0, 1)]
    assert epochs == [list(range(32))] * 2
    assert ranks[0]["full"][:8] != ranks[0]["full"][8:]
    for rank in ranks:
        assert rank["resumed"] == rank["full"][12:]


@pytest.mark.skipif(not HAS_ULYSSES, reason="deepspeed is not installed, or transformers < 5.24 (Ulysses refused)")
@pytest.mark.parametrize("case", SP_CASES)
def test_ulysses_sequence_parallel_equals_each_sample_alone(results, case):
    """SP = 2 (DeepSpeed Ulysses through UlyssesTrainer + ParallelismConfig, ZeRO-3): Llama, Qwen2, Qwen3 and
    Mistral on offline packs (prompts masked); Qwen2-VL with images on four token-budget packs (accumulation 4);
    rows of several examples (grouped_rows, accumulation 2, two rows of different label counts): Qwen2.5-VL with
    videos, Qwen3-VL (2 text
    layers) with images (deepstack sliced with the row: a rank taking the first deepstack rows instead of its own
    gives 3.9e-2), GLM-4V, InternVL (tiles), LLaVA-OneVision (anyres
    crops), Mistral3 (Pixtral) and Idefics3 (per-sample tile stacks) with images. The weight update is that of the
    global token mean of all samples, each run alone through the stock sdpa model (parameters the reference leaves
    without gradient, e.g. an unused SigLIP head, must not move). Each rank's summed CE is the chunked loss over
    its slice, formed inside the forward on the ZeRO-3-partitioned head."""
    got = results[case]
    assert (got["engine"], got["stage"], got["sp"]) == ("DeepSpeedEngine", 3, 2), got
    assert got["head_loss"] == ["DeferredLogits zero3"], got  # the chunked loss on the ZeRO-3-partitioned head
    assert got["error"] < GRAD_REL_L2, got


@pytest.mark.skipif(not HAS_ULYSSES, reason="deepspeed is not installed, or transformers < 5.24 (Ulysses refused)")
def test_ulysses_corruptions_are_caught(results):
    """Planted bugs: the row's boundaries dropped with positions counting on (samples attend to each other:
    1.3 measured), each rank's own token mean (0.24 measured), the vision tower under the Ulysses wrapper
    (DeepSpeed's assertion: the tower's attention gets no position_ids)."""
    assert results["sp_positions_not_restarted"]["error"] > 1e-2, results["sp_positions_not_restarted"]
    assert results["sp_loss_per_rank_mean"]["error"] > 1e-2, results["sp_loss_per_rank_mean"]
    assert "position_ids" in results["sp_vision_tower_sliced"]["failed"], results["sp_vision_tower_sliced"]


@pytest.mark.skipif(not HAS_ULYSSES, reason="deepspeed is not installed, or transformers < 5.24 (Ulysses refused)")
def test_ulysses_on_cpu_with_trainer_defaults_is_refused_when_built(results):
    """``use_cpu`` left at Trainer's default on CPU: accelerate counts 1 of the 2 processes (the gloo all-gather of
    the token count crashed; all-reduced directly, the update was off by 0.80). Refused when UlyssesTrainer is
    built, naming the fix."""
    refused = results["sp_cpu_without_use_cpu"]["refused"]
    assert "accelerate counts 1 process(es) but torch.distributed runs 2" in refused, refused
    assert refused.endswith("on CPU pass TrainingArguments(use_cpu=True)"), refused


def test_streaming_packs_in_trainer_once_per_epoch_equal_steps_and_resume(results):
    """vlm_pack.streaming through Trainer on 2 ranks x 2 workers over 2 JSONL files of 18 and 22 chats (fewer files
    than the 4 units: each keeps every 4th row of every file; tests/test_streaming_packs.py runs one file and whole
    shards at 2 ranks x 2 workers without a launch), accumulation 2, 9 steps: each epoch
    holds every sample exactly once across the ranks (accelerate's IterableDatasetShard passed through), both ranks
    start each epoch at the same micro-batch (the rank with less data trains loss-free packs meanwhile, nothing
    repeated), and the runs resumed from copies of checkpoint-3 (first pass) and checkpoint-6 (second pass) in
    another folder forward exactly what the uninterrupted run had left, on both ranks (deterministic per seed)."""
    got = results["stream_2_files"]
    ranks = got["ranks"]
    assert len(ranks[0]["full"]) == len(ranks[1]["full"]) == 18  # 9 steps x accumulation 2 on each rank
    starts = [[next(i for i, x in enumerate(rank["full"]) if x != "pad" and x[0] == e) for e in (1, 2)]
              for rank in ranks]
    assert starts[0] == starts[1]
    assert 2 * 3 < starts[0][0] <= 2 * 6  # checkpoint-3 is in the first pass, checkpoint-6 in the second
    for epoch in (0, 1):
        keys = [tuple(k) for rank in ranks for x in rank["full"] if x != "pad" and x[0] == epoch for k in x[1]]
        assert len(keys) == len(set(keys)) == got["samples"], epoch
    for rank in ranks:
        for step in ("3", "6"):
            assert rank["resumed"][step] == rank["full"][2 * int(step):], step


def test_a_data_error_on_one_rank_stops_every_rank(results):
    """Rank 1's stream has a chat with nothing to train on (line 20 of its file): rank 1 stops with that error,
    naming the file and line, and rank 0 stops at the same pull with an error naming rank 1, instead of waiting
    in the next collective (the per-pull agreement carries an error flag)."""
    got = results["stream_error"]
    rank0, rank1 = got["ranks"]
    assert rank1["error"] and f"{got['bad_file']} line 20: " in rank1["error"], rank1
    assert rank0["error"] and "rank 1 failed reading its streaming packs" in rank0["error"], rank0
    assert max(rank0["seconds"], rank1["seconds"]) < 120, got  # bounded: a hang would wait the 30-minute timeout
