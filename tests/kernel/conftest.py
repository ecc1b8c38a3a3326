"""Fixtures for the kernel hook tests."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.agent import AgentProcess

with warnings.catch_warnings():
    # torch warns once when numpy is absent; it is optional here.
    warnings.simplefilter("ignore")
    import torch  # noqa: F401


@pytest.fixture(autouse=True)
def staging_limits() -> Iterator[None]:
    """The staging pools' limits as they were: a snapshot budget set in a test is the whole
    process's (one kernel a process), and would follow the tests after it."""
    from jupyter_gpufrac.kernel import stream, tensor_io

    limits = tensor_io.STAGING.limit, stream.PINNED.limit
    yield
    tensor_io.STAGING.limit, stream.PINNED.limit = limits


@pytest.fixture
def ckdir(tmp_path: Path) -> Path:
    """A checkpoint directory path (not created yet: the checkpointer creates it 0700)."""
    return tmp_path / "checkpoints" / "kernel-1"


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[AgentProcess]:
    """A running simulated agent (2x16GiB)."""
    with AgentProcess(tmp_path / "agent", "2x16GiB", ["--log-level", "warning"]) as running:
        yield running
