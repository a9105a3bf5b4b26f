"""The main process's map of received fan-in messages: an entry lives as long as Celery's request for it."""

from __future__ import annotations

import gc

from celery_fanin.hooks import _Marker, _ReceivedMarkers


class _Request:
    """Stands for `celery.worker.request.Request`, which is weak-referenceable (`__weakref__` in its slots)."""

    def __init__(self, task_id: str) -> None:
        self.id = task_id


def _marker(index: int = 0) -> _Marker:
    return _Marker("batch-1", index, None)


def test_an_entry_lives_while_its_request_does() -> None:
    markers = _ReceivedMarkers()
    request = _Request("t1")
    markers.add(request.id, _marker(3), request)
    gc.collect()
    assert len(markers) == 1
    found = markers.pop("t1")
    assert found is not None and found.index == 3
    assert markers.pop("t1") is None


def test_a_released_request_takes_its_entry_with_it() -> None:
    """A child that succeeds ends in the pool process: nothing in the main process pops its entry but this."""
    markers = _ReceivedMarkers()
    requests = [_Request(f"t{i}") for i in range(100)]
    for r in requests:
        markers.add(r.id, _marker(), r)
    assert len(markers) == 100
    del r
    requests.clear()
    gc.collect()
    assert len(markers) == 0


def test_a_redelivery_under_the_same_id_keeps_its_own_entry() -> None:
    markers = _ReceivedMarkers()
    first = _Request("t1")
    markers.add("t1", _marker(1), first)
    second = _Request("t1")
    markers.add("t1", _marker(2), second)
    del first
    gc.collect()
    found = markers.pop("t1")
    assert found is not None and found.index == 2


def test_the_bound_drops_the_oldest_entry() -> None:
    markers = _ReceivedMarkers(limit=3)
    alive = [_Request(f"t{i}") for i in range(4)]
    for r in alive:
        markers.add(r.id, _marker(), r)
    assert len(markers) == 3
    assert markers.pop("t0") is None
    assert markers.pop("t3") is not None
