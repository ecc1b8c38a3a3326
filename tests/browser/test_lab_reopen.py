"""A notebook reopened in JupyterLab after its server went away, in real headless Chromium:
resumed by itself (the default), or after the user answers the question (c.GpuFrac.resume =
"ask"). The state was left by another server of the same user, on another node (its own
agent), sharing the notebook and checkpoint folders."""

from __future__ import annotations

import re
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from harness.agent import AgentProcess, wait_for
from harness.jupyter import start_server, stop_server

if TYPE_CHECKING:
    from conftest import Lab
    from playwright.sync_api import Page

pytestmark = pytest.mark.browser

CELL = "print('kept:', kept)"


def _notebook() -> dict[str, Any]:
    return {
        "cells": [{"cell_type": "code", "execution_count": None, "id": "c1", "metadata": {},
                   "outputs": [], "source": CELL}],
        "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python",
                                    "name": "python3"}},
        "nbformat": 4, "nbformat_minor": 5,
    }


def _leave_states(root: Path, names: tuple[str, ...]) -> None:
    """Another node's server runs the notebooks, then is stopped (SIGTERM, as a pod is)."""
    from harness.jupyter import Notebook

    checkpoints = root / "data" / "gpufrac" / "checkpoints"
    with AgentProcess(root.parent / "other-node" / "agent", "1x2GiB") as agent:
        server = start_server(root.parent / "other-node" / "server", agent.socket,
                              f"c.GpuFrac.checkpoint_dir = {str(checkpoints)!r}\n",
                              root=root / "notebooks", env={"GPUFRAC_NODE_NAME": "node-a"})
        try:
            for name in names:
                status, _ = server.api(f"/api/contents/{name}", "PUT",
                                       {"type": "notebook", "content": _notebook()})
                assert status in (200, 201)
                nb: Notebook = server.open_notebook(name)
                nb.ok(f"kept = 'the state of {name}'")
                nb.close()
            server.process.send_signal(signal.SIGTERM)
            server.process.wait(30)
        finally:
            stop_server(server)


def _run_cell(page: Page) -> None:
    cell = page.locator(".jp-Notebook .jp-Cell").first
    cell.locator(".jp-InputArea-editor").click()
    page.keyboard.press("Shift+Enter")


def test_a_notebook_reopened_in_jupyterlab_resumes_by_itself_or_when_asked(
        tmp_path: Path, chromium: dict[str, Any]) -> None:
    from conftest import launch_lab
    from playwright.sync_api import expect, sync_playwright

    root = tmp_path / "lab"
    (root / "notebooks").mkdir(parents=True)
    _leave_states(root, ("auto.ipynb", "asked.ipynb"))
    with sync_playwright() as pw:
        browser = pw.chromium.launch(**chromium)
        try:
            with launch_lab(root) as lab:
                page = browser.new_context(viewport={"width": 1280, "height": 800}).new_page()
                page.goto(f"{lab.url}/lab/workspaces/auto/tree/auto.ipynb?reset&token={lab.token}")
                # From when and where, and what came back, in one notification.
                toast = page.locator(".Toastify__toast").filter(has_text="Resumed from cell [1]")
                expect(toast).to_be_visible(timeout=90_000)
                expect(toast).to_contain_text(re.compile(
                    r"auto\.ipynb: Resumed from cell \[1\] at [\d:]+ on node-a, GPU 0 .*: "
                    r"restored 1 of 1 variables"))
                _run_cell(page)
                output = page.locator(".jp-OutputArea-output").first
                expect(output).to_contain_text("kept: the state of auto.ipynb", timeout=60_000)
                expect(page.locator(".jp-OutputArea").first).to_contain_text(
                    "This notebook was resumed from the last checkpoint of its earlier kernel")
                # One question asked of nobody: the default resumes without one.
                expect(page.locator(".jp-Dialog")).to_have_count(0)

            with launch_lab(root, "c.GpuFrac.resume = 'ask'\n") as lab:
                page = browser.new_context(viewport={"width": 1280, "height": 800}).new_page()
                page.goto(f"{lab.url}/lab/workspaces/ask/tree/asked.ipynb?reset&token={lab.token}")
                dialog = page.locator(".jp-Dialog")
                expect(dialog).to_contain_text("Restore the earlier state of asked.ipynb?",
                                               timeout=90_000)
                expect(dialog).to_contain_text("its Jupyter server on node-a was stopped at")
                expect(dialog).to_contain_text("holds 1 variable")
                dialog.get_by_role("button", name="Restore", exact=True).click()
                kernel_id = _kernel_of(lab, "asked.ipynb")
                wait_for(lambda: any(e["event"] == "restored" for e in _events(lab, kernel_id)),
                         60, "the restore after the answer", interval=0.5)
                _run_cell(page)
                expect(page.locator(".jp-OutputArea-output").first).to_contain_text(
                    "kept: the state of asked.ipynb", timeout=60_000)
        finally:
            browser.close()


def _kernel_of(lab: Lab, path: str) -> str:
    def found() -> str | None:
        _, sessions = lab.api("/api/sessions")
        for session in sessions if isinstance(sessions, list) else []:
            if session.get("path") == path and session.get("kernel"):
                return str(session["kernel"]["id"])
        return None

    return wait_for(found, 30, f"{path}'s kernel", interval=0.5)


def _events(lab: Lab, kernel_id: str) -> list[dict[str, Any]]:
    status, body = lab.api(f"/api/gpufrac/kernels/{kernel_id}")
    return list(body.get("events", [])) if status == 200 and isinstance(body, dict) else []

