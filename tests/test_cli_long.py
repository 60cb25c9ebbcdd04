"""The CLI on long plans: replay skipped above a size (unless asked), progress on stderr."""

import json

from memento import cli


def test_large_plans_skip_the_replay_unless_asked(capsys, monkeypatch):
    monkeypatch.setattr(cli, "_REPLAY_ROWS", 100)
    assert cli.main(["plan", "--steps", "1000", "--memory", "10", "--policy", "hsm"]) == 0
    assert "replay          skipped" in capsys.readouterr().out
    argv = ["plan", "--steps", "1000", "--memory", "10", "--policy", "hsm", "--json"]
    assert cli.main([*argv, "--replay"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["replay"]["forward_evaluations"] == record["cost"]


def test_progress_goes_to_stderr(capsys, monkeypatch):
    monkeypatch.setattr(cli, "_REPLAY_ROWS", 100)
    monkeypatch.setattr(cli, "_PROGRESS_AFTER_S", -1.0)  # as if slow: show the progress
    assert cli.main(["plan", "--steps", "50000", "--memory", "10", "--policy", "hsm"]) == 0
    captured = capsys.readouterr()
    assert "planning (about" in captured.err and "100%" in captured.err
    assert "%" not in captured.out.split("\n")[0]
