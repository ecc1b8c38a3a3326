"""Bounded numbers, ASCII quantities, per-user caps, and other users' leases in reasons: no
stored figure breaks a node-wide view, and no user reads another's lease ids or job names."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.agent import AgentProcess, http_bytes, raw_request
from node_agent import cli
from node_agent.devices.simulated import SimulatedBackend
from node_agent.ledger import Ledger
from node_agent.metrics import render_metrics
from node_agent.policy import JOB, NOTEBOOK
from node_agent.quantities import (
    GiB,
    QuantityError,
    format_bytes,
    format_duration,
    parse_kai_gpu_memory,
    parse_quantity,
)
from node_agent.request_bodies import (
    ApiError,
    parse_create_lease,
    parse_observation,
    parse_pid,
    parse_resize,
    parse_usage,
)
from node_agent.service import Agent, AgentConfig, Caller, CreateLease, OverQuota, Resize
from node_agent.stats import Observation

ALICE, BOB, ADMIN = Caller(uid=1000), Caller(uid=1001), Caller(uid=0, admin=True)

# JSON numbers no field takes: past 2^63, past a float, not finite, negative, booleans.
ABSURD = ["1" + "0" * 400, "-" + "1" * 400, "9223372036854775808", "1e308", "-1e308", "1e400",
          "Infinity", "-Infinity", "NaN", "-1", "true", "false"]
# Per endpoint, its numeric fields and the rest of a body that is otherwise valid.
NUMERIC = [
    ("POST", "/v1/leases", {"client": "t", "request": "0.25"},
     ["devices", "request", "limit", "compute_request", "compute_limit"]),
    ("PATCH", "/v1/leases/{id}", {}, ["request", "limit", "compute_request", "compute_limit"]),
    ("POST", "/v1/leases/{id}/pids", {}, ["pid"]),
    ("POST", "/v1/leases/{id}/usage", {}, ["bytes"]),
    ("POST", "/v1/leases/{id}/observations", {"kind": "checkpoint", "trigger": "cell",
                                               "bytes": 1}, ["bytes", "written_bytes", "seconds"]),
    ("POST", "/v1/leases/{id}/observations", {"kind": "offload", "reason": "park"}, ["bytes"]),
    ("POST", "/v1/leases/{id}/park", {}, ["reason"]),
]
CASES = [(method, path, base, name) for method, path, base, names in NUMERIC for name in names]


def ask(request: str, kind: str = NOTEBOOK, devices: int = 1, name: str = "",
        limit: str | None = None) -> CreateLease:
    wanted = parse_quantity(request, "request")
    return CreateLease(kind=kind, client="t", request=wanted, devices=devices, name=name,
                       limit=parse_quantity(limit, "limit") if limit else wanted)


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    ledger = Ledger(tmp_path / "state")
    agent = Agent(SimulatedBackend("2x1GiB"), ledger, AgentConfig())
    asyncio.run(agent.tick())
    yield agent
    ledger.close()


# --- the parsers -------------------------------------------------------------------------
def _body(base: dict[str, object], name: str, raw: str) -> dict[str, object]:
    body: dict[str, object] = json.loads(json.dumps(base))
    body[name] = json.loads(raw)
    return body


@pytest.mark.parametrize("raw", ABSURD)
@pytest.mark.parametrize("parse, base, name", [
    (parse_usage, {}, "bytes"), (parse_pid, {}, "pid"),
    (parse_create_lease, {"client": "t", "request": "0.25"}, "devices"),
    (parse_observation, {"kind": "checkpoint", "trigger": "cell", "bytes": 1}, "bytes"),
    (parse_observation, {"kind": "checkpoint", "trigger": "cell", "bytes": 1}, "written_bytes"),
    (parse_observation, {"kind": "checkpoint", "trigger": "cell", "bytes": 1}, "seconds"),
    (parse_observation, {"kind": "offload", "reason": "park"}, "bytes"),
    (parse_resize, {}, "request"), (parse_resize, {}, "compute_limit"),
])
def test_every_number_is_range_checked_and_named(parse: object, base: dict[str, object],
                                                 name: str, raw: str) -> None:
    with pytest.raises(ApiError) as refused:
        parse(_body(base, name, raw))  # type: ignore[operator]
    assert (refused.value.status, refused.value.field) == (400, name)
    assert 0 < len(refused.value.message) < 300  # what was expected, in a line


def test_the_largest_values_are_taken() -> None:
    assert parse_usage({"bytes": 2**63 - 1}) == 2**63 - 1
    assert parse_pid({"pid": 2**31 - 1}) == 2**31 - 1
    assert parse_observation({"kind": "checkpoint", "trigger": "cell", "bytes": 0,
                              "seconds": 86400}).seconds == 86400.0


# --- what is stored never breaks a view ---------------------------------------------------
def test_an_absurd_usage_or_observation_never_breaks_metrics_or_the_poll(agent: Agent) -> None:
    lease = agent.create_lease(ADMIN, ask("0.25"))
    agent.report_usage(ADMIN, lease.id, 10**400)  # past the API's bounds: the service clamps
    asyncio.run(agent.tick())
    # And never above what the node confirms: no process of the lease is on its GPU.
    assert agent.ledger.leases[lease.id].usage == 0
    agent.stats.observed(Observation("offload", "park", 10**400))
    agent.stats.observed(Observation("checkpoint", "cell", 10**400, 10**400, float("inf")))
    agent.stats.observed(Observation("checkpoint", "cell", 1, 1, float("nan")))
    text = render_metrics(agent, ADMIN)
    assert 'gpufrac_offloaded_bytes_total{hostname=' in text or "gpufrac_offloaded_bytes" in text
    assert "inf" not in text.replace("+Inf", "").lower()


def test_sizes_and_spans_format_whatever_they_are_given() -> None:
    assert format_bytes(10**400).endswith("TiB") and format_bytes(-(10**400)).endswith("TiB")
    assert format_duration(float("nan")) == "0 s" and format_duration(float("-inf")) == "0 s"
    assert " h" in format_duration(float("inf"))


# --- quantities ---------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["1_000_000_000", "٤Gi", "٤", "\uff11Gi", "4_096Mi", "1_0", "0.2_5",
                                  "²"])
def test_quantities_take_ascii_digits_only(text: str) -> None:
    with pytest.raises(QuantityError) as refused:
        parse_quantity(text, "request")
    assert refused.value.field == "request" and "ASCII digits only" in refused.value.message


@pytest.mark.parametrize("text", ["٤", "²", "4_096", "١٠٢٤"])
def test_kai_gpu_memory_takes_ascii_digits_only(text: str) -> None:
    with pytest.raises(QuantityError):
        parse_kai_gpu_memory(text)


@settings(max_examples=300, deadline=None)
@given(st.one_of(
    st.floats(min_value=1e-9, max_value=1.0),
    st.integers(min_value=2, max_value=2**50),
    st.builds(lambda n, unit: f"{n}{unit}", st.integers(1, 999),
              st.sampled_from(["", "K", "M", "G", "T", "Ki", "Mi", "Gi", "Ti", "GiB", "MB"])),
    st.text(alphabet="0123456789._٤١ KMGiT", max_size=8),
))
def test_a_quantity_reads_back_from_its_spec(value: object) -> None:
    try:
        quantity = parse_quantity(value, "request")
    except QuantityError:
        return
    assert quantity.spec.isascii() and "_" not in quantity.spec
    assert parse_quantity(quantity.spec, "request") == quantity


# --- per-user caps --------------------------------------------------------------------------
def test_per_user_caps_on_bytes_and_gpus(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "state")
    agent = Agent(SimulatedBackend("4x1GiB"), ledger,
                  AgentConfig(max_bytes_per_user=2 * GiB, max_gpus_per_user=1))
    asyncio.run(agent.tick())
    first = agent.create_lease(ALICE, ask("0.5"))
    agent.create_lease(ALICE, ask("0.25"))
    with pytest.raises(OverQuota) as gpus:
        agent.create_lease(ALICE, ask("0.5"))
    assert gpus.value.field == "request" and "max_gpus_per_user" in gpus.value.message
    assert "0.75 GPU(s) in 2 other lease(s)" in gpus.value.message
    with pytest.raises(OverQuota) as grown:
        agent.resize(ALICE, first.id, Resize(request=parse_quantity("1", "request")))
    assert "max_gpus_per_user" in grown.value.message
    assert agent.ledger.leases[first.id].request == first.request, "nothing half-applied"
    # Within the cap a resize goes through; another user has a cap of their own.
    agent.resize(ALICE, first.id, Resize(request=parse_quantity("0.75", "request")))
    agent.create_lease(BOB, ask("0.5"))
    # Admins are not capped.
    agent.create_lease(ADMIN, ask("1", kind=JOB, devices=2))
    ledger.close()

    ledger = Ledger(tmp_path / "state2")
    agent = Agent(SimulatedBackend("4x1GiB"), ledger, AgentConfig(max_bytes_per_user=GiB))
    asyncio.run(agent.tick())
    agent.create_lease(ALICE, ask("0.5"))
    with pytest.raises(OverQuota) as nbytes:
        agent.create_lease(ALICE, ask("0.5", devices=2))
    assert nbytes.value.field == "request" and "max_bytes_per_user" in nbytes.value.message
    assert "you reserve" in nbytes.value.message and "(--max-bytes-per-user)" in (
        nbytes.value.message)
    ledger.close()


def test_the_caps_are_serve_options() -> None:
    app = cli.ServeApp()
    app.parse_command_line(["--max-bytes-per-user", "160Gi", "--max-gpus-per-user", "2"])
    config = app.agent_config()
    assert (config.max_bytes_per_user, config.max_gpus_per_user) == (160 * GiB, 2)


# --- other users' leases and names ------------------------------------------------------------
SECRET = 'train "secret-project"\nrm -rf, a name far longer than forty characters'


def test_a_waiting_job_sees_its_own_notebooks_by_name_and_others_as_counts(agent: Agent) -> None:
    home = agent.create_lease(BOB, ask("0.25", limit="1"))
    spread = agent.create_lease(BOB, ask("0.25", limit="1", name="bob's notebook"))
    assert spread.physical != home.physical
    job = agent.create_lease(ALICE, ask("1", kind=JOB, name=SECRET))
    assert job.state == "pending"
    assert spread.id not in job.reason and "bob's notebook" not in job.reason
    assert job.reason.endswith("another user's notebook from GPU 1"), job.reason
    # The notebook that moves reads why without the job's name or id.
    moved = agent.ledger.leases[spread.id]
    assert moved.state == "migrating"
    assert job.id not in moved.reason and "secret" not in moved.reason
    assert moved.reason.endswith("for another user's job"), moved.reason


def test_a_users_own_leases_are_named_quoted_and_cut(agent: Agent) -> None:
    agent.create_lease(ALICE, ask("0.25", limit="1"))
    spread = agent.create_lease(ALICE, ask("0.25", limit="1", name="mine"))
    job = agent.create_lease(ALICE, ask("1", kind=JOB, name=SECRET))
    assert f'notebook "mine" ({spread.id}) from GPU 1' in job.reason
    moved = agent.ledger.leases[spread.id]
    quoted = json.dumps(SECRET[:39] + "…", ensure_ascii=False)
    assert moved.reason.endswith(f"for job {quoted} ({job.id})"), moved.reason
    assert "\n" not in moved.reason


def test_a_long_notebook_path_is_cut_at_its_start_so_its_file_name_stays(agent: Agent) -> None:
    path = "/home/alice/projects/" + "deep/" * 10 + "train.ipynb"
    agent.create_lease(ALICE, ask("0.25", limit="1"))
    spread = agent.create_lease(ALICE, ask("0.25", limit="1", name=path))
    job = agent.create_lease(ALICE, ask("1", kind=JOB))
    quoted = json.dumps("…" + path[-39:], ensure_ascii=False)
    assert f"notebook {quoted} ({spread.id}) from GPU 1" in job.reason
    assert agent.waiting_for(job, ALICE.uid)[0]["who"] == f"notebook {quoted} ({spread.id})"


# --- the real agent, fuzzed ---------------------------------------------------------------
@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[AgentProcess, str]]:
    with AgentProcess(tmp_path_factory.mktemp("bounds"), "2x1GiB",
                      ["--poll-interval", "0.05"]) as agent:
        yield agent, agent.client().create_lease(client="bounds", request="0.25")["id"]


def _status_ok(agent: AgentProcess) -> None:
    out = subprocess.run([sys.executable, "-m", "node_agent", "--socket", agent.socket,
                          "status"], capture_output=True, text=True, timeout=30, check=False)
    assert out.returncode == 0, out.stderr[-2000:]


@settings(max_examples=150, deadline=None)
@given(case=st.sampled_from(CASES), raw=st.sampled_from(ABSURD) | st.one_of(
    st.integers(min_value=2**63), st.integers(max_value=-1), st.floats(min_value=1e20),
    st.floats(max_value=-1e-300), st.sampled_from([float("inf"), float("-inf"), float("nan")]),
).map(lambda v: json.dumps(v)))
def test_an_absurd_number_is_a_400_naming_its_field_and_views_stay_up(
    served: tuple[AgentProcess, str], case: tuple[str, str, dict[str, object], str], raw: str
) -> None:
    agent, lease = served
    method, path, base, name = case
    if name == "reason" and raw in ("true", "false"):
        raw = json.dumps("x" * 201)  # a reason too long for people, beside numbers for text
    body = json.dumps(base)[:-1] + (", " if base else "") + f'"{name}": {raw}' + "}"
    status, answer = raw_request(agent.socket, http_bytes(
        method, path.replace("{id}", lease), body.encode()), timeout=10)
    assert status == 400 and answer["error"]["field"] == name, (body[:200], status, answer)
    assert raw_request(agent.socket, http_bytes("GET", "/metrics"))[0] == 200


def test_after_the_fuzzing_status_and_metrics_answer(served: tuple[AgentProcess, str]) -> None:
    agent, lease = served
    # The largest taken figures, at their bounds, keep every view working.
    for method, path, body in (
        ("POST", f"/v1/leases/{lease}/usage", {"bytes": 2**63 - 1}),
        ("POST", f"/v1/leases/{lease}/observations", {"kind": "offload", "reason": "park",
                                                      "bytes": 2**63 - 1}),
        ("POST", f"/v1/leases/{lease}/observations", {"kind": "checkpoint", "trigger": "cell",
                                                      "bytes": 2**63 - 1,
                                                      "written_bytes": 2**63 - 1,
                                                      "seconds": 86400}),
    ):
        for _ in range(3):
            status, answer = raw_request(agent.socket, http_bytes(
                method, path, json.dumps(body).encode()))
            assert status == 204, answer
    _status_ok(agent)
    assert raw_request(agent.socket, http_bytes("GET", "/metrics"))[0] == 200
    log = agent.log_text()
    assert "Traceback" not in log and "OverflowError" not in log, log[-3000:]
