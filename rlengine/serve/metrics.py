"""Server metrics in Prometheus' text format (version 0.0.4), served at /metrics.

The engine loop (engine_loop.py) is the only writer: after every engine step it sets the gauges
(requests running / waiting, KV blocks used) and adds the step's tokens; when a request's first
token appears and when it finishes it observes TTFT and TPOT. The HTTP thread only reads, through
`render`, under the same lock. Names follow vLLM's (vllm:time_to_first_token_seconds becomes
rlengine_time_to_first_token_seconds: underscores, as Prometheus recommends outside recording rules).
Tokens per second is a gauge over the last `window_s` seconds of steps (a sliding window, so an idle
server reads 0), next to the counters a Prometheus rate() would use. process_resident_memory_bytes is
read from /proc/self/statm (Linux; left out elsewhere).
Simplification: no client library (prometheus_client); a histogram is a fixed bucket list.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from collections import deque

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)  # vLLM's
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)  # vLLM's


class Histogram:
    """Cumulative-bucket histogram: observe(seconds), then lines() in the exposition format."""

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help_text, buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, labels: str) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        total = 0
        for bound, n in zip(self.buckets + (float("inf"),), self.counts):
            total += n
            le = "+Inf" if bound == float("inf") else repr(bound)
            out.append(f'{self.name}_bucket{{{labels},le="{le}"}} {total}')
        out += [f"{self.name}_sum{{{labels}}} {self.sum!r}", f"{self.name}_count{{{labels}}} {self.count}"]
        return out


def resident_bytes() -> int | None:
    """This process's resident set size in bytes (Linux /proc), None where unavailable."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class ServerMetrics:
    """What /metrics shows; written by the engine loop, read by the HTTP thread."""

    def __init__(self, model_name: str, *, kv_blocks_total: int, window_s: float = 10.0):
        self.labels = f'model_name="{model_name}"'
        self.lock = threading.Lock()
        self.window_s = window_s
        self.requests_running = 0           # engine requests with a sample holding KV blocks
        self.requests_waiting = 0           # engine requests queued (not yet admitted, or preempted)
        self.kv_blocks_used = 0
        self.kv_blocks_total = kv_blocks_total
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: dict[str, int] = {}  # finish reason -> requests ("abort" included)
        self.steps: deque[tuple[float, int]] = deque()  # (perf_counter, tokens) of recent steps
        self.ttft = Histogram("rlengine_time_to_first_token_seconds", "Time to first token, from arrival.",
                              TTFT_BUCKETS)
        self.tpot = Histogram("rlengine_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.", TPOT_BUCKETS)

    def record_step(self, tokens: int, *, running: int, waiting: int, kv_used: int) -> None:
        now = time.perf_counter()
        with self.lock:
            self.generation_tokens += tokens
            self.requests_running, self.requests_waiting, self.kv_blocks_used = running, waiting, kv_used
            self.steps.append((now, tokens))
            while self.steps and self.steps[0][0] < now - self.window_s:
                self.steps.popleft()

    def record_finish(self, reason: str, *, prompt_tokens: int, ttft: float | None, tpot: float | None) -> None:
        with self.lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
            self.prompt_tokens += prompt_tokens
            if ttft is not None:
                self.ttft.observe(ttft)
            if tpot is not None:
                self.tpot.observe(tpot)

    def tokens_per_second(self) -> float:
        now = time.perf_counter()
        with self.lock:
            recent = sum(n for t, n in self.steps if t >= now - self.window_s)
        return recent / self.window_s

    def render(self) -> str:
        tps = self.tokens_per_second()
        lab = self.labels
        with self.lock:
            gauges = [
                ("rlengine_num_requests_running", "Requests with samples in the running batch.", self.requests_running),
                ("rlengine_num_requests_waiting", "Requests waiting to be admitted.", self.requests_waiting),
                ("rlengine_kv_blocks_used", "KV cache blocks held by requests.", self.kv_blocks_used),
                ("rlengine_kv_blocks_total", "KV cache blocks in the pool.", self.kv_blocks_total),
                ("rlengine_kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).",
                 self.kv_blocks_used / max(1, self.kv_blocks_total)),
                ("rlengine_generation_tokens_per_second", f"Tokens generated per second over the last "
                 f"{self.window_s:g} s.", tps)]
            lines = []
            for name, help_text, value in gauges:
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name}{{{lab}}} {value}"]
            for name, help_text, value in (("rlengine_prompt_tokens_total", "Prompt tokens of finished requests.",
                                            self.prompt_tokens),
                                           ("rlengine_generation_tokens_total", "Generated tokens.",
                                            self.generation_tokens)):
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{name}{{{lab}}} {value}"]
            name = "rlengine_request_finished_total"
            lines += [f"# HELP {name} Finished requests by finish reason.", f"# TYPE {name} counter"]
            lines += [f'{name}{{{lab},finished_reason="{r}"}} {n}' for r, n in sorted(self.finished.items())]
            lines += self.ttft.lines(lab) + self.tpot.lines(lab)
        rss = resident_bytes()
        if rss is not None:
            name = "process_resident_memory_bytes"
            lines += [f"# HELP {name} Resident memory size in bytes.", f"# TYPE {name} gauge", f"{name} {rss}"]
        return "\n".join(lines) + "\n"
