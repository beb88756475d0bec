#!/bin/sh
# A project-local Python environment for the tests (pytest, numpy, prometheus_client; mypy and
# setuptools >= 77 for tests/python/test_packaging.py, which type-checks the package and builds
# it offline with --no-build-isolation). Reused when present.
set -eu
venv=${1:-.venv}
ready='import pytest, numpy, prometheus_client, mypy, setuptools
assert int(setuptools.__version__.split(".")[0]) >= 77'
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "$ready" 2>/dev/null; then
    if ! python3 -m venv "$venv" 2>/dev/null; then
        # Debian's python3 splits venv support into its own package.
        if [ "$(id -u)" -eq 0 ]; then sudo=""; else sudo="sudo"; fi
        $sudo apt-get install -y -qq python3-venv >/dev/null
        python3 -m venv "$venv"
    fi
    "$venv/bin/python" -m pip install -q --disable-pip-version-check pytest numpy prometheus_client mypy \
        "setuptools>=77"
fi
