#!/usr/bin/env bash
# Where a converged Rulebook's heap goes, by call site (docs/benchmarks.md, "Where the
# heap goes"): the e2e benchmark's memory-at-scale workload for Rulebook alone, with the
# operator under heaptrack's preload library. The bench stops the operator with SIGTERM
# once it has measured; the launcher turns that into SIGKILL, so nothing is freed on the
# way out and heaptrack's "leaked" bytes are the live heap of the converged process.
# Prints the total and the bytes under the deepest Rulebook or kube-runtime frame.
#
#   scripts/heap-profile.sh            # 3,000 parents (HEAP_PROFILE_N to change)
# Needs heaptrack (Debian: apt install heaptrack) and the local control plane.
set -euo pipefail
cd "$(dirname "$0")/.."
N="${HEAP_PROFILE_N:-3000}"
TARGET="${CARGO_TARGET_DIR:-$PWD/target}"
PRELOAD="$(dirname "$(readlink -f "$(command -v heaptrack)")")/../lib/heaptrack/libheaptrack_preload.so"
INTERPRET="$(dirname "$PRELOAD")/libexec/heaptrack_interpret"
[[ -f "$PRELOAD" && -x "$INTERPRET" ]] || { echo "heap-profile: heaptrack not found" >&2; exit 1; }
OUT="$(mktemp -d)"
cat > "$OUT/rulebook" <<WRAP
#!/usr/bin/env bash
LD_PRELOAD="$PRELOAD" DUMP_HEAPTRACK_OUTPUT="$OUT/raw.\$\$" "$TARGET/release/rulebook" "\$@" &
child=\$!
trap 'kill -KILL \$child' TERM
wait \$child
WRAP
chmod +x "$OUT/rulebook"
cargo build --release --locked --bin rulebook
BENCH_RULEBOOK_BIN="$OUT/rulebook" BENCH_WORKLOADS=scale BENCH_SCALE_N="$N" BENCH_REPEATS=1 \
  BENCH_CONTENDERS=rulebook cargo bench --locked --bench e2e
# The operator's trace is the largest (the bench also runs `rulebook crds`).
RAW="$(ls -S "$OUT"/raw.* | head -1)"
"$INTERPRET" < "$RAW" | gzip > "$OUT/heap.gz"
heaptrack_print -f "$OUT/heap.gz" --flamegraph-cost-type leaked -F "$OUT/stacks.txt" \
  --print-leaks 0 --print-peaks 0 --print-allocators 0 --print-temporary 0 > /dev/null
python3 - "$OUT/stacks.txt" <<'PY'
import collections, re, sys
owners = re.compile(r"rulebook::|kube_runtime::|kube_client::|hyper|tokio::runtime::|minijinja|rustls|h2::")
by = collections.Counter()
total = 0
for line in open(sys.argv[1]):
    stack, _, n = line.rstrip("\n").rpartition(" ")
    n = int(n)
    total += n
    frames = [re.sub(r"::h[0-9a-f]{16}", "", f) for f in stack.split(";")]
    owner = next((f for f in reversed(frames) if owners.search(f)), "other")
    by[owner[:110]] += n
print(f"live heap at the end of the converge: {total / 1e6:.2f} MB")
for k, v in by.most_common(20):
    print(f"{v / 1e6:7.2f} MB  {k}")
PY
echo "heap-profile: trace in $OUT/heap.gz (heaptrack_gui or heaptrack_print)"
