"""SessionConfig (comm/session_config.py): the probe's settings are checked by name, and from_env
reads what `isthmus run` hands every peer (connections, probe_links) without overriding the
script."""

from __future__ import annotations

import pytest

from isthmus.comm.session_config import SessionConfig


def test_probe_settings_are_validated_by_name():
    cfg = SessionConfig(coordinator="h:1", token="t")
    assert cfg.probe_links is False and cfg.probe_bytes == 1 << 20
    with pytest.raises(ValueError, match="probe_bytes"):
        SessionConfig(coordinator="h:1", token="t", probe_bytes=1000)
    with pytest.raises(ValueError, match="probe_bytes"):
        SessionConfig(coordinator="h:1", token="t", probe_bytes=True)
    with pytest.raises(ValueError, match="probe_links"):
        SessionConfig(coordinator="h:1", token="t", probe_links="yes")  # type: ignore[arg-type]


def test_from_env_reads_the_runs_connections_and_probe_setting(monkeypatch):
    monkeypatch.setenv("ISTHMUS_COORDINATOR", "127.0.0.1:9")
    monkeypatch.setenv("ISTHMUS_TOKEN", "t")
    monkeypatch.delenv("ISTHMUS_CONNECTIONS", raising=False)
    monkeypatch.delenv("ISTHMUS_PROBE_LINKS", raising=False)
    monkeypatch.delenv("ISTHMUS_PIPELINE_COMMIT", raising=False)
    plain = SessionConfig.from_env()
    assert (plain.connections, plain.probe_links, plain.pipeline_commit) == (1, False, True)
    monkeypatch.setenv("ISTHMUS_CONNECTIONS", "4")
    monkeypatch.setenv("ISTHMUS_PROBE_LINKS", "1")
    monkeypatch.setenv("ISTHMUS_PIPELINE_COMMIT", "0")
    cfg = SessionConfig.from_env()
    assert (cfg.connections, cfg.probe_links, cfg.pipeline_commit) == (4, True, False)
    # what the script says wins over the environment
    mine = SessionConfig.from_env(connections=2, probe_links=False)
    assert (mine.connections, mine.probe_links) == (2, False)
    monkeypatch.setenv("ISTHMUS_CONNECTIONS", "four")
    with pytest.raises(ValueError, match="ISTHMUS_CONNECTIONS: must be an integer, got 'four'"):
        SessionConfig.from_env()
    monkeypatch.setenv("ISTHMUS_CONNECTIONS", "0")
    with pytest.raises(ValueError, match="connections must be an int from 1 to 64"):
        SessionConfig.from_env()
    monkeypatch.setenv("ISTHMUS_CONNECTIONS", "2")
    monkeypatch.setenv("ISTHMUS_PROBE_LINKS", "maybe")
    with pytest.raises(
        ValueError, match=r"ISTHMUS_PROBE_LINKS: must be true or false \(or 1/0\), got 'maybe'"
    ):
        SessionConfig.from_env()


def test_faults_come_from_the_environment_and_are_checked_by_spec(monkeypatch):
    monkeypatch.setenv("ISTHMUS_COORDINATOR", "127.0.0.1:9")
    monkeypatch.setenv("ISTHMUS_TOKEN", "t")
    monkeypatch.delenv("ISTHMUS_FAULTS", raising=False)
    assert SessionConfig.from_env().faults == ()
    monkeypatch.setenv("ISTHMUS_FAULTS", "fail@collective:round=3; kill@step:step=40")
    assert SessionConfig.from_env().faults == ("fail@collective:round=3", "kill@step:step=40")
    # the script's own choice wins, and a list becomes a tuple
    assert SessionConfig.from_env(faults=["stop@commit:round=2"]).faults == ("stop@commit:round=2",)
    monkeypatch.setenv("ISTHMUS_FAULTS", "explode@step:step=3")
    with pytest.raises(ValueError, match="explode"):
        SessionConfig.from_env()
    with pytest.raises(ValueError, match="one string"):
        SessionConfig(coordinator="h:1", token="t", faults="fail@step:step=1")  # type: ignore[arg-type]
