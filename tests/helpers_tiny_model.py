"""A tiny random Llama in HF format, for parity tests that must run in seconds.

    path = write_tiny_llama(tmp_path)                      # GQA: 4 query heads, 2 KV heads
    path = write_tiny_llama(tmp_path, seed=1, tie_word_embeddings=True, num_hidden_layers=2)
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", path, GGMLQuantizationType.Q8_0)

The tokenizer is a hand-written byte-level BPE (every byte, a few English merges, ChatML
specials), built without training so that it is the same on every machine.
"""
from __future__ import annotations

import json
import math
import os

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf import quants as gguf_quants
from safetensors import safe_open
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]   # ids 0, 1, 2 as in SmolLM2
BOS_TOKEN_ID, EOS_TOKEN_ID = 1, 2

# Byte-level spellings: "Ġ" is a space, "Ã©" is the two bytes of "é".
_MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"),
           ("r", "e"), ("Ġ", "s"), ("a", "t"), ("e", "n"), ("Ġ", "w"), ("o", "r"), ("in", "g"),
           ("Ġ", "o"), ("Ġ", "c"), ("e", "s"), ("i", "s"), ("Ġ", "b"), ("l", "l"), ("Ġ", "f"),
           ("Ġ", "h"), ("a", "n"), ("Ġ", "i"), ("o", "u"), ("Ġ", "m"), ("Ã", "©"), ("Ġ", "l")]

CHAT_TEMPLATE = ("{% for message in messages %}"
                 "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
                 "{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def _bytes_to_unicode() -> list[str]:
    """GPT-2's printable spelling of each byte, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def tiny_tokenizer() -> Tokenizer:
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + _bytes_to_unicode()
                                        + [a + b for a, b in _MERGES])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_MERGES))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def _tokenizer_config() -> dict:
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIAL_TOKENS[BOS_TOKEN_ID],
            "eos_token": SPECIAL_TOKENS[EOS_TOKEN_ID], "pad_token": SPECIAL_TOKENS[EOS_TOKEN_ID],
            "add_bos_token": False, "model_max_length": 1024, "chat_template": CHAT_TEMPLATE}


def write_tiny_llama(path: str | os.PathLike, seed: int = 0, family: str = "llama",
                     **overrides) -> str:
    """Writes config.json, model.safetensors and the tokenizer files; returns the path.
    `overrides` are LlamaConfig fields (tie_word_embeddings, num_hidden_layers, rope_scaling,
    ...); `family` "mistral" or "qwen2" writes that model of the same shape instead."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tok = tiny_tokenizer()
    fields = dict(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0,
                  tie_word_embeddings=False, bos_token_id=BOS_TOKEN_ID,
                  eos_token_id=EOS_TOKEN_ID, pad_token_id=EOS_TOKEN_ID)
    config_class, model_class = {"llama": (LlamaConfig, LlamaForCausalLM),
                                 "mistral": (MistralConfig, MistralForCausalLM),
                                 "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[family]
    config = config_class(**{**fields, **overrides})
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32)
    with torch.no_grad():   # norms start at exactly 1 and biases at 0; perturb them so that
        for name, p in model.named_parameters():    # a swapped norm or a lost bias shows
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn_like(p))
    model.save_pretrained(path)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(_tokenizer_config(), f, indent=2)
    return path


# ---- the same model as a GGUF, written the way llama.cpp's converter writes it -------------

_GGUF_LAYER_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                     "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                     "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
                     "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
_GGUF_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight",
                      "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def gguf_tensor_name(hf_name: str) -> str:
    if hf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)            # model.layers.{i}.{module}.weight
    module, kind = rest.rsplit(".", 1)                   # ... or .bias
    return f"blk.{layer}.{_GGUF_LAYER_NAMES[module]}.{kind}"


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's Q/K row order (pairs instead of halves for RoPE)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# where each k-quant block keeps its fp16 super-block scales (d, and dmin where it has one),
# and a value for them that keeps random blocks' weights within ~±1
_KQUANT_SCALES = {GGMLQuantizationType.Q4_K: ((0, 2), 5e-4),
                  GGMLQuantizationType.Q6_K: ((208,), 2e-4)}


def encode_gguf_tensor(w: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """The bytes GGUFWriter stores. Of the types gguf-py cannot quantize, Q4_K and Q6_K get
    random blocks (seeded by the tensor's shape and its first values) with small super-block
    scales: weights of their own, not `w`'s, which any reader of the file (transformers
    included) sees alike. Other such types get zero bytes of the right size: enough to test
    that a loader refuses them."""
    if qtype == GGMLQuantizationType.F32:
        return w.astype(np.float32)
    if qtype == GGMLQuantizationType.F16:
        return w.astype(np.float16)
    try:
        return gguf_quants.quantize(w, qtype)
    except NotImplementedError:
        shape = gguf_quants.quant_shape_to_byte_shape(w.shape, qtype)
        if qtype not in _KQUANT_SCALES:
            return np.zeros(shape, dtype=np.uint8)
    offsets, scale = _KQUANT_SCALES[qtype]
    block_bytes = GGML_QUANT_SIZES[qtype][1]
    seed = abs(hash((w.shape, float(w.flat[0]), float(w.flat[-1])))) % 2**32
    blocks = np.random.default_rng(seed).integers(0, 256, size=(shape[0], shape[1] // block_bytes,
                                                                block_bytes), dtype=np.uint8)
    for at in offsets:
        blocks[..., at:at + 2] = np.frombuffer(np.float16(scale).tobytes(), dtype=np.uint8)
    return blocks.reshape(shape)


def write_tiny_gguf(path: str | os.PathLike, hf_dir: str | os.PathLike,
                    tensor_type: GGMLQuantizationType = GGMLQuantizationType.F32, *,
                    arch: str = "llama", add_bos_token: bool = False,
                    tensor_types: dict[str, GGMLQuantizationType] | None = None,
                    pre: str = "smollm", sentencepiece: bool = False) -> str:
    """Converts the model write_tiny_llama wrote into a GGUF file: matrices as `tensor_type`
    (or per GGUF tensor name from `tensor_types`), norms F32, tokenizer as metadata (its
    pre-tokenizer named `pre`; or, `sentencepiece`, write_sentencepiece_tokenizer's, for a
    model written with vocab_size=len(SENTENCEPIECE_TOKENS)). A `llama3` RoPE scaling becomes
    the `rope_freqs` tensor, as llama.cpp's converter writes it."""
    path, hf_dir = os.fspath(path), os.fspath(hf_dir)
    with open(os.path.join(hf_dir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    writer = GGUFWriter(path, arch)
    _write_gguf_config(writer, cfg)
    if sentencepiece:
        write_sentencepiece_tokenizer(writer, add_bos_token)
    else:
        _write_gguf_tokenizer(writer, hf_dir, add_bos_token, pre)
    rope = cfg.get("rope_parameters") or {}
    if rope.get("rope_type") == "llama3":
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_tensor("rope_freqs.weight", llama3_rope_divisors(
            cfg["hidden_size"] // cfg["num_attention_heads"], rope))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    with safe_open(os.path.join(hf_dir, "model.safetensors"), framework="np") as f:
        for name in f.keys():
            w = f.get_tensor(name).astype(np.float32)
            if arch == "llama" and name.endswith("q_proj.weight"):   # not Qwen2's
                w = llama_cpp_permute(w, heads)
            elif arch == "llama" and name.endswith("k_proj.weight"):
                w = llama_cpp_permute(w, kv_heads)
            gguf_name = gguf_tensor_name(name)
            default = tensor_type if w.ndim == 2 else GGMLQuantizationType.F32   # norms stay F32
            qtype = (tensor_types or {}).get(gguf_name, default)
            data = encode_gguf_tensor(w, qtype)
            writer.add_tensor(gguf_name, data, raw_dtype=qtype if data.dtype == np.uint8 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_gguf_config(writer: GGUFWriter, cfg: dict) -> None:
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_dimension_count(cfg["hidden_size"] // cfg["num_attention_heads"])
    writer.add_vocab_size(cfg["vocab_size"])


def llama3_rope_divisors(head_dim: int, rope: dict) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py stores as `rope_freqs.weight` for a `llama3`
    scaling: each frequency's divisor, computed its way (float32 frequencies, Python floats)."""
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32)
                                           / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    divisors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            divisors.append(1.0)
        elif wavelen > old / low:
            divisors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


# a SentencePiece vocabulary of our own making: specials, the 256 byte pieces, characters,
# and merged pieces (their order here is their score's: the first merges first)
_SPM_PIECES = ["▁t", "he", "▁the", "▁a", "in", "▁in", "er", "▁w", "or", "▁wor", "ld", "▁world",
               "▁H", "el", "lo", "llo", "ello", "▁Hello", "▁s", "ur", "▁sur", "▁sure", "an",
               "▁an", "▁and", "▁I", "'m", "▁1", "23", "▁123", "▁▁", "▁▁▁", "ing", "▁th", "is"]
_SPM_CHARS = sorted(set("▁abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
                        ".,!?'-:;()#*+=_/"))
SENTENCEPIECE_TOKENS = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)),
                        *_SPM_CHARS, *_SPM_PIECES]


def write_sentencepiece_tokenizer(writer: GGUFWriter, add_bos: bool | None = True) -> None:
    """A SentencePiece tokenizer (Llama 2's, Mistral's kind: pieces and scores, no merges) as
    GGUF metadata: SENTENCEPIECE_TOKENS, <s> and </s> its BOS and EOS."""
    writer.add_tokenizer_model("llama")
    writer.add_token_list(SENTENCEPIECE_TOKENS)
    writer.add_token_scores([0.0] * 259 + [-1000.0 - i for i in range(len(_SPM_CHARS))] +
                            [-1.0 - 0.5 * i for i in range(len(_SPM_PIECES))])
    writer.add_token_types([2, 3, 3, *[6] * 256, *[1] * (len(_SPM_CHARS) + len(_SPM_PIECES))])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)


def _write_gguf_tokenizer(writer: GGUFWriter, hf_dir: str, add_bos_token: bool,
                          pre: str) -> None:
    with open(os.path.join(hf_dir, "tokenizer.json"), encoding="utf-8") as f:
        tok = json.load(f)
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list([t for t, _ in vocab])
    writer.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t, _ in vocab])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    writer.add_bos_token_id(BOS_TOKEN_ID)
    writer.add_eos_token_id(EOS_TOKEN_ID)
    writer.add_add_bos_token(add_bos_token)
    writer.add_chat_template(CHAT_TEMPLATE)


def greedy_token_names(model_dir: str, prompts: list[list[int]], max_new_tokens: int
                       ) -> dict[tuple[int, ...], list[str]]:
    """transformers' greedy float32 continuation of each prompt, each token named as the
    gateway's logprobs name it with `return_tokens_as_token_ids` ("token_id:N"): the
    reference the served tests compare with (by id: special tokens' texts are all "")."""
    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    out = {}
    for prompt in prompts:
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0, eos_token_id=None,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        out[tuple(prompt)] = [f"token_id:{t}" for t in ids[0, len(prompt):].tolist()]
    return out
