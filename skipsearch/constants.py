"""Names and defaults that the command line needs before anything heavy is imported.

`python -m skipsearch --help` must answer without importing torch, transformers or optuna,
so the parser takes its choices and defaults from here. The modules that own these values
(search, models) use or are checked against the same ones (tests/test_cli_fast.py). The drafting
defaults are DraftPolicy's own: policy.py imports nothing heavy.
"""

DEFAULT_MODEL = "smollm2-135m-instruct"
# The models --model takes by name (io/named.py's table, which checks it lists the same): each a GGUF shipped on PyPI.
NAMED_MODEL_NAMES = (DEFAULT_MODEL, "gemma-3-270m")
DTYPE_NAMES = ("bfloat16", "float16", "float32", "float64")
OBJECTIVES = ("speed_x_acceptance", "speedup", "pareto", "modeled")
SAMPLERS = ("tpe", "gp", "cmaes", "random", "nsga2")
# Below this, sampling is greedy decoding in effect (a logit gap of 0.01 weighs exp(-100)), and float32 logits
# divided by the temperature overflow (at 1e-38 for logits of 80): sampling.Sampling refuses it.
MIN_TEMPERATURE = 1e-4
