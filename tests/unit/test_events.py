"""The event contract: one payload model per kind, checked when an event is made."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from planaria import rundir
from planaria.events import (
    PAYLOADS,
    EventKind,
    HangDetected,
    JobEvent,
    NodeReplaced,
    NodeReplacementFailed,
    Recovered,
    StopCause,
    table,
)
from planaria.master.timeline import Timeline

DOCS = Path(__file__).resolve().parents[2] / "docs" / "events.md"


def test_every_kind_has_its_own_payload_model():
    assert set(PAYLOADS) == set(EventKind)
    assert len(set(PAYLOADS.values())) == len(EventKind)
    assert all(model.KIND is kind for kind, model in PAYLOADS.items())


def test_data_is_checked_against_its_kind():
    good = {"host": "h1", "replacement": "n2", "replacement_host": "h2"}
    event = JobEvent(kind=EventKind.NODE_REPLACED, job="j", node="n1", data=good)
    assert isinstance(event.payload, NodeReplaced)
    assert event.payload.replacement_host == "h2" and event.payload.excluded_host is None
    assert event.data == good  # a field without a value is left out
    with pytest.raises(ValidationError, match="ok: Extra inputs are not permitted"):
        JobEvent(kind=EventKind.NODE_REPLACED, job="j", data={**good, "ok": False})
    with pytest.raises(ValidationError, match="replacement_host: Field required"):
        JobEvent(kind=EventKind.NODE_REPLACED, job="j", data={"host": "h", "replacement": "n"})
    with pytest.raises(ValidationError, match="not a NodeReplaced payload"):
        JobEvent(kind=EventKind.NODE_REPLACED, job="j")  # no data is no payload either
    with pytest.raises(ValidationError, match="cause"):
        JobEvent(kind=EventKind.JOB_STOPPED, job="j", data={"cause": "bored"})


def test_a_payload_makes_its_event_and_comes_back_from_the_json_line(tmp_path):
    seen: list[JobEvent] = []
    timeline = Timeline(tmp_path / "events.jsonl", "j", seen.append)
    failed = NodeReplacementFailed(host="h1", error="no host left", nodes_left=1, action="stop")
    timeline.emit(failed, "replacing n1 failed", node="n1")
    timeline.emit(Recovered(fault="hang", round=2, recovery_s=1.5), "recovered", node="n0")
    timeline.close()
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    assert [json.loads(line)["kind"] for line in lines] == [
        "node_replacement_failed",
        "recovered",
    ]
    assert json.loads(lines[1])["data"] == {"fault": "hang", "round": 2, "recovery_s": 1.5}
    back = [JobEvent.from_line(line) for line in lines]
    assert back == seen
    assert back[0].payload == failed and back[0].node == "n1"


def test_a_timeline_left_with_a_partial_line_is_appended_to_on_a_line_of_its_own(tmp_path):
    """A master that died mid-write left half a line: the next master (a resume) starts its
    events on a new line, so that the damage stays one line at the end of the old ones."""
    path = tmp_path / "events.jsonl"
    whole = JobEvent.of(Recovered(fault="hang", round=2, recovery_s=1.5), job="j")
    half = JobEvent.of(Recovered(fault="hang", round=3, recovery_s=2.5), job="j")
    text = half.model_dump_json()
    path.write_text(whole.model_dump_json() + "\n" + text[: len(text) // 2])
    timeline = Timeline(path, "j", lambda event: None)
    later = timeline.emit(Recovered(fault="hang", round=4, recovery_s=3.5), "recovered")
    timeline.close()
    lines = path.read_text().splitlines()
    assert len(lines) == 3 and lines[1] == text[: len(text) // 2]
    assert JobEvent.from_line(lines[0]) == whole and JobEvent.from_line(lines[2]) == later
    assert rundir.events(tmp_path) == [whole, later]  # the half line skipped, with a warning

    Timeline(path, "j", lambda event: None).close()  # a whole last line: nothing added
    assert path.read_text().splitlines() == lines


def test_nested_models_keep_their_fields():
    rank = {
        "rank": 1,
        "local_rank": 1,
        "pid": 7,
        "step": 3,
        "stalled_s": 5.0,
        "state": "T (stopped)",
        "stack": "Thread 1",
    }
    data = {"secondary": False, "round": 1, "timeout": 4.0, "ranks": [rank]}
    event = JobEvent(kind=EventKind.HANG_DETECTED, job="j", data=data)
    payload = event.payload
    assert isinstance(payload, HangDetected)
    assert payload.ranks[0].state == "T (stopped)" and payload.fault_class == "transient"
    with pytest.raises(ValidationError, match=r"ranks\.0\.stack: Field required"):
        JobEvent(kind=EventKind.HANG_DETECTED, job="j", data={**data, "ranks": [{"rank": 1}]})


def test_lines_of_an_older_timeline_are_read_with_todays_kinds():
    old = [
        {"kind": "workers_restarted", "message": "recovered from hang in 2.00s",
         "data": {"recovery_s": 2.0, "steps_lost": 0, "round": 2}},
        {"kind": "node_replaced", "message": "replacing node-1 failed: no host left",
         "data": {"ok": False}},
        {"kind": "node_replaced", "message": "node node-1 (h) stopped, not replaced: cap",
         "data": {"ok": False}},
        {"kind": "rendezvous_completed", "message": "round 1", "data": {"round": 1}},
    ]  # fmt: skip
    lines = [json.dumps({"job": "j", "time": 1.0, "node": "node-1", **raw}) for raw in old]
    events = [JobEvent.from_line(line) for line in lines]
    assert [e.kind for e in events] == [
        EventKind.RECOVERED,
        EventKind.NODE_REPLACEMENT_FAILED,
        EventKind.NODE_REMOVED,
        EventKind.RENDEZVOUS_COMPLETED,
    ]
    assert events[0].data["recovery_s"] == 2.0 and events[1].node == "node-1"
    with pytest.raises(ValidationError):
        JobEvent.from_line(json.dumps({"kind": "no_such_kind", "job": "j", "time": 1.0}))


def test_stop_causes_are_strings_an_observer_can_match():
    event = JobEvent(kind=EventKind.JOB_STOPPED, job="j", data={"cause": "too_few_nodes"})
    assert event.payload == PAYLOADS[EventKind.JOB_STOPPED](cause=StopCause.TOO_FEW_NODES)
    assert event.data == {"state": "failed", "cause": "too_few_nodes"}


def test_the_docs_list_every_kind_and_its_fields():
    text = DOCS.read_text()
    assert table() in text, "docs/events.md is stale: paste planaria.events.table() into it"
    for kind in EventKind:
        assert f"`{kind.value}`" in text
    for cause in StopCause:
        assert f"`{cause.value}`" in text, f"docs/events.md does not name the cause {cause.value}"
