#!/usr/bin/env bash
# Runs every cargo-fuzz target briefly on the stable toolchain (--sanitizer none). A crash fails
# CI; its input stays in fuzz/artifacts/<target>/ and is printed here in base64, so it can be
# added to fuzz/corpus/<target>/ (see docs/fuzzing.md) once fixed.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
secs=${RELAY_FUZZ_SECONDS:-20}
if ! command -v cargo-fuzz >/dev/null 2>&1; then
  echo "fuzz: installing cargo-fuzz"
  cargo install cargo-fuzz --locked --quiet
fi
targets=$(sed -n 's/^name = "\(.*\)"$/\1/p' Cargo.toml | grep -v '^relay-fuzz$')
cargo fuzz build --sanitizer none $targets >/dev/null 2>&1 || cargo fuzz build --sanitizer none
status=0
for t in $targets; do
  # Fuzz in a scratch copy of the corpus so that CI leaves the committed one as it is.
  work=$(mktemp -d)
  cp -r "corpus/$t/." "$work/" 2>/dev/null || true
  if cargo fuzz run "$t" --sanitizer none "$work" -- -max_total_time="$secs" >"$work.log" 2>&1; then
    echo "fuzz: $t: $(grep -Eo 'Done [0-9]+ runs in [0-9]+ second' "$work.log" | tail -n 1)"
  else
    status=1
    echo "fuzz: $t FAILED"
    tail -n 30 "$work.log"
    for f in artifacts/"$t"/*; do
      [ -f "$f" ] || continue
      echo "input kept at fuzz/$f (base64): $(base64 -w0 "$f")"
    done
  fi
  rm -rf "$work" "$work.log"
done
exit $status
