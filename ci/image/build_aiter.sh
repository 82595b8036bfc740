#!/usr/bin/env bash
# Image step 1: build AITER at pins.env's AITER_REF and install it over the
# base image's copy. Needs the base image's ROCm toolchain, torch and triton.
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source-path=SCRIPTDIR/../.. source=pins.env
. ./pins.env
: "${AITER_REPO:?pins.env sets AITER_REPO}" "${AITER_REF:?pins.env sets AITER_REF}"
: "${AITER_ROCM_ARCH:?set by ci/Dockerfile.rocm (ARG AITER_ROCM_ARCH)}"

src=/opt/aiter
rm -rf "$src"
git init -q "$src"
cd "$src"
git remote add origin "$AITER_REPO"
# A tag is fetched as a tag, so that setuptools-scm versions the wheel from it;
# a branch name or a commit id is fetched as it is.
if git fetch -q --depth 1 origin "+refs/tags/${AITER_REF}:refs/tags/${AITER_REF}"; then
    git checkout -q "refs/tags/${AITER_REF}"
else
    git fetch -q --depth 1 origin "$AITER_REF"
    git checkout -q FETCH_HEAD
fi
git submodule update -q --init --recursive --depth 1
echo "AITER ${AITER_REF} = $(git rev-parse HEAD)"

python3 -m pip install -r requirements.txt pyyaml
# Keep the base image's triton (AITER would otherwise install its own).
PREBUILD_KERNELS=1 AITER_USE_SYSTEM_TRITON=1 GPU_ARCHS="$AITER_ROCM_ARCH" \
    python3 setup.py bdist_wheel --dist-dir=dist
python3 -m pip install --no-deps --force-reinstall dist/amd_aiter-*.whl
rm -rf build dist
