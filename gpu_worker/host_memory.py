"""Host memory for CPU forwards: freed activations kept in the process, and the weights and
the KV pool in transparent huge pages.

Freed activations. glibc's malloc serves blocks above its mmap threshold with a fresh mmap
and unmaps them on free, and trims the top of the heap once enough is free. A forward on CPU
allocates and frees tens of megabytes of activations per layer, so each iteration page-faults
the same memory in again: measured here, a 1024-token prefill iteration spent ~30 % of its
time in page faults (740 → 510 ms with the thresholds below). Raising the mmap threshold to
glibc's maximum and the trim threshold to 1 GiB keeps those blocks in the heap for reuse.

Only glibc has `mallopt`; elsewhere this does nothing.

Huge pages. A decode step reads every weight once, ~100 MB in a few milliseconds for the
default model, spread over 4 KiB pages: one TLB entry covers 4 KiB of a stream that the
prefetchers run far ahead of, and each miss walks the page table. In 2 MiB pages the same
bytes take 512× fewer entries. The weights are moved after loading, and the KV pool is
allocated, into anonymous memory the kernel is asked (`madvise(MADV_HUGEPAGE)`) to back with
huge pages; where transparent huge pages are off the advice is ignored and nothing else
changes (docs/benchmarks.md#huge-pages). `PACER_HUGE_PAGES=0` leaves out the advice (the
same mappings in 4 KiB pages), for comparison or where huge pages are unwelcome.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import types

import structlog
import torch

log = structlog.get_logger("worker")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20          # glibc's upper bound on 64-bit
_TRIM_THRESHOLD = 1 << 30

_done = False


def keep_freed_memory() -> bool:
    """Set the thresholds once per process; True when they took effect."""
    global _done
    if _done:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    _done = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and \
        bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
    if not _done:
        log.warning("mallopt refused the thresholds; CPU forwards will page-fault more")
    return _done


HUGE_PAGE = 2 << 20


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """`nbytes` of zeroed host memory (uint8) starting on a 2 MiB boundary, advised into
    transparent huge pages (unless PACER_HUGE_PAGES=0). Lazily backed: a page becomes
    resident when first written. The mapping lives as long as a tensor over it does."""
    size = nbytes + HUGE_PAGE
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mm, dtype=torch.uint8)     # holds a reference to the mapping
    start = -whole.data_ptr() % HUGE_PAGE                # the mapping is page-aligned
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None and os.environ.get("PACER_HUGE_PAGES", "1") != "0":
        try:
            mm.madvise(advice, start, size - start)
        except OSError:          # a kernel without transparent huge pages: 4 KiB pages
            pass
    return whole[start:start + nbytes]


def mapping_fields(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields (`AnonHugePages`, `THPeligible`, ...) of the mapping that
    holds `address`; empty where there is no such file (not Linux) or no such mapping."""
    fields: dict[str, str] = {}
    inside = False
    try:
        lines = open("/proc/self/smaps").readlines()
    except OSError:
        return fields
    for line in lines:
        head = line.split()[0]
        if "-" in head and ":" not in head:          # a mapping's first line: lo-hi perms ...
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


def _tensors_of(model: torch.nn.Module):
    """Every tensor a module of the model holds: parameters, buffers, and tensors in plain
    attributes, one level into non-module objects (the quantized weights' codes and scales)."""
    for module in model.modules():
        yield from (t for t in module._parameters.values() if t is not None)
        yield from (t for t in module._buffers.values() if t is not None)
        for value in vars(module).values():
            if isinstance(value, torch.Tensor):
                yield value
            elif not isinstance(value, (torch.nn.Module, type, types.ModuleType, dict, list,
                                        tuple)) and hasattr(value, "__dict__"):
                yield from (t for t in vars(value).values() if isinstance(t, torch.Tensor))


def model_bytes(model: torch.nn.Module) -> int:
    """The bytes of every tensor the model holds (each storage once), the quantized weights'
    codes and scales included: what a decode step reads of its weights."""
    seen: dict[int, int] = {}
    for t in _tensors_of(model):
        if t.layout is torch.strided and not t.is_mkldnn:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        else:
            seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


def move_to_huge_pages(model: torch.nn.Module, min_bytes: int = 64 << 10) -> int:
    """Copy each CPU storage of `min_bytes` or more that the model's tensors use into one
    huge-page buffer and point those tensors at the copy (same offsets, sizes and strides;
    tensors sharing a storage still share it). The originals are freed as each is replaced
    and the heap trimmed after. Returns the bytes moved."""
    storages: dict[int, tuple[torch.UntypedStorage, list[torch.Tensor]]] = {}
    for t in _tensors_of(model):
        if t.device.type != "cpu" or t.layout is not torch.strided or t.is_mkldnn:
            continue            # (oneDNN's prepacked weights are opaque: they stay)
        s = t.untyped_storage()
        if s.nbytes() >= min_bytes:
            entry = storages.setdefault(s.data_ptr(), (s, []))
            if not any(t is u for u in entry[1]):
                entry[1].append(t)
    placed, total = [], 0
    for s, users in storages.values():
        placed.append((total, s.nbytes(), users))
        total += -(-s.nbytes() // 64) * 64
    storages.clear()          # from here a storage's last references are its users
    if not total:
        return 0
    arena = huge_page_buffer(total)
    base = arena.storage_offset()
    with torch.no_grad():
        while placed:
            offset, nbytes, users = placed.pop()
            arena[offset:offset + nbytes].copy_(
                torch.empty(0, dtype=torch.uint8).set_(users[0].untyped_storage()))
            for t in users:
                size = t.element_size()
                t.set_(arena.untyped_storage(), (base + offset) // size + t.storage_offset(),
                       t.size(), t.stride())
    _trim_heap()
    return total


def _trim_heap() -> None:
    """Hand the heap's free memory back to the OS (glibc's malloc_trim; elsewhere nothing)."""
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
