"""What each simulated node has: read from an openb node list (CSV), a YAML inventory, or flags.

* **openb CSV** (``sn,cpu_milli,memory_mib,gpu,model``, Alibaba's production trace format): one
  node per row; the node id is ``sn`` made a subject token (other characters become ``-``).
* **YAML** (mixing models)::

      nodes:
        - count: 100            # sim-a100-0 .. sim-a100-99
          name: a100            # the id prefix (with --prefix): <prefix>-<name>-<i>
          gpus: 8
          gpu_model: A100-80GB
          cpu: 96
          memory: 1TiB
          labels: {zone: a}
        - name: big-1           # count 1 (default): the id is <prefix>-big-1
          gpus: 8
          gpu_model: MI300X

* **flags**: ``--nodes N --gpus G --gpu-model M [--cpu C --memory 512GiB]``: ``<prefix>-<i>``.

GPU models go through :mod:`dsec_core.gpumodels` (canonical names; a family that names several
models, ``a100``, is refused: say which). Every error names the file and line (CSV) or the
entry and field (YAML) and what is valid.
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from dsec_core import gpumodels
from dsec_core.spec.units import parse_cpu, parse_size
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

MAX_FILE_BYTES = 64 << 20
"""Largest inventory file read."""
MAX_NODES = 100_000
"""Nodes one process simulates at most."""
MAX_GPUS = 64
"""GPUs per node at most (the node agent's declared inventory has the same bound)."""
CSV_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")
_TOKEN = re.compile(r"[A-Za-z0-9_-]+")
_NOT_TOKEN = re.compile(r"[^A-Za-z0-9_-]+")
NODE_ID_MAX = 64
MIB = 2**20
# the node agent's label rules (DSEC_NODE_LABELS): what a real node could carry
_LABEL_KEY = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_./-]{0,61}[A-Za-z0-9])?")
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?)?")


def label_problem(key: str, value: str) -> str | None:
    """Why ``key=value`` is not a label a node agent accepts, or ``None``."""
    if not _LABEL_KEY.fullmatch(key):
        return (
            f"key {key!r}: 1-63 letters, digits and _.-/ (starting and ending with a letter "
            "or digit)"
        )
    if not _LABEL_VALUE.fullmatch(value):
        return (
            f"value of {key!r} ({value!r}): at most 63 letters, digits and _.- (starting and "
            "ending with a letter or digit)"
        )
    return None


class InventoryError(ValueError):
    """An inventory that cannot be simulated; the message locates the problem."""


@dataclass(frozen=True, slots=True)
class NodePlan:
    """One simulated node: its id and what it offers."""

    node_id: str
    cpus: float
    memory_bytes: int
    gpu_model: str | None = None
    """Canonical model of its GPUs (``None``: no GPUs)."""
    gpus: int = 0
    labels: Mapping[str, str] = field(default_factory=dict)

    @property
    def gpu_memory_bytes(self) -> int:
        """Memory of one GPU (the catalogue's datasheet figure; 0 when unknown)."""
        if self.gpu_model is None:
            return 0
        known = gpumodels.BY_NAME.get(self.gpu_model)
        return known.memory_bytes if known is not None else 0


def sanitize(text: str) -> str:
    """A node id from any text: characters other than letters, digits, ``_`` and ``-`` become
    ``-``; at most 64 characters."""
    return _NOT_TOKEN.sub("-", text.strip()).strip("-")[:NODE_ID_MAX]


def canonical_model(text: str, where: str) -> str:
    """The canonical GPU model a spelling names.

    Raises:
        InventoryError: unknown, or a family of several models (``a100``).
    """
    try:
        models = gpumodels.resolve(text)
    except KeyError:
        valid = ", ".join(m.name for m in gpumodels.CATALOG)
        raise InventoryError(f"{where}: unknown GPU model {text!r}; valid: {valid}") from None
    if len(models) > 1:
        raise InventoryError(
            f"{where}: {text!r} names several models ({', '.join(models)}): name one"
        )
    return models[0]


def _check_ids(plans: Sequence[NodePlan], where: str) -> list[NodePlan]:
    if not plans:
        raise InventoryError(f"{where}: no nodes")
    if len(plans) > MAX_NODES:
        raise InventoryError(f"{where}: {len(plans)} nodes, at most {MAX_NODES}")
    seen: set[str] = set()
    for plan in plans:
        if not _TOKEN.fullmatch(plan.node_id) or len(plan.node_id) > NODE_ID_MAX:
            raise InventoryError(
                f"{where}: node id {plan.node_id!r}: 1-{NODE_ID_MAX} letters, digits, '_', '-'"
            )
        if plan.node_id in seen:
            raise InventoryError(f"{where}: node id {plan.node_id!r} given twice")
        seen.add(plan.node_id)
    return list(plans)


def _read(path: Path) -> str:
    try:
        with path.open("rb") as fh:
            raw = fh.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise InventoryError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise InventoryError(f"{path}: larger than {MAX_FILE_BYTES} bytes")
    try:
        return raw.decode()
    except UnicodeDecodeError as exc:
        raise InventoryError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


# ---------------------------------------------------------------------- flags


def uniform(
    count: int,
    *,
    gpus: int = 0,
    gpu_model: str | None = None,
    cpus: float = 64.0,
    memory_bytes: int = 512 * 2**30,
    prefix: str = "sim",
    labels: Mapping[str, str] | None = None,
) -> list[NodePlan]:
    """``count`` identical nodes ``<prefix>-0`` .. ``<prefix>-<count-1>``.

    Raises:
        InventoryError: a bad count, GPU count or model (the flag named).
    """
    if not 1 <= count <= MAX_NODES:
        raise InventoryError(f"--nodes {count}: between 1 and {MAX_NODES}")
    if not 0 <= gpus <= MAX_GPUS:
        raise InventoryError(f"--gpus {gpus}: between 0 and {MAX_GPUS}")
    if cpus <= 0 or memory_bytes <= 0:
        raise InventoryError("--cpu and --memory must be positive")
    model = None
    if gpus:
        model = canonical_model(gpu_model or "H100", "--gpu-model")
    return _check_ids(
        [
            NodePlan(f"{prefix}-{i}", cpus, memory_bytes, model, gpus, dict(labels or {}))
            for i in range(count)
        ],
        "--prefix",
    )


# ---------------------------------------------------------------------- openb CSV


def parse_csv(text: str, where: str = "nodes.csv", *, prefix: str | None = None) -> list[NodePlan]:
    """Nodes of an openb node list (``sn,cpu_milli,memory_mib,gpu,model``); ``prefix``: put
    before each sanitised ``sn``.

    Raises:
        InventoryError: ``FILE:LINE: column: what is wrong`` (missing columns, numbers, models).
    """
    reader = csv.reader(io.StringIO(text))
    try:
        header = next(reader)
    except StopIteration:
        raise InventoryError(
            f"{where}: empty; expected the header {','.join(CSV_COLUMNS)}"
        ) from None
    columns = [c.strip() for c in header]
    missing = [c for c in CSV_COLUMNS if c not in columns]
    if missing:
        raise InventoryError(
            f"{where}:1: missing column(s) {', '.join(missing)}; the openb header is "
            f"{','.join(CSV_COLUMNS)}"
        )
    at = {c: columns.index(c) for c in CSV_COLUMNS}
    plans: list[NodePlan] = []
    for row in reader:
        line = reader.line_num
        if not row or all(not cell.strip() for cell in row):
            continue
        if len(row) < len(columns):
            raise InventoryError(
                f"{where}:{line}: {len(row)} fields, the header has {len(columns)}"
            )
        cell = {c: row[i].strip() for c, i in at.items()}
        node_id = sanitize(cell["sn"])
        if not node_id:
            raise InventoryError(f"{where}:{line}: sn: empty (a node name is needed)")
        cpu_milli = _int(cell["cpu_milli"], f"{where}:{line}: cpu_milli", minimum=1)
        memory_mib = _int(cell["memory_mib"], f"{where}:{line}: memory_mib", minimum=1)
        gpus = _int(cell["gpu"], f"{where}:{line}: gpu", minimum=0, maximum=MAX_GPUS)
        model = None
        if gpus:
            if not cell["model"]:
                raise InventoryError(f"{where}:{line}: model: empty for a node with {gpus} GPUs")
            model = canonical_model(cell["model"], f"{where}:{line}: model")
        plans.append(
            NodePlan(
                f"{prefix}-{node_id}" if prefix else node_id,
                cpu_milli / 1000,
                memory_mib * MIB,
                model,
                gpus,
            )
        )
    return _check_ids(plans, where)


def _int(text: str, where: str, *, minimum: int, maximum: int | None = None) -> int:
    try:
        value = int(text)
    except ValueError:
        raise InventoryError(f"{where}: {text!r} is not a whole number") from None
    if value < minimum or (maximum is not None and value > maximum):
        upper = f" and at most {maximum}" if maximum is not None else ""
        raise InventoryError(f"{where}: {value}: at least {minimum}{upper}")
    return value


def load_csv(path: Path, *, prefix: str | None = None) -> list[NodePlan]:
    """:func:`parse_csv` of a file."""
    return parse_csv(_read(path), str(path), prefix=prefix)


# ---------------------------------------------------------------------- YAML


class NodeGroup(BaseModel):
    """One entry of ``nodes:``: ``count`` identical nodes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(default="", max_length=48, description="Id (count 1) or id prefix")
    count: int = Field(default=1, ge=1, le=MAX_NODES)
    gpus: int = Field(default=0, ge=0, le=MAX_GPUS)
    gpu_model: str | None = None
    cpu: float = Field(default=64.0, description="CPU cores (2, 500m)")
    memory: int = Field(default=512 * 2**30, description="Memory (512GiB)")
    labels: dict[str, str] = Field(default_factory=dict, max_length=64)

    @field_validator("cpu", mode="before")
    @classmethod
    def _cpu(cls, value: Any) -> float:
        return float(parse_cpu(value))

    @field_validator("memory", mode="before")
    @classmethod
    def _memory(cls, value: Any) -> int:
        return int(parse_size(value))

    @field_validator("labels")
    @classmethod
    def _labels(cls, value: dict[str, str]) -> dict[str, str]:
        for k, v in value.items():
            problem = label_problem(k, v)
            if problem is not None:
                raise ValueError(problem)
        return value

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if value and not _TOKEN.fullmatch(value):
            raise ValueError("letters, digits, '_' and '-' only")
        return value


class InventoryFile(BaseModel):
    """A YAML inventory: ``nodes:``, a list of node groups."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    nodes: list[NodeGroup] = Field(min_length=1)


def _location(loc: Sequence[int | str]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def parse_yaml(text: str, where: str = "inventory.yaml", *, prefix: str = "sim") -> list[NodePlan]:
    """Nodes of a YAML inventory (see the module docstring).

    Raises:
        InventoryError: ``FILE: nodes[i].field: what is wrong``.
    """
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise InventoryError(f"{where}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise InventoryError(f"{where}: expected a mapping with nodes: [...]")
    try:
        parsed = InventoryFile.model_validate(data)
    except ValidationError as exc:
        lines = [f"{_location(e['loc'])}: {e['msg']}" for e in exc.errors()]
        raise InventoryError(f"{where}: " + "; ".join(lines)) from None
    plans: list[NodePlan] = []
    for i, group in enumerate(parsed.nodes):
        at = f"{where}: nodes[{i}]"
        model = None
        if group.gpus:
            model = canonical_model(group.gpu_model or "H100", f"{at}.gpu_model")
        elif group.gpu_model is not None:
            raise InventoryError(f"{at}.gpu_model: given without gpus (how many?)")
        if group.cpu <= 0 or group.memory <= 0:
            raise InventoryError(f"{at}: cpu and memory must be positive")
        base = "-".join(p for p in (prefix, group.name or f"g{i}") if p)
        ids = (
            [base]
            if group.count == 1 and group.name
            else [f"{base}-{n}" for n in range(group.count)]
        )
        plans += [
            NodePlan(node_id, group.cpu, group.memory, model, group.gpus, dict(group.labels))
            for node_id in ids
        ]
    return _check_ids(plans, where)


def load_yaml(path: Path, *, prefix: str = "sim") -> list[NodePlan]:
    """:func:`parse_yaml` of a file."""
    return parse_yaml(_read(path), str(path), prefix=prefix)
