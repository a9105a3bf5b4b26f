"""Bulk publishing of children (celery_fanin/broker/publish.py), on Redis and RabbitMQ, with a real prefork worker.

The fast path builds each message once with Celery's own `create_task_message`, routes it as Celery would, and
pipelines the writes (kombu's `Producer.batch` on Redis, confirmed back-to-back publishes on RabbitMQ). These tests
prove that what a worker receives from it is what `apply_async` would have sent: arguments, custom and fan-in
headers, countdown/eta, expires, time limits (signature- and task-level), queues and `task_routes`; and that the
per-message fallbacks deliver the same.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery, chain, signals
from kombu import Connection

from celery_fanin import FanIn, fan_in_group, protocol
from celery_fanin.broker import confirms, publish
from celery_fanin.store.reports import record_terminal
from celery_fanin.worker import hooks
from tests import publish_tasks
from tests.sql import Held, child_ids
from tests.workers import CeleryProcess, start_relay, start_worker

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672//"


@pytest.fixture(params=["redis", "rabbitmq"])
def broker_env(request: pytest.FixtureRequest, e2e_env: dict[str, str]) -> Iterator[dict[str, str]]:
    """The worker environment on one broker, with queues of this test's own (sessions may run side by side)."""
    queue = f"fanin-pub-{uuid.uuid4().hex[:10]}"
    env = {**e2e_env, "FANIN_TEST_QUEUE": queue, "ROUTED_QUEUE": f"{queue}-routed", "BROKER": request.param}
    if request.param == "rabbitmq":
        env["FANIN_TEST_BROKER"] = RABBITMQ_URL
    yield env
    if request.param == "rabbitmq":
        with Connection(RABBITMQ_URL) as conn:
            channel = conn.channel()
            for name in (queue, env["ROUTED_QUEUE"]):
                try:
                    channel.queue_delete(name)
                except Exception:  # noqa: BLE001 - already gone (or never declared): nothing to clean
                    channel = conn.channel()
            channel.close()


@pytest.fixture
def started(broker_env: dict[str, str], tmp_path: Path) -> Iterator[Callable[[], None]]:
    """Starts a worker on both test queues (with the echo tasks) and a relay; stops them after the test."""
    procs: list[CeleryProcess] = []

    def start() -> None:
        queues = f"{broker_env['FANIN_TEST_QUEUE']},{broker_env['ROUTED_QUEUE']}"
        procs.append(
            start_worker(broker_env, tmp_path / "worker.log", extra=["-I", "tests.publish_tasks", "-Q", queues])
        )
        procs.append(start_relay(broker_env, tmp_path / "relay.log"))

    yield start
    for proc in procs:
        proc.stop()
        print(f"===== {proc.log.name} =====\n{proc.output()[-4000:]}")


def _producer_app(env: dict[str, str], **conf: Any) -> Celery:
    """A producer app of the test's own, configured like a user's: default queue, task_routes, the echo tasks."""
    app = Celery("tests.app", broker=env["FANIN_TEST_BROKER"], set_as_current=False)
    app.conf.update(
        fanin_database_url=env["FANIN_DATABASE_URL"],
        task_default_queue=env["FANIN_TEST_QUEUE"],
        task_routes={publish_tasks.ROUTED: {"queue": env["ROUTED_QUEUE"]}},
        broker_connection_retry_on_startup=False,
        **conf,
    )
    publish_tasks.register(app)
    FanIn(app)
    return app


def _children(app: Celery, env: dict[str, str]) -> list[Any]:
    """One child per option the fast path must carry."""
    echo = app.tasks[publish_tasks.ECHO]
    soon = datetime.now(timezone.utc) + timedelta(seconds=2)
    return [
        echo.s(1, "two", k="v").set(headers={"x_custom": "hello"}),  # 0: args, kwargs, custom header
        echo.s(1).set(countdown=2),  # 1
        echo.s(2).set(eta=soon),  # 2
        echo.s(3).set(expires=600),  # 3: expires in the future: runs, and knows it
        echo.s(4).set(countdown=3, expires=1),  # 4: expired by the time its eta comes: revoked
        app.signature("tests.app.sleepy", args=(10,)).set(soft_time_limit=0.5),  # 5: soft limit
        app.signature("tests.app.sleepy", args=(10,)).set(time_limit=1),  # 6: hard limit (pool process killed)
        app.tasks[publish_tasks.ROUTED].s(7),  # 7: task_routes
        echo.s(8).set(queue=env["ROUTED_QUEUE"]),  # 8: the queue option
        app.tasks[publish_tasks.LIMITED].s(9),  # 9: task-level time limits
        echo.s(10).set(time_limit=20, soft_time_limit=10, priority=3),  # 10: signature-level time limits
    ]


def _values(env: dict[str, str], batch_id: str) -> tuple[dict[str, Any], list[Any]]:
    with psycopg.connect(env["FANIN_DATABASE_URL"], autocommit=True) as conn:
        row = conn.execute("SELECT outcome, values FROM e2e_successor_runs WHERE batch_id = %s", (batch_id,)).fetchone()
    assert row is not None, "the successor did not run"
    return row[0], row[1]


def _run_and_check(app: Celery, env: dict[str, str], start: Callable[[], None]) -> dict[str, Any]:
    """Dispatch the children to a running worker, then check what every child saw."""
    start()
    children = _children(app, env)
    then = app.signature("tests.app.record_run", args=("pub",), kwargs={"with_values": True})
    dispatched = time.time()
    handle = fan_in_group(children, then=then, app=app).apply_async()
    status = handle.wait_batch(timeout=90)
    assert status.successor_state == "succeeded", status
    assert (status.planned, status.remaining) == (len(children), 0)
    outcome, values = _values(env, handle.batch_id)
    failures = {f["index"]: f for f in outcome["failures"]}
    assert sorted(failures) == [4, 5, 6], outcome["failures"]
    assert failures[4]["state"] == "revoked"
    assert (failures[5]["state"], failures[5]["exc_type"]) == ("time_limit", "SoftTimeLimitExceeded")
    assert (failures[6]["state"], failures[6]["exc_type"]) == ("time_limit", "TimeLimitExceeded")
    assert outcome["succeeded"] == len(children) - 3
    seen = dict(zip([i for i in range(len(children)) if i not in failures], values, strict=True))
    for index, value in seen.items():  # the fan-in headers reached task.request on every child
        assert value["fanin_batch"] == handle.batch_id, value
        assert value["fanin_index"] == index, value
    assert seen[0]["args"] == [1, "two"] and seen[0]["kwargs"] == {"k": "v"}
    assert seen[0]["custom"] == "hello"
    assert seen[0]["eta"] is None and seen[0]["expires"] is None
    for index in (1, 2):
        assert seen[index]["eta"] is not None
        assert seen[index]["ran_at"] >= dispatched + 1.5, (index, seen[index]["ran_at"] - dispatched)
    assert seen[3]["expires"] is not None
    assert seen[7]["routing_key"] == env["ROUTED_QUEUE"]
    assert seen[8]["routing_key"] == env["ROUTED_QUEUE"]
    assert seen[0]["routing_key"] == env["FANIN_TEST_QUEUE"]
    assert seen[9]["timelimit"] == [40, 30]
    assert seen[10]["timelimit"] == [20, 10]
    return outcome


def _count_celery_path(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    original = publish._publish_with_celery

    def counting(*args: Any, **kwargs: Any) -> None:
        calls.append(1)
        original(*args, **kwargs)

    monkeypatch.setattr(publish, "_publish_with_celery", counting)
    return calls


def test_fast_path_children_run_with_their_options(
    broker_env: dict[str, str], started: Callable[[], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    app = _producer_app(broker_env)
    try:
        with app.producer_or_acquire() as prod:
            expected = "confirm" if broker_env["BROKER"] == "rabbitmq" else "pipeline"
            assert publish.publish_mode(prod) == expected
        via_celery = _count_celery_path(monkeypatch)
        _run_and_check(app, broker_env, started)
        assert via_celery == [], "every child was expected on the fast path"
    finally:
        FanIn.of(app).dispose()


@pytest.mark.parametrize("fallback", ["celery", "single"])
def test_per_message_fallbacks_deliver_the_same(
    fallback: str, broker_env: dict[str, str], started: Callable[[], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`celery`: bulk publishing switched off (``fanin_bulk_publish = False``), every child via apply_async.
    `single`: a transport without batching (Redis set to retry commands, where kombu refuses pipelines; on
    RabbitMQ, confirms switched off by forcing the mode) gets the fast path's messages one at a time."""
    conf: dict[str, Any] = {}
    if fallback == "celery":
        conf["fanin_bulk_publish"] = False
    elif broker_env["BROKER"] == "redis":
        conf["broker_transport_options"] = {"retry_on_timeout": True}
    else:
        monkeypatch.setattr(publish, "publish_mode", lambda prod: "single")
    app = _producer_app(broker_env, **conf)
    try:
        with app.producer_or_acquire() as prod:
            if fallback == "single":
                assert publish.publish_mode(prod) == "single"
        via_celery = _count_celery_path(monkeypatch)
        _run_and_check(app, broker_env, started)
        if fallback == "celery":
            assert len(via_celery) == 11
        else:
            assert via_celery == []
    finally:
        FanIn.of(app).dispose()


# --- what the fast path builds, compared with what Celery itself publishes (no broker needed) ------------------


class _Capture:
    """A stand-in producer for `app.send_task`: records the arguments Celery hands to `Producer.publish`."""

    def __init__(self, connection: Any) -> None:
        self.connection = connection
        self.channel = None
        self.published: list[tuple[Any, dict[str, Any]]] = []

    def publish(self, body: Any, **kwargs: Any) -> None:
        self.published.append((body, kwargs))

    def maybe_declare(self, *args: Any, **kwargs: Any) -> None:
        pass


OPTION_SETS: list[tuple[str, dict[str, Any]]] = [
    ("tests.publish_tasks.echo", {}),
    ("tests.publish_tasks.echo", {"queue": "elsewhere"}),
    ("tests.publish_tasks.routed", {}),
    ("tests.publish_tasks.echo", {"exchange": "ex", "routing_key": "rk", "exchange_type": "topic"}),
    ("tests.publish_tasks.echo", {"priority": 7, "delivery_mode": 1}),
    ("tests.publish_tasks.echo", {"countdown": 30}),
    ("tests.publish_tasks.echo", {"expires": 60}),
    ("tests.publish_tasks.echo", {"time_limit": 5, "soft_time_limit": 3, "headers": {"x_custom": 1}}),
    ("tests.publish_tasks.limited", {}),
    ("tests.publish_tasks.limited", {"soft_time_limit": 1}),
    ("tests.publish_tasks.echo", {"serializer": "pickle", "compression": "zlib"}),
    ("not.registered.anywhere", {"queue": "elsewhere"}),
    ("tests.publish_tasks.echo", {"ignore_result": False}),
    ("tests.publish_tasks.echo", {"ignore_result": True}),
]


@pytest.mark.parametrize("stored", [False, True], ids=["default", "stored-in-backend"])
@pytest.mark.parametrize(("name", "options"), OPTION_SETS, ids=[f"{n}-{sorted(o)}" for n, o in OPTION_SETS])
def test_messages_match_what_celery_publishes(name: str, options: dict[str, Any], stored: bool) -> None:
    """The fast path's message is Celery's, given the ``ignore_result=True`` the library adds to a child (unless
    the child sets ignore_result, or ``fanin_store_child_results_in_backend`` is on)."""
    hooks.install()  # Celery's path gets its claim from the hooks (the fast path builds it in)
    app = Celery("tests.app", broker="memory://", set_as_current=False)
    app.conf.update(
        task_default_queue="default-q",
        task_routes={publish_tasks.ROUTED: {"queue": "routed-q"}},
        accept_content=["json", "pickle"],
        fanin_store_child_results_in_backend=stored,
    )
    publish_tasks.register(app)
    sig = app.signature(name, args=(1, "a"), kwargs={"k": [1, 2]}, **options)
    task_id = str(uuid.uuid4())
    headers = {**(options.get("headers") or {}), protocol.HEADER_BATCH: "b", protocol.HEADER_INDEX: 3}
    added = {} if stored or "ignore_result" in options else {"ignore_result": True}
    with app.connection_for_write() as conn:
        capture = _Capture(conn)
        sig.apply_async(task_id=task_id, producer=capture, headers=headers, add_to_parent=False, **added)
    ((celery_body, celery_kwargs),) = capture.published

    route, our_headers, our_body, properties = publish._Builder(app, "b").build(3, task_id, sig)
    if not stored:  # else whatever Celery's is (the task's ignore_result; None for a task this app does not know)
        assert our_headers["ignore_result"] is options.get("ignore_result", True)
    # Celery's path gets its headers' claim (eta and expires are computed from "now", microseconds apart); the fast
    # path builds one only for a signed message (tests/e2e/test_signing.py), this one is JSON.
    assert protocol.body_claim(celery_body) == protocol.claim(celery_kwargs["headers"])
    assert protocol.body_claim(our_body) is None
    assert _unclaimed(our_body) == _unclaimed(celery_body)
    assert route.exchange == (
        celery_kwargs["exchange"].name if hasattr(celery_kwargs["exchange"], "name") else celery_kwargs["exchange"]
    )
    assert route.routing_key == celery_kwargs["routing_key"]
    assert route.serializer == celery_kwargs["serializer"]
    assert route.compression == celery_kwargs["compression"]
    assert [q.name for q in route.declare] == [q.name for q in celery_kwargs["declare"]]
    theirs = dict(celery_kwargs["headers"])
    for key in ("eta", "expires"):  # both computed from "now", a few microseconds apart
        assert (our_headers.pop(key) is None) == (theirs.pop(key) is None), key
    assert our_headers == theirs
    # Celery also passes the task's unset options (priority=None...): the same as not passing them.
    celery_props = {k: v for k, v in celery_kwargs.items() if k not in _PUBLISH_ARGS and v is not None}
    if "expiration" in celery_props:
        assert properties.pop("expiration") == pytest.approx(celery_props.pop("expiration"), abs=1)
    assert properties == celery_props


@pytest.mark.parametrize(("name", "options"), OPTION_SETS[:4], ids=[f"{n}-{sorted(o)}" for n, o in OPTION_SETS[:4]])
def test_successor_message_matches_what_celery_publishes(name: str, options: dict[str, Any]) -> None:
    """The relay builds a successor's message like a child's: the outcome first, the successor headers."""
    hooks.install()
    app = Celery("tests.app", broker="memory://", set_as_current=False)
    app.conf.update(task_default_queue="default-q", task_routes={publish_tasks.ROUTED: {"queue": "routed-q"}})
    publish_tasks.register(app)
    sig = app.signature(name, args=("label",), **options)
    outcome = {"batch_id": "b", "succeeded": 2, "failed": 1, "failures": [{"index": 1, "state": "failed"}]}
    task_id, batch = str(uuid.uuid4()), str(uuid.UUID(int=0))
    with app.connection_for_write() as conn:
        capture = _Capture(conn)
        sig.apply_async(
            args=(outcome,),
            task_id=task_id,
            producer=capture,
            add_to_parent=False,
            headers={**(options.get("headers") or {}), protocol.HEADER_SUCCESSOR: batch, protocol.HEADER_STEP: "merge"},
        )
        ours = _Capture(conn)
        publish.publish_successor(app, ours, uuid.UUID(batch), "merge", task_id, sig, outcome)  # type: ignore[arg-type]
    ((celery_body, celery_kwargs),) = capture.published
    ((our_body, our_kwargs),) = ours.published
    # Both bodies carry the claim (ours built in, Celery's put in by the hooks' before_task_publish).
    assert protocol.body_claim(celery_body) == protocol.claim(celery_kwargs["headers"])
    assert protocol.body_claim(our_body) is None  # unsigned
    assert _unclaimed(our_body) == _unclaimed(celery_body) and our_body[0][0] == outcome
    theirs, mine = dict(celery_kwargs["headers"]), dict(our_kwargs["headers"])
    for key in ("eta", "expires"):
        assert (mine.pop(key) is None) == (theirs.pop(key) is None), key
    assert mine == theirs
    assert mine["ignore_result"] is options.get("ignore_result", False)  # a successor's result: Celery's, as ever
    assert our_kwargs["routing_key"] == celery_kwargs["routing_key"]


@pytest.mark.parametrize("stored", [False, True], ids=["default", "stored-in-backend"])
def test_celery_path_and_chain_children_ignore_results_unless_asked(stored: bool) -> None:
    """Celery's own path (a child the fast path does not build, a chain child) gives the child
    ``ignore_result=True`` as the fast path does: every task of a chain carries it (each publishes the next
    with its own options), except one that sets ignore_result itself, or all of them if the chain sets it."""
    hooks.install()
    app = Celery("tests.app", broker="memory://", set_as_current=False)
    app.conf.update(task_default_queue="default-q", fanin_store_child_results_in_backend=stored)
    publish_tasks.register(app)
    echo = app.signature("tests.publish_tasks.echo")
    published: list[tuple[Any, dict[str, Any]]] = []

    def seen(body: Any = None, headers: Any = None, **_: Any) -> None:
        published.append((body, dict(headers)))

    signals.before_task_publish.connect(seen, weak=False)
    try:
        with app.producer_or_acquire() as prod:  # memory://: published, then dropped with the app
            ignore = publish.child_results_ignored(app)
            assert ignore is not stored
            for sig in (echo.clone((1,)), echo.clone((2,)).set(ignore_result=False)):
                publish._publish_with_celery(prod, "b", 0, str(uuid.uuid4()), sig, ignore_results=ignore)
            steps = chain(echo.clone((3,)), echo.clone(), echo.clone().set(ignore_result=False), echo.clone())
            publish.publish_chain(prod, "b", 1, str(uuid.uuid4()), steps)
            explicit = chain(echo.clone((4,)), echo.clone()).set(ignore_result=False)
            publish.publish_chain(prod, "b", 2, str(uuid.uuid4()), explicit)
    finally:
        signals.before_task_publish.disconnect(seen)
    plain, asked, chained, chain_asked = published
    assert plain[1]["ignore_result"] is not stored
    assert asked[1]["ignore_result"] is False
    # The chain's first task is published now; the others travel in its body, last first, with their options.
    rest = [step["options"].get("ignore_result") for step in reversed(chained[0][2]["chain"])]
    assert chained[1]["ignore_result"] is not stored
    assert rest == ([True, False, True] if not stored else [None, False, None])
    assert chain_asked[1]["ignore_result"] is False
    assert [step["options"].get("ignore_result") for step in chain_asked[0][2]["chain"]] == [None]


def _unclaimed(body: Any) -> Any:
    """A protocol-2 body without its fan-in claim."""
    args, kwargs, embed = body
    return (args, kwargs, {k: v for k, v in embed.items() if k != protocol.BODY_CLAIM})


_PUBLISH_ARGS = frozenset(
    {
        "exchange",
        "routing_key",
        "serializer",
        "compression",
        "retry",
        "retry_policy",
        "declare",
        "headers",
        "timeout",
        "confirm_timeout",
    }
)


def test_unmodelled_options_go_through_celery(monkeypatch: pytest.MonkeyPatch) -> None:
    """A link (or any option the fast path does not build) is published by apply_async, the others are not."""
    app = Celery("tests.app", broker="memory://", set_as_current=False)
    # kombu's memory transport is one per process: a queue of the test's own, so no other test's message is read.
    queue_name = f"pub-{uuid.uuid4().hex[:10]}"
    app.conf.task_default_queue = queue_name
    publish_tasks.register(app)
    echo = app.tasks[publish_tasks.ECHO]
    calls = _count_celery_path(monkeypatch)
    children = [(0, str(uuid.uuid4()), echo.s(0)), (1, str(uuid.uuid4()), echo.s(1).set(link=echo.s()))]
    with publish.producer(app) as prod:
        publish.publish_children(app, prod, uuid.uuid4(), children)
    assert len(calls) == 1
    with app.connection_for_write() as conn:
        queue = conn.SimpleQueue(queue_name)
        received = [queue.get(timeout=1) for _ in range(2)]
        assert sorted(json.loads(json.dumps(m.headers["fanin_index"])) for m in received) == [0, 1]
        assert {m.headers["fanin_batch"] for m in received} == {received[0].headers["fanin_batch"]}
        queue.close()


# --- RabbitMQ: chunks in flight while the next is written, and a chunk the broker does not confirm ------------


def _queued_indexes(queue: str) -> list[int]:
    """Drain the queue (RabbitMQ), returning each message's fanin_index in the order the broker holds them."""
    indexes = []
    with Connection(RABBITMQ_URL) as conn:
        channel = conn.default_channel
        while (message := channel.basic_get(queue, no_ack=True)) is not None:
            indexes.append(int(message.headers["fanin_index"]))
    return indexes


@pytest.mark.parametrize("stream", [False, True], ids=["list", "generator"])
def test_rabbitmq_chunks_are_recorded_only_once_confirmed(
    e2e_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    """Chunks go out with the previous one's confirms still pending; a chunk whose confirms fail is not recorded as
    published, nor is any chunk after it, and the relay publishes from there (duplicates are counted once)."""
    from celery_fanin.relay import Relay

    queue = f"fanin-pub-{uuid.uuid4().hex[:10]}"
    app = _producer_app(
        {**e2e_env, "FANIN_TEST_BROKER": RABBITMQ_URL, "FANIN_TEST_QUEUE": queue, "ROUTED_QUEUE": f"{queue}-routed"},
        fanin_chunk_size=4,
    )
    echo = app.tasks[publish_tasks.ECHO]
    try:

        def children() -> Any:
            sigs = (echo.s(i) for i in range(13))
            return sigs if stream else list(sigs)

        handle = fan_in_group(children(), then=echo.s(), app=app).apply_async()
        assert handle.batch_status().published == 13
        assert _queued_indexes(queue) == list(range(13))

        real_wait = confirms.Unconfirmed.wait
        waits: list[int] = []

        def second_chunk_unconfirmed(self: confirms.Unconfirmed) -> None:
            if self.pending:
                waits.append(1)
                if len(waits) == 2:
                    raise OSError("no confirms from the broker")
            real_wait(self)

        monkeypatch.setattr(confirms.Unconfirmed, "wait", second_chunk_unconfirmed)
        handle = fan_in_group(children(), then=echo.s(), app=app).apply_async()
        monkeypatch.setattr(confirms.Unconfirmed, "wait", real_wait)
        assert handle.batch_status().published == 4, "only the first chunk is known to be on the broker"
        first = _queued_indexes(queue)
        assert first[:8] == list(range(8)), "the second chunk was written; it is just not confirmed"
        assert len(waits) == 2, "no chunk after the unconfirmed one is waited for (or recorded)"

        assert Relay(FanIn.of(app)).run_once() == 9
        assert handle.batch_status().published == 13
        assert sorted(set(first + _queued_indexes(queue))) == list(range(13))
    finally:
        FanIn.of(app).dispose()
        with Connection(RABBITMQ_URL) as conn:
            conn.default_channel.queue_delete(queue)


@pytest.mark.parametrize("why", ["fanin_amqp_frames=False", "py-amqp outside the tested range"])
def test_rabbitmq_without_the_frame_writer_still_publishes_children_and_successors(
    e2e_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, why: str
) -> None:
    """The AMQP frame fast path switched off (the setting, or a py-amqp it is not tested with): the confirm channel
    writes through py-amqp's own `basic_publish`, and children and the successor are published and confirmed."""
    from celery_fanin.broker import amqp_frames
    from celery_fanin.relay import Relay

    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the frame writer was used")

    monkeypatch.setattr(amqp_frames.FrameBuffer, "publish", never)
    conf: dict[str, Any] = {}
    if why.startswith("fanin_amqp_frames"):
        conf["fanin_amqp_frames"] = False
    else:
        monkeypatch.setattr(amqp_frames, "SUPPORTED", amqp_frames.supported("6.0.0"))
    queue = f"fanin-pub-{uuid.uuid4().hex[:10]}"
    env = {**e2e_env, "FANIN_TEST_BROKER": RABBITMQ_URL, "FANIN_TEST_QUEUE": queue, "ROUTED_QUEUE": f"{queue}-r"}
    app = _producer_app(env, **conf)
    echo = app.tasks[publish_tasks.ECHO]
    try:
        assert not publish.amqp_frames_enabled(app)
        handle = fan_in_group([echo.s(i) for i in range(5)], then=echo.s(), app=app).apply_async()
        assert handle.batch_status().published == 5, "every child confirmed by the broker"
        ids = child_ids(env, handle.batch_id)
        with FanIn.of(app).engine.begin() as conn:
            for task_id in ids:
                assert record_terminal(Held(conn), task_id, "succeeded").counted
        assert Relay(FanIn.of(app)).run_once() == 1  # the successor, on the same kind of confirm channel
        headers = []
        with Connection(RABBITMQ_URL) as conn:
            channel = conn.default_channel
            while (message := channel.basic_get(queue, no_ack=True)) is not None:
                headers.append(message.headers)
        assert [h["fanin_index"] for h in headers[:5]] == list(range(5))
        assert len(headers) == 6 and headers[5]["fanin_successor"] == handle.batch_id
    finally:
        FanIn.of(app).dispose()
        with Connection(RABBITMQ_URL) as conn:
            conn.default_channel.queue_delete(queue)


@pytest.mark.parametrize("stored", [False, True], ids=["default", "stored-in-backend"])
def test_eager_children_store_their_results_in_the_backend_only_if_asked(app: Celery, stored: bool) -> None:
    """Under `task_always_eager` with `task_store_eager_result` the children run inline through Celery's path: by
    default only the one that asked stores its result (a chain's tasks neither); with the setting, all of them."""
    app.conf.update(
        task_always_eager=True,
        task_store_eager_result=True,
        result_backend="cache+memory://",
        fanin_store_child_results_in_backend=stored,
    )

    @app.task(name="tests.eager.triple", shared=False)
    def triple(i: int) -> int:
        return 3 * i

    @app.task(name="tests.eager.done", shared=False)
    def done(outcome: dict[str, Any]) -> int:
        return int(outcome["succeeded"])

    children = [triple.s(1), triple.s(2).set(ignore_result=False), chain(triple.s(3), triple.s())]
    handle = fan_in_group(children, then=done.s(), app=app).apply_async()
    assert handle.batch_status().succeeded == 3 and handle.get() == 3
    ids = child_ids(app, handle.batch_id)
    results = [app.AsyncResult(task_id).result for task_id in ids]
    assert results == ([3, 6, 27] if stored else [None, 6, None])
    assert app.AsyncResult(handle.id).result == 3  # the successor's, as Celery stores it


def test_a_chain_childs_first_message_goes_through_the_producer_given(
    broker_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Celery's `chain.run` drops a `producer=` (it acquires one of its own from the pool): a chain child's first
    message must go through the producer `publish_children` is given (Redis: into its pipeline), or on RabbitMQ
    through that producer's confirm channel, counted among the messages whose confirms are waited for."""
    from kombu import Producer

    app = _producer_app(broker_env)
    echo = app.tasks[publish_tasks.ECHO]
    used: list[tuple[int, Any]] = []
    real_publish = Producer.publish

    def spy(self: Producer, body: Any, *args: Any, **kwargs: Any) -> Any:
        index = (kwargs.get("headers") or {}).get(protocol.HEADER_INDEX)
        if index is not None:
            used.append((index, self))
        return real_publish(self, body, *args, **kwargs)

    monkeypatch.setattr(Producer, "publish", spy)
    children = [
        (0, str(uuid.uuid4()), echo.s(0).set(link=echo.s())),  # Celery's path, a plain signature
        (1, str(uuid.uuid4()), echo.s(1) | echo.s()),
        (2, str(uuid.uuid4()), echo.s(2) | (echo.s() | echo.s())),
    ]
    try:
        with publish.producer(app) as prod:
            sent_before = None
            if broker_env["BROKER"] == "rabbitmq":
                expected = confirms.confirm_channel(prod, publish.amqp_frames_enabled(app))
                sent_before, target = expected.sent, expected.producer
            else:
                target = prod
            publish.publish_children(app, prod, uuid.uuid4(), children)
            assert sorted(i for i, _ in used) == [0, 1, 2]
            assert all(p is target for _, p in used), [(i, p is target) for i, p in used]
            if sent_before is not None:
                assert expected.sent - sent_before == 3, "every child counted among the confirmed publishes"
    finally:
        FanIn.of(app).dispose()
        if broker_env["BROKER"] == "rabbitmq":
            with Connection(RABBITMQ_URL) as conn:
                conn.default_channel.queue_delete(broker_env["FANIN_TEST_QUEUE"])


CHAINS: list[tuple[str, Callable[[Any], Any], dict[str, Any]]] = [
    ("two", lambda e: e.s(1) | e.s(), {}),
    ("nested", lambda e: e.s(1) | (e.s() | e.s(k=2)) | e.si(3), {}),
    ("one", lambda e: _chain_of(e.s(1)), {}),
    ("link", lambda e: e.s(1) | e.s(), {"link": "done", "link_error": "failed"}),
    ("options", lambda e: e.s(1) | e.s(), {"countdown": 30, "expires": 60, "queue": "elsewhere", "priority": 3}),
    ("headers", lambda e: (e.s(1) | e.s()).set(headers={"x_custom": 1}), {}),
]


def _chain_of(*tasks: Any) -> Any:
    from celery import chain

    return chain(*tasks)


@pytest.mark.parametrize(("name", "build", "options"), CHAINS, ids=[c[0] for c in CHAINS])
def test_a_chain_is_published_as_celerys_chain_publishes_it(
    name: str, build: Callable[[Any], Any], options: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`publish._apply_chain` does what Celery's ``chain.apply_async`` does (which drops a ``producer=``), with the
    producer: the same first message, the rest of the chain (ids, options, links) in its ``chain`` field."""
    import contextlib

    hooks.install()
    app = Celery("tests.app", broker="memory://", set_as_current=False)
    app.conf.update(task_default_queue="default-q")
    publish_tasks.register(app)
    echo = app.tasks[publish_tasks.ECHO]
    ids = [str(uuid.uuid4()) for _ in range(4)]
    extra = dict(options)
    for key in ("link", "link_error"):
        if key in extra:
            extra[key] = echo.si(extra[key])

    def chained() -> Any:
        sig = build(echo)
        for task, task_id in zip(publish.chain_tasks(sig)[:-1], ids, strict=False):
            task.set(task_id=task_id)  # Celery gives the earlier tasks random ids; publish_chain derives them
        return sig.set(**extra)

    with app.connection_for_write() as conn:
        theirs = _Capture(conn)
        monkeypatch.setattr(app, "producer_or_acquire", lambda producer=None: contextlib.nullcontext(theirs))
        chained().apply_async(task_id=ids[-1], producer=_Capture(conn), add_to_parent=False)
        monkeypatch.undo()
        ours = _Capture(conn)
        publish._apply_chain(chained(), ours, task_id=ids[-1], add_to_parent=False)  # type: ignore[arg-type]
    ((celery_body, celery_kwargs),) = theirs.published
    ((our_body, our_kwargs),) = ours.published
    assert our_body == celery_body
    mine, theirs_headers = dict(our_kwargs.pop("headers")), dict(celery_kwargs.pop("headers"))
    for key in ("eta", "expires"):  # computed from "now"
        assert (mine.pop(key) is None) == (theirs_headers.pop(key) is None), key
    assert mine == theirs_headers
    if "expiration" in celery_kwargs:
        assert our_kwargs.pop("expiration") == pytest.approx(celery_kwargs.pop("expiration"), abs=1)
    assert {k: v for k, v in our_kwargs.items() if k != "declare"} == {
        k: v for k, v in celery_kwargs.items() if k != "declare"
    }
    rest = our_body[2]["chain"]
    last_id = rest[0]["options"]["task_id"] if rest else mine["id"]  # a chain of one: its first task is its last
    assert last_id == ids[-1], "the last task carries the chain's task id"
    if "link" in options:
        assert [list(s["args"]) for s in rest[0]["options"]["link"]] == [["done"]]
    if "link_error" in options:
        assert all(list(t["options"]["link_error"][0]["args"]) == ["failed"] for t in rest)
        assert list(our_body[2]["errbacks"][0]["args"]) == ["failed"]


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "one-message"])
def test_a_successor_is_on_redis_when_the_producer_context_exits_batched_or_not(
    e2e_env: dict[str, str], batched: bool
) -> None:
    """A worker publishing the one successor its report handed it uses an unbatched producer (no Redis client made
    for a batch of one): its message is written as it is published. A batched producer writes at the context's
    exit. Either way it is on the broker, once, when the context has exited."""
    import redis

    url = e2e_env["FANIN_TEST_BROKER"]
    app = Celery("tests.app", broker=url, set_as_current=False)
    queue = f"pub-{uuid.uuid4().hex[:10]}"
    app.conf.task_default_queue = queue
    publish_tasks.register(app)
    echo = app.tasks[publish_tasks.ECHO]
    client = redis.Redis.from_url(url)
    try:
        with publish.producer(app, batched=batched) as prod:
            publish.publish_successor(app, prod, uuid.uuid4(), "then", str(uuid.uuid4()), echo.s(), {"succeeded": 1})
            assert client.llen(queue) == (0 if batched else 1)
        assert client.llen(queue) == 1
    finally:
        client.delete(queue)
        client.close()
