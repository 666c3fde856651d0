"""`python -m skipsearch <command>`: generate, optimize, export, plot, bench, profile."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from . import models
from .decoding import DraftPolicy, Sampling, generate
from .skipping import SkipSet


class UsageError(ValueError):
    """Bad input from the command line: reported as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not usage + message
        self.exit(2, f"{self.prog}: error: {message}\n")


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer ids such as 3,7,12, got {text!r}") from None


def _number(kind: type, is_valid: Callable[[float], bool], expected: str) -> Callable[[str], float]:
    """An argparse type: `kind(text)` that satisfies `is_valid`, else a one-line error saying what was expected."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not is_valid(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


_positive_int = _number(int, lambda v: v >= 1, "an integer >= 1")
_non_negative_int = _number(int, lambda v: v >= 0, "an integer >= 0")
_unit_float = _number(float, lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]")
_positive_float = _number(float, lambda v: v > 0, "a number > 0")


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument(
        "--model", default=None,
        help=f"Hugging Face name or local folder (default: the embedded {models.DEFAULT_MODEL})",
    )
    group.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    group.add_argument(
        "--dtype", default=None, choices=sorted(models.DTYPES), help="(default: bfloat16 on CUDA, float32 on CPU)"
    )


def _add_draft_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("drafting (defaults: the config's values, else the ones shown)")
    d = DraftPolicy()
    group.add_argument("--max-draft-tokens", type=_non_negative_int, default=None,
                       help=f"most tokens drafted per round (default: {d.max_draft_tokens})")
    group.add_argument("--fixed-draft", action="store_true",
                       help="always draft --max-draft-tokens tokens (default: adaptive by confidence)")
    group.add_argument("--confidence-threshold", type=_unit_float, default=None,
                       help=f"adaptive: stop drafting below this top-1 probability (default: {d.confidence_threshold})")
    group.add_argument("--target-acceptance", type=_unit_float, default=None,
                       help=f"adaptive: acceptance rate the threshold steers toward (default: {d.target_acceptance})")
    group.add_argument("--threshold-step", type=_unit_float, default=None,
                       help=f"adaptive: threshold change per round (default: {d.threshold_step})")


def _draft_policy(args: argparse.Namespace, base: DraftPolicy) -> DraftPolicy:
    return DraftPolicy(
        max_draft_tokens=base.max_draft_tokens if args.max_draft_tokens is None else args.max_draft_tokens,
        adaptive=base.adaptive and not args.fixed_draft,
        confidence_threshold=base.confidence_threshold if args.confidence_threshold is None else args.confidence_threshold,
        target_acceptance=base.target_acceptance if args.target_acceptance is None else args.target_acceptance,
        threshold_step=base.threshold_step if args.threshold_step is None else args.threshold_step,
    )


def _load(args: argparse.Namespace) -> models.LoadedModel:
    return models.load_model(args.model, device=args.device, dtype=args.dtype)


def cmd_generate(args: argparse.Namespace) -> int:
    from .config import load_skip_config

    if args.config and (args.skip_attn or args.skip_mlp):
        raise UsageError("give either --config or --skip-attn/--skip-mlp, not both")
    loaded = _load(args)
    num_layers = loaded.model.config.num_hidden_layers
    base_policy = DraftPolicy()
    skip: SkipSet | None = SkipSet.of(args.skip_attn or (), args.skip_mlp or (), num_layers)
    if args.config:
        config = load_skip_config(args.config, loaded.model)
        skip, base_policy = config.skip, config.draft
    policy = _draft_policy(args, base_policy)
    if args.autoregressive:
        skip = None
    sampling = Sampling(do_sample=args.do_sample, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    prompt_ids = models.encode_prompt(loaded.tokenizer, args.prompt, raw=args.raw)
    models.check_context(loaded.model, len(prompt_ids), args.max_new_tokens, policy.max_draft_tokens)
    generator = torch.Generator(loaded.device).manual_seed(args.seed) if args.do_sample else None
    output = generate(
        loaded.model, prompt_ids, skip=skip, max_new_tokens=args.max_new_tokens, policy=policy,
        sampling=sampling, eos_token_id=loaded.model.generation_config.eos_token_id, generator=generator,
        compile=args.compile,
    )
    text = loaded.tokenizer.decode(output.tokens, skip_special_tokens=True)
    if args.json:
        print(json.dumps({
            "text": text,
            "token_ids": output.tokens,
            "skip": skip.as_dict() if skip is not None else None,
            "stats": output.stats.as_dict(),
        }))
    else:
        print(text)
        s = output.stats
        print(
            f"[{s.new_tokens} tokens, {s.tokens_per_second:.1f} tok/s, {s.rounds} rounds, "
            f"acceptance {s.acceptance_rate:.2f} ({s.accepted}/{s.drafted}), skip {skip if skip else 'none'}"
            + (f", compile {s.compile_time_s:.1f} s]" if args.compile else "]"),
            file=sys.stderr,
        )
    return 0


def _study_name(text: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", text):
        raise argparse.ArgumentTypeError(
            f"study names are 1-100 letters, digits, '.', '_' or '-', starting with a letter or digit; got {text!r}"
        )
    return text


def _add_study_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("study")
    group.add_argument("--study-name", type=_study_name, default="default", help="name of the Optuna study")
    group.add_argument("--studies-dir", type=Path, default=Path("studies"),
                       help="where studies, exported configs and plots live")
    group.add_argument("--storage", default=None,
                       help="an Optuna storage: a SQLAlchemy URL such as postgresql+psycopg2://user:pw@host/db "
                            "(many machines) or journal:<file> (many processes, one machine) "
                            "(default: sqlite:///<studies-dir>/<study-name>.db)")


def _storage(args: argparse.Namespace, must_exist: bool) -> str:
    from .storage import default_storage

    if args.storage:
        return args.storage
    database = args.studies_dir / f"{args.study_name}.db"
    if must_exist and not database.is_file():
        raise UsageError(f"no study database at {database}: run `python -m skipsearch optimize` first, "
                         "or give --storage / --studies-dir")
    return default_storage(args.study_name, args.studies_dir)


def cmd_optimize(args: argparse.Namespace) -> int:
    from .config import ModelInfo
    from .costs import CostProfile
    from .data import load_prompts
    from .plots import write_plots
    from .export import export_trial, verdict
    from .search import SearchSpace, StudySettings, run_study
    from .storage import Heartbeat, make_storage

    prompts = load_prompts(args.dataset, field=args.field, split=args.split, num_prompts=args.num_prompts,
                           seed=args.seed)
    policy = _draft_policy(args, DraftPolicy())
    loaded = _load(args)
    num_layers = loaded.model.config.num_hidden_layers
    space = SearchSpace(num_layers=num_layers, keep_first_last=not args.allow_first_last,
                        max_skip_fraction=args.max_skip_fraction, skip_prior=args.skip_prior)
    encoded = [models.encode_prompt(loaded.tokenizer, p, raw=args.raw) for p in prompts]
    for ids in encoded:
        models.check_context(loaded.model, len(ids), args.max_new_tokens, policy.max_draft_tokens)
    if args.heartbeat_grace <= args.heartbeat_interval:
        raise UsageError("--heartbeat-grace must be longer than --heartbeat-interval")
    heartbeat = Heartbeat(args.heartbeat_interval, args.heartbeat_grace, args.max_retries)
    profile = None
    if args.cost_profile is not None:
        if args.objective != "modeled":
            raise UsageError("--cost-profile is for --objective modeled")
        profile = CostProfile.load(args.cost_profile)
        profile.check_model(loaded.model)
    if args.storage is None:
        args.studies_dir.mkdir(parents=True, exist_ok=True)  # the default SQLite file lives there
    storage = make_storage(_storage(args, must_exist=False), heartbeat)
    settings = StudySettings(
        study_name=args.study_name, storage=storage, objective=args.objective,
        sampler=args.sampler, seed=args.seed, n_trials=args.n_trials, timeout=args.timeout, min_match=args.min_match,
        dataset=args.dataset, num_prompts=len(prompts), max_new_tokens=args.max_new_tokens,
        show_progress_bar=not args.no_progress, warm_starts=not args.no_warm_starts, pruning=not args.no_pruning,
        compile=args.compile,
    )
    study = run_study(loaded.model, ModelInfo.of(loaded.model, loaded.name_or_path), loaded.dtype_name, encoded,
                      settings, space, policy, loaded.model.generation_config.eos_token_id, profile=profile)
    folder = args.studies_dir / args.study_name
    config = export_trial(study, folder / "best.json")
    print(f"study {args.study_name}: {len(study.trials)} trials in {_storage(args, must_exist=False)}")
    print(verdict(study)[1])
    print(f"exported {folder / 'best.json'}: skip {config.skip if config.skip.size else 'nothing (plain decoding)'}")
    if not args.no_plots:
        written = write_plots(study, folder / "plots")
        print(f"plots: {', '.join(str(p) for p in written)}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from .export import export_trial, verdict
    from .storage import load_study

    study = load_study(args.study_name, _storage(args, must_exist=True))
    output = args.output or args.studies_dir / args.study_name / "best.json"
    config = export_trial(study, output, args.trial)
    if args.trial is None:
        print(verdict(study)[1])
    print(f"exported {output}: skip {config.skip if config.skip.size else 'nothing (plain decoding)'}")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from .plots import write_plots
    from .storage import load_study

    study = load_study(args.study_name, _storage(args, must_exist=True))
    if not any(t.state.name == "COMPLETE" for t in study.trials):
        raise UsageError(f"study {args.study_name!r} has no completed trial to plot yet")
    output = args.output or args.studies_dir / args.study_name / "plots"
    for path in write_plots(study, output):
        print(path)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import bench_verdict, format_table, run_bench, write_outputs
    from .config import load_skip_config
    from .costs import CostProfile, profile_costs
    from .data import load_prompts

    prompts = load_prompts(args.dataset, field=args.field, split=args.split, num_prompts=args.num_prompts,
                           seed=args.seed)
    loaded = _load(args)
    config = load_skip_config(args.config, loaded.model) if args.config else None
    num_layers = loaded.model.config.num_hidden_layers
    if args.early_exit_layer is not None and not 1 <= args.early_exit_layer < num_layers:
        raise UsageError(f"--early-exit-layer must be in 1..{num_layers - 1} for this model, got {args.early_exit_layer}")
    encoded = [models.encode_prompt(loaded.tokenizer, p, raw=args.raw) for p in prompts]
    for ids in encoded:
        models.check_context(loaded.model, len(ids), args.max_new_tokens, 16)
    profile = None
    if config is not None and config.skip.size:
        if args.cost_profile:
            profile = CostProfile.load(args.cost_profile)
            profile.check_model(loaded.model)
        else:
            profile = profile_costs(loaded.model)
    rows = run_bench(loaded.model, encoded, args.max_new_tokens, loaded.model.generation_config.eos_token_id,
                     config=config, early_exit_layer=args.early_exit_layer,
                     prompt_lookup_tokens=args.prompt_lookup_tokens, repeats=args.repeats, profile=profile,
                     show_progress=not args.no_progress, compile=args.compile)
    print(format_table(rows))
    verdict = bench_verdict(rows)
    if verdict:
        print(verdict)
    settings = {"model": loaded.name_or_path, "device": str(loaded.device), "dtype": loaded.dtype_name,
                "dataset": args.dataset, "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                "repeats": args.repeats, "config": str(args.config) if args.config else None,
                "torch_threads": torch.get_num_threads()}
    json_path, png_path = write_outputs(rows, args.output_dir, settings)
    print(f"wrote {json_path} and {png_path}")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from .costs import profile_costs

    loaded = _load(args)
    profile = profile_costs(loaded.model, context_tokens=args.context_tokens, repeats=args.repeats)
    profile.save(args.output)
    print(f"one forward {profile.forward_s * 1e3:.2f} ms; each attention {profile.attn_s * 1e3:.3f} ms, each MLP "
          f"{profile.mlp_s * 1e3:.3f} ms, the rest (embeddings, norm, lm_head) {profile.rest_s * 1e3:.2f} ms; "
          f"verifying {len(profile.verify_s)} tokens {profile.verify_s[-1] * 1e3:.2f} ms")
    print(f"wrote {args.output}")
    return 0


def _add_prompt_flags(parser: argparse.ArgumentParser, num_prompts: int, max_new_tokens: int) -> None:
    from .data import BUILTIN

    data = parser.add_argument_group("prompts")
    data.add_argument("--dataset", default=BUILTIN,
                      help="'builtin' (32 prompts shipped), a local .json/.jsonl file, or a Hub dataset name")
    data.add_argument("--field", default="prompt", help="the dataset field holding the prompt text")
    data.add_argument("--split", default="train", help="the split of a Hub dataset")
    data.add_argument("--num-prompts", type=_positive_int, default=num_prompts, help="prompts to decode")
    data.add_argument("--max-new-tokens", type=_positive_int, default=max_new_tokens, help="tokens decoded per prompt")
    data.add_argument("--raw", action="store_true", help="tokenize prompts as is, without the chat template")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m skipsearch", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    formatter = argparse.ArgumentDefaultsHelpFormatter

    gen = commands.add_parser(
        "generate", help="decode one prompt with self-speculative decoding", formatter_class=formatter,
        description="Decode one prompt with self-speculative decoding (greedy output equals plain greedy decoding).",
    )
    gen.add_argument("--prompt", required=True, help="the user message")
    gen.add_argument("--raw", action="store_true", help="tokenize the prompt as is, without the chat template")
    gen.add_argument("--config", help="skip config JSON exported by `optimize` / `export`")
    gen.add_argument("--skip-attn", type=_int_list, default=None, help="attention layers to skip, e.g. 3,7")
    gen.add_argument("--skip-mlp", type=_int_list, default=None, help="MLP layers to skip, e.g. 12")
    gen.add_argument("--autoregressive", action="store_true", help="decode plainly through the same loop")
    gen.add_argument("--max-new-tokens", type=_positive_int, default=128, help="tokens to generate at most")
    gen.add_argument("--do-sample", action="store_true", help="sample (speculative rejection sampling) instead of greedy")
    gen.add_argument("--temperature", type=_positive_float, default=1.0, help="sampling temperature")
    gen.add_argument("--top-k", type=_positive_int, default=None, help="sample among the k most likely tokens")
    gen.add_argument("--top-p", type=_unit_float, default=None, help="nucleus sampling mass")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed")
    gen.add_argument("--json", action="store_true", help="print text, token ids and statistics as JSON")
    _add_draft_flags(gen)
    _add_model_flags(gen)
    gen.add_argument("--compile", action="store_true",
                     help="torch.compile the draft and verify steps (CUDA graphs on CUDA); the first call compiles")
    gen.set_defaults(run=cmd_generate)

    from .search import OBJECTIVES, SAMPLERS

    opt = commands.add_parser(
        "optimize", help="search for the skip set that decodes fastest", formatter_class=formatter,
        description="Run (or resume) an Optuna study over attention/MLP skip sets, export the best as JSON and "
                    "plot the study. Re-running the same command resumes the study up to --n-trials.",
    )
    _add_prompt_flags(opt, num_prompts=4, max_new_tokens=32)
    search = opt.add_argument_group("search")
    search.add_argument("--objective", choices=OBJECTIVES, default="speed_x_acceptance",
                        help="speedup x acceptance rate, speedup alone, both as a Pareto front, or the speedup "
                             "the cost model predicts from measured acceptance (deterministic)")
    search.add_argument("--cost-profile", type=Path, default=None,
                        help="with --objective modeled: a profile from `python -m skipsearch profile`, e.g. of a "
                             "GPU (default: profile this device when the study starts)")
    search.add_argument("--sampler", choices=SAMPLERS, default="tpe", help="Optuna sampler")
    search.add_argument("--n-trials", type=_positive_int, default=20,
                        help="finished trials the study should hold (a re-run resumes up to this)")
    search.add_argument("--timeout", type=_positive_float, default=None, help="stop after this many seconds")
    search.add_argument("--seed", type=int, default=0, help="seed of the sampler and of the prompt selection")
    search.add_argument("--skip-prior", type=_unit_float, default=0.15,
                        help="share of sublayers a uniform draw skips (0.5: the plain 2L-switch space)")
    search.add_argument("--max-skip-fraction", type=_unit_float, default=0.5, help="never skip more than this share")
    search.add_argument("--allow-first-last", action="store_true",
                        help="let the search skip sublayers of the first and last layers (kept by default)")
    search.add_argument("--min-match", type=_unit_float, default=0.5,
                        help="prune a skip set whose teacher-forced draft/full agreement is below this (0: never)")
    search.add_argument("--no-pruning", action="store_true", help="never stop a trial early (median pruner off)")
    search.add_argument("--no-warm-starts", action="store_true", help="do not enqueue the structured first trials")
    workers = opt.add_argument_group("workers and crash recovery (SQLite / PostgreSQL storages)")
    workers.add_argument("--heartbeat-interval", type=_positive_int, default=60,
                         help="seconds between a running trial's heartbeats")
    workers.add_argument("--heartbeat-grace", type=_positive_int, default=180,
                         help="seconds without a heartbeat after which a trial's worker is taken for dead, "
                              "its trial failed and retried")
    workers.add_argument("--max-retries", type=_non_negative_int, default=2,
                         help="times a dead worker's trial is retried")
    out = opt.add_argument_group("output")
    out.add_argument("--no-plots", action="store_true", help="do not write plots")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_study_flags(opt)
    _add_draft_flags(opt)
    _add_model_flags(opt)
    opt.add_argument("--compile", action="store_true",
                     help="torch.compile the draft and verify steps (CUDA graphs on CUDA); the first call compiles")
    opt.set_defaults(run=cmd_optimize)

    bench = commands.add_parser(
        "bench", help="compare skipsearch with HF greedy and its training-free peers", formatter_class=formatter,
        description="Decode the same prompts with HF greedy (the baseline), HF prompt lookup, HF early exit, "
                    "skipsearch plain and skipsearch with --config; print a table, write JSON and a bar chart.",
    )
    bench.add_argument("--config", type=Path, default=None, help="skip config JSON to benchmark")
    bench.add_argument("--early-exit-layer", type=_positive_int, default=None,
                       help="also run HF assistant_early_exit at this layer (LayerSkip-style)")
    bench.add_argument("--prompt-lookup-tokens", type=_non_negative_int, default=10,
                       help="HF prompt lookup decoding's n-gram draft length (0: leave it out)")
    bench.add_argument("--repeats", type=_positive_int, default=3, help="timed passes; the median is reported")
    bench.add_argument("--cost-profile", type=Path, default=None,
                       help="cost profile for the predicted speedup (default: profile this device)")
    bench.add_argument("--seed", type=int, default=0, help="seed of the prompt selection")
    bench.add_argument("--output-dir", type=Path, default=Path("studies/bench"), help="where bench.json/.png go")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_prompt_flags(bench, num_prompts=4, max_new_tokens=48)
    _add_model_flags(bench)
    bench.add_argument("--compile", action="store_true",
                       help="torch.compile the draft and verify steps (CUDA graphs on CUDA); the first call compiles")
    bench.set_defaults(run=cmd_bench)

    prof = commands.add_parser(
        "profile", help="measure the cost model of this device and save it as JSON", formatter_class=formatter,
        description="Time attention, MLP, the rest of a forward and verification of 1..9 tokens on this device "
                    "and dtype; `optimize --objective modeled --cost-profile` and `bench` read the file.",
    )
    prof.add_argument("--output", type=Path, default=Path("studies/cost-profile.json"), help="profile JSON to write")
    prof.add_argument("--context-tokens", type=_positive_int, default=128, help="cached tokens while timing")
    prof.add_argument("--repeats", type=_positive_int, default=20, help="timed runs per measurement (median)")
    _add_model_flags(prof)
    prof.set_defaults(run=cmd_profile)

    exp = commands.add_parser("export", help="write a trial's skip config as JSON", formatter_class=formatter,
                              description="Write the best trial (or --trial N) of a study as a skip-config JSON.")
    exp.add_argument("--trial", type=_non_negative_int, default=None, help="trial number (default: the best)")
    exp.add_argument("--output", type=Path, default=None, help="(default: <studies-dir>/<study-name>/best.json)")
    _add_study_flags(exp)
    exp.set_defaults(run=cmd_export)

    plot = commands.add_parser("plot", help="write the study's plots as PNG files", formatter_class=formatter,
                               description="Write optimization history, parameter importances, skip map, "
                                           "speedup vs skipped fraction (and the Pareto front) as PNG files.")
    plot.add_argument("--output", type=Path, default=None, help="(default: <studies-dir>/<study-name>/plots)")
    _add_study_flags(plot)
    plot.set_defaults(run=cmd_plot)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # The CLI prints its own progress; transformers' weight-loading bars would bury the one-line errors.
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # per-trial INFO lines would drown the progress bar
    try:
        return args.run(args)
    except ValueError as error:
        print(f"skipsearch {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"skipsearch {args.command}: interrupted", file=sys.stderr)
        return 130
