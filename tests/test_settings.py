"""`fanin.settings`: each setting read from `app.conf` when it is used, checked when read; `check_settings` reads
and checks every one at once (a worker's and a relay's start)."""

from __future__ import annotations

import pytest
from celery import Celery

from celery_fanin import FanIn, FanInNotConfigured
from celery_fanin.context import Settings


@pytest.fixture
def app() -> Celery:
    app = Celery("settings-test", set_as_current=False)
    FanIn(app)
    return app


def test_a_setting_is_read_when_used_with_its_default(app: Celery) -> None:
    settings = FanIn.of(app).settings
    assert settings.report_timeout == Settings.report_timeout
    app.conf.fanin_report_timeout = 7
    assert settings.report_timeout == 7, "configured after the view was made, and seen"
    app.conf.fanin_max_width = None
    assert settings.max_width == Settings.max_width, "None is the default, for a setting without a None meaning"
    app.conf.fanin_child_timeout = None
    assert settings.child_timeout is None, "None is no timeout"
    with pytest.raises(AttributeError, match="no celery-fanin setting named 'report_timout'"):
        settings.report_timout  # noqa: B018 - a misspelt setting is an error, not a default


def test_the_database_url_falls_back_to_the_environment(app: Celery, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FANIN_DATABASE_URL", "postgresql://env/db")
    settings = FanIn.of(app).settings
    assert settings.database_url == "postgresql://env/db" == Settings.from_conf(app.conf).database_url
    app.conf.fanin_django_database = "default"
    assert settings.database_url is None, "a Django database takes precedence over the environment"
    app.conf.fanin_database_url = "postgresql://conf/db"
    assert settings.database_url == "postgresql://conf/db"


def test_a_bad_value_is_refused_when_read_and_at_start(app: Celery) -> None:
    fanin = FanIn.of(app)
    app.conf.fanin_outcome_max_bytes = -1
    settings = fanin.settings  # making the view reads nothing
    assert settings.chunk_size == Settings.chunk_size
    with pytest.raises(FanInNotConfigured, match="fanin_outcome_max_bytes must be a whole number of bytes >= 0"):
        settings.outcome_max_bytes  # noqa: B018
    with pytest.raises(FanInNotConfigured, match="fanin_outcome_max_bytes"):
        fanin.check_settings()
    app.conf.fanin_outcome_max_bytes = 10
    fanin.check_settings()
