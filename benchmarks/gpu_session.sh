#!/usr/bin/env bash
# One GPU call: install, warm FlashInfer's JIT cache, run the GPU tests (stage "tests"), the 8B-shaped
# benchmark (stage "bench") or the decode profile (stage "profile"). Run from the repo root on the GPU
# machine; see ../shared/device/README.md. Wheels first (here, once per checkout):
#   ../shared/device/wheels.sh xgrammar==0.2.9 jsonschema==4.26.0 referencing jsonschema-specifications rpds-py msgspec==0.23.0
# The JIT cache comes back in parts under 15 MB (the limit on returned files); put them in .fi-parts/
# (git-ignored, carried) and the next call restores them. benchmarks/fi_cache_build.py builds such
# parts on the CPU box. Carried paths travel within 64 MiB in all: the cuDNN frontend wheel (11.6 MB;
# FlashInfer imports it only if present, for cuDNN paths rxf does not use) can stay out of .whl/.
#   bash benchmarks/gpu_session.sh tests|split|suite|bench|profile|gemv|compare|ab|variants|tune|fi-tests|quant|quant-ab|offline-profile|pytest|h200|others|stream|extend [extra script args | benchmark specs]
# GPU_TESTS=<pytest paths> narrows stage "tests" (default tests/gpu).
# Stage "gemv" times the decode projections (cuBLAS vs the Triton GEMV sweep) and prints RXF_GEMV.
# Stage "compare BASE_DIR [PHASES]" runs gpu_decode.py's PHASES (default bandwidth,decode,offline; the
# triton backend) over an older tree copied into the checkout (`git archive COMMIT | tar -x -C DIR`,
# left untracked so that it travels) and then over this tree, on one checkpoint: a speed-up measured
# against the previous commit in the same call.
# Stage "others" runs the named benchmark scripts (MoE, LLaVA, tensor parallel, the step profile),
# each bounded, logs under $OUT.
set -uo pipefail
stage=$1; shift
export PYTHONUNBUFFERED=1 FLASHINFER_WORKSPACE_BASE=$PWD/.fi-cache
if [ -z "${RXF_INSTALLED:-}" ]; then  # a second stage in the same call skips the install
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$HOME/site" .whl/*.whl || exit 1
  # pip stamps the installed headers with the install time, newer than the restored JIT objects, so
  # ninja's dependency check rebuilt every FlashInfer kernel on each call; give them a fixed old time.
  find "$HOME/site/flashinfer" "$HOME/site/tvm_ffi" -exec touch -h -d @946684800 {} + 2> /dev/null
  # Editable install for rxf's entry points (its builtins load through them); dependencies are above.
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . > /dev/null || exit 1
fi
export PYTHONPATH=$HOME/site:$PWD RXF_INSTALLED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, flashinfer; print('torch', torch.__version__, 'triton', triton.__version__, 'flashinfer', flashinfer.__version__)"
out=${OUT:-/tmp/out}; mkdir -p "$out"
# Once per call: a nested stage must not unpack over a cache that a background stage is writing.
# xz parts (fi_cache_build.py's, or a call's where xz is installed) unpack through Python's lzma, so
# they need no xz binary here: xz packs FlashInfer's modules 6x smaller than gzip (their kernels
# repeat across modules, past gzip's 32 KB window), 17 modules in 8 MB against 49.
if [ -z "${RXF_CACHE_RESTORED:-}" ]; then
  if ls .fi-parts/fi-cache.txz.part-* > /dev/null 2>&1; then
    cat .fi-parts/fi-cache.txz.part-* \
      | python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)" \
      | tar xf - && echo "JIT cache restored"
  elif ls .fi-parts/fi-cache.tgz.part-* > /dev/null 2>&1; then
    cat .fi-parts/fi-cache.tgz.part-* | tar xzf - && echo "JIT cache restored"
  fi
fi
return_cache() {  # the JIT cache as parts under 15 MB in $out, for .fi-parts/ of the next call
  if command -v xz > /dev/null; then
    tar cf - .fi-cache | xz -T0 -6 | split -b 15M - "$out/fi-cache.txz.part-"
  else
    tar czf - .fi-cache | split -b 15M - "$out/fi-cache.tgz.part-"
  fi
  ls -la "$out"
}
export RXF_CACHE_RESTORED=1
if [ "$stage" = tests ]; then
  start=$(date +%s)
  python3 benchmarks/gpu_decode.py --preset llama3-8b --phases jit > "$out/jit-8b.log" 2>&1 &
  python3 benchmarks/gpu_decode.py --preset tiny --phases jit > "$out/jit-tiny.log" 2>&1 &
  wait; echo "jit: $(( $(date +%s) - start )) s"; tail -n 2 "$out"/jit-*.log
  python3 -m pytest -q -p no:cacheprovider ${GPU_TESTS:-tests/gpu} -ra 2>&1 | tee "$out/gpu-tests.log" | tail -40
  return_cache
  [ $# -gt 0 ] && bash benchmarks/gpu_session.sh others "$@"  # then the named benchmarks, if any
elif [ "$stage" = split ]; then
  # "split [benchmark specs]": GPU_TESTS_BG (FlashInfer-heavy: their JIT compiles are CPU work) run in
  # the background (niced), bounded by BG_LIMIT_S (default 450), while GPU_TESTS (if any) and then the named benchmarks
  # run in front (BG_K / FRONT_K: pytest -k expressions for each; BG_ENV: VAR=value ... for the
  # background run only; FRONT_STAGE: another stage with its arguments, run after the front tests);
  # the JIT cache comes back last,
  # with whatever the background compiled.
  start=$(date +%s)
  timeout "${BG_LIMIT_S:-450}" nice -n 10 env ${BG_ENV:-} python3 -m pytest -q -p no:cacheprovider ${GPU_TESTS_BG} ${BG_K:+-k "$BG_K"} -ra > "$out/gpu-tests-bg.log" 2>&1 &
  bg=$!
  if [ -n "${GPU_TESTS:-}" ]; then  # none: the named benchmarks only, in front
    python3 -m pytest -q -p no:cacheprovider ${GPU_TESTS} ${FRONT_K:+-k "$FRONT_K"} -ra 2>&1 | tee "$out/gpu-tests.log" | tail -30
    echo "front tests done at $(( $(date +%s) - start )) s"
  fi
  [ -n "${FRONT_STAGE:-}" ] && bash benchmarks/gpu_session.sh $FRONT_STAGE  # e.g. "compare bench-base decode"
  [ $# -gt 0 ] && bash benchmarks/gpu_session.sh others "$@"
  wait $bg; echo "background tests: rc $? at $(( $(date +%s) - start )) s"; tail -n 30 "$out/gpu-tests-bg.log"
  return_cache
elif [ "$stage" = suite ]; then
  # "suite [pytest args]": every GPU test (GPU_TESTS, default tests/gpu) in one pytest run over
  # SUITE_WORKERS (default 8) xdist workers on the one GPU, work-stealing, so FlashInfer's JIT compiles
  # (CPU) run beside other workers' tests; bounded by SUITE_LIMIT_S (default 470; SIGINT at the bound
  # as a last resort); every test's line is in suite.log as it ends; the JIT cache comes back
  # (SUITE_CACHE=0: not).
  # Each engine of a test that leaves cache.max_total_tokens unset would size its pool from the GPU
  # memory left (cache.mem_fraction_static), so the first worker's would starve the others: here
  # such pools get a fixed size. The variable outranks a test's config dict (only keyword overrides
  # outrank the environment): a test that needs its own size passes it as one (test_overlap_gpu.py).
  export RXF_CACHE__MAX_TOTAL_TOKENS=${RXF_CACHE__MAX_TOTAL_TOKENS:-65536}
  start=$(date +%s); dist=worksteal
  python3 -c "from xdist.scheduler import WorkStealingScheduling" 2> /dev/null || dist=load
  # Each worker stops starting tests 45 s before the bound (--session-timeout), so that pytest ends
  # by itself and prints the failures' tracebacks (a SIGINT at the bound cut them off on 2026-12-03).
  limit=${SUITE_LIMIT_S:-470}
  timeout -s INT -k 30 "$limit" python3 -m pytest -p no:cacheprovider -v -ra --durations=40 \
    --session-timeout "$(( limit > 90 ? limit - 45 : limit * 2 / 3 ))" \
    -n "${SUITE_WORKERS:-8}" --dist "$dist" --timeout "${SUITE_TEST_LIMIT_S:-400}" ${GPU_TESTS:-tests/gpu} "$@" \
    > "$out/suite.log" 2>&1
  echo "suite: rc $? at $(( $(date +%s) - start )) s"
  grep -E "^(FAILED|ERROR)|Error:|^E  " "$out/suite.log" | head -n 60; tail -n 8 "$out/suite.log"
  [ "${SUITE_CACHE:-1}" = 0 ] || return_cache
elif [ "$stage" = profile ]; then
  python3 benchmarks/gpu_decode.py --preset llama3-8b --phases jit > "$out/jit-8b.log" 2>&1 &
  python3 benchmarks/gpu_profile.py --phases gemv 2>&1 | tee "$out/profile-gemv.log"
  wait; tail -n 2 "$out/jit-8b.log"
  return_cache
  python3 benchmarks/gpu_profile.py --phases step,attn "$@" 2>&1 | tee "$out/profile.log"
elif [ "$stage" = gemv ]; then
  python3 benchmarks/gpu_profile.py --phases gemv "$@" 2>&1 | tee "$out/gemv.log"
elif [ "$stage" = compare ]; then
  # COMPARE_PRESET (default llama3-8b) and COMPARE_ARGS (e.g. --random-weights) pick the model,
  # COMPARE_BACKENDS the attention backends (default triton; the offline phase uses the last);
  # BASE_ENV / NEW_ENV (VAR=value ...) apply to the base tree's run / this tree's run only.
  # COMPARE_SCRIPT=this: both trees run this tree's gpu_decode.py (one harness: its warm-up, its
  # --offline-repeats), each importing its own rxf; by default each tree runs its own script.
  base=$1; phases=${2:-bandwidth,decode,offline}; preset=${COMPARE_PRESET:-llama3-8b}; dir=/tmp/rxf-cmp-$preset
  script=benchmarks/gpu_decode.py; [ "${COMPARE_SCRIPT:-}" = this ] && script=$PWD/benchmarks/gpu_decode.py
  python3 benchmarks/gpu_decode.py --preset "$preset" --phases build --model-dir "$dir" ${COMPARE_ARGS:-} \
    > "$out/build-$preset.log" 2>&1 || { tail -n 20 "$out/build-$preset.log"; exit 1; }
  for tree in "$base" .; do
    name=new-$preset; [ "$tree" = . ] || name=base-$preset
    start=$(date +%s)
    tree_env=${NEW_ENV:-}; [ "$tree" = . ] || tree_env=${BASE_ENV:-}  # e.g. each tree's best RXF_GEMV
    (cd "$tree" && PYTHONPATH=$HOME/site:$PWD timeout "${COMPARE_LIMIT_S:-400}" env $tree_env python3 "$script" \
      --preset "$preset" --model-dir "$dir" --phases "$phases" --backends "${COMPARE_BACKENDS:-triton}" ${COMPARE_ARGS:-} \
      --output "$out/$name.json") > "$out/$name.log" 2>&1
    echo "$name: rc $? in $(( $(date +%s) - start )) s"; grep -v "Loading weights" "$out/$name.log" | tail -n "${COMPARE_TAIL:-40}"
  done
elif [ "$stage" = pytest ]; then
  # "pytest ARGS...": the given pytest arguments as they are (quoting kept), log under $OUT
  python3 -m pytest -q -p no:cacheprovider -ra "$@" 2>&1 | tee "$out/pytest.log" | tail -40
elif [ "$stage" = ab ]; then
  # "ab [PRESET]": batch-1 decode (gpu_decode.py's decode1 phase) on one checkpoint, once per
  # programmatic-dependent-launch setting (RXF_PDL 0 / 1) and RXF_GEMV value: RXF_GEMV_A (default the
  # environment's) and the sweep's all-Triton value (the gemv phase runs first); separate processes,
  # one call. AB_GEMV_SWEEP=0 skips the sweep; RXF_GEMV_B adds a value of one's own; AB_PDL="1" runs
  # one PDL setting only.
  preset=${1:-llama3-8b}; dir=/tmp/rxf-ab-$preset
  python3 benchmarks/gpu_decode.py --preset "$preset" --phases bandwidth --model-dir "$dir" \
    --output "$out/ab-bandwidth.json" > "$out/ab-build.log" 2>&1 || { tail -n 20 "$out/ab-build.log"; exit 1; }
  grep -i "roofline\|bandwidth" "$out/ab-build.log" | tail -n 4
  envs=("${RXF_GEMV_A:-${RXF_GEMV:-}}")
  [ -n "${RXF_GEMV_B:-}" ] && envs+=("$RXF_GEMV_B")
  if [ "${AB_GEMV_SWEEP:-1}" != 0 ]; then
    timeout 200 python3 benchmarks/gpu_profile.py --phases gemv --preset "$preset" > "$out/ab-gemv.log" 2>&1
    grep -E "^(suggested|all triton|projections)" "$out/ab-gemv.log"
    envs+=("$(sed -n 's/^all triton: RXF_GEMV=//p' "$out/ab-gemv.log" | tail -n 1)")
  fi
  i=0
  for gemv in "${envs[@]}"; do
    for pdl in ${AB_PDL:-0 1}; do
      RXF_PDL=$pdl RXF_GEMV=$gemv timeout 300 python3 benchmarks/gpu_decode.py --preset "$preset" --model-dir "$dir" \
        --phases decode1 --backends triton --output "$out/ab-$i-pdl$pdl.json" > "$out/ab-$i-pdl$pdl.log" 2>&1
      echo "RXF_GEMV=$gemv RXF_PDL=$pdl: rc $? $(grep '^decode1' "$out/ab-$i-pdl$pdl.log" | tail -n 1)"
    done
    i=$((i + 1))
  done
elif [ "$stage" = variants ]; then
  # "variants PRESET 'VAR=value ...' ...": batch-1 decode (gpu_decode.py's decode1 phase, triton backend)
  # of one checkpoint once per environment given, each in its own process (a variable read once per
  # process, RXF_GEMV say, takes its value), after one bandwidth phase; VARIANT_ARGS (default
  # --random-weights) go to every run, VARIANT_LIMIT_S (default 240) bounds each.
  preset=$1; shift; dir=/tmp/rxf-var-$preset; vargs=${VARIANT_ARGS---random-weights}
  python3 benchmarks/gpu_decode.py --preset "$preset" --phases build,bandwidth --model-dir "$dir" $vargs \
    --output "$out/var-$preset-bandwidth.json" > "$out/var-$preset-build.log" 2>&1 || { tail -n 20 "$out/var-$preset-build.log"; exit 1; }
  grep -i "roofline\|bandwidth" "$out/var-$preset-build.log" | tail -n 3
  i=0
  for envs in "$@"; do
    timeout "${VARIANT_LIMIT_S:-240}" env $envs python3 benchmarks/gpu_decode.py --preset "$preset" --model-dir "$dir" \
      --phases decode1 --backends triton $vargs --output "$out/var-$preset-$i.json" > "$out/var-$preset-$i.log" 2>&1
    echo "$preset $envs: rc $? $(grep '^decode1' "$out/var-$preset-$i.log" | tail -n 1)"
    i=$((i + 1))
  done
elif [ "$stage" = extend ]; then
  # "extend BASE_DIR": the extend kernel's call. The attention GPU tests (EXTEND_TESTS, bounded by
  # EXTEND_TESTS_S, default 170 s), gpu_attn_extend.py over BASE_DIR's kernel and EXTEND_CONFIGS (bounded
  # by EXTEND_SWEEP_S, default 120 s), then offline 1000 requests over BASE_DIR and this tree with one
  # harness (this tree's gpu_decode.py) and EXTEND_REPEATS (default 2) timed runs each.
  base=$1
  timeout "${EXTEND_TESTS_S:-170}" python3 -m pytest -q -p no:cacheprovider -ra ${EXTEND_TESTS:-tests/gpu/test_triton_attention_gpu.py \
    tests/gpu/test_fp8_kv_gpu.py} > "$out/extend-tests.log" 2>&1
  echo "tests: rc $?"; grep -E "passed|failed|^FAILED|^ERROR" "$out/extend-tests.log" | tail -n 8
  timeout "${EXTEND_SWEEP_S:-120}" python3 benchmarks/gpu_attn_extend.py --base "$base" --cases chunk,chunk-fp8 \
    --configs ${EXTEND_CONFIGS:-p64,64,4,2 p128,64,4,2 p128,64,8,2 p128,128,8,2 p64,64,4,3} > "$out/extend-sweep.log" 2>&1
  echo "sweep: rc $?"; tail -n 2 "$out/extend-sweep.log"
  COMPARE_SCRIPT=this COMPARE_ARGS="--offline-repeats ${EXTEND_REPEATS:-2}" COMPARE_TAIL=4 \
    COMPARE_LIMIT_S=${EXTEND_OFFLINE_S:-170} bash benchmarks/gpu_session.sh compare "$base" offline
  grep -H "^offline run" "$out"/base-llama3-8b.log "$out"/new-llama3-8b.log
elif [ "$stage" = stream ]; then
  # "stream": the FP8 decode projections' weight-read ceiling against the block-wise FP8 GEMV
  # (gpu_stream.py; STREAM_READERS, default tail,gemv,int4; STREAM_LABELS its --labels), then batch-1
  # decode of bf16 and the block-wise FP8 checkpoint made from it with the shape defaults, then of FP8
  # with each role's fastest label of that sweep and with each RXF_QGEMV value in STREAM_QGEMV
  # (space-separated), each its own process. STREAM_FORMATS=fp8 leaves bf16 out (a call short of
  # time); STREAM_READERS=none skips the sweep (its pick is then the defaults again).
  timeout "${STREAM_S:-200}" python3 benchmarks/gpu_stream.py --readers "${STREAM_READERS:-tail,gemv,int4}" \
    ${STREAM_LABELS:+--labels "$STREAM_LABELS"} --json "$out/stream.json" > "$out/stream.log" 2>&1
  echo "stream: rc $?"; grep -v -i warn "$out/stream.log"
  dir=/tmp/rxf-var-llama3-8b; G="python3 benchmarks/gpu_decode.py --preset llama3-8b --model-dir $dir --backends triton --decode1-batches 4"
  timeout 300 $G --quantization "${STREAM_FORMATS:-bf16,fp8}" --phases build,bandwidth,decode1 > "$out/stream-decode1.log" 2>&1
  echo "decode1 ${STREAM_FORMATS:-bf16,fp8} (defaults): rc $?"; grep -E "^decode1 |copy bandwidth|roofline" "$out/stream-decode1.log"
  for q in "$(python3 benchmarks/gpu_stream.py --pick "$out/stream.json")" ${STREAM_QGEMV:-}; do
    timeout 120 env RXF_QGEMV="$q" $G --quantization fp8 --phases decode1 > "$out/stream-q.log" 2>&1
    echo "RXF_QGEMV=$q: rc $? $(grep -E '^decode1 ' "$out/stream-q.log" | tail -n 2 | tr '\n' ' ')"
  done
elif [ "$stage" = fi-tests ]; then
  # "fi-tests [pytest args]": the FlashInfer cases of the attention-feature tests over a JIT cache
  # built on the CPU box (benchmarks/fi_cache_build.py, carried in .fi-parts/): first whether ninja
  # finds each restored module up to date (one line each, and ninja's reasons for the sink module);
  # if that module is not, it stops there rather than spend the call compiling. FI_LIMIT_S bounds the
  # tests (default 200).
  ops=.fi-cache/.cache/flashinfer/0.6.6/90a/cached_ops
  for d in "$ops"/*/; do
    [ -f "$d/build.ninja" ] && echo "$(basename "$d" | cut -c1-150): $(cd "$d" && ninja -n 2>&1 | tail -n 1)"
  done
  sink=$(ls -d "$ops"/*attention_sink*swa_True* 2> /dev/null | head -n 1)
  [ -n "$sink" ] || { echo "no sink module in the cache"; exit 3; }
  (cd "$sink" && ninja -n -d explain 2>&1 | head -n 8)
  (cd "$sink" && ninja -n 2>&1 | grep -q "no work to do") || { echo "the cache is not up to date: no tests"; exit 3; }
  start=$(date +%s)
  timeout -s INT "${FI_LIMIT_S:-200}" python3 -m pytest -q -p no:cacheprovider -ra \
    tests/gpu/test_attention_features_gpu.py -k flashinfer "$@" 2>&1 | tee "$out/fi-tests.log" | tail -n 40
  echo "flashinfer tests: $(( $(date +%s) - start )) s"
elif [ "$stage" = quant ]; then
  # "quant": issue 19's figures in one call, each part bounded (Q_*_S seconds) and logged under $OUT,
  # with the environment's RXF_PDL / RXF_GEMV / RXF_QGEMV; Q_PARTS (default
  # "decode1 online kvcache offline") picks the parts:
  #   decode1   batch-1 decode of bf16 and of the block-wise FP8 and AWQ checkpoints made from it
  #   online    online FP8 over random weights (batch 1)
  #   kvcache   FP8 against bf16 KV at batch 256 with 4k contexts
  #   offline   offline 1000 requests in bf16 and block-wise FP8 (Q_OFFLINE_QUANT: bf16 alone, say)
  #   fp8kv     offline 1000 requests in block-wise FP8 with an FP8 KV cache, per RXF_FP8_FUSED_INPUT
  #             in Q_FUSED (default "0 gated 1"; after "offline", whose bf16 run is their reference)
  #   moe       Qwen3-30B-A3B shape at batch 1, bf16 and online FP8 (random weights)
  #   running   offline 1000 requests per FORMAT:KV_DTYPE:MAX_RUNNING in Q_RUNNING (default "bf16:auto:256
  #             fp8:fp8_e4m3:512 bf16:auto:768 fp8:fp8_e4m3:768"): scheduler.max_running_requests and the
  #             largest decode graph, each a process bounded by Q_RUNNING_S (default 120) seconds, of
  #             Q_REPEATS (default 1) timed runs
  # Q_BACKEND (default triton): the attention backend of every part.
  parts=" ${Q_PARTS:-decode1 online kvcache offline} "
  G="python3 benchmarks/gpu_decode.py --preset llama3-8b --backends ${Q_BACKEND:-triton}"
  if [[ $parts == *" decode1 "* ]]; then
    timeout "${Q_DECODE_S:-150}" $G --quantization bf16,fp8,awq --phases build,bandwidth,decode1 \
      --output "$out/q-decode1.json" > "$out/q-decode1.log" 2>&1
    echo "decode1: rc $?"; grep -E "^decode1 |copy bandwidth" "$out/q-decode1.log"
  fi
  if [[ $parts == *" online "* ]]; then
    VARIANT_ARGS="--random-weights --quantization fp8" VARIANT_LIMIT_S=${Q_ONLINE_S:-60} \
      bash benchmarks/gpu_session.sh variants llama3-8b "RXF_QGEMV=${RXF_QGEMV:-}" | grep decode1
  fi
  if [[ $parts == *" kvcache "* ]]; then
    timeout "${Q_KV_S:-170}" $G --phases kvcache --output "$out/q-kvcache.json" > "$out/q-kvcache.log" 2>&1
    echo "kvcache: rc $?"; grep -E "^(auto|fp8_e4m3) " "$out/q-kvcache.log"
  fi
  if [[ $parts == *" offline "* ]]; then
    timeout "${Q_OFFLINE_S:-200}" $G --quantization "${Q_OFFLINE_QUANT:-bf16,fp8}" --phases offline --output "$out/q-offline.json" \
      > "$out/q-offline.log" 2>&1
    echo "offline: rc $?"; grep -E "^=== offline|req_s" "$out/q-offline.log" | tail -n 8
  fi
  if [[ $parts == *" fp8kv "* ]]; then
    for fused in ${Q_FUSED:-0 gated 1}; do
      RXF_FP8_FUSED_INPUT=$fused timeout "${Q_FP8KV_S:-110}" $G --quantization fp8 --phases offline \
        --offline-kv-dtype fp8_e4m3 --output "$out/q-fp8kv-$fused.json" > "$out/q-fp8kv-$fused.log" 2>&1
      echo "offline fp8 + fp8 KV, RXF_FP8_FUSED_INPUT=$fused: rc $? $(grep req_s "$out/q-fp8kv-$fused.log")"
    done
  fi
  if [[ $parts == *" running "* ]]; then
    for spec in ${Q_RUNNING:-bf16:auto:256 fp8:fp8_e4m3:512 bf16:auto:768 fp8:fp8_e4m3:768}; do
      IFS=: read -r fmt kv running <<< "$spec"
      timeout "${Q_RUNNING_S:-120}" $G --quantization "$fmt" --phases offline --offline-kv-dtype "$kv" \
        --offline-max-running "$running" --offline-repeats "${Q_REPEATS:-1}" > "$out/q-running.log" 2>&1
      echo "offline $spec: rc $? $(grep '"req_s"' "$out/q-running.log") $(grep -o 'total_slots=[0-9]*' "$out/q-running.log") $(grep -o "'retractions': [0-9]*" "$out/q-running.log")"
      grep "^offline run" "$out/q-running.log" | tr '\n' ';'; echo
      grep -m 1 -E "Error|error:" "$out/q-running.log" | cut -c1-300
    done
  fi
  if [[ $parts == *" moe "* ]]; then
    timeout "${Q_MOE_S:-300}" python3 benchmarks/gpu_decode.py --preset qwen3-30b-a3b --random-weights \
      --quantization bf16,fp8 --phases build,bandwidth,decode1 --backends "${Q_BACKEND:-triton}" --output "$out/q-moe.json" \
      > "$out/q-moe.log" 2>&1
    echo "moe: rc $?"; grep -E "^decode1 |roofline" "$out/q-moe.log"
  fi
elif [ "$stage" = quant-ab ]; then
  # "quant-ab BASE_DIR": issue 19's figures against an older tree (`git archive COMMIT | tar -x -C DIR`) in
  # one call: batch-1 decode of bf16, block-wise FP8 and AWQ over BASE_DIR and then this tree (`compare`,
  # one set of checkpoints), then this tree's offline 1000 requests on the same checkpoints, the parts
  # in QAB_OFFLINE (default "bf16 fp8kv": bf16, and block-wise FP8 with an FP8 KV cache under
  # RXF_FP8_FUSED_INPUT=QAB_FUSED, default gated), each bounded by QAB_OFFLINE_S (default 90) seconds.
  COMPARE_ARGS="--quantization bf16,fp8,awq" COMPARE_TAIL=12 bash benchmarks/gpu_session.sh compare "$1" decode1 \
    | grep -E "rc |b1_graphs"
  G="python3 benchmarks/gpu_decode.py --preset llama3-8b --model-dir /tmp/rxf-cmp-llama3-8b --backends triton --phases offline"
  for part in ${QAB_OFFLINE-bf16 fp8kv}; do
    if [ "$part" = bf16 ]; then args="--quantization bf16"; else args="--quantization fp8 --offline-kv-dtype fp8_e4m3"; fi
    RXF_FP8_FUSED_INPUT=${QAB_FUSED:-gated} timeout "${QAB_OFFLINE_S:-90}" $G $args > "$out/qab-$part.log" 2>&1
    echo "offline $part: rc $? $(grep req_s "$out/qab-$part.log")"
  done
elif [ "$stage" = tune ]; then
  # "tune PRESET": this GPU's decode GEMV settings (gpu_profile.py --phases gemv: its `suggested` and its
  # `all triton` RXF_GEMV) and, with TUNE_MOE=1, the MoE decode blocks at 1 token (gpu_moe_decode.py),
  # then batch-1 decode (stage variants) with the environment as it is, then with each value found.
  preset=$1
  timeout "${TUNE_GEMV_S:-150}" python3 benchmarks/gpu_profile.py --phases gemv --preset "$preset" > "$out/tune-gemv-$preset.log" 2>&1
  echo "gemv sweep: rc $?"; grep -E "^(suggested|all triton|projections)" "$out/tune-gemv-$preset.log"
  envs=("TUNE=base")
  for kind in suggested "all triton"; do
    gemv=$(sed -n "s/^$kind: RXF_GEMV=//p" "$out/tune-gemv-$preset.log" | tail -n 1)
    [ -n "$gemv" ] && envs+=("RXF_GEMV=$gemv")
  done
  if [ "${TUNE_MOE:-0}" = 1 ]; then
    timeout "${TUNE_MOE_S:-200}" python3 benchmarks/gpu_moe_decode.py --shape "$preset" --tokens 1 > "$out/tune-moe-$preset.log" 2>&1
    echo "moe sweep: rc $?"; grep -vi "warn" "$out/tune-moe-$preset.log" | tail -n 8
    moe=$(sed -n 's/^RXF_MOE_DECODE=//p' "$out/tune-moe-$preset.log" | tail -n 1)
    [ -n "$moe" ] && envs+=("RXF_MOE_DECODE=$moe")
  fi
  bash benchmarks/gpu_session.sh variants "$preset" "${envs[@]}"
elif [ "$stage" = offline-profile ]; then
  # "offline-profile [BACKEND [TAG]]": gpu_decode.py's offline phase on the Llama-3-8B shape (the
  # checkpoint `ab` uses, built if missing) with a step profile of the timed run and two kernel
  # windows (`--profile-dir`); the step summaries print, the whole profile comes back as
  # profiles-TAG.tgz. TAG names a variant run in the same call (its environment set by the caller).
  dir=/tmp/rxf-ab-llama3-8b; tag=${2:-base}; prof=/tmp/rxf-profiles-$tag; rm -rf "$prof"
  timeout "${PROFILE_LIMIT_S:-300}" python3 benchmarks/gpu_decode.py --preset llama3-8b --model-dir "$dir" \
    --phases offline --backends "${1:-triton}" --profile-dir "$prof" --output "$out/offline-$tag.json" \
    > "$out/offline-$tag.log" 2>&1
  echo "offline-profile $tag: rc $?"; grep -v "Loading weights" "$out/offline-$tag.log" | tail -n 12
  for f in "$prof"/*/dp0-tp0/summary.txt; do echo "== $f"; head -n 16 "$f"; done
  tar czf "$out/profiles-$tag.tgz" -C /tmp "rxf-profiles-$tag"
elif [ "$stage" = h200 ]; then
  # "h200 [BASE_DIR]": issue 18's H200 figures in one call, for a call that may land on either card
  # (most land on an H100): on anything but an H200 it prints the card and stops (exit 4), so that a
  # caller can run something else. First the MoE table's H200 entry (`gpu_moe_tune.py`, written into
  # the tree, so the figures after it use it; a copy comes back in $OUT: put it in
  # rxf/plugins/models/layers/; H200_TUNE=0 skips it), then each part bounded by H200_PART_S:
  # Qwen3-30B-A3B's decode phase (batch 1, overlap off, 16, 64, 256), then batch 1, 4, 8, 16 and 64
  # (decode1) of Qwen3-8B, Llama-3-8B (Qwen3-8B's bar: the same share of the roofline, in the same
  # call) and gpt-oss-20b (random weights; H200_PRESETS names others, in order; the MoE presets also
  # run gpu_decode's routing phase: the experts a batch reads), Qwen3-30B-A3B's
  # batch 1 once more with every GEMV at `triton` (RXF_GEMV=triton: the A/B of its shape defaults,
  # `gemv.SHAPE_DEFAULTS`; H200_GEMV_AB=1 runs it), then, with BASE_DIR (`git archive 899bfac`),
  # issue 17's compare on the Llama-3-8B shape (bandwidth, decode). Not yet timed as a whole: bounded by
  # H200_TUNE_S (130) + 4 x H200_PART_S (100) s beside the install; the tune alone took 72 s on an H100.
  # Issue 18's H200 tests need a second call: `SUITE_CACHE=0 GPU_TESTS="tests/gpu/test_attention_features_gpu.py
  # tests/gpu/test_qwen3_gpu.py tests/gpu/test_gemma_gpu.py tests/gpu/test_gpt_oss_gpu.py" ... suite`
  # (on an H100 these with test_decode_kernels_gpu ran 236 tests in 200 s, short of test_qwen3_gpu: give ~300 s).
  # H200_ANY_CARD=1 runs it on whatever card came: the tool lends an H100 as the H200's stand-in
  # ("good for the work nvidia-h200 is good for, timings you will report included"; its needs_h200 is
  # not for matching a card that an issue names).
  [ "${H200_ANY_CARD:-0}" = 1 ] || nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 \
    || { echo "not an H200"; exit 4; }
  if [ "${H200_TUNE:-1}" = 1 ]; then
    start=$(date +%s); timeout "${H200_TUNE_S:-130}" python3 benchmarks/gpu_moe_tune.py --budget-s 95 > "$out/h200-tune.log" 2>&1
    echo "tune: rc $? in $(( $(date +%s) - start )) s"; tail -n 16 "$out/h200-tune.log"
  fi
  runs=(${H200_PRESETS:-qwen3-30b-a3b qwen3-8b llama3-8b gpt-oss-20b})
  [ "${H200_GEMV_AB:-0}" = 1 ] && runs+=(qwen3-30b-a3b:triton)
  for run in "${runs[@]}"; do
    preset=${run%%:*}; gemv=${run#"$preset"}; gemv=${gemv#:}; tag=$preset${gemv:+-$gemv}
    phases="decode1 --decode1-batches 4,8,16,64"; [ "$run" = qwen3-30b-a3b ] && phases=decode
    moe=; case $run in qwen3-30b-a3b|gpt-oss-20b) moe=routing,;; esac  # the experts a batch reads, beside its rate
    env ${gemv:+RXF_GEMV=$gemv} timeout "${H200_PART_S:-100}" python3 benchmarks/gpu_decode.py --preset "$preset" \
      --random-weights --backends triton --output "$out/h200-$tag.json" --phases build,bandwidth,$moe$phases \
      > "$out/h200-$tag.log" 2>&1
    echo "$tag: rc $?"; grep -E "^decode|^routing|roofline" "$out/h200-$tag.log" | head -n 20
    rm -f "$out/h200-$tag.json"  # (the log has every figure; $OUT returns 8 files at most)
  done
  [ $# -gt 0 ] && COMPARE_LIMIT_S=${COMPARE_LIMIT_S:-150} COMPARE_TAIL=${COMPARE_TAIL:-30} \
    bash benchmarks/gpu_session.sh compare "$1" bandwidth,decode
elif [ "$stage" = others ]; then
  # "others SCRIPT[:ARGS] ...": each benchmark bounded to OTHERS_LIMIT_S (default 400), e.g. others
  # gpu_moe gpu_tp:--tp=1 (commas separate ARGS, unless ARGS has a space: "gpu_profile:--phases gemv,qgemv"
  # keeps its comma); the n-th runs with OUT=$out/n-SCRIPT (its files apart from another run of
  # the same script) and logs to $out/n-SCRIPT.log; OTHERS_ENV: VAR=value ... for every one of them
  n=0
  for spec in "$@"; do
    script=${spec%%:*}; args=""; [ "$spec" != "$script" ] && args=${spec#*:}
    n=$((n + 1)); log="$out/$n-$script.log"; start=$(date +%s); mkdir -p "$out/$n-$script"
    argv=${args//,/ }; [[ "$args" == *" "* ]] && argv=$args  # spaces given: commas stay (--phases gemv,qgemv)
    OUT="$out/$n-$script" timeout "${OTHERS_LIMIT_S:-400}" env ${OTHERS_ENV:-} python3 benchmarks/$script.py $argv \
      > "$log" 2>&1
    echo "$script $args: rc $? in $(( $(date +%s) - start )) s"; grep -v "Loading weights" "$log" | tail -"${OTHERS_TAIL:-30}"
  done
else
  python3 benchmarks/gpu_decode.py --preset llama3-8b "$@" 2>&1 | tee "$out/bench.log"
fi
