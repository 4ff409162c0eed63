"""transformers' greedy output, the reference every parity test compares with, and the
default model's reference computed once per test session."""
from __future__ import annotations

import contextlib
import functools
import os

import torch

NEW_TOKENS = 32
CHAT_PROMPTS = [
    "Hi!",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List five prime numbers and say why each is prime.",
    "Translate 'good morning, how are you today?' into French, Spanish and German.",
    "You are a careful assistant. Summarise the plot of Romeo and Juliet for a child, "
    "in simple words, and say what lesson the story teaches about rushing into decisions.",
    "Here is some Python code:\n\ndef add(a, b):\n    return a - b\n\nprint(add(2, 3))\n\n"
    "What does it print, what is the bug, and how would you fix it? Answer step by step, "
    "and then write a unit test with pytest that would have caught the bug before release.",
]


def hf_greedy(model, prompt: list[int], eos: int | None) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation and the logits it chose from (for near-tie checks)."""
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos,
                         pad_token_id=eos if eos is not None else 0, top_p=None, top_k=None,
                         temperature=None, output_scores=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), torch.stack(out.scores)[:, 0]


def assert_same_tokens(ours: list[int], ref: list[int], ref_logits: torch.Tensor, what: str):
    """Exact equality; a divergence is accepted only at a genuine float32 near-tie of the
    reference (top-2 logit gap below 1e-4), and the gap is printed."""
    if ours == ref:
        return
    i = next((k for k, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
    assert i < len(ours) and i < len(ref), f"{what}: lengths differ {len(ours)} vs {len(ref)}"
    top2 = torch.topk(ref_logits[i], 2).values
    gap = float(top2[0] - top2[1])
    print(f"{what}: diverges at token {i}: ours {ours[i]} vs HF {ref[i]}, HF top-2 gap {gap:.2e}")
    assert gap < 1e-4, f"{what}: token {i} differs ({ours[i]} vs {ref[i]}) with HF logit gap {gap}"


@contextlib.contextmanager
def gguf_py_read_faster():
    """transformers reads a GGUF with gguf-py, values and all, in ~14 s for the default model:
    it parses the file twice with gguf-py's reader (slices of an `np.memmap`, which run Python
    per slice) and builds gguf-py's tensor-name table once per tensor. Within this block it
    gets our reader (the same values from plain slices of the same mapping: tests/test_weights.py
    checks they are equal) and the table once per (architecture, layers): ~4 s, the same
    model bit for bit."""
    import gguf

    from shared.model_config import READER
    saved = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = READER
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(saved[1])
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = saved


def load_default_hf(tmp_dir: str):
    """transformers' float32 model of the default GGUF (the file linked into `tmp_dir`)."""
    from transformers import AutoModelForCausalLM

    from shared.model_source import resolve_model
    source = resolve_model(None)
    name = os.path.basename(source.path)
    os.symlink(source.path, os.path.join(tmp_dir, name))
    with gguf_py_read_faster():
        return AutoModelForCausalLM.from_pretrained(tmp_dir, gguf_file=name,
                                                    dtype=torch.float32).eval()


def default_chat_references(hf) -> tuple[list[list[int]], list[tuple[list[int], torch.Tensor]]]:
    """The CHAT_PROMPTS as the default model's chat template encodes them, and transformers'
    greedy NEW_TOKENS (with their logits) for each."""
    from shared.model_source import resolve_model
    from shared.tokenizer import load_tokenizer
    tok = load_tokenizer(resolve_model(None))
    prompts = [tok.encode_chat([{"role": "user", "content": c}]) for c in CHAT_PROMPTS]
    assert len({len(p) for p in prompts}) == len(prompts)
    return prompts, [hf_greedy(hf, p, tok.eos_token_id) for p in prompts]
