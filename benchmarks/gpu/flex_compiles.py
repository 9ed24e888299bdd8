"""How many distinct FlexAttention compiles the kernels stage's sequence triggers (packed, window, image blocks +
window + softcap, shared prefix, new row lengths), each call's seconds beside dynamo's new-graph count: the input
to the GPU check's time boxes (docs/gpu_check.md "Time boxes"). CPU, forward only under no_grad (CPU flex has no
backward), 4 / 2 heads of dim 64, rows of 1k-4k real ShareGPT lengths. On CPU flex compiles static shapes (one
graph per row length); on CUDA vlm_pack compiles it with dynamic shapes.

    PYTHONPATH=. python -m benchmarks.gpu.flex_compiles
"""

import time

import numpy as np
import torch
import torch._dynamo.utils as du

from benchmarks.gpu import kernels
from benchmarks.gpu.common import draw_lengths
from vlm_pack.attention.shared_prefix import shared_prefix_keys
from vlm_pack.attention.varlen import varlen_attention

torch.manual_seed(0)
H, KV, D = 4, 2, 64


def row(T, seed):
    rng = np.random.default_rng(seed)
    lengths = draw_lengths(rng, T, T // 2)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    q = torch.randn(T, H, D); k = torch.randn(T, KV, D); v = torch.randn(T, KV, D)
    return lengths, cu, q, k, v


def timed(name, fn):
    before = du.counters["stats"]["unique_graphs"]
    t = time.perf_counter()
    with torch.no_grad():
        fn()
    print(f"{name}: {time.perf_counter() - t:.1f} s, new graphs {du.counters['stats']['unique_graphs'] - before}",
          flush=True)


lengths, cu, q, k, v = row(1024, 0)
n = max(lengths)
timed("packed T=1024", lambda: varlen_attention(q, k, v, cu, cu, n, n, backend="flex"))
timed("packed T=1024 again", lambda: varlen_attention(q, k, v, cu, cu, n, n, backend="flex"))
timed("window", lambda: varlen_attention(q, k, v, cu, cu, n, n, backend="flex", window=(63, 0)))
blocks = kernels._image_blocks(lengths, 32)
timed("blocks+window+softcap", lambda: varlen_attention(q, k, v, cu, cu, n, n, backend="flex", window=(63, 0),
                                                        block_ids=blocks, softcap=5.0))
layout = shared_prefix_keys(lengths, kernels._pair_prefixes(lengths))
idx = layout["key_index"]
timed("shared_prefix (Tq != Tk)", lambda: varlen_attention(q, k.index_select(0, idx), v.index_select(0, idx), cu,
                                                           layout["cu_seqlens_k"], n, layout["max_length_k"],
                                                           backend="flex"))
for T in (2048, 4096):
    lengths, cu, q, k, v = row(T, T)
    n = max(lengths)
    timed(f"packed T={T}", lambda: varlen_attention(q, k, v, cu, cu, n, n, backend="flex"))
