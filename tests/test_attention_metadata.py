"""The attention metadata's fast path for iterations of one row per chunk (decodes) builds
exactly what the general path builds for them."""
from __future__ import annotations

import random

import torch

from gpu_worker.attention import metadata
from gpu_worker.attention.metadata import Chunk


def _fields(meta) -> dict:
    out = {k: v for k, v in vars(meta).items() if k != "groups"}
    out["groups"] = [{k: v for k, v in vars(g).items() if k != "mask"} | {"mask": g.mask}
                     for g in meta.groups]
    return out


def _assert_same(a, b, where="") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def test_single_rows_build_what_the_general_path_builds():
    rng = random.Random(0)
    for trial in range(200):
        block_size = rng.choice([1, 4, 16])
        chunks = []
        for _ in range(rng.randint(1, 9)):
            kv_len = rng.randint(1, 70)
            table = rng.sample(range(200), -(-kv_len // block_size) + rng.randint(0, 2))
            chunks.append(Chunk(1, kv_len, table, samples=rng.random() < 0.9))
        args = (chunks, block_size, "cpu", rng.choice([torch.float32, torch.bfloat16]))
        _assert_same(_fields(metadata._single_rows(*args)), _fields(metadata._any_rows(*args)),
                     f"trial {trial}")


def test_a_prompt_row_takes_the_general_path():
    chunks = [Chunk(1, 5, [0, 1], prompt_row=True), Chunk(1, 9, [2, 3, 4])]
    meta = metadata.build_attention_metadata(chunks, 4)
    assert [g.prompt_rows for g in meta.groups] == [True, False]


def test_int64_tensor_is_torch_tensor_of_the_list():
    for values in ([], [0], [5, -3, 2**62, -2**63], list(range(1000))):
        t = metadata.int64_tensor(values)
        assert t.dtype == torch.int64 and t.shape == (len(values),)
        assert torch.equal(t, torch.tensor(values, dtype=torch.int64))
        values.append(7)            # the caller's list is not the tensor's memory
        assert t.tolist() == values[:-1]
