"""The least-privilege roles of docs/how-to/database-roles.md, tested: the very SQL files the page includes are run
in a throwaway database, the schema is migrated as the owner role, and then a producer, a worker's hooks, the
relay (with its recovery duties) and retention each run as their own role, and are refused what they must not do.

Roles are cluster-wide, so each run suffixes their names and drops them at the end.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

import psycopg
import pytest
from celery import Celery
from celery.canvas import Signature
from sqlalchemy import text
from sqlalchemy.engine import make_url

from celery_fanin import (
    BatchNotFound,
    BatchOutcome,
    FanIn,
    compensated,
    fan_in_group,
    protocol,
    saga,
    sagas,
)
from celery_fanin.ops import inspection, retention
from celery_fanin.producer import encoder
from celery_fanin.relay import Relay
from celery_fanin.store import batches
from celery_fanin.store.reports import record_starts
from celery_fanin.worker import runtime, successor_runs
from tests.conftest import ADMIN_URL
from tests.sql import SUCCESSOR_PREDICATES as PREDICATES

DOCS = Path(__file__).resolve().parents[2] / "docs" / "how-to"
ROLES = ("owner", "producer", "worker", "relay", "maintenance", "dashboard", "sagaworker")


@dataclass
class Cluster:
    database: str
    suffix: str

    def role(self, name: str) -> str:
        return f"fanin_{name}_{self.suffix}"

    def url(self, role: str) -> str:
        """A libpq URL for `role` on the throwaway database (the test server trusts local connections)."""
        base = make_url(ADMIN_URL).set(username=self.role(role), password=None, database=self.database)
        return base.render_as_string(hide_password=False)

    def sql(self, path: Path) -> str:
        """A documented SQL file with this run's role names."""
        return re.sub(r"\bfanin_(" + "|".join(ROLES) + r")\b", rf"fanin_\1_{self.suffix}", path.read_text())


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    suffix = uuid.uuid4().hex[:8]
    c = Cluster(f"fanin_roles_{suffix}", suffix)
    with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{c.database}"')  # generated identifiers, not input
    try:
        with psycopg.connect(
            make_url(ADMIN_URL).set(database=c.database).render_as_string(False), autocommit=True
        ) as admin:
            admin.execute(c.sql(DOCS / "roles.sql"))
        yield c
    finally:
        with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{c.database}" WITH (FORCE)')
            for name in ROLES:
                admin.execute(f'DROP ROLE IF EXISTS "{c.role(name)}"')


def _app(cluster: Cluster, role: str, **conf: object) -> Celery:
    app = Celery(f"roles-{role}", broker="memory://", set_as_current=False)
    app.conf.update(fanin_database_url=cluster.url(role), fanin_record_attempts=1, fanin_pool_size=2, **conf)
    FanIn(app)
    app.task(name="roles.child")(_child)
    app.task(name="roles.successor")(_successor_task)
    return app


def _raising(child: Signature) -> Iterator[Signature]:
    yield child.clone(args=(0,))
    raise RuntimeError("source failed")


def _child(i: int) -> int:
    return i


def _successor_task(outcome: dict[str, int]) -> int:
    return outcome["succeeded"]


def _migrate(cluster: Cluster) -> None:
    """The schema, as the owner role, then the documented grants."""
    owner = _app(cluster, "owner")
    assert FanIn.of(owner).migrate(), "the owner role creates the schema"
    with psycopg.connect(cluster.url("owner"), autocommit=True) as conn:
        conn.execute(cluster.sql(DOCS / "grants.sql"))
    FanIn.of(owner).dispose()


def _refused(url: str, statement: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn, pytest.raises(psycopg.errors.InsufficientPrivilege):
        conn.execute(statement)


@pytest.mark.timeout(120)
def test_each_role_can_do_its_part_and_nothing_more(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    _migrate(cluster)
    producer = _app(cluster, "producer")
    worker = _app(cluster, "worker")
    relay_app = _app(cluster, "relay", fanin_successor_timeout=0.0, fanin_open_batch_grace=0.0)
    apps = (producer, worker, relay_app)
    try:
        # --- the producer: every way of writing a batch -------------------------------------------------------
        child = producer.signature("roles.child")
        then = producer.signature("roles.successor")
        plain_ids = [f"plain-{cluster.suffix}-{i}" for i in range(3)]
        plain = fan_in_group(
            [child.clone(args=(i,)).set(task_id=t) for i, t in enumerate(plain_ids)], then=then, app=producer
        ).apply_async()
        empty = fan_in_group([], then=then, app=producer).apply_async()  # its successor is sent at once
        tree_ids = [f"tree-{cluster.suffix}-{i}" for i in range(5)]
        streamed = (child.clone(args=(i,)).set(task_id=t) for i, t in enumerate(tree_ids))
        tree = fan_in_group(streamed, then=then, app=producer, max_width=2, key=f"tree-{cluster.suffix}").apply_async()
        redrive = fan_in_group(
            [child.clone(args=(0,))], then=then, app=producer, child_timeout=0.2, on_lost="redrive", max_redrives=1
        ).apply_async()
        lost = fan_in_group([child.clone(args=(0,))], then=then, app=producer, child_timeout=0.2).apply_async()
        late = fan_in_group(
            [child.clone(args=(0,))], then=then, app=producer, deadline=timedelta(seconds=0.2)
        ).apply_async()
        orphan = fan_in_group([child.clone(args=(0,))], then=then, app=producer).apply_async()
        # Its child's arguments do not fit roles.child, written as by a producer that did not check them (one before
        # the check, or one that does not know the task): the producer cannot publish it, and the relay, which
        # cannot either, publishes a rejection in its place (with no right to count an outcome itself).
        with monkeypatch.context() as unchecked:
            unchecked.setattr(encoder.Arguments, "signature", lambda *_: None)
            misfit = fan_in_group([child.clone(args=(0, 1))], then=then, app=producer).apply_async()
        threshold_ids = [f"threshold-{cluster.suffix}-{i}" for i in range(4)]
        threshold = fan_in_group(
            [child.clone(args=(i,)).set(task_id=t) for i, t in enumerate(threshold_ids)],
            then=then,
            app=producer,
            max_width=2,
            max_failures=0,
        ).apply_async()
        # A generator that raises: without a key the producer cancels its batch; with one it stays open (the relay
        # seals it below, its grace being 0 here).
        for key in (None, f"open-{cluster.suffix}"):
            with pytest.raises(RuntimeError, match="source failed"):
                fan_in_group(_raising(child), then=then, app=producer, key=key).apply_async()
        assert (plain.batch_status().planned, tree.batch_status().planned, redrive.batch_status().planned) == (3, 5, 1)
        assert empty.batch_status().successor_state in ("sent", "pending")

        # --- a worker's hooks: starts, terminal outcomes, the successor's run ---------------------------------
        fanin_w = FanIn.of(worker)
        started = [batches.Start(t, 0, "worker@test", datetime.now(timezone.utc)) for t in plain_ids]
        assert record_starts(fanin_w.reports, started) == len(plain_ids)  # what a worker's main process writes
        for index, task_id in enumerate(plain_ids):
            marker = protocol.Marker(plain.batch_id, index, None)
            state = "failed" if index == 2 else "succeeded"
            rec = runtime.current.reporter.record_child(
                fanin_w,
                task_id,
                marker,
                state,
                value=index * 10,
                has_value=state == "succeeded",
                exc=ValueError("no") if state == "failed" else None,
            )
            assert rec is not None and rec.counted, f"the worker role could not record {task_id}"
        for index, task_id in enumerate(tree_ids):
            rec = runtime.current.reporter.record_child(
                fanin_w, task_id, protocol.Marker(tree.batch_id, index, None), "succeeded", value=index, has_value=True
            )
            assert rec is not None and rec.counted
        assert tree.batch_status().state == "complete", "the leaves settled their root as the worker role"
        marker = protocol.Marker(threshold.batch_id, 0, None)
        rec = runtime.current.reporter.record_child(fanin_w, threshold_ids[0], marker, "failed", exc=ValueError("no"))
        assert rec is not None and rec.successor_created, "a leaf's failure passed its root's threshold"
        # Each successor those reports created was published by the worker itself, as the worker role: its outbox
        # row claimed and marked sent, and the rest of the tree past its threshold abandoned.
        for handle in (plain, tree, threshold):
            assert handle.batch_status().successor_state == "sent", handle.batch_id
        with FanIn.of(producer).engine.connect() as conn:
            unsent = conn.execute(
                text("SELECT count(*) FROM fanin_outbox WHERE batch_id IN (:a, :b, :c) AND sent_at IS NULL"),
                {"a": plain.batch_id, "b": tree.batch_id, "c": threshold.batch_id},
            ).scalar_one()
        assert unsent == 0
        assert threshold.batch_status().remaining == 0, "the worker abandoned the rest of the tree as the worker role"

        # --- the relay: outbox, orphaned children, lost children, deadlines, stalled successors, reconcile ------
        with psycopg.connect(
            make_url(ADMIN_URL).set(database=cluster.database).render_as_string(False), autocommit=True
        ) as admin:
            # (a pending child: one already terminal, as `lost`'s soon is, is not published again)
            admin.execute("UPDATE fanin_batches SET published_upto = 0 WHERE id = %s", (orphan.batch_id,))
        time.sleep(0.5)  # past the child timeouts and the deadline
        relay = Relay(FanIn.of(relay_app), poll_interval=0.1)
        relay.run_once(maintenance=True)
        relay.run_once(maintenance=True)  # publishes what the first round's recovery created
        stats = relay.stats
        assert stats.errors == 0
        with FanIn.of(producer).engine.connect() as conn:
            published = conn.execute(
                text("SELECT published_upto, planned FROM fanin_batches WHERE id = :b"), {"b": misfit.batch_id}
            ).one()
        assert tuple(published) == (1, 1), "the relay published the misfit child's rejection as the relay role"
        assert (stats.children_redriven, stats.deadlines_applied) == (1, 1)
        assert stats.children_lost >= 1  # `lost`, and `redrive` too if its redrive outlived child_timeout again
        assert stats.children_published >= 1, "the relay published the children the producer 'did not'"
        assert stats.successors_published >= 2, "lost's and late's (the workers published the others')"
        assert stats.successors_restarted >= 1, "a sent successor past fanin_successor_timeout was put back"
        assert stats.open_batches_sealed == 1, "the relay sealed the open batch whose producer let go"
        with FanIn.of(producer).engine.connect() as conn:
            ended = conn.execute(
                text("SELECT key IS NULL, state FROM fanin_batches WHERE key LIKE 'open-%' OR state = 'cancelled'")
            ).all()
        # The child each generator yielded before raising was lost with its chunk: both batches are empty, so the
        # sealed one is complete already.
        assert sorted(tuple(r) for r in ended) == [(False, "complete"), (True, "cancelled")]
        with psycopg.connect(
            make_url(ADMIN_URL).set(database=cluster.database).render_as_string(False), autocommit=True
        ) as admin:  # the retention check below counts the batches before these
            admin.execute("DELETE FROM fanin_batches WHERE key LIKE 'open-%' OR state = 'cancelled'")
        for handle in (plain, tree, lost, late, threshold):
            assert handle.batch_status().successor_state in ("sent", "pending"), handle.batch_id

        # The operator's reads (`status`, `ls`: the node view, version 22) work with each role that reads batches.
        with psycopg.connect(cluster.url("owner")) as conn:
            rows = conn.execute("SELECT id, planned FROM fanin_batches WHERE parent_id = %s", (tree.batch_id,))
            stored = {(str(i), n) for i, n in rows}
        for app in (producer, worker, relay_app):
            shown = inspection.describe(FanIn.of(app), tree.batch_id)
            leaves = {(c["batch_id"], c["planned"]) for c in shown["tree"]["children"] if c["kind"] == "leaf"}
            assert (shown["state"], shown["tree"]["succeeded"], leaves) == ("complete", 5, stored), app.main
            assert str(tree.batch_id) in {e["batch_id"] for e in inspection.list_batches(FanIn.of(app))}, app.main

        # The successor of `plain` runs on a worker: start guard, body reading the results, state and result.
        status = plain.batch_status()
        succ_marker = protocol.Marker(plain.batch_id, None, status.step)
        live = successor_runs.admit(fanin_w, plain.batch_id, status.step, status.successor_task_id, 0)
        assert live is not None
        outcome = BatchOutcome(plain.batch_id, status.step, 3, 2, 1, app=worker)
        assert list(outcome.values()) == [0, 10]
        assert runtime.current.reporter.record_successor(fanin_w, succ_marker, "succeeded", value=2, live=live)
        assert plain.batch_status().successor_state == "succeeded"

        # --- retention ----------------------------------------------------------------------------------------
        statement = (DOCS / "retention.sql").read_text().replace("interval '30 days'", "interval '0 seconds'")
        with psycopg.connect(cluster.url("maintenance"), autocommit=True) as conn:
            deleted = conn.execute(statement).rowcount
            assert deleted == 1, "only `plain` is finished with its successor done"
        with psycopg.connect(cluster.url("relay")) as conn:
            left = conn.execute("SELECT count(*) FROM fanin_children WHERE batch_id = %s", (plain.batch_id,))
            assert left.fetchone() == (0,), "its children went with it"
        # `fanin prune` as the same role, once the empty batch's successor has run.
        status = empty.batch_status()
        marker = protocol.Marker(empty.batch_id, None, status.step)
        live = successor_runs.admit(fanin_w, empty.batch_id, status.step, status.successor_task_id, 0)
        assert live is not None
        assert runtime.current.reporter.record_successor(fanin_w, marker, "succeeded", value=0, live=live)
        maintenance = _app(cluster, "maintenance")
        apps = (*apps, maintenance)
        assert retention.prune(FanIn.of(maintenance), 0).batches == 1
        with pytest.raises(BatchNotFound):
            empty.batch_status()

        # --- and what each role must not do ---------------------------------------------------------------------
        _refused(cluster.url("producer"), "DELETE FROM fanin_batches")
        _refused(cluster.url("producer"), "UPDATE fanin_children SET message = ''")
        _refused(cluster.url("worker"), "INSERT INTO fanin_batches (id) VALUES (gen_random_uuid())")
        _refused(cluster.url("worker"), "UPDATE fanin_batches SET successor_message = ''")
        _refused(cluster.url("worker"), "UPDATE fanin_children SET message = ''")
        _refused(cluster.url("relay"), "UPDATE fanin_children SET message = ''")
        _refused(cluster.url("relay"), "DELETE FROM fanin_outbox")
        _refused(cluster.url("maintenance"), "UPDATE fanin_batches SET state = 'running'")
        _refused(cluster.url("maintenance"), "SELECT message FROM fanin_children")
        _refused(cluster.url("maintenance"), "SELECT * FROM fanin_nodes")
        _refused(cluster.url("relay"), "CREATE TABLE fanin_extra (id int)")
    finally:
        for app in apps:
            FanIn.of(app).dispose()


@pytest.mark.timeout(120)
def test_a_saga_runs_and_rolls_back_under_the_roles(cluster: Cluster) -> None:
    """A producer records a saga and starts it; workers record its steps' and compensations' outcomes (as
    fanin_worker) and run the internal tasks that move it on, as a login role that is a member of fanin_producer
    and fanin_worker, as database-roles.md says a worker that runs sagas must be."""
    _migrate(cluster)
    with psycopg.connect(
        make_url(ADMIN_URL).set(database=cluster.database).render_as_string(False), autocommit=True
    ) as admin:
        admin.execute(f'CREATE ROLE "{cluster.role("sagaworker")}" LOGIN')  # generated identifiers, not input
        admin.execute(
            f'GRANT "{cluster.role("producer")}", "{cluster.role("worker")}" TO "{cluster.role("sagaworker")}"'
        )
    producer = _app(cluster, "producer")
    worker = _app(cluster, "worker")
    saga_worker = _app(cluster, "sagaworker")
    apps = (producer, worker, saga_worker)
    try:
        fanin_w = FanIn.of(worker)
        step_done = saga_worker.tasks[protocol.SAGA_STEP_DONE_TASK]
        compensation_done = saga_worker.tasks[protocol.COMPENSATION_DONE_TASK]

        def finish(batch_id: str | None, state: str) -> str:
            """A worker's hooks record the batch's one child (the step's task, or a stage's compensation)."""
            assert batch_id is not None
            with psycopg.connect(cluster.url("worker")) as conn:
                row = conn.execute("SELECT task_id FROM fanin_children WHERE batch_id = %s AND idx = 0", (batch_id,))
                (task_id,) = row.fetchone() or ("",)
            rec = runtime.current.reporter.record_child(
                fanin_w,
                task_id,
                protocol.Marker(batch_id, 0, None),
                state,
                value=1,
                has_value=state == "succeeded",
                exc=RuntimeError("declined") if state == "failed" else None,
            )
            assert rec is not None and rec.counted, f"the worker role could not record {task_id}"
            return task_id

        # --- the producer records the saga and starts step 1 ---------------------------------------------------
        sig = producer.signature
        handle = saga(
            compensated(sig("roles.child", args=(1,)), sig("roles.child", args=(-1,))),
            compensated(sig("roles.child", args=(2,)), sig("roles.child", args=(-2,))),
            sig("roles.child", args=(3,)),
            app=producer,
            key=f"order-{cluster.suffix}",
        ).apply_async()
        sid = handle.saga_id
        status = handle.status()
        assert (status.state, [s.state for s in status.steps]) == ("running", ["running", "pending", "pending"]), (
            "the producer role recorded the saga and started step 1"
        )

        # --- workers: steps 1 and 2 succeed, step 3 fails for good, and the rollback runs stage by stage -------
        for position in (1, 2):
            finish(handle.status().step(position).batch_id, "succeeded")
            step_done({"succeeded": 1, "failed": 0}, sid, position)
        finish(handle.status().step(3).batch_id, "failed")
        step_done({"succeeded": 0, "failed": 1}, sid, 3)
        status = handle.status()
        assert (status.state, status.failed_step, status.exc_type) == ("compensating", 3, "RuntimeError")
        assert [(c.stage, c.position, c.state) for c in status.compensations] == [(0, 2, "running"), (1, 1, "pending")]
        for stage in (0, 1):
            comp = handle.status().compensations[stage]
            finish(comp.batch_id, "succeeded")
            compensation_done({"batch_id": comp.batch_id, "succeeded": 1, "failed": 0})
        status = handle.status()
        assert status.state == "compensated", status
        assert [s.state for s in status.steps] == ["compensated", "compensated", "failed"]
        assert [c.state for c in status.compensations] == ["succeeded", "succeeded"]

        # --- and what no runtime role may do with a saga -------------------------------------------------------
        for role in ("producer", "sagaworker"):  # what a worker will run is written once
            _refused(cluster.url(role), "UPDATE fanin_saga_steps SET definition = ''")
            _refused(cluster.url(role), "UPDATE fanin_saga_compensations SET message = ''")  # only `saga resume`
            _refused(cluster.url(role), "UPDATE fanin_saga_compensations SET acked_by = 'x'")  # only `saga ack`
            _refused(cluster.url(role), "DELETE FROM fanin_sagas")
        _refused(
            cluster.url("worker"), "INSERT INTO fanin_sagas (id, app_name, steps) VALUES (gen_random_uuid(), 'x', 1)"
        )
        _refused(
            cluster.url("relay"), "INSERT INTO fanin_sagas (id, app_name, steps) VALUES (gen_random_uuid(), 'x', 1)"
        )
        _refused(cluster.url("relay"), "UPDATE fanin_saga_steps SET state = 'pending'")
        _refused(cluster.url("maintenance"), "UPDATE fanin_sagas SET state = 'running'")
        _refused(cluster.url("maintenance"), "DELETE FROM fanin_saga_compensations")

        # --- retention deletes the finished saga as the maintenance role, steps and compensations with it ---------
        maintenance = _app(cluster, "maintenance")
        apps = (*apps, maintenance)
        assert retention.prune(FanIn.of(maintenance), 0).sagas == 1
        with pytest.raises(sagas.SagaNotFound):
            handle.status()
        statement = (DOCS / "retention-sagas.sql").read_text().replace("interval '30 days'", "interval '0 seconds'")
        with psycopg.connect(cluster.url("maintenance"), autocommit=True) as conn:
            assert conn.execute(statement).rowcount == 0, "the documented SQL runs with the same role (none left)"
        with psycopg.connect(cluster.url("owner")) as conn:
            for table in ("fanin_saga_steps", "fanin_saga_compensations"):
                left = conn.execute(f"SELECT count(*) FROM {table} WHERE saga_id = %s", (sid,)).fetchone()
                assert left == (0,), table
    finally:
        for app in apps:
            FanIn.of(app).dispose()


# The functions that move a child or a counter: SECURITY DEFINER, owned by the schema owner, search path pinned.
COUNTER_FUNCTIONS = (
    "fanin_settle_v2(uuid,integer,integer,double precision)",
    "fanin_fail_up_v2(uuid,integer,double precision)",
    "fanin_create_successor_v2(uuid,text,text,text,double precision)",
    "fanin_record_terminal_v2(text,text,bytea,text,text,text,text,timestamp with time zone,integer,text)",
    "fanin_report_terminal_v2(text,uuid,integer,text,text,bytea,text,text,text,text,timestamp with time zone,integer,"
    "text,double precision)",
    "fanin_report_unrun_v2(text,uuid,integer,text,text,text,text,double precision)",
    # the entry points of the workers before version 32, kept for a worker not yet restarted after the migration
    "fanin_report_terminal(text,uuid,integer,text,text,bytea,text,text,text,text,timestamp with time zone,integer,"
    "text)",
    "fanin_report_unrun(text,uuid,integer,text,text,text,text)",
    "fanin_record_starts(text[],integer[],text[],timestamp with time zone[])",
    "fanin_seal(uuid)",
)
# Exactly what each runtime role may EXECUTE (docs/how-to/grants.sql); every other fanin_ function is internal.
EXECUTES = {
    "producer": {
        "fanin_add_children(uuid,uuid[],integer[],integer,integer,bytea)",
        "fanin_mark_published(uuid,integer)",
        "fanin_seal(uuid)",
        "fanin_cancel_open(uuid)",
        "fanin_ensure_successor(uuid,text)",
        "fanin_claim_outbox(integer,bigint[])",
        "fanin_outbox_sent(bigint[])",
        "fanin_outbox_failed(bigint,text,double precision)",
        "fanin_abandon_after_threshold(uuid)",
        # wakes the relay for a batch's children when the producer's transaction commits (a NOTIFY, no write)
        "fanin_notify_relay(text)",
    },
    "worker": {
        "fanin_report_terminal_v2(text,uuid,integer,text,text,bytea,text,text,text,text,timestamp with time zone,"
        "integer,text,double precision)",
        "fanin_record_starts(text[],integer[],text[],timestamp with time zone[])",
        # a main-process event about a copy that never ran (counted only while no copy started the child)
        "fanin_report_unrun_v2(text,uuid,integer,text,text,text,text,double precision)",
        "fanin_note_traceback(text,text)",
        # the same, only onto the counted failure of the same error (a late resend's, since version 35)
        "fanin_note_traceback_v2(text,text,text,text)",
        "fanin_note_successor_traceback(uuid,text,text)",
        "fanin_claim_run_v2(uuid,text,text,integer,double precision,double precision,text,text,text,text)",
        "fanin_count_duplicate(uuid,text)",
        "fanin_hand_over_v2(uuid,text,integer,text,timestamp with time zone,text)",
        "fanin_take_back_v2(uuid,text,integer,double precision,text)",
        "fanin_renew_leases(uuid[],text[],integer[],double precision)",
        "fanin_finish_successor_v2(uuid,text,text,integer,text,bytea,text,text,text,text,text,integer,text,text)",
        # a task of a successor's replacement before its carrier failed: the successor ends with it
        "fanin_end_replacement(uuid,text,text,text,text,text,text)",
        # the successor a worker's report created, published by that worker (fanin_worker_publishes_successors)
        "fanin_claim_outbox(integer,bigint[])",
        "fanin_outbox_sent(bigint[])",
        "fanin_outbox_failed(bigint,text,double precision)",
        "fanin_abandon_after_threshold(uuid)",
        # a successor its main process's report created, left to the relay: due at once, and the relay woken
        "fanin_wake_relay(uuid)",
        # what the report that created it hands it (fanin_report_terminal's statement calls it)
        "fanin_handed_off(uuid)",
    },
    "relay": {
        "fanin_claim_outbox(integer,bigint[])",
        "fanin_outbox_sent(bigint[])",
        "fanin_outbox_failed(bigint,text,double precision)",
        "fanin_mark_published(uuid,integer)",
        "fanin_claim_redrive(text,integer)",
        "fanin_fail_lost(text)",
        "fanin_revoke_expired(text,double precision)",
        "fanin_expire_batch(uuid,text,boolean)",
        "fanin_reconcile_batch(uuid)",
        "fanin_abandon_after_threshold(uuid)",
        "fanin_renew_open_batches()",
        "fanin_seal_open(uuid,double precision)",
        "fanin_republish_successor(uuid,text,double precision,double precision)",
        "fanin_fail_lost_replacement(uuid,text,double precision,text)",
        # the operator's `fanin rerun`, run with the relay's rights as cancel and seal are
        "fanin_rerun_successor(uuid,text,text,text)",
        # the dashboard's actions (`--allow-actions`), recorded with who and when
        "fanin_record_action(text,text,uuid,text,text)",
    },
    "maintenance": set(),
    "dashboard": set(),
}
WRITTEN_ONLY_BY_FUNCTIONS = ("fanin_batches", "fanin_children", "fanin_successors", "fanin_outbox")


def _report_sql(task_id: str, batch_id: str, index: int, name: str) -> str:
    return (
        f"SELECT * FROM fanin_report_terminal_v2('{task_id}', '{batch_id}', {index}, '{name}', 'succeeded', NULL,"
        " NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL)"
    )


@pytest.mark.timeout(120)
def test_counters_move_only_through_the_definer_functions(cluster: Cluster) -> None:
    """Role by role: the worker moves a batch only by a child's matching transition; no runtime role writes a
    counter, a successor row's creation or the outbox directly, or calls the settle functions themselves."""
    _migrate(cluster)
    producer = _app(cluster, "producer")
    try:
        child = producer.signature("roles.child")
        ids = [f"definer-{cluster.suffix}-{i}" for i in range(2)]
        children = [child.clone(args=(i,)).set(task_id=t) for i, t in enumerate(ids)]
        handle = fan_in_group(children, then=producer.signature("roles.successor"), app=producer).apply_async()
        bid = handle.batch_id
        with psycopg.connect(cluster.url("owner")) as conn:
            rows = conn.execute(
                "SELECT p.oid::regprocedure::text, p.prosecdef, pg_get_userbyid(p.proowner), p.proconfig"
                " FROM pg_proc p WHERE p.proname LIKE 'fanin\\_%'"
            ).fetchall()
        found = {r[0]: r[1:] for r in rows}
        for fn in COUNTER_FUNCTIONS:
            definer, owner, config = found[fn]
            assert definer and owner == cluster.role("owner"), fn
            assert config and any(c.startswith("search_path=pg_catalog, public, pg_temp") for c in config), fn

        worker = cluster.url("worker")
        # No direct write to a counter, a child, a successor's creation or the outbox; no settle of its own.
        _refused(worker, f"UPDATE fanin_batches SET remaining = remaining - 1 WHERE id = '{bid}'")
        _refused(worker, f"UPDATE fanin_children SET state = 'succeeded' WHERE batch_id = '{bid}'")
        _refused(worker, f"SELECT * FROM fanin_settle_v2('{bid}', 1, 0, NULL)")
        _refused(worker, f"SELECT fanin_fail_up_v2('{bid}', 1, NULL)")
        _refused(worker, f"SELECT fanin_create_successor_v2('{bid}', 'x', 'y', 'then', NULL)")
        _refused(worker, f"INSERT INTO fanin_successors (batch_id, step, task_id) VALUES ('{bid}', 'x', 'y')")
        _refused(worker, f"INSERT INTO fanin_outbox (batch_id, step) VALUES ('{bid}', 'x')")
        # Through the function, a report that does not match its child moves nothing, even from a session that
        # shadows the tables with temporary ones (the pinned search path puts pg_temp last).
        with psycopg.connect(worker, autocommit=True) as conn:
            conn.execute("CREATE TEMP TABLE fanin_batches (id uuid, remaining integer)")
            forged = conn.execute(_report_sql(ids[0], bid, 1, "roles.child")).fetchone()
            assert forged is not None and forged[4] is True, "refused"
            assert handle.batch_status().remaining == 2 and handle.batch_status().refused_reports == 1
            counted = conn.execute(_report_sql(ids[0], bid, 0, "roles.child")).fetchone()
            assert counted is not None and counted[0] is True and handle.batch_status().remaining == 1

        producer_url, relay = cluster.url("producer"), cluster.url("relay")
        for url in (producer_url, relay):
            _refused(url, f"SELECT fanin_create_successor_v2('{bid}', 'x', 'y', 'then', NULL)")
            _refused(url, f"SELECT fanin_fail_up_v2('{bid}', 1, NULL)")
        _refused(producer_url, f"SELECT * FROM fanin_settle_v2('{bid}', 1, 0, NULL)")
        _refused(producer_url, _report_sql(ids[1], bid, 1, "roles.child"))
        # A role granted nothing (PUBLIC's default EXECUTE is revoked by the migration itself).
        _refused(cluster.url("maintenance"), _report_sql(ids[1], bid, 1, "roles.child"))
        _refused(
            cluster.url("maintenance"), "SELECT fanin_record_starts(ARRAY['x'], ARRAY[0], ARRAY['w'], ARRAY[now()])"
        )
        assert handle.batch_status().remaining == 1
    finally:
        FanIn.of(producer).dispose()


def _one(url: str, statement: str) -> tuple[object, ...] | None:
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute(statement).fetchone()


@pytest.mark.timeout(120)
def test_each_role_writes_only_through_its_functions(cluster: Cluster) -> None:
    """Least privilege by construction (the definer_writes migration): no runtime role has a direct write to a
    counter, a batch's state, a child's outcome, a successor or the outbox; each may EXECUTE exactly its functions,
    and each function refuses the moves its path does not make."""
    _migrate(cluster)
    producer = _app(cluster, "producer")
    try:
        with psycopg.connect(cluster.url("owner")) as conn:
            # The predicates (migration 0034) are plain SQL, inlined by the planner, callable by anyone: they read no
            # table and write nothing (tests/store/test_predicates.py).
            procs = conn.execute(
                "SELECT p.oid::regprocedure::text, p.prosecdef, pg_get_userbyid(p.proowner), p.proconfig"
                " FROM pg_proc p WHERE left(p.proname, 6) = 'fanin_' AND p.pronamespace = 'public'::regnamespace"
                " AND p.proname <> ALL(%s)",
                (list(PREDICATES),),
            ).fetchall()
            assert len(procs) > len(COUNTER_FUNCTIONS)
            for fn, definer, owner, config in procs:
                assert definer and owner == cluster.role("owner"), fn
                assert config and any(c.startswith("search_path=pg_catalog, public, pg_temp") for c in config), fn
            for role, expected in EXECUTES.items():
                rows = conn.execute(
                    "SELECT p.oid::regprocedure::text FROM pg_proc p WHERE left(p.proname, 6) = 'fanin_'"
                    " AND p.pronamespace = 'public'::regnamespace AND has_function_privilege(%s, p.oid, 'EXECUTE')"
                    " AND p.proname <> ALL(%s)",
                    (cluster.role(role), list(PREDICATES)),
                ).fetchall()
                assert {r[0] for r in rows} == expected, role
            for role in ("producer", "worker", "relay", "dashboard", "maintenance"):
                for table in WRITTEN_ONLY_BY_FUNCTIONS:
                    row = conn.execute(
                        "SELECT has_any_column_privilege(%s, %s, 'UPDATE'), has_table_privilege(%s, %s, 'INSERT'),"
                        " has_any_column_privilege(%s, %s, 'INSERT')",
                        (cluster.role(role), table) * 3,
                    ).fetchone()
                    assert row is not None
                    update, insert_all, insert_some = row
                    # retention locks the batches it deletes, which needs an UPDATE privilege (completed_at only)
                    assert not update or (role, table) == ("maintenance", "fanin_batches"), (role, table)
                    may_insert = role == "producer" and table in ("fanin_batches", "fanin_children")
                    assert bool(insert_some) == may_insert, (role, table)
                    assert bool(insert_all) == (may_insert and table == "fanin_batches"), (role, table)
            # The node view reads its three tables with its owner's rights: only a role that may read them may read it.
            for role in ("producer", "worker", "relay", "dashboard", "maintenance"):
                row = conn.execute(
                    "SELECT has_table_privilege(%s, 'fanin_nodes', 'SELECT'),"
                    " bool_and(has_table_privilege(%s, t, 'SELECT'))"
                    " FROM unnest(ARRAY['fanin_batches', 'fanin_successors', 'fanin_children']) t",
                    (cluster.role(role),) * 2,
                ).fetchone()
                assert row is not None and row[0] == row[1] == (role != "maintenance"), role
            outcome_columns = conn.execute(
                "SELECT count(*) FROM unnest(ARRAY['state', 'result', 'finished_at', 'exc_type', 'started_at']) c"
                " WHERE has_column_privilege(%s, 'fanin_children', c, 'INSERT')",
                (cluster.role("producer"),),
            ).fetchone()
            assert outcome_columns == (0,), "a producer writes a child as published, never with an outcome"

        child = producer.signature("roles.child")
        ids = [f"least-{cluster.suffix}-{i}" for i in range(3)]
        running = fan_in_group(
            [child.clone(args=(i,)).set(task_id=t) for i, t in enumerate(ids[:2])],
            then=producer.signature("roles.successor"),
            app=producer,
            child_timeout=3600,
        ).apply_async()
        bid = running.batch_id
        finished = fan_in_group(
            [child.clone(args=(0,)).set(task_id=ids[2])], then=producer.signature("roles.successor"), app=producer
        ).apply_async()
        worker, relay, producer_url = cluster.url("worker"), cluster.url("relay"), cluster.url("producer")

        # --- the worker: a batch moves only by a child's first matching report; a successor only by its run ----
        for url in (worker, relay, producer_url):
            _refused(url, f"UPDATE fanin_batches SET remaining = remaining - 1 WHERE id = '{bid}'")
            _refused(url, f"UPDATE fanin_children SET state = 'succeeded' WHERE batch_id = '{bid}'")
            _refused(url, f"INSERT INTO fanin_successors (batch_id, step, task_id) VALUES ('{bid}', 'x', 'y')")
            _refused(url, f"INSERT INTO fanin_outbox (batch_id, step) VALUES ('{bid}', 'x')")
            _refused(url, f"UPDATE fanin_successors SET state = 'succeeded' WHERE batch_id = '{bid}'")
            _refused(url, "UPDATE fanin_outbox SET sent_at = now()")
            by_task_id = "', 'succeeded', NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL)"
            _refused(url, f"SELECT * FROM fanin_record_terminal_v2('{ids[0]}{by_task_id}")
        first = _one(worker, _report_sql(ids[0], bid, 0, "roles.child"))
        again = _one(worker, _report_sql(ids[0], bid, 0, "roles.child"))
        assert first is not None and first[0] is True and again is not None and again[:2] == (False, True)
        assert running.batch_status().remaining == 1, "a second report of a counted child is late and moves nothing"
        for fn in ("fanin_expire_batch(%s, 'cancel', NULL)", "fanin_reconcile_batch(%s)", "fanin_seal_open(%s, NULL)"):
            _refused(worker, "SELECT * FROM " + fn.replace("%s", f"'{bid}'"))
        _refused(worker, f"SELECT fanin_ensure_successor('{bid}', 'then')")
        _refused(worker, f"SELECT fanin_add_children('{bid}', '{{}}', '{{}}', 5, 5, NULL)")

        last = _one(worker, _report_sql(ids[2], finished.batch_id, 0, "roles.child"))
        assert last is not None and last[3] is True, "the last report created the successor"
        status = finished.batch_status()
        fbid, step, stid = finished.batch_id, status.step, status.successor_task_id
        finish = (
            "SELECT fanin_finish_successor_v2('{b}', '{s}', {t}, {r}, 'succeeded', NULL, NULL, NULL, NULL, NULL, NULL,"
            " NULL, NULL, NULL)"
        )
        # Not started yet: no run to be fenced to (run 0 is nobody's), and the main-process path needs its task id.
        assert _one(worker, finish.format(b=fbid, s=step, t="NULL", r=0)) == (False,)
        assert _one(worker, finish.format(b=fbid, s=step, t="'forged'", r="NULL")) == (False,)
        claim = f"SELECT run FROM fanin_claim_run_v2('{fbid}', '{step}', '{{t}}', 0, 60, 60, 'w', 'k', NULL, NULL)"
        assert _one(worker, claim.format(t="forged")) == (None,), "a run is admitted only under its task id"
        assert _one(worker, claim.format(t=stid)) == (1,)
        assert _one(worker, claim.format(t=stid)) == (None,), "and only once while it runs"
        assert _one(worker, finish.format(b=fbid, s=step, t="NULL", r=2)) == (False,), "not its run"
        assert finished.batch_status().successor_state == "running"
        assert _one(worker, finish.format(b=fbid, s=step, t="NULL", r=1)) == (True,), "its own run finishes it"

        # --- the relay: recovery moves only what is overdue, expired or due -----------------------------------
        assert _one(relay, f"SELECT fanin_fail_lost('{ids[1]}')") == (False,), "not overdue: not lost"
        assert _one(relay, f"SELECT fanin_claim_redrive('{ids[1]}', 0)") == (False,)
        assert _one(relay, f"SELECT fanin_revoke_expired('{ids[1]}', -1e9)") == (False,), "it has no expiry"
        assert _one(relay, f"SELECT * FROM fanin_expire_batch('{bid}', 'deadline', NULL)") is None, "no deadline"
        assert _one(relay, f"SELECT problems FROM fanin_reconcile_batch('{bid}')") == ([],), "nothing to repair"
        _refused(relay, _report_sql(ids[1], bid, 1, "roles.child"))
        _refused(relay, f"SELECT fanin_add_children('{bid}', '{{}}', '{{}}', 5, 5, NULL)")
        _refused(relay, f"SELECT fanin_ensure_successor('{bid}', 'then')")
        _refused(relay, finish.format(b=fbid, s=step, t=f"'{stid}'", r="NULL"))
        _refused(
            relay, f"SELECT run FROM fanin_claim_run_v2('{fbid}', '{step}', '{stid}', 0, 60, 60, 'w', 'k', NULL, NULL)"
        )

        # --- the producer: counters of its open batches only, a successor only for a finished batch ----------
        assert _one(producer_url, f"SELECT * FROM fanin_cancel_open('{bid}')") is None, "not open: not cancelled"
        assert _one(producer_url, f"SELECT fanin_ensure_successor('{bid}', 'then')") == (None,), "still running"
        assert _one(producer_url, f"SELECT fanin_add_children('{bid}', '{{}}', '{{}}', 5, 5, NULL)") == (False,)
        negative = pytest.raises(psycopg.errors.InvalidParameterValue)
        with psycopg.connect(producer_url, autocommit=True) as conn, negative:
            conn.execute(f"SELECT fanin_add_children('{bid}', '{{}}', '{{}}', 0, -1, NULL)")
        _refused(
            producer_url,
            "INSERT INTO fanin_children (task_id, batch_id, idx, task_name, message, content_type, content_encoding,"
            f" state) VALUES ('x', '{bid}', 9, 'roles.child', '', 'a', 'b', 'succeeded')",
        )
        for statement in (
            _report_sql(ids[1], bid, 1, "roles.child"),
            f"SELECT * FROM fanin_expire_batch('{bid}', 'cancel', NULL)",
            f"SELECT * FROM fanin_reconcile_batch('{bid}')",
            f"SELECT fanin_fail_lost('{ids[1]}')",
            finish.format(b=fbid, s=step, t=f"'{stid}'", r="NULL"),
        ):
            _refused(producer_url, statement)
        status = running.batch_status()
        assert (status.state, status.remaining, status.succeeded, status.planned) == ("running", 1, 1, 2)
    finally:
        FanIn.of(producer).dispose()


@pytest.mark.timeout(120)
def test_the_dashboard_serves_every_page_as_a_select_only_role(cluster: Cluster) -> None:
    """The dashboard's documented role (SELECT only) is enough for every page and filter, and can write nothing."""
    from starlette.testclient import TestClient

    from celery_fanin.web import create_app

    _migrate(cluster)
    producer = _app(cluster, "producer")
    worker = _app(cluster, "worker")
    viewer = _app(cluster, "dashboard")
    apps = (producer, worker, viewer)
    web = create_app(viewer)
    try:
        child, then = producer.signature("roles.child"), producer.signature("roles.successor")
        ids = [f"dash-{cluster.suffix}-{i}" for i in range(3)]
        flat = fan_in_group(
            [child.clone(args=(i,)).set(task_id=t) for i, t in enumerate(ids)],
            then=then,
            app=producer,
            step="dash-step",
            key=f"dash-{cluster.suffix}",
        ).apply_async()
        tree = fan_in_group(
            [child.clone(args=(i,)) for i in range(5)], then=then, app=producer, max_width=2
        ).apply_async()
        fanin_w = FanIn.of(worker)
        for index, state in ((0, "succeeded"), (1, "failed")):
            rec = runtime.current.reporter.record_child(
                fanin_w,
                ids[index],
                protocol.Marker(flat.batch_id, index, None),
                state,
                value=index,
                has_value=state == "succeeded",
                exc=ValueError("declined by the bank") if state == "failed" else None,
            )
            assert rec is not None and rec.counted
        order = saga(
            compensated(child.clone(args=(1,)), child.clone(args=(-1,))),
            child.clone(args=(2,)),
            app=producer,
            key=f"order-{cluster.suffix}",
        ).apply_async()
        with TestClient(web) as client:
            leaf = re.search(
                r'<table class="leaves">.*?href="/batches/([0-9a-f-]+)"',
                client.get(f"/batches/{tree.batch_id}").text,
                re.S,
            )
            assert leaf, "the tree's page lists its leaves"
            for path in (
                "/batches",
                "/batches?state=running",
                "/batches?step=dash-step",
                "/batches?app=roles-producer",
                "/batches?key=dash-",
                f"/batches/{flat.batch_id}",
                f"/batches/{tree.batch_id}",
                f"/batches/{leaf.group(1)}",
                "/sagas",
                "/sagas?state=running",
                f"/sagas/{order.saga_id}",
            ):
                page = client.get(path)
                assert page.status_code == 200, (path, page.text[:500])
            assert flat.batch_id in client.get("/batches?key=dash-").text
            failed = client.get(f"/batches/{flat.batch_id}").text
            assert "ValueError: declined by the bank" in failed and ids[1] in failed
            assert order.saga_id in client.get("/sagas?state=running").text
        viewer_url = cluster.url("dashboard")
        _refused(viewer_url, "UPDATE fanin_batches SET state = 'complete'")
        _refused(viewer_url, "DELETE FROM fanin_sagas")
        _refused(viewer_url, f"INSERT INTO fanin_outbox (batch_id, step) VALUES ('{flat.batch_id}', 'x')")
        _refused(viewer_url, f"SELECT * FROM fanin_settle_v2('{flat.batch_id}', 1, 0, NULL)")
        _refused(viewer_url, _report_sql(ids[2], flat.batch_id, 2, "roles.child"))
        _refused(viewer_url, "CREATE TABLE fanin_extra (id int)")
        assert flat.batch_status().remaining == 1
    finally:
        web.state.engine.dispose()
        for app in apps:
            FanIn.of(app).dispose()
