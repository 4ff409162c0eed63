"""All per-iteration attention metadata, built once and shared by every layer.

Worked example (block_size 4). Three chunks in one iteration:

    request  q_rows  kv_len  block_table   what it is
    A        1       6       [7, 2]        decode: token at position 5
    B        3       3       [4]           fresh prefill of 3 tokens
    C        2       6       [1, 5]        second chunk: positions 4..5 over a prefix of 4

    flat rows      0 | 1 2 3 | 4 5          (q_start, q_end) = (0,1), (1,4), (4,6)
    positions      5 | 0 1 2 | 4 5
    slot_mapping  9 | 16 17 18 | 20 21      block_table[pos // 4] * 4 + pos % 4
    sample_rows    0, 3, 5                  the last row of each chunk that ends its tokens

Query row i of a chunk sits at position kv_len - q_rows + i and sees keys 0..that position:
the cached prefix fully, its own chunk causally (docs/design.md#chunks).

The torch backend attends chunks with equal q_rows together as one padded batch (all decodes
form one group); flash-attn takes the cu_seqlens form directly.
"""
from __future__ import annotations

import functools
from array import array
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Chunk:
    q_rows: int
    kv_len: int
    block_table: list[int]
    samples: bool = True
    # a chunk of one row at a prompt position (a prompt's last chunk, cut to one row): it is
    # attended as the rest of its prompt is, not as a decode (see AttentionGroup.prompt_rows)
    prompt_row: bool = False


@dataclass
class AttentionGroup:
    """Chunks with the same q_rows (and prompt_rows), attended as one padded batch of G
    requests."""
    q_index: torch.Tensor        # [G, q] rows of the flat batch
    block_tables: torch.Tensor   # [G, blocks]; padded with block 0 (masked out)
    kv_len_max: int
    kv_lens: torch.Tensor        # [G]
    fresh: bool                  # every chunk is a whole prompt: keys are the chunk itself
    all_rows: bool               # the group is the whole flat batch, in order
    mask_dtype: torch.dtype = torch.float32
    # single rows at prompt positions (Chunk.prompt_row): a backend whose prompt chunks and
    # decodes take different kernels gives these the prompt chunks' kernel, so that how a
    # prompt was cut into chunks never changes the bits of its rows
    prompt_rows: bool = False

    @functools.cached_property
    def mask(self) -> torch.Tensor:
        """[G, 1, q, kv_len_max] additive: 0 where the query sees the key, -inf elsewhere.
        Built on first use (only torch's SDPA over a cached prefix needs it; the CPU kernels
        and flash-attn take the lengths) and then shared by every layer."""
        G, q = self.q_index.shape
        query_pos = (self.kv_lens - q).unsqueeze(1) + torch.arange(q, device=self.kv_lens.device)
        key_pos = torch.arange(self.kv_len_max, device=self.kv_lens.device)
        sees = key_pos.view(1, 1, -1) <= query_pos.unsqueeze(-1)                 # [G, q, L]
        mask = torch.zeros(sees.shape, dtype=self.mask_dtype, device=sees.device)
        return mask.masked_fill_(~sees, float("-inf")).unsqueeze(1)


@dataclass
class AttentionMetadata:
    positions: torch.Tensor      # [T]
    slot_mapping: torch.Tensor   # [T]
    sample_rows: torch.Tensor    # [S]
    groups: list[AttentionGroup]
    # the flash-attn form
    cu_seqlens_q: torch.Tensor   # [R + 1] int32
    seqused_k: torch.Tensor      # [R] int32, kv_len per request
    block_table: torch.Tensor    # [R, max_blocks] int32
    max_seqlen_q: int
    max_seqlen_k: int


def build_attention_metadata(chunks: list[Chunk], block_size: int,
                             device: str | torch.device = "cpu",
                             dtype: torch.dtype = torch.float32) -> AttentionMetadata:
    if all(c.q_rows == 1 and not c.prompt_row for c in chunks):
        return _single_rows(chunks, block_size, device, dtype)
    return _any_rows(chunks, block_size, device, dtype)


def _any_rows(chunks: list[Chunk], block_size: int, device, dtype: torch.dtype
              ) -> AttentionMetadata:
    q_rows = torch.tensor([c.q_rows for c in chunks], dtype=torch.int64)
    kv_lens = torch.tensor([c.kv_len for c in chunks], dtype=torch.int64)
    cu_q = torch.zeros(len(chunks) + 1, dtype=torch.int64)
    torch.cumsum(q_rows, 0, out=cu_q[1:])
    # one tensor from padded lists: a slice assignment per chunk costs ~10x (at 32 decodes)
    tables = torch.tensor(_padded_tables(chunks, block_size), dtype=torch.int64)

    # positions of every row: kv_len - q_rows + (row - q_start)
    total = int(cu_q[-1])
    req_of_row = torch.repeat_interleave(torch.arange(len(chunks)), q_rows)
    positions = (kv_lens - q_rows)[req_of_row] + torch.arange(total) - cu_q[:-1][req_of_row]
    slot_mapping = tables[req_of_row, positions // block_size] * block_size + positions % block_size
    sampling = torch.tensor([c.samples for c in chunks], dtype=torch.bool)
    sample_rows = (cu_q[1:] - 1)[sampling]

    to = dict(device=device)
    return AttentionMetadata(
        positions=positions.to(**to), slot_mapping=slot_mapping.to(**to),
        sample_rows=sample_rows.to(**to),
        groups=_groups(chunks, cu_q, tables, block_size, device, dtype),
        cu_seqlens_q=cu_q.to(dtype=torch.int32, **to), seqused_k=kv_lens.to(dtype=torch.int32, **to),
        block_table=tables.to(dtype=torch.int32, **to),
        max_seqlen_q=int(q_rows.max()), max_seqlen_k=int(kv_lens.max()))


def _padded_tables(chunks: list[Chunk], block_size: int) -> list[list[int]]:
    """Each chunk's blocks for its kv_len, padded with block 0 to the longest."""
    num_blocks = [-(-c.kv_len // block_size) for c in chunks]
    width = max(num_blocks)
    return [c.block_table[:n] + [0] * (width - n) for c, n in zip(chunks, num_blocks)]


def _single_rows(chunks: list[Chunk], block_size: int, device,
                 dtype: torch.dtype) -> AttentionMetadata:
    """The same metadata for an iteration of one row per chunk (decodes: every step of a
    stream), computed in Python lists: the general path's ~30 small torch ops took ~0.45 ms of
    a one-request step on a 2-core CPU. One group, the whole batch. The block tables, lengths,
    positions, slots and sample rows are one tensor made from one list (`int64_tensor`), one
    copy to the device, each a view of it: a tensor apiece from lists cost ~2x (32 decodes on
    2 cores)."""
    n = len(chunks)
    kv = [c.kv_len for c in chunks]
    positions = [k - 1 for k in kv]
    values = [b for row in _padded_tables(chunks, block_size) for b in row]
    width = len(values) // n
    values += kv
    values += positions
    values += [c.block_table[p // block_size] * block_size + p % block_size
               for c, p in zip(chunks, positions)]
    values += [i for i, c in enumerate(chunks) if c.samples]
    to = dict(device=device)
    flat = int64_tensor(values).to(**to)
    at = n * width
    tables, kv_lens = flat[:at].view(n, width), flat[at:at + n]
    group = AttentionGroup(
        q_index=torch.arange(n, **to).unsqueeze(1), block_tables=tables,
        kv_len_max=max(kv), kv_lens=kv_lens, fresh=all(k == 1 for k in kv),
        all_rows=True, mask_dtype=dtype, prompt_rows=False)
    return AttentionMetadata(
        positions=flat[at + n:at + 2 * n], slot_mapping=flat[at + 2 * n:at + 3 * n],
        sample_rows=flat[at + 3 * n:],
        groups=[group], cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32, **to),
        seqused_k=kv_lens.to(torch.int32), block_table=tables.to(torch.int32), max_seqlen_q=1,
        max_seqlen_k=max(kv))


def int64_tensor(values: list[int]) -> torch.Tensor:
    """torch.tensor(values, dtype=torch.int64) on the host, ~3x faster: through an array no
    one else holds (the tensor shares its memory), where torch.tensor inspects every element
    (32 ids: 1.5 against 4.6 µs, 740: 12 against 40, on a 2-core CPU)."""
    return torch.frombuffer(array("q", values), dtype=torch.int64) if values else \
        torch.empty(0, dtype=torch.int64)


def _groups(chunks: list[Chunk], cu_q: torch.Tensor, tables: torch.Tensor, block_size: int,
            device, dtype: torch.dtype) -> list[AttentionGroup]:
    by_rows: dict[tuple[int, bool], list[int]] = {}
    for i, c in enumerate(chunks):
        by_rows.setdefault((c.q_rows, c.prompt_row), []).append(i)
    groups = []
    for (q, prompt_rows), members in by_rows.items():
        idx = torch.tensor(members)
        kv = torch.tensor([chunks[i].kv_len for i in members])
        kv_max = int(kv.max())
        q_index = cu_q[idx].unsqueeze(1) + torch.arange(q)                       # [G, q]
        blocks = -(-kv_max // block_size)
        groups.append(AttentionGroup(
            q_index=q_index.to(device), block_tables=tables[idx, :blocks].to(device),
            kv_len_max=kv_max, kv_lens=kv.to(device), fresh=bool((kv == q).all()),
            all_rows=len(by_rows) == 1, mask_dtype=dtype, prompt_rows=prompt_rows))
    return groups
