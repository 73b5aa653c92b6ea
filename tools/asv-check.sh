#!/usr/bin/env bash
# Benchmark a base commit and this checkout with asv, then print only the benchmarks that got slower.
#
#   tools/asv-check.sh [BASE]     BASE defaults to HEAD^ (the parent); the checkout as it is (uncommitted
#                                 changes included; with BASE=HEAD, those alone) is compared with it.
#   tools/asv-check.sh --noise    the checkout against itself (two labels, the same rounds): every ratio is this
#                                 machine's noise, and the verdict the check would give on it (it must pass).
#
# The two are measured in interleaved rounds (ASV_ROUNDS, default 3: base, checkout, base, checkout, ...; each asv
# run takes one round of every benchmark and appends its samples), so that a change of the shared machine's load
# hits both alike. Benchmarks whose work is the process's own time CPU (asv_bench/benchmarks/common.py's CPU:
# time.process_time), which other processes' load stretches far less than wall time.
#
# Exit status: 0 nothing got slower; 3 something got slower (the rows are printed); 2 the check could not run
# (a missing tool, a base that does not build, a failed benchmark: the reason is printed). No other status: an
# unexpected failure of any step is reported as 2 with the step, never as a bare 1.
#
# Needs asv (in the test extra: pip install -e ".[test]") and, where the base's compiled sources differ from
# the checkout's, a build of the base: with Cython installed it is built in place, otherwise pip builds it in
# its isolated build environment (fetching Cython itself) into a temporary directory.
#
# Environment: ASV_FACTOR (default 1.5: a CPU-timed time that grew by more, and significantly by asv's
# statistics, is reported), ASV_WALL_FACTOR (default 4.5, for the benchmarks that time the wall clock: the cold
# loads, fsynced saves, S3, the sharded and incremental suites, whose disk and network waits CPU time cannot
# see; runs of one commit differed by up to 4.60x there on the shared 2-core development machine); memory is
# held to 1.2x and 64 KiB (peakmem_, *_peak_growth, and track_allocated: tracemalloc's peak moves by up to tens of kB
# between processes) and exact counts (the other track_: copies, bytes, read calls, misses) to any change,
# ASV_BENCH (a regular expression: only those benchmarks), ASV_KEEP=1 (keep the results directory).
#
# asv runs with --python=same on the Python that runs this script: the base is checked out into a
# temporary git worktree (its compiled extensions copied from this checkout when its native sources are
# the same, else built there) and put first on asv's path with ASV_PYTHONPATH (asv drops PYTHONPATH).
# Both runs write to a temporary results directory, so old results never enter the comparison.
set -Eeuo pipefail
SLOWER=3 CANNOT_RUN=2
fail() { echo "asv-check: $*" >&2; exit "$CANNOT_RUN"; }
trap 'fail "failed at line $LINENO: $BASH_COMMAND (exit $?)"' ERR
root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
command -v asv > /dev/null || fail "asv is not installed: python3 -m pip install 'asv>=0.6' (the test extra has it:" \
                                   "python3 -m pip install -e \".[test]\")"
PYTHONPATH="$root" python3 -c "import fastckpt" 2> /dev/null || \
    fail "the checkout's fastckpt does not import with this Python: build it first (python3 -m pip install -e .)"
factor=${ASV_FACTOR:-1.5}
wall_factor=${ASV_WALL_FACTOR:-4.5}
rounds=${ASV_ROUNDS:-3}
# The benchmarks that time the wall clock (no CPU mixin): their times get wall_factor.
wall='bench_cold\.|bench_train\.|bench_s3\.|bench_sharded\.|bench_incremental\.|bench_memory\.|StatefulSave|StatefulLoad'
bench=(); [ -n "${ASV_BENCH:-}" ] && bench=(-b "$ASV_BENCH")
noise=0
if [ "${1:-}" = "--noise" ]; then noise=1; shift; fi
base=$(git -C "$root" rev-parse --verify -q "${1:-HEAD^}^{commit}") || fail "no commit named ${1:-HEAD^} in $root"
# asv keys results by commit: uncommitted changes get one of their own (git stash create: a commit object of
# the working tree that no branch or stash points to), so that BASE may be HEAD itself.
head=$(git -C "$root" stash create 2>/dev/null || true)
[ -n "$head" ] || head=$(git -C "$root" rev-parse --verify "HEAD^{commit}")

tmp=$(mktemp -d "${TMPDIR:-/tmp}/asv-check.XXXXXX")
cleanup() {
    git -C "$root" worktree remove --force "$tmp/base" 2>/dev/null || true
    if [ "${ASV_KEEP:-0}" = 1 ]; then echo "results kept in $tmp/results" >&2; else rm -rf "$tmp"; fi
}
trap cleanup EXIT

# One configuration for both runs: the results go to $tmp, the benchmarks are this checkout's.
python3 - "$root/asv_bench/asv.conf.json" "$tmp" "$root" > "$tmp/asv.conf.json" <<'EOF'
import json, sys
conf = json.load(open(sys.argv[1]))
conf.update(repo=sys.argv[3], benchmark_dir=sys.argv[3] + "/asv_bench/benchmarks",
            results_dir=sys.argv[2] + "/results", html_dir=sys.argv[2] + "/html", env_dir=sys.argv[2] + "/env")
json.dump(conf, sys.stdout, indent=1)
EOF
asv machine --yes --config "$tmp/asv.conf.json" > /dev/null

run() {  # run SOURCE_TREE COMMIT_LABEL NAME: one round of every benchmark, its samples appended to the label's
    echo "asv: benchmarking $3 ($(git -C "$root" log -1 --format='%h %s' "$2" | cut -c1-80))" >&2
    if ! ASV_PYTHONPATH="$1" asv run --config "$tmp/asv.conf.json" --python=same --set-commit-hash="$2" \
            --append-samples -a rounds=1 "${bench[@]}" > "$tmp/$3.log" 2>&1 || grep -q "failed$" "$tmp/$3.log"; then
        grep -B2 -A20 "failed$\|Error" "$tmp/$3.log" | tail -40 >&2
        echo "asv: the $3 run failed (log: $tmp/$3.log); where the checkout's benchmarks use something the base" \
             "lacks (a new builder in fastckpt.bench), name a later BASE" >&2
        ASV_KEEP=1
        exit "$CANNOT_RUN"
    fi
}

if [ "$noise" = 1 ]; then
    # The same code twice under two labels (asv keys results by commit): any difference is noise.
    [ "$base" != "$head" ] || head=$(git -C "$root" commit-tree -p "$base" -m "asv-check: the checkout again" \
                                     "$base^{tree}")  # a second label for the same tree
    for round in $(seq "$rounds"); do
        run "$root" "$base" "first label, round $round"
        run "$root" "$head" "second label, round $round"
    done
else
    [ "$base" != "$head" ] || fail "the checkout is BASE, unchanged: nothing to compare"
    git -C "$root" worktree add --detach -q "$tmp/base" "$base"
    base_tree="$tmp/base"
    if git -C "$root" diff --quiet "$base" -- fastckpt/_native setup.py; then
        for so in "$root"/fastckpt/_native/*.so; do [ -e "$so" ] && cp "$so" "$tmp/base/fastckpt/_native/"; done
    elif python3 -c "import Cython" 2> /dev/null; then
        echo "asv: building the base's extensions (its native sources differ from the checkout's)" >&2
        (cd "$tmp/base" && python3 setup.py build_ext --inplace -j 2 > "$tmp/build.log" 2>&1) || {
            ASV_KEEP=1; fail "the base did not build (log: $tmp/build.log)"; }
    else
        echo "asv: building the base in pip's isolated build environment (Cython is not installed here)" >&2
        base_tree="$tmp/base-build"
        python3 -m pip install --quiet --no-deps --target "$base_tree" "$tmp/base" > "$tmp/build.log" 2>&1 || {
            ASV_KEEP=1; fail "the base did not build (log: $tmp/build.log); installing Cython" \
                             "(python3 -m pip install 'Cython>=3.0') builds it in place instead"; }
    fi
    for round in $(seq "$rounds"); do
        run "$base_tree" "$base" "base, round $round"
        run "$root" "$head" "checkout, round $round"
    done
fi

# asv compare marks a ratio above the factor (and, with statistics, beyond the runs' spread) with "+" (worse)
# and a benchmark that ran before and fails now with "!"; "-" (better) and unchanged rows are left out.
# Three factors: times get $factor (this machine's noise); memory (peakmem_, *_peak_growth) 1.2 (a copy of
# a benchmark's state is 1.5x and more); exact counts (the other track_: copies, misses, bytes) any change.
compare() {  # compare FACTOR [--no-stats] -> the rows asv marks worse or failed
    asv compare --config "$tmp/asv.conf.json" --factor "$@" --sort ratio --only-changed "$base" "$head" \
        | grep -E '^\| +[+!] ' || true
}
if [ "$noise" = 1 ]; then
    asv compare --config "$tmp/asv.conf.json" --factor 1.0 --no-stats --sort ratio "$base" "$head"
fi
# Memory is worse by 1.2x and by MEM_SLACK bytes at least: tracemalloc's peak of a load whose fill threads' small
# objects overlap differently from run to run moved 27-43 kB between processes of one commit, while the copy of a
# benchmark's bytes it is there to catch is MiBs.
MEM_SLACK=65536
beyond_slack() {  # the asv compare rows whose After exceeds their Before by MEM_SLACK bytes or more (or failed)
    python3 -c '
import re, sys
scale = {"": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
def value(cell):
    m = re.fullmatch(r"([0-9.]+)([kMGT]?)", cell.strip())
    return float(m.group(1)) * scale[m.group(2)] if m else None
for line in sys.stdin:
    cells = line.strip().strip("|").split("|")
    before, after = value(cells[1]), value(cells[2])
    if before is None or after is None or after - before >= float(sys.argv[1]):
        sys.stdout.write(line)
' "$MEM_SLACK"
}
slower=$( { compare "$factor" | grep -E '\.time_' | grep -vE "$wall"
            compare "$wall_factor" | grep -E '\.time_' | grep -E "$wall"
            compare 1.2 --no-stats | grep -E '\.peakmem_|_peak_growth|\.track_allocated' | beyond_slack
            compare 1.001 --no-stats | grep -E '\.track_' | grep -vE '_peak_growth|\.track_allocated'; } || true)
against=$(git -C "$root" log -1 --format=%h "$base")
if [ -z "$slower" ]; then
    echo "asv: nothing got slower against $against (CPU times by more than ${factor}x, wall times ${wall_factor}x," \
         "memory 1.2x and 64 KiB, counts at all)"
    exit 0
fi
echo "asv: worse than $against (CPU times by more than ${factor}x, wall times ${wall_factor}x, memory 1.2x" \
     "and 64 KiB, counts at all):"
echo "| Change   | Before | After | Ratio | Benchmark (Parameter) |"
echo "$slower"
exit "$SLOWER"
