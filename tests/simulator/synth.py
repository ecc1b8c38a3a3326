"""Small synthetic workloads for the simulator's tests: objects, and the two trace files' formats."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from node_agent.simulator.traces import GB, TICK_SECONDS, Cell, JobSpec, Session


def cell(tick: float, ticks: float = 1, gpus: int = 1, vram_gb: float = 1.0) -> Cell:
    return Cell(tick * TICK_SECONDS, ticks * TICK_SECONDS, gpus, int(vram_gb * GB))


def session(name: str, start: float, stop: float, *cells: Cell) -> Session:
    """A session from tick ``start`` to tick ``stop``."""
    ordered = tuple(sorted(cells, key=lambda c: c.start))
    return Session(name, start * TICK_SECONDS, stop * TICK_SECONDS, ordered)


def job(name: str, tick: float, seconds: float, gpus: int = 1, fraction: float = 1.0) -> JobSpec:
    return JobSpec(name, tick * TICK_SECONDS, seconds, gpus, fraction)


def training(start: int, ticks: int, gpus: int, vram: float) -> dict[str, object]:
    """One entry of ``trainings`` as the NotebookOS generator writes it."""
    return {"start_tick": start, "duration_in_ticks": ticks, "end_tick": start + ticks, "cpus": 1.0,
            "memory": 2.0, "vram": vram, "gpus": gpus, "gpu_utilizations": [{"utilization": 10.0}] * gpus}


def write_notebooks(path: Path, sessions: list[dict[str, object]]) -> Path:
    path.write_text(json.dumps({"workloadTitle": "synthetic", "sessions": sessions}, indent=2))
    return path


def notebook(name: str, start: int, stop: int, *trainings: dict[str, object]) -> dict[str, object]:
    return {"id": name, "start_tick": start, "stop_tick": stop, "num_training_events": len(trainings),
            "trainings": list(trainings)}


POD_HEADER = ["name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli", "gpu_spec", "qos", "pod_phase",
              "creation_time", "deletion_time", "scheduled_time"]


def pod(name: str, gpus: int, milli: int, scheduled: int | str, deleted: int | str) -> list[str]:
    return [name, "4000", "8192", str(gpus), str(milli), "", "LS", "Running", str(scheduled), str(deleted),
            str(scheduled)]


def write_pods(path: Path, rows: list[list[str]], header: list[str] = POD_HEADER) -> Path:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    return path
