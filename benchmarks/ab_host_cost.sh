#!/usr/bin/env bash
# Same-lease A/B of bench_host_cost.py: an old commit's tree against the working tree.
#
# Here (needs git):   benchmarks/ab_host_cost.sh prepare [COMMIT]   (default 4017417)
#   writes ab_old/ = git archive COMMIT of what the old bench imports (no results).
# GPU machine:        T=/tmp/triton-3.8.0 benchmarks/ab_host_cost.sh run [ROUNDS] [-k EXPR]
#   ROUNDS (default 7) interleaved rounds; each runs the old tree's own
#   bench_host_cost.py in ab_old/, then this tree's, with
#   PYTHONPATH=$T:vllm_overlay:tests/without_vllm:. ; lines are prefixed
#   "[_old N]" / "[. N]" as in benchmarks/results/logs/*-ab-*.host_cost.log.
#   Set VLLM_PINNED_TREE (absolute) for the upstream baseline columns.
set -euo pipefail
cd "$(dirname "$0")/.."

case "${1:-}" in
prepare)
    commit="${2:-4017417}"
    rm -rf ab_old && mkdir ab_old
    git archive "$commit" vllm_overlay benchmarks tests/without_vllm pytest.ini | tar -x -C ab_old
    rm -rf ab_old/benchmarks/results
    echo "ab_old/ = $(git rev-parse --short "$commit")"
    ;;
run)
    rounds="${2:-7}"
    expr="host_cost_fa or host_cost_mla or host_cost_trace"
    if [ "${3:-}" = "-k" ]; then expr="$4"; fi
    [ -d ab_old ] || { echo "no ab_old/: run '$0 prepare' here first" >&2; exit 2; }
    py="${PYTHON:-python3}"
    pp="${T:+$T:}vllm_overlay:tests/without_vllm:."
    (cd ab_old && PYTHONPATH="$pp" "$py" -c \
        'import triton, torch; print("triton", triton.__version__, "torch", torch.__version__)')
    for n in $(seq 1 "$rounds"); do
        for side in ab_old .; do
            tag="$side"; [ "$side" = ab_old ] && tag=_old
            (cd "$side" && PYTHONPATH="$pp" "$py" -m pytest -q -s -p no:cacheprovider \
                benchmarks/bench_host_cost.py -k "$expr" 2>&1) \
                | grep '^\[bench\]' | sed "s/^/[$tag $n] /" || true
        done
    done
    ;;
*)
    sed -n 2,12p "$0"; exit 2
    ;;
esac
