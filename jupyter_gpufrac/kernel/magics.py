"""The ``%gpu`` line magic: status, request, checkpoint, restore, reload, release."""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import time
from pathlib import Path
from typing import Any, NoReturn

from IPython.core.error import UsageError

from jupyter_gpufrac import checkpoint_disk, contract
from jupyter_gpufrac.kernel import messages, store, torch_adapter
from jupyter_gpufrac.kernel.agent_client import make_client
from jupyter_gpufrac.kernel.budget import unprotected_line
from jupyter_gpufrac.kernel.checkpoint import CheckpointError
from jupyter_gpufrac.kernel.hook import GpuFracHook
from node_agent.caps import mps_running
from node_agent.quantities import format_duration
from node_agent.words import CHECKPOINT_ON_DISK, FROZEN_IN_HOST_MEMORY

SUBCOMMANDS = ("status", "request", "checkpoint", "restore", "reload", "release", "park",
               "unpark")


class _HelpShown(Exception):
    """argparse printed help; stop without an error."""


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors as UsageError (one line, no traceback) instead of exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (see `{self.prog} --help`)")

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        if message:
            print(message)
        raise _HelpShown()


def build_parser() -> argparse.ArgumentParser:
    """The ``%gpu`` argument parser (kept separate so tests and docs can use it)."""
    parser = _Parser(
        prog="%gpu",
        description="This kernel's share of a GPU, managed by jupyter-gpufrac. Without a "
        "subcommand: show this kernel's GPU, request, limit, usage and state, and the node's GPUs.",
    )
    sub = parser.add_subparsers(dest="command", parser_class=_Parser, metavar="COMMAND")
    sub.add_parser("status", help="show this kernel's GPU share and the node (the default)")
    req = sub.add_parser(
        "request", help="change the guaranteed request and the limit",
        description="Change this kernel's request (guaranteed) and limit (may burst to). "
        "Quantities are a share of one GPU (0.25, or 25%%) or a memory size with its unit "
        "(2500M, 4G, 4Gi). If the new share does not fit on this GPU, the agent moves the "
        "kernel to one where it fits: the server restarts it there and its variables come "
        "back. The share is this notebook's; --remember gives it to new notebooks too.",
    )
    req.add_argument("request", nargs="?", help="guaranteed share, e.g. 0.25, 25%% or 4Gi")
    req.add_argument("--limit", help="most this kernel may use, e.g. 0.8 or 12Gi "
                     "(default: unchanged, or the new request where that is larger)")
    req.add_argument("--remember", action="store_true",
                     help="also give this share to new notebooks in this environment (until "
                     "%%gpu request --reset)")
    req.add_argument("--reset", action="store_true",
                     help="forget the request your last %%gpu request made the share of your "
                     "next kernels in this environment (this kernel keeps its share)")
    req.add_argument("--no-checkpoint", action="store_true",
                     help="do not checkpoint before asking (a move then loses the variables)")
    ck = sub.add_parser("checkpoint", help="save the notebook's variables now",
                        description="Save the notebook's variables (tensors incrementally) into "
                        "the kernel's private checkpoint directory.")
    ck.add_argument("--quiet", action="store_true", help="print nothing unless it fails")
    ck.add_argument("--full", action="store_true",
                    help="rewrite every tensor (after writes that bypass torch's version "
                    "counter, e.g. through .data or .numpy())")
    res = sub.add_parser(
        "restore", help="load variables kept on disk, or the latest checkpoint",
        description="After a restart that kept variables on disk (there was no room on the GPU "
        "for them): load those, or only the NAMEs given. In a fresh kernel of a notebook whose "
        "earlier kernel left its state (its server or node went away): take that state over, "
        "with its cell numbers and random generators. Otherwise load the latest checkpoint; "
        "variables it holds replace the current ones with the same names.")
    res.add_argument("names", nargs="*", metavar="NAME", help="variables kept on disk to load")
    sub.add_parser("reload", help="bring tensors moved to host memory back to the GPU",
                   description="Move tensors that were offloaded to host memory (to give lent "
                   "GPU memory back) back onto the GPU, as far as the cap allows.")
    rel = sub.add_parser("release", help="give GPU memory back: empty the cache, offload tensors",
                         description="Empty PyTorch's allocator cache and move the notebook's "
                         "GPU tensors to host memory; `%gpu reload` brings them back.")
    rel.add_argument("--cache-only", action="store_true",
                     help="only empty the allocator cache; keep tensors on the GPU")
    sub.add_parser("park", help="give the GPU back once this cell ends; keep the variables",
                   description="After this cell, the server checkpoints this kernel and restarts "
                   "it without a GPU (tensors in host memory): its lease holds no GPU memory. "
                   "The next cell gets a GPU first (maybe another one), then runs. Kernels idle "
                   "for c.GpuFrac.park_after seconds are parked the same way.")
    sub.add_parser("unpark", help="get a GPU back now (any cell of a parked kernel does)",
                   description="A parked kernel gets a GPU back before its next cell runs; this "
                   "cell is one, so after it the kernel has one. Waits while no GPU has room "
                   "(interrupt to stop waiting).")
    return parser


class GpuMagic:
    """Parses ``%gpu`` lines and runs them against a :class:`GpuFracHook`."""

    def __init__(self, hook: GpuFracHook) -> None:
        self.hook = hook
        self.parser = build_parser()

    def __call__(self, line: str = "") -> None:
        try:
            words = shlex.split(line)
        except ValueError as exc:
            raise UsageError(f"%gpu: cannot parse {line!r}: {exc}") from None
        if words and not words[0].startswith("-") and words[0] not in SUBCOMMANDS:
            raise UsageError(f"%gpu: unknown subcommand {words[0]!r}; expected one of: "
                             f"{', '.join(SUBCOMMANDS)} (see `%gpu --help`)")
        try:
            args = self.parser.parse_args(words)
        except _HelpShown:
            return
        command = args.command or "status"
        getattr(self, f"do_{command}")(args)

    # -- subcommands -------------------------------------------------------------------------

    def do_status(self, args: argparse.Namespace) -> None:
        print(self.status_text())

    def status_text(self) -> str:
        """What ``%gpu`` prints."""
        hook = self.hook
        env = hook.env
        s = hook.summary()
        lines = []
        if not env.has_lease:
            lines.append("gpufrac: no GPU lease. " + env.no_lease_reason())
        else:
            total = env.gpu_total
            lines.append(f"gpufrac: this kernel's share of {self._gpu_text()}")
            came = hook.share_source
            lines.append(f"  request: {messages.fmt_share(hook.request, total)} guaranteed"
                         + messages.source_words(came.get("request")))
            lines.append(f"  limit:   {messages.fmt_share(hook.limit, total)}"
                         + messages.source_words(came.get("limit")))
            usage, source = s["usage"], "PyTorch reserved"
            lease = hook.lease_info(timeout=2.0)
            if usage is None and lease is not None:
                usage, source = lease.get("usage"), "measured by the agent"
            if usage is not None:
                lines.append(f"  usage:   {messages.fmt_share(int(usage), total)} ({source})")
            if lease is not None and (lease.get("compute_request") is not None
                                      or lease.get("compute_usage") is not None):
                lines.append("  compute: " + messages.compute_text(lease, mps_running()))
            account = self._account()
            if account is not None and (lease is not None
                                        or account.get("state") == "agent-unreachable"):
                lines += messages.account_lines(account, hook.cell_started(), time.time())
            else:
                # No server left one (an older server, or none), or the agent did not answer
                # this kernel just now, which is newer than any account: as the agent says.
                lines.append(f"  state:   {self._state_text(usage, lease)}")
            lines.append(f"  kept by: {self._protection_text(lease)}")
        lines.append(self._torch_line(s))
        if hook.offloaded:
            names = ", ".join(r.name for r in hook.offloaded)
            lines.append(f"  offloaded to host memory: {names} (`%gpu reload` brings them back)")
        waiting = sorted(n for g in hook.checkpointer.deferred for n in g["names"])
        if waiting:
            lines.append(f"  kept on disk since the last restore: {', '.join(waiting)} "
                         "(`%gpu restore` loads them)")
        lines.append(self._checkpoint_line(s))
        lines.append(self._disk_line())
        if hook.restore_report:
            lines.append("  last restore:")
            lines += ["    " + x for x in hook.restore_text().splitlines()]
        for problem in env.problems:
            lines.append(f"  environment problem: {problem}")
        lines += self._node_lines()
        return "\n".join(lines)

    def _gpu_text(self) -> str:
        """``GPU 1 (NVIDIA H100 80GB HBM3, simulated)``: the GPU as the panel names it, its
        model, and "simulated" once (its UUID is for scripts: `nvidia-smi -L`)."""
        env = self.hook.env
        model = (env.gpu_name or "").removesuffix(" (simulated)")
        about = [model] if model else []
        if env.simulated or (env.gpu_name or "").endswith(" (simulated)"):
            about.append("simulated")
        details = ", ".join(about)
        return f"{self.hook.gpu_label()} ({details})" if details else self.hook.gpu_label()

    def _state_text(self, usage: int | None, lease: dict[str, Any] | None) -> str:
        hook = self.hook
        agent_state = (lease or {}).get("state")
        reason = (lease or {}).get("reason") or ""
        if lease is None:
            # Never "guaranteed" on faith: without the agent's word the share is unverified.
            return (f"agent unreachable at {hook.env.agent_socket}: this kernel's share cannot be "
                    "verified; it keeps running on its GPU, and cells still run")
        if hook.parked or agent_state == "parked":
            text = "parked: holds no GPU; the next cell gets one first, then runs"
        elif agent_state == "pending":
            text = "waiting for a GPU with room"
        elif hook.state.shrinking or agent_state == "shrinking":
            text = "shrinking: memory lent to this kernel is being reclaimed"
        elif agent_state == "migrating":
            text = "moving: the agent is moving this kernel to another GPU"
        elif usage is not None and hook.request is not None and usage > hook.request:
            text = "bursting: using more than the request (the loan may be asked back)"
        else:
            text = "guaranteed"
        return f"{text} ({reason})" if reason and text != "guaranteed" else text

    def _protection_text(self, lease: dict[str, Any] | None) -> str:
        """What keeps this kernel's state, in the panel's words: frozen in host memory while
        it is, else its checkpoint on disk, and what happens when its GPU is taken."""
        disk = f"{CHECKPOINT_ON_DISK} (after every cell that changed something)"
        if lease is not None and lease.get("frozen"):
            return (f"{FROZEN_IN_HOST_MEMORY} ({messages.fmt_bytes(lease.get('frozen_bytes'))} "
                    f"of GPU memory), and a {disk}")
        if lease is None:
            return disk
        if lease.get("fallback"):
            return (f"{disk}; freezing could not be used the last time "
                    f"({lease['fallback']}), so a park or reclaim restarts it from there")
        freezing: dict[str, Any] = {}
        with contextlib.suppress(Exception):  # a line of %gpu, never its failure
            freezing = make_client(self.hook.env.agent_socket, timeout=2.0).node().get(
                "freezing") or {}
        if freezing.get("available"):
            return (f"{disk}; if its GPU is taken: {FROZEN_IN_HOST_MEMORY}, nothing restarts")
        if freezing.get("why"):
            return f"{disk} (freezing is not available here: {freezing['why']})"
        return disk

    def _torch_line(self, s: dict[str, Any]) -> str:
        if not s["torch_imported"]:
            return "  torch: not imported yet (the cap applies as soon as it is)"
        if not s["cuda"]:
            return "  torch: imported; CUDA is not available, so there is no allocator cap"
        return (f"  torch: {messages.fmt_bytes(s['usage'])} reserved, cap "
                f"{messages.fmt_bytes(s['cap'])}")

    def _checkpoint_line(self, s: dict[str, Any]) -> str:
        if s.get("checkpoints_off"):
            return f"  checkpoint: off, a crash or a move loses the variables ({s['checkpoints_off']})"
        last = s["last_checkpoint"]
        where = s["checkpoint_dir"]
        state = s.get("checkpoint") or {}
        writing = state.get("writing")
        progress = ""
        if writing:
            progress = (f"; writing the one after cell [{writing.get('cell')}]: "
                        f"{messages.fmt_bytes(writing.get('bytes_done') or 0)} of "
                        f"{messages.fmt_bytes(writing.get('bytes_total') or 0)}")
        if state.get("owed_cell") is not None:
            progress += (f"; the one after cell [{state['owed_cell']}] is taken once that one "
                         "is written")
        if state.get("error"):
            progress += f"; the last one failed: {state['error']}"
        when = state.get("durable_time") or (last or {}).get("time")
        if not when:
            return f"  checkpoint: none yet ({where}){progress}"
        stamp = time.strftime("%H:%M:%S", time.localtime(when))
        cell = state.get("durable_cell")
        after = f" after cell [{cell}]" if cell is not None else ""
        lost = (last or {}).get("lost") or {}
        count = messages.plural(len((last or {}).get("names") or []), "variable")
        text = f"  checkpoint: {stamp}{after}, {count}, on disk ({where}){progress}"
        unprotected = state.get("unprotected") or {}
        lost = {name: why for name, why in lost.items() if name not in unprotected}
        if lost:
            text += f"; not saved: {', '.join(sorted(lost))}"
        if unprotected:
            text += f"\n    {unprotected_line(unprotected, state.get('unprotected_why'))}"
        return text

    def _node_lines(self) -> list[str]:
        env = self.hook.env
        if not env.has_lease:
            return []
        try:
            node = make_client(env.agent_socket, timeout=2.0).node()
        except Exception as exc:
            return [f"  node: agent not reachable ({exc})"]
        lines = [f"  node ({node.get('backend', '?')}):"]
        for gpu in node.get("gpus", []):
            mark = " <- this kernel" if gpu.get("uuid") == env.gpu_uuid else ""
            health = "" if gpu.get("healthy", True) else f" UNHEALTHY: {gpu.get('error')}"
            lines.append(
                f"    GPU {gpu.get('index')}: {gpu.get('name')}, "
                f"{messages.fmt_bytes(gpu.get('memory_used'))} used of "
                f"{messages.fmt_bytes(gpu.get('memory_total'))}{health}{mark}"
            )
        return lines

    def _disk_line(self) -> str:
        """What this kernel's and all the user's kernels' checkpoints here take on disk."""
        if self.hook.env.checkpoints_off:
            return "  checkpoints on disk: none (checkpoints are off)"
        try:
            folder = Path(self.hook.env.checkpoint_dir)
            # stat calls only (a bounded walk): %gpu stays quick however much is on disk.
            return disk_text(checkpoint_disk.measure(folder.parent), folder.name, time.time())
        except Exception as exc:  # a line of %gpu, never its failure
            return f"  checkpoints on disk: not measured ({exc})"

    def do_request(self, args: argparse.Namespace) -> None:
        hook = self.hook
        env = hook.env
        if args.reset:
            self.forget_request()
            if args.request is None:
                return
        if args.request is None:
            raise UsageError("%gpu request: give the new request (e.g. 0.25 or 4Gi), or --reset")
        try:
            from node_agent.quantities import QuantityError, check_share, parse_quantity
        except ImportError as exc:  # the agent package is absent in this environment
            raise UsageError(f"%gpu request: cannot parse quantities ({exc})") from None
        try:
            request = parse_quantity(args.request, "request")
            limit = parse_quantity(args.limit, "limit") if args.limit is not None else None
            total = env.gpu_total
            if total:
                # Without --limit the agent keeps the limit or raises it to the request.
                check_share(request, limit or request, total)
        except QuantityError as exc:
            raise UsageError(str(exc)) from None
        if not env.has_lease or not env.lease_id:
            self.remember_without_lease(args.request, args.limit)
            return
        if not args.no_checkpoint:
            try:
                hook.checkpoint()
            except CheckpointError as exc:
                raise UsageError(f"%gpu request: checkpoint before the change failed ({exc}); "
                                 "use --no-checkpoint to go on without one") from None
        from node_agent.client import AgentError

        try:
            lease = make_client(env.agent_socket).resize(
                env.lease_id, request=args.request, limit=args.limit
            )
        except AgentError as exc:
            raise UsageError(f"%gpu request: the agent refused: {exc}") from None
        kept = self._keep_for_new_notebooks(args)
        if lease.get("state") == "migrating":
            targets = ", ".join(hook.gpu_names(lease.get("target_gpus") or [])) or "another GPU"
            print(f"gpufrac: the new share does not fit on {hook.gpu_label()}; the agent is "
                  f"moving this kernel to {targets}. The server restarts it there, and its "
                  f"variables come back from the checkpoint just taken. {kept}")
            return
        hook.request = int(lease.get("request", hook.request or 0))
        hook.limit = int(lease.get("limit", hook.limit or 0))
        hook.share_source = {"request": contract.SOURCE_MAGIC, "limit": contract.SOURCE_MAGIC}
        hook.apply_cap()
        now = messages.share_now(hook.gpu_label(), hook.request, hook.limit, env.gpu_total)
        print(f"gpufrac: {now}. {kept}")

    def _keep_for_new_notebooks(self, args: argparse.Namespace) -> str:
        """Keep the share for new notebooks when asked (``--remember``); the sentence that
        says whose share it is now."""
        spec = messages.share_spec({"request": args.request, "limit": args.limit})
        if not args.remember:
            again = " ".join(["%gpu request", args.request]
                             + (["--limit", args.limit] if args.limit else []) + ["--remember"])
            return f"For this notebook only; `{again}` gives new notebooks here the same."
        if not self._remembered():
            return (f"Not kept for new notebooks: this kernel's folder is not yours alone "
                    f"({self.hook.env.checkpoints_off or 'no server named one'}).")
        try:
            self._remember(args.request, args.limit)
        except UsageError as exc:
            return f"Not kept for new notebooks: {exc}."
        return f"{spec[0].upper()}{spec[1:]} {messages.REMEMBERED}."

    def _account(self) -> dict[str, Any] | None:
        """The server's account of this kernel as it last left it (contract.ACCOUNT_FILE)."""
        env = self.hook.env
        if env.checkpoints_off:
            return None
        try:
            found = json.loads(store.read_file(env.checkpoint_dir, contract.ACCOUNT_FILE))
        except (OSError, ValueError, store.UnsafeCheckpointError):
            return None
        return found if isinstance(found, dict) else None

    def _remembered(self) -> bool:
        """Whether the server keeps this kernel's `%gpu request` for new notebooks (it does
        where it named the file, in a folder that is the user's alone)."""
        env = self.hook.env
        return env.remembered_request is not None and env.checkpoints_off is None

    def remember_without_lease(self, request: str, limit: str | None) -> None:
        """``%gpu request`` in a kernel the server started without a lease: the share of new
        notebooks here, and the one the server asks for when it gives this kernel a GPU."""
        env = self.hook.env
        if env.remembered_request is None or not self._remembered():
            raise UsageError("%gpu request: this kernel has no GPU lease to change. "
                             + env.no_lease_reason())
        self._remember(request, limit)
        print(f"gpufrac: {messages.share_spec({'request': request, 'limit': limit})} "
              f"{messages.REMEMBERED}. This kernel has no GPU lease yet: it gets one with this "
              "share as soon as the agent has room.")

    def _remember(self, request: str, limit: str | None) -> None:
        """Keep ``request``/``limit`` as the share of the user's new kernels here: through the
        folder's descriptor, under an exclusive temporary name, never via a link."""
        path = self.hook.env.remembered_request
        assert path is not None
        try:
            store.write_file(path.parent, path.name,
                             json.dumps({"request": request, "limit": limit}).encode(),
                             blobs=False)
        except (OSError, store.UnsafeCheckpointError) as exc:
            raise UsageError(f"%gpu request: could not keep it ({exc})") from None

    def forget_request(self) -> None:
        """``%gpu request --reset``: new kernels here take their kernelspec's or the default."""
        env = self.hook.env
        path = env.remembered_request
        if path is None:
            raise UsageError("%gpu request --reset: this kernel was not started by a Jupyter "
                             "server with jupyter-gpufrac, so nothing is remembered for it")
        default = (f"the default share ({messages.share_spec(env.default_share)})"
                   if env.default_share else "the server's default share")
        then = (f"new notebooks in this environment get {default} unless their kernelspec "
                "names one; " + ("this kernel keeps its own." if env.has_lease else
                                 "this kernel, which has no GPU lease yet, asks for it too."))
        try:
            path.unlink()
        except FileNotFoundError:
            print(f"gpufrac: no request is remembered here: {then}")
            return
        print(f"gpufrac: forgot your remembered request: {then}")

    def do_checkpoint(self, args: argparse.Namespace) -> None:
        try:
            result = self.hook.checkpoint(full=args.full)
        except CheckpointError as exc:
            # UsageError: one line in the notebook, and an error status for the server.
            raise UsageError(f"%gpu checkpoint: {exc}") from None
        if args.quiet:
            return
        print(f"gpufrac: checkpoint of {messages.plural(len(result.names), 'variable')} "
              f"(and {messages.plural(len(result.modules), 'module')} to re-import) in "
              f"{format_duration(result.seconds)}: "
              f"{messages.fmt_bytes(result.tensors_bytes)} of tensors, "
              f"{messages.fmt_bytes(result.bytes_written)} written -> {result.path}")
        if result.lost:
            parts = [f"{name} ({why})" for name, why in sorted(result.lost.items())]
            print(f"gpufrac: not saved: {messages.names_list(parts)}")

    def do_restore(self, args: argparse.Namespace) -> None:
        if self.hook.checkpointer.deferred or args.names:
            try:
                restored, lost = self.hook.restore_deferred(list(args.names))
            except CheckpointError as exc:
                raise UsageError(f"%gpu restore: {exc}") from None
            if restored:
                print(f"gpufrac: loaded {messages.names_list(restored)} from disk.")
            if lost:
                parts = [f"{name} ({why})" for name, why in sorted(lost.items())]
                raise UsageError(f"%gpu restore: could not load {messages.names_list(parts)}")
            return
        if self.hook.env.resumable is not None:
            # A fresh kernel of a notebook whose earlier kernel left its state: take it over.
            try:
                report = self.hook.resume()
            except CheckpointError as exc:
                raise UsageError(f"%gpu restore: {exc}") from None
        else:
            report = self.hook.restore(None, at_start=False)
        if report["error"]:
            raise UsageError(f"%gpu restore: {report['error']}")
        print(report["message"])

    def do_reload(self, args: argparse.Namespace) -> None:
        back, left, note = self.hook.reload()
        if note:
            print(f"gpufrac: {note}")
        if not back and not left:
            print("gpufrac: nothing is offloaded to host memory.")
            return
        if back:
            print(f"gpufrac: back on the GPU: {', '.join(r.name for r in back)}.")
        if left:
            print(f"gpufrac: still in host memory (no room under the cap): "
                  f"{', '.join(r.name for r in left)}.")

    def do_release(self, args: argparse.Namespace) -> None:
        if not torch_adapter.cuda_available():
            print("gpufrac: no CUDA device in this kernel (or torch is not imported): "
                  "there is no GPU memory to release.")
            return
        moved = self.hook.release(cache_only=args.cache_only)
        if moved:
            size = messages.fmt_bytes(sum(r.nbytes for r in moved))
            print(f"gpufrac: moved {', '.join(r.name for r in moved)} ({size}) to host memory "
                  "and emptied the allocator cache; `%gpu reload` brings them back.")
        else:
            print("gpufrac: emptied the allocator cache; no GPU tensors to move.")

    def do_park(self, args: argparse.Namespace) -> None:
        env = self.hook.env
        if not env.has_lease or not env.lease_id:
            raise UsageError("%gpu park: this kernel has no GPU lease to give back. "
                             + env.no_lease_reason())
        if self.hook.parked or self.hook.frozen:
            kept = " (frozen in host memory)" if self.hook.frozen else ""
            print(f"gpufrac: this kernel holds no GPU already{kept}: nothing to park. Its next "
                  "cell gets a GPU first, then runs.")
            return
        from node_agent.client import AgentError

        try:
            make_client(env.agent_socket).park_request(env.lease_id)
        except AgentError as exc:
            raise UsageError(f"%gpu park: the agent refused: {exc}") from None
        print("gpufrac: parking once this cell ends, as you asked. The kernel gives its GPU "
              "back and keeps its variables. If another cell starts within seconds, it keeps "
              "its GPU instead. The next cell gets a GPU first, then runs.")

    def do_unpark(self, args: argparse.Namespace) -> None:
        # A parked kernel got its GPU back before this cell ran (see GpuFracHook.unpark).
        if self.hook.parked:
            self.hook.unpark()
        if not self.hook.env.has_lease:
            print("gpufrac: this kernel has no GPU lease.")
            return
        print(f"gpufrac: this kernel runs on {self.hook.gpu_label()}.")


def disk_text(usage: checkpoint_disk.Usage, kernel: str, now: float) -> str:
    """``  checkpoints on disk: 1.2 GiB for this kernel, 3.4 GiB for all your kernels here (2
    kept from shut-down kernels until 2025-01-02 14:03)``."""
    mine = usage.of(kernel)
    at_least = "" if usage.complete else "at least "
    text = (f"  checkpoints on disk: {at_least}{messages.fmt_bytes(mine.bytes if mine else 0)} "
            f"for this kernel, {at_least}{messages.fmt_bytes(usage.total)} for all your kernels "
            f"here")
    kept = usage.kept(now)
    if kept:
        untils = [f.marker.keep_until for f in kept if f.marker and f.marker.keep_until]
        until = (" until " + time.strftime("%Y-%m-%d %H:%M", time.localtime(max(untils)))
                 if untils else "")
        text += f" ({len(kept)} kept from shut-down kernels{until})"
    return text
