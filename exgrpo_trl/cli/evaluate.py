"""`exgrpo eval`: the paper's benchmarks, avg@k, and a table laid out like algorithm §10.

    exgrpo eval --model PATH_OR_HUB_ID \\
        --benchmarks aime24,aime25,amc,math500,minerva,olympiad,arc_c,gpqa_diamond,mmlu_pro

writes ``results.json``, ``results.md`` (the paper's rows beside this model's) and ``completions.jsonl`` into
``--output-dir`` and prints the table. What is graded and how: `exgrpo_trl.eval`.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..eval.generators import TransformersGenerator, VLLMGenerator, vllm_available
from ..eval.registry import (
    BENCHMARKS,
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_P,
    PAPER_BACKBONE,
    PAPER_REPORTED_AVERAGES,
    PAPER_RESULTS,
    load_benchmark,
)
from ..eval.report import evaluate_benchmark, markdown_table, summarize
from ..utils.requirements import MissingDependency, require

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------------
def parse_per_benchmark(text: str | None, cast: Callable[[str], Any], what: str) -> tuple[Any, dict[str, Any]]:
    """``"4"`` -> (4, {}); ``"aime24=32,amc=16"`` -> (None, {...}); ``"8,aime24=32"`` -> (8, {"aime24": 32})."""
    default, per = None, {}
    if text is None:
        return default, per
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue
        name, sep, value = part.partition("=")
        try:
            if sep:
                per[name.strip()] = cast(value.strip())
            else:
                default = cast(part)
        except ValueError as exc:
            raise ValueError(f"--{what}: cannot read {part!r} ({exc})") from exc
    return default, per


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="exgrpo eval",
        description="Evaluate a model on the ExGRPO paper's benchmarks (algorithm §9) and write results.json, "
        "results.md (laid out like the paper's table, its numbers beside yours) and completions.jsonl.",
    )
    parser.add_argument("--model", required=True, help="model folder or Hub id")
    parser.add_argument("--tokenizer", default=None, help="tokenizer to use instead of the model's")
    parser.add_argument("--revision", default=None)
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument(
        "--benchmarks",
        default=",".join(BENCHMARKS),
        help=f"comma-separated, of {', '.join(BENCHMARKS)} (default: all) or names given with --data",
    )
    parser.add_argument(
        "--data",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="read a benchmark from a local file of its Hub schema (repeatable); a NAME outside the "
        "registry adds a math benchmark with prompt/question/problem + answer columns",
    )
    parser.add_argument(
        "--data-dir", default=None, help="folder with local benchmark files NAME.jsonl/.json/.parquet/.csv"
    )
    parser.add_argument(
        "--samples",
        default=None,
        help="samples per question: N for all, or NAME=N,... (default: 32 for aime24, aime25, amc; 1 else)",
    )
    parser.add_argument("--temperature", default=str(DEFAULT_TEMPERATURE), help="T or NAME=T,... (default 0.6)")
    parser.add_argument("--top-p", default=str(DEFAULT_TOP_P), help="P or NAME=P,... (default 1.0)")
    parser.add_argument("--max-new-tokens", default=str(DEFAULT_MAX_NEW_TOKENS), help="N or NAME=N,... (default 8192)")
    parser.add_argument(
        "--limit", type=int, default=None, help="evaluate only the first N questions of each benchmark"
    )
    parser.add_argument(
        "--system-prompt", default=None, help="system prompt (default: LUFFY's, as in training; '' for none)"
    )
    parser.add_argument(
        "--require-think-end",
        action="store_true",
        help="grade like the training reward: a completion without </think> scores 0",
    )
    parser.add_argument(
        "--backend",
        choices=("auto", "transformers", "vllm"),
        default="auto",
        help="auto: vLLM if importable and a GPU is present, else transformers",
    )
    parser.add_argument("--dtype", default="auto", help="model dtype (auto, bfloat16, float16, float32)")
    parser.add_argument(
        "--device", default=None, help="transformers backend: device (default: cuda if available, else cpu)"
    )
    parser.add_argument("--batch-size", type=int, default=64, help="transformers backend: sequences per generate call")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="vLLM")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="vLLM")
    parser.add_argument("--max-model-len", type=int, default=None, help="vLLM")
    parser.add_argument(
        "--vllm-kwargs", default=None, help="vLLM: more vllm.LLM arguments as JSON, e.g. '{\"enforce_eager\": true}'"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default=None, help="default: eval_results/<model folder name>")
    parser.add_argument("--name", default=None, help="row label in the table (default: the model's folder name)")
    parser.add_argument("--no-completions", action="store_true", help="do not write completions.jsonl")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _resolve_dtype(dtype: str):
    if dtype == "auto":
        return "auto"
    import torch

    resolved = getattr(torch, dtype, None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return resolved


def make_generator(args: argparse.Namespace, tokenizer):
    """The generation backend the arguments ask for: (generator, backend name)."""
    backend = args.backend
    if backend == "auto":
        backend = "vllm" if vllm_available() else "transformers"
    if backend == "vllm":
        generator = VLLMGenerator(
            args.model,
            tokenizer,
            tokenizer_path=args.tokenizer,
            dtype=args.dtype,
            tensor_parallel_size=args.tensor_parallel_size,
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_model_len=args.max_model_len,
            seed=args.seed,
            revision=args.revision,
            trust_remote_code=args.trust_remote_code,
            progress=not args.no_progress,
            llm_kwargs=json.loads(args.vllm_kwargs) if args.vllm_kwargs else None,
        )
        return generator, backend
    import torch
    from transformers import AutoModelForCausalLM

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    kwargs = {"dtype": _resolve_dtype(args.dtype), "trust_remote_code": args.trust_remote_code}
    if args.revision:
        kwargs["revision"] = args.revision
    model = AutoModelForCausalLM.from_pretrained(args.model, **kwargs).to(device)
    model.eval()
    return TransformersGenerator(model, tokenizer, batch_size=args.batch_size, progress=not args.no_progress), backend


def run_evaluation(args: argparse.Namespace, generator=None, tokenizer=None) -> dict[str, Any]:
    """Everything `main` does after parsing; `generator` / `tokenizer` may be given (tests, notebooks)."""
    local = {}
    for item in args.data:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--data expects NAME=PATH, got {item!r}")
        local[name.strip()] = path.strip()
    names = [n.strip() for n in args.benchmarks.split(",") if n.strip()]
    if not names:
        raise ValueError("--benchmarks is empty")
    for n in names:
        if n not in BENCHMARKS and n not in local:
            raise ValueError(
                f"unknown benchmark {n!r}: use {', '.join(BENCHMARKS)} or give it a file with --data {n}=PATH"
            )
    samples_default, samples_per = parse_per_benchmark(args.samples, int, "samples")
    temp_default, temp_per = parse_per_benchmark(args.temperature, float, "temperature")
    top_p_default, top_p_per = parse_per_benchmark(args.top_p, float, "top-p")
    tokens_default, tokens_per = parse_per_benchmark(args.max_new_tokens, int, "max-new-tokens")
    for option, per in (
        ("samples", samples_per),
        ("temperature", temp_per),
        ("top-p", top_p_per),
        ("max-new-tokens", tokens_per),
    ):
        unknown = sorted(set(per) - set(names))
        if unknown:
            raise ValueError(f"--{option} names benchmark(s) {unknown} that are not evaluated ({names})")

    benchmarks = [
        load_benchmark(n, local.get(n), system_prompt=args.system_prompt, limit=args.limit, data_dir=args.data_dir)
        for n in names
    ]
    if tokenizer is None:
        from ..utils.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(
            args.tokenizer or args.model, revision=args.revision or "main", trust_remote_code=args.trust_remote_code
        )
    backend = getattr(generator, "backend_name", type(generator).__name__) if generator is not None else None
    if generator is None:
        generator, backend = make_generator(args, tokenizer)

    label = args.name or Path(str(args.model).rstrip("/")).name
    output_dir = Path(args.output_dir or Path("eval_results") / label)
    output_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    all_records: list[dict[str, Any]] = []

    def pick(per: dict[str, Any], default: Any, fallback: Any, name: str) -> Any:
        return per.get(name, default if default is not None else fallback)

    for bench in benchmarks:
        result, records = evaluate_benchmark(
            bench,
            generator,
            tokenizer,
            samples=pick(samples_per, samples_default, bench.samples, bench.name),
            temperature=pick(temp_per, temp_default, DEFAULT_TEMPERATURE, bench.name),
            top_p=pick(top_p_per, top_p_default, DEFAULT_TOP_P, bench.name),
            max_new_tokens=pick(tokens_per, tokens_default, DEFAULT_MAX_NEW_TOKENS, bench.name),
            seed=args.seed,
            require_think_end=args.require_think_end,
        )
        results[bench.name] = result
        all_records.extend(records)
        logger.info("%s: %s = %.1f", bench.name, result["metric"], result["score"])

    from .. import __version__

    report = {
        "model": args.model,
        "label": label,
        "backend": backend,
        "exgrpo_trl_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "seed": args.seed,
        "system_prompt": "luffy" if args.system_prompt is None else args.system_prompt,
        "require_think_end": args.require_think_end,
        "limit": args.limit,
        "benchmarks": results,
        "averages": summarize(results),
        "paper": {"backbone": PAPER_BACKBONE, "results": PAPER_RESULTS, "reported_averages": PAPER_REPORTED_AVERAGES},
    }
    table = markdown_table(results, label)
    settings = ", ".join(
        f"{r['title']}: k={r['samples']}, T={r['temperature']}, top-p={r['top_p']}, max {r['max_new_tokens']} tokens"
        for r in results.values()
    )
    graded = (
        "completions without </think> score 0"
        if args.require_think_end
        else "graded after the last </think> when present, else the whole completion"
    )
    markdown = (
        f"# Evaluation of `{args.model}`\n\n{table}\n"
        f"Backend: {backend}; seed {args.seed}; {graded}."
        f"\n\nSettings: {settings}.\n"
    )
    (output_dir / "results.json").write_text(json.dumps(_json_safe(report), indent=2, ensure_ascii=False) + "\n")
    (output_dir / "results.md").write_text(markdown)
    if not args.no_completions:
        with open(output_dir / "completions.jsonl", "w") as f:
            for record in all_records:
                f.write(json.dumps(_json_safe(record), ensure_ascii=False) + "\n")
    report["output_dir"] = str(output_dir)
    report["markdown"] = markdown
    return report


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``exgrpo eval ARGS`` and ``python -m exgrpo_trl.cli.evaluate ARGS``."""
    args = build_arg_parser().parse_args(argv)
    try:  # before the model loads: grading comes after hours of generation
        require("math_verify", "exgrpo eval")
        if args.backend == "vllm":
            require("vllm", "exgrpo eval --backend vllm")
    except MissingDependency as e:
        print(f"exgrpo eval: error: {e}", file=sys.stderr)
        return 1
    logging.basicConfig(level=logging.INFO, format="%(asctime)s - %(levelname)s - %(name)s - %(message)s")
    report = run_evaluation(args)
    print(report["markdown"])
    written = "results.json, results.md" + ("" if args.no_completions else ", completions.jsonl")
    print(f"Wrote {written} to {report['output_dir']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
