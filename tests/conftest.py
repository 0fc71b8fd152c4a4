"""Shared test settings: every test gets its own posttrain home, never the user's."""

import os

import pytest

# Two cores on CI: keep torch from oversubscribing them in every test process.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def posttrain_home(tmp_path, monkeypatch):
    """A fresh POSTTRAIN_HOME (and DAGSTER_HOME inside it) for one test."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("POSTTRAIN_HOME", str(home))
    monkeypatch.setenv("DAGSTER_HOME", str(home / "dagster"))
    return home
