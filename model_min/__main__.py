"""Command line: ``python -m model_min generate --model DIR --prompt TEXT`` (or ``--prompt-ids``).

Prints the generated text (token ids for ``--prompt-ids`` without a tokenizer) as it is
committed, then one summary line: tokens, forwards, tokens per forward, p_cache, tok/s.

``python -m model_min demo`` decodes a few prompts with the shipped tiny model in every mode
and compares them (see ``model_min/demo.py``).
"""

import argparse
import shlex
import sys
import time
from pathlib import Path

import torch

from . import demo
from .generator import MODES, Generator, SamplingParams, parse_threshold
from .loader import load_model
from .run_info import device_info, utc_now, versions, write_json
from .tokenizer import chat_prompt, load_tokenizer

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
          "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def _ids(text: str) -> list[int]:
    return [int(t) for t in text.replace(" ", "").split(",") if t]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m model_min", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="decode one prompt with a checkpoint")
    gen.add_argument("--model", required=True, help="checkpoint directory (config.json + safetensors)")
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (needs tokenizer.json in --model)")
    prompt.add_argument("--prompt-ids", type=_ids, help="prompt token ids, e.g. 1,2,3")
    gen.add_argument("--chat", action="store_true", help="wrap --prompt in the Qwen chat template")
    gen.add_argument("--mode", choices=MODES, default="streaming")
    gen.add_argument("--window", type=int, default=16)
    gen.add_argument("--threshold", type=parse_threshold, default=0.4,
                     help="entropy threshold in nats, or 'none' for one token per step")
    gen.add_argument("--penalty", type=float, default=0.02)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop-ids", type=_ids, default=None,
                     help="stop token ids (default: the checkpoint's eos ids)")
    gen.add_argument("--ignore-eos", action="store_true", help="no stop tokens at all")
    gen.add_argument("--mask-token-id", type=int, default=None,
                     help="mask token id when config.json has no mask_token_id")
    gen.add_argument("--page-size", type=int, default=16)
    gen.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    gen.add_argument("--dtype", choices=["auto", *DTYPES], default="auto")
    gen.add_argument("--cuda-graph", action="store_true", help="capture the decode step (CUDA)")
    gen.add_argument("--json", type=Path, default=None, metavar="PATH",
                     help="also write the prompt, tokens, text and figures to PATH as JSON")
    demo.add_arguments(commands.add_parser(
        "demo", help="compare streaming, block-wise and AR decoding on the shipped tiny model",
        description=demo.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    return parser


def generate(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    dtype = None if args.dtype == "auto" else DTYPES[args.dtype]
    model = load_model(args.model, device=device, dtype=dtype)
    try:
        tokenizer = load_tokenizer(args.model)
    except ImportError:
        if args.prompt is not None:
            raise
        tokenizer = None  # token ids in, token ids out: no need for the tokenizers package
    if args.prompt is not None:
        if tokenizer is None:
            print(f"error: {args.model} has no tokenizer.json; use --prompt-ids", file=sys.stderr)
            return 2
        text = chat_prompt(args.prompt) if args.chat else args.prompt
        prompt = tokenizer.encode(text)
    else:
        prompt = args.prompt_ids
    if args.ignore_eos:
        stop_ids = ()
    elif args.stop_ids is not None:
        stop_ids = tuple(args.stop_ids)
    else:
        stop_ids = model.config.eos_token_ids
        if args.chat and tokenizer is not None:
            stop_ids += tuple(t for t in tokenizer.chat_stop_ids() if t not in stop_ids)
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, threshold=args.threshold, penalty=args.penalty, seed=args.seed,
        stop_token_ids=stop_ids,
    )
    generator = Generator(
        model, window=args.window, page_size=args.page_size, max_batch=1,
        tokenizer=tokenizer, mask_token_id=args.mask_token_id,
        max_cache_tokens=len(prompt) + max(args.max_new_tokens, 0) + args.window,
        cuda_graph=args.cuda_graph,
    )
    committed: list[int] = []
    printed = ""

    def show(_index: int, new_tokens: list[int]) -> None:
        nonlocal printed
        committed.extend(new_tokens)
        if tokenizer is None:
            print(" ".join(str(t) for t in new_tokens), end=" ", flush=True)
            return
        text = tokenizer.decode(committed)
        if text.startswith(printed):  # print only the new suffix (multi-byte safe)
            print(text[len(printed):], end="", flush=True)
            printed = text

    start = time.perf_counter()
    [result] = generator.generate([prompt], params, mode=args.mode, on_tokens=show)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    tokens = len(result.token_ids)
    print()
    print(
        f"tokens={tokens} forwards={result.forwards} tok/fwd={result.tokens_per_forward:.2f} "
        f"p_cache={result.p_cache:.3f} tok/s={tokens / seconds:.1f} "
        f"finish={result.finish_reason} mode={args.mode} seed={result.seed}"
    )
    if args.json is not None:
        write_json(args.json, {
            "benchmark": "model_min_generate", "date": utc_now(), "device": device_info(device),
            "versions": versions(), "command": "python -m model_min " + " ".join(
                shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
            "wall_time": f"time.perf_counter around the generate call, {device.type}",
            "settings": {key: value for key, value in vars(args).items()
                         if key not in ("command", "json", "prompt", "prompt_ids")},
            "prompt": args.prompt, "prompt_ids": prompt, "token_ids": result.token_ids,
            "text": result.text, "finish_reason": result.finish_reason,
            "forwards": result.forwards, "tokens_per_forward": result.tokens_per_forward,
            "p_cache": result.p_cache, "seed": result.seed, "seconds": seconds,
            "tokens_per_second": tokens / seconds if seconds > 0 else None,
        })
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        return demo.run(args)
    try:
        return generate(args, argv)
    except (ValueError, FileNotFoundError, ImportError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
