#!/usr/bin/env bash
# The GPU check of issue 15, for a machine with a real Vulkan GPU: every test that runs wgpu
# kernels, on the GPU; bench_ops with the kernel autotune; bench_train and the main job on the
# GPU; then one summary table.
#
# On the lent NVIDIA H200 (no Rust, no package registry, maybe no Vulkan loader there), pack the
# binaries and loaders here first, then run it there in one call of the device tool:
#
#   scripts/gpu-bundle.sh                       # here: .gpu/bundle.tar.xz + .gpu/debs (~10 MB)
#   run(carry [".gpu"], timeout_s 540, command "GPU_PEAK_TFLOPS=67 scripts/gpu-check.sh")
#
# On a machine with cargo it builds the bundle itself. GPU_PEAK_TFLOPS: the GPU's f32 peak (H200
# SXM: 67) for the % column. GPU_CHECK_SOFTWARE=1 takes a software adapter (lavapipe) as the GPU:
# a dry run of the whole script where there is no GPU (slow, and no GPU figure).
#
# Logs go to ${OUT:-gpu-check-out}/, at most 8 files (what the device tool brings back): the
# table, summary.log, tests.log, one log per benchmark and the autotune's choices (a fresh cache
# file, so the trial runs, and is timed, in this check). Each step has a time limit, and all of
# them together (building the bundle aside) GPU_CHECK_BUDGET_S (default 480 s, inside the 540 s
# above), so that a hang costs that step and the table still comes back.
set -u
cd "$(dirname "$0")/.."
root=$PWD
out="${OUT:-gpu-check-out}"
mkdir -p "$out"
out=$(cd "$out" && pwd) # absolute: the tests run from their packages' folders
rm -f "$out/autotune.tsv" "$out/summary.log" "$out/tests.log"
peak="${GPU_PEAK_TFLOPS:-}"
deadline=$((SECONDS + 86400)) # the budget starts once the binaries are there (below)
status=0

say() { echo "$*" | tee -a "$out/summary.log"; }
trim() { sed 's/^ *//; s/ *$//'; }

limit() { # seconds asked -> seconds granted: at most what is left of the budget
    local left=$((deadline - SECONDS))
    echo $((left < $1 ? left : $1))
}

bounded() { # seconds asked, log, command...: runs it within the budget, its output in log;
    # returns its exit status (124: timed out), or 125 without running it once the budget is spent
    local granted log=$2
    granted=$(limit "$1")
    shift 2
    [ "$granted" -le 5 ] && return 125
    timeout "$granted" "$@" >"$log" 2>&1
}

verdict() { # what, exit status, start time, note: one line in the summary; a failure marks the check
    case $2 in
        0) say "   $1ok ($((SECONDS - $3)) s) ${4:-}" ;;
        124) say "   $1TIMED OUT ($((SECONDS - $3)) s) ${4:-}" ;;
        125) say "   $1NOT RUN: the check's time budget is spent" ;;
        *) say "   $1FAILED (exit $2, $((SECONDS - $3)) s) ${4:-}" ;;
    esac
    [ "$2" = 0 ] || status=1
}

step() { # name, limit in seconds, command...: runs it into $out/name.log and says how it went
    local name=$1 limit=$2 t0=$SECONDS rc=0
    shift 2
    say "== $name: $*"
    bounded "$limit" "$out/$name.log" "$@" || rc=$?
    verdict "" $rc $t0
    case $rc in 0 | 125) ;; *) tail -20 "$out/$name.log" | tee -a "$out/summary.log" ;; esac
}

# The Vulkan loader: the bundle's packages where the machine has none (unpacked into /, as the
# device tool's README says), and NVIDIA's driver manifest where the driver is mounted outside the
# loader's search path.
if ! ldconfig -p 2>/dev/null | grep -q 'libvulkan\.so\.1' && ls .gpu/debs/*.deb >/dev/null 2>&1; then
    for f in .gpu/debs/*.deb; do dpkg -x "$f" /; done
    ldconfig
    say "unpacked the Vulkan loader from .gpu/debs"
fi
if ! ldconfig -p 2>/dev/null | grep -q 'libvulkan\.so\.1'; then
    say "SKIPPED: no Vulkan loader (libvulkan.so.1): install it and the GPU's driver, or run scripts/gpu-bundle.sh first"
    exit 2
fi
nvidia_icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
if [ -z "${VK_DRIVER_FILES:-}${VK_ICD_FILENAMES:-}" ] && [ -f "$nvidia_icd" ] &&
    ! ls /usr/share/vulkan/icd.d/nvidia* /etc/vulkan/icd.d/nvidia* >/dev/null 2>&1; then
    export VK_DRIVER_FILES=$nvidia_icd VK_ICD_FILENAMES=$nvidia_icd
    # The library it names (libGLX_nvidia.so.0) lives beside the mounted driver.
    [ -d /usr/local/nvidia/lib64 ] && export LD_LIBRARY_PATH="/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    say "Vulkan driver manifest: $nvidia_icd"
fi

# The binaries: built here where there is cargo, else the bundle carried in.
if command -v cargo >/dev/null 2>&1; then
    step bundle 1800 scripts/gpu-bundle.sh --no-debs
fi
if [ ! -f .gpu/bundle.tar.xz ]; then
    say "SKIPPED: no cargo here and no .gpu/bundle.tar.xz: run scripts/gpu-bundle.sh where there is cargo and carry .gpu"
    exit 2
fi
# Unpacked outside the checkout: .gpu/ travels with the device tool (64 MiB at most), the
# unpacked binaries (~110 MB) must not.
bin=/tmp/wgpipe-gpu-check
rm -rf "$bin" && mkdir -p "$bin"
# tar needs the xz program, which a slim image may lack; Python's tarfile reads xz itself.
if ! tar -C "$bin" -xJf .gpu/bundle.tar.xz 2>/dev/null; then
    python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' .gpu/bundle.tar.xz "$bin" ||
        { say "cannot unpack .gpu/bundle.tar.xz (no xz, no python3 with lzma)"; exit 2; }
fi

deadline=$((SECONDS + ${GPU_CHECK_BUDGET_S:-480}))
step adapters 60 "$bin/examples/bench_ops" --list-adapters
sed 's/^/   /' "$out/adapters.log" | grep -v XDG_RUNTIME_DIR | tee -a "$out/summary.log"
gpu_index=$(grep -v ', software)' "$out/adapters.log" | grep '^[0-9]' | head -1 | cut -d: -f1)
train_args=()
bench_ops_limit=120
if [ -z "$gpu_index" ] && [ "${GPU_CHECK_SOFTWARE:-0}" = 1 ]; then
    gpu_index=$(grep '^[0-9]' "$out/adapters.log" | head -1 | cut -d: -f1)
    say "GPU_CHECK_SOFTWARE=1: a dry run on adapter $gpu_index (software: no GPU figure; the main job runs 40 steps)"
    train_args=(--steps 40)
    # lavapipe tunes the f32 and f16 products up to 2048^3 at a few GFLOP/s per candidate
    bench_ops_limit=200
fi
if [ -z "$gpu_index" ]; then
    say "SKIPPED: no hardware adapter found; the Vulkan loader says:"
    VK_LOADER_DEBUG=error,warn,driver timeout 60 "$bin/examples/bench_ops" --list-adapters 2>&1 |
        grep -v XDG_RUNTIME_DIR | tail -30 | tee -a "$out/summary.log"
    exit 2
fi
rm -f "$out/adapters.log" # in summary.log: the logs that come back are few

# The benchmarks run with the autotune on (software adapters too, for the dry run) and a fresh
# cache; matmul's figure first, the one the issue's target is about.
export WGPIPE_AUTOTUNE=on WGPIPE_AUTOTUNE_CACHE="$out/autotune.tsv"
step bench_ops "$bench_ops_limit" "$bin/examples/bench_ops" --quick

# Every wgpu test on the GPU (Device::test_wgpu() follows WGPIPE_TEST_WGPU; wgpu_vs_cpu runs on
# every adapter anyway), each binary from its package's folder as cargo runs it. A wgpu test that
# skips here is a finding: the GPU should have run it.
# The tests keep the autotune's default (on for GPUs), with a cache of their own.
export WGPIPE_TEST_WGPU="wgpu:$gpu_index"
tests_cache=/tmp/gpu-check-tests-autotune.tsv
rm -f "$tests_cache"
say "== tests (WGPIPE_TEST_WGPU=$WGPIPE_TEST_WGPU)"
: >"$out/tests.log"
for exe in "$bin"/*/*; do
    dir=$(basename "$(dirname "$exe")")
    [ "$dir" = examples ] && continue
    name="$dir/$(basename "$exe")"
    t0=$SECONDS rc=0
    (cd "$root/$dir" && bounded 150 "$out/test.tmp" \
        env -u WGPIPE_AUTOTUNE WGPIPE_AUTOTUNE_CACHE="$tests_cache" "$exe") || rc=$?
    result=$(grep -E '^test result:' "$out/test.tmp" 2>/dev/null | tail -1)
    { echo "==== $name (exit $rc)"; cat "$out/test.tmp" 2>/dev/null; } >>"$out/tests.log"
    rm -f "$out/test.tmp"
    verdict "$name: " $rc $t0 "$result"
done
skipped=$(grep -c 'SKIPPED' "$out/tests.log")
say "   lines saying SKIPPED: $skipped"
grep 'SKIPPED' "$out/tests.log" | sort | uniq -c | head -10 | tee -a "$out/summary.log"
grep -E '^test .* FAILED$|panicked at' "$out/tests.log" | head -20 | tee -a "$out/summary.log"

step bench_train 180 "$bin/examples/bench_train" --devices "wgpu:$gpu_index" --no-pipeline --seconds 3 --rounds 2
# The reference beside it: the same three steps in PyTorch on CUDA (f32), where there is one
# (on the CPU in a dry run). WGPIPE_TORCH_PYTHON: the Python that has torch (default python3).
py="${WGPIPE_TORCH_PYTHON:-python3}"
if "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
    torch_device=cuda
elif [ "${GPU_CHECK_SOFTWARE:-0}" = 1 ] && "$py" -c 'import torch' >/dev/null 2>&1; then
    torch_device=cpu
else
    torch_device="none: $py has no torch with CUDA"
fi
case $torch_device in
    cuda | cpu) step torch 180 "$py" scripts/torch_reference.py --device "$torch_device" --seconds 3 ;;
    *) say "no PyTorch reference ($torch_device)" ;;
esac
step train_transformer 180 "$bin/examples/train_transformer" --device gpu --quiet "${train_args[@]}"

# One row per figure; % of the f32 peak where GPU_PEAK_TFLOPS is given (f32 rows only).
pct() { # GFLOP/s -> % of the peak, or -
    if [ -n "$peak" ] && [ -n "$1" ]; then awk -v g="$1" -v p="$peak" 'BEGIN{printf "%.1f%%", 100*g/(p*1000)}'; else echo -; fi
}
{
    echo "| check | wgpipe | PyTorch (${torch_device%%:*}) | % of f32 peak |"
    echo "|---|---|---|---|"
    grep -E "^\| wgpu:$gpu_index .*\| matmul f(32|16) \|" "$out/bench_ops.log" 2>/dev/null | while IFS='|' read -r _ _dev op size queued _rest; do
        gf=$(echo "$queued" | grep -oE '[0-9.]+' | head -1)
        p=-
        case "$op" in *f32*) p=$(pct "$gf") ;; esac
        echo "| $(echo "$op" | trim) $(echo "$size" | trim) (autotuned) | $(echo "$queued" | trim) | - | $p |"
    done
    i=0
    for key in mlp block lm; do
        i=$((i + 1))
        row=$(grep -E "^\| .*\| wgpu:$gpu_index" "$out/bench_train.log" 2>/dev/null | sed -n "${i}p")
        [ -z "$row" ] && continue
        IFS='|' read -r _ w _dev plain _pipe _torch _ratio gflop _rest <<<"$row"
        plain=$(echo "$plain" | trim) gflop=$(echo "$gflop" | trim)
        torch=$(grep "^$key " "$out/torch.log" 2>/dev/null | cut -d' ' -f2)
        ref=-
        [ -n "$torch" ] && ref=$(awk -v a="$plain" -v b="$torch" 'BEGIN{printf "%.2f steps/s (wgpipe %.2fx)", b, a/b}')
        echo "| bench_train $(echo "$w" | trim) | $plain steps/s | $ref | $(pct "$(awk -v s="$plain" -v g="$gflop" 'BEGIN{print s*g}')") |"
    done
    # "trained steps 0..400 in 53.1 s (16500 tokens/s): ..."
    trained=$(grep -oE 'trained steps [0-9.]+ in [0-9.]+ s \([0-9.]+ tokens/s\)' "$out/train_transformer.log" 2>/dev/null | tail -1)
    echo "| train_transformer --device gpu | ${trained:-see train_transformer.log} | - | - |"
} >"$out/table.md"
echo
echo "autotune: $(wc -l <"$out/autotune.tsv" 2>/dev/null || echo 0) shape classes chosen (all in autotune.tsv); the square f32 and f16 products, then the row kernels' workgroup sizes:"
grep -E '	(f16 )?single m(256|512|1024|2048) n\2 k\2	' "$out/autotune.tsv" 2>/dev/null | cut -f2-
grep '	row wg ' "$out/autotune.tsv" 2>/dev/null | cut -f2- | head -24
echo
cat "$out/table.md"
exit $status
