"""What is held and used after each event, for the metrics."""

from __future__ import annotations

from node_agent.simulator.core import Core
from node_agent.simulator.metrics import Sample
from node_agent.simulator.records import Lease, SessionRun
from node_agent.simulator.traces import Cell


class Sampling(Core):
    """The engine's samples of what is held and used."""

    def _sample(self) -> Sample:
        held = held_nb = 0
        jobs_running = cells_running = shared = 0.0
        for node in self.nodes:
            occupied: set[str] = set()
            by_notebooks: set[str] = set()
            busy: dict[str, int] = {}
            cells: list[tuple[Lease, Cell]] = []
            for lease in node.leases.values():
                where = lease.physical
                occupied.update(where)
                owner = lease.owner
                if isinstance(owner, SessionRun):
                    by_notebooks.update(where)
                    if owner.cell is not None and owner.cell.gpus > 0 and owner.paused_at is None:
                        cells.append((lease, owner.cell))
                        for u in where:
                            busy[u] = busy.get(u, 0) + 1
                elif owner.started is not None:
                    jobs_running += owner.spec.in_use
                    for u in where:
                        busy[u] = busy.get(u, 0) + 1
            for lease, cell in cells:
                cells_running += cell.gpus
                if any(busy[u] > 1 for u in lease.physical):
                    shared += cell.gpus
            held += len(occupied)
            held_nb += len(by_notebooks)
        # Wall time against work done, weighted by the GPUs each keeps busy: the slowdown.
        wall = work = cell_wall = cell_work = 0.0
        for run in self._busy:
            if run.paused_at is not None:
                continue
            if isinstance(run, SessionRun):
                assert run.cell is not None
                weight = float(run.cell.gpus)
                cell_wall += weight
                cell_work += weight * run.speed
            else:
                weight = run.spec.in_use
            wall += weight
            work += weight * run.speed
        return Sample(held, held_nb, jobs_running + cells_running, cells_running, shared,
                      wall, work, cell_wall, cell_work, self._frozen_kernels, self._frozen_bytes)
