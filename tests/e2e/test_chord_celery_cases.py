"""Celery's own chord integration cases (celery's t/integration/test_canvas.py, class `test_chord`), ported to
`from celery_fanin import chord` (issue 40, item 1) and run by real `celery worker` processes.

Each case keeps Celery's canvas, tasks (tests/chord_tasks.py: Celery's t/integration/tasks.py on this app) and
expected values; what changes, and why, is said here once:

- A header task that fails makes `get()` raise `ChordHeaderFailed` (a `celery.exceptions.ChordError` naming the
  failed children), where Celery's chord result re-raises the header task's own `ExpectedException` (its
  `get()` follows the header's `GroupResult` in the result backend). A failing body raises its own error, as in
  Celery.
- A Celery `group` (or chord) inside the header is refused (`InvalidFanIn`) before anything is written; where a
  case puts one there, the port asserts the refusal and runs the counterpart: the group as the header itself, or a
  nested `celery_fanin.chord` where Celery's group is followed by a task (Celery's "upgrade" of `group | task`).
- `group(...) | task` is how Celery spells a chord; its counterpart here is `chord(group(...), task)`.
- `celery_fanin.chord` refuses a single signature as the header; Celery takes one as a header of one task, so the
  cases that give one (`chord(sig, body)`) give `[sig]`.
- No result backend (tests/app.py configures none): the body's list and the handle's answers are read from
  PostgreSQL. Only `test_cases_whose_tasks_need_a_result_backend` and the cases of causes 8 and 9 give the worker
  one, for what is Celery's, not the chord's: `add_to_all` replaces itself with a group, which Celery turns into a
  chord of its own, and reading a plain task's result (`AsyncResult(id).get()`) needs one.
- "Exactly once" (Celery: wait a second and look again) is checked once nothing is left to run: the broker queue
  empty, the worker with nothing active, reserved or scheduled, the outbox all sent.

The gaps this port found (causes), all fixed now; each fix first showed as its strict xfail passing:

1. Fixed (a replacement's tasks other than its carrier are parts of the successor, and a part's failure ends it):
   a body chain whose middle task failed never finished (the successor stayed `replaced`). Its cases (the bodies of
   test_error_propagates_to_chord_from_chain, test_immutable_errback_called_by_chord_from_chain and
   test_mutable_errback_called_by_chord_from_chain, both styles) are normal tests again.
2. Fixed (a replacement's carrier with a task id of its own carries the successor's, under which its run guard
   admits it): a body chain whose last task had a frozen task id was refused as a duplicate delivery. Its cases
   (the body of test_mutable_errback_called_by_chord_from_chain_tail, both styles) are normal tests again.
3. Fixed (commit 4748954: a failed successor's error is rebuilt as the loaded class of its name): a body's error
   was rebuilt by name only (`celery_fanin.remote.ExpectedException`). Its cases (the bodies of
   test_error_propagates_to_chord_from_simple and _from_chain_tail, test_immutable_errback_called_by_chord_from_simple
   and _from_chain_tail, test_mutable_errback_called_by_chord_from_simple) are normal tests again.
4. Fixed (`then_canvas` writes a group as a fan-in of its own, whose successor `celery_fanin.group_results` returns
   the members' values or raises the first failing member's error; the handle's `get()` follows it): a group as the
   body needed a result backend (`then_canvas` replaced itself with the group, which Celery upgrades to a chord),
   so the body failed with NotImplementedError. Its cases (the body of test_error_propagates_to_chord_from_group,
   test_immutable_errback_called_by_chord_from_group, test_mutable_errback_called_by_chord_from_group,
   test_immutable_errback_called_by_chord_from_group_fail_multiple and
   test_mutable_errback_called_by_chord_from_group_fail_multiple_on_body_failure) are normal tests.
5. Fixed (a chain child may end with a nested fan-in: its message, `celery_fanin.run_group`, is the chain's last
   task, and the batch it writes stands for the child, each of its children given the value of the task before):
   a chain in the header that held a nested chord was refused (`InvalidFanIn`), at `apply_async` or on a worker
   (`celery_fanin.run_canvas`). Its cases (test_chord_in_chords_with_chains, test_chain_chord_chain_chord,
   test_nested_group_chain and test_nested_chord_group_chain_group_tail, their counterparts with a nested chord,
   and test_chord_unlock_with_failed_task_in_nested_chain_member) are test_a_chord_at_the_end_of_a_chain_in_the_header.
6. Fixed (`chord.link_error` links the errback to each header task when `task_allow_error_cb_on_chord_header`
   is on, as Celery's): test_flag_allow_error_cb_on_chord_header_on_upgraded_chord is a normal test.
7. Fixed (a chord's body may be a chord: it is written when the header finishes, each of its header tasks given
   the header's results, and the outer handle's `get()` answers with its body): a chord as a chord's body was
   refused. test_chord_error_propagation_with_different_body_types[body is a chord] is a normal test.
8. Fixed (`run_canvas` and `then_canvas` are transparent in the task tree: what they publish is their parent's
   child; the body is the child of the header task whose report finished the batch and published it): a header
   task's parent was the `run_canvas` task that wrote the chord, and the body's first task's the `then_canvas`
   that ran the body chain or the task before the chord. test_parent_ids and test_parent_ids__OR are normal tests.
9. Fixed (`get()` follows the chain's parents while the batch does not exist, as Celery's `follow_parents`):
   `get()` did not follow a failed task before the chord in a chain and waited (Celery xfails this case on Redis,
   #6437). test_error_propagates_from_chord is a normal test.

Every case of `test_chord`, in Celery's order:

- test_simple_chord_with_a_delay_in_group_save: ported in test_results_in_header_order: the chord and its value; the
  one-second delay Celery patches into `BaseKeyValueStoreBackend._apply_chord_incr` (a key-value result backend's
  chord counter) has no counterpart, the count is a PostgreSQL row.
- test_chord_order: ported in test_results_in_header_order (a generator header).
- test_redis_subscribed_channels_leak: not applicable: it counts the Redis result backend's pub/sub channels before
  and after; the handle subscribes to nothing (it reads PostgreSQL).
- test_replaced_nested_chord: ported in test_cases_whose_tasks_need_a_result_backend.
- test_add_to_chord: not applicable: `Task.add_to_chord` grows the running chord through `request.chord` and the
  Redis result backend's chord counter (`backend.add_to_chord`); a fan-in's header is fixed when it is written
  (growing a batch is `fan_in_group`'s open batches, another API).
- test_add_chord_to_chord: not applicable: `Task.add_to_chord` again.
- test_eager_chord_inside_task: ported as test_eager_chord_inside_task (`chord_add` builds `celery_fanin.chord`, its
  header a list).
- test_group_chain: ported in test_cases_whose_tasks_need_a_result_backend (`chord(group(...), add_to_all.s(8))`).
- test_group_kwargs: ported in test_cases_whose_tasks_need_a_result_backend.
- test_group_args_and_kwargs: ported in test_cases_whose_tasks_need_a_result_backend (the list asserted in order,
  which Celery's Redis backend does not keep).
- test_nested_group_chain: ported in test_groups_in_chains_in_the_header_are_refused (the group at the end of the
  header's chain); the counterpart with a nested chord in test_a_chord_at_the_end_of_a_chain_in_the_header.
- test_single_task_header: ported in test_cases_whose_tasks_need_a_result_backend (its `group | task` form as
  `chord(header)(body)`).
- test_empty_header_chord: ported in test_cases_whose_tasks_need_a_result_backend (its `group | task` form as
  `chord(header)(body)`).
- test_nested_chord: ported: its first canvas in test_cases_whose_tasks_need_a_result_backend (its body is
  `add_to_all`), its third (four levels) in test_results_in_header_order; its second is the first written as `group
  | task`.
- test_parent_ids: ported as test_parent_ids[test_parent_ids]; the root ids, values and order are asserted before
  the parent ids (the results before and inside the body are plain tasks', read from the
  result backend as Celery reads them).
- test_parent_ids__OR: ported as test_parent_ids[test_parent_ids__OR], as test_parent_ids.
- test_chord_on_error: ported in test_errback_flags_and_nested_chords: the error names the failed task, the
  old-style errback runs once with the body's id, the header's results (`[3, 7]` and one failure) read from
  `fanin_children` where Celery reads the Redis backend's `.j` key.
- test_generator: ported in test_results_in_header_order (sizes 3 to 9: a generator header, the sum, every task ran)
  but for its point, which is not applicable: it asserts that the first header task ran before the generator ended
  (celery #3021); a fan-in validates and writes the whole header in one transaction before publishing any of it, by
  design (so no one-second sleeps).
- test_parallel_chords: ported in test_results_in_header_order.
- test_chord_in_chords_with_chains: ported in test_a_chord_at_the_end_of_a_chain_in_the_header.
- test_chain_chord_chain_chord: ported in test_a_chord_at_the_end_of_a_chain_in_the_header.
- test_chord_in_chain_with_args: ported in test_cases_whose_tasks_need_a_result_backend (xfail in Celery, #6176):
  `chain(chord(...), identity.s())` ends in a plain task, whose result only a result backend holds.
- test_chain_in_chain_with_args: not applicable: no chord in it (a chain in a chain, celery #6200).
- test_large_header: ported in test_large_headers.
- test_chain_to_a_chord_with_large_header: ported in test_large_headers.
- test_priority: not applicable: no chord in it (a one-task chain's priority).
- test_priority_chain: not applicable: no chord in it (a chain's priority).
- test_nested_chord_group: ported in test_results_in_header_order: the refusal, and the group as the header.
- test_nested_chord_group_chain_group_tail: ported in test_groups_in_chains_in_the_header_are_refused (the
  refusal); the counterpart with a nested chord in test_a_chord_at_the_end_of_a_chain_in_the_header.
- test_error_propagates_from_chord: ported in test_error_propagates_from_chord; its chain ends
  in a group with no body, the counterpart is a chord with `tsum.s()` as body; the error is that of a task before
  the chord, which only a result backend holds.
- test_error_propagates_from_chord2: ported in test_error_propagation (a chord with `tsum.s()` as body, as above).
- test_error_propagates_to_chord_from_simple: ported in test_error_propagation (header and body).
- test_immutable_errback_called_by_chord_from_simple: ported in test_errbacks_from_simple_and_chain_members (header
  and body).
- test_mutable_errback_called_by_chord_from_simple: ported in test_errbacks_from_simple_and_chain_members (both
  errback styles, header and body).
- test_error_propagates_to_chord_from_chain: ported in test_error_propagation (header and body).
- test_immutable_errback_called_by_chord_from_chain: ported in test_errbacks_from_simple_and_chain_members
  (header and body).
- test_mutable_errback_called_by_chord_from_chain: ported in test_errbacks_from_simple_and_chain_members (both
  styles, header and body).
- test_error_propagates_to_chord_from_chain_tail: ported in test_error_propagation (header and body).
- test_immutable_errback_called_by_chord_from_chain_tail: ported in test_errbacks_from_simple_and_chain_members
  (header and body).
- test_mutable_errback_called_by_chord_from_chain_tail: ported in test_errbacks_from_simple_and_chain_members (both
  styles, header and body).
- test_error_propagates_to_chord_from_group: ported in test_error_propagation (the header group: the refusal, then
  the group as the header; and the body).
- test_immutable_errback_called_by_chord_from_group: ported in test_errbacks_from_groups (the header group as
  above, and the body).
- test_mutable_errback_called_by_chord_from_group: ported in test_errbacks_from_groups (both styles, the header and
  the body).
- test_immutable_errback_called_by_chord_from_group_fail_multiple: ported in test_errbacks_from_groups (the
  header and the body).
- test_mutable_errback_called_by_chord_from_group_fail_multiple_on_header_failure: ported in
  test_errbacks_from_groups (both styles).
- test_mutable_errback_called_by_chord_from_group_fail_multiple_on_body_failure: ported in test_errbacks_from_groups
  (both styles).
- test_chord_header_task_replaced_with_chain: ported in test_tasks_replaced_with_chains (its header a list).
- test_chord_header_child_replaced_with_chain_first: ported in test_tasks_replaced_with_chains.
- test_chord_header_child_replaced_with_chain_middle: ported in test_tasks_replaced_with_chains.
- test_chord_header_child_replaced_with_chain_last: ported in test_tasks_replaced_with_chains.
- test_chord_body_task_replaced_with_chain: ported in test_tasks_replaced_with_chains (its header a list).
- test_chord_body_chain_child_replaced_with_chain_first: ported in test_tasks_replaced_with_chains (its header a
  list).
- test_chord_body_chain_child_replaced_with_chain_middle: ported in test_tasks_replaced_with_chains (its header a
  list).
- test_chord_body_chain_child_replaced_with_chain_last: ported in test_tasks_replaced_with_chains (its header a
  list).
- test_nested_chord_header_link_error: ported in test_errback_flags_and_nested_chords.
- test_enabling_flag_allow_error_cb_on_chord_header: ported in test_errback_flags_and_nested_chords.
- test_disabling_flag_allow_error_cb_on_chord_header: ported in test_errback_flags_and_nested_chords.
- test_flag_allow_error_cb_on_chord_header_on_upgraded_chord: ported in test_errback_flags_and_nested_chords,
  `chord(header, body).link_error(...)` for Celery's upgraded `chain(group(header), body)` (cause 6, fixed).
- test_upgraded_chord_link_error_with_header_errback_enabled: ported in test_errback_flags_and_nested_chords, with
  `chain(identity.si(42), chord(...))`.
- test_chord_error_propagation_with_different_body_types: ported in test_errback_flags_and_nested_chords (a task, a
  chain and a group as body; no "task_id must not be empty" in the worker's log), and a chord as body in
  test_chord_error_propagation_with_a_chord_as_body.
- test_chord_error_in_nested_chain_does_not_crash: ported in test_cases_whose_tasks_need_a_result_backend:
  `chain(chord(...), identity.s())`, whose result is the plain task's after the chord.
- test_chord_unlock_with_failed_task_in_nested_chain_member: ported in
  test_a_chord_at_the_end_of_a_chain_in_the_header (the nested group a nested chord); there is no `chord_unlock`,
  but the claim stands: a header chain whose first task fails before a nested chord fails the chord promptly
  (Celery's TIMEOUT / 10), and the nested chord is never written.
"""

from __future__ import annotations

import re
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import chain, group
from celery.backends.base import DisabledBackend
from celery.exceptions import ChordError
from celery.result import AsyncResult
from kombu.serialization import loads

from celery_fanin import ChordHeaderFailed, FanInResult, InvalidFanIn, chord
from tests.chord_tasks import (
    ExpectedException,
    add,
    add_replaced,
    add_to_all,
    chord_add,
    collect_ids,
    errback_new_style,
    errback_old_style,
    fail,
    identity,
    ids,
    print_unicode,
    redis_count,
    redis_echo,
    replace_with_chain,
    tsum,
    write_to_file_and_return_int,
)
from tests.sql import rows
from tests.workers import wait_for

pytestmark = [pytest.mark.e2e]

TIMEOUT = 20  # Celery's is 60: each canvas here takes a second or two
ERRBACK_STYLES = {"old_style": errback_old_style, "new_style": errback_new_style}

Steps = Iterator[None]


# --- running several cases in one test function -------------------------------------------------------------------


class Cases:
    """Several of Celery's cases in one test function (one worker, one relay), each under its name.

    A case is a generator: it sends its canvas, `yield`s, then waits for and checks what it sent (and may yield
    again, to check once nothing is left to run). All are sent first, then all are checked, against one shared
    timeout: several that hang cost one timeout, not one each. A case's failure is recorded, and the test fails
    at the end naming every case that failed, so that one failure hides no other.
    """

    def __init__(self, timeout: float = TIMEOUT) -> None:
        self.timeout = timeout
        self.deadline: float | None = None
        self.failed: dict[str, str] = {}
        self.ran: dict[str, None] = {}
        self.pending: dict[str, Steps] = {}

    def left(self) -> float:
        """What is left of the one timeout, which starts with the first wait."""
        if self.deadline is None:
            self.deadline = time.monotonic() + self.timeout
        return max(1.0, self.deadline - time.monotonic())

    @contextmanager
    def case(self, name: str) -> Iterator[None]:
        self.ran[name] = None
        try:
            yield
        except (Exception, pytest.fail.Exception):  # pytest.raises's "DID NOT RAISE" is no Exception
            self.failed[name] = traceback.format_exc(limit=8)
            self.pending.pop(name, None)

    def start(self, name: str, steps: Steps) -> None:
        """Run a case up to its first `yield` (it sends its canvas)."""
        with self.case(name):
            if next(steps, "done") is None:
                self.pending[name] = steps

    def add(self, name: str) -> Callable[[Callable[[], Steps]], Callable[[], Steps]]:
        """`start`, as a decorator."""

        def decorate(case: Callable[[], Steps]) -> Callable[[], Steps]:
            self.start(name, case())
            return case

        return decorate

    def step(self) -> None:
        """Run every pending case on to its next `yield` (or its end)."""
        for name, steps in list(self.pending.items()):
            with self.case(name):
                if next(steps, "done") == "done":
                    del self.pending[name]

    def check(self) -> None:
        while self.pending:
            self.step()
        if self.failed:
            text = "\n\n".join(f"--- {name} ---\n{trace}" for name, trace in self.failed.items())
            pytest.fail(f"{len(self.failed)} of {len(self.ran)} cases failed: {list(self.failed)}\n\n{text}")


def _captured(check: Callable[[], Any]) -> str | None:
    """The failure of `check` as text (None if it passed), to report after the checks that come after it."""
    try:
        check()
    except (Exception, pytest.fail.Exception):
        return traceback.format_exc(limit=8)
    return None


class World:
    """The test's worker, its Redis (where Celery's tasks echo and count), and the store."""

    def __init__(self, producer: Any, worker: Any, redis_url: str) -> None:
        self.producer = producer
        self.worker = worker
        self.redis = redis.Redis.from_url(redis_url)

    def echoes(self, key: str) -> list[str]:
        return [m.decode() if isinstance(m, bytes) else str(m) for m in self.redis.lrange(key, 0, -1)]

    def count(self, key: str) -> int:
        value = self.redis.get(key)
        return int(value) if value is not None else 0

    def _idle(self) -> bool:
        if self.redis.llen(self.producer.conf.task_default_queue):
            return False
        if rows(self.producer, "SELECT count(*) AS n FROM fanin_outbox WHERE sent_at IS NULL")[0].n:
            return False
        inspect = self.producer.control.inspect(destination=[self.worker.name], timeout=2)
        for ask in (inspect.active, inspect.reserved, inspect.scheduled):
            replies = ask() or {}
            if not replies or any(replies.values()):
                return False
        return True

    def settle(self) -> None:
        """Wait until nothing is left to run (twice in a row): every callback that was going to run has run."""
        wait_for(lambda: self._idle() and self._idle(), TIMEOUT, interval=0.2, message="nothing left to run")

    def worker_log(self) -> str:
        return str(self.worker.output())

    def log_lines(self, *signs: str) -> str:
        """The worker's log lines that hold every sign."""
        return "\n".join(line for line in self.worker_log().splitlines() if all(s in line for s in signs))

    def task_names(self) -> dict[str, set[str]]:
        """Task id -> the names of the tasks the worker received under it (a task that replaces itself hands its
        id on: `celery_fanin.then_canvas` and the last task of the chain it runs)."""
        names: dict[str, set[str]] = {}
        for name, task_id in re.findall(r"Task ([\w.]+)\[([0-9a-f-]{36})\] received", self.worker_log()):
            names.setdefault(task_id, set()).add(name)
        return names


def _batches(producer: Any) -> int:
    return int(rows(producer, "SELECT count(*) AS n FROM fanin_batches")[0].n)


def _start(
    producer: Any,
    processes: Any,
    e2e_env: dict[str, str],
    concurrency: int = 3,
    extra_env: dict[str, str] | None = None,
) -> World:
    worker = processes.worker(extra_env=extra_env, concurrency=concurrency)
    processes.relay()
    return World(producer, worker, e2e_env["FANIN_TEST_BROKER"])


def _header_failed(handle: Any, timeout: float, *names: str) -> ChordHeaderFailed:
    """Celery: `pytest.raises(ExpectedException)`; here the chord's error, naming what failed."""
    with pytest.raises(ChordError) as caught:
        handle.get(timeout=timeout)
    err = caught.value
    assert isinstance(err, ChordHeaderFailed), f"{type(err).__name__}: {err}"
    for name in names or ("ExpectedException",):
        assert name in str(err), f"{name!r} not in {str(err)!r}"
    return err


def _body_failed(handle: Any, timeout: float) -> None:
    """Celery: `pytest.raises(ExpectedException)`, raised by the body: the class of tests.chord_tasks, not one made
    by its name. Any other error goes through as it is."""
    with pytest.raises(ExpectedException):
        handle.get(timeout=timeout)


def _body(chord_sig: Any) -> Any:
    """Celery's `chord_sig.body`."""
    body = chord_sig.body
    assert body is not None
    return body


def _refused(producer: Any, build: Callable[[], Any]) -> None:
    """Refused with InvalidFanIn, and nothing written."""
    before = _batches(producer)
    with pytest.raises(InvalidFanIn):
        build().apply_async()
    assert _batches(producer) == before


@pytest.fixture
def result_backend(e2e_env: dict[str, str], producer: Any) -> Iterator[str]:
    """The producer with a Redis result backend (the broker's database), as the worker started with it has."""
    backend = e2e_env["FANIN_TEST_BROKER"]
    before = producer.conf.result_backend
    producer.conf.result_backend = backend
    producer._local.__dict__.pop("backend", None)  # the app caches its backend per thread
    yield backend
    producer._local.__dict__.pop("backend", None)
    producer.conf.result_backend = before


@pytest.fixture
def late_world(producer: Any, processes: Any, e2e_env: dict[str, str]) -> Iterator[Callable[..., World]]:
    """`late_world(extra_env=None)` starts the worker and relay when a case asks (some with a result backend). The
    worker is SIGKILLed at the end: these cases check nothing of its shutdown, and a warm one costs two seconds."""
    worlds: list[World] = []

    def start(extra_env: dict[str, str] | None = None) -> World:
        worlds.append(_start(producer, processes, e2e_env, extra_env=extra_env))
        return worlds[-1]

    yield start
    for world in worlds:
        world.worker.kill()


# --- the cases of a failing header or body member, with their errbacks ----------------------------------------


@dataclass
class MemberCase:
    """A chord whose header or body holds a failing member; `check` asserts its errbacks once nothing is left to
    run; `failing_id` is the frozen id of the task that fails, where the case freezes one."""

    sig: Any
    check: Callable[[World], None]
    failing_id: str | None = None


MEMBERS: dict[str, Callable[[Any], Any]] = {
    "from_simple": lambda fail_sig: fail_sig,
    "from_chain": lambda fail_sig: chain(identity.si(42), fail_sig, identity.si(42)),
    "from_chain_tail": lambda fail_sig: chain(identity.si(42), fail_sig),
    "from_group": lambda fail_sig: group(identity.si(42), fail_sig),
}


def _member_chord(member: Any, where: str) -> Any:
    """Celery's `chord((member,), identity.s())` or `chord((identity.si(42),), member)`; a group member in the
    header is the header itself (a group in the header is refused: see the module's docstring)."""
    if where == "body":
        return chord((identity.si(42),), member)
    if isinstance(member, group):
        return chord(member, identity.s())
    return chord((member,), identity.s())


def error_propagates(kind: str, where: str) -> MemberCase:
    """test_error_propagates_to_chord_<kind>: no errback."""
    return MemberCase(_member_chord(MEMBERS[kind](fail.s()), where), lambda world: None)


def immutable_errback(kind: str, where: str) -> MemberCase:
    """test_immutable_errback_called_by_chord_<kind>: redis_echo.si(errback_msg, redis_key=redis_key), once."""
    errback_msg, redis_key = str(uuid.uuid4()), str(uuid.uuid4())
    chord_sig = _member_chord(MEMBERS[kind](fail.s()), where)
    chord_sig.link_error(redis_echo.si(errback_msg, redis_key=redis_key))

    def check(world: World) -> None:
        assert world.echoes(redis_key) == [errback_msg]

    return MemberCase(chord_sig, check)


def mutable_errback(kind: str, where: str, style: str) -> MemberCase:
    """test_mutable_errback_called_by_chord_<kind>: errback_task.s(), counted under the id of the task that failed
    (the body's when a header task failed)."""
    fail_sig = fail.s()
    fail_sig_id = fail_sig.freeze().id
    chord_sig = _member_chord(MEMBERS[kind](fail_sig), where)
    chord_sig.link_error(ERRBACK_STYLES[style].s())
    expected_redis_key = _body(chord_sig).freeze().id if where == "header" else fail_sig_id

    def check(world: World) -> None:
        assert world.count(expected_redis_key) == 1

    return MemberCase(chord_sig, check, fail_sig_id)


FAIL_TASK_COUNT = 42


def immutable_errback_fail_multiple(where: str) -> MemberCase:
    """test_immutable_errback_called_by_chord_from_group_fail_multiple: once for the header (the errback is the
    body's), once per failing task of the body group."""
    redis_key = str(uuid.uuid4())
    child_sig = group(*(identity.si(42) for _ in range(24)), *(fail.s() for _ in range(FAIL_TASK_COUNT)))
    chord_sig = _member_chord(child_sig, where)
    chord_sig.link_error(redis_count.si(redis_key=redis_key))
    expected = 1 if where == "header" else FAIL_TASK_COUNT

    def check(world: World) -> None:
        assert world.count(redis_key) == expected

    return MemberCase(chord_sig, check)


def mutable_errback_fail_multiple_on_header_failure(style: str) -> MemberCase:
    child_sig = group(*(identity.si(42) for _ in range(8)), *(fail.s() for _ in range(FAIL_TASK_COUNT)))
    chord_sig = chord(child_sig, identity.s())
    chord_sig.link_error(ERRBACK_STYLES[style].s())
    expected_redis_key = _body(chord_sig).freeze().id

    def check(world: World) -> None:
        assert world.count(expected_redis_key) == 1

    return MemberCase(chord_sig, check)


def mutable_errback_fail_multiple_on_body_failure(style: str) -> MemberCase:
    fail_sigs = tuple(fail.s() for _ in range(FAIL_TASK_COUNT))
    fail_sig_ids = tuple(s.freeze().id for s in fail_sigs)
    chord_sig = chord((identity.si(42),), group(*(identity.si(42) for _ in range(8)), *fail_sigs))
    chord_sig.link_error(ERRBACK_STYLES[style].s())

    def check(world: World) -> None:
        assert [world.count(key) for key in fail_sig_ids] == [1] * len(fail_sig_ids)

    return MemberCase(chord_sig, check)


def _member_case(cases: Cases, where: str, case: MemberCase, world: World) -> Steps:
    """Sends the chord; then its error, as Celery's case expects it; then, once nothing is left to run, its
    errbacks (checked even if the error was not the one expected, which is reported after)."""
    res = case.sig.delay()
    yield
    if where == "header":
        error = _captured(lambda: _header_failed(res, cases.left()))
    else:
        error = _captured(lambda: _body_failed(res, cases.left()))
    yield  # world.settle()
    case.check(world)
    assert error is None, error


def _run_errback_cases(world: World, cases: Cases) -> None:
    cases.step()  # every error
    world.settle()
    cases.check()  # every errback


# --- values -------------------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_results_in_header_order(producer: Any, processes: Any, e2e_env: dict[str, str], tmp_path: Path) -> None:
    assert isinstance(producer.backend, DisabledBackend), "the body's list is read from PostgreSQL"
    _start(producer, processes, e2e_env)
    cases = Cases()

    @cases.add("test_simple_chord_with_a_delay_in_group_save")
    def simple_chord_with_a_delay_in_group_save() -> Steps:
        c = chord(header=[add.si(1, 1), add.si(1, 1)], body=tsum.s())
        result = c()
        yield
        assert isinstance(result, FanInResult)
        assert result.get(timeout=cases.left()) == 4

    @cases.add("test_chord_order")
    def chord_order() -> Steps:
        inputs = list(range(10))
        c = chord((identity.si(i) for i in inputs), identity.s())
        result = c()
        yield
        assert result.get(timeout=cases.left()) == inputs

    def generator(size: int) -> Steps:
        def assert_generator(file_name: str) -> Iterator[Any]:
            for i in range(size):  # Celery sleeps here and checks the first task ran (see the module's docstring)
                yield write_to_file_and_return_int.s(file_name, i)

        file_name = str(tmp_path / f"generator-{size}")
        c = chord(assert_generator(file_name), tsum.s())
        res = c()
        yield
        assert res.get(timeout=cases.left()) == size * (size - 1) // 2
        assert sorted(int(line) for line in Path(file_name).read_text().split()) == list(range(size))

    for size in range(3, 10):
        cases.start(f"test_generator[{size}]", generator(size))

    @cases.add("test_parallel_chords")
    def parallel_chords() -> Steps:
        c1 = chord(group(add.s(1, 2), add.s(3, 4)), tsum.s())
        c2 = chord(group(add.s(1, 2), add.s(3, 4)), tsum.s())
        g = group(c1, c2)
        r = g.delay()
        yield
        assert r.get(timeout=cases.left()) == [10, 10]

    @cases.add("test_nested_chord (its third canvas)")
    def nested_chord() -> Steps:
        # group([group([group([group([add.s(1, 2)]) | add.s([3])]) | add.s([4])]) | add.s([5])]) | add.s([6])
        c = chord([chord([chord([chord([add.s(1, 2)], add.s([3]))], add.s([4]))], add.s([5]))], add.s([6]))
        res = c()
        yield
        assert res.get(timeout=cases.left()) == [[[[3, 3], 4], 5], 6]

    @cases.add("test_nested_chord_group")
    def nested_chord_group() -> Steps:
        _refused(producer, lambda: chord((group(identity.s(42), identity.s(42)),), identity.s()))
        sig = chord(group(identity.s(42), identity.s(42)), identity.s())  # the group unrolled, as Celery does
        res = sig.delay()
        yield
        assert res.get(timeout=cases.left()) == [42, 42]

    cases.check()


@pytest.mark.timeout(30)
def test_groups_in_chains_in_the_header_are_refused(producer: Any) -> None:
    """The refusals of test_nested_group_chain and test_nested_chord_group_chain_group_tail (their counterparts, with
    a nested chord, are test_a_chord_at_the_end_of_a_chain_in_the_header's): nothing runs, so no worker."""
    # test_nested_group_chain. Celery: chain(add.si(1, 0), group(add.si(1, 100), chain(add.si(1, 200),
    # group(add.si(1, 1000), add.si(1, 2000)))), add.si(1, 10)): the group before add.si(1, 10) is the header, the
    # inner one is in it.
    _refused(
        producer,
        lambda: chord([add.si(1, 100), chain(add.si(1, 200), group(add.si(1, 1000), add.si(1, 2000)))], add.si(1, 10)),
    )
    # test_nested_chord_group_chain_group_tail
    _refused(producer, lambda: chord(group(chain(identity.s(42), group(identity.s(), identity.s()))), identity.s()))


@pytest.mark.timeout(90)
def test_large_headers(producer: Any, processes: Any, e2e_env: dict[str, str]) -> None:
    _start(producer, processes, e2e_env, concurrency=4)
    cases = Cases(timeout=60)

    @cases.add("test_large_header")
    def large_header() -> Steps:
        c = chord(group(identity.si(i) for i in range(1000)), tsum.s())  # group(...) | tsum.s()
        res = c.delay()
        yield
        assert res.get(timeout=cases.left()) == 499500

    @cases.add("test_chain_to_a_chord_with_large_header")
    def chain_to_a_chord_with_large_header() -> Steps:
        c = identity.si(1) | chord(group(identity.s() for _ in range(1000)), tsum.s())
        res = c.delay()
        yield
        assert res.get(timeout=cases.left()) == 1000

    cases.check()


@pytest.mark.timeout(60)
def test_tasks_replaced_with_chains(producer: Any, processes: Any, e2e_env: dict[str, str]) -> None:
    _start(producer, processes, e2e_env)
    cases = Cases()

    def replaced(orig_sig: Any, expected: list[int]) -> Steps:
        res_obj = orig_sig.delay()
        yield
        assert res_obj.get(timeout=cases.left()) == expected

    # (Celery gives the header replace_with_chain.si(42) and identity.s(42) alone: see the module's docstring)
    cases.start(
        "test_chord_header_task_replaced_with_chain",
        replaced(chord([replace_with_chain.si(42)], identity.s()), [42]),
    )
    cases.start(
        "test_chord_header_child_replaced_with_chain_first",
        replaced(chord((replace_with_chain.si(42), identity.s(1337)), identity.s()), [42, 1337]),
    )
    cases.start(
        "test_chord_header_child_replaced_with_chain_middle",
        replaced(
            chord((identity.s(42), replace_with_chain.s(1337), identity.s(31337)), identity.s()), [42, 1337, 31337]
        ),
    )
    cases.start(
        "test_chord_header_child_replaced_with_chain_last",
        replaced(chord((identity.s(42), replace_with_chain.s(1337)), identity.s()), [42, 1337]),
    )
    cases.start(
        "test_chord_body_task_replaced_with_chain",
        replaced(chord([identity.s(42)], replace_with_chain.s()), [42]),
    )
    cases.start(
        "test_chord_body_chain_child_replaced_with_chain_first",
        replaced(chord([identity.s(42)], chain(replace_with_chain.s(), identity.s())), [42]),
    )
    cases.start(
        "test_chord_body_chain_child_replaced_with_chain_middle",
        replaced(chord([identity.s(42)], chain(identity.s(), replace_with_chain.s(), identity.s())), [42]),
    )
    cases.start(
        "test_chord_body_chain_child_replaced_with_chain_last",
        replaced(chord([identity.s(42)], chain(identity.s(), replace_with_chain.s())), [42]),
    )
    cases.check()


# --- errors -------------------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_error_propagation(producer: Any, processes: Any, e2e_env: dict[str, str]) -> None:
    world = _start(producer, processes, e2e_env)
    cases = Cases()
    with cases.case("test_error_propagates_to_chord_from_group (the group in the header is refused)"):
        _refused(producer, lambda: chord((group(identity.si(42), fail.s()),), identity.s()))
    for kind, where in [
        ("from_simple", "header"),
        ("from_simple", "body"),
        ("from_chain", "header"),
        ("from_chain", "body"),
        ("from_chain_tail", "header"),
        ("from_chain_tail", "body"),
        ("from_group", "header"),
        ("from_group", "body"),
    ]:
        name = f"test_error_propagates_to_chord_{kind} ({where})"
        cases.start(name, _member_case(cases, where, error_propagates(kind, where), world))

    @cases.add("test_error_propagates_from_chord2")
    def error_propagates_from_chord2() -> Steps:
        sig = add.s(1, 1) | add.s(1) | chord([add.s(1), fail.s()], tsum.s())  # Celery: ... | group(add.s(1), fail.s())
        res = sig.delay()
        yield
        _header_failed(res, cases.left())

    _run_errback_cases(world, cases)


@pytest.mark.timeout(60)
def test_errbacks_from_simple_and_chain_members(producer: Any, processes: Any, e2e_env: dict[str, str]) -> None:
    world = _start(producer, processes, e2e_env)
    cases = Cases()
    for kind, where in [
        ("from_simple", "header"),
        ("from_simple", "body"),
        ("from_chain", "header"),
        ("from_chain", "body"),
        ("from_chain_tail", "header"),
        ("from_chain_tail", "body"),
    ]:
        name = f"test_immutable_errback_called_by_chord_{kind} ({where})"
        cases.start(name, _member_case(cases, where, immutable_errback(kind, where), world))
    for style in ERRBACK_STYLES:
        for kind, where in [
            ("from_simple", "header"),
            ("from_simple", "body"),
            ("from_chain", "header"),
            ("from_chain", "body"),
            ("from_chain_tail", "header"),
            ("from_chain_tail", "body"),
        ]:
            name = f"test_mutable_errback_called_by_chord_{kind}[{style}] ({where})"
            cases.start(name, _member_case(cases, where, mutable_errback(kind, where, style), world))
    _run_errback_cases(world, cases)


@pytest.mark.timeout(60)
def test_errbacks_from_groups(producer: Any, processes: Any, e2e_env: dict[str, str]) -> None:
    """The groups in the header and as the body (written as a fan-in of their own: no result backend needed)."""
    world = _start(producer, processes, e2e_env)
    cases = Cases()

    with cases.case("test_immutable_errback_called_by_chord_from_group (the group in the header is refused)"):
        _refused(producer, lambda: chord((group(identity.si(42), fail.s()),), identity.s()))
    cases.start(
        "test_immutable_errback_called_by_chord_from_group (header)",
        _member_case(cases, "header", immutable_errback("from_group", "header"), world),
    )
    cases.start(
        "test_immutable_errback_called_by_chord_from_group_fail_multiple (header)",
        _member_case(cases, "header", immutable_errback_fail_multiple("header"), world),
    )
    for style in ERRBACK_STYLES:
        cases.start(
            f"test_mutable_errback_called_by_chord_from_group[{style}] (header)",
            _member_case(cases, "header", mutable_errback("from_group", "header", style), world),
        )
        cases.start(
            f"test_mutable_errback_called_by_chord_from_group_fail_multiple_on_header_failure[{style}]",
            _member_case(cases, "header", mutable_errback_fail_multiple_on_header_failure(style), world),
        )
    for name, case in GROUP_BODY_CASES.items():
        cases.start(name, _member_case(cases, "body", case(), world))
    _run_errback_cases(world, cases)


# A group as the body: each failing member calls the errbacks (Celery's `group.link_error` links them to every
# member), and the handle's get() raises the first failing member's error, as a group's result does.
GROUP_BODY_CASES: dict[str, Callable[[], MemberCase]] = {
    "test_immutable_errback_called_by_chord_from_group (body)": lambda: immutable_errback("from_group", "body"),
    "test_mutable_errback_called_by_chord_from_group[old_style] (body)": lambda: mutable_errback(
        "from_group", "body", "old_style"
    ),
    "test_mutable_errback_called_by_chord_from_group[new_style] (body)": lambda: mutable_errback(
        "from_group", "body", "new_style"
    ),
    "test_immutable_errback_called_by_chord_from_group_fail_multiple (body)": lambda: immutable_errback_fail_multiple(
        "body"
    ),
    "test_mutable_errback_called_by_chord_from_group_fail_multiple_on_body_failure[old_style]": lambda: (
        mutable_errback_fail_multiple_on_body_failure("old_style")
    ),
    "test_mutable_errback_called_by_chord_from_group_fail_multiple_on_body_failure[new_style]": lambda: (
        mutable_errback_fail_multiple_on_body_failure("new_style")
    ),
}


HEADERS = (
    (fail.si(),),
    (fail.si(), fail.si(), fail.si()),
    (fail.si(), identity.si(42)),
    (fail.si(), identity.si(42), identity.si(42)),
    (fail.si(), identity.si(42), fail.si()),
    (fail.si(), identity.si(42), fail.si(), identity.si(42)),
    (fail.si(), identity.si(42), fail.si(), identity.si(42), fail.si()),
)


def _fresh(header: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(sig.clone() for sig in header)


def _failed_count(header: tuple[Any, ...]) -> int:
    return sum(1 for sig in header if sig.name == fail.name)


@contextmanager
def _allow_error_cb_on_chord_header(producer: Any, value: bool) -> Iterator[None]:
    before = producer.conf.task_allow_error_cb_on_chord_header
    producer.conf.task_allow_error_cb_on_chord_header = value
    try:
        yield
    finally:
        producer.conf.task_allow_error_cb_on_chord_header = before


@pytest.mark.timeout(60)
def test_errback_flags_and_nested_chords(producer: Any, processes: Any, e2e_env: dict[str, str]) -> None:
    world = _start(producer, processes, e2e_env)
    cases = Cases()

    @cases.add("test_chord_on_error")
    def chord_on_error() -> Steps:
        c1 = chord(
            header=[add.s(1, 2), add.s(3, 4), fail.s()],
            body=print_unicode.s("This should not be called").on_error(errback_old_style.s()),
        )
        res = c1()
        yield
        err = _header_failed(res, cases.left())
        # Celery finds the failed task's id in the ChordError its errback got
        uuid_patt = re.compile(r"[0-9A-Fa-f]{8}-([0-9A-Fa-f]{4}-){3}[0-9A-Fa-f]{12}")
        failed_ids = [m.group() for m in uuid_patt.finditer(str(err))]
        children = rows(
            producer,
            "SELECT task_id, state, result, result_content_type, result_content_encoding FROM fanin_children "
            "WHERE batch_id = :b ORDER BY idx",
            b=res.batch_id,
        )
        assert children[2].task_id in failed_ids, f"the failed task {children[2].task_id} is named: {err}"
        # Celery reads the header's results from the Redis backend's .j key
        assert [loads(c.result, c.result_content_type, c.result_content_encoding) for c in children[:2]] == [3, 7]
        assert [c.state for c in children] == ["succeeded", "succeeded", "failed"]
        assert res.parent.completed_count() == 2
        yield  # world.settle()
        assert world.count(res.id) == 1, "the old-style errback, once, with the body's id"

    with _allow_error_cb_on_chord_header(producer, False):

        @cases.add("test_nested_chord_header_link_error")
        def nested_chord_header_link_error() -> Steps:
            errback_msg, errback_key = "errback called", f"echo_errback-{uuid.uuid4()}"
            body_msg, body_key = "chord body called", f"echo_body-{uuid.uuid4()}"
            chord_inner = chord([identity.si("t1"), fail.si()], identity.si("t2 (body)"))
            chord_outer = chord(group([identity.si("t3"), chord_inner]), redis_echo.si(body_msg, redis_key=body_key))
            chord_outer.link_error(redis_echo.si(errback_msg, redis_key=errback_key))
            res = chord_outer.delay()
            yield
            error = _captured(lambda: _header_failed(res, cases.left()))  # Celery does not ask
            yield  # world.settle()
            assert world.echoes(body_key) == [], "Chord body was called when it should have not"
            assert world.echoes(errback_key) == [errback_msg], "only one errback"
            assert error is None, error

    def header_fails(chord_sig: Any, check_errbacks: Callable[[], None]) -> Steps:
        res = chord_sig.delay()
        yield
        error = _captured(lambda: _header_failed(res, cases.left()))
        yield  # world.settle()
        check_errbacks()
        assert error is None, error

    with _allow_error_cb_on_chord_header(producer, True):
        for i, header in enumerate(HEADERS):
            header = _fresh(header)
            header_errback_key, body_errback_key = f"header-errback-{uuid.uuid4()}", f"body-errback-{uuid.uuid4()}"
            body_key = f"echo_body-{uuid.uuid4()}"
            chord_sig = chord(header, redis_echo.si("chord body called", redis_key=body_key))
            # link error to chord header ONLY
            for header_task in chord_sig.tasks:
                header_task.link_error(redis_echo.si("header errback called", redis_key=header_errback_key))
            # link error to chord body ONLY
            _body(chord_sig).link_error(redis_echo.si("body errback called", redis_key=body_errback_key))

            def enabled(
                header: tuple[Any, ...] = header,
                hk: str = header_errback_key,
                bk: str = body_errback_key,
                body_key: str = body_key,
            ) -> None:
                assert world.echoes(body_key) == [], "Chord body was called when it should have not"
                # the errback was called for each failed header task, and for the body
                assert world.echoes(hk) == ["header errback called"] * _failed_count(header)
                assert world.echoes(bk) == ["body errback called"]

            cases.start(
                f"test_enabling_flag_allow_error_cb_on_chord_header (header {i})", header_fails(chord_sig, enabled)
            )

    with _allow_error_cb_on_chord_header(producer, False):
        for i, header in enumerate(HEADERS):
            errback_key, body_key = f"echo_errback-{uuid.uuid4()}", f"echo_body-{uuid.uuid4()}"
            chord_sig = chord(_fresh(header), redis_echo.si("chord body called", redis_key=body_key))
            chord_sig.link_error(redis_echo.si("errback called", redis_key=errback_key))

            def disabled(errback_key: str = errback_key, body_key: str = body_key) -> None:
                assert world.echoes(body_key) == [], "Chord body was called when it should have not"
                assert world.echoes(errback_key) == ["errback called"], "only one errback"

            name = f"test_disabling_flag_allow_error_cb_on_chord_header (header {i})"
            cases.start(name, header_fails(chord_sig, disabled))

    with _allow_error_cb_on_chord_header(producer, True):
        # cause 6, fixed: chord.link_error links the errback to each header task with the flag on, as Celery's
        for i, header in enumerate(HEADERS[1:], start=1):  # Celery leaves out the header of one task (no upgrade)
            header = _fresh(header)
            errback_key, body_key = f"echo_errback-{uuid.uuid4()}", f"echo_body-{uuid.uuid4()}"
            chord_sig = chord(header, redis_echo.si("chord body called", redis_key=body_key))  # chain(group, body)
            chord_sig.link_error(redis_echo.si("errback called", redis_key=errback_key))

            def upgraded(header: tuple[Any, ...] = header, ek: str = errback_key, bk: str = body_key) -> None:
                assert world.echoes(bk) == [], "Chord body was called when it should have not"
                # the errback was called for each failed header task + the body
                assert world.echoes(ek) == ["errback called"] * (_failed_count(header) + 1)

            name = f"test_flag_allow_error_cb_on_chord_header_on_upgraded_chord (header {i})"
            cases.start(name, header_fails(chord_sig, upgraded))

        @cases.add("test_upgraded_chord_link_error_with_header_errback_enabled")
        def upgraded_chord_link_error_with_header_errback_enabled() -> Steps:
            body_key, errback_key = f"echo_body-{uuid.uuid4()}", f"echo_errback-{uuid.uuid4()}"
            sig = chain(
                identity.si(42),
                chord([fail.si(), fail.si()], redis_echo.si("chord body called", redis_key=body_key)),
            ).on_error(redis_echo.si("errback called", redis_key=errback_key))
            res = sig.apply_async()
            yield
            _header_failed(res, cases.left())

    def different_body_types(input_body: Callable[[], Any]) -> Steps:
        failing_chord = chord([add.si(15, 7), fail.si()], input_body())  # chain(group([...]), input_body())
        result = failing_chord.apply_async()
        yield
        _header_failed(result, cases.left())
        yield  # world.settle()
        assert "task_id must not be empty" not in world.worker_log()

    bodies = {  # "body is a chord": test_chord_error_propagation_with_a_chord_as_body
        "body is a single_task": lambda: add.si(9, 7),
        "body is a chain": lambda: chain(add.si(9, 7), add.si(5, 7)),
        "body is a group": lambda: group([add.si(9, 7), add.si(5, 7)]),
    }
    for body_id, input_body in bodies.items():
        name = f"test_chord_error_propagation_with_different_body_types[{body_id}]"
        cases.start(name, different_body_types(input_body))

    cases.step()  # every error
    world.settle()
    cases.check()  # every errback


# --- with a result backend, for what is Celery's ------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_cases_whose_tasks_need_a_result_backend(
    producer: Any, processes: Any, e2e_env: dict[str, str], result_backend: str
) -> None:
    world = _start(producer, processes, e2e_env, extra_env={"FANIN_TEST_RESULT_BACKEND": result_backend})
    cases = Cases()

    @cases.add("test_replaced_nested_chord")
    def replaced_nested_chord() -> Steps:
        c1 = chord(
            [
                chord([add.s(1, 2), add_replaced.s(3, 4)], add_to_all.s(5)) | tsum.s(),
                chord([add_replaced.s(6, 7), add.s(0, 0)], add_to_all.s(8)) | tsum.s(),
            ],
            add_to_all.s(9),
        )
        res1 = c1()
        yield
        assert res1.get(timeout=cases.left()) == [29, 38]

    @cases.add("test_group_chain")
    def group_chain() -> Steps:
        c = add.s(2, 2) | chord(group(add.s(i) for i in range(4)), add_to_all.s(8))
        res = c()
        yield
        assert res.get(timeout=cases.left()) == [12, 13, 14, 15]

    @cases.add("test_group_kwargs")
    def group_kwargs() -> Steps:
        c = add.s(2, 2) | chord(group(add.s(i) for i in range(4)), add_to_all.s(8))
        res = c.apply_async(kwargs={"z": 1})
        yield
        assert res.get(timeout=cases.left()) == [13, 14, 15, 16]

    @cases.add("test_group_args_and_kwargs")
    def group_args_and_kwargs() -> Steps:
        c = chord(group(add.s(i) for i in range(4)), add_to_all.s(8))
        res = c.apply_async(args=(4,), kwargs={"z": 1})
        yield
        assert res.get(timeout=cases.left()) == [13, 14, 15, 16]  # in order: the fan-in keeps the header's

    @cases.add("test_single_task_header")
    def single_task_header() -> Steps:
        c1 = chord([add.s(2, 5)], body=add_to_all.s(9))
        res1 = c1()
        res2 = chord([add.s(2, 5)])(add_to_all.s(9))  # Celery: group([add.s(2, 5)]) | add_to_all.s(9)
        yield
        assert res1.get(timeout=cases.left()) == [16]
        assert res2.get(timeout=cases.left()) == [16]

    @cases.add("test_empty_header_chord")
    def empty_header_chord() -> Steps:
        c1 = chord([], body=add_to_all.s(9))
        res1 = c1()
        res2 = chord([])(add_to_all.s(9))  # Celery: group([]) | add_to_all.s(9)
        yield
        assert res1.get(timeout=cases.left()) == []
        assert res2.get(timeout=cases.left()) == []

    @cases.add("test_nested_chord (its first canvas)")
    def nested_chord() -> Steps:
        c1 = chord(
            [chord([add.s(1, 2), add.s(3, 4)], add.s([5])), chord([add.s(6, 7)], add.s([10]))],
            add_to_all.s(["A"]),
        )
        res1 = c1()
        yield
        assert res1.get(timeout=cases.left()) == [[3, 7, 5, "A"], [13, 10, "A"]]

    @cases.add("test_chord_in_chain_with_args")
    def chord_in_chain_with_args() -> Steps:
        c1 = chain(chord([identity.s(), identity.s()], identity.s()), identity.s())
        res1 = c1.apply_async(args=(1,))
        yield
        assert res1.get(timeout=cases.left()) == [1, 1]
        res1 = c1.apply(args=(1,))
        assert res1.get(timeout=cases.left()) == [1, 1]

    @cases.add("test_chord_error_in_nested_chain_does_not_crash")
    def chord_error_in_nested_chain_does_not_crash() -> Steps:
        c = chain(chord([add.si(1, 1), fail.si()], identity.s()), identity.s())  # chain(chain(group(...), ...), ...)
        result = c.apply_async()
        yield
        with pytest.raises((ChordError, ExpectedException)):  # Celery: any error but a TypeError (or none)
            result.get(timeout=cases.left())
        assert "task_id must not be empty" not in world.worker_log()

    cases.check()


# --- eager --------------------------------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_eager_chord_inside_task(producer: Any, e2e_env: dict[str, str]) -> None:
    prev = chord_add.app.conf.task_always_eager
    chord_add.app.conf.task_always_eager = True
    try:
        chord_add.apply_async(args=(4, 8), throw=True).get()
        [batch] = rows(producer, "SELECT state, succeeded FROM fanin_batches")
        assert (batch.state, batch.succeeded) == ("complete", 1)
    finally:
        chord_add.app.conf.task_always_eager = prev


# --- a chord at the end of a chain in the header (cause 5, fixed) --------------------------------------------------


def _chord_in_chords_with_chains(world: World) -> None:
    c = chord(
        group(
            [
                chain(add.si(1, 2), chord(group([add.si(1, 2), add.si(1, 2)]), add.si(1, 2))),
                chain(add.si(1, 2), chord(group([add.si(1, 2), add.si(1, 2)]), add.si(1, 2))),
            ]
        ),
        add.si(2, 2),
    )
    assert c.delay().get(timeout=TIMEOUT) == 4


def _chain_chord_chain_chord(world: World) -> None:
    c = chain(
        identity.si(1),
        chord(
            [identity.si(2), chain(identity.si(3), chord([identity.si(4), identity.si(5)], identity.si(6)))],
            identity.si(7),
        ),
    )
    assert c.delay().get(timeout=TIMEOUT) == 7


def _nested_group_chain(world: World) -> None:
    """The counterpart with a nested chord (the refusal of Celery's group: test_groups_in_chains_..._refused)."""
    c = chain(
        add.si(1, 0),
        chord(
            [add.si(1, 100), chain(add.si(1, 200), chord([add.si(1, 1000), add.si(1, 2000)], tsum.s()))],
            add.si(1, 10),
        ),
    )
    assert c().get(timeout=TIMEOUT) == 11


def _nested_chord_group_chain_group_tail(world: World) -> None:
    """The counterpart with a nested chord (the refusal of Celery's group: test_groups_in_chains_..._refused): the
    value of the chain's task before the chord reaches each of the chord's header tasks first."""
    sig = chord(
        group(chain(identity.s(42), chord([identity.s(), identity.s()], identity.s()))),  # [42, 42]
        identity.s(),  # [[42, 42]]
    )
    assert sig.delay().get(timeout=TIMEOUT) == [[42, 42]]


def _chord_unlock_with_failed_task_in_nested_chain_member(world: World) -> None:
    # Celery: chain(group(identity.si(1), chain(fail.si(), group(identity.si(2), identity.si(3)), identity.si(4))),
    # identity.s())
    c = chord(
        [identity.si(1), chain(fail.si(), chord([identity.si(2), identity.si(3)], identity.si(4)))],
        identity.s(),
    )
    result = c.apply_async()
    with pytest.raises(ChordHeaderFailed, match="ExpectedException"):  # Celery: ExpectedException or ChordError
        result.get(timeout=TIMEOUT / 10 + 4)  # Celery's TIMEOUT / 10 (6 s)
    world.settle()
    [child] = rows(
        world.producer,
        "SELECT c.state, (SELECT count(*) FROM fanin_batches n WHERE n.parent_task_id = c.task_id) AS n"
        " FROM fanin_children c WHERE c.batch_id = :b AND c.idx = 1",
        b=result.batch_id,
    )
    assert (child.state, child.n) == ("failed", 0), "counted failed; the chord after the failed task never written"


CHAINS_ENDING_IN_A_CHORD: dict[str, Callable[[World], None]] = {
    "test_chord_in_chords_with_chains": _chord_in_chords_with_chains,
    "test_chain_chord_chain_chord": _chain_chord_chain_chord,
    "test_nested_group_chain": _nested_group_chain,
    "test_nested_chord_group_chain_group_tail": _nested_chord_group_chain_group_tail,
    "test_chord_unlock_with_failed_task_in_nested_chain_member": _chord_unlock_with_failed_task_in_nested_chain_member,
}


@pytest.mark.timeout(45)
@pytest.mark.parametrize("case", CHAINS_ENDING_IN_A_CHORD)
def test_a_chord_at_the_end_of_a_chain_in_the_header(case: str, late_world: Callable[..., World]) -> None:
    """The chord is the chain's last task: written when the task before it succeeded, it stands for the header
    task, which is counted when its body ends, with the body's value."""
    world = late_world()
    CHAINS_ENDING_IN_A_CHORD[case](world)


@pytest.mark.timeout(45)
def test_chord_error_propagation_with_a_chord_as_body(late_world: Callable[..., World]) -> None:
    """test_chord_error_propagation_with_different_body_types[body is a chord]; and the body chord's value, its
    header tasks given the outer header's results (as Celery's)."""
    world = late_world()
    failing_chord = chord(
        [add.si(15, 7), fail.si()], chord(group([add.si(1, 1), add.si(2, 2)]), add.si(10, 10))
    )  # chain(group([...]), chord(...))
    result = failing_chord.apply_async()
    _header_failed(result, TIMEOUT)
    nested = chord([add.si(1, 1), add.si(2, 2)], chord([tsum.s(), tsum.s()], tsum.s())).apply_async()
    assert nested.get(timeout=TIMEOUT) == 12  # each inner header task sums [2, 4]; the body sums [6, 6]
    world.settle()
    assert "task_id must not be empty" not in world.worker_log()


def _parent_ids_canvas(case: str) -> tuple[Any, str, str, str]:
    """Celery's canvas, with the ids it checks: the root's, collect_ids' (the body's first task) and ids(i=2)'s."""
    root = ids.si(i=1)
    expected_root_id = root.freeze().id
    second, collect = ids.si(i=2), collect_ids.s(i=50)
    second_id, collect_id = second.freeze().id, collect.freeze().id
    if case == "test_parent_ids":
        g = chain(root, second, chord(group(ids.si(i=i) for i in range(3, 50)), chain(collect | ids.si(i=51))))
    else:  # test_parent_ids__OR
        g = root | second | chord(group(ids.si(i=i) for i in range(3, 50)), collect) | ids.si(i=51)
    return g, expected_root_id, collect_id, second_id


@pytest.mark.timeout(45)
@pytest.mark.parametrize("case", ["test_parent_ids", "test_parent_ids__OR"])
def test_parent_ids(case: str, producer: Any, late_world: Callable[..., World], result_backend: str) -> None:
    """Celery's `assert_parentids_chord`: what each task saw of its root and parent. The results before the body
    and inside it are plain tasks' (read from the result backend, as Celery does); the chord's from PostgreSQL.
    The parent ids are compared last, all together, so that a wrong one hides none of the other checks."""
    late_world(extra_env={"FANIN_TEST_RESULT_BACKEND": result_backend})
    g, expected_root_id, collect_id, second_id = _parent_ids_canvas(case)
    res = g()
    parents: list[tuple[str, Any, Any]] = []  # (which task, its parent_id, the one Celery expects)
    assert isinstance(res, AsyncResult)
    # first we check the last task
    root_id, parent_id, value = res.get(timeout=TIMEOUT)
    assert value == 51
    assert root_id == expected_root_id
    parents.append(("ids(i=51), after the body", parent_id, collect_id))
    # then the chord callback
    prev, (root_id, body_parent_id, value) = AsyncResult(collect_id, app=producer).get(timeout=TIMEOUT)
    assert value == 50
    assert root_id == expected_root_id
    # started by one of the chord header tasks.
    header_ids = [r.task_id for r in rows(producer, "SELECT task_id FROM fanin_children")]
    parents.append(
        ("collect_ids, the body", body_parent_id, body_parent_id if body_parent_id in header_ids else "a header task")
    )
    # check what the chord callback recorded
    assert [p[2] for p in prev] == list(range(3, 50))  # in header order
    for root_id, parent_id, i in prev:
        assert root_id == expected_root_id
        parents.append((f"ids(i={i}), in the header", parent_id, second_id))
    # ids(i=2)
    root_id, parent_id, value = AsyncResult(second_id, app=producer).get(timeout=TIMEOUT)
    assert value == 2
    assert parent_id == expected_root_id
    assert root_id == expected_root_id
    # ids(i=1)
    root_id, parent_id, value = AsyncResult(expected_root_id, app=producer).get(timeout=TIMEOUT)
    assert value == 1
    assert root_id == expected_root_id
    assert parent_id is None
    wrong = [f"{task}: parent_id {got}, not {expected}" for task, got, expected in parents if got != expected]
    assert not wrong, f"{len(wrong)} parent ids differ from Celery's, the first: {wrong[:2]}"


@pytest.mark.timeout(45)
def test_error_propagates_from_chord(late_world: Callable[..., World], result_backend: str) -> None:
    """`add.s(1, 1) | fail.s() | chord(...)`: fail stops the chain, so the chord is never written; its handle's
    `get()` raises fail's error, read from the result backend (Celery's `follow_parents`)."""
    world = late_world(extra_env={"FANIN_TEST_RESULT_BACKEND": result_backend})
    before = _batches(world.producer)
    sig = add.s(1, 1) | fail.s() | chord([add.s(1), add.s(1)], tsum.s())  # Celery: ... | group(add.s(1), add.s(1))
    res = sig.delay()
    _body_failed(res, TIMEOUT)  # Celery: pytest.raises(ExpectedException), the error before the chord
    world.settle()
    assert _batches(world.producer) == before, "the chord was written after the task before it failed"
