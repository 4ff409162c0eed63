"""CUDA graphs for decode iterations (docs/gpu.md#cuda-graphs).

An iteration of decodes alone launches the same kernels every step; only the batch size and
the values in a few small tensors change (token ids, positions, slots, KV lengths, block
tables). So at start-up one graph is captured per padded batch size over static buffers, and
a decode iteration copies its inputs into those buffers and replays the graph of the smallest
size that holds it: one launch instead of ~15–20 kernels per layer, and no Python between
them.

Padding rows (batch B run in the graph of size P > B) must not disturb the real ones: they
read token 0 at position 0, write their K/V into a scratch block the scheduler never hands
out (the last block of the pool, which the runner allocates one larger), and attend that one
slot. Rows are independent everywhere but in attention, so the real rows' results are what an
eager forward of B rows gives.

Only the attention backends whose launch reads lengths from device memory can be captured:
our Triton kernel (its grid depends on the batch size and on max_seqlen_q = 1 alone). Not with
a tensor-parallel group (the collectives are not captured here) nor while P/D streams K/V
layer by layer (a host callback per layer).
"""
from __future__ import annotations

import time

import numpy as np
import structlog
import torch

from gpu_worker.attention import AttentionMetadata, Chunk

log = structlog.get_logger("worker")

CAPTURABLE_BACKENDS = ("triton",)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Padded batch sizes: 1, 2, 4, 8, then every multiple of 8 up to max_num_seqs (vLLM's
    spacing): at most 7 padding rows once past 8."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs + 8, 8))
    return sorted({min(s, max_num_seqs) for s in sizes})


class DecodeGraphs:
    def __init__(self, model, kv_caches, backend, block_size: int, max_blocks_per_seq: int,
                 scratch_block: int, device: str, sizes: list[int]):
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.block_size, self.scratch = block_size, scratch_block
        self.device = device
        self.sizes = sorted(sizes)
        n, w = self.sizes[-1], max_blocks_per_seq
        on_gpu = torch.device(device).type == "cuda"
        # the step's inputs reach the GPU as two copies from page-locked host buffers: rows
        # (ids, positions, slots, KV lengths) of int64 for every buffered row, and the block
        # tables of the rows run; each buffer is filled whole on the host, padding included
        # a padding row: token 0 at position 0, its K/V to the scratch block, one key
        self.padding_row = np.array([[0], [0], [scratch_block * block_size], [1]])
        self.host_rows = torch.empty((4, n), dtype=torch.int64, pin_memory=on_gpu)
        self.host_rows.numpy()[:] = self.padding_row
        self.host_tables = torch.full((n, w), scratch_block, dtype=torch.int32,
                                      pin_memory=on_gpu)
        self.copied = torch.cuda.Event() if on_gpu else None
        self.rows_buf = self.host_rows.to(device, copy=True)
        self.ids, self.positions, self.slots, self.kv_lens = self.rows_buf
        self.tables = self.host_tables.to(device, copy=True)
        self.cu_q = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.rows = torch.arange(n, dtype=torch.int64, device=device)
        self.max_len = w * block_size
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if on_gpu:
            self._capture()
        # elsewhere (tests on CPU) `run` fills the same buffers and runs the model eagerly
        # over them: everything but the capture itself

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            positions=self.positions[:size], slot_mapping=self.slots[:size],
            sample_rows=self.rows[:size], groups=[], cu_seqlens_q=self.cu_q[:size + 1],
            seqused_k=self.kv_lens[:size], block_table=self.tables[:size], max_seqlen_q=1,
            max_seqlen_k=self.max_len)

    @torch.inference_mode()
    def _capture(self) -> None:
        t0, before = time.perf_counter(), torch.cuda.memory_reserved(self.device)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for size in reversed(self.sizes):      # largest first: the smaller reuse its memory
            meta = self._meta(size)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):     # warm-up: compiles the kernels, sizes buffers
                self.model(self.ids[:size], self.kv_caches, meta, self.backend)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.model(self.ids[:size], self.kv_caches, meta, self.backend)
            self.graphs[size] = (graph, out)
        torch.cuda.synchronize(self.device)
        log.info("cuda graphs captured", sizes=self.sizes, seconds=round(time.perf_counter() - t0, 1),
                 graphs_mib=round((torch.cuda.memory_reserved(self.device) - before) / 2**20))

    def size_for(self, chunks: list[Chunk]) -> int | None:
        """The graph that runs these chunks, or None (not all decodes, too many, too long)."""
        if any(c.q_rows != 1 or c.kv_len > self.max_len for c in chunks):
            return None
        n = len(chunks)
        return next((s for s in self.sizes if s >= n), None)

    def run(self, input_ids: torch.Tensor, chunks: list[Chunk], size: int) -> torch.Tensor:
        """Logits [len(chunks), V] of a decode iteration (every chunk one row), by replaying
        the graph of `size` rows. `input_ids`: the rows' tokens, on the host."""
        n, bs = len(chunks), self.block_size
        if self.copied is not None:
            self.copied.synchronize()          # the last step's copies have left the buffers
        kv = np.fromiter((c.kv_len for c in chunks), dtype=np.int64, count=n)
        width = int(-(-kv.max() // bs))
        tables = self.host_tables.numpy()
        tables[:size, :width] = self.scratch   # rows past n: padding, which attend one slot
        for i, c in enumerate(chunks):
            row = c.block_table[:width]
            tables[i, :len(row)] = row
        rows = self.host_rows.numpy()
        pos = kv - 1
        rows[0, :n] = input_ids.numpy()
        rows[1, :n] = pos
        rows[2, :n] = tables[np.arange(n), pos // bs].astype(np.int64) * bs + pos % bs
        rows[3, :n] = kv
        rows[:, n:size] = self.padding_row
        self.rows_buf.copy_(self.host_rows, non_blocking=True)
        self.tables[:size].copy_(self.host_tables[:size], non_blocking=True)   # whole rows: one
        # copy (columns past `width` hold older tables, never read: no key reaches them)
        if self.copied is not None:
            self.copied.record()
        if size in self.graphs:
            graph, out = self.graphs[size]
            graph.replay()
        else:
            out = self.model(self.ids[:size], self.kv_caches, self._meta(size), self.backend)
        return out[:n]
