"""A stand-in for the external data warehouse: a seeded, deterministic stream of partner users.

Each row is derived from `(seed, position)` alone, so a run of N rows is a prefix of a run of M > N rows, and the
same ids come back on every machine and Python process (string seeds are hashed with SHA-512, not `hash()`).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from typing import TypedDict

DEFAULT_SEED = 20240603
PLANS = ("free", "pro", "team", "enterprise")
# Share of warehouse users the app already has; the rest were deleted locally or never imported.
LOCAL_SHARE = 0.9
# Share of rows the warehouse returns without an external id (a real export has a few); the scheduler skips them.
MISSING_ID_SHARE = 0.01


class WarehouseRow(TypedDict):
    external_id: str | None
    email: str
    plan: str


def row(position: int, seed: int = DEFAULT_SEED) -> WarehouseRow:
    """The warehouse row at `position`."""
    rng = random.Random(f"{seed}:row:{position}")
    external_id = None if rng.random() < MISSING_ID_SHARE else f"acme-{position:07d}"
    return {
        "external_id": external_id,
        "email": f"user{position}@partner.example",
        "plan": rng.choice(PLANS),
    }


class DataWarehouseClient:
    """Streams the partner's active users, as a cursor over a reporting query would."""

    def __init__(self, seed: int = DEFAULT_SEED) -> None:
        self.seed = seed

    def execute(self, total: int) -> Iterator[WarehouseRow]:
        """The first `total` rows, lazily: the scheduler reads them a slice at a time."""
        return (row(i, self.seed) for i in range(total))


def is_local(external_id: str, seed: int = DEFAULT_SEED) -> bool:
    """Whether the app already has this user (decided per id, so it does not depend on how many rows are read)."""
    return random.Random(f"{seed}:local:{external_id}").random() < LOCAL_SHARE


def local_users(rows: Iterable[WarehouseRow], seed: int = DEFAULT_SEED) -> list[tuple[str, str]]:
    """The (external_id, email) pairs the app's users table holds before the sync; the demo seeds them."""
    return [(r["external_id"], r["email"]) for r in rows if r["external_id"] and is_local(r["external_id"], seed)]
