"""gpt-fast's own decoding of one of benchmarks/configs/' shapes, random weights: the reference for our engine's speed.

gpt-fast (pytorch-labs) is not a dependency: its model.py and generate.py (commit 32971d3, unchanged) are imported from
--gpt-fast, a copy of ../shared/anchors/gpt-fast that travels with the GPU call (gpu.sh's `gptfast` stage). The
decode step is compiled as gpt-fast's main compiles it (CUDA graphs, full graph, coordinate descent tuning); the
prefill is not compiled and is counted in the time, as engine_speed.py counts it. Run on the machine that runs
engine_speed.py, in the same call, its figures compare with that script's (not paired: one after the other). Its
shape-specific run.py read the Llama-3-8B shape's weights at 71-72% of the measured bandwidth on an H100
(2026-11-25) and 56-57% on an H200 (2026-11-27).

    python benchmarks/gptfast_anchor.py --gpt-fast .gptfast --config benchmarks/configs/smollm2-135m.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types

import torch

from engine_speed import random_prompts, read_bandwidth


def model_args(config: dict) -> dict:
    """gpt-fast's ModelArgs for a Llama-family config.json. gpt-fast takes a head's size to be hidden // heads and
    unties the output head from the embedding (the bytes a token reads are the same)."""
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    if config.get("head_dim", hidden // heads) != hidden // heads:
        raise ValueError(f"gpt-fast needs head_dim = hidden_size // num_attention_heads, not {config['head_dim']}")
    return dict(block_size=config.get("max_position_embeddings", 2048), vocab_size=config["vocab_size"],
                n_layer=config["num_hidden_layers"], n_head=heads, n_local_heads=config.get("num_key_value_heads", heads),
                dim=hidden, intermediate_size=config["intermediate_size"],
                rope_base=config.get("rope_theta", 10000.0), norm_eps=config.get("rms_norm_eps", 1e-5))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpt-fast", required=True, metavar="DIR", help="a folder with gpt-fast's model.py, generate.py")
    parser.add_argument("--config", required=True, help="a Llama-family config.json (benchmarks/configs/)")
    parser.add_argument("--device", default="cuda", help="cuda (CUDA graphs) or cpu (a check that it runs)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens per run (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=4, help="timed runs after the compile (default: %(default)s)")
    args = parser.parse_args()
    if not os.path.isfile(os.path.join(args.gpt_fast, "generate.py")):
        parser.error(f"--gpt-fast {args.gpt_fast}: no generate.py there (copy ../shared/anchors/gpt-fast)")
    sys.path.insert(0, args.gpt_fast)
    # generate.py imports its tokenizer module, which needs sentencepiece and tiktoken: the ids here are random, so a
    # stand-in keeps the run from needing either.
    sys.modules["tokenizer"] = types.SimpleNamespace(get_tokenizer=None)
    import generate as gptfast
    from model import ModelArgs, Transformer

    with open(args.config) as file:
        config = json.load(file)
    bandwidth = read_bandwidth(torch.device(args.device))
    with torch.device(args.device):
        model = Transformer(ModelArgs(**model_args(config)))
    model = model.to(torch.bfloat16 if args.device != "cpu" else torch.float32).eval()
    weights = sum(p.numel() * p.element_size() for name, p in model.named_parameters() if "tok_embeddings" not in name)
    print(f"gpt-fast on {args.config} ({args.device}): weights read per token {weights / 1e9:.3f} GB; measured read "
          f"bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)
    cuda_graphs = {"mode": "reduce-overhead"} if args.device != "cpu" else {}
    gptfast.decode_one_token = torch.compile(gptfast.decode_one_token, fullgraph=True, **cuda_graphs)
    prompt = torch.tensor(random_prompts(config["vocab_size"], 1)[0], device=args.device, dtype=torch.int)
    rates = []
    for run in range(args.repeats + 1):  # the first run compiles
        gptfast.device_sync(args.device)
        start = time.perf_counter()
        with torch.no_grad():
            gptfast.generate(model, prompt, args.max_new_tokens, 1, interactive=False, draft_model=None,
                             temperature=0.0, top_k=1)
        gptfast.device_sync(args.device)
        seconds = time.perf_counter() - start
        if run == 0:
            print(f"compile + first run {seconds:.1f} s", flush=True)
            continue
        rates.append(args.max_new_tokens / seconds)
        print(f"run {run}: {rates[-1]:.1f} tok/s (prefill included), {rates[-1] * weights / 1e9:.0f} GB/s, "
              f"{100 * rates[-1] * weights / bandwidth:.0f}% of measured", flush=True)
    print(f"gpt-fast median {statistics.median(rates):.1f} tok/s, "
          f"{100 * statistics.median(rates) * weights / bandwidth:.0f}% of measured bandwidth")


if __name__ == "__main__":
    main()
