#!/usr/bin/env bash
# Benchmarks and GPU tests on a machine with a GPU and no network (the H200 host the closing
# notes quote). Wheels the image lacks are taken from $WHEELS (default .devwheels, made with
# `pip download --python-version 3.12 --only-binary=:all: pyzmq pydantic pydantic-settings
# msgspec pytest-asyncio xxhash`). Results go to $OUT (default ./bench-out). Usage:
#   scripts/h200-bench.sh gpu-tests|tiers [MIB]|reset|under LOAD|snapshot [SIZES]|soak [SECONDS]|throughput [ALGORITHM]|blockpool [ALGORITHM]|publisher [DECODERS [ROUNDS]]|paced|ranks [RESETS [FILL]]|ranks-apart [ALGORITHM]
# The vLLM comparisons (publisher, blockpool, throughput's --against-vllm) read vLLM's files from
# $KVPUBD_VLLM_DIR (default .devvllm/: kv_events.py, block_pool.py and the rest; made on a host
# with network by `KVPUBD_VLLM_DIR=.devvllm kvpubd bench vllm-extract WHEEL`); without them
# those comparisons are skipped with a note.
set -uo pipefail
cd "$(dirname "$0")/.."
export KVPUBD_VLLM_DIR=${KVPUBD_VLLM_DIR:-.devvllm}
OUT=${OUT:-bench-out}; mkdir -p "$OUT"
WHEELS=${WHEELS:-.devwheels}
python3 -m pip install -q --no-index --find-links "$WHEELS" pyzmq pydantic pydantic-settings \
    msgspec pytest-asyncio xxhash >/dev/null 2>&1 || echo "h200-bench: wheels not installed" >&2
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
    || export PYTHONPATH=$PWD
K="python3 -m kvpubd"
case "${1:-}" in
  gpu-tests) python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_tier_copy.py tests/test_pool_sharing.py \
                 tests/test_reset_contract.py tests/test_sliced_pool_work.py -m "not slow" 2>&1 | tail -5 ;;
  # tiers [MIB]: demote/promote between the GPU pool and the host tier, every copy method,
  # against one contiguous pinned copy; then the NumPy copier
  tiers) $K bench tiers --total-mib "${2:-512}" --json > "$OUT/tiers.json"
         $K bench tiers --total-mib "${2:-512}" --cpu --json > "$OUT/tiers-cpu.json" ;;
  # soak [SECONDS]: every load at once, resets timed, mirrors checked
  soak) $K bench soak --duration "${2:-60}" --json > "$OUT/soak.json" ;;
  reset) $K bench reset --sizes 0,10000,100000,1000000 --resets 200 --json > "$OUT/reset-cpu.json"
         $K bench reset --sizes 0,1000000 --resets 200 --device cuda:0 --json > "$OUT/reset-cuda.json" ;;
  under) $K bench reset --under "$2" --sizes 1000000 --resets "${3:-100}" --json > "$OUT/under-$2.json" ;;
  # snapshot [SIZES]: the snapshot endpoint, cold, warm and 8 clients at once (100k and 1M)
  snapshot) $K bench snapshot --sizes "${2:-100000,1000000}" --json > "$OUT/snapshot.json" ;;
  # throughput [ALGORITHM]: cache.hash_algorithm, sha256 (default) or xxhash; with vLLM's
  # BlockPool on the same prompts and hash beside the daemon
  throughput) $K bench throughput --hash-algorithm "${2:-sha256}" --against-vllm --json \
                  > "$OUT/throughput-${2:-sha256}.json" ;;
  # blockpool [ALGORITHM]: vLLM's BlockPool and kvpubd's pipeline in process, sha256, xxhash
  # or both (default)
  blockpool) $K bench blockpool --hash-algorithm "${2:-both}" --json \
                 > "$OUT/blockpool-${2:-both}.json" ;;
  # publisher [DECODERS [ROUNDS]]: decoding processes per stream (1: the decoder sets the rate)
  publisher) $K bench publisher --against-vllm --decoders "${2:-1}" --rounds "${3:-7}" --json \
                 > "$OUT/publisher-d${2:-1}.json" ;;
  paced) $K bench throughput --load-fraction 0.5 --load-fraction 0.9 --resets 100 --json \
             > "$OUT/paced.json" ;;
  # ranks [RESETS [FILL]]: one service at 1, 2, 4 and 8 ranks (rank worker processes on;
  # 8 ranks also with them off), 2000 requests per rank; vLLM's publisher in the same session
  # (the 8-rank rate is judged against it); then resets of every rank at 8 ranks with FILL
  # (default 1M) cached blocks per rank, idle and at 90 % of the 8-rank capacity, RESETS
  # (default 20) rounds each. About 6-8 minutes; progress on stderr.
  ranks) say() { echo "ranks: $* (${SECONDS}s)" >&2; }
         for r in 1 2 4 8; do
           say "throughput, $r rank(s), rank processes on"
           $K bench throughput --ranks "$r" --rank-processes on --requests $((2000 * r)) --json \
               > "$OUT/ranks-$r.json"
         done
         say "throughput, 8 ranks, rank processes off"
         $K bench throughput --ranks 8 --rank-processes off --requests 16000 --json \
             > "$OUT/ranks-8-off.json"
         say "vLLM's publisher beside ours, 4 decoders per stream"
         $K bench publisher --against-vllm --decoders 4 --json > "$OUT/ranks-publisher-d4.json"
         say "resets of every rank at 8 ranks, ${3:-1000000} blocks per rank, idle and 90 % load"
         $K bench throughput --ranks 8 --rank-processes on --requests 16000 \
             --fill-blocks "${3:-1000000}" --load-fraction 0.9 --resets "${2:-20}" --json \
             > "$OUT/ranks-8-resets.json"
         say "done"
         python3 scripts/ranks_summary.py "$OUT" >&2 ;;
  # ranks-apart [ALGORITHM]: one single-rank daemon per rank; as many requests per rank as
  # one rank gets above.
  ranks-apart) for r in 1 2 4 8; do
                 $K bench throughput --ranks "$r" --daemon-per-rank --requests $((2000 * r)) \
                     --hash-algorithm "${2:-sha256}" --json > "$OUT/ranks-apart-$r-${2:-sha256}.json"
               done ;;
  *) echo "usage: $0 gpu-tests|tiers [MIB]|reset|under LOAD [RESETS]|snapshot [SIZES]|soak [SECONDS]|throughput [ALGORITHM]|blockpool [ALGORITHM]|publisher [DECODERS [ROUNDS]]|paced|ranks [RESETS [FILL]]|ranks-apart [ALGORITHM]" >&2
     exit 2 ;;
esac
