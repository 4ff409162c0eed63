"""The kernels' DecoderStack (csrc/decoder.cpp): an iteration of decodes alone runs every
layer in one C++ call where the matrices are int4 in the VNNI layout. It must give the
layer-by-layer path's logits bit for bit, fall back wherever it does not apply, and refuse
bad input with a clear error instead of reading out of bounds."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from gpu_worker.quant import linear
from services.engine import LLMEngine
from shared.engine_args import EngineArgs
from shared.sampling import SamplingParams
from tests.helpers_tiny_model import write_tiny_gguf, write_tiny_llama

pytestmark = pytest.mark.skipif(
    linear._vnni_kernels() is None,
    reason="the stack needs int4 in the VNNI layout: AVX512-VNNI (or AVX2) kernels")

PROMPTS = [[5, 6, 7], list(range(40, 58)), list(range(60, 100)), list(range(3, 70))]


def _engine(gguf: str, dtype: str, **args) -> LLMEngine:
    return LLMEngine(EngineArgs(model=gguf, block_size=16, num_kv_blocks=256, max_model_len=512,
                                dtype=dtype, **args), progress=False)


def _decode_forward(engine: LLMEngine, steps: int):
    """Run the engine `steps` iterations; the arguments of the last decode-only forward."""
    model = engine.runner.model
    seen, forward = [], model.forward

    def capture(ids, kv, meta, backend, **hooks):
        if backend.decode_group(meta, kv[0][0].dtype) is not None:
            seen.append((ids, kv, meta, backend))
        return forward(ids, kv, meta, backend, **hooks)

    model.forward = capture
    for _ in range(steps):
        engine.step()
    model.forward = forward
    assert seen, "no iteration of decodes alone"
    return forward, seen[-1]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])   # the KV cache's dtype follows
# 1, 2: few rows (each thread one contiguous range of columns); 44: past vnni_amx_rows (AMX tiles)
@pytest.mark.parametrize("requests", [1, 2, len(PROMPTS), 44])
def test_the_stack_gives_the_layers_logits_bit_for_bit(tmp_path, dtype, requests):
    gguf = write_tiny_gguf(tmp_path / "m.gguf", write_tiny_llama(tmp_path / "hf"), Q.Q4_1)
    prompts = (PROMPTS * requests)[:requests]
    with _engine(gguf, dtype) as engine:
        for p in prompts:
            engine.add_request(p, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
        forward, (ids, kv, meta, backend) = _decode_forward(engine, 14)
        model = engine.runner.model
        assert ids.shape[0] == requests and model._decoder_stack(kv) is not None
        stacked = forward(ids, kv, meta, backend)
        streamed = []           # P/D's per-layer hand-off needs the layers one by one
        assert torch.equal(forward(ids, kv, meta, backend, streamed.append), stacked)
        assert streamed == list(range(len(model.layers)))
        model.native_decode = False
        layered = forward(ids, kv, meta, backend)
        assert torch.equal(stacked, layered)


# head_dim 64: the prefill kernel's size (the tiny model's 16 has none, so no mixed call)
WIDE = dict(hidden_size=256, intermediate_size=512)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_iterations_with_prompt_chunks_give_the_layers_logits_bit_for_bit(tmp_path, dtype):
    """DecoderStack.mixed: decodes beside chunks of many rows, of one row at a prompt position
    (the budget cut a prompt to its last row), and prompts alone."""
    gguf = write_tiny_gguf(tmp_path / "m.gguf", write_tiny_llama(tmp_path / "hf", **WIDE), Q.Q4_1)
    with _engine(gguf, dtype, max_num_batched_tokens=24) as engine:
        model = engine.runner.model
        if not engine.runner.backend._prefill_in_kernel(64, 2):
            pytest.skip("no prefill kernel in this build (AVX2 and AVX-512 only): no mixed call")
        forward, checked = model.forward, []

        def compare(ids, kv, meta, backend, **hooks):
            stack = model._decoder_stack(kv)
            by_prefill = model._mixed_rows(stack, meta, backend, kv) if stack else None
            if by_prefill is None or hooks.get("after_layer"):
                return forward(ids, kv, meta, backend, **hooks)
            one_call = forward(ids, kv, meta, backend, **hooks)
            model.native_decode = False
            layered = forward(ids, kv, meta, backend)
            model.native_decode = True
            assert torch.equal(one_call, layered)
            checked.append((int((by_prefill == 0).sum()), int(by_prefill.sum()),
                            any(g.prompt_rows for g in meta.groups)))
            return one_call

        model.forward = compare
        # 24 rows of the first prompt alone, then its last row beside the next one's chunk
        # (they arrive once it is in: arriving with it, these short prompts would go first,
        # docs/design.md#short-prompts-beside-long-ones), then decodes beside chunks
        greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        engine.add_request(list(range(5, 30)), greedy)
        engine.step()
        for p in (PROMPTS[1], PROMPTS[2], PROMPTS[3]):
            engine.add_request(p, greedy)
        while engine.has_unfinished():
            engine.step()
    assert any(decodes and prompts for decodes, prompts, _ in checked), checked
    assert any(decodes == 0 for decodes, _, _ in checked), checked
    assert any(one_row for _, _, one_row in checked), checked


def test_the_mixed_call_refuses_inconsistent_chunks(tmp_path):
    gguf = write_tiny_gguf(tmp_path / "m.gguf", write_tiny_llama(tmp_path / "hf", **WIDE), Q.Q4_1)
    with _engine(gguf, "bfloat16") as engine:
        kv = engine.runner.kv_caches
        stack = engine.runner.model._decoder_stack(kv)
        if not engine.runner.backend._prefill_in_kernel(64, 2):
            pytest.skip("no prefill kernel in this build (AVX2 and AVX-512 only): no mixed call")
        x = torch.zeros(3, 256)
        i64, i32 = (lambda *v: torch.tensor(v, dtype=torch.int64)), \
            (lambda *v: torch.tensor(v, dtype=torch.int32))
        table, cu, lens = i32(1, 2).view(1, 2), i32(0, 3), i32(3)
        ok = dict(positions=i64(0, 1, 2), slots=i64(16, 17, 18))
        rows = torch.ones(3, dtype=torch.uint8)
        stack.mixed(x, ok["positions"], ok["slots"], table, cu, lens, rows)   # well formed
        with pytest.raises(RuntimeError, match="position or slot"):
            stack.mixed(x, i64(0, 1, 5), ok["slots"], table, cu, lens, rows)
        with pytest.raises(RuntimeError, match="position or slot"):
            stack.mixed(x, ok["positions"], i64(16, 17, 10 ** 9), table, cu, lens, rows)
        with pytest.raises(RuntimeError, match="two kernels"):
            stack.mixed(x, ok["positions"], ok["slots"], table, cu, lens,
                        torch.tensor([1, 0, 1], dtype=torch.uint8))
        with pytest.raises(RuntimeError, match="decode of more than one row"):
            stack.mixed(x, ok["positions"], ok["slots"], table, cu, lens, torch.zeros_like(rows))
        with pytest.raises(RuntimeError, match="block id"):
            stack.mixed(x, ok["positions"], ok["slots"], i32(1, 10 ** 6).view(1, 2), cu,
                        i32(20), rows)
        with pytest.raises(RuntimeError, match="cu_seqlens_q from 0"):
            stack.mixed(x, ok["positions"], ok["slots"], table, i32(0, 2), lens, rows)


def test_greedy_tokens_are_the_same_with_and_without_the_stack(tmp_path):
    gguf = write_tiny_gguf(tmp_path / "m.gguf", write_tiny_llama(tmp_path / "hf", seed=3), Q.Q4_0)
    sp = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * len(PROMPTS)
    runs = []
    for native in (True, False):
        with _engine(gguf, "bfloat16", max_num_batched_tokens=32) as engine:
            engine.runner.model.native_decode = native
            runs.append([c.token_ids for c in engine.generate(PROMPTS, sp)])
            assert (engine.runner.model._stack is not None) == native
    assert runs[0] == runs[1]


def test_the_runner_says_when_the_layers_start(tmp_path):
    """`on_forward` (the worker's event loop waits for it before its own Python work, see
    gpu_worker/service.py PlanLoop.handed_over) is called once a forward, after the embedding
    and before any layer: on the stack's path and on the layers' own."""
    gguf = write_tiny_gguf(tmp_path / "m.gguf", write_tiny_llama(tmp_path / "hf", seed=3), Q.Q4_0)
    with _engine(gguf, "bfloat16", max_num_batched_tokens=32) as engine:
        model, events = engine.runner.model, []
        embed, layer, stack = model.embed_tokens.forward, model.layers[0].forward, \
            model._decoder_stack

        class Recorded:            # the C++ stack's methods cannot be replaced: wrap it
            def __init__(self, inner):
                self.inner = inner

            def decode(self, *a):
                events.append("stack")
                return self.inner.decode(*a)

            def mixed(self, *a):
                events.append("stack")
                return self.inner.mixed(*a)

        model.embed_tokens.forward = lambda *a: events.append("embed") or embed(*a)
        model.layers[0].forward = lambda *a: events.append("layers") or layer(*a)
        model._decoder_stack = lambda kv: (lambda s: s and Recorded(s))(stack(kv))
        engine.runner.on_forward = lambda: events.append("handed over")
        engine.generate(PROMPTS[:2], [SamplingParams(max_tokens=4, temperature=0.0)] * 2)
    forwards = [events[i:i + 3] for i in range(0, len(events), 3)]
    assert len(events) == 3 * len(forwards)
    assert ["embed", "handed over", "layers"] in forwards       # prefills
    assert ["embed", "handed over", "stack"] in forwards        # decodes alone
    assert all(f in (["embed", "handed over", "layers"], ["embed", "handed over", "stack"])
               for f in forwards)


def test_the_stack_stands_aside_where_it_does_not_apply(tmp_path):
    """o_proj of 96 columns pads to 128 (int4 weights are padded to 64 columns): the layers'
    own path serves."""
    hf = write_tiny_llama(tmp_path / "hf", hidden_size=96, intermediate_size=192,
                          num_attention_heads=6, num_key_value_heads=3)
    gguf = write_tiny_gguf(tmp_path / "m.gguf", hf, Q.Q4_0)
    with _engine(gguf, "float32") as engine:
        engine.add_request(PROMPTS[1], SamplingParams(max_tokens=6, temperature=0.0))
        _, (ids, kv, meta, backend) = _decode_forward(engine, 4)
        assert engine.runner.model._decoder_stack(kv) is None


def test_the_stack_refuses_bad_input_clearly(tmp_path):
    gguf = write_tiny_gguf(tmp_path / "m.gguf", write_tiny_llama(tmp_path / "hf"), Q.Q4_1)
    with _engine(gguf, "float32") as engine:
        engine.add_request(PROMPTS[2], SamplingParams(max_tokens=8, temperature=0.0))
        _, (ids, kv, meta, backend) = _decode_forward(engine, 3)
        model = engine.runner.model
        stack = model._decoder_stack(kv)
        g = meta.groups[0]
        x = torch.zeros(1, model.cfg.hidden_size)
        far = torch.tensor([10 ** 6])
        with pytest.raises(RuntimeError, match="position or slot out of range"):
            stack.decode(x, far, meta.slot_mapping, g.block_tables, g.kv_lens)
        with pytest.raises(RuntimeError, match="position or slot out of range"):
            stack.decode(x, meta.positions, far, g.block_tables, g.kv_lens)
        with pytest.raises(RuntimeError, match="block id out of the pool"):
            stack.decode(x, meta.positions, meta.slot_mapping,
                         torch.full_like(g.block_tables, 10 ** 6), g.kv_lens)
        with pytest.raises(RuntimeError, match="x \\[G, hidden\\] float32"):
            stack.decode(x.double(), meta.positions, meta.slot_mapping, g.block_tables, g.kv_lens)
        layer = model.layers[0]
        with pytest.raises(RuntimeError, match="int4 in the VNNI layout"):
            stack.add_layer(layer.input_layernorm.weight, layer.mlp.down_proj.qweight.vnni,
                            layer.self_attn.o_proj.qweight.vnni,
                            layer.post_attention_layernorm.weight,
                            layer.mlp.gate_up_proj.qweight.vnni, layer.mlp.down_proj.qweight.vnni,
                            *kv[0])
