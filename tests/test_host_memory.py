"""Weights and the KV pool in transparent huge pages (gpu_worker/host_memory.py)."""
from __future__ import annotations

import pytest
import torch

from gpu_worker.host_memory import (HUGE_PAGE, huge_page_buffer, mapping_fields,
                                     move_to_huge_pages)
from gpu_worker.kv_cache import allocate_kv_pool
from shared.model_config import ModelConfig


def _thp_mode() -> str:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "never"
    return text.split("[")[1].split("]")[0]


def test_buffer_is_zeroed_aligned_and_advised():
    buf = huge_page_buffer(3 * HUGE_PAGE + 123)
    assert buf.dtype == torch.uint8 and buf.numel() == 3 * HUGE_PAGE + 123
    assert buf.data_ptr() % HUGE_PAGE == 0
    assert int(buf.sum()) == 0
    buf.fill_(7)                     # writable, and it outlives the function that mapped it
    assert int(buf[-1]) == 7
    if _thp_mode() == "never":
        pytest.skip("transparent huge pages are off on this kernel: the advice is ignored")
    assert mapping_fields(buf.data_ptr()).get("THPeligible") == "1"


class _Holder:
    def __init__(self, codes: torch.Tensor) -> None:
        self.codes = codes


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(256, 512)          # weight 512 KiB: moved; bias too small
        self.tied = torch.nn.Module()
        self.tied.weight = self.lin.weight            # the same Parameter in two modules
        base = torch.arange(300_000, dtype=torch.int32)
        self.register_buffer("table", base[1000:].view(-1, 100), persistent=False)
        self.view_of_table = self.table[:, 3]          # a strided view sharing its storage
        self.packed = _Holder(torch.randint(0, 255, (1024, 96), dtype=torch.uint8))
        self.small = torch.ones(4)


def test_move_keeps_values_sharing_and_layout():
    torch.manual_seed(0)
    m = _Model()
    before = {name: t.clone() for name, t in (("w", m.lin.weight), ("b", m.lin.bias),
                                              ("table", m.table), ("view", m.view_of_table),
                                              ("codes", m.packed.codes))}
    strides = (m.table.stride(), m.view_of_table.stride())
    small_ptr = m.small.data_ptr()
    moved = move_to_huge_pages(m)
    assert moved >= m.lin.weight.nbytes + m.packed.codes.nbytes + 300_000 * 4
    assert torch.equal(m.lin.weight, before["w"]) and torch.equal(m.lin.bias, before["b"])
    assert torch.equal(m.table, before["table"]) and torch.equal(m.view_of_table, before["view"])
    assert torch.equal(m.packed.codes, before["codes"])
    assert (m.table.stride(), m.view_of_table.stride()) == strides
    assert m.tied.weight is m.lin.weight
    # one storage still: a write through the view shows in the buffer
    m.view_of_table[0] = -5
    assert int(m.table[0, 3]) == -5
    assert m.small.data_ptr() == small_ptr               # under the size floor: left alone
    arena = m.lin.weight.untyped_storage()
    assert m.packed.codes.untyped_storage().data_ptr() == arena.data_ptr()
    assert m.lin.bias.untyped_storage().data_ptr() != arena.data_ptr()
    # the model still computes
    x = torch.randn(3, 256)
    torch.testing.assert_close(m.lin(x), x @ before["w"].t() + before["b"])


def test_kv_pool_on_cpu_is_zeroed_huge_page_memory():
    cfg = ModelConfig("LlamaForCausalLM", 97, 64, 96, 2, 4, 2, 16, 1e4, 1e-5, 256, False, 1, 2)
    pool = allocate_kv_pool(cfg, 40, 16, 2, torch.bfloat16, "cpu")
    assert pool.shape == (2, 2, 40, 16, 2, 16) and pool.dtype == torch.bfloat16
    assert pool.is_contiguous() and pool.data_ptr() % HUGE_PAGE == 0
    assert not pool.any()
