"""GPU telemetry: an NVML sampler thread whose samples are tagged with the current phase.

A daemon thread polls NVML (nvidia-ml-py) every `interval_s` for each GPU this process uses:
utilisation, memory used, power, SM and memory clocks and the cumulative energy counter.
Which GPUs: NVML numbers every GPU on the node and ignores CUDA_VISIBLE_DEVICES, so the
process's CUDA devices (torch's indices) are mapped to NVML handles by UUID, else by PCI bus
id (under MIG that is the parent GPU, whose power is the whole board's). The trainer and
engine mark phases with `sampler.phase("decode")` or `set_phase()`: an attribute write plus,
when the phase changes, a clock read appended to a switch log. Each interval between two
samples of a GPU is split at the logged switch times and each piece is charged to the phase
that ran in it, so a phase shorter than the sampling period still gets its share (energy
split in proportion to time for the counter, by the interpolated power otherwise). stop()
forgets the last readings: the stopped gap is charged to no phase. Power is NVML's
instantaneous field where the driver offers it (Hopper and later), else the averaged
nvmlDeviceGetPowerUsage; energy comes from the counter difference, or integrates power where
the counter is not supported.

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

from rlengine.telemetry.nvml_devices import CudaIdentity, map_cuda_to_nvml, torch_cuda_identities

PHASES = ("idle", "prefill", "decode", "logprob", "forward-backward", "optimizer")
_PHASE_SET = frozenset(PHASES)


@dataclass(slots=True, kw_only=True)
class NvmlSample:
    """One NVML reading of one GPU. A field is None when NVML does not support it on this GPU."""

    t: float                       # seconds, from the sampler's clock
    gpu: int                       # NVML device index
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
    power_source: str = ""                                      # "instant", "average" (NVML's 1 s mean) or "mixed"
    phases: dict[str, PhaseStats] = field(default_factory=dict)
    total: PhaseStats | None = None

    def format(self) -> str:
        """A short plain-text table (one line per phase)."""
        if not self.available:
            return self.reason
        fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        lines = [f"GPU telemetry: {self.num_gpus} GPU(s), energy from {self.energy_source}, "
                 f"{self.power_source or 'no'} power readings",
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


class _NvmlReturn(Exception):
    """A failed NVML field read, carrying NVML's return code like pynvml's NVMLError does."""

    def __init__(self, value: int):
        super().__init__(f"NVML field read returned {value}")
        self.value = value


class NvmlSampler:
    """Background NVML sampler, tagged by phase. Use as a context manager or start()/stop().

    devices: NVML indices to sample (explicit override). Otherwise `cuda_devices` (torch CUDA
    indices, default every device torch sees) are mapped to NVML by UUID / PCI bus id;
    `cuda_identities` replaces torch's view of them (tests).
    """

    @classmethod
    def for_device(cls, device) -> "NvmlSampler":
        """The sampler of the GPU a torch device is (NVML numbers every GPU on the node: the CUDA index
        is mapped by UUID / PCI bus id); for a CPU device it says plainly that there is no telemetry."""
        return cls(cuda_devices=[device.index or 0] if device.type == "cuda" else None)

    def __init__(self, devices: list[int] | None = None, *, cuda_devices: list[int] | None = None,
                 interval_s: float = 0.1, nvml=None, clock: Callable[[], float] = time.perf_counter,
                 keep_samples: int = 10_000, cuda_identities: list[CudaIdentity] | None = None) -> None:
        if not interval_s > 0:
            raise ValueError(f"NvmlSampler.interval_s must be > 0, got {interval_s!r}")
        self.interval_s = interval_s
        self._clock = clock
        self._phase = "idle"
        self._base_phase = "idle"               # phase before the oldest logged switch
        self._switches: collections.deque[tuple[float, str]] = collections.deque()  # (t, new phase)
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
        self._power_kind: dict[int, str] = {}   # "instant" | "average" per GPU
        self.available, self.reason = False, ""
        self._nvml, self._handles, self.devices = None, [], []
        self._init_nvml(nvml, devices, cuda_devices, cuda_identities)

    # ---- setup ----------------------------------------------------------------------------
    def _init_nvml(self, nvml, devices, cuda_devices, cuda_identities) -> None:
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
        why = ""
        if count and devices is None:
            ids = torch_cuda_identities(cuda_devices) if cuda_identities is None else cuda_identities
            if not ids:
                why = (f"torch sees no CUDA device, so none of NVML's {count} GPU(s) is this process's "
                       f"(pass devices=[NVML indices] to sample them anyway)")
            else:
                devices, why = map_cuda_to_nvml(nvml, ids)
        devices = [] if devices is None else list(devices)
        bad = [d for d in devices if not 0 <= d < count]
        if count == 0 or not devices or bad or why:
            nvml.nvmlShutdown()
            self.reason = (f"GPU telemetry unavailable: NVML sees {count} GPU(s)"
                           + (f"; requested device(s) {bad} do not exist" if bad else "")
                           + (f"; {why}" if why else ""))
            return
        self._nvml, self.devices = nvml, devices
        self._handles = [nvml.nvmlDeviceGetHandleByIndex(d) for d in devices]
        self.available = True

    # ---- phase tagging (hot path: an attribute write; a clock read when the phase changes) --
    def set_phase(self, name: str) -> None:
        """Tag later samples with `name` (one of PHASES) and log the switch time."""
        if name not in _PHASE_SET:
            raise ValueError(f"NvmlSampler phase must be one of {PHASES}, got {name!r}")
        if name != self._phase and self.available:
            self._switches.append((self._clock(), name))  # deque.append: safe against the sampler thread
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
            self.set_phase(previous)

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

    def _instant_power_mw(self, handle):
        nv = self._nvml
        field_id = getattr(nv, "NVML_FI_DEV_POWER_INSTANT", None)
        if field_id is None or not hasattr(nv, "nvmlDeviceGetFieldValues"):
            raise _NvmlReturn(getattr(nv, "NVML_ERROR_NOT_SUPPORTED", 3))
        value = nv.nvmlDeviceGetFieldValues(handle, [field_id])[0]
        if value.nvmlReturn != 0:
            raise _NvmlReturn(value.nvmlReturn)
        return value.value.uiVal

    def _power_mw(self, i: int, handle):
        power = self._read(i, "power_instant", lambda: self._instant_power_mw(handle))
        if power is not None:
            self._power_kind[i] = "instant"
            return power
        self._power_kind[i] = "average"
        return self._read(i, "power", lambda: self._nvml.nvmlDeviceGetPowerUsage(handle))

    def _read_gpu(self, i: int, handle, phase: str, t: float) -> NvmlSample:
        nv = self._nvml
        util = self._read(i, "util", lambda: nv.nvmlDeviceGetUtilizationRates(handle))
        mem = self._read(i, "mem", lambda: nv.nvmlDeviceGetMemoryInfo(handle))
        power = self._power_mw(i, handle)
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
        with self._lock:
            self._prune_switches(min(x.t for x in self._last.values()))
        return out

    def _segments(self, a: float, b: float) -> list[tuple[str, float, float]]:
        """(phase, start, end) pieces of the interval (a, b], cut at the logged phase switches."""
        phase, pieces, t = self._base_phase, [], a
        for ts, name in list(self._switches):  # list(deque) is one atomic C call under the GIL
            if ts <= a:
                phase = name
            elif ts < b:
                pieces.append((phase, t, ts))
                phase, t = name, ts
        pieces.append((phase, t, b))
        return [p for p in pieces if p[2] > p[1]]

    def _prune_switches(self, upto: float) -> None:
        while self._switches and self._switches[0][0] <= upto:
            self._base_phase = self._switches.popleft()[1]

    def _fold(self, s: NvmlSample) -> None:
        prev = self._last.get(s.gpu)
        self._last[s.gpu] = s
        if prev is None:
            return  # first reading of this GPU (or the first after stop()): a baseline, no interval yet
        dt = s.t - prev.t
        if dt <= 0:
            return
        counter = s.energy_j is not None and prev.energy_j is not None and s.energy_j >= prev.energy_j
        power = s.power_w is not None and prev.power_w is not None
        if counter:  # a counter that went back (driver reload) is skipped
            self._energy_from_counter[s.gpu] = True
        elif power:
            self._energy_from_counter.setdefault(s.gpu, False)
        p_at = (lambda t: prev.power_w + (s.power_w - prev.power_w) * (t - prev.t) / dt) if power else None
        for phase, t0, t1 in self._segments(prev.t, s.t):
            acc = self._acc.setdefault((s.gpu, phase), _Acc())
            piece = t1 - t0
            acc.seconds += piece
            acc.intervals += 1
            p_mean = 0.5 * (p_at(t0) + p_at(t1)) if power else None
            if counter:
                acc.energy_j += (s.energy_j - prev.energy_j) * piece / dt
            elif power:
                acc.energy_j += p_mean * piece
            for name in acc.wsum:
                value = p_mean if name == "power_w" else getattr(s, name)
                if value is not None:
                    acc.wsum[name] += value * piece
                    acc.wtime[name] += piece

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
        """Stop the thread and take a final sample; the time until the next start() is charged to no phase."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self.sample_once()
        with self._lock:
            self._last.clear()
            self._switches.clear()
            self._base_phase = self._phase

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
        return TelemetrySummary(available=True, reason="", num_gpus=len(self.devices),
                                energy_source=_one({"counter" if c else "power-integral" for c in counter.values()}),
                                power_source=_one(set(self._power_kind.values())), phases=phases, total=total)


def _one(kinds: set[str]) -> str:
    return kinds.pop() if len(kinds) == 1 else ("mixed" if kinds else "")


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
