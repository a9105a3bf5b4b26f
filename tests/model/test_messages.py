"""The message-level model (messages.py) against the real database and the library's real worker code paths.

One case per hole of issue 38, each with only the rules that reach it (so that each hole is shown found on its
own), and the whole model. On the code before the fixes every case finds its hole, and is expected to fail
(strict): a fix turns its case into a pass, and its xfail comes off with it. `--model-examples N --model-steps M`
runs longer.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from hypothesis import Phase
from hypothesis.internal.conjecture import engine
from hypothesis.stateful import run_state_machine_as_test

from .conftest import model_budget, model_settings
from .messages import APPS, FAULTS, STATS, TWIN, MessageMachine, make_app

CI_EXAMPLES = 100
CI_STEPS = 25

# hole -> the rules that reach it (the full model has them all).
CASES = {
    "1-replaced-successor-runs-again": frozenset({"duplicate", "replace", "stall"}),
    "2-twin-hostname": frozenset({"twin", "duplicate"}),
    "3-copy-event-ends-live-run": frozenset({"duplicate", "events", "stall", "relay"}),
    "5-transient-error-drops-report": frozenset({"faults"}),
    "4-lost-start-and-expiry-sweep": frozenset({"outage", "expiry"}),
    "6-forged-dead-owner": frozenset({"forge"}),
    "all": MessageMachine.features,
}
# Hypothesis turns a random part of the rules off in each example (swarm testing): the expiry case needs its
# start cut, its body held and a sweep all in one example; the whole model has many rules to spread over.
EXAMPLES = {"4-lost-start-and-expiry-sweep": 80, "all": 60}
HOLES = (
    "issue 38's holes are open on this code: 1 (a replaced successor's original copy is admitted again), 2 (a twin "
    "host's live run judged dead by hostname + PID namespace), 3 (a never-admitted copy's main-process event ends a "
    "live run), 4 (a start dropped in a short outage, then the expiry sweep counts a running child revoked), 5 "
    "(55P03/57014/25006 drop a report), 6 (a forged p_dead_owner admits a second run)"
)


def _run(case: str, scratch_db: Callable[[], str], config: pytest.Config, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine, "MAX_SHRINKING_SECONDS", 30)
    examples, steps = model_budget(config, EXAMPLES.get(case, CI_EXAMPLES), CI_STEPS)
    url = scratch_db()
    APPS[url] = make_app(url)
    machine = type("Messages", (MessageMachine,), {"url": url, "features": CASES[case]})
    STATS.clear()
    started = time.monotonic()
    try:
        run_state_machine_as_test(
            machine,
            settings=model_settings(examples, steps, phases=[Phase.generate, Phase.shrink], print_blob=False),
        )
    finally:
        FAULTS.uninstall()
        TWIN.uninstall()
        print(f"message model [{case}]: {time.monotonic() - started:.1f}s;", dict(sorted(STATS.items())))


@pytest.mark.timeout(600)
@pytest.mark.xfail(strict=True, reason=HOLES)
def test_message_model(
    scratch_db: Callable[[], str], request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole model, in `make test` (about 45 s on a shared 2-core machine, shrinking included)."""
    _run("all", scratch_db, request.config, monkeypatch)


@pytest.mark.breakages
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "case",
    [pytest.param(name, marks=pytest.mark.xfail(strict=False, reason=HOLES)) for name in CASES if name != "all"],
)
def test_message_model_finds_hole(
    case: str, scratch_db: Callable[[], str], request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each hole found on its own, with only the rules that reach it (`make breakages`, ~40 s a case). Not
    strict: a run of the budget found holes 3 and 4 in 2 of 3 and 1 of 3 runs measured (the others 3-4 of 4); a
    fixed hole's case should pass every run."""
    _run(case, scratch_db, request.config, monkeypatch)
