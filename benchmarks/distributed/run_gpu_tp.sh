#!/usr/bin/env bash
# Run benchmarks/configs/gpu_tp_smollm2.yaml on this node's GPUs, the target sharded over N of them.
#
#   bash benchmarks/distributed/run_gpu_tp.sh OUT [N]     # N: default every GPU nvidia-smi lists
#
# Writes OUT/gpu_tp_smollm2_tpN.yaml (the config with tp_size: N), OUT/machine.txt, OUT/log.txt and
# the results in OUT/run (rerunning resumes). On a GPU machine without network, first install the
# kit as benchmarks/gpu/run.sh does (`run.sh a`, `run.sh b OUT`): its /tmp/gpu_kit/site is used when
# it is there. Several nodes: see docs/distributed.md (torchrun --nnodes, --rdzv-endpoint).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: run_gpu_tp.sh OUT [N]}
gpus=${2:-$(nvidia-smi -L | wc -l)}
mkdir -p "$out"
config="$out/gpu_tp_smollm2_tp$gpus.yaml"
sed "s/^  tp_size: .*/  tp_size: $gpus/" benchmarks/configs/gpu_tp_smollm2.yaml > "$config"
if [ -d /tmp/gpu_kit/site ]; then
  export PYTHONPATH="/tmp/gpu_kit/site:/tmp/gpu_kit${PYTHONPATH:+:$PYTHONPATH}" SPECDEC_CACHE=/tmp/gpu_kit/cache
  [ -f .gpu_kit/b/question.jsonl ] && export SPECDEC_SPEC_BENCH="$PWD/.gpu_kit/b/question.jsonl"
fi
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  nvidia-smi topo -m || true
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} > "$out/machine.txt" 2>&1
python3 -m torch.distributed.run --standalone --nproc-per-node "$gpus" -m specdec bench "$config" \
    --out "$out/run" --no-progress 2>&1 | tee "$out/log.txt"
