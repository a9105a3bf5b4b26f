"""The worker hooks: the main process's map of received fan-in messages (an entry lives as long as Celery's request
for it), what a message's marker claims, and one documented method per Celery signal."""

from __future__ import annotations

import gc

from celery_fanin.protocol import HEADER_CHAIN, HEADER_PART, HEADER_PART_OF, HEADER_STEP, HEADER_TASK, Marker, claim
from celery_fanin.store.batches import Claim
from celery_fanin.worker.received import ReceivedMarkers
from celery_fanin.worker.reporter import claim_of


class _Request:
    """Stands for `celery.worker.request.Request`, which is weak-referenceable (`__weakref__` in its slots)."""

    def __init__(self, task_id: str) -> None:
        self.id = task_id


def _marker(index: int = 0) -> Marker:
    return Marker("batch-1", index, None)


def test_an_entry_lives_while_its_request_does() -> None:
    markers = ReceivedMarkers()
    request = _Request("t1")
    markers.add(request.id, _marker(3), request)
    gc.collect()
    assert len(markers) == 1
    found = markers.pop("t1")
    assert found is not None and found.index == 3
    assert markers.pop("t1") is None


def test_a_released_request_takes_its_entry_with_it() -> None:
    """A child that succeeds ends in the pool process: nothing in the main process pops its entry but this."""
    markers = ReceivedMarkers()
    requests = [_Request(f"t{i}") for i in range(100)]
    for r in requests:
        markers.add(r.id, _marker(), r)
    assert len(markers) == 100
    del r
    requests.clear()
    gc.collect()
    assert len(markers) == 0


def test_a_redelivery_under_the_same_id_keeps_its_own_entry() -> None:
    markers = ReceivedMarkers()
    first = _Request("t1")
    markers.add("t1", _marker(1), first)
    second = _Request("t1")
    markers.add("t1", _marker(2), second)
    del first
    gc.collect()
    found = markers.pop("t1")
    assert found is not None and found.index == 2


def test_the_bound_drops_the_oldest_entry() -> None:
    markers = ReceivedMarkers(limit=3)
    alive = [_Request(f"t{i}") for i in range(4)]
    for r in alive:
        markers.add(r.id, _marker(), r)
    assert len(markers) == 3
    assert markers.pop("t0") is None
    assert markers.pop("t3") is not None


# --- what a report claims (the store counts it only if the child row agrees: migration 0014) -------------------


def test_a_plain_child_claims_its_own_task_name() -> None:
    marker = Marker.from_mapping({"task": "proj.add", "fanin_batch": "b", "fanin_index": 2})
    assert marker is not None and claim_of(marker) == Claim("b", 2, "proj.add")


def test_a_chain_childs_tasks_claim_the_chains_last_task() -> None:
    """Any task of a chain child reports for the chain (its last task's id and name), whichever of them ran."""
    headers = {"task": "proj.first", "fanin_batch": "b", "fanin_index": 0, "fanin_chain": "c1", "fanin_task": "p.last"}
    marker = Marker.from_mapping(headers)
    assert marker is not None and marker.child_id("first-id") == "c1" and claim_of(marker) == Claim("b", 0, "p.last")
    # A chain published before HEADER_TASK: its earlier task cannot say the child's name; batch and index still hold.
    old = Marker.from_mapping({"task": "proj.first", "fanin_batch": "b", "fanin_index": 0, "fanin_chain": "c1"})
    assert old is not None and claim_of(old) == Claim("b", 0, None)


def test_a_replacement_claims_the_task_it_replaced() -> None:
    """Task.replace keeps the task id and changes the name: the replacement carries the replaced name on."""
    original = Marker.from_mapping({"task": "proj.original", "fanin_batch": "b", "fanin_index": 1})
    assert original is not None
    carried = original.headers()
    assert carried[HEADER_TASK] == "proj.original"
    replacement = Marker.from_mapping({"task": "proj.replacement", **carried})
    assert replacement is not None and claim_of(replacement) == Claim("b", 1, "proj.original")


def test_a_replacements_other_tasks_report_for_what_it_replaced() -> None:
    """`Task.replace` with a chain: its earlier tasks report for the child as a chain child's do; for a successor
    they are parts (the carrier's token, the successor's task id), never the successor itself; a part's own
    replacement keeps them parts; the headers are claimed (bound into a signed body)."""
    child = Marker.from_mapping({"task": "proj.original", "fanin_batch": "b", "fanin_index": 1})
    assert child is not None
    earlier = Marker.from_mapping({"task": "proj.step", **child.part_headers("child-id", None)})
    assert earlier is not None and not earlier.is_successor
    assert earlier.child_id("step-id") == "child-id" and claim_of(earlier) == Claim("b", 1, "proj.original")
    in_chain = Marker.from_mapping({"task": "p.mid", "fanin_batch": "b", "fanin_index": 0, "fanin_chain": "last"})
    assert in_chain is not None and in_chain.headers()[HEADER_CHAIN] == "last"  # its carrier reports for the chain
    assert in_chain.part_headers("mid-id", None)[HEADER_CHAIN] == "last"

    successor = Marker.from_mapping({"task": "proj.body", "fanin_successor": "b", "fanin_step": "then"})
    assert successor is not None
    headers = successor.part_headers("successor-id", "token-1")
    part = Marker.from_mapping({"task": "proj.step", **headers})
    assert part is not None and part.is_part and part.is_successor
    assert (part.batch_id, part.step, part.carrier, part.part_of) == ("b", "then", "token-1", "successor-id")
    assert part.headers() == headers and part.part_headers("other-id", "token-2") == headers
    assert claim({"id": "x", "task": "proj.step", **headers}) == {
        "id": "x",
        "task": "proj.step",
        **{k: str(v) for k, v in headers.items()},
    }
    # A child's carrier frozen with a task id of its own stands for the child; its own parts do not.
    carrier = Marker.from_mapping({"task": "p.last", "fanin_batch": "b", "fanin_index": 1, HEADER_PART_OF: "child"})
    assert carrier is not None and carrier.child_id("own-id") == "child" and not carrier.is_part
    assert carrier.headers()[HEADER_PART_OF] == "child"
    assert HEADER_PART_OF not in carrier.part_headers("child", None)
    assert carrier.part_headers("child", None)[HEADER_CHAIN] == "child"
    # Without the token (a replacement of a run already ended) the headers make no part.
    assert Marker.from_mapping({"task": "t", HEADER_PART: "b", HEADER_STEP: "then", HEADER_PART_OF: "s"}) is None


# --- the hooks class: one method per Celery signal --------------------------------------------------------------


def test_each_signal_is_one_documented_method_connected_once() -> None:
    """The middleware has one no-op method per signal it names; the adapter overrides each of them, and `install`
    connects each once, however often a `FanIn(app)` calls it."""
    import inspect

    from celery import signals

    from celery_fanin.worker import hooks, middleware

    hooks.install()
    hooks.install()  # a second FanIn(app) in the same process connects nothing more
    defined = {n for n, m in inspect.getmembers(middleware.Middleware, inspect.isfunction) if not n.startswith("_")}
    assert defined == {name for name, _ in middleware.SIGNALS}
    for name, uid in middleware.SIGNALS:
        for cls in (middleware.Middleware, hooks.WorkerHooks):
            doc = (getattr(cls, name).__doc__ or "").strip()
            assert doc and "\n" not in doc, f"{cls.__name__}.{name} needs a one-line docstring"
        assert getattr(hooks.WorkerHooks, name) is not getattr(middleware.Middleware, name), f"{name} not adapted"
        assert getattr(middleware.Middleware(), name)() is None
        connected = [r for key, r in getattr(signals, name).receivers if key[0] == f"celery_fanin.{uid}"]
        assert len(connected) == 1, f"{name}: {len(connected)} receivers"
