"""GPU telemetry: an NVML sampler thread whose samples are tagged with the current phase.

A daemon thread polls NVML (nvidia-ml-py) every `interval_s` for each GPU: utilisation, memory
used, power, SM and memory clocks and the cumulative energy counter. The trainer and engine
mark phases with `sampler.phase("decode")` or `set_phase()`; that is a plain attribute write,
so nothing NVML-related runs on their hot path. Each interval between two consecutive samples
of a GPU is attributed to the phase tagged on the later sample (the phase that was running
when the interval ended): with phases much longer than the interval the error is one interval
per phase switch. Energy comes from the counter difference; where the counter is not
supported it falls back to integrating power over the interval (trapezoid).

NVML's "gpu" utilisation is the fraction of time any kernel was running, not SM occupancy
(that needs DCGM profiling metrics); it is reported as `gpu_util_pct` for that reason.
Without nvidia-ml-py, a driver or a GPU the sampler is inert: `available` is False, `reason`
says why, start/stop do nothing and the summary says telemetry is unavailable.
"""

from __future__ import annotations

import collections
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

PHASES = ("idle", "prefill", "decode", "logprob", "forward-backward", "optimizer")
_PHASE_SET = frozenset(PHASES)


@dataclass(slots=True, kw_only=True)
class NvmlSample:
    """One NVML reading of one GPU. A field is None when NVML does not support it on this GPU."""

    t: float                       # seconds, from the sampler's clock
    gpu: int                       # device index
    phase: str                     # phase tagged when the sample was taken
    gpu_util_pct: float | None     # % of the last NVML period with a kernel running
    mem_util_pct: float | None     # % of the last NVML period the memory controller was busy
    mem_used_bytes: int | None     # device memory in use
    power_w: float | None          # board power draw
    sm_clock_mhz: int | None       # current SM clock
    mem_clock_mhz: int | None      # current memory clock
    energy_j: float | None         # cumulative energy counter since driver load


@dataclass(slots=True, kw_only=True)
class PhaseStats:
    """Aggregates of one phase over all GPUs (energy summed, utilisations averaged, time-weighted)."""

    seconds: float                       # sampled time in this phase (per GPU, averaged over GPUs)
    intervals: int                       # sample intervals attributed to the phase (all GPUs)
    gpu_util_pct: float | None           # time-weighted mean
    mem_util_pct: float | None           # time-weighted mean
    power_w: float | None                # time-weighted mean, summed over GPUs
    sm_clock_mhz: float | None           # time-weighted mean
    energy_j: float                      # summed over GPUs
    energy_per_response_j: float | None  # energy_j / responses, when responses were given
    energy_per_token_j: float | None     # energy_j / tokens, when tokens were given


@dataclass(slots=True, kw_only=True)
class TelemetrySummary:
    """Per-phase aggregates, or the reason there are none."""

    available: bool
    reason: str                                                 # "" when available
    num_gpus: int = 0
    energy_source: str = ""                                     # "counter", "power-integral" or "mixed"
    phases: dict[str, PhaseStats] = field(default_factory=dict)
    total: PhaseStats | None = None

    def format(self) -> str:
        """A short plain-text table (one line per phase)."""
        if not self.available:
            return self.reason
        fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        lines = [f"GPU telemetry: {self.num_gpus} GPU(s), energy from {self.energy_source}",
                 f"{'phase':>16} {'s':>9} {'gpu%':>6} {'mem%':>6} {'W':>8} {'J':>11} {'J/resp':>9} {'J/tok':>9}"]
        rows = list(self.phases.items()) + ([("total", self.total)] if self.total else [])
        for name, p in rows:
            lines.append(f"{name:>16} {p.seconds:9.2f} {fmt(p.gpu_util_pct, '6.1f')} {fmt(p.mem_util_pct, '6.1f')} "
                         f"{fmt(p.power_w, '8.1f')} {p.energy_j:11.1f} {fmt(p.energy_per_response_j, '9.3f')} "
                         f"{fmt(p.energy_per_token_j, '9.4f')}")
        return "\n".join(lines)


class _Acc:
    """Running sums for one (gpu, phase): interval-weighted, so no sample list is needed."""

    __slots__ = ("seconds", "intervals", "energy_j", "wsum", "wtime")

    def __init__(self) -> None:
        self.seconds = 0.0
        self.intervals = 0
        self.energy_j = 0.0
        self.wsum = {"gpu_util_pct": 0.0, "mem_util_pct": 0.0, "power_w": 0.0, "sm_clock_mhz": 0.0}
        self.wtime = dict.fromkeys(self.wsum, 0.0)  # time over which each field was defined


class NvmlSampler:
    """Background NVML sampler, tagged by phase. Use as a context manager or start()/stop()."""

    def __init__(self, devices: list[int] | None = None, *, interval_s: float = 0.1, nvml=None,
                 clock: Callable[[], float] = time.perf_counter, keep_samples: int = 10_000) -> None:
        if not interval_s > 0:
            raise ValueError(f"NvmlSampler.interval_s must be > 0, got {interval_s!r}")
        self.interval_s = interval_s
        self._clock = clock
        self._phase = "idle"
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.samples: collections.deque[NvmlSample] = collections.deque(maxlen=keep_samples)
        self.errors = 0                         # NVML errors other than "not supported"
        self.last_error = ""                    # repr of the latest such error
        self._unsupported: set[tuple[int, str]] = set()
        self._last: dict[int, NvmlSample] = {}
        self._acc: dict[tuple[int, str], _Acc] = {}
        self._energy_from_counter: dict[int, bool] = {}
        self.available, self.reason = False, ""
        self._nvml, self._handles, self.devices = None, [], []
        self._init_nvml(nvml, devices)

    # ---- setup ----------------------------------------------------------------------------
    def _init_nvml(self, nvml, devices: list[int] | None) -> None:
        if nvml is None:
            try:
                import pynvml as nvml
            except ImportError as exc:
                self.reason = f"GPU telemetry unavailable: nvidia-ml-py (pynvml) is not installed ({exc})"
                return
        try:
            nvml.nvmlInit()
        except Exception as exc:  # NVMLError_LibraryNotFound / DriverNotLoaded on a machine without a GPU
            self.reason = f"GPU telemetry unavailable: NVML could not initialise, no NVIDIA driver or GPU ({exc})"
            return
        count = nvml.nvmlDeviceGetCount()
        devices = list(range(count)) if devices is None else list(devices)
        bad = [d for d in devices if not 0 <= d < count]
        if count == 0 or not devices or bad:
            nvml.nvmlShutdown()
            self.reason = (f"GPU telemetry unavailable: NVML sees {count} GPU(s)"
                           + (f"; requested device(s) {bad} do not exist" if bad else ""))
            return
        self._nvml, self.devices = nvml, devices
        self._handles = [nvml.nvmlDeviceGetHandleByIndex(d) for d in devices]
        self.available = True

    # ---- phase tagging (hot path: attribute writes only) -----------------------------------
    def set_phase(self, name: str) -> None:
        """Tag later samples with `name` (one of PHASES)."""
        if name not in _PHASE_SET:
            raise ValueError(f"NvmlSampler phase must be one of {PHASES}, got {name!r}")
        self._phase = name

    @property
    def current_phase(self) -> str:
        return self._phase

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Tag samples with `name` inside the block; the previous phase is restored after."""
        previous = self._phase
        self.set_phase(name)
        try:
            yield
        finally:
            self._phase = previous

    # ---- sampling -------------------------------------------------------------------------
    def _read(self, i: int, name: str, fn: Callable[[], object]):
        if (i, name) in self._unsupported:
            return None
        try:
            return fn()
        except Exception as exc:
            if getattr(exc, "value", None) == getattr(self._nvml, "NVML_ERROR_NOT_SUPPORTED", 3):
                self._unsupported.add((i, name))  # permanent for this GPU: do not ask again
            else:
                self.errors += 1
                self.last_error = repr(exc)
            return None

    def _read_gpu(self, i: int, handle, phase: str, t: float) -> NvmlSample:
        nv = self._nvml
        util = self._read(i, "util", lambda: nv.nvmlDeviceGetUtilizationRates(handle))
        mem = self._read(i, "mem", lambda: nv.nvmlDeviceGetMemoryInfo(handle))
        power = self._read(i, "power", lambda: nv.nvmlDeviceGetPowerUsage(handle))          # mW
        sm = self._read(i, "sm_clock", lambda: nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_SM))
        mclk = self._read(i, "mem_clock", lambda: nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_MEM))
        energy = self._read(i, "energy", lambda: nv.nvmlDeviceGetTotalEnergyConsumption(handle))  # mJ
        return NvmlSample(
            t=t, gpu=self.devices[i], phase=phase,
            gpu_util_pct=None if util is None else float(util.gpu),
            mem_util_pct=None if util is None else float(util.memory),
            mem_used_bytes=None if mem is None else int(mem.used),
            power_w=None if power is None else power / 1e3,
            sm_clock_mhz=sm, mem_clock_mhz=mclk,
            energy_j=None if energy is None else energy / 1e3,
        )

    def sample_once(self) -> list[NvmlSample]:
        """Read every GPU now and fold the readings into the per-phase sums (the thread calls this)."""
        if not self.available:
            return []
        phase = self._phase
        out = []
        for i, handle in enumerate(self._handles):
            s = self._read_gpu(i, handle, phase, self._clock())
            with self._lock:
                self._fold(s)
                self.samples.append(s)
            out.append(s)
        return out

    def _fold(self, s: NvmlSample) -> None:
        prev = self._last.get(s.gpu)
        self._last[s.gpu] = s
        if prev is None:
            return  # first reading of this GPU: a baseline, no interval yet
        dt = s.t - prev.t
        if dt <= 0:
            return
        acc = self._acc.setdefault((s.gpu, s.phase), _Acc())
        acc.seconds += dt
        acc.intervals += 1
        if s.energy_j is not None and prev.energy_j is not None and s.energy_j >= prev.energy_j:
            acc.energy_j += s.energy_j - prev.energy_j  # a counter that went back (driver reload) is skipped
            self._energy_from_counter[s.gpu] = True
        elif s.power_w is not None and prev.power_w is not None:
            acc.energy_j += 0.5 * (s.power_w + prev.power_w) * dt
            self._energy_from_counter.setdefault(s.gpu, False)
        for name in acc.wsum:
            value = getattr(s, name)
            if value is not None:
                acc.wsum[name] += value * dt
                acc.wtime[name] += dt

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample_once()

    def start(self) -> "NvmlSampler":
        """Take a baseline sample and start the thread (no-op when unavailable or already running)."""
        if not self.available or self._thread is not None:
            return self
        self._stop.clear()
        self.sample_once()
        self._thread = threading.Thread(target=self._run, name="rlengine-nvml", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread and take a final sample so the last interval is counted."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self.sample_once()

    def reset(self) -> None:
        """Clear the per-phase sums (e.g. at a boundary); the last readings stay as the new baseline."""
        with self._lock:
            self._acc.clear()

    def close(self) -> None:
        """Stop and release NVML."""
        self.stop()
        if self._nvml is not None:
            self._nvml.nvmlShutdown()
            self._nvml, self.available = None, False
            self.reason = "GPU telemetry unavailable: the sampler was closed"

    def __enter__(self) -> "NvmlSampler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- summary --------------------------------------------------------------------------
    def summary(self, *, responses: int | None = None, tokens: int | None = None) -> TelemetrySummary:
        """Per-phase time, mean utilisations and energy; per response / per token when counts are given.

        The counts are totals for the summarised span (e.g. one boundary), applied to every phase:
        the decode row's J/token is decode energy divided by all generated tokens.
        """
        if not self.available:
            return TelemetrySummary(available=False, reason=self.reason)
        with self._lock:
            accs = {k: (v.seconds, v.intervals, v.energy_j, dict(v.wsum), dict(v.wtime)) for k, v in self._acc.items()}
            counter = dict(self._energy_from_counter)
        phases = {}
        for name in PHASES:
            parts = [v for (_, p), v in accs.items() if p == name]
            if parts:
                phases[name] = _combine(parts, len(self.devices), responses, tokens)
        total = _combine(list(accs.values()), len(self.devices), responses, tokens) if accs else None
        kinds = {"counter" if c else "power-integral" for c in counter.values()}
        source = kinds.pop() if len(kinds) == 1 else ("mixed" if kinds else "")
        return TelemetrySummary(available=True, reason="", num_gpus=len(self.devices), energy_source=source,
                                phases=phases, total=total)


def _combine(parts: list[tuple], num_gpus: int, responses: int | None, tokens: int | None) -> PhaseStats:
    seconds = sum(p[0] for p in parts)
    energy = sum(p[2] for p in parts)

    def mean(name: str) -> float | None:
        wt = sum(p[4][name] for p in parts)
        return sum(p[3][name] for p in parts) / wt if wt > 0 else None

    power = mean("power_w")
    return PhaseStats(
        seconds=seconds / num_gpus, intervals=sum(p[1] for p in parts),
        gpu_util_pct=mean("gpu_util_pct"), mem_util_pct=mean("mem_util_pct"),
        power_w=None if power is None else power * num_gpus, sm_clock_mhz=mean("sm_clock_mhz"),
        energy_j=energy,
        energy_per_response_j=energy / responses if responses else None,
        energy_per_token_j=energy / tokens if tokens else None,
    )
