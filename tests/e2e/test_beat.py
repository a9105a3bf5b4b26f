"""A fan-in as a `beat_schedule` entry (`fan_in_schedule`): two real `celery beat` processes tick the same entry,
and each schedule slot gets one batch, whose successor runs once."""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg

from tests.workers import CeleryProcess, wait_for

EVERY = 2.0  # seconds: the entry's interval, so that a test sees several slots


def _beat(env: dict[str, str], tmp_path: Path, n: int) -> CeleryProcess:
    beat = CeleryProcess(
        [
            "beat",
            "-l",
            "INFO",
            "--max-interval",
            "1",
            "-s",
            str(tmp_path / f"schedule{n}"),
            "--pidfile",
            str(tmp_path / f"beat{n}.pid"),
        ],
        env,
        tmp_path / f"beat{n}.log",
        ready_marker="beat: Starting",
    )
    beat.wait_ready()
    return beat


def _sends(beat: CeleryProcess) -> int:
    return len(re.findall(r"Sending due task fan-in-every", beat.output()))


def _batches(env: dict[str, str]) -> list[tuple[str, str]]:
    with psycopg.connect(env["FANIN_DATABASE_URL"], autocommit=True) as conn:
        rows = conn.execute("SELECT key, id::text FROM fanin_batches WHERE parent_id IS NULL ORDER BY key")
        return [(r[0], r[1]) for r in rows]


def test_two_beats_ticking_one_entry_make_one_batch_per_slot(
    e2e_env: dict[str, str], processes: Any, tmp_path: Path
) -> None:
    env = {**e2e_env, "FANIN_TEST_BEAT_EVERY": str(EVERY)}
    processes.worker(extra_env=env, concurrency=4)
    processes.relay()
    beats = [_beat(env, tmp_path, 1), _beat(env, tmp_path, 2)]
    processes.started.extend(beats)  # stopped (and their logs shown on failure) with the worker
    # Both beats have ticked several slots: enough messages that some slots were sent twice.
    wait_for(lambda: all(_sends(b) >= 4 for b in beats), 90, 0.2, "four ticks from each beat")
    for beat in beats:
        beat.stop()
    sends = sum(_sends(b) for b in beats)

    def settled() -> list[tuple[str, str]] | None:
        batches = _batches(e2e_env)
        return batches if batches and _runs(e2e_env) == len(batches) else None

    # Every message sent was run by the worker (a second message for a slot finds the slot's batch)...
    wait_for(
        lambda: processes.started[0].output().count("celery_fanin.run_canvas[") >= 2 * sends,
        60,
        0.2,
        "every beat message run",
    )
    batches = wait_for(settled, 60, 0.2, "every batch's successor")
    keys = [key for key, _ in batches]
    assert all(key.startswith("beat:fan-in-every:") for key in keys)
    assert len(set(keys)) == len(keys)  # one batch per slot...
    assert len(batches) < sends, f"{sends} ticks made {len(batches)} batches: no slot was ticked twice?"
    starts = [datetime.fromisoformat(key.removeprefix("beat:fan-in-every:")).timestamp() for key in keys]
    assert all(start % EVERY == 0 for start in starts)  # slots counted from the epoch: every beat agrees on them
    assert _runs(e2e_env) == len(batches)  # ...and one successor run per batch


def _runs(env: dict[str, str]) -> int:
    with psycopg.connect(env["FANIN_DATABASE_URL"], autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM e2e_successor_runs WHERE label = 'beat'").fetchone()
    return int(row[0]) if row else 0
