"""The ``pdserve`` command.

    pdserve generate [--model NAME] [--max-tokens N] [--temperature T] [--chat] PROMPT...
    pdserve gateway|conductor|prefill|decode|unified|cache-pool|planner [--config FILE]
            [--key value ...]
    pdserve keys --out DIR
    pdserve advise --workers N --slo-ttft-ms MS --slo-tpot-ms MS (--trace PATH | --rate R ...)

``pdserve keys`` writes a CURVE key pair per role into DIR (see docs/security.md);
point every process at it with ``curve_keys_dir`` (``PDSERVE_CURVE_KEYS_DIR``).

``pdserve advise`` simulates every deployment of N workers (colocated, each P:D split,
with and without the cache pool) on a workload and writes the best one's config
(services/advisor/cli.py).

Each service subcommand runs that process; ``pdserve SERVICE --help`` lists its settings.
"""

from __future__ import annotations

import argparse
import sys

from services.advisor import cli as advisor_cli


def _generate(args: argparse.Namespace) -> int:
    from common.sampling_params import SamplingParams
    from services.engine.config import EngineConfig
    from services.engine.engine import LLMEngine

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, seed=args.seed)
        engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype,
                                        kv_cache_bytes=args.kv_cache_mib << 20,
                                        quantization=args.quantization,
                                        kv_cache_dtype=args.kv_cache_dtype))
        prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}])
                   if args.chat else p for p in args.prompt]
        for done in engine.generate(prompts, params):
            print(engine.tokenizer.decode(done.token_ids))
    except (ValueError, FileNotFoundError) as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _keys(args: argparse.Namespace) -> int:
    from common.zmq_auth import generate_keys

    try:
        written = generate_keys(args.out)
    except OSError as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {len(written)} key files to {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SERVICES:
        sub.add_parser(name, help=f"run the {name} process", add_help=False)
    gen = sub.add_parser("generate", help="generate text offline with the engine")
    gen.add_argument("prompt", nargs="+")
    gen.add_argument("--model", default="smollm2-135m-instruct")
    gen.add_argument("--dtype", default="float32")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--kv-cache-mib", type=int, default=512)
    gen.add_argument("--quantization", default="none",
                     help="weights kept quantized on the CPU (int8, int4, w8a16, w4a16, ...)")
    gen.add_argument("--kv-cache-dtype", default="auto",
                     help="auto (the model's dtype), bfloat16 or int8 (CPU, float32 model)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    gen.set_defaults(func=_generate)
    keys = sub.add_parser("keys", help="write a CURVE key pair per role into a directory")
    keys.add_argument("--out", required=True, help="directory for the key files")
    keys.set_defaults(func=_keys)
    adv = sub.add_parser("advise", help="find the best deployment of N workers for a "
                         "workload under SLOs, on the simulator")
    advisor_cli.add_arguments(adv)
    adv.set_defaults(func=advisor_cli.run)
    return parser


def _run_service(name: str, argv: list[str]) -> int:
    if name == "gateway":
        from services.gateway.server import main as run
        return run(argv)
    if name == "conductor":
        from services.conductor.server import main as run
        return run(argv)
    if name == "cache-pool":
        from services.cache_pool.server import main as run
        return run(argv)
    if name == "planner":
        from services.planner.server import main as run
        return run(argv)
    from services.worker.server import main as run
    return run(argv, role=name)


SERVICES = ("gateway", "conductor", "prefill", "decode", "unified", "cache-pool", "planner")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SERVICES:
        return _run_service(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
