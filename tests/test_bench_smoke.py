"""The benchmark harness in --smoke mode (tiny N, one repeat), so that it cannot rot: it must start its own worker
and relay, run every contender and phase, and write a JSON report with every figure. Its numbers mean nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.workers import ROOT

pytestmark = [pytest.mark.e2e]

CONTENDER_KEYS = ("dispatch_s", "e2e_s", "rss_peak_mb")
LATENCY_KEYS = ("p50_ms", "p99_ms", "max_ms", "batches", "batch_size")
DB_KEYS = (
    "terminal_statements_per_event",
    "terminal_roundtrips_per_event",
    "start_statements_per_child",
    "all_statements_per_child",
    "all_roundtrips_per_child",
    "pg_stat_statements",
    "method",
)
THROUGHPUT_KEYS = (
    "fanin_default_events_per_s",
    "default_ratio",
    "fanin_events_per_s",
    "raw_update_per_s",
    "raw_update_engine_per_s",
    "ratio",
    "ratio_min",
    "ratio_max",
    "rounds",
    "reporters",
)
TARGET_KEYS = (
    "dispatch_speedup_vs_group",
    "e2e_ratio_vs_group_ff",
    "e2e_ratio_vs_group",
    "e2e_ratio_vs_chord",
    "successor_p50_ms",
    "successor_p99_ms",
    "roundtrips_per_terminal_event",
    "throughput_ratio_vs_raw_update",
)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_smoke_run_writes_every_figure(broker: str, tmp_path: Path) -> None:
    doc = tmp_path / "BENCHMARKS.md"  # the block a run rewrites, between its broker's markers
    doc.write_text(
        f"before\n<!-- bench:{broker}:start -->\nold figures\n<!-- bench:{broker}:end -->\nbetween\n"
        "<!-- bench:targets:start -->\nold targets\n<!-- bench:targets:end -->\nafter\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "bench", "--smoke", "--broker", broker, "--out", str(tmp_path), "--markdown", str(doc)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # Nothing left for interpreter exit: a chord's results still registered with the backend then try to
    # unsubscribe through a redis-py that can no longer reconnect ("Exception ignored in AsyncResult.__del__").
    assert "Exception ignored" not in out.stderr, out.stderr[-3000:]
    report = json.loads((tmp_path / f"bench-{broker}-smoke.json").read_text())
    assert report["errors"] == []
    assert report["broker"] == broker
    assert {"nproc", "memory_gib", "versions"} <= report["machine"].keys()
    for contender in ("group", "group_ff", "chord", "fanin"):
        figures = report["contenders"][contender]["20"]
        for key in CONTENDER_KEYS:
            assert figures[key]["median"] > 0, (contender, key)
        assert figures["reps"] == [0], contender  # the smoke run's one repeat
    for name in ("e2e_ratio_vs_group_ff", "e2e_ratio_vs_group", "e2e_ratio_vs_chord", "dispatch_speedup_vs_group"):
        target = report["targets"][name]  # paired within the one repeat: its own ratio, no spread
        assert target["value"] > 0 and target["min"] == target["max"] == target["value"] and target["repeats"] == 1
    fanin, chord = report["contenders"]["fanin"]["20"]["e2e_s"], report["contenders"]["chord"]["20"]["e2e_s"]
    assert report["targets"]["e2e_ratio_vs_chord"]["value"] == fanin["runs"][0] / chord["runs"][0]
    for contender in ("chord", "fanin"):
        assert set(LATENCY_KEYS) <= report["latency"][contender].keys()
    assert set(DB_KEYS) <= report["db"].keys()
    assert report["db"]["terminal_events"] == report["db"]["children"]  # every child's terminal event was counted
    assert report["db"]["terminal_statements_per_event"] >= 1
    assert set(THROUGHPUT_KEYS) <= report["throughput"].keys()
    assert report["throughput"]["fanin_events_per_s"] > 0
    assert len(report["throughput"]["rounds"]) == 1  # the smoke run's one round: its median is that round
    assert report["throughput"]["ratio"] == report["throughput"]["ratio_min"] == report["throughput"]["ratio_max"]
    assert set(TARGET_KEYS) <= report["targets"].keys()
    assert "bench-" in (report["plot"] or "bench-")  # the plot needs matplotlib (the dev extra)
    text = doc.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "\nbetween\n" in text
    assert "old figures" not in text and "old targets" not in text
    assert "| 20 | fan_in_group |" in text and "| 20 | chord |" in text
    assert "successor latency p50" in text and "terminal events/s" in text  # the targets block, this broker's


@pytest.mark.timeout(240)
def test_drain_smoke_prints_a_rate_and_cpu_per_child_for_each_kind(tmp_path: Path) -> None:
    """`python -m bench.drain` (the worker's cost per child, BENCHMARKS.md) at a small N, so that it cannot rot.

    400 children: enough that each role's CPU, read from /proc in 10 ms ticks, is above zero where it is spent."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.drain",
            "--n",
            "400",
            "--rounds",
            "1",
            "--kinds",
            "plain,fanin,fanin-batched",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    kinds = ("plain ", "fanin ", "fanin-batched ")
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines() if line.startswith(kinds)}
    assert rows.keys() == {"plain", "fanin", "fanin-batched"}, out.stdout
    for kind, row in rows.items():
        rate, main, pool, postgres = float(row[1]), float(row[-4]), float(row[-3]), float(row[-2])
        assert rate > 0 and main > 0 and pool > 0, (kind, row)
        assert (postgres > 0) == kind.startswith("fanin"), (kind, row)  # only a fan-in's children report to PostgreSQL
        if kind.startswith("fanin"):
            assert float(row[3]) > 0, (kind, row)  # children per commit


@pytest.mark.timeout(240)
def test_dashboard_bench_smoke_times_every_page(tmp_path: Path) -> None:
    """`python -m bench.dashboard` (BENCHMARKS.md) on a small store, so that it cannot rot: it fills its scratch
    database, serves the dashboard and prints one line per page; its figures mean nothing at this size."""
    size = ["--batches", "2000", "--children", "20000", "--sagas", "200", "--repeats", "2"]
    argv = [sys.executable, "-m", "bench.dashboard", *size, "--json"]
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=220)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    figures = json.loads(out.stdout[out.stdout.index("{") :])
    assert figures["store"]["batches"] > 2000 and figures["store"]["children"] > 19_000
    pages = figures["pages"]
    assert {"batches", "batches ?key=order-1234", "sagas", "saga"} <= pages.keys()
    assert all(0 < p["p50_ms"] <= p["max_ms"] for p in pages.values()), pages
    assert "batches pages: worst p95" in out.stderr


@pytest.mark.timeout(240)
def test_scaling_smoke_writes_every_series(tmp_path: Path) -> None:
    """`python -m bench.scaling --smoke` (BENCHMARKS.md, docs/concepts/scaling.md), so that it cannot rot: every
    reporter count of every series (flat, a tree, the defaults, the defaults through a worker's report batcher, the
    raw UPDATE) and every relay count has a rate,
    and the relays sent every successor they were given. Its figures mean nothing at this size."""
    argv = [sys.executable, "-m", "bench.scaling", "--smoke", "--out", str(tmp_path)]
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=220)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads((tmp_path / "scaling-smoke.json").read_text())
    terminal = report["terminal"]
    assert terminal["errors"] == []  # no phase failed (a failed one is reported, and its figure left out)
    assert terminal["reporters"] == [1, 2, 4]
    assert set(terminal["series"]) == {"flat", "tree-4", "default", "default-batched", "raw"}
    # The default batch through a worker's report batcher: every report committed by it (none sent alone), its
    # statements counted, and its rate paired with the default batch's of the same round.
    for reporters, figures in terminal["series"]["default-batched"].items():
        assert figures["sent_alone"] == [0], reporters
        assert 1 <= figures["reports_per_commit"] <= int(reporters), (reporters, figures)
        assert figures["ratio_to_default"] > 0 and set(figures["cpu_us_per_event"]) == {
            "reporters",
            "batchers",
            "postgres",
        }
    assert terminal["leaves"]["flat"] == 0 and terminal["leaves"]["tree-4"] == 4  # the layouts asked for
    for name, per in terminal["series"].items():
        assert set(per) == {"1", "2", "4"}, name
        for reporters, figures in per.items():
            assert figures["median"] > 0 and len(figures["runs"]) == 1, (name, reporters)
            assert figures["ratio_to_raw"] > 0, (name, reporters)
        if name == "raw":
            assert all(f["ratio_to_raw"] == 1 for f in per.values())
    relays = report["relay"]["relays"]
    assert set(relays) == {"1", "2"}
    assert all(f["median"] > 0 for f in relays.values()), relays
    assert report["relay"]["successors_per_phase"] == 20
    assert "| reporters |" in out.stdout and "| relays |" in out.stdout  # the printed tables


def test_a_ratio_of_two_contenders_is_paired_within_each_repeat() -> None:
    """`bench.run.paired` divides the two contenders' figures of one repeat, never medians of different repeats; a
    repeat in which either failed is left out; a report before the repeats were recorded pairs its runs in order
    only when both have one per repeat."""
    from bench.run import paired

    def fig(values: list[float], reps: list[int] | None) -> dict[str, Any]:
        f: dict[str, Any] = {"e2e_s": {"runs": values}}
        if reps is not None:
            f["reps"] = reps
        return f

    c = {"fanin": {"10": fig([1.0, 3.0, 2.0], [0, 1, 2])}, "chord": {"10": fig([2.0, 2.0], [0, 2])}}
    got = paired(c, "10", "fanin", "chord")
    assert got is not None and got["runs"] == [0.5, 1.0] and got["median"] == 0.75  # repeat 1: chord failed
    # Medians of the repeats would say 2.0 / 2.0 = 1.0.
    old = {"fanin": {"10": fig([1.0, 4.0], None)}, "chord": {"10": fig([2.0, 2.0], None)}}
    assert paired(old, "10", "fanin", "chord") == {"median": 1.25, "min": 0.5, "max": 2.0, "runs": [0.5, 2.0]}
    uneven = {"fanin": {"10": fig([1.0, 4.0], None)}, "chord": {"10": fig([2.0], None)}}
    assert paired(uneven, "10", "fanin", "chord") is None
    assert paired(c, "10", "fanin", "group_ff") is None  # a contender this run did not have


@pytest.mark.timeout(120)
def test_predicates_bench_smoke_times_the_three_forms_of_the_relay_s_scan() -> None:
    """`python -m bench.predicates` (bench/NOTES.md, migration 0034) on a small table, so that it cannot rot: its
    figures mean nothing at this size, only that each form ran and was paired."""
    argv = [sys.executable, "-m", "bench.predicates", "--rows", "2000", "--repeats", "3"]
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for line in ("written out  median", "predicate    median", "definer      median"):
        assert line in out.stdout, out.stdout
    assert "predicate / written out, paired: median" in out.stdout and "definer / written out" in out.stdout


@pytest.mark.timeout(240)
@pytest.mark.parametrize("style", ["set", "pipeline"])
def test_batched_reports_bench_smoke_counts_every_report_once_in_each_group_size(style: str) -> None:
    """`python -m bench.batched_reports` (issue 41's prototype measurement, bench/NOTES.md) at a small N, so that it
    cannot rot: every phase must count each of its reports exactly once (it raises otherwise), at each group size,
    with either way of sending a group."""
    argv = [sys.executable, "-m", "bench.batched_reports", "--reporters", "1,2", "--groups", "1,4"]
    argv += ["--events", "100", "--children", "400", "--rounds", "1", "--style", style]
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=220)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    table = [line for line in out.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [line.split("|")[1:3] for line in table] == [
        [" 1 ", " 1 "],
        [" 1 ", " 4 "],
        [" 2 ", " 1 "],
        [" 2 ", " 4 "],
    ], out.stdout
