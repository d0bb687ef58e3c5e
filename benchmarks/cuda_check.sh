#!/usr/bin/env bash
# The CUDA checks in one run, for a machine with an NVIDIA GPU (CI has none: there the CUDA tests
# skip). Usage, from the repository root:
#   bash benchmarks/cuda_check.sh OUTDIR [TOKENIZER_DIR]
# OUTDIR gets summary.txt (the machine, then each part's exit status), engine.log, api.log,
# serve-*.log, bench-*.json and profile.log (engine_throughput.py --profile: where a step's time
# goes). TOKENIZER_DIR (optional) holds smollm2-135m's tokenizer.json,
# tokenizer_config.json and chat_template.jinja: the serving benchmark then runs a random-weight
# model of that shape (speed does not depend on the values) at 1 and 32 clients, int4 and bf16.
# API_TIMEOUT (default 360 s) bounds the API tests, run beside the engine's; their servers pick
# the GPU. Needs the packages of pyproject.toml's test extra beside PyTorch with CUDA (an image
# without them: install their wheels first; pytest-asyncio is the one plugin the tests use).
set -u
OUT=${1:?usage: cuda_check.sh OUTDIR [TOKENIZER_DIR]}
TOK=${2:-}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
status() { echo "$1 rc=$2" | tee -a "$OUT/summary.txt"; }

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers',
transformers.__version__, torch.cuda.get_device_name())"
  lscpu | grep 'Model name'; nproc; } > "$OUT/summary.txt" 2>&1

# The API tests (tiny random models) beside the engine's, every server of theirs on the GPU.
timeout "${API_TIMEOUT:-360}" $PY -m pytest -p no:cacheprovider -v -rfEs -m "not real_model" \
  tests/api tests/cli > "$OUT/api.log" 2>&1 &
api_pid=$!

# 1. The engine's own numbers on the device (tests/engine/test_cuda.py).
timeout 180 $PY -m pytest -p no:cacheprovider -v -rs tests/engine/test_cuda.py \
  tests/quant/test_quant.py -k "cuda" > "$OUT/engine.log" 2>&1
status engine $?
wait $api_pid
status api $?

# 2. Serving speed: `localserve bench` against `localserve serve` on the GPU, alone on the
#    machine (launching kernels is CPU work: the API tests beside it slowed it).
if [ -n "$TOK" ]; then
  WORK=$(mktemp -d)
  export LOCALSERVE_HOME=$WORK/home
  $PY - "$TOK" "$WORK/smollm2-135m-random" <<'EOF'
import shutil
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

tok, out = Path(sys.argv[1]), Path(sys.argv[2])
config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                     max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
                     tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
torch.manual_seed(0)
LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
for f in tok.iterdir():
    shutil.copy(f, out / f.name)
EOF
  for bits in 4 16; do
    $PY -m cli.main pull "$WORK/smollm2-135m-random" --bits $bits > "$OUT/serve-$bits.log" 2>&1
    status "pull-$bits" $?
    name=$(ls "$LOCALSERVE_HOME/models" | grep -E ":(int4|bf16)$" | grep "$([ $bits = 4 ] && echo int4 || echo bf16)")
    $PY -m cli.main serve "$name" --port 8321 >> "$OUT/serve-$bits.log" 2>&1 &
    pid=$!
    for _ in $(seq 240); do
      $PY -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8321/health')" \
        2> /dev/null && break
      kill -0 $pid 2> /dev/null || break
      sleep 0.5
    done
    timeout 150 $PY -m cli.main bench --url http://127.0.0.1:8321 --concurrency 1,32 \
      --per-client 2 --output-tokens 128 --json "$OUT/bench-$bits.json" >> "$OUT/serve-$bits.log" 2>&1
    status "bench-$bits" $?
    kill $pid; wait $pid
  done
  PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} timeout 240 $PY benchmarks/engine_throughput.py \
    smollm2-135m-random:int4 \
    smollm2-135m-random:bf16 --batch 1 32 --repeat 1 --tokens 32 --profile 32 \
    > "$OUT/profile.log" 2>&1
  status profile $?
  unset LOCALSERVE_HOME
fi

