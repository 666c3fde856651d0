cd /work/main
for v in .venv-check-newest .venv; do
  . $v/bin/activate
  echo "== $v: $(python -c 'import torch; print(torch.__version__)')"
  SECONDS=0
  python benchmarks/engine_speed.py --skip-sets "" --num-prompts 2 --max-new-tokens 48 --repeats 4 2>&1 | grep -v "^WARNING"
  echo "wall ${SECONDS}s"
  deactivate
done
