"""What goes wrong is said clearly: bad configuration, bad ``%gpu`` arguments, no agent at all."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.agent import wait_for
from harness.jupyter import running_server

pytestmark = pytest.mark.e2e


def test_bad_configuration_names_the_trait(tmp_path: Path) -> None:
    config = 'c.GpuFrac.default_request = "lots"\n'
    with running_server(tmp_path, str(tmp_path / "none.sock"), config) as server:
        line = wait_for(
            lambda: next((ln for ln in server.log_text().splitlines() if "c.GpuFrac." in ln), None),
            30, "the configuration error in the server log", interval=0.2,
        )
        assert "c.GpuFrac.default_request: expected a share of one GPU" in line, line
        assert "Traceback" not in server.log_text()
        # The server and the extension keep running, and the widget says what is wrong.
        assert server.api("/api/status")[0] == 200
        status, node = server.api("/api/gpufrac/node")
        assert status == 200 and node["config_problems"] == [line.split("jupyter_gpufrac: ")[1]
                                                           .split("; kernels start")[0]]


def test_no_agent_kernels_still_start_and_say_why(tmp_path: Path) -> None:
    socket = str(tmp_path / "nobody" / "agent.sock")
    with running_server(tmp_path, socket, "c.GpuFrac.embedded_agent = False\n") as server:
        node = server.get("/api/gpufrac/node")
        assert node["agent"]["available"] is False and socket in node["agent"]["error"]
        nb = server.open_notebook("plain.ipynb")
        assert nb.ok("print(6 * 7)").strip() == "42"
        status = server.kernel_status(nb.kernel_id)
        assert status["state"] == "no-gpu" and socket in status["reason"]
        assert [e["event"] for e in status["events"]] == ["no_gpu"]
        # Kept for when an agent answers (the server asks again then), and said so.
        reply = nb.run("%gpu request 0.5")
        assert reply.status == "ok" and "kept for new notebooks" in reply.stdout, reply
        assert "no GPU lease yet" in reply.stdout, reply
        shown = nb.ok("%gpu")
        assert "no GPU lease" in shown and socket in shown, shown
        nb.close()
