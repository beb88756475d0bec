#!/bin/sh
# A project-local Python environment for the tests (pytest, numpy). Reused when present.
set -eu
venv=${1:-.venv}
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import pytest, numpy, prometheus_client" 2>/dev/null; then
    if ! python3 -m venv "$venv" 2>/dev/null; then
        # Debian's python3 splits venv support into its own package.
        if [ "$(id -u)" -eq 0 ]; then sudo=""; else sudo="sudo"; fi
        $sudo apt-get install -y -qq python3-venv >/dev/null
        python3 -m venv "$venv"
    fi
    "$venv/bin/python" -m pip install -q --disable-pip-version-check pytest numpy prometheus_client
fi
