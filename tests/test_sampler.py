"""The sampler: greedy, temperature, top-k, top-p, per-request seeds, log-probabilities."""
from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from gpu_worker.cpu_kernels import cpu_kernels
from gpu_worker.sampler import Sampler, argmax, hash32, seeded_bits, seeded_row_uniforms
from shared.sampling import SamplingParams


def logits(rows: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def argmax_case(rows: int, vocab: int, tie: tuple[int, int] = (1, 3)) -> torch.Tensor:
    """Logits an argmax gets wrong easily: a tie for the largest at the columns `tie` (the
    first must win), two NaNs (the first wins), a row of -inf, +inf in the last column."""
    x = logits(rows, vocab, seed=vocab)
    if vocab > max(tie):
        x[0, tie[0]] = x[0, tie[1]] = x[0].max() + 1
    if rows > 1:
        x[1, vocab // 2] = x[1, vocab - 1] = float("nan")
        x[2] = float("-inf")
        x[-1, -1] = float("inf")
    return x


@pytest.mark.parametrize("vocab", [1, 5, 16, 17, 49152, 49157])
@pytest.mark.parametrize("rows", [1, 3, 33])
def test_the_kernels_argmax_is_torchs(rows, vocab):
    """csrc/sampling.cpp against torch.argmax: those cases, and vocabularies that do not fill
    a vector."""
    if cpu_kernels() is None:
        pytest.skip("no CPU kernels here: torch's argmax serves")
    x = argmax_case(rows, vocab)
    assert torch.equal(argmax(x), x.argmax(dim=-1))


def test_greedy_is_argmax():
    x = logits()
    out = Sampler(seed=0).sample(x, [SamplingParams(temperature=0.0)] * 4, [0] * 4)
    assert [t.token_id for t in out] == x.argmax(-1).tolist()


def test_top_k_1_is_greedy():
    x = logits()
    out = Sampler(seed=0).sample(x, [SamplingParams(temperature=1.0, top_k=1)] * 4, [0] * 4)
    assert [t.token_id for t in out] == x.argmax(-1).tolist()


def test_seeded_draw_ignores_the_rest_of_the_batch():
    x = logits(rows=6)
    p = SamplingParams(temperature=1.0, seed=1234)
    alone = Sampler(seed=1).sample(x[2:3], [p], [5])[0].token_id
    others = [SamplingParams(temperature=1.0)] * 6
    for seed in range(5):
        params = list(others)
        params[2] = p
        mixed = Sampler(seed=seed).sample(x, params, [0, 1, 5, 3, 4, 5])[2].token_id
        assert mixed == alone


def test_seeded_draws_differ_by_output_index():
    x = logits(rows=1, vocab=1000) * 0   # uniform: a repeat would be a 1-in-1000 chance
    p = SamplingParams(temperature=1.0, seed=7)
    draws = [Sampler().sample(x, [p], [n])[0].token_id for n in range(5)]
    assert len(set(draws)) > 1


def test_top_k_and_top_p_restrict_the_support():
    x = logits(rows=1, vocab=50)
    top3 = set(torch.topk(x[0], 3).indices.tolist())
    s = Sampler(seed=0)
    for n in range(200):
        t = s.sample(x, [SamplingParams(temperature=2.0, top_k=3)], [n])[0].token_id
        assert t in top3
    probs = torch.softmax(x[0], -1)
    order = torch.argsort(probs, descending=True)
    nucleus = set(order[:int((probs[order].cumsum(0) < 0.5).sum()) + 1].tolist())
    for n in range(200):
        t = s.sample(x, [SamplingParams(temperature=1.0, top_p=0.5)], [n])[0].token_id
        assert t in nucleus


def test_temperature_one_follows_the_softmax():
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    s = Sampler(seed=0)
    counts = torch.zeros(4)
    n = 4000
    for i in range(n):
        counts[s.sample(x, [SamplingParams(temperature=1.0)], [i])[0].token_id] += 1
    expected = torch.softmax(x[0], -1)
    assert torch.allclose(counts / n, expected, atol=0.03), (counts / n, expected)


def test_logprobs_are_the_log_softmax_with_top_n():
    x = logits(rows=2)
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.0)]
    out = Sampler().sample(x, params, [0, 0])
    ref = torch.log_softmax(x, -1)
    tok = out[0].token_id
    assert abs(out[0].logprob - float(ref[0, tok])) < 1e-6
    ids = [i for i, _ in out[0].top_logprobs]
    assert ids == torch.topk(ref[0], 3).indices.tolist()
    assert out[1].logprob is None and out[1].top_logprobs is None


def test_extreme_parameters_never_produce_nan():
    x = logits(rows=1) * 1000
    s = Sampler(seed=0)
    for p in (SamplingParams(temperature=1e-30), SamplingParams(temperature=1.0, top_p=1e-45),
              SamplingParams(temperature=1e-6, top_p=1e-6, top_k=2), SamplingParams(temperature=100.0)):
        t = s.sample(x, [p], [0])[0].token_id
        assert 0 <= t < x.shape[1]
    assert s.sample(x, [SamplingParams(temperature=1.0, top_p=1e-45)], [0])[0].token_id == int(x.argmax())


@pytest.mark.parametrize("seed", [None, 3])
def test_a_temperature_past_float32s_range_keeps_the_masks(seed):
    """A temperature too large for float32 (JSON allows 1e39) draws uniformly from what the
    masks leave: it was inf there, a masked logit divided by it NaN, and the row had no
    token (the request failed, blaming its constraints)."""
    x = logits(rows=1, vocab=40)
    x[0, 20:] = float("-inf")                   # a grammar's mask
    s = Sampler(seed=0)
    for temperature in (1e39, 1e300):
        p = SamplingParams(temperature=temperature, allowed_token_ids=(3, 7, 25), seed=seed)
        drawn = {s.sample(x, [p], [i], masked=True)[0].token_id for i in range(60)}
        assert drawn == {3, 7}, temperature


# ---- the device sampler: distribution, masks, seeds, one copy per step ----------------------

# chi-square critical values at p = 0.001 by degrees of freedom (a correct sampler fails a
# given seed's test with probability 0.001; the seeds below are fixed, so the test is stable)
_CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


def _expected(x: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution `p` should sample from row `x`, computed the plain way."""
    x = x / p.temperature
    probs = torch.softmax(x, -1)
    order = torch.argsort(probs, descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    if p.top_k:
        keep[order[:p.top_k]] = True
    else:
        keep[:] = True
    masked = torch.where(keep, probs, torch.zeros_like(probs))
    masked = masked / masked.sum()
    if p.top_p < 1.0:
        cum = masked[order].cumsum(0)
        nucleus = order[:int((cum - masked[order] < p.top_p).sum())]
        keep2 = torch.zeros_like(keep)
        keep2[nucleus] = True
        masked = torch.where(keep2, masked, torch.zeros_like(masked))
        masked = masked / masked.sum()
    return masked


def _chi2(counts: torch.Tensor, expected: torch.Tensor) -> tuple[float, int]:
    n = counts.sum()
    support = expected > 0
    assert counts[~support].sum() == 0, "sampled a token outside the support"
    e = expected[support] * n
    return float(((counts[support] - e) ** 2 / e).sum()), int(support.sum()) - 1


@pytest.mark.parametrize("p", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7),
                               SamplingParams(temperature=1.5, top_k=5),
                               SamplingParams(temperature=1.0, top_p=0.8),
                               SamplingParams(temperature=1.3, top_k=6, top_p=0.9)])
@pytest.mark.parametrize("seeded", [True, False])
def test_draws_follow_the_masked_softmax(p, seeded):
    """8 000 draws of one row (seeded: one request's tokens 0..7999; unseeded: one batch of
    8 000 rows) against the softmax of its masked, temperature-scaled logits."""
    x = torch.tensor([1.5, 1.0, 0.6, 0.2, 0.0, -0.4, -1.0, -2.0])
    n = 8000
    if seeded:
        p = SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=11)
    out = Sampler(seed=5).sample(x.expand(n, -1), [p] * n, list(range(n)))
    counts = torch.bincount(torch.tensor([t.token_id for t in out]), minlength=8).float()
    stat, df = _chi2(counts, _expected(x, p))
    assert stat < _CHI2_999[df], (stat, df, counts)


def test_masks_hold_row_by_row_in_a_mixed_batch():
    x = logits(rows=6, vocab=40, seed=3)
    params = [SamplingParams(temperature=2.0, top_k=3), SamplingParams(temperature=1.0, top_p=0.3),
              SamplingParams(temperature=0.0), SamplingParams(temperature=3.0, top_k=5, top_p=0.5, seed=9),
              SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=1e-6, seed=2)]
    support = [set(torch.nonzero(_expected(x[i], p)).flatten().tolist()) if not p.greedy
               else {int(x[i].argmax())} for i, p in enumerate(params)]
    s = Sampler(seed=0)
    for step in range(150):
        out = s.sample(x, params, [step] * 6)
        for i, t in enumerate(out):
            assert t.token_id in support[i], (i, t.token_id, support[i])
    assert support[5] == {int(x[5].argmax())}     # a top_p that rounds to 0: the top token


def test_seeded_tokens_ignore_batch_composition_and_position():
    """A seeded request's n-th token, alone and in batches of other sizes, orders and mixes
    (greedy, unseeded, other seeds, other masks), for n = 0..29."""
    torch.manual_seed(0)
    mine = logits(rows=1, vocab=300, seed=4)[0]
    p = SamplingParams(temperature=1.2, top_k=50, top_p=0.95, seed=2**40 - 3)
    alone = [Sampler().sample(mine[None], [p], [n])[0].token_id for n in range(30)]
    others = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.5, seed=1), SamplingParams(temperature=1.0, top_p=0.5)]
    for size in (2, 5, 17):
        x = logits(rows=size, vocab=300, seed=size)
        at = size // 2
        x[at] = mine
        params = [others[i % len(others)] for i in range(size)]
        params[at] = p
        for n in range(30):
            idx = [(n + i) % 7 for i in range(size)]
            idx[at] = n
            assert Sampler(seed=size).sample(x, params, idx)[at].token_id == alone[n]
    assert len(set(alone)) > 5


def test_any_64_bit_seed_samples_its_own_repeatable_tokens():
    """A millisecond clock reading, the int64 ends, a negative seed: each the same tokens
    every time, and not its neighbour's (both 32-bit halves are hashed)."""
    from shared.sampling import SEED_RANGE
    x = logits(rows=1, vocab=300, seed=7)

    def tokens(seed: int) -> list[int]:
        p = SamplingParams(temperature=1.0, seed=seed)
        return [Sampler().sample(x, [p], [n])[0].token_id for n in range(24)]

    for seed in (1_765_051_200_000, SEED_RANGE[0], SEED_RANGE[1] - 1, -1):
        assert tokens(seed) == tokens(seed), seed
        assert tokens(seed) != tokens(seed + 1 if seed < SEED_RANGE[1] - 1 else seed - 1), seed


@pytest.mark.parametrize("vocab", [4096, 49152])
def test_the_window_gives_the_masks_a_whole_sort_gives(vocab):
    """On a CPU top-k/top-p look at each row's largest values first and sort a row whole only
    where its k or its nucleus reaches past them: the same mask either way. Peaked and flat
    rows, k within and past the window, nuclei inside and outside it, filters off."""
    from gpu_worker.sampler import NUCLEUS_WIDTH, _row_params, _top_k_top_p, _top_k_top_p_sorted
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, vocab, generator=gen)
    x[::2] *= 8                                     # peaked rows: small nuclei
    params = [SamplingParams(top_p=0.9), SamplingParams(top_p=0.5),
              SamplingParams(top_k=50), SamplingParams(top_k=NUCLEUS_WIDTH + 500, top_p=0.95),
              SamplingParams(top_k=20, top_p=0.8), SamplingParams(),
              SamplingParams(top_k=1), SamplingParams(top_p=1e-9)]
    for batch in (params, params[2:3] + params[5:7]):       # with nuclei, top-k alone
        rows = [params.index(p) for p in batch]
        table = torch.tensor([_row_params(i, p, 0) for i, p in enumerate(batch)],
                             dtype=torch.float64)
        got, want = _top_k_top_p(x[rows], table, batch), _top_k_top_p_sorted(x[rows], table)
        assert torch.equal(got.isinf(), want.isinf()), [int((g.isinf() != w.isinf()).sum())
                                                        for g, w in zip(got, want)]
        kept = ~want.isinf()
        assert torch.equal(got[kept], x[rows][kept])
    # at 49,152 the flat row with top-p 0.5 needs more than the window: it took the whole sort
    assert vocab < 49152 or int((~_top_k_top_p_sorted(x[1:2], torch.tensor([_row_params(0, params[1], 0)],
                                                        dtype=torch.float64)).isinf()).sum()) \
        > NUCLEUS_WIDTH


class _HostReads(TorchFunctionMode):
    """Counts every way a tensor's values can reach Python or the host."""
    READS = {"tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"}

    def __init__(self):
        super().__init__()
        self.reads: list[tuple[str, int]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in self.READS or (name == "to" and "cpu" in repr(args[1:]) + repr(kwargs)):
            self.reads.append((name, args[0].numel()))
        return func(*args, **kwargs)


@pytest.mark.parametrize("with_logprobs", [False, True])
def test_one_copy_to_the_host_per_step(with_logprobs):
    """Greedy, unseeded, seeded, top-k/top-p rows (and logprobs for two of them): one read of
    the device per step, of S ids plus, per row that asked, its logprob and top-N pairs."""
    x = logits(rows=6, vocab=1000)
    lp = [3, 0] if with_logprobs else [None, None]
    params = [SamplingParams(temperature=0.0, logprobs=lp[0]), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.8, seed=3, top_k=20),
              SamplingParams(temperature=1.0, top_p=0.7, logprobs=lp[1]),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=4)]
    s = Sampler(seed=0)
    s.sample(x, params, [0] * 6)            # the generator is made on first use
    with _HostReads() as mode:
        out = s.sample(x, params, list(range(6)))
    # 6 ids; 2 rows asked: each its logprob, and top-3 (the most any asked) values and ids
    expected_numel = 6 + (2 + 2 * 3 * 2 if with_logprobs else 0)
    # besides, on a CPU only, the top-p window may look at one flag: does a row need the whole
    # sort (free there; on CUDA every row is sorted and nothing syncs: test_cuda_step_syncs_...)
    flags = [r for r in mode.reads if r[1] == 1]
    assert flags in ([], [("__bool__", 1)]), mode.reads
    assert [r for r in mode.reads if r[1] != 1] == [("tolist", expected_numel)], mode.reads
    assert len(out) == 6 and out[0].token_id == int(x[0].argmax())


def test_hash_matches_a_plain_python_reference():
    """The overflow-free 32-bit multiply in int64 tensors equals the plain integer one."""
    def ref(v: int) -> int:
        m = 0xFFFFFFFF
        v ^= v >> 16
        v = (v * 0x7FEB352D) & m
        v ^= v >> 15
        v = (v * 0x846CA68B) & m
        return v ^ (v >> 16)
    xs = [0, 1, 2, 12345, 0x7FFFFFFF, 0x80000000, 0xDEADBEEF, 0xFFFFFFFE, 0xFFFFFFFF]
    assert hash32(torch.tensor(xs)).tolist() == [ref(v) for v in xs]


def test_seeded_uniforms_are_uniform_and_inside_the_open_interval():
    """A seeded row's uniform over its output index (one seed's successive tokens), and the
    hash's words over columns, are uniform; the seed's high and low words both count."""
    n = 200_000
    for seed_lo, seed_hi in ((5, 0), (5, 1), (6, 0)):
        u = seeded_row_uniforms(torch.full((n,), seed_lo), torch.full((n,), seed_hi),
                                torch.arange(n))[:, 0]
        assert u.dtype == torch.float64 and float(u.min()) > 0 and float(u.max()) < 1
        assert abs(float(u.mean()) - 0.5) < 0.003
        counts = torch.histc(u.float(), bins=16, min=0, max=1)
        stat = float(((counts - counts.mean()) ** 2 / counts.mean()).sum())
        assert stat < 37.7                              # chi-square, 15 df, p = 0.001
    words = seeded_bits(torch.tensor([5, 5, 6]), torch.tensor([0, 1, 0]), torch.tensor([0, 0, 0]),
                        100_000)
    assert int(words.min()) >= 0 and int(words.max()) < 2 ** 32
    assert abs(float(words.double().mean()) / 2 ** 32 - 0.5) < 0.005
    assert not torch.equal(words[0], words[1]) and not torch.equal(words[0], words[2])


# ---- on CUDA (skipped without a GPU; the prepared GPU check runs them) ----------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_cuda_step_syncs_only_in_its_one_copy(monkeypatch):
    """With torch's sync debug mode set to error, a step that mixes every kind of row (and
    logprobs) syncs nowhere but in the sampler's one read of the device."""
    import gpu_worker.sampler as sampler_module
    x = logits(rows=6, vocab=32_000).cuda()
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.8, seed=3, top_k=20),
              SamplingParams(temperature=1.0, top_p=0.7, logprobs=0),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=4)]
    s = Sampler(seed=0)
    s.sample(x, params, [0] * 6)
    reads = []

    def one_read(t):
        torch.cuda.set_sync_debug_mode(0)
        try:
            reads.append(t.numel())
            return t.tolist()
        finally:
            torch.cuda.set_sync_debug_mode(2)
    monkeypatch.setattr(sampler_module, "to_host", one_read)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode(2)
    try:
        out = s.sample(x, params, list(range(6)))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert len(reads) == 1 and out[0].token_id == int(x[0].argmax())


@cuda
def test_cuda_seeded_tokens_equal_the_cpu_ones():
    """The hash gives the same uniforms on both devices, so seeded draws from the same
    float32 logits agree (a draw may differ only where the devices' softmax rounds a CDF
    boundary onto the other side of u: allow 1 in 100)."""
    x = logits(rows=64, vocab=5000, seed=9)
    params = [SamplingParams(temperature=0.9, seed=1000 + i) for i in range(64)]
    u_cpu = seeded_row_uniforms(torch.arange(64), torch.zeros(64, dtype=torch.int64),
                                torch.full((64,), 5))
    u_gpu = seeded_row_uniforms(torch.arange(64).cuda(), torch.zeros(64, dtype=torch.int64).cuda(),
                                torch.full((64,), 5).cuda())
    assert torch.equal(u_cpu, u_gpu.cpu())
    same = 0
    for n in range(10):
        a = [t.token_id for t in Sampler().sample(x, params, [n] * 64)]
        b = [t.token_id for t in Sampler().sample(x.cuda(), params, [n] * 64)]
        same += sum(i == j for i, j in zip(a, b))
    assert same >= 0.99 * 640, same


def test_a_long_kernel_lets_other_python_threads_run():
    """The compute kernels release the GIL (csrc/bindings.cpp kReleaseGil): while one runs, the
    worker's event loop thread can send the last step's tokens. With a switch interval far
    longer than the call, another thread gets the GIL during it only if the kernel lets go."""
    import sys
    import threading
    import time
    if cpu_kernels() is None:
        pytest.skip("no CPU kernels here")
    x = torch.randn(32, 1 << 20)
    out = torch.empty(32, dtype=torch.int64)
    spins, done = [0], threading.Event()

    def spin() -> None:
        while not done.is_set():
            spins[0] += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.5)
    thread = threading.Thread(target=spin)
    during = []
    try:
        thread.start()
        while not spins[0]:         # spinning before the first call (sleep lets go of the GIL)
            time.sleep(0.001)
        # a few calls, well inside the switch interval together: on a busy machine the other
        # thread may find no free core during one ~30 ms call
        for _ in range(5):
            before = spins[0]
            cpu_kernels().argmax_rows(x, out)
            during.append(spins[0] - before)
            if during[-1]:
                break
    finally:
        done.set()
        thread.join()
        sys.setswitchinterval(interval)
    assert any(during), during
    assert torch.equal(out, x.argmax(dim=-1))
