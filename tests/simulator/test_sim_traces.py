"""Reading the notebook and job traces, and what a trace that does not parse says."""

from __future__ import annotations

from pathlib import Path

import pytest

from node_agent.simulator.traces import GB, TraceError, load_pods, load_sessions, sample_jobs

from .synth import notebook, pod, training, write_notebooks, write_pods


def test_sessions_in_seconds_with_their_cells_in_order(tmp_path: Path) -> None:
    path = write_notebooks(tmp_path / "nb.json", [
        notebook("a", 10, 100, training(50, 3, 4, 2.5), training(20, 2, 0, 0.0)),
        notebook("b", 0, 5),
    ])
    a, b = load_sessions(path)
    assert (a.id, a.start, a.stop) == ("a", 600.0, 6000.0)
    assert [c.start for c in a.cells] == [1200.0, 3000.0]
    assert (a.cells[1].duration, a.cells[1].gpus, a.cells[1].vram) == (180.0, 4, int(2.5 * GB))
    assert a.peak_gpus == 4 and b.peak_gpus == 0 and b.cells == ()


def test_not_json_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('{\n  "sessions": [\n    {"start_tick": 1,,}\n  ]\n}')
    with pytest.raises(TraceError) as e:
        load_sessions(path)
    assert str(path) in str(e.value) and "line 3" in str(e.value)


@pytest.mark.parametrize(("change", "where", "field"), [
    (lambda s: s.pop("stop_tick"), "$.sessions[1]", "stop_tick"),
    (lambda s: s.update(start_tick="soon"), "$.sessions[1]", "start_tick"),
    (lambda s: s.update(stop_tick=-1), "$.sessions[1]", "stop_tick"),
    (lambda s: s["trainings"][1].update(gpus=1.5), "$.sessions[1].trainings[1]", "gpus"),
    (lambda s: s["trainings"][1].pop("duration_in_ticks"), "$.sessions[1].trainings[1]", "duration_in_ticks"),
    (lambda s: s["trainings"][1].update(vram=float("nan")), "$.sessions[1].trainings[1]", "vram"),
    (lambda s: s.update(trainings={}), "$.sessions[1]", "trainings"),
])
def test_a_bad_session_names_its_json_path_and_field(tmp_path: Path, change: object, where: str,
                                                     field: str) -> None:
    good = notebook("ok", 0, 10, training(1, 1, 1, 1.0))
    bad = notebook("bad", 0, 10, training(1, 1, 1, 1.0), training(3, 1, 1, 1.0))
    change(bad)  # type: ignore[operator]
    path = write_notebooks(tmp_path / "nb.json", [good, bad])
    with pytest.raises(TraceError) as e:
        load_sessions(path)
    assert (e.value.path, e.value.where, e.value.field) == (str(path), where, field)
    assert str(e.value).startswith(f"{path}: {where}: {field}: ")


def test_no_sessions_list_says_so(tmp_path: Path) -> None:
    path = tmp_path / "nb.json"
    path.write_text('{"workloadTitle": "x"}')
    with pytest.raises(TraceError, match=r"\$: sessions: missing"):
        load_sessions(path)


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"nope\.json"):
        load_sessions(tmp_path / "nope.json")


def test_pods_that_ran_and_asked_for_gpus(tmp_path: Path) -> None:
    path = write_pods(tmp_path / "pods.csv", [
        pod("whole", 1, 1000, 100, 400),
        pod("share", 1, 460, 0, 50),
        pod("eight", 8, 1000, 10, 20),
        pod("cpu", 0, 0, 10, 20),
        pod("pending", 1, 500, "", ""),
    ])
    pods = {p.name: p for p in load_pods(path)}
    assert set(pods) == {"whole", "share", "eight"}
    assert (pods["whole"].gpus, pods["whole"].fraction, pods["whole"].duration) == (1, 1.0, 300.0)
    assert pods["share"].fraction == pytest.approx(0.46)
    assert (pods["eight"].gpus, pods["eight"].fraction) == (8, 1.0)


def test_a_bad_pod_row_names_file_line_and_field(tmp_path: Path) -> None:
    path = write_pods(tmp_path / "pods.csv", [pod("a", 1, 1000, 0, 10), pod("b", 1, 1000, 0, "later")])
    with pytest.raises(TraceError) as e:
        load_pods(path)
    assert (e.value.where, e.value.field) == ("line 3", "deletion_time")
    assert str(path) in str(e.value)


def test_a_share_out_of_range_is_refused(tmp_path: Path) -> None:
    path = write_pods(tmp_path / "pods.csv", [pod("a", 1, 1500, 0, 10)])
    with pytest.raises(TraceError, match=r"line 2: gpu_milli: expected 1\.\.1000"):
        load_pods(path)


def test_a_missing_column_is_named(tmp_path: Path) -> None:
    header = ["name", "num_gpu", "gpu_milli", "scheduled_time"]
    path = write_pods(tmp_path / "pods.csv", [["a", "1", "1000", "0"]], header=header)
    with pytest.raises(TraceError, match="line 1: deletion_time: missing column"):
        load_pods(path)


def test_jobs_are_drawn_reproducibly_within_the_window(tmp_path: Path) -> None:
    path = write_pods(tmp_path / "pods.csv", [pod(f"p{i}", 1, 1000, 0, 100 + i) for i in range(20)])
    pods = load_pods(path)
    first = sample_jobs(pods, 10, 1000.0, 2000.0, seed=7)
    assert first == sample_jobs(pods, 10, 1000.0, 2000.0, seed=7)
    assert first != sample_jobs(pods, 10, 1000.0, 2000.0, seed=8)
    assert len({j.id for j in first}) == 10
    assert all(1000.0 <= j.arrival < 2000.0 for j in first)
    assert [j.arrival for j in first] == sorted(j.arrival for j in first)
    with pytest.raises(ValueError, match="at most 20 pods"):
        sample_jobs(pods, 21, 0.0, 1.0, seed=0)
