#!/usr/bin/env bash
# On the lent GPU machine, from the repo root: the steps after the bundle's pieces have travelled.
#
#   call 1 (carry .gpu/piece0):                 mkdir -p /tmp/b && cp .gpu/piece0/* /tmp/b/
#   (another vLLM's bundle, built into .gpu-033: carry .gpu-033/piece0 and .gpu-033/piece1, and set BUNDLE=.gpu-033)
#   call 2 within 30 s (carry .gpu/piece1, .gpu/extras, .dev):
#                                               bash tools/gpu-bundle/on-device.sh install
#   later calls (carry .dev):                   bash tools/gpu-bundle/on-device.sh gate [gate.py arguments]
#                                               bash tools/gpu-bundle/on-device.sh suite   (SUITE_SECONDS, 540)
#                                               bash tools/gpu-bundle/on-device.sh profile [bench.py arguments]
#
# Here, before call 1: `tools/gpu-bundle/make .gpu` (once per vLLM version), `bash benchmarks/gpu-extras.sh
# download .gpu/extras`, and this commit's wheels and name in .dev (ignored by git, so they travel only when
# carried): `pip wheel --no-deps -w .dev/proj packages/core packages/testing packages/family-*` and
# `git rev-parse --short HEAD > .dev/commit`. With the machine still warm, `install` again reinstalls only the wheels.
set -euo pipefail
export PYTHONPATH=/tmp/site:/tmp/extra VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 \
  TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 PATH=/tmp/extra/bin:$PATH
# VLLM_USE_V2_MODEL_RUNNER is left to vlenvoys.load, which chooses the runner (V2 on CUDA).
leftovers() {
  # The gate's two servers run each in a session of its own with its engine, and outlive a gate that was cut: on an
  # H100 they held 16 GB beside the next call's gate. Each leader's whole session goes.
  for leader in $(pgrep -f "[a]pi_server.entry import main|[v]lenvoys.cli import app; app\(\) serve" || true); do
    pkill -9 -s "$leader" || true; done
}
case "${1:-}" in
install)
  if [ ! -d /tmp/site/vllm ]; then
    cp "${BUNDLE:-.gpu}"/piece1/* /tmp/b/
    bash /tmp/b/install.sh /tmp/b
    [ ! -d .gpu/extras ] || SITE=/tmp/site bash benchmarks/gpu-extras.sh install .gpu/extras
  fi
  rm -rf /tmp/proj && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/proj .dev/proj/*.whl
  rm -rf /tmp/site/vlenvoys* && cp -r /tmp/proj/* /tmp/site/
  cp .dev/commit /tmp/site/measured-commit  # the gate names the wheels installed, not a .dev left from another call
  python3 -c "import vllm, nnsight, vlenvoys; print('vLLM', vllm.__version__, 'nnsight', nnsight.__version__, vlenvoys.__file__)" ;;
profile)  # where a trace's time goes on the GPU (#48 item 2): py-spy of the engine cores, bench.py's paired rows
  shift
  timeout "${PROFILE_SECONDS:-560}" python3 benchmarks/bench.py --paired --repeats 1 --profile "${OUT:-/tmp}/profile" "$@" 2>&1 |
    grep -v "it/s\]" | tail -60 ;;
gate)  # each engine as the gate starts it: plain vLLM on its default runner, vlenvoys on its own
  unset VLLM_USE_V2_MODEL_RUNNER
  shift
  set -o pipefail
  leftovers  # a gate cut by its limit, or a call killed at its own, left its servers up
  rc=0
  timeout "${GATE_SECONDS:-575}" python3 benchmarks/gate.py --commit "$(cat /tmp/site/measured-commit)" --out "${OUT:-.}" "$@" 2>&1 |
    tee "${OUT:-.}/gate.log" | grep -v "it/s\]" | tail -80 || rc=$?
  leftovers; exit "$rc" ;;
suite)  # logs kept in /tmp and packed into one file: a call brings back only so many files, and a cut run none
  leftovers
  rm -rf /tmp/suite && mkdir -p /tmp/suite
  # Measuring a vLLM outside the families' verified ranges (0.33, 0.34) is what a run on its bundle is for.
  export VLENVOYS_ALLOW_UNVERIFIED_VLLM=${VLENVOYS_ALLOW_UNVERIFIED_VLLM:-1}
  timeout "${SUITE_SECONDS:-540}" bash benchmarks/gpu-suite.sh /tmp/suite > /tmp/suite/summary.txt 2>&1 ||
    { # the groups' subshells first (they would start their next group), then their tests
      pkill -f "benchmarks/[g]pu-suite.sh" || true; pkill -f "python3 -m [p]ytest" || true
      echo "cut at ${SUITE_SECONDS:-540} s; each log's tests passed so far, and its failures:"
      for f in /tmp/suite/*.log; do echo "=== $(basename "$f"): $(grep -c " PASSED" "$f") passed so far"
        grep -E " (FAILED|ERROR)( |$)" "$f" | head -8 || true; done; }  # no failure is no reason to stop
  cat /tmp/suite/summary.txt || true
  tar -czf "${OUT:-/tmp}/suite-logs.tgz" -C /tmp suite ;;
*) echo "usage: $0 install|gate|suite|profile" >&2; exit 2 ;;
esac
