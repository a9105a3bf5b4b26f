"""A streaming producer that pauses mid-stream, for the open-batch tests: the test SIGKILLs it, or lets it go on.

Run as `python -m tests.e2e.stream_producer FIRST [--key KEY] [--deadline SECONDS] [--go FILE REST]`. It streams
`tests.app.ok` children from a generator in chunks of 5 (successor `record_run("stream")`), prints the batch id
when the batch is inserted, and prints `PAUSED` once the generator has yielded FIRST children and is asked for
the next (by then every chunk before it is committed and published). Without --go it then sleeps until killed;
with --go it waits for FILE to exist and yields REST more children. Ends by printing `DONE`, or `RAISED <type>:
<message>` (exit status 3) if apply_async raised.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

from celery.canvas import Signature

from celery_fanin import FanInError, fan_in_group
from celery_fanin.store import batches
from tests import app as tasks


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("first", type=int)
    parser.add_argument("--key", default=None)
    parser.add_argument("--deadline", type=float, default=None)
    parser.add_argument("--go", nargs=2, default=None, metavar=("FILE", "REST"))
    args = parser.parse_args()
    tasks.app.conf.fanin_chunk_size = 5
    original_insert = batches.insert_batch

    def insert_and_announce(conn: Any, batch: Any, **kwargs: Any) -> Any:
        if kwargs.get("parent_id") is None:
            print(batch.id, flush=True)
        return original_insert(conn, batch, **kwargs)

    batches.insert_batch = insert_and_announce  # type: ignore[assignment]

    def children() -> Iterator[Signature]:
        for i in range(args.first):
            yield tasks.ok.s(i)
        print("PAUSED", flush=True)
        if args.go is None:
            while True:
                time.sleep(60)
        go_file, rest = args.go[0], int(args.go[1])
        while not os.path.exists(go_file):
            time.sleep(0.05)
        for i in range(args.first, args.first + rest):
            yield tasks.ok.s(i)

    options: dict[str, Any] = {"key": args.key}
    if args.deadline is not None:
        options.update(deadline=timedelta(seconds=args.deadline), on_deadline="proceed")
    try:
        fan_in_group(children(), then=tasks.record_run.s("stream"), **options).apply_async()
    except FanInError as exc:
        print(f"RAISED {type(exc).__name__}: {exc}", flush=True)
        raise SystemExit(3) from None
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
