"""Every surface tells one story, in real headless Chromium against a real server.

Two notebooks share the Lab: one runs on a GPU of the simulated node, the other
asks for 0.9 of a GPU (its kernelspec says so) while another lease holds 0.8 of
the GPU that the first leaves free, so the agent gives it no lease. The status
item follows the notebook in front: each one's own truth as the user switches
tabs, while a notification's "Details" is opened for the other one, when a
kernel is changed, when a notebook is closed and when its kernel is shut down.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from conftest import Lab
    from playwright.sync_api import Locator, Page


pytestmark = pytest.mark.browser

SCHEMA_ID = "https://jupyter-gpufrac.github.io/events/kernel/v1"
# A kernelspec asking for more than any GPU has left once FILLER holds its share.
TOO_BIG = "too-big"
# JupyterLab's debugger when a kernel is changed under it. A failed request is judged by
# its response (below), not by Chromium's console line, which names no address.
IGNORED_CONSOLE = re.compile(r"Could not restore the debugger state|Failed to load resource")
KERNEL_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
TOO_BIG_REQUEST = "0.9"
FILLER_REQUEST = "0.8"


def _notebook(kernel: str, source: str) -> dict[str, Any]:
    return {
        "cells": [
            {"cell_type": "code", "execution_count": None, "id": "c1", "metadata": {},
             "outputs": [], "source": source},
        ],
        "metadata": {"kernelspec": {"display_name": kernel, "language": "python", "name": kernel}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }


def _kernel_of(lab: Lab, path: str) -> str | None:
    status, sessions = lab.api("/api/sessions")
    assert status == 200 and isinstance(sessions, list), sessions
    for session in sessions:
        if session.get("path") == path and session.get("kernel"):
            return str(session["kernel"]["id"])
    return None


def _emit(lab: Lab, kernel_id: str, event: str, message: str, **fields: object) -> None:
    data = {"kernel_id": kernel_id, "event": event, "message": message, "time": time.time(), **fields}
    status, body = lab.api("/api/events", "POST", {"schema_id": SCHEMA_ID, "version": "1", "data": data})
    assert status == 204, (status, body)


def _watch_errors(page: Page) -> list[str]:
    """What the page reports as going wrong: console errors, uncaught exceptions and every
    request answered 400 or more, with its status and path."""
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(f"uncaught: {e}"))
    page.on("response", lambda r: errors.append(f"HTTP {r.status} {r.url.split('?')[0]}")
            if r.status >= 400 else None)
    return errors


def _unexpected(errors: list[str], lab: Lab) -> list[str]:
    """The errors a user could meet: all but the favicon, the debugger's note, and a 404 for
    a kernel that was shut down meanwhile (JupyterLab and the status item may each ask
    once more about a kernel as it goes)."""
    status, running = lab.api("/api/kernels")
    assert status == 200 and isinstance(running, list)
    alive = {k["id"] for k in running}

    def expected(error: str) -> bool:
        if IGNORED_CONSOLE.search(error) or "favicon" in error:
            return True
        ids = KERNEL_ID.findall(error)
        return error.startswith("HTTP 404 ") and bool(ids) and not alive.intersection(ids)

    return [e for e in errors if not expected(e)]


def _tab(page: Page, path: str) -> Locator:
    return page.locator("#jp-main-dock-panel").get_by_role("tab", name=path, exact=True)


@pytest.fixture
def two_notebooks(lab: Lab) -> Iterator[tuple[str, str]]:
    """gpu.ipynb (the default kernel, which gets a GPU) and nogpu.ipynb (a
    kernelspec asking for 0.9 of a GPU: no GPU has room once a lease of another
    client holds 0.8 of one); their kernels and that lease end after."""
    from node_agent.client import AgentClient

    agent = AgentClient(lab.env["GPUFRAC_AGENT_SOCKET"])
    filler = agent.create_lease(client="browser-test", request=FILLER_REQUEST, kind="notebook")
    # Held by a process, as a kernel holds its lease: one without any is an orphan, released
    # after the agent's orphan grace (60 s), which a slow machine's test may outlast.
    holder = subprocess.Popen(["sleep", "600"])
    agent.register_pid(str(filler["id"]), holder.pid)
    spec = lab.root / "data" / "kernels" / TOO_BIG
    spec.mkdir(parents=True, exist_ok=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (0.9 GPU)",
        "language": "python",
        "metadata": {"gpufrac": {"request": TOO_BIG_REQUEST}},
    }))
    paths = ("gpu.ipynb", "nogpu.ipynb")
    for path, kernel in zip(paths, ("python3", TOO_BIG), strict=True):
        status, _ = lab.api(f"/api/contents/{path}", "PUT",
                            {"type": "notebook", "content": _notebook(kernel, "x = 1")})
        assert status in (200, 201)
    yield paths
    status, sessions = lab.api("/api/sessions")
    for session in sessions if isinstance(sessions, list) else []:
        if session.get("path") in paths:
            lab.api(f"/api/sessions/{session['id']}", "DELETE")
    for path in paths:
        lab.api(f"/api/contents/{path}", "DELETE")
    agent.release(str(filler["id"]))
    holder.kill()
    holder.wait()


def test_status_item_follows_the_notebook_in_front(
    lab: Lab, chromium: dict[str, Any], two_notebooks: tuple[str, str], screenshots: Path
) -> None:
    from playwright.sync_api import expect, sync_playwright

    with_gpu, without = two_notebooks
    with sync_playwright() as pw:
        browser = pw.chromium.launch(**chromium)
        try:
            page = browser.new_context(viewport={"width": 1280, "height": 800}).new_page()
            console_errors = _watch_errors(page)
            page.goto(f"{lab.url}/lab/workspaces/follow/tree/{with_gpu}?reset&token={lab.token}")
            item = page.locator(".jp-gpufrac-StatusItem")
            expect(item).to_have_attribute("data-gpu-index", re.compile(r"^\d$"), timeout=90_000)
            expect(item).to_have_text(re.compile(r"^GPU \d: "))
            gpu_index = item.get_attribute("data-gpu-index")
            gpu_kernel = lab.wait_for("gpu.ipynb's kernel", lambda: _kernel_of(lab, with_gpu), 30)

            # The second notebook: its kernel gets no lease, and the item says so
            # (never the first notebook's GPU).
            page.evaluate(f"window.jupyterapp.commands.execute('docmanager:open', {{path: '{without}'}})")
            expect(_tab(page, without)).to_have_class(re.compile("lm-mod-current"), timeout=20_000)
            expect(item).to_have_attribute("data-state", "no-gpu", timeout=90_000)
            expect(item).to_have_text("no GPU")
            expect(item).to_have_attribute("data-gpu-index", "")
            expect(item).to_have_attribute("title", re.compile("no GPU", re.I))
            page.locator("#jp-main-statusbar").screenshot(
                path=str(screenshots / "statusbar-no-gpu-light.png")
            )
            nogpu_kernel = _kernel_of(lab, without)
            assert nogpu_kernel and nogpu_kernel != gpu_kernel
            status, body = lab.api(f"/api/gpufrac/kernels/{nogpu_kernel}")
            assert status == 200 and isinstance(body, dict) and body["state"] == "no-gpu", body

            # Back and forth: each tab shows its own kernel's truth at once.
            for _ in range(2):
                _tab(page, with_gpu).click()
                expect(item).to_have_attribute("data-gpu-index", str(gpu_index), timeout=10_000)
                expect(item).to_have_text(re.compile(rf"^GPU {gpu_index}: "))
                _tab(page, without).click()
                expect(item).to_have_attribute("data-state", "no-gpu", timeout=10_000)
                expect(item).to_have_text("no GPU")

            # A notification about the other notebook: its "Details" shows that
            # notebook, and the item in front follows it -- never the item of one
            # notebook on the tab of the other.
            _emit(lab, str(gpu_kernel), "shrink_requested",
                  "Asked to shrink to its request: GPU 0's owner needs its memory back.",
                  notebook=with_gpu)
            toast = page.locator(".Toastify__toast").filter(has_text="Asked to shrink")
            expect(toast).to_be_visible(timeout=20_000)
            toast.get_by_role("button", name="Details").click()
            panel = page.locator("#jp-gpufrac-panel")
            expect(panel).to_be_visible(timeout=10_000)
            expect(panel.locator("h2")).to_contain_text(with_gpu)
            _tab(page, without).click()
            expect(item).to_have_attribute("data-state", "no-gpu", timeout=10_000)
            expect(panel.locator("h2")).to_contain_text(without, timeout=10_000)
            expect(panel.locator(".jp-gpufrac-State")).to_have_text("no GPU")

            # The kernel changes under the tab: the item follows the new one.
            page.evaluate(
                "window.jupyterapp.shell.currentWidget.sessionContext.changeKernel({name: 'python3'})"
            )
            expect(item).to_have_attribute("data-gpu-index", re.compile(r"^\d$"), timeout=90_000)
            expect(item).to_have_text(re.compile(r"^GPU \d: "))
            expect(item).not_to_have_attribute("data-state", "no-gpu")

            # Closing the notebook in front: the item shows the one now in front.
            page.evaluate(
                "async () => { const w = window.jupyterapp.shell.currentWidget;"
                " await w.context.save(); w.close(); }"
            )
            expect(_tab(page, without)).to_have_count(0, timeout=10_000)
            _tab(page, with_gpu).click()
            expect(item).to_have_attribute("data-gpu-index", str(gpu_index), timeout=10_000)
            expect(item).to_have_text(re.compile(rf"^GPU {gpu_index}: "))

            # Its kernel shut down, the notebook still open: nothing is left in
            # the status bar ("GPU: …", "GPU · parked").
            page.evaluate("window.jupyterapp.shell.currentWidget.sessionContext.shutdown()")
            expect(item).to_be_hidden(timeout=20_000)
        finally:
            browser.close()
    assert not _unexpected(console_errors, lab), console_errors


def _boxes_overlap(a: dict[str, float] | None, b: dict[str, float] | None) -> bool:
    assert a is not None and b is not None
    return not (a["x"] + a["width"] <= b["x"] or b["x"] + b["width"] <= a["x"]
                or a["y"] + a["height"] <= b["y"] or b["y"] + b["height"] <= a["y"])


def test_panel_and_node_table_agree_through_park_and_unpark(
    lab: Lab, chromium: dict[str, Any], screenshots: Path
) -> None:
    """"This kernel", the node's table and the status item say the same at each
    step: parked (listed under "No GPU", not running with its old usage, not
    gone), then back on a GPU; and a notification never covers the panel."""
    from playwright.sync_api import expect, sync_playwright

    path = "park.ipynb"
    status, _ = lab.api(f"/api/contents/{path}", "PUT",
                        {"type": "notebook", "content": _notebook("python3", "kept = 41")})
    assert status in (200, 201)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(**chromium)
        try:
            page = browser.new_context(viewport={"width": 1280, "height": 800}).new_page()
            console_errors = _watch_errors(page)
            # A workspace of its own: no notebook of another test is restored beside it.
            page.goto(f"{lab.url}/lab/workspaces/park/tree/{path}?reset&token={lab.token}")
            item = page.locator(".jp-gpufrac-StatusItem")
            expect(item).to_have_attribute("data-gpu-index", re.compile(r"^\d$"), timeout=90_000)
            gpu_index = item.get_attribute("data-gpu-index")
            notebook = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook")
            notebook.locator(".jp-Cell").first.click()
            page.keyboard.press("Shift+Enter")
            expect(notebook.locator(".jp-InputPrompt").first).to_contain_text("[1]", timeout=60_000)

            page.evaluate("window.jupyterapp.commands.execute('gpufrac:open-panel')")
            panel = page.locator("#jp-gpufrac-panel")
            expect(panel).to_be_visible(timeout=10_000)
            state = panel.locator(".jp-gpufrac-State")
            mine = panel.locator(".jp-gpufrac-Panel-gpus li[data-current=true]")
            expect(state).to_have_text("guaranteed", timeout=30_000)
            expect(mine).to_have_count(1)
            expect(panel.locator(f"tr[data-gpu-index='{gpu_index}'] li[data-current=true]")).to_contain_text(
                "(this kernel)"
            )

            # Parked: every surface says so as the event arrives, and the table
            # lists the kernel under "No GPU" (not running with its old usage,
            # not gone).
            notebook.locator(".jp-Cell").nth(1).click()
            page.keyboard.type("%gpu park")
            page.keyboard.press("Shift+Enter")
            expect(state).to_have_text(re.compile(r"^parked"), timeout=60_000)
            # Rendered together from one account: no waiting between the two.
            expect(mine).to_have_count(1, timeout=1)
            expect(mine).to_have_attribute("data-state", "parked", timeout=1)
            expect(panel.locator("tr[data-gpu=none] li[data-current=true]")).to_have_count(1, timeout=1)
            expect(mine).not_to_contain_text("MiB of")
            # The GPU it was frozen on, and thaws onto.
            expect(item).to_have_text(re.compile(r"^GPU \d · parked, frozen$"))
            expect(item).to_have_attribute("data-gpu-index", "")
            panel.screenshot(path=str(screenshots / "panel-parked-light.png"))

            # Back on a GPU with the next cell: its GPU is shown everywhere again.
            page.keyboard.type("print(kept + 1)")
            page.keyboard.press("Shift+Enter")
            expect(notebook.locator(".jp-OutputArea-output").last).to_contain_text(
                "42", timeout=60_000
            )
            expect(state).not_to_have_text(re.compile(r"parked|waiting"), timeout=30_000)
            expect(item).to_have_attribute("data-gpu-index", re.compile(r"^\d$"), timeout=10_000)
            back_on = item.get_attribute("data-gpu-index")
            expect(panel.locator(".jp-gpufrac-Panel-facts")).to_contain_text(f"GPU {back_on}")
            expect(panel.locator(f"tr[data-gpu-index='{back_on}'] li[data-current=true]")).to_have_count(1)
            expect(panel.locator("tr[data-gpu=none]")).to_have_count(0)

            # A notification while the panel is open does not cover it.
            kernel_id = _kernel_of(lab, path)
            assert kernel_id
            _emit(lab, kernel_id, "shrink_requested",
                  "Asked to shrink to its request: GPU 0's owner needs its memory back.",
                  notebook=path)
            toast = page.locator(".Toastify__toast").filter(has_text="Asked to shrink")
            expect(toast).to_be_visible(timeout=20_000)
            expect(toast).to_be_in_viewport(ratio=1)
            assert not _boxes_overlap(toast.bounding_box(), panel.bounding_box())
        finally:
            browser.close()
            kernel_id = _kernel_of(lab, path)
            if kernel_id:
                lab.api(f"/api/kernels/{kernel_id}", "DELETE")
            lab.api(f"/api/contents/{path}", "DELETE")
    assert not _unexpected(console_errors, lab), console_errors
