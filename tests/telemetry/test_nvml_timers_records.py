"""Telemetry: the NVML sampler against a stand-in NVML module (no GPU here), the CPU phase timer,
and boundary records from a hand-made engine trace.

The stand-in implements the handful of pynvml calls the sampler makes; its counters advance only
when the test says so, and the sampler's clock is a fake too, so every expected number is exact.
Torch's view of the CUDA devices is a stand-in as well (CudaIdentity lists), mapped to the fake
NVML GPUs by UUID / PCI bus id.
"""

import time
import types

import pytest

from rlengine.telemetry.nvml import PHASES, NvmlSampler
from rlengine.telemetry.nvml_devices import CudaIdentity, normalise_uuid
from rlengine.telemetry.records import StepRecord, b_act_stats, build_boundary_record
from rlengine.telemetry.timers import PhaseTimer

NOT_SUPPORTED = 3


class FakeNVMLError(Exception):
    def __init__(self, value):
        super().__init__(f"NVML error {value}")
        self.value = value


class FakeGPU:
    def __init__(self, index):
        self.energy_mj = 1_000_000  # counter since "driver load"
        self.power_mw = 100_000
        self.instant_mw = 150_000   # what the instantaneous power field reads, where supported
        self.gpu_util, self.mem_util = 0, 0
        self.uuid = f"GPU-0000000{index}-aaaa-bbbb-cccc-dddddddddddd"
        self.pci = types.SimpleNamespace(domain=0, bus=0x10 + index, device=0,
                                         busId=f"00000000:{0x10 + index:02X}:00.0")


class FakeField:
    def __init__(self, ret, mw):
        self.nvmlReturn, self.value = ret, types.SimpleNamespace(uiVal=mw)


class FakeNVML:
    """The pynvml calls NvmlSampler makes, over GPUs whose state the test sets."""

    NVMLError = FakeNVMLError
    NVML_ERROR_NOT_SUPPORTED = NOT_SUPPORTED
    NVML_CLOCK_SM, NVML_CLOCK_MEM = 1, 2

    NVML_FI_DEV_POWER_INSTANT = 186

    def __init__(self, num_gpus=1, energy_supported=True, fail_init=False, instant_supported=False):
        self.gpus = [FakeGPU(i) for i in range(num_gpus)]
        self.energy_supported, self.fail_init = energy_supported, fail_init
        self.instant_supported = instant_supported
        self.energy_calls = self.field_calls = 0
        self.shutdown_called = False

    def nvmlInit(self):
        if self.fail_init:
            raise FakeNVMLError(12)

    def nvmlShutdown(self):
        self.shutdown_called = True

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        return self.gpus[i]

    def nvmlDeviceGetUtilizationRates(self, h):
        return types.SimpleNamespace(gpu=h.gpu_util, memory=h.mem_util)

    def nvmlDeviceGetMemoryInfo(self, h):
        return types.SimpleNamespace(used=2**30, total=2**34, free=2**34 - 2**30)

    def nvmlDeviceGetPowerUsage(self, h):
        return h.power_mw

    def nvmlDeviceGetClockInfo(self, h, kind):
        return 1980 if kind == self.NVML_CLOCK_SM else 2619

    def nvmlDeviceGetUUID(self, h):
        return h.uuid

    def nvmlDeviceGetPciInfo(self, h):
        return h.pci

    def nvmlDeviceGetFieldValues(self, h, ids):
        assert ids == [self.NVML_FI_DEV_POWER_INSTANT]
        self.field_calls += 1
        return [FakeField(0, h.instant_mw) if self.instant_supported else FakeField(NOT_SUPPORTED, 0)]

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        self.energy_calls += 1
        if not self.energy_supported:
            raise FakeNVMLError(NOT_SUPPORTED)
        return h.energy_mj


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def cuda_view(nvml, indices=None):
    """Torch's view of CUDA devices that are the fake NVML GPUs `indices` (default: all), by UUID."""
    indices = range(len(nvml.gpus)) if indices is None else indices
    return [CudaIdentity(i, normalise_uuid(nvml.gpus[g].uuid), None) for i, g in enumerate(indices)]


def sampler(nvml, clock=None, **kw):
    return NvmlSampler(nvml=nvml, cuda_identities=cuda_view(nvml), **({"clock": clock} if clock else {}), **kw)


def step(nvml, clock, seconds, joules, util=(0, 0), power_w=None):
    """Advance every fake GPU and the clock as if `seconds` of work drew `joules`."""
    clock.t += seconds
    for g in nvml.gpus:
        g.energy_mj += int(joules * 1000)
        g.gpu_util, g.mem_util = util
        if power_w is not None:
            g.power_mw = int(power_w * 1000)


def test_phase_tagging_and_per_phase_aggregation():
    nv, clock = FakeNVML(), FakeClock()
    s = sampler(nv, clock)
    assert s.available and s.reason == ""
    s.sample_once()                                  # baseline, phase idle: no interval yet
    with s.phase("decode"):
        assert s.current_phase == "decode"
        step(nv, clock, 1.0, 300.0, util=(90, 60))
        s.sample_once()
        step(nv, clock, 2.0, 500.0, util=(60, 30))
        s.sample_once()
    assert s.current_phase == "idle"                 # restored
    s.set_phase("optimizer")
    step(nv, clock, 0.5, 200.0, util=(100, 80))
    s.sample_once()

    summary = s.summary(responses=10, tokens=400)
    assert summary.available and summary.num_gpus == 1 and summary.energy_source == "counter"
    assert list(summary.phases) == ["decode", "optimizer"]
    dec = summary.phases["decode"]
    assert dec.seconds == pytest.approx(3.0) and dec.intervals == 2
    assert dec.energy_j == pytest.approx(800.0)      # counter difference, mJ -> J
    assert dec.gpu_util_pct == pytest.approx((90 * 1 + 60 * 2) / 3)   # time-weighted
    assert dec.mem_util_pct == pytest.approx((60 * 1 + 30 * 2) / 3)
    assert dec.sm_clock_mhz == pytest.approx(1980)
    assert dec.energy_per_response_j == pytest.approx(80.0) and dec.energy_per_token_j == pytest.approx(2.0)
    opt = summary.phases["optimizer"]
    assert opt.seconds == pytest.approx(0.5) and opt.energy_j == pytest.approx(200.0)
    assert summary.total.energy_j == pytest.approx(1000.0) and summary.total.seconds == pytest.approx(3.5)
    assert "decode" in summary.format() and "counter" in summary.format()
    samples = list(s.samples)
    assert [x.phase for x in samples] == ["idle", "decode", "decode", "optimizer"]
    assert samples[1].power_w == pytest.approx(100.0) and samples[1].mem_used_bytes == 2**30

    s.reset()                                        # next boundary: last reading is the new baseline
    step(nv, clock, 1.0, 50.0)
    s.sample_once()
    after = s.summary()
    assert after.total.energy_j == pytest.approx(50.0) and list(after.phases) == ["optimizer"]
    assert after.total.energy_per_response_j is None


def test_two_gpus_sum_energy_and_average_time():
    nv, clock = FakeNVML(num_gpus=2), FakeClock()
    s = sampler(nv, clock)
    s.sample_once()
    s.set_phase("forward-backward")
    step(nv, clock, 2.0, 100.0, util=(50, 20))
    s.sample_once()
    p = s.summary().phases["forward-backward"]
    assert p.energy_j == pytest.approx(200.0) and p.seconds == pytest.approx(2.0) and p.intervals == 2
    assert p.power_w == pytest.approx(200.0)          # 100 W per GPU, summed


def test_energy_not_supported_falls_back_to_power_and_stops_asking():
    nv, clock = FakeNVML(energy_supported=False), FakeClock()
    s = sampler(nv, clock)
    s.sample_once()
    s.set_phase("prefill")
    step(nv, clock, 2.0, 0.0, power_w=300.0)
    s.sample_once()
    summary = s.summary()
    assert summary.energy_source == "power-integral"
    # trapezoid between 100 W and 300 W over 2 s
    assert summary.phases["prefill"].energy_j == pytest.approx(400.0)
    assert nv.energy_calls == 1 and s.errors == 0     # NOT_SUPPORTED is remembered, not an error
    assert list(s.samples)[-1].energy_j is None


def test_background_thread_samples_and_stops():
    nv = FakeNVML()
    with sampler(nv, interval_s=0.005) as s:
        with s.phase("decode"):
            deadline = time.monotonic() + 2.0
            while len(s.samples) < 4 and time.monotonic() < deadline:
                time.sleep(0.005)
    n = len(s.samples)
    assert n >= 4 and s._thread is None
    time.sleep(0.03)
    assert len(s.samples) == n                        # stopped: no more samples
    s.close()
    assert nv.shutdown_called and not s.available


def test_unknown_phase_is_rejected():
    s = sampler(FakeNVML(), FakeClock())
    with pytest.raises(ValueError, match="forward-backward"):
        s.set_phase("train")
    assert set(PHASES) == {"prefill", "decode", "logprob", "forward-backward", "optimizer", "idle"}


@pytest.mark.parametrize("nvml, needle", [
    (FakeNVML(fail_init=True), "NVML could not initialise"),
    (FakeNVML(num_gpus=0), "0 GPU"),
])
def test_unavailable_path_says_why(nvml, needle):
    s = NvmlSampler(nvml=nvml)
    assert not s.available
    assert s.reason.startswith("GPU telemetry unavailable") and needle in s.reason
    s.start()                                         # no-ops
    s.set_phase("decode")
    assert s.sample_once() == []
    s.stop()
    summary = s.summary(responses=4, tokens=10)
    assert not summary.available and summary.phases == {} and summary.format() == s.reason


def test_missing_device_index_is_unavailable():
    s = NvmlSampler(devices=[3], nvml=FakeNVML(num_gpus=2))
    assert not s.available and "[3]" in s.reason


# ---- which GPUs: torch's CUDA devices mapped to NVML -------------------------------------------
def test_cuda_devices_map_to_nvml_by_uuid_then_pci():
    nv = FakeNVML(num_gpus=4)
    # CUDA_VISIBLE_DEVICES=2,0 in effect: cuda:0 is NVML's GPU 2 (known by UUID, torch prints no "GPU-"),
    # cuda:1 is NVML's GPU 0, known only by its PCI location.
    ids = [CudaIdentity(0, normalise_uuid(nv.gpus[2].uuid[4:].upper()), None), CudaIdentity(1, None, (0, 0x10, 0))]
    s = NvmlSampler(nvml=nv, cuda_identities=ids, clock=FakeClock())
    assert s.available and s.devices == [2, 0]
    assert [x.gpu for x in s.sample_once()] == [2, 0]
    # two MIG instances on one board (same PCI location, MIG UUIDs NVML does not list): sampled once
    mig = [CudaIdentity(0, "mig-1234", (0, 0x11, 0)), CudaIdentity(1, "mig-5678", (0, 0x11, 0))]
    assert NvmlSampler(nvml=FakeNVML(num_gpus=2), cuda_identities=mig).devices == [1]


def test_unmapped_or_missing_cuda_devices_are_unavailable():
    s = NvmlSampler(nvml=FakeNVML(num_gpus=2), cuda_identities=[CudaIdentity(0, "ffff", (0, 0x99, 0))])
    assert not s.available and "CUDA device 0" in s.reason and "2 GPU(s)" in s.reason
    s = NvmlSampler(nvml=FakeNVML(num_gpus=2), cuda_identities=[])
    assert not s.available and "torch sees no CUDA device" in s.reason


# ---- phase switches inside an interval, the stopped gap, instantaneous power -------------------
def test_interval_is_split_at_phase_switches():
    nv, clock = FakeNVML(), FakeClock()
    s = sampler(nv, clock)
    s.sample_once()                                   # t=100, idle
    clock.t = 100.25
    s.set_phase("optimizer")                          # a 0.25 s phase, shorter than the sampling period
    clock.t = 100.5
    s.set_phase("idle")
    step(nv, clock, 0.5, 100.0, util=(80, 10))        # t=101: one sample interval of 1 s, 100 J
    s.sample_once()
    p = s.summary().phases
    assert p["optimizer"].seconds == pytest.approx(0.25) and p["optimizer"].energy_j == pytest.approx(25.0)
    assert p["idle"].seconds == pytest.approx(0.75) and p["idle"].energy_j == pytest.approx(75.0)
    assert p["optimizer"].gpu_util_pct == pytest.approx(80.0)
    assert len(s._switches) == 0                      # switches before the last sample are folded away


def test_split_power_integral_interpolates():
    nv, clock = FakeNVML(energy_supported=False), FakeClock()
    s = sampler(nv, clock)
    s.sample_once()                                   # 100 W at t=100
    clock.t = 101.0
    s.set_phase("decode")
    step(nv, clock, 1.0, 0.0, power_w=300.0)          # 300 W at t=102; 200 W interpolated at the switch
    s.sample_once()
    p = s.summary().phases
    assert p["idle"].energy_j == pytest.approx(150.0) and p["decode"].energy_j == pytest.approx(250.0)
    assert p["decode"].power_w == pytest.approx(250.0)


def test_stopped_gap_is_charged_to_no_phase():
    nv, clock = FakeNVML(), FakeClock()
    s = sampler(nv, clock, interval_s=1000.0)         # the thread never samples on its own here
    s.start()                                         # baseline at t=100
    s.set_phase("decode")
    step(nv, clock, 1.0, 100.0)
    s.stop()                                          # final sample: 1 s, 100 J of decode
    step(nv, clock, 50.0, 5000.0)                     # stopped: not measured
    s.start()                                         # a new baseline, not an interval
    step(nv, clock, 1.0, 10.0)
    s.stop()
    dec = s.summary().phases["decode"]
    assert dec.seconds == pytest.approx(2.0) and dec.energy_j == pytest.approx(110.0)


@pytest.mark.parametrize("instant", [True, False])
def test_instantaneous_power_where_offered(instant):
    nv, clock = FakeNVML(instant_supported=instant), FakeClock()
    s = sampler(nv, clock)
    for _ in range(3):
        step(nv, clock, 1.0, 1.0)
        s.sample_once()
    assert list(s.samples)[-1].power_w == pytest.approx(150.0 if instant else 100.0)
    assert s.summary().power_source == ("instant" if instant else "average")
    assert nv.field_calls == (3 if instant else 1)    # "not supported" is asked once
    assert ("instant" if instant else "average") in s.summary().format()


def test_default_sampler_on_this_machine():
    s = NvmlSampler()                                 # real pynvml (or its absence)
    if s.available:
        s.close()
        pytest.skip("NVML works on this machine")
    assert s.reason.startswith("GPU telemetry unavailable") and not s.summary().available


# ---- PhaseTimer ---------------------------------------------------------------------------
def test_phase_timer_cpu():
    timer = PhaseTimer("cpu")
    assert not timer.use_cuda_events
    for _ in range(2):
        with timer.phase("gen"):
            time.sleep(0.01)
    with timer.phase("train"):
        pass
    totals = timer.totals()
    assert set(totals) == {"gen", "train"} and timer.counts() == {"gen": 2, "train": 1}
    assert totals["gen"] >= 0.02 and 0 <= totals["train"] < totals["gen"]
    assert timer.total("never") == 0.0
    with timer.phase("step"):                         # nesting distinct phases is allowed
        with timer.phase("gen"):
            pass
        with pytest.raises(RuntimeError, match="already open"):
            with timer.phase("step"):
                pass
        with pytest.raises(RuntimeError, match="open"):
            timer.reset()
    timer.reset()
    assert timer.totals() == {} and timer.counts() == {}


def test_phase_timer_counts_time_when_body_raises():
    timer = PhaseTimer()
    with pytest.raises(KeyError):
        with timer.phase("gen"):
            raise KeyError("x")
    assert timer.counts() == {"gen": 1}
    with timer.phase("gen"):                          # the failed phase did not stay open
        pass


# ---- boundary records -------------------------------------------------------------------
def hand_trace():
    # One prefill of 4 prompts (40 tokens), then decode with B_act 4, 4, 3, 2, 1, 1.
    # Decode time per B_act: 4 -> 0.2 + 0.2 = 0.4 s, 3 -> 0.1, 2 -> 0.1, 1 -> 0.2 + 0.2 = 0.4; total 1.0 s.
    return [
        StepRecord("prefill", 4, 40, 0.5, num_seqs_prefilled=4),
        StepRecord("decode", 4, 4, 0.2), StepRecord("decode", 4, 4, 0.2),
        StepRecord("decode", 3, 3, 0.1), StepRecord("decode", 2, 2, 0.1),
        StepRecord("decode", 1, 1, 0.2), StepRecord("decode", 1, 1, 0.2),
    ]


def test_b_act_stats_on_hand_trace():
    st = b_act_stats(hand_trace(), threshold=2)
    assert st.decode_steps == 6 and st.decode_seconds == pytest.approx(1.0)
    assert st.mean == pytest.approx(4 * 0.4 + 3 * 0.1 + 2 * 0.1 + 1 * 0.4)     # 2.5
    # cumulative time by B_act: 1 -> 0.4, 2 -> 0.5, 3 -> 0.6, 4 -> 1.0
    assert (st.p10, st.p50, st.p90, st.peak) == (1, 2, 4, 4)
    assert st.frac_time_below == pytest.approx(0.4)                             # B_act < 2: only B_act 1
    assert b_act_stats(hand_trace()).threshold == 2                              # default: half the peak
    assert b_act_stats(hand_trace(), threshold=5).frac_time_below == pytest.approx(1.0)


def test_boundary_record_from_hand_trace():
    rec = build_boundary_record(hand_trace(), responses=4, t_gen=2.0, t_train=6.0, preemptions=1,
                                recomputed_tokens=12)
    assert rec.responses == 4 and rec.generated_tokens == 15 + 4   # decode tokens + one per prefill
    assert rec.prefill_tokens == 40 and rec.prefill_steps == 1 and rec.prefill_seconds == pytest.approx(0.5)
    assert rec.q_gen == pytest.approx(2.0) and rec.q == pytest.approx(0.5)
    assert rec.gen_tokens_per_s == pytest.approx(9.5) and rec.step_seconds == pytest.approx(1.5)
    assert rec.b_act.mean == pytest.approx(2.5) and rec.preemptions == 1 and rec.recomputed_tokens == 12
    d = rec.to_dict()
    assert d["b_act"]["p50"] == 2 and d["q_gen"] == pytest.approx(2.0)


def test_boundary_record_without_decode_steps():
    rec = build_boundary_record([StepRecord("prefill", 2, 8, 0.1, num_seqs_prefilled=2)], responses=2,
                                t_gen=0.2, t_train=0.0)
    assert rec.b_act.mean is None and rec.b_act.frac_time_below is None and rec.generated_tokens == 2
    assert rec.q == rec.q_gen == pytest.approx(10.0)


@pytest.mark.parametrize("kwargs, trace, match", [
    (dict(responses=1, t_gen=0.0, t_train=1.0), [], "t_gen"),
    (dict(responses=1, t_gen=1.0, t_train=-1.0), [], "t_train"),
    (dict(responses=-1, t_gen=1.0, t_train=1.0), [], "responses"),
    (dict(responses=1, t_gen=1.0, t_train=1.0), [StepRecord("train", 1, 1, 0.1)], "kind"),
    (dict(responses=1, t_gen=1.0, t_train=1.0), [StepRecord("decode", 1, 1, -0.1)], "seconds"),
])
def test_boundary_record_errors(kwargs, trace, match):
    with pytest.raises(ValueError, match=match):
        build_boundary_record(trace, **kwargs)
