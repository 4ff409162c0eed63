"""A Llama-family decoder over one flat batch: x is [T, d] for all requests together.

Only attention sees request boundaries (through AttentionMetadata); every linear sees the
flat [T, d] tensor (docs/design.md#one-flat-batch). Only the rows that sample reach the LM head.
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch
from torch import nn

from gpu_worker.attention import AttentionMetadata
from gpu_worker.model.layers import (ColumnParallelLinear, ParallelLMHead, RMSNorm,
                                     RotaryEmbedding, RowParallelLinear, VocabParallelEmbedding,
                                     gpu_16bit, prepack)
from gpu_worker.parallel import TPGroup
from gpu_worker.profiling import scope
from gpu_worker.quant.linear import vnni_tiles_from_rows
from shared.errors import ModelLoadError
from shared.model_config import ModelConfig


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, quant: str | None = None):
        super().__init__()
        self.num_heads = tp.shard(cfg.num_heads, "query heads")
        self.num_kv_heads = tp.shard(cfg.num_kv_heads, "KV heads")
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [q, kv, kv], tp, quant,
                                             bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear(q, cfg.hidden_size, tp, quant)

    def forward(self, x, rotary, kv_cache, meta, backend, out_dtype):
        # x: [T, d] -> qkv: [T, (H + 2·KVH)·hd] on this rank, in the residual stream's dtype
        T = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.qkv_proj.weight.dtype == torch.bfloat16 and rotary.fused is not None:
            # bfloat16 GEMMs on CPU: an iteration of decodes alone runs RoPE, the K/V store and
            # attention as one op on the GEMM's own output (the backend says None otherwise)
            qkv = self.qkv_proj(x, out_dtype=torch.bfloat16)
            block = getattr(backend, "decode_block", None)
            with scope("attention"):
                o = block(qkv, rotary, kv_cache, meta, self.scale, q_size) if block else None
            if o is not None:
                return self.o_proj(o, out_dtype=out_dtype)
            qkv = qkv.float()           # the residual stream's dtype on CPU
        else:
            qkv = self.qkv_proj(x, out_dtype=out_dtype)
            fused = getattr(backend, "rope_store_attend", None)
            if fused is not None and gpu_16bit(qkv):
                # Triton on a GPU: RoPE and the K/V store in one launch, then attention
                with scope("attention"):
                    o = fused(qkv, rotary, kv_cache, meta, self.scale, self.num_heads,
                              self.num_kv_heads)
                return self.o_proj(o.reshape(T, q_size), out_dtype=out_dtype)
        qk = rotary(meta.positions, qkv[:, :q_size + kv_size].view(T, -1, self.head_dim))
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, q_size + kv_size:].view(T, self.num_kv_heads, self.head_dim)
        with scope("attention"):
            o = backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(o.reshape(T, q_size), out_dtype=out_dtype)


class LlamaMLP(nn.Module):
    fused = None        # the CPU kernels' silu_and_mul (bfloat16 weights), see set_dtypes

    def __init__(self, cfg: ModelConfig, tp: TPGroup, quant: str | None = None):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, tp,
                                                 quant)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, tp, quant)
        self.local_ffn = self.gate_up_proj.local_sizes[0]

    def forward(self, x, out_dtype):
        # The [T, 2·ffn] intermediate stays in the weights' dtype: with bfloat16 weights on
        # CPU, casting it to the float32 stream and back cost more than SwiGLU in bfloat16.
        gate_up = self.gate_up_proj(x, out_dtype=self.gate_up_proj.weight.dtype)
        if self.fused is not None and gate_up.dtype == torch.bfloat16:
            h = gate_up.new_empty((gate_up.shape[0], self.local_ffn))
            self.fused.silu_and_mul(gate_up, h)         # one pass, rounded once
        elif gpu_16bit(gate_up):
            from gpu_worker.model import triton_ops
            h = triton_ops.silu_and_mul(gate_up, self.local_ffn)
        else:
            gate, up = gate_up[:, :self.local_ffn], gate_up[:, self.local_ffn:]
            h = nn.functional.silu(gate) * up
        return self.down_proj(h, out_dtype=out_dtype)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, quant: str | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, tp, quant)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg, tp, quant)

    def forward(self, x, delta, rotary, kv_cache, meta, backend):
        """x is the residual stream and `delta` the previous layer's MLP output, not added yet
        (None before the first layer): the norms add it in the same pass (x += delta, in
        place) and hand the GEMMs their input in the weights' dtype. With the CPU kernels'
        norms, the attention and MLP outputs stay in that dtype too (the norm widens them as
        it adds). Returns (x, this layer's MLP output)."""
        mm = self.mlp.gate_up_proj.weight.dtype
        fused = self.input_layernorm.fused
        narrow = mm if fused is not None and hasattr(fused, "decode_attention_block") else x.dtype
        h = self.input_layernorm.add_(x, delta, mm)
        a = self.self_attn(h, rotary, kv_cache, meta, backend, narrow)
        h = self.post_attention_layernorm.add_(x, a, mm)           # x += a, in place
        return x, self.mlp(h, narrow)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, quant: str | None = None,
                 max_positions: int | None = None):
        """`quant` ("int4", "int8" or None): the matrices' scheme (gpu_worker/quant); the
        layers then hold packed integers and no float weights. `max_positions`: the RoPE
        tables' rows, the engine's context (default the config's, which may say a million)."""
        super().__init__()
        self.cfg = cfg
        self.quant = quant
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, quant)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, tp, quant) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, quant)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions or cfg.max_position_embeddings,
                                      cfg.rope_theta, cfg.rope_scaling)
        self.act_dtype = torch.float32
        # decodes alone through the kernels' DecoderStack where it applies (_decoder_stack);
        # False keeps the layer-by-layer path (the tests compare the two)
        self.native_decode = True
        self._stack = None          # (the kv caches it was built over, the stack or None)

    def set_dtypes(self, weight_dtype: torch.dtype, act_dtype: torch.dtype,
                   fused_ops=None) -> None:
        """Matrices (linears, embedding, LM head) in weight_dtype; norms, RoPE tables and the
        residual stream in act_dtype. `fused_ops` (the CPU kernels module) replaces the norms',
        RoPE's and SwiGLU's torch ops: the bfloat16-weight path; the float32 path keeps torch's ops,
        whose bits the parity tests compare with transformers."""
        self.act_dtype = act_dtype
        for module in self.modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)):
                if module.quant:
                    continue        # integers; the placeholder says bfloat16, their GEMMs' input
                module.weight.data = module.weight.data.to(weight_dtype)
            elif isinstance(module, RMSNorm):
                module.weight.data = module.weight.data.to(act_dtype)
            if isinstance(module, (RMSNorm, RotaryEmbedding, LlamaMLP)):
                module.fused = fused_ops
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
            self.lm_head.qweight = self.embed_tokens.qweight
        for module in self.modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)):
                if module.qweight is not None:
                    continue            # packed already, in its integer layout
                module.packed = prepack(module.weight.data)
                if module.packed is not None and module.weight is not self.embed_tokens.weight:
                    # the packed copy replaces W (only its dtype is read from now on); a tied
                    # LM head keeps it: the embedding looks rows up in it
                    module.weight.data = module.weight.data.new_empty(0)

    def forward(self, input_ids: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata, backend, after_layer=None,
                before_layers=None) -> torch.Tensor:
        """input_ids: [T] -> logits of the sampling rows: [S, V] (float32). `after_layer(l)`,
        when given, is called once layer l has written its K/V to the pool (P/D's layer
        streaming, gpu_worker/kv_transfer); `before_layers()` as the layers start."""
        x = self.embed_tokens(input_ids).to(self.act_dtype)
        stack = self._decoder_stack(kv_caches) if after_layer is None else None
        group = backend.decode_group(meta, kv_caches[0][0].dtype) \
            if stack is not None and hasattr(backend, "decode_group") else None
        if before_layers is not None:
            before_layers()
        by_prefill = self._mixed_rows(stack, meta, backend, kv_caches) \
            if stack is not None and group is None else None
        if group is not None:       # decodes alone: every layer in one C++ call
            with scope("layers"):
                delta = stack.decode(x, meta.positions, meta.slot_mapping, group.block_tables,
                                     group.kv_lens)
        elif by_prefill is not None:    # with prompt chunks: the same, each row's kernel its own
            with scope("layers"):
                delta = stack.mixed(x, meta.positions, meta.slot_mapping, meta.block_table,
                                    meta.cu_seqlens_q, meta.seqused_k, by_prefill)
        else:
            delta = None
            for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
                x, delta = layer(x, delta, self.rotary, kv_cache, meta, backend)
                if after_layer is not None:
                    after_layer(index)
        x.add_(delta)
        h = self.norm(x[meta.sample_rows])
        with scope("lm_head"):
            return self.lm_head(h).float()

    def _mixed_rows(self, stack, meta, backend, kv_caches):
        """The rows' kernels for DecoderStack.mixed (TorchAttentionBackend.mixed_rows), or None
        where the layers' own path serves the iteration."""
        if not hasattr(backend, "mixed_rows"):
            return None
        attn = self.layers[0].self_attn
        return backend.mixed_rows(meta, kv_caches[0][0].dtype, attn.head_dim,
                                  attn.num_heads // attn.num_kv_heads)

    def _decoder_stack(self, kv_caches):
        """The CPU kernels' DecoderStack over these caches (csrc/decoder.cpp: an iteration of
        decodes runs every layer in one call, the same kernels as the layers' own path), built
        once; None where it does not apply: `native_decode` off, no kernels with it, sharded
        weights, biases, or a layer whose matrices are not unpadded int4 in the VNNI layout."""
        if not self.native_decode:
            return None
        if self._stack is not None and self._stack[0] is kv_caches:
            return self._stack[1]
        stack = self._build_decoder_stack(kv_caches)
        self._stack = (kv_caches, stack)
        return stack

    def _build_decoder_stack(self, kv_caches):
        kernels = self.norm.fused
        if kernels is None or not hasattr(kernels, "DecoderStack") or \
                self.act_dtype != torch.float32 or self.rotary.fused is None:
            return None
        linears = [(layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                    layer.mlp.down_proj) for layer in self.layers]
        weights = [m.qweight for four in linears for m in four]
        if self.cfg.qkv_bias or any(m.tp.size != 1 for four in linears for m in four) or not all(
                getattr(w, "scheme", None) == "int4" and w.vnni is not None
                and w.padded_out == w.out_features
                and w.group == weights[0].group for w in weights):
            return None
        cfg, attn = self.cfg, self.layers[0].self_attn
        stack = kernels.DecoderStack(cfg.hidden_size, attn.num_heads, attn.num_kv_heads,
                                     attn.head_dim, self.layers[0].mlp.local_ffn,
                                     weights[0].group, self.layers[0].input_layernorm.eps,
                                     attn.scale, self.rotary.cos, self.rotary.sin,
                                     tiles_from_rows=vnni_tiles_from_rows())
        for layer, (qkv, o, gate_up, down), (k_cache, v_cache) in zip(self.layers, linears,
                                                                        kv_caches):
            stack.add_layer(layer.input_layernorm.weight, qkv.qweight.vnni, o.qweight.vnni,
                            layer.post_attention_layernorm.weight, gate_up.qweight.vnni,
                            down.qweight.vnni, k_cache, v_cache)
        return stack

    # ---- loading ---------------------------------------------------------------------------

    @torch.no_grad()
    def init_random(self, std: float = 0.02, seed: int = 0) -> None:
        """`--load-format dummy`: N(0, std) matrices and unit norms, made where the parameters
        are (on the device), reproducible for a seed."""
        gen = torch.Generator(device=self.embed_tokens.weight.device).manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=gen)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy each checkpoint tensor's shard into its parameter; prove every (parameter,
        part) was filled exactly once. Returns the number of tensors used."""
        targets = dict(self._weight_targets())
        loaded: set[tuple[str, int]] = set()
        used = 0
        for name, tensor in weights:
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue            # tied: the embedding is the LM head
            if name not in targets:
                raise ModelLoadError(f"checkpoint tensor {name!r} has no place in the model")
            module, part = targets[name]
            key = (name, part)
            if key in loaded:
                raise ModelLoadError(f"checkpoint tensor {name!r} appears twice")
            module.load(part, tensor)
            loaded.add(key)
            used += 1
        missing = sorted(n for n in targets if (n, targets[n][1]) not in loaded)
        if missing:
            raise ModelLoadError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
        return used

    def _weight_targets(self) -> Iterator[tuple[str, tuple[nn.Module, int]]]:
        """HF tensor name -> (module that owns it, part of a fused weight)."""
        yield "model.embed_tokens.weight", (self.embed_tokens, 0)
        yield "model.norm.weight", (self.norm, 0)
        if not self.cfg.tie_word_embeddings:
            yield "lm_head.weight", (self.lm_head, 0)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            for part, n in enumerate(("q_proj", "k_proj", "v_proj")):
                yield p + f"self_attn.{n}.weight", (attn.qkv_proj, part)
                if attn.qkv_proj.bias is not None:
                    yield p + f"self_attn.{n}.bias", (attn.qkv_proj.bias, part)
            yield p + "self_attn.o_proj.weight", (attn.o_proj, 0)
            yield p + "mlp.gate_proj.weight", (mlp.gate_up_proj, 0)
            yield p + "mlp.up_proj.weight", (mlp.gate_up_proj, 1)
            yield p + "mlp.down_proj.weight", (mlp.down_proj, 0)
            yield p + "input_layernorm.weight", (layer.input_layernorm, 0)
            yield p + "post_attention_layernorm.weight", (layer.post_attention_layernorm, 0)
