"""`rlengine serve`: its options and the command that checks them, builds the engine and runs the server
(rlengine/serve/; FastAPI and uvicorn come with the serve extra, and without them the command says so)."""

from __future__ import annotations

import os
import sys


def add_serve_parser(sub, add_model_args, add_tokenizer_args) -> None:
    """The `serve` subcommand on the CLI's subparsers (the model and tokenizer options are the shared ones)."""
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server on the engine (needs the serve extra)",
                       description="/v1/completions, /v1/chat/completions, /v1/models, /health and /metrics on "
                       "one engine loop (continuous batching across requests). Stops gracefully on SIGTERM / "
                       "SIGINT. The API key may also come from RLENGINE_API_KEY.")
    add_model_args(p)
    add_tokenizer_args(p)
    p.add_argument("--seed", type=int, default=0, help="the engine's seed (requests without one draw from it)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default: %(default)s)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but /health")
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="B_gen: sequences in flight (default: %(default)s)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="batch-invariant kernels: a request's output does not depend on what else is batched (CPU)")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds requests in flight get to finish after SIGTERM / SIGINT (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="CPU: torch.set_num_threads (default: torch's)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    """`rlengine serve`: an OpenAI-compatible HTTP server on one engine (rlengine.serve; the serve extra)."""
    import importlib.util

    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"rlengine serve: error: needs the serve extra ({' and '.join(missing)} missing): "
              "pip install 'rlengine[serve]'", file=sys.stderr)
        return 2
    from rlengine.engine import LLM
    from rlengine.model.config import ConfigError
    from rlengine.model.factory import tokenizer_for
    from rlengine.plan.preflight import check_device, check_model
    from rlengine.serve.server import serve

    check_device(args.device, "--device")
    check_model(args.model, "--model", args.revision)
    tokenizer_for(args.model, revision=args.revision, tokenizer=args.tokenizer, what="--tokenizer")
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in [0, 65535], got {args.port}")
    if args.shutdown_timeout < 0:
        raise ConfigError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    if args.threads is not None:
        if args.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    try:
        llm = LLM(model=args.model, dtype=args.dtype, device=args.device, tokenizer=args.tokenizer,
                  revision=args.revision, seed=args.seed, max_num_seqs=args.max_num_seqs,
                  max_model_len=args.max_model_len, batch_invariant=args.batch_invariant, lora_path=args.lora_path)
    except ValueError as exc:
        raise ConfigError(f"{exc} (check --max-num-seqs / --max-model-len / --batch-invariant)") from None
    return serve(llm, model_name=args.served_model_name or args.model, host=args.host, port=args.port,
                 api_key=args.api_key or os.environ.get("RLENGINE_API_KEY") or None,
                 shutdown_timeout=args.shutdown_timeout, log_level=args.log_level, access_log=args.access_log)
