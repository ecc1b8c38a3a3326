"""The event schema registers with jupyter_events, every event kind validates, 50 are kept."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
from jupyter_events import EventLogger

from jupyter_gpufrac.contract import EVENT_KINDS
from jupyter_gpufrac.contract import EVENT_SCHEMA_ID as SCHEMA_ID
from jupyter_gpufrac.contract import EVENT_SCHEMA_PATH as SCHEMA_PATH
from jupyter_gpufrac.server.events import KernelEventLog, make_event


def test_schema_and_every_kind_validate() -> None:
    logger = EventLogger()
    logger.register_event_schema(SCHEMA_PATH)
    schema = logger.schemas.get(SCHEMA_ID)
    assert schema.version == "1"
    log = KernelEventLog(logger, logging.getLogger("test"))
    for kind in EVENT_KINDS:
        log.emit(
            "k", kind, f"{kind} happened", reason="why", gpu_index=1, gpu_uuid="GPU-x",
            from_gpu_index=1, to_gpu_index=0, request=1, limit=2, usage=3,
            restored=["a"], lost=["b"],
        )
    # Each emitted event passed the schema (emit validates and would raise otherwise).
    assert [event["event"] for event in log.events("k")] == list(EVENT_KINDS)


def test_unknown_fields_are_left_out_and_unknown_kinds_refused() -> None:
    event = make_event("k", "placed", "m", gpu_index=None, reason=None, usage=5)
    assert set(event) == {"kernel_id", "event", "message", "usage", "time"}
    with pytest.raises(ValueError, match="unknown gpufrac event"):
        make_event("k", "exploded", "m")


def test_keeps_the_last_fifty_per_kernel() -> None:
    log = KernelEventLog(None, logging.getLogger("test"))
    for n in range(60):
        log.emit("k", "bursting", f"event {n}")
    log.emit("other", "placed", "elsewhere")
    kept = log.events("k")
    assert len(kept) == 50 and kept[0]["message"] == "event 10" and kept[-1]["message"] == "event 59"
    assert log.last("k", {"placed"}) is None and log.last("other")["event"] == "placed"  # type: ignore[index]
    log.forget("k")
    assert log.events("k") == []


def test_importing_the_extension_touches_neither_nvml_nor_agent() -> None:
    code = (
        "import sys, jupyter_gpufrac\n"
        "points = jupyter_gpufrac._jupyter_server_extension_points()\n"
        "assert points[0]['app'].__name__ == 'GpuFrac'\n"
        "import jupyter_gpufrac.server.provisioner\n"
        "assert not {'pynvml', 'torch'} & set(sys.modules), sorted({'pynvml', 'torch'} & set(sys.modules))\n"
    )
    env_socket = "/nonexistent/agent.sock"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
        env={"GPUFRAC_AGENT_SOCKET": env_socket, "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr


def test_a_bursting_notice_does_not_hide_what_a_restore_lost() -> None:
    import logging
    from types import SimpleNamespace

    from jupyter_gpufrac.server.account import kernel_state
    from jupyter_gpufrac.server.kernels import KernelGpu
    from jupyter_gpufrac.server.settings import standalone_settings

    lease = {"state": "active", "bursting": True}
    restored = {"event": "restored", "ok": False, "time": 100.0,
                "message": "Stopped; 1 of 2 variables restored; lost: g."}
    bursting = {"event": "bursting", "time": 100.1, "message": "Using 271 MiB"}
    log = logging.getLogger("test")
    kernel = SimpleNamespace(last_activity=None)
    gpu = KernelGpu("k-1", {}, lambda: standalone_settings(log), log)
    state, reason, _ = kernel_state(kernel, gpu, lease, [restored, bursting], now=101.0)
    assert (state, reason) == ("restore-incomplete", restored["message"])
    # Anything else after the restore (a shrink request, a move) is news: shown instead.
    moved = {"event": "migrating", "time": 100.2, "message": "Moving"}
    assert kernel_state(kernel, gpu, lease, [restored, bursting, moved],
                        now=101.0)[0] == "bursting"


def test_a_frozen_kernel_waits_for_what_it_was_frozen_for_said_by_the_server() -> None:
    """Not the agent's shortfall of every GPU (one job named once per GPU, ids and all): the
    freeze's own sentence; without one, the agent's reason with leases by name."""
    import logging
    from types import SimpleNamespace

    from jupyter_gpufrac.server.account import kernel_state
    from jupyter_gpufrac.server.kernels import KernelGpu
    from jupyter_gpufrac.server.settings import standalone_settings

    log = logging.getLogger("test")
    kernel = SimpleNamespace(last_activity=None)
    gpu = KernelGpu("k-1", {}, lambda: standalone_settings(log), log)
    lease = {"state": "pending", "frozen": True, "reason": (
        'frozen in host memory, waiting for a GPU: GPU 0 is held whole by job "t" '
        '(l-0123456789ab), GPU 1 is held whole by job "t" (l-0123456789ab)')}
    frozen = {"event": "frozen", "time": 100.0,
              "message": 'Frozen because job "t" needs GPU 0 whole: it thaws when the job ends.'}
    assert kernel_state(kernel, gpu, lease, [frozen], now=101.0) == (
        "waiting-for-gpu", frozen["message"], None)
    state, reason, _ = kernel_state(kernel, gpu, lease, [], now=101.0)
    assert state == "waiting-for-gpu" and reason is not None and "l-" not in reason
