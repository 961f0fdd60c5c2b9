"""``inflight serve``: the OpenAI-compatible server (uvicorn, in this process) over one LLM.

The engine runs in this process on its worker thread; uvicorn's event loop runs the HTTP side.

SIGTERM (or Ctrl-C) drains: the server keeps listening but answers 503 to new requests (and to
``/health``, so a load balancer takes it out), lets the requests in flight finish for up to
``--drain-timeout`` seconds (then cancels the rest, which end with an error chunk), closes the
connections, shuts the engine down and exits 0. A second signal stops at once.

    python -m inflight.serve.server MODEL [--host 127.0.0.1 --port 8000 ...]   # = inflight serve MODEL
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading

logger = logging.getLogger("inflight.serve")


def build_llm(args):
    """The LLM of ``inflight serve``'s arguments."""
    from inflight import LLM, KvCacheConfig, SchedulerConfig

    kv = KvCacheConfig(max_tokens=args.kv_cache_max_tokens, free_memory_fraction=args.kv_cache_free_memory_fraction,
                       tokens_per_block=args.tokens_per_block, enable_block_reuse=not args.disable_block_reuse)
    sched = SchedulerConfig(capacity_scheduler_policy=args.capacity_scheduler_policy,
                            context_chunking_policy=args.context_chunking_policy)
    kwargs = {}
    if args.disable_overlap_scheduler:
        kwargs["disable_overlap_scheduler"] = True
    if args.device is not None:
        kwargs["device"] = args.device
    return LLM(args.model, dtype=args.dtype, kv_cache_config=kv, scheduler_config=sched,
               max_batch_size=args.max_batch_size, max_num_tokens=args.max_num_tokens, max_seq_len=args.max_seq_len,
               enable_chunked_prefill=args.enable_chunked_prefill, seed=args.seed,
               log_iteration_stats=args.log_iteration_stats, quantization=args.quantization, **kwargs)


def _served_names(args) -> tuple[str, tuple[str, ...]]:
    """The served model name (``--served-model-name``, else the model argument as given, like vLLM),
    plus the directory's base name as an alias when the model is a path."""
    name = args.served_model_name or str(args.model)
    aliases = []
    base = os.path.basename(os.path.normpath(str(args.model)))
    if base and base != name:
        aliases.append(base)
    return name, tuple(aliases)


def _make_server_class():
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn with a drain phase before its own graceful shutdown (see the module doc)."""

        def __init__(self, config, state, drain_timeout: float):
            super().__init__(config)
            self.state = state
            self.drain_timeout = drain_timeout
            self._loop: asyncio.AbstractEventLoop | None = None
            self._drain_task: asyncio.Task | None = None

        async def serve(self, sockets=None):
            self._loop = asyncio.get_running_loop()
            await super().serve(sockets)

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
            logger.info("signal %s: draining %d request(s) in flight (up to %.0f s); new requests get 503",
                        sig, self.state.in_flight, self.drain_timeout)
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


def make_server(app, host: str, port: int, *, drain_timeout: float = 30.0, log_level: str = "info",
                access_log: bool = True):
    """A uvicorn server for an app of :func:`~inflight.serve.app.build_app`, with the drain behaviour.
    ``server.run()`` blocks (signals are handled only in the main thread)."""
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                            lifespan="off", timeout_graceful_shutdown=10, timeout_keep_alive=5)
    return _make_server_class()(config, app.state.server, drain_timeout)


def _shutdown_llm(llm, timeout: float = 60.0) -> None:
    t = threading.Thread(target=llm.shutdown, name="inflight-shutdown", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        logger.error("the engine did not shut down within %.0f s", timeout)


def run_server(args) -> int:
    """``inflight serve``: builds the LLM, serves it until SIGTERM/SIGINT, drains, exits 0."""
    from inflight.serve.app import build_app

    if args.max_queue_size < 1:
        raise ValueError(f"--max-queue-size must be >= 1, got {args.max_queue_size}")
    if args.drain_timeout < 0:
        raise ValueError(f"--drain-timeout must be >= 0, got {args.drain_timeout}")
    llm = build_llm(args)
    try:
        name, aliases = _served_names(args)
        app = build_app(llm, name, args.max_queue_size, aliases=aliases)
        server = make_server(app, args.host, args.port, drain_timeout=args.drain_timeout,
                             log_level=args.uvicorn_log_level, access_log=not args.disable_access_log)
        logger.info("serving %s as %r on http://%s:%d (max_seq_len %d)", args.model, name, args.host, args.port,
                    llm.max_seq_len)
        server.run()
        if not server.started:
            return 1
    finally:
        _shutdown_llm(llm)
    logger.info("server stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    import argparse

    from inflight.serve.cli import add_serve_arguments

    parser = argparse.ArgumentParser(prog="python -m inflight.serve.server",
                                     description="OpenAI-compatible server (same as `inflight serve`)")
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"inflight serve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
