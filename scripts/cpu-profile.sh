#!/usr/bin/env bash
# Where a converging Rulebook's CPU goes (docs/benchmarks.md, "Where the CPU goes"): the
# e2e benchmark's memory-at-scale workload for Rulebook alone, with `perf record`
# attached to the operator (DWARF call graphs: the release binary has no frame pointers,
# and async stacks are deep, hence the 64 KiB stack copies at a low rate). Prints the
# share of samples by part of the process (reconciles, renders on the blocking pool, the
# watch streams, HTTP, parked threads) and, within reconciles, by step.
#
#   scripts/cpu-profile.sh            # 3,000 parents (CPU_PROFILE_N to change)
# Needs perf (Debian: apt install linux-perf; kernel.perf_event_paranoid <= 2) and the
# local control plane.
set -euo pipefail
cd "$(dirname "$0")/.."
N="${CPU_PROFILE_N:-3000}"
TARGET="${CARGO_TARGET_DIR:-$PWD/target}"
command -v perf >/dev/null || { echo "cpu-profile: perf not found" >&2; exit 1; }
OUT="$(mktemp -d)"
cat > "$OUT/rulebook" <<WRAP
#!/usr/bin/env bash
"$TARGET/release/rulebook" "\$@" &
child=\$!
if [[ "\$1" == run ]]; then
  perf record -F 99 --call-graph dwarf,65528 -o "$OUT/perf.data" -p \$child 2>"$OUT/perf.log" &
  perf=\$!
  trap 'kill -INT \$perf; wait \$perf; kill -KILL \$child' TERM
fi
wait \$child
WRAP
chmod +x "$OUT/rulebook"
cargo build --release --locked --bin rulebook
BENCH_RULEBOOK_BIN="$OUT/rulebook" BENCH_WORKLOADS=scale BENCH_SCALE_N="$N" BENCH_REPEATS=1 \
  BENCH_CONTENDERS=rulebook cargo bench --locked --bench e2e
perf script -i "$OUT/perf.data" -F comm,tid,ip,sym 2>/dev/null > "$OUT/script.txt"
python3 - "$OUT/script.txt" <<'PY'
import collections, re, sys
stacks, cur = [], []
for line in open(sys.argv[1]):
    line = line.rstrip()
    if not line:
        if cur:
            stacks.append(cur)
        cur = []
    elif line[0] in " \t":
        parts = line.split(None, 1)
        cur.append(parts[1] if len(parts) > 1 else "?")
if cur:
    stacks.append(cur)
parts = [  # first match wins
    ("reconciles (on the runtime)", r"reconcile_inner"),
    ("renders and status (blocking pool)", r"render_off_runtime|status_off_runtime|BlockingTask"),
    ("watch streams and caches", r"kube_runtime::watcher|rulebook::engine|cache::store"),
    ("controller queue", r"kube_runtime::controller|kube_runtime::scheduler"),
    ("HTTP and TLS", r"hyper::proto|hyper_util|rustls"),
    ("parked or waking (tokio, kernel)", r"park|epoll_wait|futex"),
]
by, steps = collections.Counter(), collections.Counter()
step = re.compile(r"rulebook::(reconcile|render)::[a-z_:]+|rulebook::render::[A-Za-z_:<> ]+")
for s in stacks:
    text = ";".join(s)
    by[next((n for n, rx in parts if re.search(rx, text)), "other")] += 1
    if "reconcile_inner" in text:
        # leaf first: the frame just below reconcile_inner
        frames = [f for f in reversed(s)]
        i = max(k for k, f in enumerate(frames) if "reconcile_inner" in f)
        below = next((re.sub(r"::\{\{closure\}\}|\+0x[0-9a-f]+", "", f) for f in frames[i + 1:]
                      if f.startswith("rulebook::") or "<rulebook::" in f), "(itself)")
        steps[below[:90]] += 1
total = len(stacks)
print(f"{total} samples at 99 Hz (about {total / 99:.1f} s of CPU)")
for k, v in by.most_common():
    print(f"{100 * v / total:5.1f} %  {k}")
print("within reconciles:")
for k, v in steps.most_common(12):
    print(f"{100 * v / total:5.1f} %  {k}")
PY
echo "cpu-profile: samples in $OUT/perf.data (perf report -i ...)"
