"""The dashboard in a real browser (Debian's chromium, driven by selenium through chromedriver) while a batch runs
through real `celery worker` subprocesses: what a person looking at the pages would see.

Children are held back by gates the test opens one at a time (`tests.app.gated`), so the progress bar's moves
are the test's own doing; the page is never reloaded (a marker set in the page's window survives each update).
Set FANIN_DASHBOARD_SCREENSHOTS to a folder (docs/how-to/img) to keep the screenshots the docs show.
A missing browser fails the test: CI installs it (.ci/run), and so must a developer (the message says how).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from celery_fanin import FanIn, compensated, fan_in_group, manual, saga
from tests import app as tasks
from tests.sql import open_gate, rows
from tests.workers import CeleryProcess

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
WAIT = 60  # seconds any one thing a person would see may take to show, under load


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if missing:
        pytest.fail(f"{', '.join(missing)} not found: apt-get install -y chromium chromium-driver", pytrace=False)
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="fanin-chromium-")
    for arg in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        "--window-size=1280,1000",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(
        options=options, service=Service(executable_path=CHROMEDRIVER, log_output=str(tmp_path / "chromedriver.log"))
    )
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _serve(processes: Any, tmp_path: Path, *flags: str) -> str:
    proc = CeleryProcess(
        ["fanin", "dashboard", "--port", "0", "--refresh", "0.5", *flags],
        processes.env,
        tmp_path / "dashboard.log",
        ready_marker="dashboard at http://",
    )
    processes.started.append(proc)  # stopped, and its exit checked, with the workers
    proc.wait_ready()
    found = re.search(r"dashboard at (http://\S+)/", proc.output())
    assert found, proc.output()
    return found.group(1)


@pytest.fixture
def dashboard(processes: Any, tmp_path: Path) -> str:
    """`celery -A tests.app fanin dashboard` on a free loopback port, updating every half second."""
    return _serve(processes, tmp_path)


@pytest.fixture
def acting_dashboard(processes: Any, tmp_path: Path) -> str:
    """The same with `--allow-actions`."""
    return _serve(processes, tmp_path, "--allow-actions")


def _until(driver: Any, what: str, check: Callable[[Any], Any]) -> Any:
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    def probe(d: Any) -> Any:
        try:
            return check(d)
        except (NoSuchElementException, StaleElementReferenceException):  # the live region was just replaced
            return False

    try:
        return WebDriverWait(driver, WAIT, poll_frequency=0.1).until(probe)
    except Exception as exc:
        raise AssertionError(f"the page never showed {what}: {driver.current_url}\n{_visible(driver)[:3000]}") from exc


def _visible(driver: Any) -> str:
    from selenium.webdriver.common.by import By

    return str(driver.find_element(By.TAG_NAME, "body").text)


def _done(driver: Any, selector: str) -> tuple[int, int]:
    """(done, planned) as the progress bar at `selector` shows them."""
    from selenium.webdriver.common.by import By

    bar = driver.find_element(By.CSS_SELECTOR, selector)
    return int(bar.get_attribute("aria-valuenow")), int(bar.get_attribute("aria-valuemax"))


def _shot(driver: Any, tmp_path: Path, name: str) -> None:
    """A screenshot of the whole page, into tmp_path, and into FANIN_DASHBOARD_SCREENSHOTS if it is set."""
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1280, max(700, min(int(height) + 40, 2400)))
    path = tmp_path / f"{name}.png"
    assert driver.save_screenshot(str(path)), name
    keep = os.environ.get("FANIN_DASHBOARD_SCREENSHOTS")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(keep) / path.name)
    driver.set_window_size(1280, 1000)


def test_a_person_watches_a_batch_finish_and_a_saga_wait_for_them(
    producer: Any, processes: Any, dashboard: str, browser: Any, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    processes.worker(concurrency=3)  # the two gated children hold two processes; the third runs everything else
    processes.relay()
    rows(producer, tasks.ATTEMPTS_DDL)
    with FanIn.of(producer).engine.begin() as conn:
        conn.execute(text(tasks.SAGA_TABLES_DDL))
    # A few batches that finish at once, so that the batches page shows more than one state.
    earlier = [
        fan_in_group([tasks.ok.s(i) for i in range(n)], then=tasks.record_run.s(f"earlier-{n}"), step=step)
        for n, step in ((40, "thumbnails"), (12, "invoices"))
    ]
    earlier.append(
        fan_in_group(
            [tasks.fail.s(0), *[tasks.ok.s(i) for i in range(1, 9)]],
            step="invoices",
            then=tasks.record_run.s("earlier-partial"),
        )
    )
    for done in [g.apply_async() for g in earlier]:
        assert done.wait_batch(timeout=90).successor_state == "succeeded"
    gates = [f"dash-{uuid.uuid4().hex[:8]}-{i}" for i in range(2)]
    children = [tasks.fail.s(0), tasks.ok.s(1), tasks.ok.s(2), tasks.gated.s(gates[0]), tasks.gated.s(gates[1])]
    handle = fan_in_group(
        children, then=tasks.record_run.s("dashboard"), step="nightly-import", key=f"import-{uuid.uuid4().hex[:6]}"
    ).apply_async()
    order = f"o-{uuid.uuid4().hex[:6]}"
    asked = f"Email the customer of order {order}: the confirmation was sent in error"
    rollback = saga(
        compensated(tasks.saga_do.s("reserve", order), tasks.saga_undo.s("reserve", order)),
        manual(tasks.saga_do.s("notify", order), asked),
        tasks.saga_ship_fails.s(order),
        key=f"order-{order}",
    ).apply_async()

    # --- the batches page: the batch's row, its bar at the three children not held back ---------------------------
    browser.get(f"{dashboard}/batches")
    row = f'tr[data-batch="{handle.batch_id}"]'
    _until(browser, "the batch at 3 of 5", lambda d: _done(d, f"{row} svg.bar") == (3, 5))
    # The live region is replaced as rows update, so every read after a wait goes through _until (staleness-safe).
    cells = _until(browser, "the batch's row", lambda d: d.find_element(By.CSS_SELECTOR, row).text)
    assert "running" in cells and "nightly-import" in cells and "3 / 5" in cells, cells
    assert "live" in _until(browser, "the live status", lambda d: d.find_element(By.ID, "live-status").text)
    # The relay panel: this test's relay is connected (its LISTEN connection's name), so no warning that none is.
    panel = _until(browser, "the relay panel", lambda d: d.find_element(By.CSS_SELECTOR, "section.relay").text)
    assert "connected" in panel and "celery-fanin relay" in panel and "none connected" not in panel, panel
    _shot(browser, tmp_path, "dashboard-batches")

    # --- one batch, reached by its link: the failure's message and arguments, the bar moving as gates open --------
    _until(browser, "the batch's link clicked", lambda d: d.find_element(By.CSS_SELECTOR, f"{row} a").click() or True)
    _until(browser, "the batch's page", lambda d: d.current_url.endswith(f"/batches/{handle.batch_id}"))
    failures = _until(browser, "the failure", lambda d: d.find_element(By.CSS_SELECTOR, "table.failures").text)
    assert "ValueError: child 0 failed on purpose" in failures and "tests.app.fail" in failures, failures
    assert "[0]" in failures, "the failed child's arguments"
    assert _until(browser, "the batch's bar", lambda d: _done(d, "svg.bar.big")) == (3, 5)
    assert "not created yet" in _visible(browser), "no successor while children run"
    browser.execute_script("window.fanInMarker = 'not reloaded'")
    updated = _until(browser, "the live stamp", lambda d: d.find_element(By.ID, "live").get_attribute("data-updated"))

    open_gate(producer, gates[0])
    _until(browser, "the bar at 4 of 5", lambda d: _done(d, "svg.bar.big") == (4, 5))
    assert browser.execute_script("return window.fanInMarker") == "not reloaded", "updated in place"
    _until(
        browser, "a new live stamp", lambda d: d.find_element(By.ID, "live").get_attribute("data-updated") != updated
    )
    cards = _until(browser, "the cards", lambda d: d.find_element(By.CSS_SELECTOR, ".cards").text)
    assert re.search(r"3\s+succeeded", cards) and re.search(r"1\s+failed", cards), cards
    _until(browser, "a starts chart", lambda d: d.find_elements(By.CSS_SELECTOR, "svg.chart rect.chart-bar"))
    _shot(browser, tmp_path, "dashboard-batch")

    open_gate(producer, gates[1])
    _until(browser, "the bar full", lambda d: _done(d, "svg.bar.big") == (5, 5))

    def successor_ran(d: Any) -> str | None:
        shown = str(d.find_element(By.CSS_SELECTOR, "table.successor").text)
        return shown if "succeeded" in shown else None

    successor = _until(browser, "the successor's run", successor_ran)
    assert "tests.app.record_run" in successor, successor
    _until(browser, "the page final", lambda d: "final" in d.find_element(By.ID, "live-status").text)
    assert browser.execute_script("return window.fanInMarker") == "not reloaded"

    # --- found again from a child's task id, typed into the lookup form on the batches page ----------------------
    with FanIn.of(producer).engine.connect() as conn:
        child = conn.execute(
            text("SELECT task_id FROM fanin_children WHERE batch_id = :b AND idx = 2"), {"b": handle.batch_id}
        ).one()
    browser.get(f"{dashboard}/batches")
    box = _until(browser, "the lookup box", lambda d: d.find_element(By.CSS_SELECTOR, "form.lookup input[name=id]"))
    box.send_keys(child.task_id + Keys.ENTER)
    _until(browser, "the batch found", lambda d: d.current_url.endswith(f"/batches/{handle.batch_id}"))
    assert "nightly-import" in _visible(browser)

    # --- the saga: its steps in order, the compensation that ran, and what the operator must acknowledge ---------
    status = rollback.wait(timeout=120)
    assert status.state == "manual_action_required", status
    browser.get(f"{dashboard}/sagas/{rollback.saga_id}")

    def steps_shown(d: Any) -> list[list[str]]:
        rows = d.find_elements(By.CSS_SELECTOR, "table.steps tbody tr")
        return [[c.text for c in r.find_elements(By.TAG_NAME, "td")[:4]] for r in rows]

    shown = _until(browser, "the saga's steps", steps_shown)
    assert shown == [
        ["1", "tests.app.saga_do", "task", "compensated"],
        ["2", "tests.app.saga_do", "task", "manual_action_required"],
        ["3", "tests.app.saga_ship_fails", "task", "failed"],
    ], shown
    callout = _until(browser, "the callout", lambda d: d.find_element(By.CSS_SELECTOR, ".callout.to-ack").text)
    assert asked in callout and f"saga ack {rollback.saga_id} 2" in callout, callout
    assert "ConnectionError: the carrier is down" in _visible(browser)
    _shot(browser, tmp_path, "dashboard-saga")
    browser.get(f"{dashboard}/sagas?state=manual_action_required")
    assert rollback.saga_id[:8] in _visible(browser)


def test_a_person_cancels_a_batch_and_reruns_a_successor_from_its_page(
    producer: Any, processes: Any, acting_dashboard: str, browser: Any, tmp_path: Path
) -> None:
    """`--allow-actions` (issue 40, item 6): the buttons a batch's state allows, a click that does it (the form's
    CSRF token from the page's cookie), and the record of who did what, on the page."""
    from selenium.webdriver.common.by import By

    processes.worker(concurrency=2)
    processes.relay()
    rows(producer, tasks.ATTEMPTS_DDL)
    gate = f"act-{uuid.uuid4().hex[:8]}"
    held = fan_in_group([tasks.gated.s(gate), tasks.ok.s(1)], then=tasks.record_run.s("never")).apply_async()
    failing = fan_in_group([tasks.ok.s(1)], then=tasks.failing_successor.s("rerun-me")).apply_async()

    browser.get(f"{acting_dashboard}/batches/{held.batch_id}")
    buttons = _until(browser, "the buttons", lambda d: d.find_elements(By.CSS_SELECTOR, "form.actions button"))
    assert [b.text for b in buttons] == ["Cancel batch"], [b.text for b in buttons]
    _until(browser, "the cancel clicked", lambda d: d.find_element(By.CSS_SELECTOR, "button.a-cancel").click() or True)
    log = _until(browser, "the action recorded", lambda d: d.find_element(By.CSS_SELECTOR, "table.actions-log").text)
    assert "cancel" in log and "done" in log and "anonymous (127.0.0.1)" in log, log
    assert held.wait_batch(timeout=30).state == "cancelled"
    open_gate(producer, gate)

    with pytest.raises(RuntimeError):
        failing.get(timeout=60)
    browser.get(f"{acting_dashboard}/batches/{failing.batch_id}")
    _until(browser, "the rerun clicked", lambda d: d.find_element(By.CSS_SELECTOR, "button.a-rerun").click() or True)
    log = _until(browser, "the rerun recorded", lambda d: d.find_element(By.CSS_SELECTOR, "table.actions-log").text)
    assert "rerun" in log and "done" in log, log
    reruns = _until(browser, "the reruns table", lambda d: d.find_element(By.CSS_SELECTOR, "table.reruns").text)
    assert "failed (run 1)" in reruns and "anonymous (127.0.0.1)" in reruns, reruns
    _shot(browser, tmp_path, "dashboard-actions")
