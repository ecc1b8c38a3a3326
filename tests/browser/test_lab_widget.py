"""The labextension in real headless Chromium, against a real server.

One JupyterLab, one notebook, one story: the notebook's kernel is spread to
GPU 1 of the simulated node, and the status item says so in numbers ("GPU 1:
0.3/4.0 GiB"), narrow enough (measured) to leave the status bar's right end on
screen at 1024 px beside jupyter-resource-usage, and switches to the full line
("GPU 1 (16GiB): 0.3/4.0/16.0 GiB · guaranteed") and back when its setting
changes through the settings registry; a whole-GPU job (`gpufrac-agent
run --gpus 1`) makes the agent move it back to GPU 0 while a cell still runs:
the status item counts down ("GPU 1 · moving in 23 s") and never says
"migrating" before the move starts; once the cell ends the kernel moves; the
status item and a notification say so, and what was kept; the details panel
(opened from the keyboard) shows the node and the history; the notebook still
has its variables. Then shrink and OOM-kill events, sent through the event
contract, must give notifications that say why and what was lost, with no
success mark unless the restore was verified, and never cut mid-word without a
"Details" action that opens the whole text. Last, the GPU agent stops
answering (SIGSTOP): widget and panel say "agent unreachable" with the reason
within seconds, never "guaranteed" nor a current-looking figure ("GPU 0: ?"),
and recover when it answers again. No errors may reach the browser console.

Screenshots of the item and the panel in the light and dark themes go to a temp
dir, or to docs/screenshots with GPUFRAC_UPDATE_SCREENSHOTS=1.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from conftest import Lab
    from playwright.sync_api import Locator, Page


pytestmark = pytest.mark.browser

NOTEBOOK = {
    "cells": [
        {
            "cell_type": "code",
            "execution_count": None,
            "id": "c1",
            "metadata": {},
            "outputs": [],
            "source": "weights = list(range(1000))\nlr = 0.01",
        },
        {
            "cell_type": "code",
            "execution_count": None,
            "id": "c2",
            "metadata": {},
            "outputs": [],
            # Still running when the move is asked for; the test lets it end.
            "source": (
                "import os, time\n"
                "t_end = time.time() + 120\n"
                "while not os.path.exists('release-cell') and time.time() < t_end:\n"
                "    time.sleep(0.2)"
            ),
        },
    ],
    "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}},
    "nbformat": 4,
    "nbformat_minor": 5,
}

SCHEMA_ID = "https://jupyter-gpufrac.github.io/events/kernel/v1"

# Chromium reports these for reasons outside the extension; nothing else may
# reach the console as an error.
IGNORED_CONSOLE = (re.compile(r"favicon"),)

# The status item beside JupyterLab's own (issue #13): its plain line, and any
# line with a state word, at most this wide (px) at JupyterLab's default font.
PLAIN_WIDTH_MAX = 160
WORDED_WIDTH_MAX = 230
# "GPU 1: 2.1/4.0 GiB": usage against request ("<0.1" when small), nothing else.
FIGURES = r"(<)?\d+(\.\d)?/\d+(\.\d)? (GiB|MiB)"
PLAIN_LINE = re.compile(rf"^GPU \d+: {FIGURES}$")
# The `statusItem: "full"` setting: usage/request/limit.
FIGURES_FULL = r"(<)?\d+(\.\d)?/\d+(\.\d)?/\d+(\.\d)? (GiB|MiB)"
# jupyter-resource-usage's item (align left, rank 2), as it reads with a few
# hundred MB used; the narrow-window check puts a copy of it in the status bar.
RESOURCE_USAGE_TEXT = "Mem: 200.52 MB"


def _kernel_gpu(lab: Lab, kernel_id: str) -> int | None:
    status, body = lab.api(f"/api/gpufrac/kernels/{kernel_id}")
    if status != 200 or not isinstance(body, dict) or not body.get("gpu"):
        return None
    return int(body["gpu"]["index"])


def _notebook_kernel(lab: Lab, path: str) -> str:
    status, sessions = lab.api("/api/sessions")
    assert status == 200 and isinstance(sessions, list), sessions
    for session in sessions:
        if session.get("path") == path and session.get("kernel"):
            return str(session["kernel"]["id"])
    raise AssertionError(f"no session for {path}: {sessions}")


def _emit(lab: Lab, kernel_id: str, event: str, message: str, **fields: object) -> None:
    data = {"kernel_id": kernel_id, "event": event, "message": message, "time": time.time(), **fields}
    status, body = lab.api("/api/events", "POST", {"schema_id": SCHEMA_ID, "version": "1", "data": data})
    assert status == 204, (status, body)


def _embedded_agent_pid(lab: Lab) -> int:
    """The server's embedded agent: `node_agent serve` with a socket in the Lab's temp dir."""
    import psutil

    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "serve" in cmdline and any(str(lab.root) in a for a in cmdline):
            return int(proc.info["pid"])
    raise AssertionError("no embedded agent process found")


def _toast_text(toast: Locator) -> str:
    return toast.locator(".jp-toast-message").inner_text().replace("\n", " ").strip()


def test_widget_follows_kernel_through_migration(
    lab: Lab, chromium: dict[str, Any], screenshots: Path, tmp_path: Path
) -> None:
    from playwright.sync_api import expect, sync_playwright

    status, node = lab.api("/api/gpufrac/node")
    assert status == 200, f"GET /api/gpufrac/node: {status} {node}\n{lab.log_tail()}"
    assert isinstance(node, dict) and len(node["gpus"]) == 2, node

    # A kernel started first takes GPU 0 (both idle: the lowest index). The
    # notebook's kernel then shares GPU 0 in the logical (bin-packed) plan but is
    # spread to idle GPU 1 -- exactly the one a whole-GPU job will claim.
    status, other = lab.api("/api/kernels", "POST", {"name": "python3"})
    assert status == 201, (status, other)
    assert isinstance(other, dict)
    lab.wait_for("the first kernel's GPU", lambda: _kernel_gpu(lab, other["id"]) is not None, 60)

    status, _ = lab.api("/api/contents/demo.ipynb", "PUT", {"type": "notebook", "content": NOTEBOOK})
    assert status in (200, 201)

    console_errors: list[str] = []
    job: subprocess.Popen[bytes] | None = None
    with sync_playwright() as pw:
        browser = pw.chromium.launch(**chromium)
        try:
            context = browser.new_context(viewport={"width": 1440, "height": 900})
            page = context.new_page()
            page.on(
                "console",
                lambda m: (
                    console_errors.append(f"{m.text} @ {m.location}")
                    if m.type == "error" and not any(p.search(m.text) for p in IGNORED_CONSOLE)
                    else None
                ),
            )
            page.on("pageerror", lambda e: console_errors.append(f"uncaught: {e}"))
            page.goto(f"{lab.url}/lab/tree/demo.ipynb?token={lab.token}")

            # The status item shows the notebook kernel's GPU.
            item = page.locator(".jp-gpufrac-StatusItem")
            expect(item).to_have_attribute("data-gpu-index", "1", timeout=90_000)
            # Numbers at a glance; the device, the limit and the state in the tooltip.
            expect(item).to_have_attribute("data-state", "guaranteed", timeout=30_000)
            expect(item).to_have_text(PLAIN_LINE)
            expect(item).to_have_text(re.compile(r"^GPU 1: "))
            expect(item).to_have_attribute(
                "title", re.compile(r"^GPU 1 · .*simulated\n.* guaranteed, .* limit\.\n")
            )
            expect(item).to_have_attribute("role", "button")
            expect(item).to_have_attribute("aria-label", re.compile(r"GPU lease: GPU 1"))
            widths = {"guaranteed": _item_width(item, PLAIN_WIDTH_MAX)}
            _assert_bell_on_screen_at_1024(page)
            _switch_status_item_through_settings(lab, page, item)

            # Some state worth restoring.
            page.locator(".jp-Notebook .jp-Cell").first.click()
            page.keyboard.press("Shift+Enter")
            expect(page.locator(".jp-Notebook .jp-InputPrompt").first).to_contain_text("[1]", timeout=60_000)
            _shoot_item(page, item, screenshots / "widget-before-move-light.png")
            # A cell that runs until the test lets it end (at most 120 s).
            page.keyboard.press("Shift+Enter")
            expect(page.locator(".jp-Notebook .jp-InputPrompt").nth(1)).to_contain_text("[*]", timeout=20_000)

            # A job that needs a whole GPU: GPU 1 must be emptied.
            job = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "node_agent",
                    "run",
                    "--gpus",
                    "1",
                    "--timeout",
                    "120",
                    "--",
                    "sleep",
                    "300",
                ],
                env=lab.env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )

            # [server] The move waits for the running cell: a countdown on GPU 1,
            # never "migrating" before anything moved.
            state_word = item.locator(".jp-gpufrac-StatusItem-state")
            expect(item).to_have_attribute("data-state", "move-pending", timeout=60_000)
            expect(state_word).to_have_text(re.compile(r"^moving in \d+ s$"))
            expect(item).to_have_text(re.compile(r"^GPU 1 · moving in \d+ s$"))
            expect(item).to_have_attribute("title", re.compile(r"Moving in \d+ s — cell still running"))
            expect(item).to_have_attribute("data-gpu-index", "1")
            expect(item).not_to_contain_text("migrating")
            widths["move-pending"] = _item_width(item, WORDED_WIDTH_MAX)
            first_left = int(state_word.get_attribute("data-seconds-left") or "0")
            page.wait_for_timeout(2200)
            expect(item).to_have_attribute("data-state", "move-pending")
            later_left = int(state_word.get_attribute("data-seconds-left") or "0")
            assert 0 < later_left < first_left, (first_left, later_left)
            pending_move = page.locator(".Toastify__toast").filter(has_text="demo.ipynb").first
            expect(pending_move).to_be_visible(timeout=10_000)
            expect(pending_move).not_to_have_class(re.compile("Toastify__toast--success"))
            _shoot_item(page, item, screenshots / "widget-move-pending-light.png")
            # The cell ends within its grace period: the move goes on, nothing is cut off.
            (lab.notebooks / "release-cell").write_text("")

            # The item follows the kernel to GPU 0 ...
            expect(item).to_have_attribute("data-gpu-index", "0", timeout=120_000)
            expect(item).to_contain_text("GPU 0")
            # ... and a notification says what happened, why, and what was kept.
            toast = page.locator(".Toastify__toast").filter(has_text="GPU 0").first
            expect(toast).to_be_visible(timeout=30_000)
            expect(toast).to_contain_text("GPU 1")
            expect(toast).to_contain_text(re.compile(r"\bjob\b"))
            expect(toast).to_contain_text(re.compile(r"\d+ of \d+ variables restored"), timeout=60_000)
            expect(item).to_have_attribute("data-state", "restored", timeout=30_000)
            expect(item).to_have_text(re.compile(rf"^GPU 0: {FIGURES} · restored$"))
            widths["restored"] = _item_width(item, WORDED_WIDTH_MAX)
            # Verified by the kernel: the one success mark there is.
            expect(toast).to_have_class(re.compile("Toastify__toast--success"), timeout=30_000)
            expect(toast).to_contain_text("demo.ipynb")
            # JupyterLab's own kernel status comes back too (not stuck on "Starting").
            expect(page.locator("#jp-main-statusbar")).to_contain_text("Idle", timeout=20_000)
            _shoot_item(page, item, screenshots / "widget-light.png")

            # Keyboard: focus the item, Enter opens the panel.
            item.focus()
            page.keyboard.press("Enter")
            panel = page.locator("#jp-gpufrac-panel")
            expect(panel).to_be_visible(timeout=10_000)
            expect(panel.locator("tr[data-gpu-index]")).to_have_count(2, timeout=20_000)
            # The table puts this kernel where "This kernel" does; the job holds
            # all of GPU 1, one figure ("16.0 GiB", not a range from it to itself).
            expect(panel.locator("tr[data-gpu-index='0'] li[data-current=true]")).to_have_count(1)
            expect(panel.locator("tr[data-gpu-index='1'] li")).to_have_text(
                re.compile(r"^job sleep 300: \S+ \S+ of 16\.0 GiB, guaranteed$")
            )
            history = panel.locator(".jp-gpufrac-Panel-history")
            # One entry for the move: how it ended, its steps (countdown, move,
            # restart, restore) folded beneath.
            move = history.locator(":scope > li").first
            expect(move).to_have_attribute("data-event", "restored")
            expect(move).to_contain_text("GPU 1")
            expect(move.locator("details li")).to_have_count(4)
            expect(move.locator("details li[data-event=migrated]")).to_contain_text("GPU 1")
            expect(history).to_contain_text(re.compile(r"restored \d+ of \d+ variables"))
            expect(panel.locator(".jp-gpufrac-State")).to_have_text("restored")
            expect(panel.locator(".jp-gpufrac-Panel-restore")).to_have_attribute("data-ok", "true")
            expect(panel.locator("h2")).to_contain_text("demo.ipynb")
            # Where the share came from (the server's share_source), e.g. "(c.GpuFrac)".
            expect(panel.locator(".jp-gpufrac-Panel-asked")).to_have_text(
                re.compile(r"^request \S+ \(.+\), limit ")
            )
            # The panel re-renders by diffing (VirtualDOM.render): the button that
            # was clicked is the same element afterwards and keeps the focus.
            refresh = panel.get_by_role("button", name="Refresh GPU information")
            refresh.click()
            page.wait_for_timeout(1500)
            expect(refresh).to_be_focused()
            page.screenshot(path=str(screenshots / "lab-light.png"))
            # The panel alone, without the toast over it.
            for close in page.locator(".Toastify__toast").get_by_title("Hide notification").all():
                close.click()
            expect(page.locator(".Toastify__toast")).to_have_count(0, timeout=10_000)
            panel.screenshot(path=str(screenshots / "panel-light.png"))

            # Same views in the dark theme; the extension only uses --jp-* variables.
            page.evaluate(
                "window.jupyterapp.commands.execute('apputils:change-theme', {theme: 'JupyterLab Dark'})"
            )
            expect(page.locator("body")).to_have_attribute(
                "data-jp-theme-name", "JupyterLab Dark", timeout=20_000
            )
            page.wait_for_timeout(500)  # let the theme's stylesheet settle
            panel.screenshot(path=str(screenshots / "panel-dark.png"))
            page.screenshot(path=str(screenshots / "lab-dark.png"))
            page.locator(".jp-Notebook").first.click()  # the notebook again, as users see it
            # The notebook page stayed connected and its variables came back.
            page.locator(".jp-Notebook .jp-Cell").nth(2).click()
            page.keyboard.type("print(len(weights), lr)")
            page.keyboard.press("Shift+Enter")
            expect(page.locator(".jp-Notebook .jp-OutputArea-output").first).to_contain_text(
                "1000 0.01", timeout=60_000
            )
            _shoot_item(page, item, screenshots / "widget-dark.png")
            # Space works like Enter, and the panel takes the keyboard focus.
            item.focus()
            page.keyboard.press(" ")
            expect(panel).to_be_focused(timeout=10_000)

            # Reclaim, told through the documented event contract (POST
            # /api/events reaches the same stream the server emits on): the
            # user hears why, and after an OOM kill what was kept and lost.
            kernel_id = _notebook_kernel(lab, "demo.ipynb")
            _emit(
                lab,
                kernel_id,
                "shrink_requested",
                "Asked to shrink to its 4.0 GiB request: GPU 0's owner needs its memory back.",
            )
            shrink = page.locator(".Toastify__toast").filter(has_text="Asked to shrink")
            expect(shrink).to_be_visible(timeout=20_000)
            _emit(
                lab,
                kernel_id,
                "oom_killed",
                "Killed to give 6.0 GiB back to GPU 0's owner; restoring its last checkpoint.",
            )
            killed = page.locator(".Toastify__toast").filter(has_text="Killed to give")
            expect(killed).to_be_visible(timeout=20_000)
            # The restore updates this same notification (its text changes).
            killed = page.locator(f"[id='{killed.get_attribute('id')}']")
            _emit(
                lab,
                kernel_id,
                "restored",
                "Restored after the kill: 2 of 3 variables restored; lost: batches (a generator).",
                restored=["weights", "lr"],
                lost=["batches"],
            )
            expect(killed).to_contain_text("lost: batches", timeout=20_000)
            # Something was lost: no success mark, and it stays until read; it
            # names the notebook and says what to do.
            expect(killed).not_to_have_class(re.compile("Toastify__toast--success"))
            expect(killed).to_have_class(re.compile("Toastify__toast--warning"))
            # What happened, in plain words (no "losses").
            expect(killed).to_contain_text("demo.ipynb: 2 of 3 variables restored; lost: batches")
            expect(killed).not_to_contain_text("loss")
            expect(killed).to_contain_text("Re-run the cells that create it")

            # A move while a cell runs: a countdown first, then what was cut off, by cell.
            # The server's sentence is longer than a notification holds: the
            # notification says it in its own words, the countdown first.
            long_message = (
                "To move from GPU 0 to GPU 1 (a job needs the whole GPU) once the running cell "
                "ends. If it has not ended by 13:12:24, it is cut off, and the kernel restarts "
                "from the state after the last completed cell."
            )
            _emit(
                lab,
                kernel_id,
                "move_pending",
                long_message,
                deadline=time.time() + 30,
                notebook="demo.ipynb",
                to_gpu_index=1,
                reason="a job needs the whole GPU",
            )
            pending = page.locator(".Toastify__toast").filter(has_text="Moving to GPU 1 in")
            expect(pending).to_be_visible(timeout=20_000)
            expect(pending).to_contain_text(
                re.compile(r"^demo\.ipynb: Moving to GPU 1 in \d+ s, sooner if the running cell "
                           r"ends: a job needs the whole GPU\.")
            )
            pending = page.locator(f"[id='{pending.get_attribute('id')}']")
            # It counts down: the figure shown now is replaced by a smaller one.
            counted = re.search(r"in (\d+) s", _toast_text(pending))
            assert counted, _toast_text(pending)
            shown = int(counted.group(1))
            expect(pending).to_contain_text(re.compile(rf"in ({'|'.join(map(str, range(shown)))}) s"),
                                            timeout=5_000)
            _emit(
                lab,
                kernel_id,
                "restored",
                "Moved from GPU 0 to GPU 1; 2 of 2 variables restored; cell [4] train() was cut "
                "off: re-run it.",
                restored=["weights", "lr"],
                lost=[],
                ok=False,
                interrupted_cell="[4] train()",
                notebook="demo.ipynb",
            )
            expect(pending).to_contain_text("2 of 2 variables restored", timeout=20_000)
            expect(pending).to_contain_text("cell [4] train() was cut off. Re-run it.")
            expect(pending).to_contain_text("demo.ipynb")
            expect(pending).not_to_have_class(re.compile("Toastify__toast--success"))
            # "Details" (it closes the toast) opens the panel, which has the whole sentences.
            pending.get_by_role("button", name="Details").click()
            expect(panel).to_be_visible(timeout=10_000)
            expect(history).to_contain_text(long_message, timeout=10_000)
            expect(history.locator("[data-event=restored][data-ok=false]").first).to_contain_text(
                "cell [4] train() was cut off"
            )
            # ok missing is no success either.
            _emit(
                lab,
                kernel_id,
                "restored",
                "Restored: 2 of 2 variables restored.",
                restored=["weights", "lr"],
                lost=[],
            )
            unverified = page.locator(".Toastify__toast").filter(has_text="not verified")
            expect(unverified).to_be_visible(timeout=20_000)
            expect(unverified).not_to_have_class(re.compile("Toastify__toast--success"))
            page.wait_for_timeout(1000)  # toasts slide in
            page.screenshot(path=str(screenshots / "notifications-dark.png"))
            for close in page.locator(".Toastify__toast").get_by_title("Hide notification").all():
                close.click()
            # Text from the server only ever becomes text: markup in a message is shown, not parsed.
            markup = '<img src="x" class="gpufrac-injected" onerror="window.gpufracInjected = 1">'
            _emit(lab, kernel_id, "placed", f"Placed on GPU 0. {markup}")
            expect(history).to_contain_text(markup, timeout=20_000)
            expect(page.locator("img.gpufrac-injected")).to_have_count(0)
            assert page.evaluate("window.gpufracInjected") is None

            # [server] The agent stops answering: within seconds no view says
            # "guaranteed"; the reason is shown; it comes back when the agent does.
            agent_pid = _embedded_agent_pid(lab)
            expect(item).not_to_have_attribute("data-state", "agent-unreachable")
            os.kill(agent_pid, signal.SIGSTOP)
            stopped_at = time.monotonic()
            try:
                # The server notices within agent_check_interval + 2 s; the view within 5 s of that.
                expect(item).to_have_attribute("data-state", "agent-unreachable", timeout=8_000)
                noticed_s = time.monotonic() - stopped_at
                expect(item.locator(".jp-gpufrac-StatusItem-state")).to_have_text("agent unreachable")
                # No figure that could pass for a current one; the last seen in the tooltip.
                expect(item).to_have_text("GPU 0: ? · agent unreachable")
                expect(item).not_to_have_attribute("aria-label", re.compile("guaranteed"))
                expect(item).to_have_attribute("title", re.compile("cannot be verified"))
                last_seen = re.compile(r"^Last seen: .*; the agent does not answer, so they may "
                                       r"have changed\.$", re.M)
                expect(item).to_have_attribute("title", last_seen)
                widths["agent-unreachable"] = _item_width(item, WORDED_WIDTH_MAX)
                _assert_bell_on_screen_at_1024(page)
                expect(panel.locator(".jp-gpufrac-State")).to_have_text("agent unreachable")
                expect(panel.locator(".jp-gpufrac-Panel-reason")).to_contain_text("cannot be verified")
                expect(panel.locator(".jp-gpufrac-Panel-usage")).not_to_contain_text("guaranteed")
                expect(panel.locator(".jp-gpufrac-Panel-agent")).to_be_visible(timeout=15_000)
                lost_agent = (
                    page.locator(".Toastify__toast").filter(has_text="demo.ipynb").filter(has_text="agent")
                )
                expect(lost_agent).to_be_visible(timeout=10_000)
                expect(lost_agent).not_to_have_class(re.compile("Toastify__toast--success"))
                _shoot_item(page, item, screenshots / "widget-agent-unreachable-dark.png")
                print(f"agent loss shown {noticed_s:.1f} s after SIGSTOP")
            finally:
                os.kill(agent_pid, signal.SIGCONT)
            expect(item).not_to_have_attribute("data-state", "agent-unreachable", timeout=30_000)
            expect(panel.locator(".jp-gpufrac-Panel-agent")).to_have_count(0, timeout=30_000)
            expect(item).not_to_contain_text("?")
            print("status item width (px): " + ", ".join(f"{k} {v:.0f}" for k, v in widths.items()))
        except Exception as err:
            # What CI needs to tell a frontend bug from a server one.
            with contextlib.suppress(Exception):
                page.screenshot(path=str(tmp_path / "failure.png"))
            raise AssertionError(
                f"{err}\n--- browser console errors ---\n"
                + "\n".join(console_errors)
                + f"\n--- screenshot: {tmp_path / 'failure.png'}\n--- lab log ---\n{lab.log_tail()}"
            ) from err
        finally:
            browser.close()
            if job is not None:
                # The job's whole session: the CLI and the command it runs.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(job.pid, signal.SIGTERM)
                try:
                    job.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(job.pid, signal.SIGKILL)
                    job.wait()

    assert not console_errors, "errors in the browser console:\n" + "\n".join(console_errors)


def _switch_status_item_through_settings(lab: Lab, page: Page, item: Locator) -> None:
    """The `statusItem` setting, changed through the settings registry (the
    palette command calls ISettings.set), reaches the item at once and is saved."""
    from playwright.sync_api import expect

    toggle = "window.jupyterapp.commands.execute('gpufrac:toggle-full-status')"
    page.evaluate(toggle)
    expect(item).to_have_attribute("data-mode", "full", timeout=10_000)
    expect(item).to_have_text(re.compile(rf"^GPU 1 \(.+\): {FIGURES_FULL} · guaranteed$"))
    status, saved = lab.api("/lab/api/settings/jupyter-gpufrac:plugin")
    assert status == 200 and isinstance(saved, dict), (status, saved)
    assert '"full"' in str(saved.get("raw")), saved
    page.evaluate(toggle)
    expect(item).to_have_attribute("data-mode", "compact", timeout=10_000)
    expect(item).to_have_text(PLAIN_LINE)


def _item_width(item: Locator, most: float) -> float:
    """The status item's rendered width, at most `most` px (issue #13)."""
    box = item.bounding_box()
    assert box is not None
    assert box["width"] <= most, f"status item {item.inner_text()!r} is {box['width']:.0f} px wide (> {most})"
    return float(box["width"])


def _assert_bell_on_screen_at_1024(page: Page) -> None:
    """In a 1024 px window, beside a copy of jupyter-resource-usage's item, the
    status bar's right end (the notification bell) stays on screen."""
    from playwright.sync_api import expect

    size = page.viewport_size
    page.set_viewport_size({"width": 1024, "height": 768})
    page.evaluate(
        """text => {
          const ours = document.querySelector('#jp-main-statusbar .jp-gpufrac-StatusItem');
          const item = document.createElement('div');
          item.className = 'lm-Widget jp-StatusBar-Item gpufrac-test-resource-usage';
          const label = document.createElement('span');
          label.className = 'jp-StatusBar-TextItem';
          label.textContent = text;
          item.appendChild(label);
          ours.parentElement.insertBefore(item, ours);
        }""",
        RESOURCE_USAGE_TEXT,
    )
    try:
        stand_in = page.locator(".gpufrac-test-resource-usage")
        expect(stand_in).to_be_visible()
        bell = page.locator("#jp-main-statusbar .jp-Notification-Status")
        expect(bell).to_be_in_viewport(ratio=1)
        box = bell.bounding_box()
        assert box is not None and box["x"] + box["width"] <= 1024, box
    finally:
        page.evaluate("() => document.querySelector('.gpufrac-test-resource-usage')?.remove()")
        if size:
            page.set_viewport_size(size)


def _shoot_item(page: Page, item: Locator, path: Path) -> None:
    """The status bar's left end, through the item: what a user sees of it."""
    box = item.bounding_box()
    bar = page.locator("#jp-main-statusbar").bounding_box()
    assert box is not None and bar is not None
    page.screenshot(
        path=str(path),
        clip={
            "x": 0,
            "y": bar["y"],
            "width": min(bar["width"], box["x"] + box["width"] + 24),
            "height": bar["height"],
        },
    )
