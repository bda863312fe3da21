"""`kvtop completion SHELL`: the script completes kvtop's commands, options, choices and paths."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import run_kvtop

from kvtop.cli import _commands


def _bash_complete(script: Path, cwd: Path, *words: str) -> list[str]:
    """What bash offers for the command line ``words`` (the last one being completed)."""
    prog = (f"source {script}\n"
            f"COMP_WORDS=({' '.join(repr(w) for w in words)}); COMP_CWORD={len(words) - 1}\n"
            f"COMP_LINE={' '.join(words)!r}; COMP_POINT=${{#COMP_LINE}}; COMPREPLY=()\n"
            "_shtab_kvtop; printf '%s\\n' \"${COMPREPLY[@]}\"\n")
    r = subprocess.run(["bash", "-c", prog], capture_output=True, text=True, cwd=cwd, timeout=30)
    assert r.returncode == 0, r.stderr
    return [line for line in r.stdout.splitlines() if line]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_bash_completes_commands_options_choices_and_files(tmp_path: Path) -> None:
    r = run_kvtop("completion", "bash", timeout=60)
    assert r.returncode == 0, r.stderr
    script = tmp_path / "kvtop.bash"
    script.write_text(r.stdout)
    (tmp_path / "trace-1.jsonl").write_text("")
    assert _bash_complete(script, tmp_path, "kvtop", "snaps") == ["snapshot"]
    assert sorted(_bash_complete(script, tmp_path, "kvtop", "sim")) == ["sim-server", "simulate"]
    assert "--duration" in _bash_complete(script, tmp_path, "kvtop", "snapshot", "--dur")
    assert _bash_complete(script, tmp_path, "kvtop", "analyze", "t.jsonl", "--format", "") == ["json", "text"]
    assert _bash_complete(script, tmp_path, "kvtop", "analyze", "trace-") == ["trace-1.jsonl"]
    assert _bash_complete(script, tmp_path, "kvtop", "record", "-o", "tra") == ["trace-1.jsonl"]


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_every_command_is_in_every_shell_script(shell: str) -> None:
    r = run_kvtop("completion", shell, timeout=60)
    assert r.returncode == 0 and r.stderr == ""
    for mod in _commands():
        assert mod.NAME in r.stdout, (shell, mod.NAME)
    assert "--itl-target-ms" in r.stdout and "--log-format" in r.stdout


def test_an_unknown_shell_is_a_usage_error() -> None:
    r = run_kvtop("completion", "bsh", timeout=60)
    assert r.returncode == 2 and "did you mean 'bash'?" in r.stderr and r.stderr.count("\n") == 1
