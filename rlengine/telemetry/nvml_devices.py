"""Which NVML devices are this process's GPUs: torch's CUDA indices mapped to NVML indices.

NVML enumerates every GPU on the node in its own order and ignores CUDA_VISIBLE_DEVICES, while
torch's cuda:0 is the first *visible* device in CUDA's order. A GPU is matched by UUID (torch
reports it without NVML's "GPU-" prefix) and, failing that, by PCI domain / bus / device. Under
MIG a CUDA device is a MIG instance whose UUID NVML lists only under its parent; the PCI match
then finds the parent GPU, whose power and energy cover the whole board.
The sampler (nvml.py) calls `map_cuda_to_nvml`; tests pass stand-in properties and NVML.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CudaIdentity:
    """How one CUDA device can be recognised in NVML."""

    index: int                          # torch's CUDA index (cuda:index)
    uuid: str | None                    # normalised: lower case, no GPU-/MIG- prefix
    pci: tuple[int, int, int] | None    # (domain, bus, device)


def normalise_uuid(value) -> str | None:
    if value is None:
        return None
    text = value.decode() if isinstance(value, bytes) else str(value)
    text = text.strip().lower()
    for prefix in ("gpu-", "mig-"):
        if text.startswith(prefix):
            text = text[len(prefix):]
    return text or None


def torch_cuda_identities(indices: list[int] | None = None) -> list[CudaIdentity]:
    """UUID and PCI location of torch's CUDA devices (all visible ones by default); [] without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return []
    indices = list(range(torch.cuda.device_count())) if indices is None else list(indices)
    out = []
    for i in indices:
        p = torch.cuda.get_device_properties(i)
        pci = None
        if getattr(p, "pci_bus_id", None) is not None:
            pci = (int(getattr(p, "pci_domain_id", 0)), int(p.pci_bus_id), int(getattr(p, "pci_device_id", 0)))
        out.append(CudaIdentity(i, normalise_uuid(getattr(p, "uuid", None)), pci))
    return out


def _nvml_identity(nvml, handle) -> tuple[str | None, tuple[int, int, int] | None]:
    try:
        uuid = normalise_uuid(nvml.nvmlDeviceGetUUID(handle))
    except Exception:  # an NVMLError: the UUID is unknown, the PCI match may still work
        uuid = None
    try:
        info = nvml.nvmlDeviceGetPciInfo(handle)
        pci = (int(info.domain), int(info.bus), int(info.device))
    except Exception:
        pci = None
    return uuid, pci


def map_cuda_to_nvml(nvml, cuda: list[CudaIdentity]) -> tuple[list[int], str]:
    """NVML indices of `cuda` devices, in the same order, and "" — or ([], the reason none could be mapped)."""
    count = nvml.nvmlDeviceGetCount()
    known = [_nvml_identity(nvml, nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(count)]
    out = []
    for dev in cuda:
        match = next((i for i, (u, _) in enumerate(known) if dev.uuid and u == dev.uuid), None)
        if match is None:
            match = next((i for i, (_, p) in enumerate(known) if dev.pci and p == dev.pci), None)
        if match is None:
            return [], (f"CUDA device {dev.index} (uuid {dev.uuid}, pci {dev.pci}) matches none of NVML's "
                        f"{count} GPU(s)")
        if match not in out:  # two MIG instances of one GPU: sample the board once
            out.append(match)
    return out, ""
