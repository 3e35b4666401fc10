#!/usr/bin/env bash
# One device call (~4 min): does a process holding the in-process drafter run its host code slower than a target-only
# process (docs/benchmarks.md, "Speculation at batch and over REST": detached plain steps slower than target-only's at
# concurrency 8)? Each line is its own process; results under $OUT/host_*.log.
#   usage: OUT=... scripts/host_slowdown.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
D=tandem/demo_pair/draft
SPEC="--drafter in-process --draft-model $D --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4"
run() { local name=$1; shift; timeout 100 scripts/gpu_check.sh run python3 "$@" > "$OUT/host_$name.log" 2>&1
        echo "== $name"; grep -E "batch 8:|^tok/s|^drafter|^torch threads|^  thread" "$OUT/host_$name.log" | cut -c1-160; }
run alone bench/detached_plain.py --device cuda --batch 8 --seconds 4 --engines target-only
run beside bench/detached_plain.py --device cuda --batch 8 --seconds 4 --engines target-only,detached
run arrivals_plain bench/profile_arrivals.py --concurrency 8 --no-profile
run arrivals_never bench/profile_arrivals.py --concurrency 8 --no-profile --never-speculating $SPEC
run arrivals_never_1thread bench/profile_arrivals.py --concurrency 8 --no-profile --torch-threads 1 --never-speculating $SPEC
OMP_NUM_THREADS=1 run arrivals_never_omp1 bench/profile_arrivals.py --concurrency 8 --no-profile --never-speculating $SPEC
run arrivals_plain_again bench/profile_arrivals.py --concurrency 8 --no-profile
lscpu | grep -E "^(Model name|Thread|Core|Socket|CPU\(s\)|NUMA node)" > "$OUT/host_lscpu.log"
