#!/usr/bin/env bash
# Deployment gate: `graphopt gate` (optimize + parity + --expect + paired latency against a
# baseline + JUnit in one call), failing the pipeline with graphopt's exit codes (3 parity,
# 4 target/expectation/too-noisy baseline, 5 latency regression).  Usage:
#   examples/ci/gate.sh MODEL.onnx BASELINE.json [EXPECT] [JUNIT.xml]
# The first run writes the baseline (commit it); later runs compare against it.  Nothing is
# written besides the baseline and the JUnit file.
set -euo pipefail
model="$1"
baseline="$2"
expect="${3:-}"
junit="${4:-graphopt-gate.xml}"
args=(--target cpu -O 2 --junit "$junit")
[ -n "$expect" ] && args+=(--expect "$expect")
if [ -f "$baseline" ]; then
  args+=(--baseline "$baseline")
else
  args+=(--save-baseline "$baseline")
fi
graphopt gate "$model" "${args[@]}"
