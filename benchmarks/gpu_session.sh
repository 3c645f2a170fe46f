#!/usr/bin/env bash
# What one call on a lent GPU runs (docs/benchmarks.md, "One GPU"): the one-GPU tests, then benchmarks/gpu.py's
# table for what issue 30 still measures, with profiles, a second round (the synchronous schedules, pipemare and
# xpipe) so their ratios can be read against the run's own noise, and gpipe under the expandable-segments allocator. Everything
# lands under $OUT (default gpu_results/).
#
#   PYTHONPATH=. bash benchmarks/gpu_session.sh                                       # on the GPU
#   OUT=/tmp/dry EXTRA="--device cpu --tiny" bash benchmarks/gpu_session.sh           # a dry run on a CPU
#
# Each stage has its own time limit, so a hang in one still leaves the others' results.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.
out=${OUT:-gpu_results}
extra=${EXTRA:-}
mkdir -p "$out"
stamp() { echo "== $(date -u +%H:%M:%S) $*"; }
bench() {  # bench LABEL ARGS...: one invocation of benchmarks/gpu.py, its rows appended to $out/LABEL.jsonl
    local label=$1
    shift
    stamp "$label"
    # shellcheck disable=SC2086  # $extra holds several flags
    timeout 300 python benchmarks/gpu.py --warmup 3 --steps 8 --sync-steps 1 --json "$out/$label.jsonl" \
        --profile-dir "$out/profiles_$label" "$@" $extra >"$out/$label.log" 2>&1
    echo "rc $?"
    sed -n '/^| variant/,$p' "$out/$label.log"
}

stamp tests
timeout 180 python -m pytest tests/gpu -q -p no:cacheprovider >"$out/tests.txt" 2>&1
echo "rc $?"
tail -3 "$out/tests.txt"

# pipemare and xpipe redirect their backwards on a torch without storage exchange (docs/async-semantics.md);
# /copy-weights is the way they ran before. gpipe against 1f1b and accumulation: where its step goes.
bench round1 --profile gpipe 1f1b accumulation \
    --variants accumulation gpipe 1f1b pipemare pipemare/copy-weights pipemare/no-correction xpipe xpipe/copy-weights zbv
bench round2 --variants accumulation gpipe 1f1b interleaved_1f1b pipemare xpipe
# the allocator mapping memory in place of new cudaMalloc blocks: does gpipe's larger working set cost it steps?
(export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; bench expandable --variants accumulation gpipe 1f1b)
stamp done
