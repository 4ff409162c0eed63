"""Tensor parallelism across processes: tp=N gives the tokens of tp=1 and of transformers,
with chunked prefill, piggybacking and preemption; seeded sampling is identical across tp; one
forward makes exactly 2 all-reduces per layer + 1 (embedding) + 1 all-gather (LM head); a
model whose heads do not divide by tp is refused before anything is spawned; a rank killed
with SIGKILL ends the others with an error naming it, within seconds; an engine never shut
down ends its group before the interpreter finalizes; rank 0 forwards each plan's bytes as
they came from Redis."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from gpu_worker.service import PlanLoop, _decode_plan
from gpu_worker.tp.executor import TPExecutor
from services.engine import LLMEngine
from shared.engine_args import EngineArgs
from shared.errors import PacerError
from shared.keys import Keys
from shared.plan import IterationPlan, StepResult
from shared.protocol import STREAM_FIELD, PlanMsg, to_fields
from shared.sampling import SamplingParams
from tests.helpers_tiny_model import write_tiny_llama
from tests.hf_reference import NEW_TOKENS, assert_same_tokens
from tests.test_engine_parity import CONFIGS, kv_blocks_to_force_preemption, tiny  # noqa: F401

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEADLINE_S = 20      # a hang would last the 30 s collective timeout or forever; death takes ~1 s


def run_tp(model: str, prompts, sampling, tp: int, **overrides) -> tuple[list[list[int]], int]:
    """Generate to completion; returns tokens and the number of preemptions."""
    if overrides.get("num_kv_blocks", 512) is None:
        overrides["num_kv_blocks"] = kv_blocks_to_force_preemption(prompts, 16)
    with LLMEngine(EngineArgs(model=model, block_size=16, tp=tp,
                                 **{"dtype": "float32", "quantization": "none", **overrides}),
                   progress=False) as engine:
        results = engine.generate(prompts, sampling)
        bm = engine.scheduler.block_manager
        bm.check_integrity()
        assert bm.num_free_blocks == bm.num_total_blocks
        return [r.token_ids for r in results], engine.scheduler.num_preemptions_total


def greedy(n: int, max_tokens: int = NEW_TOKENS) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=max_tokens, temperature=0.0)] * n


def child_pids() -> set[int]:
    pids: set[int] = set()
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as f:
            pids.update(int(p) for p in f.read().split())
    return pids


# ---- the cut must fall on head boundaries ------------------------------------------------

def test_tp_that_splits_a_head_is_refused_before_spawning():
    before = child_pids()
    with pytest.raises(PacerError, match="tp=2 does not divide the model's 9 query heads "
                                         "and 3 KV heads"):
        LLMEngine(EngineArgs(tp=2), progress=False)
    assert child_pids() <= before


# ---- greedy parity: tp=2 on the tiny GQA model (4 query heads, 2 KV heads) ---------------

@pytest.mark.parametrize("name,overrides,expect_preemption",
                         [c for c in CONFIGS if c[0] != "big-budget"])
def test_tiny_tp2_matches_tp1_and_transformers(tiny, name, overrides, expect_preemption):
    path, prompts, refs = tiny
    overrides = {**overrides, "max_model_len": 512}
    ours, preemptions = run_tp(path, prompts, greedy(len(prompts)), 2, **overrides)
    single, _ = run_tp(path, prompts, greedy(len(prompts)), 1, **overrides)
    if expect_preemption:
        assert preemptions > 0, "the small KV pool did not preempt"
    for k, (o, s, (r, logits)) in enumerate(zip(ours, single, refs)):
        assert_same_tokens(o, r, logits, f"tp=2 {name} prompt {k} vs transformers")
        assert_same_tokens(o, s, logits, f"tp=2 {name} prompt {k} vs tp=1")


# ---- greedy parity: tp=3 on the default SmolLM2 (9 query heads, 3 KV heads) --------------

SMOL_TOKENS = 16


@pytest.fixture(scope="module")
def smollm_small(smollm_chat):
    """4 chat prompts and transformers' first 16 greedy tokens for each."""
    prompts, refs = smollm_chat
    return prompts[3:7], [(r[:SMOL_TOKENS], logits[:SMOL_TOKENS]) for r, logits in refs[3:7]]


@pytest.mark.slow
def test_smollm2_tp3_matches_transformers(smollm_small):
    """(tp=1 against transformers with the same 16-token chunks: tests/test_engine_parity.py)"""
    prompts, refs = smollm_small
    sampling = greedy(len(prompts), SMOL_TOKENS)
    ours, _ = run_tp("smollm2-135m", prompts, sampling, 3, max_num_batched_tokens=16)
    for k, (o, (r, logits)) in enumerate(zip(ours, refs)):
        assert_same_tokens(o, r, logits, f"tp=3 prompt {k} vs transformers")


# ---- seeded sampling ----------------------------------------------------------------------

def test_seeded_sampling_is_identical_across_tp(tiny):
    path, prompts, _ = tiny
    seeded = [SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=100 + i)
              for i in range(4)]
    # an unseeded request too: the ranks must still agree with each other (the executor
    # checks a digest of every iteration's tokens and would raise)
    sampling = seeded + [SamplingParams(max_tokens=24, temperature=1.0)]
    ours, _ = run_tp(path, prompts[:5], sampling, 2, max_num_batched_tokens=16, max_model_len=512)
    single, _ = run_tp(path, prompts[:5], sampling, 1, max_num_batched_tokens=16,
                       max_model_len=512)
    assert ours[:4] == single[:4]
    assert len({tuple(t) for t in ours[:4]}) == 4      # different seeds, different draws


# ---- the communication pattern ------------------------------------------------------------

def test_one_forward_is_two_all_reduces_per_layer_plus_embedding_and_lm_head(tiny):
    path, prompts, _ = tiny
    with LLMEngine(EngineArgs(model=path, dtype="float32", tp=2, block_size=16, num_kv_blocks=64,
                              max_model_len=512), progress=False) as engine:
        runner = engine.runner
        cfg = engine.model_config
        # each rank's KV pool holds only its own KV heads
        assert runner.runner.kv_caches[0][0].shape[2] == cfg.num_kv_heads // 2
        engine.add_request(prompts[2], SamplingParams(max_tokens=4, temperature=0.0))
        for _ in range(2):                          # one prefill, then one decode
            reduces, gathers = runner.tp.num_all_reduces, runner.tp.num_all_gathers
            engine.step()
            assert runner.tp.num_all_reduces - reduces == 2 * cfg.num_layers + 1
            assert runner.tp.num_all_gathers - gathers == 1


def test_an_empty_plan_runs_no_forward(tiny):
    path, _, _ = tiny
    with LLMEngine(EngineArgs(model=path, dtype="float32", tp=2, block_size=16, num_kv_blocks=64,
                              max_model_len=512), progress=False) as engine:
        result = engine.runner.execute(IterationPlan(0, [], [], {}))
        assert result.sampled == {} and engine.runner.tp.num_all_reduces == 0


# ---- failures -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_six_heads(tmp_path_factory) -> str:
    """6 query heads and 3 KV heads: divides by 3, so tp=3 has two followers."""
    return write_tiny_llama(tmp_path_factory.mktemp("six"), seed=2, hidden_size=96,
                            intermediate_size=192, num_attention_heads=6,
                            num_key_value_heads=3, num_hidden_layers=2)


def test_killing_a_follower_ends_the_group_with_an_error_naming_it(tiny_six_heads, capfd):
    engine = LLMEngine(EngineArgs(model=tiny_six_heads, dtype="float32", tp=3, block_size=16, num_kv_blocks=256,
                                  max_model_len=1024), progress=False)
    try:
        followers = engine.runner.followers.procs
        for i in range(4):
            engine.add_request([5 + i] * 20, SamplingParams(max_tokens=900, temperature=0.0,
                                                            ignore_eos=True))
        engine.step()
        killed_at = []

        def kill_rank_1():
            killed_at.append(time.monotonic())
            os.kill(followers[1].pid, signal.SIGKILL)

        threading.Timer(0.2, kill_rank_1).start()       # while iterations run
        with pytest.raises(PacerError, match="tp rank 1 .*killed by SIGKILL"):
            while engine.has_unfinished():
                engine.step()
        assert time.monotonic() - killed_at[0] < DEADLINE_S
        followers[2].wait(timeout=DEADLINE_S)          # the other follower is gone too
        with pytest.raises(PacerError, match="tp rank 1"):     # and the executor stays down
            engine.runner.execute(IterationPlan(10_000, [], [], {}))
    finally:
        engine.shutdown()
    assert "pacer: tp rank 2:" in capfd.readouterr().err   # it said why before leaving


DRIVER = textwrap.dedent("""
    import json, sys, time
    from shared.logging import configure_logging
    configure_logging("driver")              # logs to stderr: stdout carries the pids
    from services.engine import LLMEngine
    from shared.engine_args import EngineArgs
    from shared.sampling import SamplingParams
    engine = LLMEngine(EngineArgs(model=sys.argv[1], dtype="float32", tp=3, block_size=16, num_kv_blocks=64,
                                  max_model_len=512), progress=False)
    engine.generate([[5, 6, 7]], [SamplingParams(max_tokens=4, temperature=0.0)])
    print(json.dumps([p.pid for p in engine.runner.followers.procs.values()]), flush=True)
    time.sleep(600)
""")


def test_killing_rank_0_ends_the_followers(tiny_six_heads, tmp_path):
    err = open(tmp_path / "stderr", "w+")
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, tiny_six_heads], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        pids = json.loads(driver.stdout.readline())
        driver.kill()
        driver.wait()
        deadline = time.monotonic() + DEADLINE_S
        while any(os.path.exists(f"/proc/{p}") and not _is_zombie(p) for p in pids):
            assert time.monotonic() < deadline, "the followers outlived rank 0"
            time.sleep(0.1)
    finally:
        if driver.poll() is None:
            driver.kill()
    err.seek(0)
    text = err.read()
    assert text.count("tp rank 0") >= 2 and "is gone" in text, text


EXITS_WITHOUT_SHUTDOWN = textwrap.dedent("""
    import atexit, sys
    import torch.distributed as dist
    from services.engine import LLMEngine
    from shared.engine_args import EngineArgs
    from shared.sampling import SamplingParams

    def after_the_engines_turn():        # registered first: runs after the engine's handler
        procs = engine.runner.followers.procs.values()
        print("group destroyed" if not dist.is_initialized() else "group alive",
              "followers reaped" if all(p.poll() is not None for p in procs) else "running",
              flush=True)
    atexit.register(after_the_engines_turn)
    engine = LLMEngine(EngineArgs(model=sys.argv[1], dtype="float32", tp=2, block_size=16,
                                  num_kv_blocks=64, max_model_len=512), progress=False)
    engine.generate([[5, 6, 7]], [SamplingParams(max_tokens=4, temperature=0.0)])
""")


def test_an_engine_left_without_shutdown_ends_its_group_before_the_interpreter_finalizes(tiny):
    """A program that never calls shutdown(): the executor's exit handler ends the followers
    and destroys the process group while the interpreter still runs; left to finalization,
    a gloo thread letting go of a collective's tensors can abort the process (-6)."""
    path, _, _ = tiny
    proc = subprocess.run([sys.executable, "-c", EXITS_WITHOUT_SHUTDOWN, path], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[-2] == "group destroyed followers reaped", proc.stdout


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


# ---- the command line ---------------------------------------------------------------------

def test_pacer_generate_tp2_gives_the_tp1_tokens(tiny, tmp_path):
    path, prompts, _ = tiny
    (tmp_path / "in.jsonl").write_text(
        "".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts[:3]))
    out = tmp_path / "out.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "generate", "--model", path, "--tp", "2",
         "--max-num-batched-tokens", "16", "--max-model-len", "512", "--num-kv-blocks", "128",
         "--max-tokens", "12", "--prompts", str(tmp_path / "in.jsonl"), "--output", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "error" not in proc.stderr.lower(), proc.stderr      # followers left cleanly
    got = [json.loads(line)["token_ids"] for line in out.read_text().splitlines()]
    single, _ = run_tp(path, prompts[:3], greedy(3, 12), 1, max_num_batched_tokens=16,
                       max_model_len=512, num_kv_blocks=128)
    assert got == single


def test_rank_0_forwards_a_plans_bytes_as_they_came_from_redis():
    class Recording(TPExecutor):
        def __init__(self):                      # no group: records what execute() gets
            self.wires = []

        def execute(self, plan, wire=None):
            self.wires.append(wire)
            return StepResult(plan.step, {})

    fields = to_fields(PlanMsg(IterationPlan(3, [], [], {})), scheduler="s")
    plan, wire = _decode_plan({k.encode(): v for k, v in fields.items()})
    assert wire is fields[STREAM_FIELD]             # the entry's own bytes, not re-encoded
    executor = Recording()
    loop = PlanLoop(None, Keys(), executor, {}, "0-0", "run")
    loop._execute(plan, wire)
    assert executor.wires == [wire]


# ---- the agreement check ------------------------------------------------------------------

AGREEMENT_RANK = textwrap.dedent("""
    import json, sys
    from gpu_worker.tp.broadcast import AgreementCheck
    from gpu_worker.tp.group import destroy, init_tp_group
    from shared.errors import PacerError
    from shared.plan import SampledToken, StepResult
    rank, port, diverge_at = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    group = init_tp_group(rank, 2, "127.0.0.1", port, "gloo")
    check = AgreementCheck(group)
    outcome = {"every": check.every, "error": None, "steps": 0}
    try:
        for step in range(1, 11):
            token = 7 if rank == 1 and step == diverge_at else step
            check.after(StepResult(step, {"a": SampledToken(token), "b": SampledToken(3)}))
            outcome["steps"] = step
    except PacerError as e:
        outcome["error"] = str(e)
    group.store.add("pacer/left", 1)       # leave together: the watchdog would see a death
    while group.store.add("pacer/left", 0) < 2:
        pass
    destroy(group)
    print(json.dumps(outcome), flush=True)
""")


@pytest.mark.parametrize("every,diverge_at,completed,when", [
    (None, 3, 2, "at step 3"),                 # the default: every iteration
    ("4", 6, 7, "between steps 5 and 8"),      # the check at 4 passes; step 6 is caught at 8
])
def test_ranks_that_sample_differently_are_stopped(every, diverge_at, completed, when):
    """Two real ranks (gloo): rank 1 samples another token at one step; both ranks stop
    with the step named, checking every iteration (default) or every N (rank 0's
    PACER_TP_CHECK_EVERY, which the follower takes from it)."""
    from gpu_worker.tp.group import find_free_port
    port = find_free_port()
    procs = []
    for rank in (0, 1):
        env = {k: v for k, v in os.environ.items() if k != "PACER_TP_CHECK_EVERY"}
        if every and rank == 0:
            env["PACER_TP_CHECK_EVERY"] = every
        procs.append(subprocess.Popen(
            [sys.executable, "-c", AGREEMENT_RANK, str(rank), str(port), str(diverge_at)],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outcomes = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outcomes.append(json.loads(out))
    for o in outcomes:
        assert o["every"] == int(every or 1)
        assert o["steps"] == completed and o["error"].endswith(when), o
        assert "ranks [1] sampled different tokens" in o["error"]
