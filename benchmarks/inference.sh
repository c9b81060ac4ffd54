#!/usr/bin/env bash
# The inference measurements of issue 26 in one device call (about 9 minutes on an H200): the
# GPU tests of decoding, steps and the static cache, then the benchmarks whose tables go into
# docs/performance.md. Each part has its own time limit, so that one slow part leaves the
# others their time; logs go to $OUT (the device tool brings them back), the tables are
# printed last.
#
#   bash benchmarks/inference.sh            # from the repository root, on the GPU machine
#
# lark travels as a wheel (.whl, see the device tool's notes); FA4 is optional (its columns
# stay empty without it).
set -uo pipefail
out="${OUT:-/tmp/inference}"
mkdir -p "$out"
if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1

part() {  # part SECONDS NAME COMMAND...
    local seconds=$1 name=$2
    shift 2
    echo "== $name"
    timeout "$seconds" "$@" > "$out/$name.log" 2>&1
    echo "   exit $? (log: $name.log)"
}

part 170 tests python3 -m pytest -m gpu tests/test_gpu.py -n 8 -q -p no:cacheprovider \
    -k "decod or step or static or captured or lengths or warm or window or generate" \
    -rf --tb=line
part 110 decode_step python3 benchmarks/decode_step.py --layers 8 --cache 32768 --batch 8
part 160 decode python3 benchmarks/decode.py --caches 32768 --batches 8
part 130 generate python3 benchmarks/generate.py --models mistral --attention sdpa flexspec \
    --tokens 32

for name in tests decode_step decode generate; do
    echo
    echo "## $name"
    grep -E "^\||passed|failed" "$out/$name.log" | tail -20
done
