"""Workloads for the simulator: when requests arrive and how long their prompts and outputs are.

Arrival gaps as vLLM's benchmark draws them: Gamma(shape=b, scale=1/(rate·b)), b=1 being
Poisson and smaller b burstier; rate inf sends everything at t=0. Lengths are drawn from a
spec string:

    512                      fixed
    uniform:128:1024         uniform over [128, 1024]
    lognormal:300:0.8[:MAX]  lognormal with median 300 and sigma 0.8, clipped to [1, MAX]

No length (drawn, given as MAX, or in a trace) may pass MAX_LENGTH tokens.

A trace is JSONL with one `{"arrival_s", "prompt_len", "output_len"}` object per line.
Each random quantity has its own seeded stream, so changing the output lengths leaves the
arrival times and prompt lengths as they were.
"""
from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from shared.errors import PacerError


@dataclass(frozen=True)
class Arrival:
    arrival_s: float
    prompt_len: int
    output_len: int
    kind: str = "main"        # which stream it came from, reported apart ("main", "long")


LengthSampler = Callable[[random.Random], int]

# The longest prompt or output a workload may hold: beyond any model's context (the longest
# are ~10M tokens). The simulator queues each request's prompt as a list of token ids, 16
# bytes a token: a length of 10**9 ran out of memory before the pool turned it away.
MAX_LENGTH = 2**24


def parse_length(spec: str) -> LengthSampler:
    """A sampler for a length spec (see the module docstring); PacerError if malformed."""
    parts = str(spec).strip().lower().split(":")
    try:
        if len(parts) == 1:
            return _fixed(int(parts[0]))
        if parts[0] == "uniform" and len(parts) == 3:
            return _uniform(int(parts[1]), int(parts[2]))
        if parts[0] == "lognormal" and len(parts) in (3, 4):
            cap = int(parts[3]) if len(parts) == 4 else MAX_LENGTH
            return _lognormal(float(parts[1]), float(parts[2]), cap)
    except ValueError:
        pass
    raise PacerError(f"length {spec!r}: use N, uniform:LO:HI or lognormal:MEDIAN:SIGMA[:MAX]")


def _fixed(n: int) -> LengthSampler:
    _check_length(n, "a fixed length")
    return lambda rng: n


def _uniform(lo: int, hi: int) -> LengthSampler:
    _check_length(lo, "uniform's low end")
    if hi < lo:
        raise PacerError(f"uniform:{lo}:{hi}: the high end is below the low end")
    _check_length(hi, "uniform's high end")
    return lambda rng: rng.randint(lo, hi)


def _lognormal(median: float, sigma: float, cap: int) -> LengthSampler:
    if not (1 <= median < math.inf and 0 <= sigma < math.inf and cap >= 1):
        raise PacerError(f"lognormal:{median}:{sigma}: needs a finite median >= 1, a finite "
                         "sigma >= 0 and max >= 1")
    _check_length(cap, "lognormal's max")
    mu, log_cap = math.log(median), math.log(cap)
    # lognormvariate's draw, clipped in the log domain: a wide sigma's tail would overflow
    # exp() (or round an infinity) before the cap applied
    return lambda rng: min(cap, max(1, round(math.exp(min(rng.normalvariate(mu, sigma),
                                                          log_cap)))))


def _check_length(n: int, what: str) -> None:
    if n < 1:
        raise PacerError(f"{what} must be >= 1, got {n}")
    if n > MAX_LENGTH:
        raise PacerError(f"{what} must be at most {MAX_LENGTH:,} tokens, got {n:,}")


def arrival_times(n: int, rate: float, burstiness: float, seed: int | str) -> list[float]:
    """n arrival times from t=0 with Gamma-distributed gaps (all 0 when rate is inf)."""
    if not rate > 0:
        raise PacerError(f"--request-rate must be > 0 (or inf), got {rate}")
    if not 0 < burstiness < math.inf:     # inf: a Gamma of no spread, which random refuses
        raise PacerError(f"--burstiness must be a finite number > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(f"{seed}/gaps")
    scale = 1.0 / (rate * burstiness)
    times, t = [], 0.0
    for _ in range(n):
        t += rng.gammavariate(burstiness, scale)
        times.append(t)
    return times


def synthetic(n: int, rate: float, burstiness: float, prompt_len: str, output_len: str,
              seed: int, kind: str = "main") -> list[Arrival]:
    """n requests of one stream; `seed` and `kind` together name its random streams."""
    prompt, output = parse_length(prompt_len), parse_length(output_len)
    rng_prompt = random.Random(f"{seed}/{kind}/prompt")
    rng_output = random.Random(f"{seed}/{kind}/output")
    return [Arrival(t, prompt(rng_prompt), output(rng_output), kind)
            for t in arrival_times(n, rate, burstiness, f"{seed}/{kind}")]


def occasional(rate: float, until_s: float, prompt_len: str, output_len: str, seed: int,
               kind: str = "long") -> list[Arrival]:
    """A Poisson stream at `rate` over [0, until_s): e.g. the rare 100k-token prompt."""
    if not rate > 0 or math.isinf(rate):
        raise PacerError(f"the rate of an occasional stream must be finite and > 0, got {rate}")
    rng = random.Random(f"{seed}/{kind}/gaps")
    times, t = [], rng.expovariate(rate)
    while t < until_s:
        times.append(t)
        t += rng.expovariate(rate)
    prompt, output = parse_length(prompt_len), parse_length(output_len)
    rng_prompt = random.Random(f"{seed}/{kind}/prompt")
    rng_output = random.Random(f"{seed}/{kind}/output")
    return [Arrival(t, prompt(rng_prompt), output(rng_output), kind) for t in times]


def read_trace(path: str) -> list[Arrival]:
    """A JSONL trace; PacerError naming the line of anything malformed."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise PacerError(f"cannot read trace {path}: {e}") from None
    arrivals = []
    for n, line in lines:
        try:
            item = json.loads(line)
            arrival = Arrival(float(item["arrival_s"]), int(item["prompt_len"]),
                              int(item["output_len"]), str(item.get("kind", "main")))
        except (ValueError, TypeError, KeyError) as e:
            raise PacerError(f"{path} line {n}: need {{\"arrival_s\", \"prompt_len\", "
                             f"\"output_len\"}} ({e})") from None
        if not (0 <= arrival.arrival_s < math.inf
                and 1 <= min(arrival.prompt_len, arrival.output_len)
                and max(arrival.prompt_len, arrival.output_len) <= MAX_LENGTH):
            raise PacerError(f"{path} line {n}: arrival_s must be a finite number >= 0 and "
                             f"lengths from 1 to {MAX_LENGTH:,} tokens, got {arrival.arrival_s!r}, "
                             f"{arrival.prompt_len}, {arrival.output_len}")
        arrivals.append(arrival)
    if not arrivals:
        raise PacerError(f"trace {path} has no requests")
    return sorted(arrivals, key=lambda a: a.arrival_s)
