#!/usr/bin/env bash
# make image, on the host: docker build -f ci/Dockerfile.rocm . when a Docker
# engine is reachable. BASE_IMAGE and IMAGE_TAG may be set in the environment.
set -euo pipefail
cd "$(dirname "$0")/../.."

if ! command -v docker >/dev/null 2>&1 || ! docker info >/dev/null 2>&1; then
    echo "make image: no Docker engine reachable (\`docker info\` failed); build ci/Dockerfile.rocm on a machine with Docker: docker build -f ci/Dockerfile.rocm ." >&2
    exit 2
fi
# shellcheck source-path=SCRIPTDIR/../.. source=pins.env
. ./pins.env
tag="${IMAGE_TAG:-vllm-aiter-series:${VLLM_VERSION}-aiter-${AITER_REF}}"
args=(build -f ci/Dockerfile.rocm -t "$tag")
if [[ -n "${BASE_IMAGE:-}" ]]; then
    args+=(--build-arg "BASE_IMAGE=${BASE_IMAGE}")
fi
exec docker "${args[@]}" .
