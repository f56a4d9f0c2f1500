#!/usr/bin/env bash
# Packs what scripts/gpu-check.sh runs, for a GPU machine without Rust: the lent NVIDIA H200 has
# no cargo and reaches no package registry, and its image may lack a Vulkan loader. Run it here:
#
#   scripts/gpu-bundle.sh             # writes .gpu/bundle.tar.xz and .gpu/debs/ (git-ignored)
#
# then, with the device tool: run(carry [".gpu"], timeout_s 540, command "GPU_PEAK_TFLOPS=67
# scripts/gpu-check.sh").
#
# The bundle holds the examples gpu-check.sh runs and every test binary that runs wgpu kernels,
# built in release and stripped, each under the folder of its package (test binaries run from
# their package's folder, as cargo runs them). The binaries share most of their code (wgpu, naga,
# the kernels), which xz's 64 MiB window finds across files: ~110 MB of binaries pack to a fraction
# of the device tool's 64 MiB limit on what travels. .gpu/debs holds the Vulkan loader and the GL
# vendor libraries NVIDIA's Vulkan driver loads, as packages of this machine's distribution (the
# device tool's README names them); gpu-check.sh unpacks them there when the loader is missing.
#
# --no-debs: the binaries only (gpu-check.sh runs that on a machine that has cargo).
set -euo pipefail
cd "$(dirname "$0")/.."
debs=1
[ "${1:-}" = "--no-debs" ] && debs=0

dest=.gpu
stage="$dest/stage"
rm -rf "$stage"
mkdir -p "$stage/examples"

cargo build --release --example bench_ops --example bench_train --example train_transformer
for e in bench_ops bench_train train_transformer; do
    cp "target/release/examples/$e" "$stage/examples/"
done

# package folder, cargo package, test targets whose kernels run on Device::test_wgpu() or on
# every adapter (the library's own tests are named after the crate).
wgpu_tests=(
    "tensor wgpipe-tensor wgpipe_tensor wgpu_vs_cpu half_precision"
    "autograd wgpipe-autograd gradcheck half_precision"
    "models wgpipe-models autocast backends"
    "tests wgpipe-tests pipeline"
)
# Every file whose tests run on Device::test_wgpu() must be in that list.
for f in $(grep -rl --include=*.rs 'test_wgpu' ./*/src ./*/tests); do
    grep -q '#\[test\]' "$f" || continue
    f=${f#./}
    dir=${f%%/*}
    case $f in
        */tests/*) target=$(echo "$f" | cut -d/ -f3) target=${target%.rs} ;;
        *) target=$(grep -m1 '^name' "$dir/Cargo.toml" | cut -d'"' -f2 | tr - _) ;;
    esac
    if ! printf '%s\n' "${wgpu_tests[@]}" | grep -qE "^$dir .* $target( |\$)"; then
        echo "gpu-bundle: $f runs tests on Device::test_wgpu() but its target '$target' ($dir) is not in wgpu_tests" >&2
        exit 1
    fi
done
for entry in "${wgpu_tests[@]}"; do
    read -r dir package targets <<<"$entry"
    mkdir -p "$stage/$dir"
    # cargo prints each test binary's path ("executable"), its name the target's plus a hash.
    exes=$(cargo test --release -p "$package" --no-run --message-format=json 2>/dev/null |
        grep -o '"executable":"[^"]*"' | cut -d'"' -f4)
    for t in $targets; do
        exe=$(echo "$exes" | grep "/deps/$t-[0-9a-f]*$" | head -1)
        if [ -z "$exe" ]; then
            echo "gpu-bundle: no test binary '$t' in $package" >&2
            exit 1
        fi
        cp "$exe" "$stage/$dir/$t"
    done
done
strip "$stage"/*/*
tar -C "$stage" -cf - . | xz -T0 -9 >"$dest/bundle.tar.xz"
rm -rf "$stage"

if [ "$debs" = 1 ]; then
    # The device tool's recipe: this distribution's amd64 packages, whatever this machine runs.
    rm -rf "$dest/debs" /tmp/gpu-bundle-apt
    mkdir -p "$dest/debs" /tmp/gpu-bundle-apt/partial
    apt=(-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/gpu-bundle-apt)
    apt-get "${apt[@]}" update -qq
    (cd "$dest/debs" && apt-get "${apt[@]}" download -qq \
        libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2 2>&1 | grep -v unsandboxed || true)
    ls "$dest"/debs/libvulkan1_*.deb >/dev/null
fi
du -sh "$dest"/* | sed "s/^/gpu-bundle: /"
