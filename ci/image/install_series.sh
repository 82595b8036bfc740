#!/usr/bin/env bash
# Image step 2: apply the series at the pinned vLLM (make apply), build its
# ROCm wheel (make build) and install it with vLLM's ROCm requirements.
set -euo pipefail
cd "$(dirname "$0")/../.."

missing=()
for tool in make git; do
    command -v "$tool" >/dev/null || missing+=("$tool")
done
# make apply fetches the sdist with pip from a small venv (scripts/seriestool/sdist.py).
if ! python3 -c "import ensurepip, venv" 2>/dev/null; then
    missing+=("python$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')-venv")
fi
if ((${#missing[@]})); then
    apt-get update
    apt-get install -y --no-install-recommends "${missing[@]}"
    rm -rf /var/lib/apt/lists/*
fi

make apply
# vLLM's ROCm requirements, held to the base image's torch/triton by its
# constraints file where it has one (as upstream's docker/Dockerfile.rocm does).
constraints=()
if [[ -f /etc/rocm-constraints.txt ]]; then
    constraints=(-c /etc/rocm-constraints.txt)
fi
python3 -m pip install "${constraints[@]}" -r build/vllm/requirements/rocm.txt
make build PYTHON=python3 DEVICE=rocm
python3 -m pip install --no-deps --force-reinstall dist/vllm-*.whl
# The wheel stays in dist/; the build tree is not needed at run time.
rm -rf build
