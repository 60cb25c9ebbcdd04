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
    assert "planning (about" in captured.err and "done" in captured.err
    assert "%" not in captured.out.split("\n")[0]


def test_piped_progress_is_two_lines_without_carriage_returns(capsys, monkeypatch):
    monkeypatch.setattr(cli, "_REPLAY_ROWS", 100)
    monkeypatch.setattr(cli, "_PROGRESS_AFTER_S", -1.0)
    assert cli.main(["plan", "--steps", "50000", "--memory", "10", "--policy", "hsm"]) == 0
    err = capsys.readouterr().err  # capsys' stderr is not a terminal
    assert "\r" not in err
    lines = [line for line in err.splitlines() if line.startswith("planning (about")]
    assert len(lines) == 2 and lines[0].endswith(": ...") and lines[1].endswith(": done")


def test_progress_on_a_terminal_redraws_one_line(capsys, monkeypatch):
    monkeypatch.setattr(cli, "_REPLAY_ROWS", 100)
    monkeypatch.setattr(cli, "_PROGRESS_AFTER_S", -1.0)
    monkeypatch.setattr(cli.sys.stderr, "isatty", lambda: True, raising=False)
    assert cli.main(["plan", "--steps", "50000", "--memory", "10", "--policy", "hsm"]) == 0
    err = capsys.readouterr().err
    assert err.count("\r") > 2 and err.rstrip("\n").rsplit("\r", 1)[1].endswith("100%")


def test_every_command_describes_itself_and_its_default_folder(capsys):
    for command, default in [("curves", "memento-curves"), ("demo", "memento-demo")]:
        assert cli.main([command, "--help"]) == 0
        out = capsys.readouterr().out
        usage, description = out.split("\n\n")[:2]
        assert usage.startswith(f"usage: memento {command}") and len(description) > 80
        assert f"(default: {default})" in out
