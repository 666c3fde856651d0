"""Every linear of the eager verifier packed for oneDNN (decode/packed.py's PackedHead, from 4 rows on), against the
verifier the engine runs (only the LM head packed): the eager verify step over a round's tokens, paired and
interleaved, 95% intervals. Run from the repository root:
    python benchmarks/results/xeon-2026-11-28-s27/all_linears.py "" 20          # the default model
    python benchmarks/results/xeon-2026-11-28-s27/all_linears.py gemma-3-270m 12"""
import copy, sys, torch
sys.path.insert(0, "benchmarks")
from verify_head import pair, _x
from skipsearch.decode.engine import engine_for
from skipsearch.decode.packed import PackedHead
from skipsearch.decode.steps import forward_at_position
from skipsearch.io.data import load_prompts
from skipsearch.io.models import encode_prompt, load_model

name = (sys.argv[1] or None) if len(sys.argv) > 1 else None
repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 20
loaded = load_model(name, device="cpu", dtype="float32")
model = loaded.model
prompt = encode_prompt(loaded.tokenizer, load_prompts(num_prompts=1, seed=0)[0])
engine = engine_for(model)
current = engine.eager_verifier()
allp = copy.deepcopy(model)
for mod_name, mod in list(allp.named_modules()):
    for child_name, child in list(mod.named_children()):
        if isinstance(child, torch.nn.Linear):
            setattr(mod, child_name, PackedHead(child.weight, child.bias))
print(name, torch.get_num_threads(), "threads")
with torch.inference_mode():
    cache = engine.cache_for(len(prompt) + 10, None)
    forward_at_position(model, cache, torch.tensor([prompt]))
    position = int(cache.position)
    ids = torch.tensor([prompt[-9:]])
    def run(module, width):
        def call():
            cache.seek(position)
            return forward_at_position(module, cache, ids[:, :width])
        return call
    for w in (1, 4, 5, 9):
        a = run(current, w)(); b = run(allp, w)()
        print(w, "max diff", float((a - b).abs().max()), "argmax same", bool((a.argmax(-1) == b.argmax(-1)).all()))
        ratio, cur_s, all_s = pair(run(current, w), run(allp, w), repeats)
        plain, _, _ = pair(run(allp, w), run(model, 1), repeats)
        print(f"  {w} rows: current verifier {cur_s*1e3:.1f} ms, all linears packed {all_s*1e3:.1f} ms, "
              f"current over all-packed {_x(ratio)}; all-packed over a plain step {_x(plain)}", flush=True)
