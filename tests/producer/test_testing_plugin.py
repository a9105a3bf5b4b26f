"""The pytest plugin for users (`celery_fanin.testing`) and eager mode, shown as a user's test suite would use them.

Each test writes a small test suite with `pytester` and runs it in a pytest subprocess, as a user's CI would.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import psycopg
import pytest
from sqlalchemy import make_url

pytest_plugins = ["pytester"]
CONTRIB = "celery.contrib.pytest"  # Celery's own fixtures (celery_app, celery_config), which the live ones use

USER_TESTS = """
import pytest
from celery.exceptions import Reject
from celery_fanin import BatchOutcome, fan_in_group


@pytest.fixture
def tasks(fanin_app):
    @fanin_app.task
    def square(i):
        return i * i

    @fanin_app.task
    def boom(i):
        raise ValueError(f"boom {i}")

    @fanin_app.task(bind=True, max_retries=3)
    def flaky(self, i):
        if self.request.retries < 2:
            raise self.retry(countdown=30)  # eager retries run at once
        return i

    @fanin_app.task
    def refuse(i):
        raise Reject("refused", requeue=False)

    @fanin_app.task
    def summary(outcome, label):
        result = BatchOutcome.from_message(outcome, app=fanin_app)
        return {"label": label, "ok": result.succeeded, "failed": result.failed, "values": list(result.values()),
                "failures": [[f["index"], f["state"], f["exc_type"]] for f in result.failures]}

    return square, boom, flaky, refuse, summary


def test_fanin_run_completes_with_production_outcomes(fanin_app, fanin_run, tasks):
    square, boom, flaky, refuse, summary = tasks
    children = [square.s(1), boom.s(2), flaky.s(3), refuse.s(4), fanin_app.signature("no.such.task"), square.s(6)]
    handle = fanin_run(fan_in_group(children, then=summary.s("nightly")))
    status = handle.batch_status()
    assert (status.state, status.planned, status.succeeded, status.failed) == ("complete", 6, 3, 3)
    assert (status.successor_state, status.successor_runs) == ("succeeded", 1)
    assert handle.successor().result == {
        "label": "nightly", "ok": 3, "failed": 3, "values": [1, 3, 36],
        "failures": [[1, "failed", "ValueError"], [3, "rejected", "Reject"], [4, "unknown", "NotRegistered"]],
    }


def test_an_empty_group_runs_its_successor(fanin_run, tasks):
    summary = tasks[-1]
    handle = fanin_run(fan_in_group([], then=summary.s("empty")))
    assert handle.successor().result["ok"] == 0
    assert handle.batch_status().finished


def test_each_test_starts_with_empty_tables(fanin_database):
    import psycopg
    url = fanin_database.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT count(*) FROM fanin_batches").fetchone() == (0,)
"""

EAGER_TESTS = """
import pytest
from celery_fanin import fan_in_group


@pytest.fixture
def fanin_celery_config():
    return {"broker_url": "memory://", "task_always_eager": True, "task_eager_propagates": True}


@pytest.fixture
def eager_tasks(fanin_app):
    from celery_fanin import BatchOutcome

    @fanin_app.task
    def double(i):
        return 2 * i

    @fanin_app.task
    def fails(i):
        raise KeyError(i)

    @fanin_app.task
    def total(outcome):
        result = BatchOutcome.from_message(outcome, app=fanin_app)
        return [result.succeeded, result.failed, list(result.values())]

    return double, fails, total


def test_apply_async_under_eager_counts_children_and_runs_the_successor_later(fanin_app, eager_tasks):
    from celery_fanin.producer.eager import run_eagerly
    from celery_fanin import FanIn

    double, fails, total = eager_tasks
    handle = fan_in_group([double.s(1), fails.s(2), double.s(3)], then=total.s()).apply_async()
    # Under task_always_eager apply_async ran the children and then the successor inline.
    status = handle.batch_status()
    assert (status.succeeded, status.failed, status.successor_state) == (2, 1, "succeeded")
    assert handle.successor().result == [2, 1, [2, 6]]
    # Running it again is harmless: the successor's run guard refuses a second run.
    again = run_eagerly(FanIn.of(fanin_app), handle.batch_id)
    assert again.batch_status().successor_runs == 1


def test_chain_children_under_eager(eager_tasks):
    from celery import chain

    double, fails, total = eager_tasks
    # A chain child counts with its last task's value, or fails with the error of whichever task failed.
    children = [chain(double.s(1), double.s(), double.s()), chain(double.s(1), fails.s(), double.s()), double.s(5)]
    handle = fan_in_group(children, then=total.s()).apply_async()
    status = handle.batch_status()
    assert (status.succeeded, status.failed, status.successor_state) == (2, 1, "succeeded")
    assert handle.successor().result == [2, 1, [8, 10]]


def test_nested_fan_ins_and_pipelines_under_eager(eager_tasks, fanin_database):
    import uuid

    import psycopg

    double, fails, total = eager_tasks
    # A child that is a fan-in counts when its inner successor finishes, with that successor's value.
    inner = fan_in_group([double.s(1), fails.s(2), double.s(3)], then=total.s())
    handle = fan_in_group([inner, double.s(4)], then=total.s()).apply_async()
    status = handle.batch_status()
    assert (status.state, status.succeeded, status.failed, status.successor_state) == ("complete", 2, 0, "succeeded")
    assert handle.successor().result == [2, 0, [[2, 1, [2, 6]], 8]]
    # The inner batch was created inside a child of the outer one: one level down, as on a worker (the depth
    # bound counts it), though eager requests keep the fan-in headers in request.headers.
    url = fanin_database.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(url) as conn:
        rows = conn.execute("SELECT depth, lineage FROM fanin_batches WHERE parent_task_id IS NOT NULL").fetchall()
    assert rows == [(1, uuid.UUID(handle.batch_id))]
    # A pipeline: the next stage starts from the first one's successor, keyed by it; final() follows it.
    first = fan_in_group([double.s(1)], then=fan_in_group([double.s(5), double.s(6)], then=total.s()))
    assert first.apply_async().final(timeout=10) == [2, 0, [10, 12]]
"""


LIVE_TESTS = """
import pytest
from sqlalchemy import text
from celery_fanin import BatchOutcome, FanIn, fan_in_group


@pytest.fixture
def tasks(celery_app):
    @celery_app.task
    def square(i):
        if i == 3:
            raise ValueError("three")
        return i * i

    @celery_app.task
    def total(outcome, label):
        result = BatchOutcome.from_message(outcome, app=celery_app)
        return {"label": label, "ok": result.succeeded, "failed": result.failed, "values": list(result.values()),
                "failures": [[f["index"], f["exc_type"], f["args"]] for f in result.failures]}

    return square, total


def test_a_fan_in_on_a_live_worker_and_relay(tasks, fanin_worker, fanin_relay, celery_app):
    square, total = tasks
    assert not celery_app.conf.task_always_eager
    handle = fan_in_group([square.s(i) for i in range(5)], then=total.s("live")).apply_async()
    status = handle.wait_batch(timeout=60)
    assert (status.state, status.succeeded, status.failed) == ("complete", 4, 1)
    assert (status.successor_state, status.successor_runs) == ("succeeded", 1)
    assert handle.result == {"label": "live", "ok": 4, "failed": 1, "values": [0, 1, 4, 16],
                               "failures": [[3, "ValueError", [3]]]}
    # Published over the broker once (nothing ran eagerly): by the worker whose report created it
    # (fanin_worker_publishes_successors), or by the relay had it claimed the outbox row first.
    with FanIn.of(celery_app).engine.connect() as conn:
        row = conn.execute(text("SELECT attempts, sent_at IS NOT NULL FROM fanin_outbox WHERE batch_id = :b"),
                           {"b": handle.batch_id}).one()
    assert tuple(row) == (1, True)
    assert fanin_relay.stats.successors_published in (0, 1)


def test_tasks_defined_after_the_worker_started(celery_app, fanin_worker, fanin_relay):
    @celery_app.task
    def double(i):
        return 2 * i

    @celery_app.task
    def collect(outcome):
        return list(BatchOutcome.from_message(outcome, app=celery_app).values())

    fanin_worker.reload()
    handle = fan_in_group([double.s(i) for i in range(3)], then=collect.s()).apply_async()
    assert handle.get(timeout=60) == [0, 2, 4]
    assert handle.batch_status().successor_runs == 1
"""


def _ini(pytester: pytest.Pytester, database_url: str | None, enable: bool = True) -> None:
    lines = ["[pytest]"]
    if enable:
        lines.append("celery_fanin = true")
    if database_url is not None:
        lines.append(f"fanin_test_database_url = {database_url}")
    pytester.makeini("\n".join(lines) + "\n")


@pytest.mark.timeout(180)
def test_enabled_by_the_ini_option(pytester: pytest.Pytester, database_url: str) -> None:
    _ini(pytester, database_url)
    pytester.makepyfile(test_user=USER_TESTS)
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3)


@pytest.mark.timeout(180)
def test_enabled_with_dash_p_and_eager_apply_async(pytester: pytest.Pytester, database_url: str) -> None:
    _ini(pytester, database_url, enable=False)
    pytester.makepyfile(test_eager=EAGER_TESTS)
    result = pytester.runpytest_subprocess("-q", "-p", "celery_fanin.testing")
    result.assert_outcomes(passed=3)


@pytest.mark.timeout(180)
def test_enabled_from_a_conftest_on_an_embedded_server(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No database configured: the plugin starts a private embedded server for the session."""
    monkeypatch.delenv("FANIN_TEST_DATABASE_URL", raising=False)
    _ini(pytester, None, enable=False)
    pytester.makeconftest('pytest_plugins = ["celery_fanin.testing"]\n')
    pytester.makepyfile(test_user=USER_TESTS)
    result = pytester.runpytest_subprocess("-q")
    result.assert_outcomes(passed=3)


def test_off_unless_enabled(pytester: pytest.Pytester) -> None:
    _ini(pytester, None, enable=False)
    pytester.makepyfile(
        test_off="""
        def test_uses_the_fixture(fanin_app):
            pass
        """
    )
    result = pytester.runpytest_subprocess("-q")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*fixture 'fanin_app' not found*"])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("broker", ["redis", "memory", "memory-xdist"])
def test_live_worker_and_relay_fixtures_on_celery_contrib_pytest(
    pytester: pytest.Pytester, database_url: str, clean_redis: str, broker: str
) -> None:
    """`fanin_worker` and `fanin_relay` on Celery's own `celery_app`, configured by `celery_config`: the user's
    Redis broker, or Celery's default in-memory one (also under pytest-xdist, each worker on its own database)."""
    _ini(pytester, database_url)
    if broker == "redis":
        pytester.makeconftest(
            "import pytest\n\n\n@pytest.fixture(scope='session')\ndef celery_config():\n"
            f"    return {{'broker_url': {clean_redis!r}}}\n"
        )
    pytester.makepyfile(test_live=LIVE_TESTS)
    xdist = ["-n", "2"] if broker == "memory-xdist" else []
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", "-p", "no:randomly", "-p", CONTRIB, *xdist)
    result.assert_outcomes(passed=2)
    if broker == "redis":
        import redis

        # The messages went through the user's Redis: kombu's bindings of the default queue are there.
        assert redis.Redis.from_url(clean_redis).exists("_kombu.binding.celery")


@pytest.mark.timeout(120)
def test_fanin_worker_refuses_an_eager_app(pytester: pytest.Pytester, database_url: str) -> None:
    _ini(pytester, database_url)
    pytester.makeconftest(
        "import pytest\n\n\n@pytest.fixture(scope='session')\ndef celery_config():\n"
        "    return {'task_always_eager': True}\n"
    )
    pytester.makepyfile(test_eager_worker="def test_it(fanin_worker):\n    pass\n")
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", "-p", CONTRIB)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*remove task_always_eager from celery_config*"])


@pytest.mark.timeout(120)
def test_the_live_fixtures_say_when_celery_contrib_pytest_is_not_enabled(
    pytester: pytest.Pytester, database_url: str
) -> None:
    _ini(pytester, database_url)
    pytester.makepyfile(test_no_contrib="def test_it(fanin_relay):\n    pass\n")
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*run on celery.contrib.pytest's celery_app: enable that plugin too*"])


XDIST_TESTS = """
import os

import psycopg
import pytest
from celery_fanin import BatchOutcome, fan_in_group

CONFIGURED = {configured!r}


@pytest.fixture
def double(fanin_app):
    @fanin_app.task
    def double(i):
        return 2 * i

    @fanin_app.task
    def total(outcome):
        return BatchOutcome.from_message(outcome, app=fanin_app).succeeded

    return double, total


@pytest.mark.parametrize("i", range(6))
def test_each_worker_has_a_migrated_empty_database_of_its_own(fanin_database, fanin_run, double, i):
    url = fanin_database.replace("postgresql+psycopg://", "postgresql://")
    worker = os.environ["PYTEST_XDIST_WORKER"]
    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT current_database()").fetchone() == (CONFIGURED + "_" + worker,)
        assert conn.execute("SELECT count(*) FROM fanin_batches").fetchone() == (0,)
    task, total = double
    handle = fanin_run(fan_in_group([task.s(i), task.s(i + 1)], then=total.s()))
    assert handle.batch_status().succeeded == 2 and handle.successor().result == 2
"""


def _databases(prefix: str) -> set[str]:
    from tests.conftest import _admin

    with _admin() as admin:
        rows = admin.execute("SELECT datname FROM pg_database WHERE datname LIKE %s", (prefix + "%",)).fetchall()
    return {r[0] for r in rows}


@pytest.fixture
def configured_db(fresh_db: Callable[[], str]) -> Iterator[tuple[str, str]]:
    """A database a user's ini names (its name, its URL), with a table of the user's own that the plugin's emptying
    reaches (`fanin_*`) and a row in it; the workers' databases named after it are dropped afterwards too."""
    from tests.conftest import _admin

    url = fresh_db()
    name = str(make_url(url).database)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE fanin_users_own (x int)")
        conn.execute("INSERT INTO fanin_users_own VALUES (1)")
    yield name, url
    with _admin() as admin:
        for db in _databases(name) - {name}:  # `fresh_db` drops the configured one
            admin.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')  # generated identifiers


@pytest.mark.timeout(240)
def test_under_xdist_each_worker_gets_a_database_of_its_own(
    pytester: pytest.Pytester, configured_db: tuple[str, str]
) -> None:
    """With `-n 2` each worker migrates and empties `<configured>_gw0` / `_gw1`, never the configured database
    (whose fan-in tables each test would otherwise empty under the other worker's running test); a worker's
    database made beforehand is used and kept, one the plugin made is dropped at the end."""
    name, url = configured_db
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}_gw1"')  # made beforehand (by someone allowed to): kept
    _ini(pytester, url)
    pytester.makepyfile(test_xdist=XDIST_TESTS.format(configured=name))
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", "-n", "2")
    result.assert_outcomes(passed=6)
    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT x FROM fanin_users_own").fetchall() == [(1,)]  # never emptied
        assert conn.execute("SELECT to_regclass('fanin_batches')").fetchone() == (None,)  # never migrated
    assert _databases(name) == {name, f"{name}_gw1"}


@pytest.mark.timeout(240)
def test_under_xdist_a_role_that_cannot_create_databases_is_told_what_to_do(
    pytester: pytest.Pytester, configured_db: tuple[str, str]
) -> None:
    from tests.conftest import _admin

    name, url = configured_db
    role = f"fanin_nocreatedb_{uuid.uuid4().hex[:8]}"
    with _admin() as admin:
        admin.execute(f'CREATE ROLE "{role}" LOGIN NOCREATEDB')  # a generated identifier
    try:
        role_url = make_url(url).set(username=role).render_as_string(hide_password=False)
        _ini(pytester, role_url)
        pytester.makepyfile(test_xdist=XDIST_TESTS.format(configured=name))
        result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", "-n", "2")
        result.assert_outcomes(errors=6)
        result.stdout.fnmatch_lines([f"*may not create it*Grant the role CREATEDB, create '{name}_gw*"])
        assert _databases(name) == {name}
    finally:
        with _admin() as admin:
            admin.execute(f'DROP ROLE IF EXISTS "{role}"')


def test_a_workers_database_name_fits_postgresql() -> None:
    from celery_fanin.testing import worker_database_name

    assert worker_database_name("app_test", "gw3") == "app_test_gw3"
    long = "t" * 70
    assert worker_database_name(long, "gw12") == "t" * 58 + "_gw12"
    assert len(worker_database_name("é" * 40, "gw0").encode()) <= 63  # bytes, not characters, and no split letter
