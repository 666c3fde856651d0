# Plain compiled decoding paired with transformers' paths on a Xeon without AMX (thirtieth session, issue 40).
cd /work/main
. .venv/bin/activate
echo "== $(python -c 'import torch; print(torch.__version__)'); $(lscpu | grep 'Model name' | sed 's/  */ /g'); amx flags: $(grep -o -w 'amx[a-z_0-9]*' /proc/cpuinfo | sort -u | tr '\n' ' ')"
SECONDS=0
python benchmarks/engine_speed.py --skip-sets "" --num-prompts 2 --max-new-tokens 48 --repeats 4 2>&1 | grep -v "^WARNING"
echo "wall ${SECONDS}s"
