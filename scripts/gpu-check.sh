#!/usr/bin/env bash
# The GPU check of issue 15, for a machine with a real Vulkan GPU: the wgpu tests, bench_ops with
# the matmul autotune, bench_train and the main job on the GPU, then one summary table.
#
#   scripts/gpu-check.sh                # from the repository root
#   GPU_PEAK_TFLOPS=67 scripts/gpu-check.sh   # f32 peak of the GPU (H200 SXM: 67), for the % column
#
# Needs a Vulkan loader (libvulkan.so.1) and the GPU's ICD (for NVIDIA: the driver's
# nvidia_icd.json); lavapipe alone is not a GPU and the script says so. Logs go to
# ${OUT:-gpu-check-out}/. The autotune's choices go to a fresh cache file there, so the trial
# runs (and is timed) in this check.
set -u
cd "$(dirname "$0")/.."
out="${OUT:-gpu-check-out}"
mkdir -p "$out"
export WGPIPE_AUTOTUNE=on
export WGPIPE_AUTOTUNE_CACHE="$out/autotune.tsv"
rm -f "$WGPIPE_AUTOTUNE_CACHE"
peak="${GPU_PEAK_TFLOPS:-}"
status=0

step() { # name, command...: runs it, logs it, records pass/fail
    local name=$1; shift
    echo "== $name: $*" | tee -a "$out/summary.log"
    local t0=$SECONDS
    if "$@" >"$out/$name.log" 2>&1; then
        echo "   ok ($((SECONDS - t0)) s)" | tee -a "$out/summary.log"
    else
        echo "   FAILED ($((SECONDS - t0)) s); tail of $out/$name.log:" | tee -a "$out/summary.log"
        tail -20 "$out/$name.log"
        status=1
    fi
}

if ! ldconfig -p 2>/dev/null | grep -q 'libvulkan\.so\.1'; then
    echo "SKIPPED: no Vulkan loader (libvulkan.so.1) on this machine; install it and the GPU's ICD"
    exit 2
fi

step build cargo build --release --examples
step adapters cargo run --release -q --example bench_ops -- --list-adapters
if ! grep -v -e ', software)' -e '^$' "$out/adapters.log" | grep -q '^[0-9]'; then
    echo "SKIPPED: no hardware adapter found (only: $(tr '\n' ' ' <"$out/adapters.log"))"
    exit 2
fi
gpu_index=$(grep -v ', software)' "$out/adapters.log" | grep '^[0-9]' | head -1 | cut -d: -f1)

step wgpu_tests cargo test --release -p wgpipe-tensor --test wgpu_vs_cpu
step wgpu_autotune_tests cargo test --release -p wgpipe-tensor --lib autotune
step bench_ops target/release/examples/bench_ops
step bench_train target/release/examples/bench_train --devices "cpu,wgpu:$gpu_index" --no-pipeline --seconds 3
step train_transformer target/release/examples/train_transformer --device gpu --quiet

echo
echo "| check | figure | % of f32 peak |"
echo "|---|---|---|"
grep -E "^\| wgpu:$gpu_index .*\| matmul \|" "$out/bench_ops.log" | while IFS='|' read -r _ dev op size queued _rest; do
    gf=$(echo "$queued" | grep -oE '[0-9.]+' | head -1)
    pct="-"
    if [ -n "$peak" ] && [ -n "$gf" ]; then pct=$(awk -v g="$gf" -v p="$peak" 'BEGIN{printf "%.1f%%", 100*g/(p*1000)}'); fi
    echo "| matmul $(echo "$size" | xargs) (autotuned) | $(echo "$queued" | xargs) | $pct |"
done
grep -E "^\| .*\| wgpu:$gpu_index" "$out/bench_train.log" | while IFS='|' read -r _ w _dev plain _rest; do
    echo "| bench_train $(echo "$w" | xargs) | $(echo "$plain" | xargs) steps/s | - |"
done
# "trained steps 0..400 in 53.1 s (16500 tokens/s): ..."
trained=$(grep -oE 'trained steps [0-9.]+ in [0-9.]+ s \([0-9.]+ tokens/s\)' "$out/train_transformer.log" | tail -1)
echo "| train_transformer --device gpu | ${trained:-see $out/train_transformer.log} | - |"
echo
echo "autotune choices ($WGPIPE_AUTOTUNE_CACHE):"
cat "$WGPIPE_AUTOTUNE_CACHE" 2>/dev/null || echo "(none saved)"
exit $status
