"""`memento plan-chain`: the CLI over `memento.planning.plan_chain`."""

import json

import memento.planning
from memento import cli


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


CHAIN = ("--costs", "1,2,3", "--hidden", "1,1,2,2", "--internal", "3,3,4", "--memory", "6")


def test_plan_chain_flags(capsys):
    code, out, err = run(capsys, "plan-chain", *CHAIN, "--rows")
    assert code == 0 and err == ""
    s = memento.planning.plan_chain([1, 2, 3], [1, 1, 2, 2], [3, 3, 4], 6)
    assert s.cost == 6  # every internal state fits: each layer once
    assert "3 layers, memory 6 units" in out
    assert "cost            6 (weighted forward cost; each layer once: 6)" in out
    assert f"peak memory     {s.simulate().peak_memory} units" in out
    assert f"{len(s.actions)} rows" in out
    assert out.count("arg=") == len(s.actions) and "BACKWARD_FUSED     arg=0   pos=2" in out


def test_plan_chain_hsm_and_json_file(capsys, tmp_path):
    path = tmp_path / "chain.json"
    path.write_text(
        json.dumps({"costs": [1, 2, 3], "hidden": [1, 1, 2, 2], "internal": [3, 3, 4], "memory": 6})
    )
    code, out, _ = run(capsys, "plan-chain", "--json", str(path), "--policy", "hsm")
    s = memento.planning.plan_chain([1, 2, 3], [1, 1, 2, 2], [3, 3, 4], 6, internal=False)
    assert code == 0 and s.cost == 9
    assert "chain schedule (hsm)" in out and "cost            9 " in out
    assert "arg=" not in out  # rows only with --rows


def test_plan_chain_errors(capsys, tmp_path):
    code, _, err = run(capsys, "plan-chain", "--costs", "1,2")
    assert code == 2 and "give --hidden, --internal, --memory (or --json FILE)" in err
    code, _, err = run(capsys, "plan-chain", *CHAIN[:-1], "5MiB")
    assert (
        code == 2
        and "--memory must be an integer in the unit of --hidden and --internal, or a percentage of their sum such as 50%; got '5MiB'"
        in err
    )
    code, out, _ = run(capsys, "plan-chain", *CHAIN[:-1], "50%")
    assert code == 0 and "memory 5 units" in out
    code, _, err = run(
        capsys,
        "plan-chain",
        "--costs",
        "1,2",
        "--hidden",
        "1,1,2",
        "--internal",
        "3",
        "--memory",
        "3",
    )
    assert code == 2 and "--internal must have 2 entries, got 1" in err
    code, _, err = run(capsys, "plan-chain", *CHAIN[:-1], "0")
    assert code == 2 and "memento.plan_chain: memory=0 is below the minimum" in err
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"costs": [1]}))
    code, _, err = run(capsys, "plan-chain", "--json", str(path))
    assert code == 2 and "missing hidden, internal, memory" in err
    code, _, err = run(capsys, "plan-chain", "--json", str(path), "--costs", "1")
    assert code == 2 and "drop --costs" in err
