#!/usr/bin/env bash
# The inference measurements of issues 26 and 27, in parts that each fit a device call: the GPU
# tests of decoding, steps, replays and the static cache, then the benchmarks whose tables go
# into docs/performance.md. Each part has its own time limit, so that one slow part leaves the
# others their time; logs go to $OUT (the device tool brings them back), and the tables are
# printed last.
#
#   bash benchmarks/inference.sh                 # the parts "tests host" (about 9 minutes)
#   bash benchmarks/inference.sh kernels         # 32K decode tables (7 minutes)
#   bash benchmarks/inference.sh model           # generate() in its three cache modes (6 minutes)
#   bash benchmarks/inference.sh deep            # generate() of a 16-layer Llama (7 minutes)
#   bash benchmarks/inference.sh paged           # paged decode at 32K (7 minutes)
#   bash benchmarks/inference.sh small           # paged reads at 4K, two ways (3 minutes)
#   bash benchmarks/inference.sh tiles           # paged reads with a key tile of 32 (2 minutes)
#
# Parts: tests (the GPU tests of this area), host (host time of a step's calls: replays,
# compiled calls without dynamo, planning), kernels (decode steps and warm calls at 32K), long
# (warm calls at 128K), model (transformers' generate(): dynamic cache, static cache, static
# cache with the forward compiled), deep (a 16-layer Llama's generate(), dynamic cache and
# static cache compiled: per-layer costs against per-step ones), profile (where a
# dynamic-cache generate() token's host time goes, flexspec against sdpa, under cProfile),
# stages (the same by stage, clocked without a profiler: the attention layers and flexspec's
# call path), paged (paged caches at pages 16 and 64, `causal & doc` with a moving offset),
# small (small paged reads listing every page, then with exact masks), tiles (paged reads with
# a key tile narrower than the page), mixed (a prefill chunk with decoded tokens, also captured
# and replayed).
# The limits are what each part took on the H200 and the H100 with some room (2026-12-05: the
# tests took 324 s and the mixed rows more than 200 s on the H100; 2026-12-06, on the H100: the
# tests 236 s, deep about 190 s, and the six decode specs at 32K about 300 s; the paged and
# serving tests alone 219 s with -n 4 before the second serving spec and the tuned read;
# 2026-12-06 again, on the H100: the tests 295 s, small about 200 s, tiles about 95 s).
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
nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

logs=()
part() {  # part SECONDS NAME COMMAND...
    local seconds=$1 name=$2
    shift 2
    echo "== $name ($(date +%T))"
    timeout "$seconds" "$@" > "$out/$name.log" 2>&1
    echo "   exit $? (log: $name.log)"
    logs+=("$name")
}

[ $# -eq 0 ] && set -- tests host
for what in "$@"; do
    case "$what" in
        tests)
            part 480 tests python3 -m pytest -m gpu tests/test_gpu.py -n 8 -q \
                -p no:cacheprovider -rfE --tb=short -k "decod or step or static or captured \
or lengths or warm or window or generate or replay or no_dynamo_call or offset or serving \
or paged or fresh_document_ids" ;;
        host)
            part 90 step_replay python3 benchmarks/step_replay.py --device cuda --rounds 9
            part 150 compiled_calls python3 benchmarks/compiled_calls.py --device cuda --rounds 9
            part 60 planning python3 benchmarks/planning.py --device cuda --plans 200 ;;
        kernels)
            part 110 decode_step python3 benchmarks/decode_step.py --layers 8 --cache 32768 \
                --batch 8
            part 330 decode python3 benchmarks/decode.py --caches 32768 --batches 8 ;;
        long)
            part 300 decode_long python3 benchmarks/decode.py --caches 131072 --batches 8 ;;
        model)
            part 320 generate python3 benchmarks/generate.py --models llama mistral \
                --attention sdpa flexspec --tokens 32 --modes dynamic static static+compiled ;;
        deep)
            part 400 generate_deep python3 benchmarks/generate.py --models llama \
                --attention sdpa flexspec --tokens 32 --modes dynamic static+compiled \
                --layers 16 ;;
        stages)
            part 200 generate_stages python3 benchmarks/generate.py --models llama mistral \
                --attention sdpa flexspec --tokens 32 --modes dynamic --stages ;;
        profile)
            part 150 generate_profile python3 benchmarks/generate.py --models mistral \
                --attention sdpa flexspec --tokens 32 --modes dynamic --profile 40 ;;
        paged)
            part 150 paged_16 python3 benchmarks/paged.py --caches 32768 --batches 8 --pages 16
            part 150 paged_64 python3 benchmarks/paged.py --caches 32768 --batches 8 --pages 64
            part 120 paged_doc python3 benchmarks/paged.py --specs "causal & doc" \
                --caches 32768 --batches 8 64 --pages 64 ;;
        small)
            # small decoding reads list every page where a row sees every key it holds: the
            # rows with that rule, then without it
            part 200 paged_small python3 benchmarks/paged.py --caches 4096 --batches 8 \
                --pages 16 64 --specs "causal;causal + alibi;causal + softcap(30)"
            part 200 paged_small_exact python3 benchmarks/paged.py --caches 4096 --batches 8 \
                --pages 16 64 --specs "causal;causal + alibi;causal + softcap(30)" \
                --exact-masks ;;
        tiles)
            # a key tile of 32 within pages of 64 (kernel_options), the contiguous call as is
            part 200 paged_tiles python3 benchmarks/paged.py --caches 4096 --batches 64 8 \
                --pages 64 --specs "causal;causal + alibi" --read-options '{"BLOCK_N": 32}' ;;
        mixed)
            part 280 mixed python3 benchmarks/paged.py --mixed 512 --caches 4096 32768 \
                --batches 8 --pages 64 ;;
        *) echo "unknown part '$what' (tests, host, kernels, long, model, deep, stages, profile, paged, small, tiles, mixed)" >&2; exit 2 ;;
    esac
done

for name in "${logs[@]}"; do
    echo
    echo "## $name"
    grep -E "^\||^  |^profile|^stages|passed|failed|Error" "$out/$name.log" | tail -100
done
