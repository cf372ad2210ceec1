#!/usr/bin/env bash
# Runs a cargo-fuzz target for a number of seconds.
#
#   fuzz/run.sh [SECONDS] [TARGET]      (defaults: 60, cni_parse)
#
# Installs cargo-fuzz if missing (it needs the nightly toolchain). Seeds from
# fuzz/seeds/TARGET are copied into the working corpus fuzz/corpus/TARGET,
# which grows across runs and is not committed. Crashes land in
# fuzz/artifacts/TARGET. Set CARGO_BUILD_JOBS to limit build parallelism and
# FUZZ_TARGET_DIR to build elsewhere than fuzz/target.
set -euo pipefail

seconds="${1:-60}"
target="${2:-cni_parse}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here"

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "installing cargo-fuzz" >&2
    cargo install cargo-fuzz --locked
fi
if ! rustup toolchain list | grep '^nightly' >/dev/null; then
    echo "cargo-fuzz needs the nightly toolchain: rustup toolchain install nightly" >&2
    exit 1
fi

mkdir -p "corpus/$target"
if [ -d "seeds/$target" ]; then
    cp -n "seeds/$target"/* "corpus/$target"/ 2>/dev/null || true
fi

dict=()
if [ -f cni.dict ] && [ "$target" = cni_parse ]; then
    dict=(-dict=cni.dict)
fi
target_dir=()
if [ -n "${FUZZ_TARGET_DIR:-}" ]; then
    target_dir=(--target-dir "$FUZZ_TARGET_DIR")
fi

exec cargo +nightly fuzz run "${target_dir[@]}" "$target" "corpus/$target" -- \
    -max_total_time="$seconds" -max_len=65536 -print_final_stats=1 "${dict[@]}"
