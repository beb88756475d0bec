#!/bin/sh
# The Python environment `make bench-forward` compares against: torch and transformers 5.23.0
# (the version the fixtures were made with; it has DeepseekV4ForCausalLM), with numpy and
# safetensors. PyPI's torch wheel pulls in its CUDA libraries (about 5.5 GB installed); only
# its CPU path runs. Reused when present. Exits non-zero when pip cannot install them (no
# network), and the Makefile then runs the benchmark without the comparison.
set -eu
venv=${1:-.venv-bench}
ready='import torch, numpy, safetensors, transformers
assert transformers.__version__ == "5.23.0"'
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "$ready" 2>/dev/null; then
    exit 0
fi
python3 -m venv "$venv"
echo "bench_venv: installing torch and transformers 5.23.0 into $venv (a few GB, once)"
"$venv/bin/python" -m pip install -q --disable-pip-version-check torch "transformers==5.23.0" \
    numpy safetensors
"$venv/bin/python" -c "$ready"
