"""Command line: ``python -m model_min generate [--model DIR] --prompt TEXT`` (or
``--prompt-ids``; each may be given several times).

Prints the generated text (token ids for ``--prompt-ids`` without a tokenizer) as it is
committed, then one summary line per prompt: tokens, forwards, tokens per forward, p_cache,
tok/s. The model defaults to the shipped tiny demo model. A usage error (a bad option
value) exits 2, any other error 1, each with one line on stderr that names the option,
argument, file or key.

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
# a prompt this long prints a progress line before its prefill (on stderr)
LONG_PROMPT_TOKENS = 256


def _ids(text: str) -> list[int]:
    """``1,2,3`` as token ids (argparse type: a bad list is a usage error)."""
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated token ids such as 1,2,3, got {text!r}") from None
    if any(t < 0 for t in ids):
        raise argparse.ArgumentTypeError(f"token ids must be >= 0, got {text!r}")
    return ids


def _device(text: str) -> str:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N``, checked against this torch."""
    if text == "auto":
        return text
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r}: only cpu and cuda devices are supported")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = "without CUDA" if torch.version.cuda is None else "with CUDA, but no GPU"
            raise argparse.ArgumentTypeError(
                f"{text!r}: no CUDA device (torch {torch.__version__} was built {build})")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(
                f"{text!r}: there are {torch.cuda.device_count()} CUDA devices")
    return text


def _count(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value
    return parse


def _threshold(text: str) -> float | None:
    try:
        return parse_threshold(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number of nats or 'none', got {text!r}") from None


def _version() -> str:
    import wedlm_kernels

    return (f"model_min (wedlm_kernels {wedlm_kernels.__version__}, torch {torch.__version__})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m model_min", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=_version())
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser(
        "generate", help="decode prompts with a checkpoint",
        description="Decode one or more prompts (decoded together, as one batch).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    gen.add_argument("--model", type=Path, default=demo.DEMO_MODEL_DIR,
                     help="checkpoint directory (config.json, *.safetensors, tokenizer.json); "
                          "default: the shipped tiny demo model")
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", action="append",
                        help="prompt text (needs tokenizer.json in --model); repeat for more")
    prompt.add_argument("--prompt-ids", type=_ids, action="append",
                        help="prompt token ids, e.g. 1,2,3; repeat for more")
    gen.add_argument("--chat", action="store_true",
                     help="wrap each --prompt in the Qwen chat template")
    gen.add_argument("--mode", choices=MODES, default="streaming",
                     help="streaming parallel decoding, the block-wise baseline, or AR")
    gen.add_argument("--window", type=_count(1), default=16, help="decode window W (slots)")
    gen.add_argument("--window-policy", choices=["fixed", "adaptive"], default="fixed",
                     help="streaming: keep W slots, or size each window from what it commits "
                          "(docs/algorithm.md, 'The adaptive window')")
    gen.add_argument("--threshold", type=_threshold, default=0.4,
                     help="entropy threshold in nats, or 'none' for one token per step")
    gen.add_argument("--penalty", type=float, default=0.02,
                     help="distance penalty per position from the window's first mask")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--top-k", type=_count(0), default=0, help="0: off")
    gen.add_argument("--top-p", type=float, default=1.0, help="1: off")
    gen.add_argument("--max-new-tokens", type=_count(1), default=128,
                     help="tokens to generate per prompt at most")
    gen.add_argument("--seed", type=int, default=None,
                     help="sampling seed (default: a fresh one per request, printed)")
    gen.add_argument("--stop-ids", type=_ids, default=None,
                     help="stop token ids (default: the checkpoint's eos ids)")
    gen.add_argument("--ignore-eos", action="store_true", help="no stop tokens at all")
    gen.add_argument("--mask-token-id", type=_count(0), default=None,
                     help="mask token id when config.json has no mask_token_id")
    gen.add_argument("--page-size", type=_count(1), default=16, help="KV cache page size")
    gen.add_argument("--device", type=_device, default="auto",
                     help="auto (cuda when present), cpu, cuda or cuda:N")
    gen.add_argument("--dtype", choices=["auto", *DTYPES], default="auto",
                     help="auto: bf16 on CUDA, fp32 on the CPU")
    gen.add_argument("--cuda-graph", action="store_true", help="capture the decode step (CUDA)")
    gen.add_argument("--poll-every", type=_count(1), default=1,
                     help="decode steps between two looks of the host (and prints): 1 shows "
                          "tokens as they are committed, at one small readback per step")
    gen.add_argument("--no-progress", action="store_true",
                     help="no progress line on stderr before a long prefill")
    gen.add_argument("--json", type=Path, default=None, metavar="PATH",
                     help="also write the prompts, tokens, text and figures to PATH as JSON")
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
        prompts = [tokenizer.encode(chat_prompt(text) if args.chat else text)
                   for text in args.prompt]
    else:
        prompts = args.prompt_ids
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
        model, window=args.window, page_size=args.page_size, max_batch=len(prompts),
        tokenizer=tokenizer, mask_token_id=args.mask_token_id,
        max_cache_tokens=sum(len(p) + args.max_new_tokens + args.window for p in prompts),
        poll_every=args.poll_every, cuda_graph=args.cuda_graph,
        window_policy=args.window_policy,
    )
    several = len(prompts) > 1
    committed: list[list[int]] = [[] for _ in prompts]
    printed = [""] * len(prompts)
    start = time.perf_counter()
    longest = max(len(p) for p in prompts)
    waiting_for_prefill = longest >= LONG_PROMPT_TOKENS and not args.no_progress
    if waiting_for_prefill:
        print(f"prefill: {sum(len(p) for p in prompts)} prompt tokens on {device} ...",
              file=sys.stderr, flush=True)

    def show(index: int, new_tokens: list[int]) -> None:
        nonlocal waiting_for_prefill
        if waiting_for_prefill:
            print(f"prefill: done, first tokens after {time.perf_counter() - start:.1f} s",
                  file=sys.stderr, flush=True)
            waiting_for_prefill = False
        committed[index].extend(new_tokens)
        if several:  # several prompts: each is printed whole when it is done
            return
        if tokenizer is None:
            print(" ".join(str(t) for t in new_tokens), end=" ", flush=True)
            return
        text = tokenizer.decode(committed[index])
        if text.startswith(printed[index]):  # print only the new suffix (multi-byte safe)
            print(text[len(printed[index]):], end="", flush=True)
            printed[index] = text

    results = generator.generate(prompts, params, mode=args.mode, on_tokens=show)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    if not several:
        print()
    for index, result in enumerate(results):
        tokens = len(result.token_ids)
        if several:
            output = (result.text if tokenizer is not None
                      else " ".join(str(t) for t in result.token_ids))
            print(f"[{index}] {output}")
        print(
            f"{f'[{index}] ' if several else ''}tokens={tokens} forwards={result.forwards} "
            f"tok/fwd={result.tokens_per_forward:.2f} p_cache={result.p_cache:.3f} "
            f"tok/s={tokens / seconds:.1f} finish={result.finish_reason} mode={args.mode} "
            f"seed={result.seed}"
        )
    if args.json is not None:
        settings = {key: (str(value) if isinstance(value, Path) else value)
                    for key, value in vars(args).items()
                    if key not in ("command", "json", "prompt", "prompt_ids")}
        requests = [{
            "prompt": None if args.prompt is None else args.prompt[index],
            "prompt_ids": prompts[index], "token_ids": result.token_ids, "text": result.text,
            "finish_reason": result.finish_reason, "forwards": result.forwards,
            "tokens_per_forward": result.tokens_per_forward, "p_cache": result.p_cache,
            "seed": result.seed,
        } for index, result in enumerate(results)]
        write_json(args.json, {
            "benchmark": "model_min_generate", "date": utc_now(), "device": device_info(device),
            "versions": versions(), "command": "python -m model_min " + " ".join(
                shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
            "wall_time": f"time.perf_counter around the generate call, {device.type}",
            "settings": settings, **(requests[0] if not several else {}),
            "requests": requests, "seconds": seconds,
            "tokens_per_second": (sum(len(r.token_ids) for r in results) / seconds
                                  if seconds > 0 else None),
        })
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        return demo.run(args)
    try:
        return generate(args, argv)
    except (ValueError, TypeError, FileNotFoundError, ImportError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
