"""Workload traces: notebook sessions (Adobe, NotebookOS JSON) and jobs (Alibaba GPU v2023 pods CSV)."""

from __future__ import annotations

import csv
import json
import math
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

# One tick of the NotebookOS workload generator is a minute.
TICK_SECONDS = 60.0
GB = 2**30  # the trace's "GB" read as GiB, the unit node specs use


class TraceError(ValueError):
    """A trace that does not parse: names the file, where in it (line or JSON path) and the field."""

    def __init__(self, path: str | Path, where: str, field: str, message: str) -> None:
        self.path, self.where, self.field, self.message = str(path), where, field, message
        super().__init__(f"{path}: {where}: {field}: {message}")


@dataclass(frozen=True)
class Cell:
    """One cell execution: when it starts (s), how long it runs (s), GPUs it uses, GPU memory (bytes),
    and the share of each GPU's compute it keeps busy as traced (its mean utilisation; 1.0 if untold)."""

    start: float
    duration: float
    gpus: int
    vram: int
    compute: float = 1.0


@dataclass(frozen=True)
class Session:
    """A notebook session: its life (s) and its cells, in order."""

    id: str
    start: float
    stop: float
    cells: tuple[Cell, ...]

    @property
    def peak_gpus(self) -> int:
        return max((c.gpus for c in self.cells), default=0)


@dataclass(frozen=True)
class JobSpec:
    """A pod that needs GPUs: ``gpus`` whole GPUs, or a ``fraction`` of one (1.0: whole)."""

    id: str
    arrival: float
    duration: float
    gpus: int
    fraction: float

    @property
    def in_use(self) -> float:
        """GPUs it keeps busy while it runs."""
        return self.gpus * self.fraction


def _number(value: object, path: Path, where: str, field: str, *, integer: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        kind = "a non-negative integer" if integer else "a non-negative number"
        raise TraceError(path, where, field, f"expected {kind}, got {value!r}")
    if integer and value != int(value):
        raise TraceError(path, where, field, f"expected a non-negative integer, got {value!r}")
    return float(value)


def _get(obj: Mapping[str, object], key: str, path: Path, where: str) -> object:
    if key not in obj:
        raise TraceError(path, where, key, "missing")
    return obj[key]


def load_sessions(path: str | Path) -> list[Session]:
    """Sessions from a NotebookOS workload template (``sessions[].trainings[]``, ticks of 60 s)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise TraceError(path, "file", "-", e.strerror or str(e)) from e
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceError(path, f"line {e.lineno} column {e.colno}", "-", f"not JSON: {e.msg}") from e
    if not isinstance(doc, dict):
        raise TraceError(path, "$", "sessions", "expected an object holding a list of sessions")
    raw = _get(doc, "sessions", path, "$")
    if not isinstance(raw, list):
        raise TraceError(path, "$", "sessions", f"expected a list, got {type(raw).__name__}")
    sessions = []
    for i, s in enumerate(raw):
        where = f"$.sessions[{i}]"
        if not isinstance(s, dict):
            raise TraceError(path, where, "-", f"expected an object, got {type(s).__name__}")
        start = _number(_get(s, "start_tick", path, where), path, where, "start_tick")
        stop = _number(_get(s, "stop_tick", path, where), path, where, "stop_tick")
        if stop < start:
            raise TraceError(path, where, "stop_tick", f"{stop:g} is before start_tick {start:g}")
        trainings = s.get("trainings", [])
        if not isinstance(trainings, list):
            raise TraceError(path, where, "trainings", f"expected a list, got {type(trainings).__name__}")
        cells = [_cell(t, path, f"{where}.trainings[{j}]") for j, t in enumerate(trainings)]
        cells.sort(key=lambda c: c.start)
        sid = s.get("id", f"session-{i}")
        sessions.append(Session(str(sid), start * TICK_SECONDS, stop * TICK_SECONDS, tuple(cells)))
    return sessions


def _cell(t: object, path: Path, where: str) -> Cell:
    if not isinstance(t, dict):
        raise TraceError(path, where, "-", f"expected an object, got {type(t).__name__}")
    start = _number(_get(t, "start_tick", path, where), path, where, "start_tick")
    duration = _number(_get(t, "duration_in_ticks", path, where), path, where, "duration_in_ticks")
    gpus = _number(_get(t, "gpus", path, where), path, where, "gpus", integer=True)
    vram = _number(t.get("vram", 0.0), path, where, "vram")
    return Cell(start * TICK_SECONDS, duration * TICK_SECONDS, int(gpus), int(vram * GB),
                _utilisation(t.get("gpu_utilizations"), path, where))


def _utilisation(raw: object, path: Path, where: str) -> float:
    """Mean of the per-GPU ``utilization`` percentages as a share in (0, 1]; 1.0 where absent."""
    if not isinstance(raw, list) or not raw:
        return 1.0
    shares = []
    for k, u in enumerate(raw):
        here = f"{where}.gpu_utilizations[{k}]"
        if not isinstance(u, dict):
            raise TraceError(path, here, "-", f"expected an object, got {type(u).__name__}")
        shares.append(_number(_get(u, "utilization", path, here), path, here, "utilization") / 100)
    # A cell that ran at all used some compute: keep it above zero so it can be slowed.
    return min(1.0, max(0.01, sum(shares) / len(shares)))


_POD_FIELDS = ("name", "num_gpu", "gpu_milli", "scheduled_time", "deletion_time")


@dataclass(frozen=True)
class Pod:
    """A GPU pod of the Alibaba trace that ran: GPUs, share of one GPU, how long it ran (s)."""

    name: str
    gpus: int
    fraction: float
    duration: float


def load_pods(path: str | Path) -> list[Pod]:
    """Pods that asked for GPUs and ran (scheduled and deleted); others are skipped."""
    path = Path(path)
    try:
        handle = path.open(newline="")
    except OSError as e:
        raise TraceError(path, "file", "-", e.strerror or str(e)) from e
    with handle:
        return list(_pods(csv.DictReader(handle), path))


def _pods(reader: csv.DictReader[str], path: Path) -> Iterator[Pod]:
    missing = [f for f in _POD_FIELDS if f not in (reader.fieldnames or ())]
    if missing:
        raise TraceError(path, "line 1", missing[0], "missing column (the header needs "
                         + ", ".join(_POD_FIELDS) + ")")
    for row in reader:
        where = f"line {reader.line_num}"
        gpus = _int_field(row, "num_gpu", path, where)
        if gpus == 0:
            continue
        if not row["scheduled_time"] or not row["deletion_time"]:
            continue  # never ran (Pending): nothing to replay
        milli = _int_field(row, "gpu_milli", path, where)
        if not 0 < milli <= 1000:
            raise TraceError(path, where, "gpu_milli", f"expected 1..1000, got {milli}")
        scheduled = _int_field(row, "scheduled_time", path, where)
        deleted = _int_field(row, "deletion_time", path, where)
        if deleted < scheduled:
            raise TraceError(path, where, "deletion_time", f"{deleted} is before scheduled_time {scheduled}")
        # A share is of one GPU only; multi-GPU pods take whole GPUs.
        fraction = milli / 1000 if gpus == 1 else 1.0
        yield Pod(row["name"] or where, gpus, fraction, float(max(1, deleted - scheduled)))


def _int_field(row: Mapping[str, str | None], field: str, path: Path, where: str) -> int:
    text = (row.get(field) or "").strip()
    try:
        value = int(text)
    except ValueError:
        raise TraceError(path, where, field, f"expected a non-negative integer, got {text!r}") from None
    if value < 0:
        raise TraceError(path, where, field, f"expected a non-negative integer, got {value}")
    return value


def sample_jobs(pods: Sequence[Pod], count: int, start: float, end: float, seed: int) -> list[JobSpec]:
    """``count`` pods drawn without replacement, arriving uniformly over [start, end): the pods'
    own arrival times span months of a far larger cluster, so only their shapes and durations
    are replayed."""
    if count > len(pods):
        raise ValueError(f"--jobs-sample: at most {len(pods)} pods ran in the jobs trace, asked for {count}")
    rng = random.Random(seed)
    chosen = rng.sample(list(pods), count)
    jobs = [
        JobSpec(p.name, rng.uniform(start, end), p.duration, p.gpus, p.fraction) for p in chosen
    ]
    jobs.sort(key=lambda j: (j.arrival, j.id))
    return jobs
