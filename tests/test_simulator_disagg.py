"""`pacer simulate --disagg P:D`: the same scheduling core as prefill instances and decode
instances with the K/V hop priced between them, against colocated chunked prefill on as many
instances (docs/design.md#pd-disaggregation-pricing-the-hop)."""
from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from scheduler_svc.arrivals import Arrival, synthetic
from scheduler_svc.sim_report import summarize
from scheduler_svc.simulator import Hop, simulate, simulate_disaggregated
from services.cli import main
from shared.fabric import load_fabric
from tests.test_simulator import H100_7B, RowsCost, config

IB_HDR = Hop.of(H100_7B, load_fabric("ib-hdr"))


def test_the_hop_by_hand():
    # 1 ms per row; 1 MB of K/V per token over 1 GB/s (1 MB per ms) in 2 layers.
    hop = Hop(load_fabric("1"), kv_bytes_per_token=1e6, num_layers=2)
    arrivals = [Arrival(0.0, 10, 3)]
    small = config(max_num_batched_tokens=4, block_size=4)
    result = simulate_disaggregated(arrivals, small, small, RowsCost(), hop)
    # Prefill chunks of 4, 4 and 2 rows; each forward's K/V leave layer by layer (ready
    # halfway and at the end) and the forward answers once they are sent:
    # 0-4 ms computing, 2-4 and 4-6 sending; 6-10, 8-10 and 10-12; 12-14, 13-14 and 14-15.
    assert list(result.timeline.ms[:3]) == pytest.approx([6, 6, 3])
    assert result.prefill_done_s == pytest.approx([0.015])
    assert result.transfer_ms == pytest.approx([10.0])
    assert result.exposed_ms == pytest.approx([5.0])
    # The decode instance checks the K/V it received at 15 ms (a plan of no rows; the digests
    # cost nothing here) and takes it on: the next tokens at 16 and 17. TTFT counts to the
    # first token out of the decode pool, and the gap after the prefill side's is no TBT.
    assert result.first_token_s == pytest.approx([0.016])
    assert list(result.tbt_ms) == pytest.approx([1.0])
    assert result.finish_s == pytest.approx([0.017])
    assert list(result.timeline.instance) == [0, 0, 0, 1, 1, 1]
    assert list(result.timeline.decode_rows[3:]) == [0, 1, 1]
    # With the digests priced at 0.1 ms a token: each prefill iteration digests what it sent
    # after its sends, and the check digests the 10 prompt tokens: first token 2 ms later.
    priced = simulate_disaggregated(arrivals, small, small, RowsCost(),
                                    replace(hop, digest_ms_per_token=0.1))
    assert list(priced.timeline.ms[:4]) == pytest.approx([6.4, 6.4, 3.2, 1.0])
    assert priced.first_token_s == pytest.approx([0.018])
    # Sent whole after the prefill: 10 ms of waiting after the last chunk.
    whole = simulate_disaggregated(arrivals, small, small, RowsCost(),
                                   Hop(hop.fabric, 1e6, 2, layer_streaming=False))
    assert list(whole.timeline.ms[:3]) == pytest.approx([4, 4, 12])
    assert whole.exposed_ms == pytest.approx([10.0])
    assert whole.first_token_s == pytest.approx([0.021])
    # Two TP ranks, each sending its half over a link of its own: 5 ms after the last chunk.
    ranks = simulate_disaggregated(arrivals, small, small, RowsCost(),
                                   Hop(hop.fabric, 1e6, 2, layer_streaming=False, links=2))
    assert ranks.transfer_ms == pytest.approx([5.0]) and ranks.exposed_ms == pytest.approx([5.0])


def test_a_send_is_exposed_only_to_the_request_whose_k_v_it_is():
    # 1 ms per row, 1 MB per token at 1 MB/ms, sent whole after the prefill. A 2-token prompt
    # and a 10-token one share the first 4-row forward (2 rows each): the short one's 2 ms send
    # holds that forward back, but the long one's transfer is only its own 10 ms at the end.
    hop = Hop(load_fabric("1"), kv_bytes_per_token=1e6, num_layers=2, layer_streaming=False)
    small = config(max_num_batched_tokens=4, block_size=4)
    result = simulate_disaggregated([Arrival(0.0, 2, 3), Arrival(0.0, 10, 3)], small, small,
                                    RowsCost(), hop)
    t = result.timeline
    assert [ms for ms, i in zip(t.ms, t.instance) if i == 0] == pytest.approx([6, 4, 14])
    assert result.transfer_ms == pytest.approx([2.0, 10.0])
    assert result.exposed_ms == pytest.approx([2.0, 10.0])        # the long one was 12
    assert summarize(result)["transfer_hidden"] == pytest.approx(0.0)


def test_cli_transfer_hidden_is_never_negative(capsys):
    # the review's run: whole prompts sent after the prefill hide nothing (was -2.5 %)
    assert main(["simulate", "--disagg", "1:1", "--num-requests", "40", "--request-rate", "0.5",
                 "--prompt-len", "uniform:2000:6000", "--output-len", "64",
                 "--no-layer-streaming", "--json"]) == 0
    disagg = json.loads(capsys.readouterr().out)["modes"]["disagg"]
    assert disagg["transfer_hidden"] == pytest.approx(0.0, abs=1e-12)
    assert disagg["exposed_transfer_ms"]["max"] == pytest.approx(disagg["transfer_ms"]["max"])


def test_every_request_gets_its_tokens_on_both_sides():
    arrivals = synthetic(150, 6.0, 1.0, "uniform:16:3000", "uniform:1:64", seed=2)
    colocated = simulate(arrivals, config(), H100_7B, instances=3)
    disagg = simulate_disaggregated(arrivals, config(), config(), H100_7B, IB_HDR, 1, 2)
    assert len(colocated.tbt_ms) == sum(a.output_len - 1 for a in arrivals)
    # P/D: the prefill side's token and the gap after it are not counted as the stream's.
    by_id = disagg.arrivals
    assert sorted(by_id, key=lambda a: (a.arrival_s, a.prompt_len)) == \
        sorted(arrivals, key=lambda a: (a.arrival_s, a.prompt_len))
    assert len(disagg.tbt_ms) == sum(max(0, a.output_len - 2) for a in by_id)
    for result in (colocated, disagg):
        assert all(f >= a.arrival_s for f, a in zip(result.first_token_s, result.arrivals))
    assert set(colocated.timeline.instance) == {0, 1, 2} == set(disagg.timeline.instance)
    # A one-token request ends on the prefill side; the others went over the fabric, and
    # their first counted token came from a decode instance after the hand-over.
    for a, done, first in zip(by_id, disagg.prefill_done_s, disagg.first_token_s):
        assert math.isnan(done) == (a.output_len == 1)
        if a.output_len > 1:
            assert first > done
    # Decode instances carry decodes only: every row they run is one request's one row.
    for instance, prefill_rows in zip(disagg.timeline.instance, disagg.timeline.prefill_rows):
        assert instance == 0 or prefill_rows == 0


def test_decode_memory_holds_back_the_prefill_side_in_order():
    # The decode pool holds ~2 prompts of 2k: the others wait for its reservations, first
    # come first served, and all finish.
    arrivals = [Arrival(0.001 * i, 2000, 50) for i in range(8)]
    decode = config(num_kv_blocks=2 * 2100 // 16)
    result = simulate_disaggregated(arrivals, config(), decode, H100_7B, IB_HDR)
    assert len(result.arrivals) == 8 and not result.rejected
    assert result.prefill_done_s == sorted(result.prefill_done_s)
    assert result.first_token_s[-1] > 3 * result.finish_s[0]
    # A conditional P/D run prefills short prompts on the decode side instead.
    short = [Arrival(0.0, 100, 8), Arrival(0.0, 3000, 8)]
    conditional = simulate_disaggregated(short, config(), config(), H100_7B, IB_HDR,
                                         min_prompt_tokens=256)
    assert math.isnan(conditional.prefill_done_s[0]) and not math.isnan(conditional.prefill_done_s[1])


def test_disaggregation_keeps_the_token_gaps_flat_under_long_prompts():
    arrivals = synthetic(200, 2.0, 1.0, "uniform:2000:6000", "uniform:64:256", seed=1)
    colocated = summarize(simulate(arrivals, config(), H100_7B, "colocated", instances=2))
    disagg = summarize(simulate_disaggregated(arrivals, config(), config(), H100_7B, IB_HDR))
    assert disagg["tbt_max_over_median"] < 2.5 < colocated["tbt_max_over_median"]
    assert disagg["tbt_ms"]["max"] < colocated["tbt_ms"]["max"] / 2
    # ...while the first token waits for the transfer, of which layer streaming hides ~all.
    assert disagg["transfer_hidden"] > 0.95
    assert disagg["ttft_ms"]["median"] > colocated["ttft_ms"]["median"]


def test_a_slow_fabric_shows_in_the_first_token():
    arrivals = synthetic(20, 0.05, 1.0, "4096", "32", seed=3)     # one at a time on the link
    runs = {name: summarize(simulate_disaggregated(
        arrivals, config(), config(), H100_7B, Hop.of(H100_7B, load_fabric(name))))
        for name in ("nvlink", "ib-hdr", "2")}
    # 2 GiB per request: 43 ms over IB HDR hides behind the ~115 ms prefill, in two chunks of
    # 2048 rows, but for each chunk's last layer. At 2 GB/s the 1.07 s transfer leaves
    # ~0.96 s exposed.
    assert runs["nvlink"]["exposed_transfer_ms"]["median"] < 0.1
    assert runs["ib-hdr"]["exposed_transfer_ms"]["median"] == pytest.approx(42.9 / 32, rel=0.05)
    assert runs["2"]["exposed_transfer_ms"]["median"] == pytest.approx(1074 - 115 * 31 / 32,
                                                                       rel=0.05)
    assert runs["2"]["ttft_ms"]["median"] > runs["ib-hdr"]["ttft_ms"]["median"] + 900


def test_goodput_counts_requests_meeting_both_slos():
    arrivals = synthetic(100, 2.0, 1.0, "uniform:2000:6000", "uniform:64:256", seed=1)
    result = simulate(arrivals, config(), H100_7B, instances=2)
    loose, tight = summarize(result, 10_000, 1_000), summarize(result, 10_000, 10)
    assert loose["slo_attainment"] == 1.0
    assert loose["goodput_rps"] == pytest.approx(loose["requests_per_s"])
    assert 0 < tight["goodput_rps"] < loose["goodput_rps"]
    assert summarize(result, 1, 1_000)["goodput_rps"] == 0


SMALL = ["simulate", "--num-requests", "40", "--request-rate", "2",
         "--prompt-len", "uniform:1000:4000", "--output-len", "uniform:16:64"]


def test_cli_disagg_reports_every_metric_and_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "pd.png"
    assert main(SMALL + ["--disagg", "1:1", "--fabric", "ib-hdr", "--json",
                         "--plot", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["disagg"]["fabric"] == "ib-hdr" and out["slo"] == {"ttft_ms": 1000.0,
                                                                   "tbt_ms": 50.0}
    colocated, disagg = out["modes"]["colocated"], out["modes"]["disagg"]
    for summary in (colocated, disagg):
        assert summary["requests"] == 40
        for key in ("ttft_ms", "tbt_ms"):
            assert {"median", "p99", "max"} <= set(summary[key])
        assert 0 <= summary["slo_attainment"] <= 1 and summary["goodput_rps"] >= 0
    for key in ("transfer_ms", "exposed_transfer_ms", "ttft_prefill_side_ms", "transfer_hidden"):
        assert key in disagg and key not in colocated
    assert "2 instance(s)" in colocated["instances"] and "ib-hdr" in disagg["instances"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(SMALL + ["--disagg", "1:1"]) == 0
    table = capsys.readouterr().out
    assert "goodput req/s" in table and "exposed transfer median ms" in table


def test_cli_sweep(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "sweep.png"
    assert main(SMALL + ["--disagg", "1:1", "--sweep", "fabric=nvlink,2", "--plot",
                         str(png)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[0] == "fabric" and [r.split()[0] for r in lines[2:]] == ["nvlink", "2"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(SMALL + ["--disagg", "1:1", "--sweep", "request-rate=1,3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [p["value"] for p in out["points"]] == ["1", "3"]
    assert set(out["points"][0]["modes"]) == {"colocated", "disagg"}


@pytest.mark.parametrize("argv,flag", [(["--disagg", "0:1"], "--disagg"),
                                       (["--disagg", "2"], "--disagg"),
                                       (["--disagg", "1:1", "--compare"], "--compare"),
                                       (["--disagg", "1:1", "--fabric", "wifi"], "--fabric"),
                                       # a ZeroDivisionError traceback
                                       (["--disagg", "1:1", "--fabric", "1e-300"], "--fabric"),
                                       (["--disagg", "1:1", "--sweep", "fabric=ib-hdr,0"],
                                        "--sweep fabric '0'"),
                                       # memory filled until the kernel killed the run
                                       (["--disagg", "1:99999999999999"], "at most 1,024"),
                                       # a ValueError traceback from the core
                                       (["--max-num-batched-tokens", str(10**20)],
                                        "--max-num-batched-tokens: counts must be at most"),
                                       (["--sweep", "fabric=nvlink"], "--disagg"),
                                       (["--disagg", "1:1", "--sweep", "load=1"], "--sweep"),
                                       (["--disagg", "1:1", "--sweep", "request-rate=0"], "rate"),
                                       (["--tbt-slo-ms", "0"], "--tbt-slo-ms")])
def test_cli_bad_disagg_input_is_one_error_line(capsys, argv, flag):
    assert main(SMALL + argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pacer simulate: error:") and flag in lines[0]
