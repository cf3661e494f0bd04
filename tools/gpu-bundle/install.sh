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
# vLLM 0.34's kernel warm-up imports MiniMax-M3's CuTe DSL kernels on every CUDA engine, and with them
# nvidia-cutlass-dsl, quack-kernels and cuda-python (over 100 MB, not in the bundle). That warm-up serves
# MiniMax-M3 alone: where CuTe DSL is missing it is left out, and said.
W="$SITE/vllm/model_executor/warmup/kernel_warmup.py"
# 0.32 names the same warm-up but imports CuTe DSL only inside it: there the module imports, and nothing is done.
if grep -q "minimax_m3_msa_warmup import" "$W" 2>/dev/null && ! PYTHONPATH="$SITE" python3 -c "import cutlass" 2>/dev/null &&
  ! PYTHONPATH="$SITE" python3 -c "import vllm.model_executor.warmup.minimax_m3_msa_warmup" 2>/dev/null; then
  python3 - "$W" <<'PY'
import sys
path = sys.argv[1]
text = open(path).read()
old = "    if current_platform.is_cuda():\n        # The MSA kernels"
assert old in text, "vLLM's kernel warm-up changed: see tools/gpu-bundle/install.sh"
open(path, "w").write(text.replace(old, "    if False:  # tools/gpu-bundle: no CuTe DSL in the bundle, MiniMax-M3's warm-up left out\n        # The MSA kernels"))
PY
  echo "vLLM's MiniMax-M3 kernel warm-up left out (no CuTe DSL in the bundle)"
fi
echo "installed into $SITE: $(python3 -c 'import sys; sys.path.insert(0, sys.argv[1]); import importlib.metadata as m; print("vllm", m.version("vllm"))' "$SITE"), $(du -sh "$SITE" | cut -f1)"
