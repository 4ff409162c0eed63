"""`pacer simulate`: the real scheduling core on a fake clock priced by the cost model."""
from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from scheduler_svc.arrivals import (MAX_LENGTH, Arrival, arrival_times, parse_length, read_trace,
                                    synthetic)
from scheduler_svc.sim_report import summarize
from scheduler_svc.core import Scheduler
from scheduler_svc.simulator import Hop, simulate, simulate_disaggregated
from services.cli import main
from shared.config import SchedulerConfig
from shared.cost_model import MODELS, RooflineCost
from shared.errors import PacerError
from shared.fabric import load_fabric
from shared.hardware import HARDWARE

H100_7B = RooflineCost(MODELS["llama-2-7b"], HARDWARE["h100"])


class RowsCost:
    """1 ms per Q row: the clock can be followed by hand."""

    def iteration_ms(self, chunks):
        return float(sum(q for q, _ in chunks))


def config(**kw) -> SchedulerConfig:
    base = dict(max_num_batched_tokens=2048, max_num_seqs=256, num_kv_blocks=8000,
                block_size=16, max_model_len=200_000)
    return SchedulerConfig(**(base | kw))


# ---- the clock ------------------------------------------------------------------------------

def test_clock_follows_the_iteration_costs():
    arrivals = [Arrival(0.0, 10, 3), Arrival(0.0105, 2, 2)]
    result = simulate(arrivals, config(max_num_batched_tokens=4, block_size=4), RowsCost())
    # a: 4, 4, 2 rows (first token at 10 ms), a decode alone (11 ms); b arrived at 10.5 ms
    # and joins the next: a's decode + b's 2 rows = 3 ms (14 ms); b's decode alone (15 ms).
    assert list(result.timeline.ms) == [4, 4, 2, 1, 3, 1]
    assert result.first_token_s == pytest.approx([0.010, 0.014])
    assert list(result.tbt_ms) == pytest.approx([1.0, 3.0, 1.0])
    assert result.finish_s == pytest.approx([0.014, 0.015])


def test_the_schedulers_read_the_simulated_clock(monkeypatch):
    """What a scheduler times by its clock (a TTFT goal's deadlines, the token-gap target's
    pace) is simulated time: each request arrives at its arrival's time, by the clock the
    scheduler reads then, on every instance of a P/D cluster too."""
    seen = []
    add_request = Scheduler.add_request

    def spy(self, request_id, prompt_token_ids, sampling, *args, arrival_s=None, **kw):
        seen.append((arrival_s, self.clock()))
        return add_request(self, request_id, prompt_token_ids, sampling, *args,
                           arrival_s=arrival_s, **kw)

    monkeypatch.setattr(Scheduler, "add_request", spy)
    arrivals = [Arrival(0.25, 10, 3), Arrival(1.5, 2, 2)]
    simulate(arrivals, config(), H100_7B)
    simulate_disaggregated(arrivals, config(), config(), H100_7B,
                           Hop.of(H100_7B, load_fabric("nvlink")))
    assert seen == [(0.25, 0.25), (1.5, 1.5)] * 2


def test_every_request_gets_exactly_its_output_length():
    arrivals = synthetic(200, 20.0, 0.5, "uniform:16:512", "uniform:1:64", seed=3)
    for chunked in (True, False):
        result = simulate(arrivals, config(enable_chunked_prefill=chunked), H100_7B)
        assert len(result.tbt_ms) == sum(a.output_len - 1 for a in arrivals)
        assert all(f >= a.arrival_s for f, a in zip(result.first_token_s, arrivals))
        ends = list(result.timeline.end_s)
        assert ends == sorted(ends)


def test_a_request_too_big_for_the_pool_is_rejected_not_run():
    arrivals = [Arrival(0.0, 100, 4), Arrival(0.0, 10_000, 4)]
    result = simulate(arrivals, config(num_kv_blocks=64), H100_7B)
    assert len(result.arrivals) == 1 and len(result.rejected) == 1
    assert "KV blocks" in result.rejected[0][1]


# ---- docs/design.md#why-chunked-prefill in small --------------------------------------------

def test_chunking_flattens_the_tbt_spike_of_a_long_prompt():
    arrivals = synthetic(150, 4.0, 1.0, "uniform:256:1024", "uniform:64:256", seed=1)
    arrivals = sorted(arrivals + [Arrival(10.0, 30_000, 4, "long")], key=lambda a: a.arrival_s)
    base = config(max_iteration_ms=20.0, iteration_cost=H100_7B)
    orca = summarize(simulate(arrivals, replace(base, enable_chunked_prefill=False), H100_7B))
    chunked = summarize(simulate(arrivals, base, H100_7B))
    assert orca["tbt_max_over_median"] > 100
    assert chunked["tbt_max_over_median"] < 10
    assert chunked["tbt_ms"]["max"] <= 20.0 + 1e-9     # the latency budget held throughout
    assert orca["ttft_ms_long"]["n"] == chunked["ttft_ms_long"]["n"] == 1


@pytest.mark.parametrize("budget", [dict(max_iteration_ms=20.0), dict(target_tbt_factor=1.5)])
def test_a_prompt_at_the_memory_wall_is_not_starved_by_short_ones(budget):
    """A 100k-token prompt among 4 short ones a second on a pool of 122,880 tokens: its
    chunks meet the latency budget's floor once each one reads ~90k tokens of K/V, and
    nothing is admitted beside it from then on. Before, the short prompts let in first kept
    the batch full: the long one crawled four rows an iteration (TTFT 86 s with the fixed
    budget, 25 s with the auto target), the pool filled and 66 and 7 requests were
    preempted, and the streams saw gaps of 0.5 and 2.2 s (docs/design.md#short-prompts-beside-long-ones)."""
    arrivals = synthetic(400, 4.0, 1.0, "uniform:256:1024", "uniform:128:512", seed=1)
    arrivals = sorted(arrivals + [Arrival(20.0, 100_000, 4, "long")], key=lambda a: a.arrival_s)
    result = simulate(arrivals, config(iteration_cost=H100_7B, num_kv_blocks=7680, **budget),
                      H100_7B)
    report = summarize(result)
    assert report["preemptions"] == 0
    assert report["ttft_ms_long"]["max"] < 20_000
    assert report["tbt_max_over_median"] < 15
    if "max_iteration_ms" in budget:
        assert report["tbt_ms"]["max"] <= 20.0 + 0.1


def test_same_seed_same_run_other_seed_other_run():
    def run(seed):
        arrivals = synthetic(300, 30.0, 1.0, "lognormal:300:0.8:4000", "uniform:8:64", seed)
        return simulate(arrivals, config(max_num_batched_tokens=512), H100_7B)
    a, b, c = run(7), run(7), run(8)
    assert list(a.tbt_ms) == list(b.tbt_ms) and a.timeline.to_dict() == b.timeline.to_dict()
    assert list(a.tbt_ms) != list(c.tbt_ms)


# ---- arrivals ------------------------------------------------------------------------------

def test_length_specs():
    import random
    rng = random.Random(0)
    assert parse_length("512")(rng) == 512
    assert {parse_length("uniform:3:5")(rng) for _ in range(200)} == {3, 4, 5}
    draws = [parse_length("lognormal:100:1.5:300")(rng) for _ in range(2000)]
    assert 1 <= min(draws) and max(draws) == 300
    for bad in ("0", "uniform:5:3", "uniform:1", "normal:3:4", "lognormal:0:1", "x",
                "lognormal:inf:0.8", "lognormal:100:inf", "lognormal:nan:1"):
        with pytest.raises(PacerError):
            parse_length(bad)
    # a sigma wide enough that exp() of its tail overflows: draws clipped to [1, MAX] still
    wide = [parse_length("lognormal:100:1000:5000")(rng) for _ in range(200)]
    assert set(wide) <= set(range(1, 5001)) and {1, 5000} <= set(wide)


def test_lengths_past_any_context_are_refused_before_the_run(tmp_path, capsys):
    # The simulator queues each prompt as a list of token ids: --prompt-len 1000000000 took
    # 16 GB (and minutes) before the KV pool turned the first request away.
    too_long = str(MAX_LENGTH + 1)
    for bad in (too_long, f"uniform:1:{too_long}", f"lognormal:100:1:{too_long}"):
        with pytest.raises(PacerError, match=f"at most {MAX_LENGTH:,} tokens"):
            parse_length(bad)
    assert parse_length(str(MAX_LENGTH))(None) == MAX_LENGTH
    # a wide lognormal without MAX is clipped there
    assert max(parse_length("lognormal:1000:50")(random.Random(s)) for s in range(50)) == MAX_LENGTH
    trace = tmp_path / "trace.jsonl"
    trace.write_text(f'{{"arrival_s": 0, "prompt_len": {too_long}, "output_len": 8}}\n')
    with pytest.raises(PacerError, match=f"line 1: .*lengths from 1 to {MAX_LENGTH:,} tokens"):
        read_trace(str(trace))
    for argv in (["--prompt-len", "1000000000"], ["--output-len", "1000000000"],
                 ["--long-prompt-rate", "1", "--long-prompt-len", "1000000000"],
                 ["--trace", str(trace)]):
        assert main(["simulate", "--num-requests", "3", *argv]) == 2
        err = capsys.readouterr().err
        assert "16,777,216 tokens" in err and err.count("\n") == 1, err


def test_gamma_gaps_keep_the_rate_and_inf_sends_all_at_once():
    times = arrival_times(4000, 50.0, 0.3, seed=1)
    assert len(times) / times[-1] == pytest.approx(50.0, rel=0.1)
    assert arrival_times(5, float("inf"), 1.0, seed=1) == [0.0] * 5
    with pytest.raises(PacerError):
        arrival_times(5, 0.0, 1.0, seed=1)


def test_trace_file_is_read_sorted_and_checked(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"arrival_s": 0.5, "prompt_len": 100, "output_len": 8}\n\n'
                     '{"arrival_s": 0.0, "prompt_len": 20000, "output_len": 2, "kind": "long"}\n')
    arrivals = read_trace(str(trace))
    assert arrivals == [Arrival(0.0, 20000, 2, "long"), Arrival(0.5, 100, 8)]
    result = simulate(arrivals, config(), H100_7B)
    assert len(result.tbt_ms) == 1 + 7
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arrival_s": 0.0, "prompt_len": 10, "output_len": 1}\n{"arrival_s": 1}\n')
    with pytest.raises(PacerError, match="line 2"):
        read_trace(str(bad))


# ---- the command -------------------------------------------------------------------------

def test_cli_compare_prints_json_and_writes_timeline_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    timeline, png = tmp_path / "t.json", tmp_path / "p.png"
    code = main(["simulate", "--compare", "--num-requests", "60", "--request-rate", "8",
                 "--prompt-len", "uniform:64:512", "--output-len", "uniform:8:32",
                 "--long-prompt-rate", "1", "--long-prompt-len", "20000",
                 "--max-iteration-ms", "20", "--json", "--timeline", str(timeline),
                 "--plot", str(png)])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["modes"]) == {"orca", "chunked"}
    assert out["model"] == "llama-2-7b" and out["config"]["max_iteration_ms"] == 20.0
    for summary in out["modes"].values():
        assert summary["requests"] == out["workload"]["requests"] > 60
        assert summary["tbt_ms"]["median"] <= summary["tbt_ms"]["p99"] <= summary["tbt_ms"]["max"]
    assert out["modes"]["orca"]["tbt_ms"]["max"] > out["modes"]["chunked"]["tbt_ms"]["max"]
    saved = json.loads(timeline.read_text())
    assert len(saved["orca"]["ms"]) == out["modes"]["orca"]["iterations"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_trace_single_mode_and_bad_input(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"arrival_s": i * 0.01, "prompt_len": 64,
                                         "output_len": 4}) + "\n" for i in range(20)))
    assert main(["simulate", "--trace", str(trace), "--no-chunked-prefill", "--json",
                 "--model", "smollm2-135m", "--hw", "a100"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out["modes"]) == ["orca"] and out["modes"]["orca"]["requests"] == 20
    assert main(["simulate", "--prompt-len", "uniform:9:1"]) == 2
    assert "uniform" in capsys.readouterr().err


# ---- rejected requests (too long for the context or the pool) --------------------------------

def _strict_json(text: str) -> dict:
    """JSON as the standard has it: no bare NaN or Infinity."""
    def refuse(constant):
        raise AssertionError(f"{constant} in the JSON")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("flags,why", [
    (["--prompt-len", "200000"], "need 12511 KV blocks, but the whole pool has 7680"),
    (["--max-model-len", "100"], "within the model's context of 100 tokens"),
    (["--num-kv-blocks", "10"], "but the whole pool has 10"),
])
def test_cli_every_request_rejected_is_an_error_naming_why(flags, why, capsys):
    for output in ([], ["--json"]):
        assert main(["simulate", "--num-requests", "3", *flags, *output]) == 2
        out, err = capsys.readouterr()
        assert out == "" and "3 of 3 requests rejected (chunked): 3 like: " in err
        assert why in err and "nan" not in err.lower()


def test_cli_rejected_requests_count_as_slo_misses_and_are_said(capsys):
    flags = ["simulate", "--num-requests", "3", "--max-model-len", "600", "--output-len", "4"]
    assert main([*flags, "--json"]) == 0
    out, err = capsys.readouterr()
    chunked = _strict_json(out)["modes"]["chunked"]
    assert (chunked["requests"], chunked["rejected"]) == (1, 2)
    assert chunked["slo_attainment"] == pytest.approx(1 / 3)           # was 100 %: 1 of 1
    assert chunked["goodput_rps"] == pytest.approx(1 / chunked["duration_s"])
    assert list(chunked["rejected_reasons"].values()) == [2]
    assert "2 of 3 requests rejected (chunked): 2 like: prompt of" in err
    assert main(flags) == 0
    out, err = capsys.readouterr()
    assert "33.3%" in out and "2 of 3 requests rejected" in err


def test_cli_json_has_no_bare_nan(capsys):
    # one output token each: no token gap at all, so the TBT figures are unknown
    assert main(["simulate", "--num-requests", "3", "--output-len", "1", "--json"]) == 0
    chunked = _strict_json(capsys.readouterr().out)["modes"]["chunked"]
    assert chunked["tbt_ms"]["median"] is None and chunked["requests"] == 3


def test_a_trace_with_an_infinite_or_nan_arrival_is_refused(tmp_path, capsys):
    for value in ("Infinity", "NaN", "-1"):
        trace = tmp_path / "trace.jsonl"
        trace.write_text('{"arrival_s": 0.5, "prompt_len": 100, "output_len": 8}\n'
                         f'{{"arrival_s": {value}, "prompt_len": 10, "output_len": 2}}\n')
        with pytest.raises(PacerError, match="line 2: arrival_s must be a finite number >= 0"):
            read_trace(str(trace))
        assert main(["simulate", "--trace", str(trace)]) == 2
        assert "finite" in capsys.readouterr().err


def test_cli_refuses_what_it_would_silently_ignore(capsys):
    # the long stream had no span to run over at rate inf: it was dropped
    assert main(["simulate", "--num-requests", "3", "--request-rate", "inf",
                 "--long-prompt-rate", "0.005"]) == 2
    assert "--request-rate inf sends them all at t=0" in capsys.readouterr().err
    # the online fit is the model of a latency budget: without one it was never asked
    assert main(["simulate", "--num-requests", "3", "--cost", "online"]) == 2
    assert "give --max-iteration-ms or --target-tbt-ms" in capsys.readouterr().err
    assert main(["simulate", "--num-requests", "3", "--cost", "online",
                 "--target-tbt-ms", "auto"]) == 0
    # a long-prompt rate of nan or below 0 ran no long stream, without a word
    for rate in ("nan", "-1"):
        assert main(["simulate", "--num-requests", "3", "--long-prompt-rate", rate]) == 2
        assert ("--long-prompt-rate must be a finite number >= 0 (0: none), got"
                in capsys.readouterr().err)


def test_cli_refuses_an_infinite_burstiness(capsys):
    # a Gamma of shape inf: random.gammavariate's ValueError came out as a traceback
    assert main(["simulate", "--num-requests", "3", "--burstiness", "inf"]) == 2
    assert capsys.readouterr().err == ("pacer simulate: error: --burstiness must be a finite "
                                       "number > 0, got inf\n")


def test_cli_refuses_a_kv_pool_too_large_to_book(capsys):
    # --num-kv-blocks 100000000000 died of a MemoryError (or took the host's memory) building
    # the block lists; a pool of that many bytes the same
    for argv in (["--num-kv-blocks", "100000000000"], ["--kv-cache-memory", "100000TiB"]):
        assert main(["simulate", "--num-requests", "3", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("pacer simulate: error: a KV pool of ") and err.count("\n") == 1
        assert "blocks: the simulator holds at most 2**24 (16,777,216)" in err
