"""Children's generated task ids: the same form as Celery's `uuid()`, and all of them distinct."""

from __future__ import annotations

import itertools
import re
import uuid

from celery.utils import uuid as celery_uuid

from celery_fanin.producer.task_ids import random_ids

CANONICAL = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


def test_ids_are_version_4_uuids_in_celerys_form() -> None:
    assert CANONICAL.match(celery_uuid())  # the form this test holds ours to is Celery's own
    for task_id in itertools.islice(random_ids(block=7), 50):  # several blocks
        parsed = uuid.UUID(task_id)
        assert parsed.version == 4 and parsed.variant == uuid.RFC_4122
        assert str(parsed) == task_id
        assert CANONICAL.match(task_id), task_id


def test_ids_are_distinct_across_blocks() -> None:
    ids = list(itertools.islice(random_ids(block=100), 20_000))
    assert len(set(ids)) == len(ids)


def test_every_random_digit_varies() -> None:
    """Only the version and the variant's two bits are fixed: a slicing error would fix (or repeat) more."""
    ids = [i.replace("-", "") for i in itertools.islice(random_ids(block=64), 2_000)]
    for pos in range(32):
        seen = {i[pos] for i in ids}
        if pos == 12:
            assert seen == {"4"}
        elif pos == 16:
            assert seen == set("89ab")
        else:
            assert len(seen) == 16, (pos, seen)
    # consecutive ids within a block do not share their digits (a cut at the wrong offset would)
    assert sum(a[:8] == b[:8] for a, b in itertools.pairwise(ids)) == 0
