"""The GPUs of this node: read through NVML (``nvidia-ml-py``), or declared in a file.

:class:`NvmlProbe` opens NVML once, keeps one handle per device and an event set registered for
XID critical errors, and each :meth:`NvmlProbe.read` returns every GPU as a
:class:`~dsec_core.events.GpuInfo`: model, uuid, PCI bus id, memory, temperature, utilization,
volatile ECC counts, the XID errors counted since start, MIG mode, the state of each NVLink and
the PCI id at its other end, and how each pair of GPUs is joined (``topology``). A field the
device does not support is ``None`` (or empty); any other failure of a field is a *problem*
("GPU 2: temperature: GPU is lost") that the node's heartbeat reports, or, with ``strict``, an
error (``scripts/gpu-check.sh``). Every call blocks in the driver: call it from a thread.

Without NVML (the library is missing, or no driver is loaded) a node has no GPUs and says why
(``gpu_probe = "no NVML: <reason>"``). A *declared* inventory (``DSEC_NODE_INVENTORY``, YAML or
JSON, like KWOK's fake nodes) replaces the probe: how GPU nodes are simulated on machines
without GPUs. ``python -m dsec_nodeagent.gpu`` prints this node's GPUs as JSON.
"""

from __future__ import annotations

import importlib
import json
import logging
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from dsec_core.events import GpuInfo, GpuLink
from dsec_core.spec.units import ByteSize, Cores
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

log = logging.getLogger(__name__)

XID_POLL_MAX = 10_000
"""Events drained from the XID event set in one read at most (a storm never stalls a beat)."""

DECLARED_MAX_BYTES = 1 << 20
"""Largest declared inventory file read."""

Link = Literal["NVLINK", "SINGLE", "MULTIPLE", "HOSTBRIDGE", "NODE", "SYSTEM"]


class FieldReadError(RuntimeError):
    """A GPU field could not be read for another reason than "not supported" (strict mode)."""


@dataclass(frozen=True)
class GpuReading:
    """The GPUs of the node, how they were found, and what could not be read."""

    gpus: list[GpuInfo]
    probe: str
    problems: list[str] = field(default_factory=list)


def topology_names(nvml: Any) -> dict[int, Link]:
    """NVML's ``nvmlGpuTopologyLevel_t`` values -> names. ``INTERNAL`` (two GPUs on one board)
    is closer than one PCIe switch; it is reported as ``SINGLE``, the closest PCIe level."""
    return {
        nvml.NVML_TOPOLOGY_INTERNAL: "SINGLE",
        nvml.NVML_TOPOLOGY_SINGLE: "SINGLE",
        nvml.NVML_TOPOLOGY_MULTIPLE: "MULTIPLE",
        nvml.NVML_TOPOLOGY_HOSTBRIDGE: "HOSTBRIDGE",
        nvml.NVML_TOPOLOGY_NODE: "NODE",
        nvml.NVML_TOPOLOGY_SYSTEM: "SYSTEM",
    }


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _pci(value: Any) -> str:
    """A PCI bus id in one spelling (NVML pads the domain to 8 digits in some calls only)."""
    text = _text(value).strip().lower()
    domain, sep, rest = text.partition(":")
    if sep and rest.count(":") == 1:
        return f"{int(domain, 16):08x}:{rest}"
    return text


@dataclass
class _Device:
    index: int
    handle: Any
    uuid: str
    pci: str


class NvmlProbe:
    """NVML, opened once. ``nvml``: the ``pynvml`` module (default: imported on :meth:`open`);
    pure unit tests pass a fake one. ``strict``: a field that fails to read raises
    :class:`FieldReadError` instead of becoming a problem."""

    def __init__(self, nvml: Any | None = None, *, strict: bool = False) -> None:
        self.nvml: Any = nvml
        self.strict = strict
        self.reason: str | None = None
        self._devices: list[_Device] = []
        self._events: Any = None
        self._xids: dict[str, int] = {}  # uuid -> XIDs seen, for GPUs registered for them
        self._lost: list[str] = []  # devices NVML lists but could not open
        self._open = False

    # ------------------------------------------------------------------ open / close

    def open(self) -> bool:
        """Initialize NVML and find the devices; ``False`` (and :attr:`reason`) without NVML."""
        if self._open:
            return True
        try:
            if self.nvml is None:
                self.nvml = importlib.import_module("pynvml")
            self.nvml.nvmlInit()
        except ImportError as exc:
            self.reason = f"the nvidia-ml-py package is not installed ({exc})"
            return False
        except Exception as exc:  # NVMLError: library not found, driver not loaded, ...
            self.reason = str(exc) or type(exc).__name__
            return False
        self._open = True
        nvml = self.nvml
        count = self._field(self._lost, "device count", nvml.nvmlDeviceGetCount) or 0
        for index in range(count):
            device = self._field(self._lost, f"GPU {index}", self._device, index)
            if device is not None:
                self._devices.append(device)
        self._register_xids()
        return True

    def _device(self, index: int) -> _Device:
        nvml = self.nvml
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        return _Device(index, handle, uuid, _pci(nvml.nvmlDeviceGetPciInfo(handle).busId))

    def _register_xids(self) -> None:
        nvml = self.nvml
        try:
            self._events = nvml.nvmlEventSetCreate()
        except Exception as exc:
            log.warning("NVML: no event set, XID errors are not counted: %s", exc)
            return
        for device in self._devices:
            try:
                nvml.nvmlDeviceRegisterEvents(
                    device.handle, nvml.nvmlEventTypeXidCriticalError, self._events
                )
            except Exception as exc:  # not supported on this GPU (or in this container)
                log.info("NVML: GPU %d does not report XID events: %s", device.index, exc)
                continue
            self._xids[device.uuid] = 0

    def close(self) -> None:
        """Free the event set and shut NVML down."""
        if not self._open:
            return
        nvml = self.nvml
        if self._events is not None:
            try:
                nvml.nvmlEventSetFree(self._events)
            except Exception as exc:
                log.debug("NVML: event set free failed: %s", exc)
            self._events = None
        try:
            nvml.nvmlShutdown()
        except Exception as exc:
            log.debug("NVML: shutdown failed: %s", exc)
        self._open = False
        self._devices, self._lost, self._xids = [], [], {}

    # ------------------------------------------------------------------ reading

    def read(self) -> GpuReading:
        """Every GPU now (opens NVML on first use); blocks in the driver."""
        if not self.open():
            return GpuReading([], f"no NVML: {self.reason}")
        problems = list(self._lost)
        self._poll_xids(problems)
        gpus: list[GpuInfo] = []
        for device in self._devices:
            info = self._gpu(device, problems)
            if info is not None:
                gpus.append(info)
        joined = self._topology(gpus, problems)
        gpus = [g.model_copy(update={"topology": joined.get(g.uuid, {})}) for g in gpus]
        return GpuReading(gpus, "nvml", problems)

    def _unsupported(self, exc: BaseException) -> bool:
        nvml = self.nvml
        codes = {
            getattr(nvml, "NVML_ERROR_NOT_SUPPORTED", 3),
            getattr(nvml, "NVML_ERROR_FUNCTION_NOT_FOUND", 13),
        }
        return isinstance(exc, nvml.NVMLError) and getattr(exc, "value", None) in codes

    def _field(self, problems: list[str], where: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``; ``None`` when not supported; another failure is a problem (or, when
        strict, :class:`FieldReadError`)."""
        try:
            return fn(*args)
        except Exception as exc:
            if self._unsupported(exc):
                return None
            if self.strict:
                raise FieldReadError(f"{where}: {type(exc).__name__}: {exc}") from exc
            problems.append(f"{where}: {exc or type(exc).__name__}")
            return None

    def _gpu(self, device: _Device, problems: list[str]) -> GpuInfo | None:
        nvml, h, where = self.nvml, device.handle, f"GPU {device.index}"
        name = self._field(problems, f"{where}: name", nvml.nvmlDeviceGetName, h)
        memory = self._field(problems, f"{where}: memory", nvml.nvmlDeviceGetMemoryInfo, h)
        if name is None or memory is None:
            # A GPU that cannot say what it is (lost, fallen off the bus): not offered.
            problems.append(f"{where} ({device.uuid}): no name or memory reported; not offered")
            return None
        temperature = self._field(
            problems, f"{where}: temperature", nvml.nvmlDeviceGetTemperature, h,
            nvml.NVML_TEMPERATURE_GPU,
        )  # fmt: skip
        utilization = self._field(
            problems, f"{where}: utilization", nvml.nvmlDeviceGetUtilizationRates, h
        )
        return GpuInfo(
            index=device.index,
            uuid=device.uuid,
            model=_text(name),
            pci_bus_id=device.pci,
            memory_total_bytes=int(memory.total),
            memory_used_bytes=int(memory.used),
            temperature_c=None if temperature is None else float(temperature),
            utilization_pct=None if utilization is None else float(utilization.gpu),
            ecc_corrected=self._ecc(device, problems, nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
            ecc_uncorrected=self._ecc(device, problems, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
            xid_errors=self._xids.get(device.uuid),
            mig_enabled=self._mig(device, problems),
            nvlinks=self._nvlinks(device, problems),
        )

    def _ecc(self, device: _Device, problems: list[str], kind: int) -> int | None:
        nvml = self.nvml
        count = self._field(
            problems, f"GPU {device.index}: ECC", nvml.nvmlDeviceGetTotalEccErrors,
            device.handle, kind, nvml.NVML_VOLATILE_ECC,
        )  # fmt: skip
        return None if count is None else int(count)

    def _mig(self, device: _Device, problems: list[str]) -> bool:
        nvml = self.nvml
        modes = self._field(
            problems, f"GPU {device.index}: MIG mode", nvml.nvmlDeviceGetMigMode, device.handle
        )
        return modes is not None and modes[0] == nvml.NVML_DEVICE_MIG_ENABLE

    def _nvlinks(self, device: _Device, problems: list[str]) -> list[GpuLink]:
        nvml, links = self.nvml, []
        invalid = getattr(nvml, "NVML_ERROR_INVALID_ARGUMENT", 2)
        for link in range(nvml.NVML_NVLINK_MAX_LINKS):
            try:
                state = nvml.nvmlDeviceGetNvLinkState(device.handle, link)
            except Exception as exc:
                # Not supported: no NVLink on this GPU; invalid argument: past its last link.
                if not (self._unsupported(exc) or getattr(exc, "value", None) == invalid):
                    self._field(problems, f"GPU {device.index}: NVLink {link}", _raise, exc)
                break
            active = state == nvml.NVML_FEATURE_ENABLED
            remote = None
            if active:
                info = self._field(
                    problems, f"GPU {device.index}: NVLink {link} remote PCI",
                    nvml.nvmlDeviceGetNvLinkRemotePciInfo, device.handle, link,
                )  # fmt: skip
                remote = None if info is None else _pci(info.busId)
            links.append(GpuLink(link=link, active=active, remote_pci=remote))
        return links

    def _topology(self, gpus: Sequence[GpuInfo], problems: list[str]) -> dict[str, dict[str, str]]:
        """uuid -> peer uuid -> how they are joined."""
        nvml = self.nvml
        names = topology_names(nvml)
        handles = {d.uuid: d.handle for d in self._devices}
        joined: dict[str, dict[str, str]] = {g.uuid: {} for g in gpus}
        for i, a in enumerate(gpus):
            for b in gpus[i + 1 :]:
                if _nvlinked(a, b) or self._p2p_nvlink(handles[a.uuid], handles[b.uuid]):
                    level: str | None = "NVLINK"
                else:
                    where = f"GPU {a.index}-{b.index}: topology"
                    value = self._field(
                        problems, where, nvml.nvmlDeviceGetTopologyCommonAncestor,
                        handles[a.uuid], handles[b.uuid],
                    )  # fmt: skip
                    level = None if value is None else names.get(int(value), "SYSTEM")
                if level is not None:
                    joined[a.uuid][b.uuid] = joined[b.uuid][a.uuid] = level
        return joined

    def _p2p_nvlink(self, a: Any, b: Any) -> bool:
        """NVLink through an NVSwitch: the link's far end is the switch, not the peer GPU."""
        nvml = self.nvml
        status = getattr(nvml, "nvmlDeviceGetP2PStatus", None)
        index = getattr(nvml, "NVML_P2P_CAPS_INDEX_NVLINK", None)
        if status is None or index is None:
            return False
        try:
            return bool(status(a, b, index) == getattr(nvml, "NVML_P2P_STATUS_OK", 0))
        except Exception:  # not supported: no NVLink between them
            return False

    def _poll_xids(self, problems: list[str]) -> None:
        """Drain the XID event set without waiting (timeout 0); count per GPU."""
        if self._events is None:
            return
        nvml = self.nvml
        timeout = getattr(nvml, "NVML_ERROR_TIMEOUT", 10)
        for _ in range(XID_POLL_MAX):
            try:
                data = nvml.nvmlEventSetWait_v2(self._events, 0)
            except Exception as exc:
                if getattr(exc, "value", None) != timeout:
                    self._field(problems, "XID events", _raise, exc)
                return
            uuid = self._field(problems, "XID event", nvml.nvmlDeviceGetUUID, data.device)
            uuid = None if uuid is None else _text(uuid)
            if uuid in self._xids:
                self._xids[uuid] += 1
            log.warning("GPU %s: XID %s", uuid, getattr(data, "eventData", "?"))


def _raise(exc: BaseException) -> None:
    raise exc


def _nvlinked(a: GpuInfo, b: GpuInfo) -> bool:
    """An active NVLink of one ends at the other's PCI id."""
    return any(link.active and link.remote_pci == b.pci_bus_id for link in a.nvlinks) or any(
        link.active and link.remote_pci == a.pci_bus_id for link in b.nvlinks
    )


# ---------------------------------------------------------------------- declared inventory


class InventoryError(ValueError):
    """A declared inventory file that cannot be used (the message names the file and field)."""


class DeclaredGpu(BaseModel):
    """One entry of ``gpus:``; ``count`` identical GPUs joined pairwise by ``link``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(min_length=1, max_length=200)
    memory: ByteSize
    count: int = Field(default=1, ge=1, le=64)
    link: Link = Field(default="SYSTEM", description="How the GPUs of this entry are joined")
    mig_enabled: bool = False
    uuid: str | None = Field(default=None, min_length=1, max_length=100)

    @model_validator(mode="after")
    def _one_uuid_one_gpu(self) -> DeclaredGpu:
        if self.uuid is not None and self.count != 1:
            raise ValueError("uuid names one GPU: give it only with count 1")
        return self


class DeclaredInventory(BaseModel):
    """A declared inventory file: GPUs, and optionally what sandboxes may use of CPU/memory."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cpus: Cores | None = None
    memory: ByteSize | None = None
    gpus: list[DeclaredGpu] = Field(default_factory=list, max_length=64)


def _location(loc: Sequence[int | str]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def load_declared(path: Path) -> DeclaredInventory:
    """Read and validate a declared inventory.

    Raises:
        InventoryError: unreadable, not YAML/JSON, or a field is wrong (each one named).
    """
    where = f"DSEC_NODE_INVENTORY {path}"
    try:
        with path.open("rb") as fh:
            raw = fh.read(DECLARED_MAX_BYTES + 1)
    except OSError as exc:
        raise InventoryError(f"{where}: cannot read: {exc.strerror or exc}") from None
    if len(raw) > DECLARED_MAX_BYTES:
        raise InventoryError(f"{where}: larger than {DECLARED_MAX_BYTES} bytes")
    try:
        data = json.loads(raw) if path.suffix == ".json" else yaml.safe_load(raw)
    except (ValueError, yaml.YAMLError) as exc:
        raise InventoryError(f"{where}: not valid {_kind(path)}: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise InventoryError(
            f"{where}: expected a mapping with gpus (and optionally cpus, memory), "
            f"got {type(data).__name__}"
        )
    try:
        return DeclaredInventory.model_validate(data)
    except ValidationError as exc:
        lines = [f"{_location(e['loc'])}: {e['msg']}" for e in exc.errors()]
        raise InventoryError(f"{where}: " + "; ".join(lines)) from None


def _kind(path: Path) -> str:
    return "JSON" if path.suffix == ".json" else "YAML"


def declared_gpus(declared: DeclaredInventory, node_id: str) -> list[GpuInfo]:
    """The GPUs a declared inventory describes (uuids ``GPU-<node>-<index>`` unless given)."""
    entries: list[tuple[int, DeclaredGpu]] = []
    for entry_no, entry in enumerate(declared.gpus):
        entries.extend((entry_no, entry) for _ in range(entry.count))
    uuids = [entry.uuid or f"GPU-{node_id}-{i}" for i, (_, entry) in enumerate(entries)]
    gpus = []
    for i, (entry_no, entry) in enumerate(entries):
        topology = {
            uuids[j]: (entry.link if other_no == entry_no else "SYSTEM")
            for j, (other_no, _) in enumerate(entries)
            if j != i
        }
        gpus.append(
            GpuInfo(
                index=i,
                uuid=uuids[i],
                model=entry.model,
                memory_total_bytes=entry.memory,
                mig_enabled=entry.mig_enabled,
                topology=topology,
            )
        )
    return gpus


# ---------------------------------------------------------------------- entry point


def main(argv: Sequence[str] | None = None, *, nvml: Any = None) -> int:
    """Print this node's GPUs as JSON (``python -m dsec_nodeagent.gpu``).

    Exit 0 with the GPUs (or none, with the reason); exit 1 when NVML is present but a field
    read failed (unless ``--lenient``: then it is listed under ``problems``) — the check a GPU
    machine runs after setup (``scripts/gpu-check.sh``). ``nvml``: a fake module (unit tests).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    probe = NvmlProbe(nvml, strict="--lenient" not in args)
    try:
        probe.read()
        # A second read counts XIDs since the first and proves the handles stay usable.
        reading = probe.read()
    except Exception as exc:  # FieldReadError, or a bug in the mapping: both fail the check
        traceback.print_exc()
        print(json.dumps({"gpu_probe": "nvml", "error": str(exc)}), flush=True)
        return 1
    finally:
        probe.close()
    print(
        json.dumps(
            {
                "gpu_probe": reading.probe,
                "gpus": [g.model_dump(mode="json") for g in reading.gpus],
                "problems": reading.problems,
            },
            indent=2,
        ),
        flush=True,
    )
    return 1 if reading.problems else 0


if __name__ == "__main__":
    sys.exit(main())
