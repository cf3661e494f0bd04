#!/usr/bin/env bash
# What `vlenvoys serve` needs on the H200 beyond the offline bundle (tools/gpu-bundle ships
# vLLM's offline engine, not its HTTP server): uvicorn and the server's other imports, about 7 MB.
#
#   bash benchmarks/gpu-extras.sh download DIR     here: the wheels into DIR (carry DIR to the GPU machine)
#   bash benchmarks/gpu-extras.sh install DIR      there, after the bundle's install.sh: into /tmp/extra
#
# `install` takes only the distributions neither the image nor /tmp/site has, so no version of theirs
# is shadowed; put /tmp/extra last on PYTHONPATH (and /tmp/extra/bin on PATH: py-spy, for bench.py --profile). Measured 2026-12-04: the server tests and
# benchmarks/serve.py ran with these eleven installed (the rest were already there).
set -euo pipefail
WHEELS="uvicorn h11 click httptools uvloop watchfiles python-multipart email-validator dnspython
  pydantic-extra-types prometheus_client prometheus-fastapi-instrumentator anyio httpx httpcore certifi idna sniffio
  model-hosting-container-standards jmespath supervisor py-spy"
D=${2:?a folder for the wheels}
case "$1" in
download)
  mkdir -p "$D"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$D" $WHEELS ;;
install)
  mkdir -p /tmp/extra
  missing=()
  for wheel in "$D"/*.whl; do
    name=$(basename "$wheel" | cut -d- -f1)
    PYTHONPATH=${SITE:-/tmp/site} python3 -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" "$name" 2>/dev/null ||
      missing+=("$wheel")
  done
  [ ${#missing[@]} -eq 0 ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/extra "${missing[@]}"
  echo "installed into /tmp/extra: ${missing[*]##*/}" ;;
*) echo "usage: $0 download|install DIR" >&2; exit 2 ;;
esac
