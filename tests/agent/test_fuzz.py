"""Every endpoint of a real agent fuzzed with hypothesis: no request gets a 5xx or an answer
that is not a JSON error, and the agent lives on."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import quote, urlencode

import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.agent import AgentProcess, http_bytes, raw_request

FIELDS = ["kind", "request", "limit", "devices", "client", "kernel_id", "name", "pid", "bytes",
          "reason", "uid", "owner_uid", "x", "trigger", "written_bytes", "seconds"]
PATHS = ["/v1/node", "/v1/leases", "/v1/leases/{id}", "/v1/leases/{id}/pids",
         "/v1/leases/{id}/usage", "/v1/leases/{id}/observations", "/v1/leases/{id}/migrated",
         "/v1/leases/{id}/park", "/v1/leases/{id}/park-request", "/v1/leases/{id}/unpark",
         "/v1/directives", "/metrics", "/v1/nothing", "/"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40)
    | st.sampled_from(["0.25", "1", "1Gi", "2500M", "1e-300", "nan", "-1", "0", "9" * 33,
                       "notebook", "job", "1.5", "4Gi ", "checkpoint", "offload", "cell",
                       "shrink"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=3),
    max_leaves=8,
)

# Query numbers: anything, except a valid wait long enough to slow the run down.
query_numbers = st.one_of(
    st.sampled_from(["nan", "inf", "-inf", "1e999", "-2", "-1", "0", "0.01", "9" * 30, "",
                     "1_000", "0x10", " 1"]),
    st.floats().map(repr).filter(lambda v: not 0.1 < float(v) <= 60 if v != "nan" else True),
    st.integers().map(str),
    st.text(max_size=10),
)


ENDPOINTS = [
    ("GET", "/v1/node"), ("GET", "/v1/leases"), ("POST", "/v1/leases"),
    ("GET", "/v1/leases/{id}"), ("PATCH", "/v1/leases/{id}"), ("DELETE", "/v1/leases/{id}"),
    ("POST", "/v1/leases/{id}/pids"), ("POST", "/v1/leases/{id}/usage"),
    ("POST", "/v1/leases/{id}/observations"),
    ("POST", "/v1/leases/{id}/migrated"), ("POST", "/v1/leases/{id}/park"),
    ("POST", "/v1/leases/{id}/park-request"), ("POST", "/v1/leases/{id}/unpark"),
    ("GET", "/v1/directives"), ("GET", "/metrics"),
]
SPECIAL_BODIES = [b"", b"[]", b"null", b"{", b'"x"', b"[" * 5000, b'{"a": ' * 3000,
                  b"\xff\xfe", b'{"request": 1' + b"0" * 5000 + b"}"]
NOT_A_PROCESS = 4_194_305  # above the largest pid Linux hands out


def _harmless(body: dict[str, Any]) -> dict[str, Any]:
    # The fuzzer runs as root: a registered pid must never be a real process the agent
    # might one day stop.
    pid = body.get("pid")
    if isinstance(pid, int) and 0 <= pid < 2**31 and psutil.pid_exists(pid):
        body["pid"] = NOT_A_PROCESS
    return body


@st.composite
def requests(draw: Callable[..., Any]) -> bytes:
    method, path = draw(st.sampled_from(ENDPOINTS) | st.tuples(
        st.sampled_from(["GET", "POST", "PATCH", "DELETE", "PUT", "OPTIONS"]),
        st.sampled_from(PATHS)))
    lease = draw(st.sampled_from(["{lease}", "{lease}", "l-000000000000", "x" * 64, "-", "x" * 65,
                                  "l%20x", "%ff", "l.x"]))
    path = path.replace("{id}", lease)
    query: dict[str, str] = {}
    if path == "/v1/directives":
        query[draw(st.sampled_from(["client", "lease"]))] = draw(
            st.sampled_from(["fuzz", "{lease}", "", "x" * 300]) | st.text(max_size=20))
    for name in draw(st.sets(st.sampled_from(["after", "timeout", "client", "kinds", "x"]),
                             max_size=3)):
        query[name] = draw(
            query_numbers if name in ("after", "timeout")
            else st.sampled_from(["park", "park,unparked", "migrate,,park", "reboot", ""])
            | st.text(max_size=20) if name == "kinds" else st.text(max_size=20))
    if query:
        path += "?" + urlencode(query, quote_via=quote)
    if draw(st.integers(0, 3)):
        body = json.dumps(_harmless(draw(st.dictionaries(
            st.sampled_from(FIELDS), json_values, max_size=6)))).encode()
    else:
        body = draw(st.binary(max_size=64) | st.sampled_from(SPECIAL_BODIES))
    headers = draw(st.sampled_from(["", "Content-Type: application/json\r\n",
                                    "Authorization: token x\r\n", "Expect: 100-continue\r\n"]))
    return http_bytes(method, path, body, headers)


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[AgentProcess, str]]:
    """One agent for every example, and the id of a lease it holds."""
    with AgentProcess(tmp_path_factory.mktemp("fuzz"), "2x1GiB",
                      ["--poll-interval", "0.05"]) as agent:
        yield agent, agent.client().create_lease(client="fuzz", request="0.25")["id"]


@settings(max_examples=400, deadline=None)
@given(request=requests())
def test_no_request_gets_a_5xx_or_a_non_json_error(
    fuzzed: tuple[AgentProcess, str], request: bytes
) -> None:
    agent, lease = fuzzed
    request = request.replace(b"{lease}", lease.encode())
    status, answer = raw_request(agent.socket, request, timeout=10)
    assert status < 500, (request[:300], answer)
    if status >= 400:
        assert isinstance(answer, dict) and isinstance(answer["error"]["message"], str), answer
    # Alive and still answering properly after every request.
    assert raw_request(agent.socket, http_bytes("GET", "/v1/node"))[0] == 200


def test_the_fuzzed_agent_logged_no_crash(fuzzed: tuple[AgentProcess, str]) -> None:
    log = fuzzed[0].log_text()
    assert "Traceback" not in log and "Uncaught exception" not in log, log[-3000:]
