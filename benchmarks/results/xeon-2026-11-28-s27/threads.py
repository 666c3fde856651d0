"""Four threads decode one model at once, compiled (regional steps, aot_eager), 5 calls each, against what each
prompt decodes alone: how many of the 20 calls decoded other tokens. With `--copies BACKEND`, each thread decodes a
copy of the model of its own (copy.deepcopy), and every call (alone too) compiles with BACKEND; with `--eager`,
every call decodes eagerly. Run from the repository root:
    python benchmarks/results/xeon-2026-11-28-s27/threads.py [--copies aot_eager|inductor | --eager]"""

import copy
import sys
import threading

import torch

sys.path.insert(0, "tests")
from conftest import tiny_model  # noqa: E402
from skipsearch.decode.loop import generate  # noqa: E402
from skipsearch.decode.skipset import SkipSet  # noqa: E402

settings = dict(max_new_tokens=40, skip=SkipSet(attn=(1,), mlp=(2,)), compile=True, compile_backend="aot_eager",
                compile_mode="regional")
model = tiny_model(num_layers=4)
copies = "--copies" in sys.argv
prompts = [torch.randint(0, 96, (1, n), generator=torch.Generator().manual_seed(n)) for n in (5, 9, 13, 17)]
if "--eager" in sys.argv:
    settings["compile"] = False
if copies:
    settings["compile_backend"] = sys.argv[sys.argv.index("--copies") + 1]
alone = [generate(model, p, **settings).tokens for p in prompts]
models = [copy.deepcopy(model) if copies else model for _ in prompts]
out = {}


def decode(i: int) -> None:
    for repeat in range(5):
        out[i, repeat] = generate(models[i], prompts[i], **settings).tokens


threads = [threading.Thread(target=decode, args=(i,)) for i in range(4)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
wrong = sum(out[i, r] != alone[i] for i in range(4) for r in range(5))
who = f"a copy per thread, {settings['compile_backend']}" if copies else "one model"
who += "" if settings["compile"] else ", eager"
print(f"{who}: calls that decoded other tokens than alone: {wrong} of 20")
