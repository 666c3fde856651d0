import os

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config


def worker_threads() -> int | None:
    """The threads torch runs in each pytest-xdist worker (its share of the cores), or None outside several workers.
    Left at torch's default, `-n 2` on 2 cores ran 4 threads on 2 cores: a study test that took 59 s alone took 238 s
    in the suite, its threads spinning against the other worker's (the whole suite: 28 min, against 18 with this)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if "PYTEST_XDIST_WORKER" not in os.environ or workers < 2:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // workers)


def pytest_configure(config):
    """Each pytest-xdist worker, and every process its tests start (OMP_NUM_THREADS), runs `worker_threads()`."""
    threads = worker_threads()
    if threads is not None:
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}

# The tested families (README, "Supported families"): each family's config class with its defaults, and what a tiny
# model of it must keep to test what the family needs (Llama 3.x's rope scaling); families.tiny_config shrinks it.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
FAMILY_CONFIGS = {
    "llama": ("LlamaConfig", {"rope_parameters": LLAMA3_ROPE, "max_position_embeddings": 131072}),
    "mistral": ("MistralConfig", {}),
    "qwen2": ("Qwen2Config", {}), "qwen3": ("Qwen3Config", {}), "qwen3_moe": ("Qwen3MoeConfig", {}),
    "mixtral": ("MixtralConfig", {}), "gemma2": ("Gemma2Config", {}), "gemma3": ("Gemma3TextConfig", {}),
    "phi3": ("Phi3Config", {}), "olmo2": ("Olmo2Config", {}), "smollm3": ("SmolLM3Config", {}),
    "gpt_oss": ("GptOssConfig", {}),
}


def family_config(family: str, **overrides):
    """A tiny config of a tested family (`FAMILY_CONFIGS`); skips the test where this transformers lacks the family."""
    from skipsearch.decode.families import tiny_config

    name, extra = FAMILY_CONFIGS[family]
    cls = getattr(transformers, name, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    return tiny_config(cls(**extra), **overrides)


def family_model(family: str, seed: int = 0, dtype=torch.float32, **overrides):
    """A tiny random-weight model of a tested family (fp32 by default: the routed experts' kernels take no fp64)."""
    from skipsearch.decode.families import tiny_model as tiny_family_model

    return tiny_family_model(family_config(family, **overrides), seed=seed, dtype=dtype)


def tiny_gguf(path, architecture="llama", fill=0.0):
    """A GGUF file of one 4x8 embedding that gguf's reader accepts and transformers cannot convert (no tokenizer,
    missing metadata); `fill` tells two files of the same name and size apart."""
    import numpy
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", numpy.full((4, 8), fill, dtype=numpy.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tiny_model(arch: str = "llama", seed: int = 0, dtype=torch.float32, vocab_size: int = 96, num_layers: int = 4,
               **config_overrides):
    """A small random causal LM; float64 makes greedy ties practically impossible, so equality tests are exact."""
    torch.manual_seed(seed)
    config = CONFIGS[arch](
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=0, eos_token_id=1, pad_token_id=1, tie_word_embeddings=False, **config_overrides,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    # Random init gives near-uniform logits; sharper ones make drafts and acceptance non-trivial.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


@pytest.fixture(autouse=True)
def guard_off_unless_tested(request, monkeypatch):
    """The draft controller prices rounds by this machine's timings, and its guard falls back to plain decoding by
    them: tests of anything else run with the guard off and a clock on which every loop iteration takes 1 ms, so that
    their statistics do not follow the machine's load. tests/test_guard.py (marked `guarded`) tests the controller,
    with a virtual clock where a decision matters."""
    if request.node.get_closest_marker("guarded") is None:
        import dataclasses
        import itertools

        from skipsearch.decode import loop as decoding

        real, ticks = decoding.DraftController, itertools.count()
        monkeypatch.setattr(decoding, "DraftController",
                            lambda policy, *args: real(dataclasses.replace(policy, guard=False), *args))
        monkeypatch.setattr(decoding, "ROUND_CLOCK", lambda: next(ticks) * 1e-3)


@pytest.fixture(scope="session")
def default_model():
    from skipsearch.io.models import load_model

    # The exactness tests need fp32: pinned, so that on a GPU machine (where CUDA and bf16 are the defaults)
    # they test the same thing; tests/test_cuda.py covers CUDA.
    return load_model(device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_model):
    """A tiny random Llama with the default model's tokenizer, saved as a Hugging Face folder (for CLI tests)."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    model = tiny_model("llama", vocab_size=len(default_model.tokenizer), num_layers=4)
    model.config.eos_token_id = default_model.tokenizer.eos_token_id
    model.generation_config.eos_token_id = default_model.tokenizer.eos_token_id
    model.save_pretrained(folder)
    default_model.tokenizer.save_pretrained(folder)
    return folder


class VirtualTimer:
    """A clock that only forwards advance, by made-up costs of their parts: each attention and MLP sublayer run and
    the rest of the forward cost `base + per_token * tokens` (no cost for a sublayer draft mode skips), plus, per
    forward, a delay drawn from an exponential of mean `noise` (a busy machine) while `noisy_forwards` last."""

    COSTS = {"attn": (1.0, 0.1), "mlp": (0.5, 0.05), "rest": (2.0, 0.2)}  # (base, per token), virtual ms

    def __init__(self, model, noise=0.0, noisy_forwards=None, seed=0):
        import random

        self.now, self.forwards, self.noise, self.noisy_forwards = 0.0, 0, noise, noisy_forwards
        self.rng = random.Random(seed)
        parts = [(module, part) for layer in model.model.layers for module, part in ((layer.self_attn, "attn"),
                                                                                     (layer.mlp, "mlp"))]
        self.hooks = [module.register_forward_pre_hook(self.charge(part), with_kwargs=True)
                      for module, part in [*parts, (model, "rest")]]

    def remove(self):
        for hook in self.hooks:
            hook.remove()

    def charge(self, part):
        base, per_token = self.COSTS[part]

        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs.get("hidden_states", kwargs.get("input_ids"))
            self.now += (base + per_token * hidden.shape[1]) / 1e3
            if part == "rest":
                self.forwards += 1
                if self.noise and (self.noisy_forwards is None or self.forwards <= self.noisy_forwards):
                    self.now += self.rng.expovariate(1 / self.noise)

        return hook

    def __call__(self):
        return self.now


@pytest.fixture
def virtual_profiles(monkeypatch):
    """`profile_costs` in virtual time (`VirtualTimer`, for its forwards and the decoder it calibrates with), for tests
    of what the commands write: a busy test machine's real timings would be refused as noise."""
    import types

    from skipsearch.api import bench, profile
    from skipsearch.costs.profiler import profile_costs as real
    from skipsearch.decode import loop as decoding


    def in_virtual_time(model, *args, **kwargs):
        timer = VirtualTimer(model)
        try:
            with monkeypatch.context() as patch:
                patch.setattr(decoding, "time", types.SimpleNamespace(perf_counter=timer))
                return real(model, *args, **{**kwargs, "clock": timer})
        finally:
            timer.remove()

    for command in (bench, profile):  # where the commands that profile look it up
        monkeypatch.setattr(command, "profile_costs", in_virtual_time)


@pytest.fixture
def compiled_prefill_on_cpu(monkeypatch):
    """The regional mode's compiled prefill on the CPU too: by default only CUDA runs it (on a CPU it lost to the eager
    prefill), and the CPU is where its chunks, padding and masks are tested."""
    from skipsearch.decode import engine

    monkeypatch.setattr(engine, "COMPILED_PREFILL_DEVICES", frozenset({"cuda", "cpu"}))
