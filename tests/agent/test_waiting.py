"""The progress line of a waiting `run`: every lease named as the agent names it, a countdown that counts."""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from node_agent.waiting import made_room_words, waiting_key, waiting_words

WHO = st.sampled_from(['notebook "a.ipynb" (l-0a1b2c3d4e5f)', "another user's notebook"])
ENTRY = st.fixed_dictionaries({
    "who": WHO, "kind": st.just("notebook"), "gpu": st.sampled_from(["GPU 0", "GPU 1"]),
    "action": st.sampled_from(["moving", "freezing", "parking"]),
    "to": st.sampled_from(["GPU 0", "GPU 1"]),
    "deadline": st.none() | st.floats(1e9, 2e9),
})
NOW = st.floats(1e9, 2e9)


@given(st.lists(ENTRY, min_size=1, max_size=4), NOW, st.floats(0, 1e6))
def test_each_lease_is_named_and_its_countdown_counts_down_and_never_below_zero(
    waiting: list[dict[str, object]], now: float, later: float
) -> None:
    before, after = waiting_words(waiting, now), waiting_words(waiting, now + later)
    for line in (before, after):
        # By name, as people know it: the lease id the agent adds is for scripts.
        assert all(str(w["who"]).removesuffix(" (l-0a1b2c3d4e5f)") in line for w in waiting)
        assert "l-0a1b2c3d4e5f" not in line
        assert line.startswith(f"waiting for {len(waiting)} notebook")
    seconds = [[int(n) for n in re.findall(r"within (\d+) s", line)] for line in (before, after)]
    assert all(n > 0 for n in seconds[0] + seconds[1])
    # Time passing only lowers a countdown, or ends it ("now").
    assert len(seconds[1]) <= len(seconds[0])
    timed = [w for w in waiting if w["action"] == "moving" and w["deadline"] is not None]
    if len(seconds[1]) == len(seconds[0]) == len(timed):
        assert all(b <= a for a, b in zip(seconds[0], seconds[1], strict=True))
    assert waiting_key(waiting) == waiting_key([{**w, "deadline": None} for w in waiting])


def test_a_move_past_its_deadline_is_due_now_and_a_park_says_it_has_none() -> None:
    moving = {"who": "another user's notebook", "kind": "notebook", "gpu": "GPU 1",
              "action": "moving", "to": "GPU 0", "deadline": 100.0}
    parking = {**moving, "action": "parking", "to": None, "deadline": None}
    assert waiting_words([moving], 99.2) == ("waiting for 1 notebook to make room: another "
                                            "user's notebook moves from GPU 1 to GPU 0 within 1 s")
    line = waiting_words([moving, parking], 100.5)
    assert line.startswith("waiting for 2 notebooks to make room: ")
    assert "GPU 0 now (its time is up); " in line
    assert line.endswith("on GPU 1 is asked to park once its kernel is idle (no deadline)")


def test_what_was_done_to_make_room_is_said_once_the_job_runs() -> None:
    """A freeze of a moment (the job starts before `run` first polls) is still seen."""
    frozen = [{"who": f'notebook "{n}.ipynb" (l-0a1b2c3d4e5f)', "kind": "notebook",
               "gpu": f"GPU {i}", "action": "freezing", "to": None, "deadline": None}
              for i, n in enumerate("ab")]
    assert made_room_words(frozen) == (
        'made room: notebook "a.ipynb" on GPU 0 frozen in host memory; notebook "b.ipynb" on '
        "GPU 1 frozen in host memory (what was frozen thaws when the command ends)")
    moved = {**frozen[0], "action": "moving", "to": "GPU 1", "deadline": 5.0}
    assert made_room_words([moved]) == 'made room: notebook "a.ipynb" on GPU 0 moved to GPU 1'


def test_a_notebook_is_named_by_its_file_name_however_the_agent_cut_its_path() -> None:
    waiting = [{"who": 'notebook "…b-201/lab0/notebooks/Untitled1.ipynb" (l-0a1b2c3d4e5f)',
                "kind": "notebook", "gpu": "GPU 1", "action": "moving", "to": "GPU 0",
                "deadline": None}]
    assert waiting_words(waiting, 0.0) == ('waiting for 1 notebook to make room: notebook '
                                           '"Untitled1.ipynb" is moving from GPU 1 to GPU 0')
