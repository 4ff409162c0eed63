"""gpu_worker/cuda_graphs.py off a GPU: the static buffers, the padding rows and their scratch
block, and a smaller batch after a larger one, run eagerly over the same buffers a captured
graph reads (the capture itself needs CUDA; bench/gpu_check.sh times it on a GPU). Our Triton
kernel runs under TRITON_INTERPRET=1 (set by conftest.py)."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (pip install triton, in the dev extra)",
                allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 on CPU", allow_module_level=True)

from gpu_worker.attention import Chunk, build_attention_metadata, select_backend  # noqa: E402
from gpu_worker.cuda_graphs import DecodeGraphs, capture_sizes  # noqa: E402
from gpu_worker.kv_cache import allocate_kv_cache  # noqa: E402
from gpu_worker.model.llama import LlamaForCausalLM  # noqa: E402
from gpu_worker.parallel import SINGLE  # noqa: E402
from shared.model_config import ModelConfig  # noqa: E402

BS = 4


def _model():
    cfg = ModelConfig("LlamaForCausalLM", 97, 64, 96, 2, 4, 2, 16, 1e4, 1e-5, 256, False, 1, 2)
    model = LlamaForCausalLM(cfg, SINGLE).eval()
    model.init_random(std=0.2, seed=3)
    return cfg, model


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(64)[-3:] == [48, 56, 64]


def test_padded_replay_equals_the_eager_forward():
    cfg, model = _model()
    backend = select_backend("triton", "cpu", BS)
    blocks = 40
    caches = allocate_kv_cache(cfg, blocks + 1, BS, cfg.num_kv_heads, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(0)
    for k, v in caches:                                   # a cache already holding history
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
    graphs = DecodeGraphs(model, caches, backend, BS, max_blocks_per_seq=8, scratch_block=blocks,
                          device="cpu", sizes=[1, 4, 8])
    perm = torch.randperm(blocks, generator=gen).tolist()
    tables = [perm[0:5], perm[5:12], perm[12:14]]
    for chunks in ([Chunk(1, 17, tables[0]), Chunk(1, 26, tables[1]), Chunk(1, 6, tables[2])],
                   [Chunk(1, 18, tables[0])],                    # smaller after larger
                   [Chunk(1, 19, tables[0]), Chunk(1, 7, tables[2])]):
        ids = torch.randint(0, cfg.vocab_size, (len(chunks),), generator=gen)
        before = [(k.clone(), v.clone()) for k, v in caches]
        size = graphs.size_for(chunks)
        assert size == {1: 1, 2: 4, 3: 4}[len(chunks)]
        got = graphs.run(ids, chunks, size)
        graphed_caches = [(k.clone(), v.clone()) for k, v in caches]
        for (k, v), (k0, v0) in zip(caches, before):         # again, eagerly, from the same cache
            k.copy_(k0)
            v.copy_(v0)
        meta = build_attention_metadata(chunks, BS, "cpu", torch.float32)
        with torch.inference_mode():
            want = model(ids, caches, meta, backend)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for (k, v), (kg, vg) in zip(caches, graphed_caches):
            # the real rows' K/V are written alike; padding touched the scratch block only
            torch.testing.assert_close(kg[:blocks], k[:blocks], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(vg[:blocks], v[:blocks], rtol=1e-5, atol=1e-5)


def test_not_for_prefill_or_a_context_past_the_buffers():
    cfg, model = _model()
    caches = allocate_kv_cache(cfg, 9, BS, cfg.num_kv_heads, torch.float32, "cpu")
    graphs = DecodeGraphs(model, caches, select_backend("triton", "cpu", BS), BS, 2, 8, "cpu",
                          [1, 2])
    assert graphs.size_for([Chunk(3, 3, [0])]) is None                  # a prefill chunk
    assert graphs.size_for([Chunk(1, 9, [0, 1, 2])]) is None             # past 2 blocks of 4
    assert graphs.size_for([Chunk(1, 2, [0])] * 3) is None               # past the largest
    assert graphs.size_for([Chunk(1, 8, [0, 1])]) == 1
