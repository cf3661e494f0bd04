#!/usr/bin/env bash
# On the GPU machine: piece0's and piece1's files (and piece2's, for the MoE kernels) in one folder B, then
#   bash B/install.sh B      -> the bundle's vLLM, nnsight and this project's packages in /tmp/site (SITE=... for another)
set -euo pipefail
B=$(cd "${1:-.}" && pwd); SITE=${SITE:-/tmp/site}
cd "$B"
cat base.tar.part* > base.tar && sha256sum -c base.tar.sha256
rm -rf x && mkdir x && tar -xf base.tar -C x && rm -f base.tar && cd x && sha256sum -c --quiet SHA256SUMS
mkdir -p "$SITE"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" wheels/*.whl proj/*.whl
tar -xJf core.tar.xz -C "$SITE" && tar -xJf fa3.tar.xz -C "$SITE"
[ ! -f "$B/moe.tar.xz" ] || tar -xJf "$B/moe.tar.xz" -C "$SITE"
echo "installed into $SITE: $(python3 -c 'import sys; sys.path.insert(0, sys.argv[1]); import importlib.metadata as m; print("vllm", m.version("vllm"))' "$SITE"), $(du -sh "$SITE" | cut -f1)"
