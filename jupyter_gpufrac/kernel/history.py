"""IPython's cell numbers and In/Out history, recorded between cells and put back after a restart."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# cells.json is rewritten after every cell: the oldest sources give way past this many characters.
INPUT_CHARS = 1_000_000
# An output kept by value: numbers and booleans, and strings up to this length.
OUTPUT_STR_CHARS = 1000


def record(ip: Any, running: tuple[str, str] | None,
           variables: Mapping[str, object]) -> dict[str, Any]:
    """What ``cells.json`` keeps of the history: ``inputs`` ([parsed, raw] per cell from [1],
    with the running cell's when ``running`` is given) and ``outputs`` (by cell number: a small
    value, or the name of the user's variable that holds it)."""
    manager = getattr(ip, "history_manager", None)
    if manager is None:
        return {}
    inputs = [[p, r] for p, r in zip(manager.input_hist_parsed[1:], manager.input_hist_raw[1:],
                                     strict=False)]
    if running is not None:
        inputs.append(list(running))
    size = sum(len(p) + len(r) for p, r in inputs)
    for pair in inputs:
        if size <= INPUT_CHARS:
            break
        size -= len(pair[0]) + len(pair[1])
        pair[0] = pair[1] = ""
    holders = {id(value): name for name, value in variables.items()}
    outputs: dict[str, Any] = {}
    for number, value in dict(manager.output_hist).items():
        if isinstance(value, bool | int | float) or (
                isinstance(value, str) and len(value) <= OUTPUT_STR_CHARS):
            outputs[str(number)] = {"value": value}
        elif id(value) in holders:
            outputs[str(number)] = {"name": holders[id(value)]}
    return {"inputs": inputs, "outputs": outputs}


def last_number(previous: Mapping[str, Any], checkpoint_cell: object) -> int | None:
    """The number of the last cell the old process ran or began (None: none known)."""
    running = previous.get("running")
    found = [previous.get("execution_count"), checkpoint_cell,
             running.get("execution_count") if isinstance(running, Mapping) else None]
    numbers = [n for n in found if isinstance(n, int) and not isinstance(n, bool) and n > 0]
    return max(numbers) if numbers else None


def continue_after(ip: Any, previous: Mapping[str, Any], last: int,
                   restored: set[str], *, running: bool = False) -> None:
    """Make the next cell [last + 1], with ``In``, ``_i``…, ``Out``, ``_``… as IPython kept them
    before the restart (a source not recorded is empty; an output not restorable is absent).
    ``running``: called from the kernel's first cell (``%gpu restore``), which becomes
    [last + 1] itself, the next one [last + 2]."""
    manager = getattr(ip, "history_manager", None)
    if manager is None or ip.execution_count != (2 if running else 1):
        return  # a cell ran already: its numbers stand
    raw_inputs = previous.get("inputs")
    pairs = [p for p in raw_inputs if _is_pair(p)] if isinstance(raw_inputs, list) else []
    pairs = (pairs + [["", ""]] * last)[:last]
    if running:
        pairs.append([manager.input_hist_parsed[-1], manager.input_hist_raw[-1]])
        last += 1
    # In is the list itself (In[n] is its n-th item): filled in place from [1] on.
    manager.input_hist_parsed[1:] = [p for p, _ in pairs]
    manager.input_hist_raw[1:] = [r for _, r in pairs]
    raw = ["", "", "", *[r for _, r in pairs]]
    # As IPython's store_inputs leaves them after cell [last]: _i00 is its source.
    manager._i00, manager._i, manager._ii, manager._iii = raw[-1], raw[-2], raw[-3], raw[-4]
    to_main: dict[str, object] = {f"_i{n}": r for n, (_, r) in enumerate(pairs, 1)}
    to_main.update(_i=manager._i, _ii=manager._ii, _iii=manager._iii)
    outputs = previous.get("outputs")
    kept: dict[int, object] = {}
    for key, entry in (outputs.items() if isinstance(outputs, Mapping) else ()):
        if not (isinstance(key, str) and key.isdigit() and 0 < int(key) <= last
                and isinstance(entry, Mapping)):
            continue
        if "value" in entry:
            kept[int(key)] = entry["value"]
        elif entry.get("name") in restored and entry["name"] in ip.user_ns:
            kept[int(key)] = ip.user_ns[entry["name"]]
    for number in sorted(kept):
        manager.output_hist[number] = kept[number]
        to_main[f"_{number}"] = kept[number]
    hook = getattr(ip, "displayhook", None)
    if kept and hook is not None:
        last_three = [kept[n] for n in sorted(kept)[-3:]]
        unders = ["", "", *last_three][-3:]
        hook.___, hook.__, hook._ = unders
        to_main.update({"_": hook._, "__": hook.__, "___": hook.___})
    ip.push(to_main, interactive=False)  # IPython's names: hidden, never checkpointed
    ip.execution_count = last + 1


def _is_pair(item: object) -> bool:
    return (isinstance(item, list) and len(item) == 2
            and all(isinstance(s, str) for s in item))
