"""``inflight serve``: the OpenAI-compatible server (uvicorn, in this process) over one LLM.

This module owns the command: :func:`add_parser` mounts it on ``inflight``'s subcommands,
:func:`add_arguments` gives its options (the model, the server's own options, and every engine
option of :class:`~inflight.llm_args.LlmArgs` through :func:`~inflight.llm_args.add_cli_arguments`)
and :func:`run` runs it. The engine runs in this process on its worker thread; uvicorn's event loop
runs the HTTP side (the app: :mod:`inflight.serve.app`).

SIGTERM (or Ctrl-C) drains: the server keeps listening but answers 503 to new requests (and to
``/health``, so a load balancer takes it out), lets the requests in flight finish for up to
``--drain-timeout`` seconds (then cancels the rest, which end with an error chunk), closes the
connections, shuts the engine down and exits 0. A second signal stops at once.

    python -m inflight.serve.server MODEL [--host 127.0.0.1 --port 8000 ...]   # = inflight serve MODEL

Nothing here imports FastAPI or uvicorn at module level (they are the optional ``serve`` extra), so
that ``inflight --help`` works without them.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import threading

import torch

from inflight.llm import LLM
from inflight.llm_args import LlmArgs, add_cli_arguments
from inflight.serve.extras import SERVE_MODULES, require_extra
from inflight.serve.limits import DEFAULT_MAX_REQUEST_BYTES

# The token budget of a serving step: it bounds how long one long prompt's chunk holds up everyone's
# decode. vLLM's 2048 on a GPU; on a CPU a step costs ~4 ms per prompt token late in an 8k-token prompt
# (SmolLM2-135M, 2 cores), so 2048 would freeze a stream for ~8 s and 256 keeps it under ~1 s for ~3 %
# on the long prompt's time to first token (benchmarks/bench_stall.py).
SERVE_TOKEN_BUDGET = {"cuda": 2048, "cpu": 256}


def serve_defaults() -> dict:
    """A public server's engine defaults, where they differ from LlmArgs' (which are the offline ones):
    chunked prefill with a serving token budget (by the machine: CUDA when available, else CPU), so
    that one long prompt is prefilled a chunk per step beside everyone's decodes instead of freezing
    them for its whole prefill; and a bound on the tokens one request may ask for (n x max_tokens)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return {
        "enable_chunked_prefill": True,
        "max_num_tokens": SERVE_TOKEN_BUDGET[device],
        "max_request_tokens": 1 << 18,
    }


SERVE_DEFAULTS = serve_defaults()

logger = logging.getLogger("inflight.serve")

_DEFAULT_MODEL = "smollm2"


# ---------------------------------------------------------------------------------------------- arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``inflight serve`` (also of ``python -m inflight.serve.server``)."""
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help=f"a Hugging Face model directory, a .gguf file, or a known name (default: {_DEFAULT_MODEL})",
    )
    parser.add_argument("--model", dest="model_flag", default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the model id clients use (default: the model argument as given; a directory's base "
        "name is accepted too)",
    )
    repo = parser.add_argument_group("model repository (Triton's; instead of MODEL)")
    repo.add_argument(
        "--model-repository",
        default=None,
        metavar="DIR",
        help="serve every model of DIR: one subdirectory per model, configured by Triton's config.pbtxt "
        "(or config.json); the engine options below are every model's defaults",
    )
    repo.add_argument(
        "--model-control-mode",
        default="none",
        choices=("none", "explicit"),
        help="none: load every model at start-up, refuse load/unload; explicit: load the --load-model "
        "ones, then what /v2/repository/models/{m}/load asks for (default none)",
    )
    repo.add_argument(
        "--load-model",
        action="append",
        default=[],
        metavar="NAME",
        help="with --model-control-mode explicit: a model to load at start-up (repeatable; * for all)",
    )
    net = parser.add_argument_group("server")
    net.add_argument("--host", default="127.0.0.1")
    net.add_argument("--port", type=int, default=8000)
    net.add_argument(
        "--grpc-port",
        type=int,
        default=8001,
        help="Triton's gRPC API (KServe v2) on this port, same host (default 8001; -1: off). Needs "
        "tritonclient[grpc]; a port that cannot be bound is logged and the HTTP API serves on",
    )
    net.add_argument(
        "--max-queue-size",
        type=int,
        default=1024,
        metavar="N",
        help="most requests in flight (running or waiting); more get 503 at once (default 1024)",
    )
    net.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM, seconds to let requests in flight finish before cancelling them (default 30)",
    )
    net.add_argument(
        "--health-stall-timeout",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="/health answers 503 when the engine has had work pending and finished no step for this long "
        "(default 120)",
    )
    net.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        metavar="BYTES",
        help="largest request body; a larger one gets 413 before it is read whole (default 64 MiB; 0: no limit)",
    )
    net.add_argument("--disable-access-log", action="store_true", help="no log line per HTTP request")
    net.add_argument(
        "--no-web",
        dest="web",
        action="store_false",
        help="no chat page (/) and no dashboard (/dashboard); the API routes are the same either way",
    )
    net.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
    )
    add_cli_arguments(parser, "engine", defaults=SERVE_DEFAULTS)
    parser.set_defaults(func=run)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Mounts ``serve`` on a command's subparsers (``inflight serve``)."""
    p = subparsers.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (completions, chat, metrics)",
        description="Serve a model over an OpenAI-compatible HTTP API.",
    )
    add_arguments(p)
    return p


def _model(args) -> str:
    """The model of the positional argument or the hidden ``--model`` alias (not both, unless equal)."""
    if args.model is None:
        return args.model_flag or _DEFAULT_MODEL
    if args.model_flag is not None and args.model_flag != args.model:
        raise ValueError(f"the model is given twice: {args.model!r} and --model {args.model_flag!r}")
    return args.model


def _served_names(model: str, served_model_name: str | None) -> tuple[str, tuple[str, ...]]:
    """The served model name (``--served-model-name``, else the model argument as given, like vLLM),
    plus the directory's base name as an alias when the model is a path."""
    name = served_model_name or model
    aliases = []
    base = os.path.basename(os.path.normpath(model))
    if base and base != name:
        aliases.append(base)
    return name, tuple(aliases)


def _make_server_class():
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn with a drain phase before its own graceful shutdown (see the module doc)."""

        def __init__(self, config, models, drain_timeout: float, grpc_port: int | None = None):
            super().__init__(config)
            self.state = models  # the ModelSet: draining, in_flight, abort_all over every model
            self.drain_timeout = drain_timeout
            self.grpc_port = grpc_port  # asked for (0: any free port); the bound one once serving
            self.grpc_server = None
            self._loop: asyncio.AbstractEventLoop | None = None
            self._drain_task: asyncio.Task | None = None

        async def serve(self, sockets=None):
            self._loop = asyncio.get_running_loop()
            if self.grpc_port is not None and self.grpc_port >= 0:
                await self._start_grpc()
            try:
                await super().serve(sockets)
            finally:
                if self.grpc_server is not None:
                    await self.grpc_server.stop(grace=5)

        async def _start_grpc(self) -> None:
            """Triton's gRPC API beside the HTTP one, on this event loop (one ModelSet for both)."""
            try:
                from inflight.serve.kserve_grpc import start_grpc
            except ImportError as exc:
                logger.warning("gRPC API off: %s (pip install 'tritonclient[grpc]')", exc)
                return
            try:
                limit = getattr(self.config.app.state, "max_request_bytes", None)
                self.grpc_server, self.grpc_port = await start_grpc(
                    self.state, self.config.host, self.grpc_port, limit
                )
            except (OSError, RuntimeError) as exc:
                logger.warning("gRPC API off: %s", exc)
                return
            logger.info("Triton gRPC API on %s:%d", self.config.host, self.grpc_port)

        def handle_exit(self, sig, frame) -> None:
            # Not uvicorn's: it re-raises the captured signal after serving, which would make a clean
            # drain exit with -SIGTERM instead of 0.
            if self.state.draining or self.should_exit or self._loop is None:
                self.should_exit = True
                self.force_exit = True
                if self._loop is not None:
                    self._loop.call_soon_threadsafe(self.state.abort_all)
                return
            self.state.draining = True
            self._loop.call_soon_threadsafe(self._start_drain, sig)

        def _start_drain(self, sig) -> None:
            self._drain_task = asyncio.ensure_future(self._drain(sig))

        async def _drain(self, sig) -> None:
            loop = asyncio.get_running_loop()
            logger.info(
                "signal %s: draining %d request(s) in flight (up to %.0f s); new requests get 503",
                sig,
                self.state.in_flight,
                self.drain_timeout,
            )
            deadline = loop.time() + self.drain_timeout
            while self.state.in_flight > 0 and loop.time() < deadline and not self.force_exit:
                await asyncio.sleep(0.05)
            if self.state.in_flight > 0:
                logger.warning("drain timeout: cancelling %d request(s)", self.state.abort_all())
                deadline = loop.time() + 5.0
                while self.state.in_flight > 0 and loop.time() < deadline:
                    await asyncio.sleep(0.05)
            logger.info("drained; shutting down")
            self.should_exit = True

    return DrainingServer


def make_server(
    app,
    host: str,
    port: int,
    *,
    drain_timeout: float = 30.0,
    log_level: str = "info",
    access_log: bool = True,
    grpc_port: int | None = None,
):
    """A uvicorn server for an app of :func:`~inflight.serve.app.build_app`, with the drain behaviour,
    and Triton's gRPC API on ``grpc_port`` (None or -1: off; 0: any free port, ``server.grpc_port``
    once started). ``server.run()`` blocks (signals are handled only in the main thread)."""
    import uvicorn

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=access_log,
        lifespan="off",
        timeout_graceful_shutdown=10,
        timeout_keep_alive=5,
    )
    return _make_server_class()(config, app.state.models, drain_timeout, grpc_port)


def _server_for(app, args):
    """make_server with the command line's server options."""
    return make_server(
        app,
        args.host,
        args.port,
        drain_timeout=args.drain_timeout,
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_access_log,
        grpc_port=args.grpc_port,
    )


def _shutdown_llm(llm, timeout: float = 60.0) -> None:
    t = threading.Thread(target=llm.shutdown, name="inflight-shutdown", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        logger.error("the engine did not shut down within %.0f s", timeout)


def _body_limit(args) -> int | None:
    if args.max_request_bytes < 0:
        raise ValueError(f"--max-request-bytes must be >= 0 (0: no limit), got {args.max_request_bytes}")
    return args.max_request_bytes or None


def run(args) -> int:
    """``inflight serve``: builds the LLM, serves it until SIGTERM/SIGINT, drains, exits 0."""
    require_extra(SERVE_MODULES, "serve")
    # The app imports FastAPI (the optional `serve` extra), hence this import here, not at the top.
    from inflight.serve.app import build_app

    if args.max_queue_size < 1:
        raise ValueError(f"--max-queue-size must be >= 1, got {args.max_queue_size}")
    if args.drain_timeout < 0:
        raise ValueError(f"--drain-timeout must be >= 0, got {args.drain_timeout}")
    _body_limit(args)  # a bad value fails before any model loads
    if args.model_repository is not None:
        return _run_repository(args)
    if args.load_model or args.model_control_mode != "none":
        raise ValueError("--model-control-mode and --load-model need --model-repository")
    model = _model(args)
    llm = LLM(**LlmArgs.from_cli(args, model=model).to_kwargs())
    try:
        name, aliases = _served_names(model, args.served_model_name)
        app = build_app(
            llm,
            name,
            args.max_queue_size,
            aliases=aliases,
            stall_timeout=args.health_stall_timeout,
            web=args.web,
            max_request_bytes=_body_limit(args),
        )
        server = _server_for(app, args)
        logger.info(
            "serving %s as %r on http://%s:%d (max_seq_len %d)",
            model,
            name,
            args.host,
            args.port,
            llm.max_seq_len,
        )
        if args.web:
            logger.info(
                "chat page http://%s:%d/ , engine dashboard http://%s:%d/dashboard",
                args.host,
                args.port,
                args.host,
                args.port,
            )
        server.run()
        if not server.started:
            return 1
    finally:
        _shutdown_llm(llm)
    logger.info("server stopped")
    return 0


def _run_repository(args) -> int:
    """``inflight serve --model-repository DIR``: every model of DIR (serve/repository.py)."""
    from inflight import __version__
    from inflight.llm import _ensure_logging
    from inflight.serve.app import build_models_app
    from inflight.serve.repository import ModelRepository

    _ensure_logging()  # the repository logs before any engine exists

    if args.model is not None or args.model_flag is not None or args.served_model_name is not None:
        raise ValueError(
            "--model-repository serves the repository's models: give no MODEL or --served-model-name"
        )
    if args.load_model and args.model_control_mode != "explicit":
        raise ValueError("--load-model needs --model-control-mode explicit (mode none loads every model)")
    repository = ModelRepository(
        args.model_repository,
        LlmArgs.from_cli(args),
        control_mode=args.model_control_mode,
        version=__version__,
        max_queue_size=args.max_queue_size,
        stall_timeout=args.health_stall_timeout,
    )
    try:
        repository.load_at_startup(args.load_model)
        app = build_models_app(repository, web=args.web, max_request_bytes=_body_limit(args))
        server = _server_for(app, args)
        logger.info(
            "serving the model repository %s on http://%s:%d (%s ready)",
            args.model_repository,
            args.host,
            args.port,
            ", ".join(s.model_name for s in repository.serving()) or "none",
        )
        server.run()
        if not server.started:
            return 1
    finally:
        repository.close()
    logger.info("server stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m inflight.serve.server",
        description="OpenAI-compatible server (same as `inflight serve`)",
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"inflight serve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
