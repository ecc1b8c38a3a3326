"""What every test shares: no system agent of the machine's own, and the slow folders first."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from node_agent import client
from node_agent.cli import command


@pytest.fixture(autouse=True)
def no_system_agent(monkeypatch: pytest.MonkeyPatch,
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Root's system agent (the README's set-up for shared machines) answers at
    /run/gpufrac/agent.sock on some test machines; every default then would name it. The
    tests see a system socket of their own instead, where nothing answers until a test
    puts something there; the path is yielded."""
    path = str(tmp_path_factory.getbasetemp() / "system-agent" / "agent.sock")
    for module in (client, command):
        monkeypatch.setattr(module, "SYSTEM_SOCKET", path)
    yield path


# Folders whose files run for minutes each (real servers, kernels, browsers): `make test`'s
# workers take whole files in collection order, so these go first and the many short files
# even the workers out at the end instead of one long file running alone.
SLOW_FIRST = ("e2e", "browser", "hub")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent

    def rank(item: pytest.Item) -> int:
        parts = item.path.relative_to(here).parts if item.path.is_relative_to(here) else ()
        return SLOW_FIRST.index(parts[0]) if parts and parts[0] in SLOW_FIRST else len(SLOW_FIRST)

    items.sort(key=rank)  # stable: a file's own tests keep their order
