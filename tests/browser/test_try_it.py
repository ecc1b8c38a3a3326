"""The README's "Try it", walked as a newcomer would, in headless Chromium: two new notebooks,
a whole-GPU job that moves one, a two-GPU job that freezes both, a park, and shares as people
type them. At each step every surface that should say something says it within a second or
two (the status item, the panel, the notifications, the notebook's next cell, the job's
terminal) and every word shown is the glossary's (docs/glossary.md): no word it replaces, no
lease id, no literal Markdown.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from message_catalogue import glossary_tables

if TYPE_CHECKING:
    from conftest import Lab
    from playwright.sync_api import Locator, Page


pytestmark = pytest.mark.browser

# What no surface may show a person: the words the glossary replaces (its patterns that are
# words, not source placeholders), a lease id, a duration to the hundredth.
SHOWN_NEVER = [
    *(re.compile(pattern) for pattern, _, _ in glossary_tables("Words we do not use")[0]
      if "{" not in pattern),
    re.compile(r"\bl-[0-9a-f]{12}\b"),
    re.compile(r"\b\d+\.\d\d s\b"),
]
# Nor Markdown where JupyterLab shows text (cell output and the terminal quote commands
# between backticks, as IPython's and the shell's own messages do; docs/glossary.md).
MARKDOWN = re.compile(r"`|\*\*")
LAB = ("status item", "status item tooltip", "panel", "notification")
KERNEL_WORDS = {word for word, _, _ in glossary_tables("States")[0]}
JOB_GATE = "import os, sys, time\nwhile not os.path.exists(sys.argv[1]): time.sleep(0.05)"
# How long after the server emits an event the status item may take to show it (s).
SHOWN_WITHIN_S = 1.0
# Every change of the status item, with when it happened (unix seconds).
WATCH_ITEM = """() => {
  window.gpufracSeen = [];
  const seen = node => window.gpufracSeen.push({
    text: node.innerText, state: node.dataset.state, hold: node.dataset.hold,
    time: Date.now() / 1000});
  const watch = () => {
    const node = document.querySelector('.jp-gpufrac-StatusItem');
    if (!node) { return setTimeout(watch, 50); }
    new MutationObserver(() => seen(node)).observe(
      node, {attributes: true, childList: true, subtree: true, characterData: true});
  };
  watch();
}"""


class Walk:
    """The page, and every text a person was shown on it, by where it was shown."""

    def __init__(self, lab: Lab, page: Page) -> None:
        self.lab, self.page = lab, page
        self.shown: list[tuple[str, str]] = []
        self.states: set[str] = set()  # the panel's state labels, as shown
        self.item = page.locator(".jp-gpufrac-StatusItem")
        self.panel = page.locator("#jp-gpufrac-panel")

    def read(self, where: str, locator: Locator) -> str:
        text = locator.inner_text()
        self.shown.append((where, text))
        return text

    def look(self) -> None:
        """What the status item (line and tooltip), the panel and the notifications say now."""
        self.read("status item", self.item)
        self.shown.append(("status item tooltip", self.item.get_attribute("title") or ""))
        if self.panel.count():
            self.read("panel", self.panel)
            self.states.add(self.panel.locator(".jp-gpufrac-State").inner_text())
        for toast in self.page.locator(".Toastify__toast").all():
            with contextlib.suppress(Exception):  # a toast may close while it is read
                self.read("notification", toast)

    def new_notebook(self) -> str:
        """File → New → Notebook (Python 3): its path."""
        path = self.page.evaluate(
            "async () => (await window.jupyterapp.commands.execute('notebook:create-new',"
            " {kernelName: 'python3'})).context.path")
        tab = self.page.locator("#jp-main-dock-panel").get_by_role("tab", name=path, exact=True)
        from playwright.sync_api import expect

        expect(tab).to_have_class(re.compile("lm-mod-current"), timeout=20_000)
        return str(path)

    def front(self, path: str) -> None:
        self.page.locator("#jp-main-dock-panel").get_by_role("tab", name=path, exact=True).click()

    def cell(self, code: str, timeout: float = 60_000) -> str:
        """Type a cell at the end of the notebook in front and run it: what it printed."""
        from playwright.sync_api import expect

        notebook = self.page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook")
        notebook.locator(".jp-Cell").last.locator(".cm-content").click()
        self.page.keyboard.insert_text(code)
        cells = notebook.locator(".jp-Cell").count()
        self.page.keyboard.press("Shift+Enter")
        ran = notebook.locator(".jp-Cell").nth(cells - 1)
        expect(ran.locator(".jp-InputPrompt")).to_have_text(re.compile(r"\[\d+\]"),
                                                            timeout=timeout)
        return self.read("notebook", ran.locator(".jp-OutputArea"))

    def shown_after(self, path: str, event: str, seen: str) -> float:
        """Seconds from the server's `event` of `path`'s kernel to the status item's first
        change after it whose text says `seen`."""
        status, sessions = self.lab.api("/api/sessions")
        assert status == 200 and isinstance(sessions, list)
        kernel = next(s["kernel"]["id"] for s in sessions if s["path"] == path)
        status, body = self.lab.api(f"/api/gpufrac/kernels/{kernel}")
        assert status == 200 and isinstance(body, dict)
        at = max(e["time"] for e in body["events"] if e["event"] == event)
        changes = self.page.evaluate("window.gpufracSeen")
        shown = min(c["time"] for c in changes if c["time"] >= at - 1 and seen in c["text"])
        return float(shown - at)


def _job(lab: Lab, gpus: int, gate: Path) -> subprocess.Popen[str]:
    """`gpufrac-agent run --gpus N` from the Lab's terminal, until `gate` exists."""
    return subprocess.Popen(
        [sys.executable, "-m", "node_agent", "run", "--gpus", str(gpus), "--timeout", "120",
         "--", sys.executable, "-c", JOB_GATE, str(gate)],
        env=lab.env, cwd=lab.notebooks, stderr=subprocess.PIPE, text=True,
        start_new_session=True)


def _stopped(job: subprocess.Popen[str], gate: Path) -> str:
    """Let the job end; what it said on its terminal."""
    gate.touch()
    _, err = job.communicate(timeout=60)
    assert job.returncode == 0, err
    return err


@pytest.fixture
def fresh_node(lab: Lab) -> Iterator[None]:
    """No kernel of an earlier test on the node: the walk's two notebooks are alone."""
    def end_all() -> None:
        _, sessions = lab.api("/api/sessions")
        for session in sessions if isinstance(sessions, list) else []:
            lab.api(f"/api/sessions/{session['id']}", "DELETE")
        _, kernels = lab.api("/api/kernels")
        for kernel in kernels if isinstance(kernels, list) else []:
            lab.api(f"/api/kernels/{kernel['id']}", "DELETE")

    end_all()
    lab.wait_for("an empty node", lambda: not lab.api("/api/gpufrac/node")[1]["leases"], 30)
    yield
    end_all()


def test_try_it_walked_end_to_end_in_the_glossarys_words(
    lab: Lab, chromium: dict[str, Any], fresh_node: None, tmp_path: Path, screenshots: Path
) -> None:
    from playwright.sync_api import expect, sync_playwright

    jobs: list[subprocess.Popen[str]] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(**chromium)
        try:
            page = browser.new_context(viewport={"width": 1440, "height": 900}).new_page()
            page.goto(f"{lab.url}/lab/workspaces/try-it?reset&token={lab.token}")
            page.wait_for_function(
                "window.jupyterapp?.commands.hasCommand('notebook:create-new')", timeout=90_000)
            walk = Walk(lab, page)
            item = walk.item
            page.evaluate(WATCH_ITEM)
            # The light theme (an earlier test may have left the dark one), for the pictures.
            page.evaluate("window.jupyterapp.commands.execute('apputils:change-theme',"
                          " {theme: 'JupyterLab Light'})")

            # 2. Two notebooks: the second runs on idle GPU 1, so that it can burst.
            # A fresh kernel holds next to nothing; the simulated node counts what its
            # interpreter grew by after its pid was registered (tens of MiB: "0.1" at most).
            first = walk.new_notebook()
            expect(item).to_have_text(re.compile(r"^GPU 0: (<0\.1|0|0\.1)/4\.0 GiB$"),
                                      timeout=90_000)
            second = walk.new_notebook()
            expect(item).to_have_text(re.compile(r"^GPU 1: (<0\.1|0|0\.1)/4\.0 GiB$"),
                                      timeout=90_000)
            walk.cell("a, b, c, d = 1, 2, 3, 4")
            # 4. The panel: where the share came from, in %gpu's words; ids only in tooltips.
            page.evaluate("window.jupyterapp.commands.execute('gpufrac:open-panel')")
            expect(walk.panel.locator(".jp-gpufrac-State")).to_have_text("guaranteed",
                                                                         timeout=20_000)
            expect(walk.panel.locator(".jp-gpufrac-Panel-asked")).to_have_text(
                "request 0.25 (from the c.GpuFrac default), limit 1 (from the c.GpuFrac "
                "default)")
            expect(walk.panel.locator("h2")).to_have_attribute("title", re.compile(r"lease l-"))
            walk.look()

            # 5. A move: a whole-GPU job takes GPU 1; the second notebook goes back to GPU 0.
            gate = tmp_path / "move-done"
            jobs.append(_job(lab, 1, gate))
            expect(item).to_have_text(re.compile(r"^GPU 0: .* · restored$"), timeout=60_000)
            moved = page.locator(".Toastify__toast").filter(has_text=second).filter(
                has_text="variables restored")
            expect(moved).to_contain_text(re.compile(
                r"Moved from GPU 1 to GPU 0 to free GPU 1 for job .*4 of 4 variables restored"),
                timeout=30_000)
            walk.look()
            said = _stopped(jobs[-1], gate)
            assert f'notebook "{second}" moves from GPU 1 to GPU 0' in said, said
            assert f'made room: notebook "{second}" on GPU 1 moved to GPU 0' in said, said
            assert re.search(r"\] running on GPU 1\n", said), said
            walk.shown.append(("terminal", said))
            # Its next cell starts with the same sentence and what was restored.
            news = walk.cell("print(a + d)")
            assert news.startswith(
                "gpufrac: This kernel was moved from GPU 1 to GPU 0 to free GPU 1 for job"), news
            assert "gpufrac: Restored 4 of 4 variables" in news and news.rstrip().endswith("5")

            # 6. A freeze: a job on both GPUs; both notebooks wait frozen, then thaw.
            gate = tmp_path / "freeze-done"
            jobs.append(_job(lab, 2, gate))
            expect(item).to_have_text("GPU 0 · frozen, waiting", timeout=30_000)
            frozen = page.locator(".Toastify__toast").filter(has_text=second).filter(
                has_text="Frozen because job")
            expect(frozen).to_be_visible(timeout=10_000)
            # Why it waits: the job it was frozen for, said once (not each GPU's shortfall).
            expect(walk.panel.locator(".jp-gpufrac-Panel-reason")).to_have_text(
                re.compile(r"^Frozen because job .* needs GPU 0 whole: "))
            walk.look()
            page.screenshot(path=str(screenshots / "try-it-frozen-light.png"))
            said = _stopped(jobs[-1], gate)
            assert re.search(r"made room: .*frozen in host memory .*\(what was frozen thaws "
                             r"when the command ends\)", said), said
            walk.shown.append(("terminal", said))
            expect(item).to_have_text(re.compile(r"^GPU 0: .* · thawed$"), timeout=30_000)
            # Each within a second of the server's event: the status item follows the event
            # stream, not only its poll.
            for event, seen in (("frozen", "frozen, waiting"), ("unparked", "thawed")):
                late = walk.shown_after(second, event, seen)
                assert late <= SHOWN_WITHIN_S, f"{event} shown {late:.2f} s after it happened"
            expect(frozen).to_contain_text(re.compile(
                r"Back on GPU 0: thawed after being frozen for .* It was frozen because job"),
                timeout=10_000)
            walk.look()
            news = walk.cell("print(b)")
            lines = news.splitlines()
            assert lines[0].startswith("gpufrac: frozen in host memory at ") and "job" in lines[0]
            assert lines[1].startswith("gpufrac: thawed at "), news
            assert walk.cell("print('again')").strip() == "again"

            # 7. A park, asked for; asked again it changes nothing.
            walk.front(first)
            parked = walk.cell("%gpu park")
            assert "parking once this cell ends" in parked
            expect(item).to_have_text("GPU 0 · parked, frozen", timeout=30_000)
            state = walk.panel.locator(".jp-gpufrac-State")
            expect(state).to_have_text("parked, frozen", timeout=10_000)
            # What no longer holds is not shown; the command in the reason is code.
            expect(walk.panel.locator(".jp-gpufrac-Panel-facts")).not_to_contain_text(
                "Last restore")
            expect(walk.panel.locator(".jp-gpufrac-Panel-reason code")).to_have_text("%gpu park")
            walk.look()
            walk.panel.screenshot(path=str(screenshots / "try-it-parked-light.png"))
            table = subprocess.run([sys.executable, "-m", "node_agent", "status"], env=lab.env,
                                   capture_output=True, text=True, timeout=30, check=True).stdout
            row = next(line for line in table.splitlines() if line.startswith(f"notebook {first}"))
            assert "parked, needs 4.0 GiB" in row and row.rstrip().endswith(
                "frozen in host memory"), table
            walk.shown.append(("terminal", table))
            again = walk.cell("%gpu park")
            assert again.startswith("gpufrac: this kernel holds no GPU already"), again
            expect(item).to_have_text("GPU 0 · parked, frozen")
            back = walk.cell("print('back')")
            assert back.startswith("gpufrac: parked at "), back
            assert "gpufrac: back on GPU " in back and ", thawed (" in back, back

            # Shares as people type them.
            asked = walk.cell("%gpu request 2")
            assert "2 GiB or 2 GPUs?" in asked, asked
            asked = walk.cell("%gpu request 50%")
            assert "now 0.5 of GPU " in asked and "For this notebook only" in asked, asked
            walk.look()
        finally:
            browser.close()
            for job in jobs:
                if job.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(job.pid, signal.SIGTERM)
                    job.wait(timeout=20)

    # Every word shown, on every surface, is the glossary's.
    broken = [f"{where}: {pattern.pattern!r} in {text!r}" for where, text in walk.shown
              for pattern in [*SHOWN_NEVER, *([MARKDOWN] if where in LAB else [])]
              if pattern.search(text)]
    assert not broken, "\n".join(broken)
    # The states the panel showed are the glossary's words (a frozen kernel's with "frozen").
    words = {re.sub(r"^frozen, |, frozen$", "", state) for state in walk.states}
    assert words <= KERNEL_WORDS and len(words) >= 3, walk.states
