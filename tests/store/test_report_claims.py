"""A worker's terminal report counts only when its message's batch, index and task name match the child's row.

A message carrying a pending child's task id but another batch, index or task name is refused: no child, counter,
successor or outbox row moves, the refusal is counted on the child's own batch (`status` shows it), and the same
child's genuine report still counts afterwards.
"""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import Engine

from celery_fanin import protocol
from celery_fanin.store import batches, queries
from celery_fanin.store.reports import record_terminal

from .helpers import create, json_encoded, new_batch, report, snapshot


def _claimed(
    engine: Engine, task_id: str, claim: batches.Claim, state: str = "succeeded", result: object = 1
) -> batches.TerminalRecord:
    """A report whose message claims `claim` (its batch, index, task name)."""
    return report(engine, task_id, state, result=json_encoded(result), claim=claim)


def _refused_metric() -> float:
    """The worker's `fanin_worker_reports_refused` counter, as Prometheus exports it."""
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("fanin_worker_reports_refused_total") or 0.0


def _refused(engine: Engine, batch_id: uuid.UUID) -> int:
    with engine.connect() as conn:
        found = queries.batch(conn, batch_id)
    assert found is not None
    return found.refused_reports


@pytest.mark.parametrize(
    "wrong",
    [
        pytest.param({"batch_id": "00000000-0000-4000-8000-000000000000"}, id="another batch"),
        pytest.param({"index": 1}, id="another index"),
        pytest.param({"index": None}, id="no index"),
        pytest.param({"task_name": "t.forged"}, id="another task name"),
    ],
)
def test_a_report_whose_message_disagrees_with_the_child_is_refused_and_changes_nothing(
    store_engine: Engine, wrong: dict[str, object]
) -> None:
    batch, children, _ = create(store_engine, 2)
    child = children[0]
    good = batches.Claim(str(batch.id), 0, child.task_name)
    forged = batches.Claim(**{**good.__dict__, **wrong})  # type: ignore[arg-type]
    before = snapshot(store_engine, batch.id, ignore=frozenset({"refused_reports"}))

    rec = report(store_engine, child.task_id, result=json_encoded("forged"), claim=forged)

    assert rec == batches.TerminalRecord(counted=False, remaining=None, successor_created=False, refused=True)
    assert snapshot(store_engine, batch.id, ignore=frozenset({"refused_reports"})) == before
    assert _refused(store_engine, batch.id) == 1  # counted on the child's own batch
    # The genuine report still counts the child.
    assert report(store_engine, child.task_id, result=json_encoded(1), claim=good).counted
    assert _claimed(store_engine, children[1].task_id, batches.Claim(str(batch.id), 1, "t.child")).successor_created


def test_a_late_report_that_disagrees_is_refused_not_recorded_late(store_engine: Engine) -> None:
    batch, children, _ = create(store_engine, 2)
    good = batches.Claim(str(batch.id), 0, "t.child")
    assert _claimed(store_engine, children[0].task_id, good).counted
    late = _claimed(store_engine, children[0].task_id, good, state="failed")
    assert (late.late, late.refused) == (True, False)
    refused = _claimed(store_engine, children[0].task_id, batches.Claim(str(batch.id), 0, "t.other"), state="failed")
    assert (refused.counted, refused.late, refused.refused) == (False, False, True)
    assert _refused(store_engine, batch.id) == 1


def test_an_unknown_task_id_is_neither_counted_nor_refused(store_engine: Engine) -> None:
    batch, _, _ = create(store_engine, 1)
    rec = _claimed(store_engine, f"nobody-{uuid.uuid4()}", batches.Claim(str(batch.id), 0, "t.child"))
    assert (rec.counted, rec.late, rec.refused) == (False, False, False)
    assert _refused(store_engine, batch.id) == 0


def test_a_claim_without_a_task_name_checks_batch_and_index(store_engine: Engine) -> None:
    """A chain child published before HEADER_TASK existed: its earlier task's failure names no child task."""
    batch, children, _ = create(store_engine, 2)
    assert _claimed(store_engine, children[0].task_id, batches.Claim(str(batch.id), 1, None)).refused
    assert _claimed(store_engine, children[0].task_id, batches.Claim(str(batch.id), 0, None), state="failed").counted


def test_the_report_connection_sends_the_claim(store_engine: Engine, app: object) -> None:
    """The hooks' own path (`ReportConnection`, one statement): a forged claim is refused there too."""
    from celery_fanin import FanIn

    fanin = FanIn.of(app)  # type: ignore[arg-type]
    batch, children, _ = create(store_engine, 1)
    forged = record_terminal(
        fanin.reports,
        children[0].task_id,
        "succeeded",
        result=json_encoded(1),
        claim=batches.Claim(str(uuid.uuid4()), 0, "t.child"),
    )
    assert forged.refused and not forged.counted
    good = record_terminal(
        fanin.reports,
        children[0].task_id,
        "succeeded",
        result=json_encoded(1),
        claim=batches.Claim(str(batch.id), 0, "t.child"),
    )
    assert good.counted and good.successor_created


def test_a_tree_child_is_claimed_by_its_root_and_index(store_engine: Engine) -> None:
    """A tree's children are rows of its leaves; their messages name the root and the index in the whole batch."""
    batch, children = new_batch(4)
    with store_engine.begin() as conn:
        batches.create_batch(conn, batch, children, leaves=2)
    other, _, _ = create(store_engine, 1)
    assert _claimed(store_engine, children[3].task_id, batches.Claim(str(other.id), 3, "t.child")).refused
    assert _claimed(store_engine, children[3].task_id, batches.Claim(str(batch.id), 2, "t.child")).refused
    claims = [batches.Claim(str(batch.id), i, "t.child") for i in range(4)]
    recs = [_claimed(store_engine, c.task_id, claim) for c, claim in zip(children, claims, strict=True)]
    assert all(r.counted for r in recs) and recs[-1].successor_created
    # Counted on the child's own batch (the tree's root, which `status` reads), not on the batch the message named.
    assert (_refused(store_engine, batch.id), _refused(store_engine, other.id)) == (2, 0)


def test_the_worker_hook_logs_a_refused_claimed(
    store_engine: Engine, app: object, caplog: pytest.LogCaptureFixture
) -> None:
    from celery_fanin import FanIn
    from celery_fanin.worker import runtime

    fanin = FanIn.of(app)  # type: ignore[arg-type]
    batch, children, _ = create(store_engine, 1)
    forged = protocol.Marker(str(batch.id), 0, None, task_name="t.forged")
    before = _refused_metric()
    with caplog.at_level("WARNING", logger="celery_fanin.hooks"):
        rec = runtime.current.reporter.record_child(
            fanin, children[0].task_id, forged, "succeeded", value=1, has_value=True
        )
    assert rec is not None and rec.refused and not rec.counted
    assert "report refused" in caplog.text and children[0].task_id in caplog.text
    assert _refused_metric() == before + 1
    genuine = protocol.Marker(str(batch.id), 0, None, task_name="t.child")
    rec = runtime.current.reporter.record_child(
        fanin, children[0].task_id, genuine, "succeeded", value=1, has_value=True
    )
    assert rec is not None and rec.counted and rec.successor_created


def test_a_message_refused_by_its_claim_is_counted_on_the_child_and_moves_nothing(
    store_engine: Engine, app: object, caplog: pytest.LogCaptureFixture
) -> None:
    """The worker's own refusal (`Reporter.refuse`: the headers disagree with the claim in the signed body) goes
    through the store's report statement with a claim no child matches: counted where a refused report is."""
    from celery_fanin import FanIn
    from celery_fanin.worker import runtime

    fanin = FanIn.of(app)  # type: ignore[arg-type]
    batch, children, _ = create(store_engine, 2)
    before, metric = snapshot(store_engine, batch.id, ignore=frozenset({"refused_reports"})), _refused_metric()
    genuine = protocol.Marker(str(batch.id), 1, None, task_name="t.child")
    with caplog.at_level("WARNING", logger="celery_fanin.hooks"):
        runtime.current.reporter.refuse(fanin, children[1].task_id, genuine, "its headers differ")
    assert "report refused" in caplog.text and "its headers differ" in caplog.text
    assert snapshot(store_engine, batch.id, ignore=frozenset({"refused_reports"})) == before
    assert (_refused(store_engine, batch.id), _refused_metric()) == (1, metric + 1)
    # The child's genuine report still counts.
    rec = runtime.current.reporter.record_child(
        fanin, children[1].task_id, genuine, "succeeded", value=1, has_value=True
    )
    assert rec is not None and rec.counted


def test_claim_refusal_compares_the_body_with_the_headers(app: object) -> None:
    from celery import Celery

    from celery_fanin import FanIn
    from celery_fanin.worker.reporter import claim_refusal

    assert isinstance(app, Celery)
    fanin = FanIn.of(app)
    headers = {"id": "t-1", "task": "t.child", "retries": 0, protocol.HEADER_BATCH: "b", protocol.HEADER_INDEX: 2}
    body: tuple[list[object], dict[str, object], dict[str, object]] = ([], {}, {"callbacks": None})
    protocol.put_claim(body, headers)
    claimed = {"id": "t-1", "task": "t.child", "retries": "0", "fanin_batch": "b", "fanin_index": "2"}
    assert protocol.body_claim(body) == claimed
    assert claim_refusal(fanin, headers, protocol.body_claim(body)) is None
    for changed in (
        {"id": "t-2"},
        {"task": "t.other"},
        {protocol.HEADER_INDEX: 1},
        {protocol.HEADER_BATCH: "c"},
        {"expires": "2020-01-01T00:00:00+00:00"},  # would expire it: revoked
        {"timelimit": [0.1, None]},  # would time it out
        {"retries": 3},  # would make its first retryable failure its last
        {"eta": "2999-01-01T00:00:00+00:00"},  # would hold it back past child_timeout
    ):
        assert claim_refusal(fanin, {**headers, **changed}, protocol.body_claim(body)), changed
    assert claim_refusal(fanin, {**headers, protocol.HEADER_CHAIN: "t-9"}, protocol.body_claim(body))
    # No claim: taken without signing (an earlier release's message), refused with it.
    assert claim_refusal(fanin, headers, None) is None
    app.conf.task_serializer = "auth"
    try:
        assert claim_refusal(fanin, headers, None) == "its signed body carries no fan-in claim"
    finally:
        app.conf.task_serializer = "json"
    # A message of no batch carries no claim.
    plain: tuple[list[object], dict[str, object], dict[str, object]] = ([], {}, {})
    protocol.put_claim(plain, {"id": "t-3", "task": "t.plain"})
    assert protocol.body_claim(plain) is None
