#!/usr/bin/env bash
# Bisect a speed change on one GPU: one bisect_probe.py per commit, engines up at once, timed one after another.
#
#   here:  for c in C1 C2 ...; do mkdir -p W/$c; git archive $c packages/core packages/family-llama | tar -x -C T/$c;
#          (cd T/$c && pip wheel --no-deps -w W/$c packages/core packages/family-llama); done   (W travels with `carry`)
#   there: for each commit, pip install --no-deps --target /tmp/c/<commit> W/<commit>/*.whl; move the bundle's own
#          vlenvoys* out of /tmp/site; then  bash benchmarks/bisect.sh   (COMMITS="c1 c2" for some of /tmp/c)
# Results: $OUT/results.json (one object per commit) and $OUT/logs.txt.
set -u
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_USE_V2_MODEL_RUNNER=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
CK=$(ls -d ~/.cache/vlenvoys/bench-llama-1b-bfloat16)
F=/tmp/probe-$(date +%s); mkdir -p "$F"
commits=(${COMMITS:-$(ls /tmp/c)})
n=${#commits[@]}; i=0
for c in "${commits[@]}"; do
  PYTHONPATH=/tmp/c/$c:/tmp/site timeout "${PROBE_SECONDS:-540}" python3 benchmarks/bisect_probe.py "$CK" "$c" $i $n "$F" > "$F/log-$c" 2>&1 &
  i=$((i+1)); sleep 2
done
wait
cat "$F"/result-*.json > "$OUT/results.json" 2>/dev/null
for c in "${commits[@]}"; do echo "=== $c"; tail -c 30000 "$F/log-$c"; done > "$OUT/logs.txt"
for c in "${commits[@]}"; do grep -E "^\{|up in|failed|Error" "$F/log-$c" | tail -5; done
