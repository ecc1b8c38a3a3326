"""``python -m node_agent.simulator``: the tables, the figure, and what bad input says."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from node_agent.simulator import main
from node_agent.simulator.policies import scheduler_settings, site_policies

from .synth import notebook, pod, training, write_notebooks, write_pods


@pytest.fixture
def traces(tmp_path: Path) -> tuple[Path, Path]:
    sessions = [
        notebook("long", 0, 400, training(5, 3, 1, 2.0), training(40, 5, 1, 6.0), training(300, 2, 1, 3.0)),
        notebook("wide", 10, 200, training(20, 4, 4, 3.0), training(60, 2, 0, 0.0)),
        notebook("cpu", 0, 50, training(1, 1, 0, 0.0)),
    ]
    pods = [pod(f"p{i}", 1, 1000 if i % 2 else 400, 0, 600 + 60 * i) for i in range(8)]
    pods.append(pod("big", 4, 1000, 0, 3600))
    return write_notebooks(tmp_path / "nb.json", sessions), write_pods(tmp_path / "pods.csv", pods)


def test_prints_both_tables_and_writes_the_figure(traces: tuple[Path, Path], tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    nb, pods = traces
    out = tmp_path / "out"
    code = main(["--trace", str(nb), "--jobs", str(pods), "--jobs-sample", "5", "--seed", "3",
                 "--node", "4x16GiB", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    for p in site_policies(900) + scheduler_settings(site_policies(900)[3]):
        assert f"\n{p.name} " in captured.out
    assert "held/use" in captured.out and "3 sessions (2 use a GPU" in captured.out
    assert "Jobs: 5 of the 9 GPU pods" in captured.out
    assert "Freeze 0.9 s/GiB (7.2 s for 8 GiB), thaw 0.2625 s/GiB (2.1 s for 8 GiB)" in captured.out
    assert "slowdown" in captured.out and "thaw wait" in captured.out and "\ngpufrac+freeze " in captured.out
    assert "[1/12] reserve" in captured.err and "simulated 12 runs" in captured.err
    assert (out / "gpus-held.png").read_bytes().startswith(b"\x89PNG")
    figures = (out / "figures.md").read_text()
    assert "Site policies (issue 12)" in figures and "Model." in figures


def test_without_jobs_settings_or_figure(traces: tuple[Path, Path], tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    nb, _ = traces
    out = tmp_path / "out"
    assert main(["--trace", str(nb), "--no-settings", "--no-plot", "--quiet", "--nodes", "2",
                 "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "Jobs: none." in captured.out and "max 2 per GPU" not in captured.out
    assert "Cluster: 2 nodes of 8xA100-80GB." in captured.out
    assert captured.err == "" and not (out / "gpus-held.png").exists()


def test_without_matplotlib_the_table_still_comes_and_says_what_to_install(
        traces: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    nb, _ = traces
    code = main(["--trace", str(nb), "--no-settings", "--quiet", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 1
    assert "gpufrac+park" in captured.out
    assert "pip install matplotlib" in captured.err


@pytest.mark.parametrize(("args", "said"), [
    (["--node", "8xV100"], "Accepted: COUNTxMODEL (8xA100-80GB"),
    (["--jobs-sample", "50"], "at most 9 pods"),
    (["--node", "2x16GiB"], "session wide runs a cell on 4 GPUs but a node of 2x16GiB has 2"),
])
def test_bad_input_says_what_is_wrong(traces: tuple[Path, Path], tmp_path: Path, args: list[str], said: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    nb, pods = traces
    assert main(["--trace", str(nb), "--jobs", str(pods), "--out", str(tmp_path), *args]) == 2
    assert said in capsys.readouterr().err


@pytest.mark.parametrize(("args", "said"), [
    (["--park-after", "0"], "--park-after: expected seconds >= 1, got '0'"),
    (["--nodes", "two"], "--nodes: expected a count >= 1, got 'two'"),
])
def test_bad_numbers_are_refused_before_anything_runs(traces: tuple[Path, Path], args: list[str], said: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--trace", str(traces[0]), *args])
    assert e.value.code == 2 and said in capsys.readouterr().err


def test_a_trace_that_does_not_parse_names_file_place_and_field(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    nb = write_notebooks(tmp_path / "nb.json", [notebook("a", 0, 10, {"start_tick": 1, "gpus": 1})])
    assert main(["--trace", str(nb), "--out", str(tmp_path)]) == 2
    assert f"{nb}: $.sessions[0].trainings[0]: duration_in_ticks: missing" in capsys.readouterr().err

    pods = write_pods(tmp_path / "pods.csv", [pod("a", 1, 1000, 0, 10), pod("b", "x", 1000, 0, 10)])  # type: ignore[arg-type]
    good = write_notebooks(tmp_path / "ok.json", [notebook("a", 0, 10, training(1, 1, 1, 1.0))])
    assert main(["--trace", str(good), "--jobs", str(pods), "--out", str(tmp_path)]) == 2
    assert f"{pods}: line 3: num_gpu: expected a non-negative integer, got 'x'" in capsys.readouterr().err


def test_runs_as_a_module() -> None:
    done = subprocess.run([sys.executable, "-m", "node_agent.simulator", "--help"], capture_output=True,
                          text=True, timeout=60, check=True)
    assert "--park-after" in done.stdout and "--jobs-sample" in done.stdout



def test_gpufrac_agent_simulate_runs_it_and_passes_its_exit_status(
        traces: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from node_agent import cli

    nb, _ = traces
    assert cli.main(["simulate", "--trace", str(nb), "--no-settings", "--no-plot", "--quiet",
                     "--out", str(tmp_path)]) == 0
    assert "held/use" in capsys.readouterr().out
    assert cli.main(["simulate", "--trace", str(nb), "--node", "3xbananas"]) == 2
    assert "Accepted: COUNTxMODEL" in capsys.readouterr().err
    assert cli.main(["simulate", "--help"]) == 0
    assert "usage: gpufrac-agent simulate" in capsys.readouterr().out


def test_freeze_and_thaw_times_and_contention_are_options(traces: tuple[Path, Path], tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    nb, _ = traces
    assert main(["--trace", str(nb), "--no-settings", "--no-plot", "--quiet", "--out", str(tmp_path),
                 "--freeze-seconds-per-gib", "1", "--thaw-seconds-per-gib", "0.5", "--no-contention"]) == 0
    out = capsys.readouterr().out
    assert "Freeze 1 s/GiB (8 s for 8 GiB), thaw 0.5 s/GiB (4 s for 8 GiB)" in out
    assert "Compute contention: off" in out and "2.00x" not in out
    assert main(["--trace", str(nb), "--no-settings", "--no-plot", "--quiet", "--out", str(tmp_path),
                 "--cell-compute", "traced"]) == 0
    assert "traced utilisation" in capsys.readouterr().out
