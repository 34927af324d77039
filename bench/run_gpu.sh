#!/usr/bin/env bash
# What one device call runs: GPU tests, then the benchmarks, each writing `--json $OUT/<name>.json` and its
# log. Every benchmark starts with an empty Triton cache (its first run is a fresh process's: nothing compiled
# by an earlier one). Result files record the command and the git commit: where the copy of the tree has no
# .git, pass the commit in, e.g. `HF_RADIX_COMMIT=$(git rev-parse HEAD)` expanded on the machine that has it.
# Usage on the device machine: bash bench/run_gpu.sh [tests] [profile] [profilehybrid] [profiledecode] [profiledet] [profilegsp] [linear] [attention] [sampling] [sharedprefix] [chatnotier] [gsp] [generate] [score] [deterministic] [warm] [chat] [rl] [warmtests] [hybrid]
# Hybrid models need transformers >= 5.24 and run faster with flash-linear-attention: carry their wheels
# (bench/README.md) and put them first on PYTHONPATH before calling this script.
# Results kept: copy $OUT/<name>.json and .log to bench/results/<name>_h200.{json,log} (see bench/README.md).
set -u
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
export HF_RADIX_COMMIT=${HF_RADIX_COMMIT:-unknown}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
for step in "$@"; do
  if [ "$step" != tests ]; then TRITON_CACHE_DIR=$(mktemp -d); export TRITON_CACHE_DIR; fi
  case $step in
    tests) timeout 260 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE -n 6 --tb=short tests/ 2>&1 | tee "$OUT/gpu_tests.log" ;;
    profile) timeout 300 python3 bench/profile_runs.py --json "$OUT/profile.json" 2>&1 | tee "$OUT/profile.log" ;;
    profilehybrid) timeout 200 python3 bench/profile_runs.py --hybrid --part "${PROFILE_PART:-both}" --questions 64 --json "$OUT/profile_hybrid.json" 2>&1 | tee "$OUT/profile_hybrid.log" ;;
    profilegsp) for mode in default deterministic; do flag=$([ $mode = deterministic ] && echo --deterministic)
      timeout 200 python3 bench/profile_runs.py --part gsp $flag --json "$OUT/profile_gsp_$mode.json" 2>&1 | tee "$OUT/profile_gsp_$mode.log"; done ;;
    profiledet) timeout 250 python3 bench/profile_runs.py --deterministic --questions 64 --json "$OUT/profile_deterministic.json" 2>&1 | tee "$OUT/profile_deterministic.log" ;;
    linear) timeout 200 python3 bench/linear_bench.py --json "$OUT/linear.json" 2>&1 | tee "$OUT/linear.log" ;;
    attention) timeout 200 python3 bench/invariant_attention_bench.py --json "$OUT/invariant_attention.json" 2>&1 | tee "$OUT/invariant_attention.log" ;;
    profiledecode) timeout 200 python3 bench/profile_runs.py --part decode --json "$OUT/profile_decode.json" 2>&1 | tee "$OUT/profile_decode.log" ;;
    gsp) timeout 300 python3 bench/gsp.py --groups16 --generate --json "$OUT/gsp.json" 2>&1 | tee "$OUT/gsp.log" ;;
    generate) timeout 240 python3 bench/generate_bench.py --json "$OUT/generate.json" 2>&1 | tee "$OUT/generate.log" ;;
    deterministic) timeout 420 python3 bench/deterministic.py --json "$OUT/deterministic.json" 2>&1 | tee "$OUT/deterministic.log" ;;
    score) timeout 180 python3 bench/score_bench.py --json "$OUT/score.json" 2>&1 | tee "$OUT/score.log" ;;
    warm) timeout 150 python3 bench/warm_start_bench.py --workloads score_bench --json "$OUT/warm_start.json" 2>&1 | tee "$OUT/warm_start.log" ;;
    chat) timeout 200 python3 bench/chat_bench.py --configs unbounded,host_tier --json "$OUT/chat_bench.json" 2>&1 | tee "$OUT/chat_bench.log" ;;
    rl) timeout 330 python3 bench/rl_rollouts.py --json "$OUT/rl_rollouts.json" 2>&1 | tee "$OUT/rl_rollouts.log" ;;
    chatnotier) timeout 100 python3 bench/chat_bench.py --configs unbounded,no_tier --json "$OUT/chat_bench_no_tier.json" 2>&1 | tee "$OUT/chat_bench_no_tier.log" ;;
    sampling) timeout 60 python3 bench/sampling_bench.py --json "$OUT/sampling.json" 2>&1 | tee "$OUT/sampling.log" ;;
    sharedprefix) timeout 100 python3 bench/shared_prefix_bench.py --json "$OUT/shared_prefix_bench.json" 2>&1 | tee "$OUT/shared_prefix_bench.log" ;;
    hybrid) timeout 450 python3 bench/hybrid.py --parts "${HYBRID_PARTS:-kernels,gsp,score,chat}" --json "$OUT/hybrid.json" 2>&1 | tee "$OUT/hybrid.log" ;;
    warmtests) timeout 260 python3 -m pytest -q -p no:cacheprovider tests/test_warm_gpu.py 2>&1 | tee "$OUT/warm_gpu_tests.log" ;;
  esac
done
