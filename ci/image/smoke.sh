#!/usr/bin/env bash
# Image step 3: the import smoke test, from outside the source tree so that
# the installed vLLM is the one imported.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
cd /
python3 "$repo/ci/smoke_import.py" --rocm --pins "$repo/pins.env" --overlay "$repo/vllm_overlay"
