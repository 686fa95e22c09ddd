"""The two commands of a fresh machine: the README opens with them, CI runs the test one, and
run.sh is POSIX sh that refuses an unknown command in one line (its set-up is exercised by CI
itself, which starts from a fresh clone with `.ci/run`)."""

from __future__ import annotations

import subprocess


def test_the_readme_opens_with_exactly_the_two_commands(repo_root):
    lines = (repo_root / "README.md").read_text().splitlines()
    assert lines[0] == "# LazyTrain" and lines[1] == ""
    assert [ln.strip() for ln in lines[2:4]] == ["./run.sh train", "./run.sh test"]
    assert lines[4] == ""


def test_ci_runs_the_readme_test_command(repo_root):
    body = [ln for ln in (repo_root / ".ci" / "run").read_text().splitlines()
            if ln.strip() and not ln.startswith("#")]
    assert body[-1] == 'exec ./run.sh test "$@"'


def test_run_sh_is_posix_sh_and_refuses_an_unknown_command(repo_root):
    script = repo_root / "run.sh"
    assert subprocess.run(["sh", "-n", str(script)]).returncode == 0  # parses as POSIX sh
    res = subprocess.run(["sh", str(script), "deploy"], capture_output=True, text=True)
    assert res.returncode == 2 and res.stderr.startswith("usage: ./run.sh train")
    text = script.read_text()
    # the main job survives a second run: the run dir is overwritten, not refused
    assert 'train --run-dir runs/default --overwrite "$@"' in text
    # the CPU wheel goes in before the package (else pip resolves torch>=2.4 to a CUDA build)
    assert text.index('install -q "$TORCH_PIN"') < text.index("install -q -e '.[all,dev]'")
