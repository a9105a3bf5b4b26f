"""`python -m example_app.saga_demo ORDER_ID`: place one order as a saga (see example_app/saga.py), wait for it and
print its steps, compensations and ledger. Needs a worker and a relay running (`celery -A example_app worker`,
`celery -A example_app fanin relay`). An order id ending in `-nocarrier` cannot ship: the saga rolls back."""

from __future__ import annotations

import argparse
import sys

from celery_fanin import FanIn

from . import db
from .celeryapp import app
from .saga import place_order


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Place one order as a saga and wait for it.")
    parser.add_argument("order_id")
    parser.add_argument("--timeout", type=float, default=60)
    args = parser.parse_args(argv)
    handle = place_order(args.order_id)
    status = handle.wait(timeout=args.timeout)
    print(f"saga {status.saga_id}: {status.state}")
    for step in status.steps:
        print(f"  step {step.position} {step.name}: {step.state}")
    for comp in status.compensations:
        print(f"  undo of step {comp.position}: {comp.task_name or comp.manual_text} -> {comp.state}")
    with db.connect(FanIn.of(app).database_url) as conn:
        for row in db.order_ledger(conn, args.order_id):
            print(f"  ledger: {row['action']} {row['detail']}")
    return 0 if status.state in ("succeeded", "manual_action_required", "compensated") else 1


if __name__ == "__main__":
    sys.exit(main())
