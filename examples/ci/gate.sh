#!/usr/bin/env bash
# Deployment gate: optimize + check + bench, failing the pipeline with graphopt's exit codes
# (3 parity, 4 target/expectation, 5 latency regression).  Usage:
#   examples/ci/gate.sh MODEL.onnx BASELINE.json [EXPECT]
# The first run on a branch writes the baseline (commit it); later runs compare against it.
set -euo pipefail
model="$1"
baseline="$2"
expect="${3:-}"
out="$(mktemp -d)"
args=(--target cpu -O 2 -o "$out/bundle" --junit "$out/optimize.xml" --quiet)
[ -n "$expect" ] && args+=(--expect "$expect")
graphopt optimize "$model" "${args[@]}"
graphopt check "$model" "$out/bundle" --format json > "$out/parity.json"
if [ -f "$baseline" ]; then
  graphopt bench "$model" --optimized "$out/bundle" --baseline "$baseline" \
    --max-regression 5% --junit "$out/bench.xml"
else
  graphopt bench "$model" --optimized "$out/bundle" --save-baseline "$baseline"
fi
echo "gate passed; reports in $out"
