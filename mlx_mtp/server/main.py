"""``mlx-mtp serve``: arguments, model loading, and the uvicorn server around ``app``."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import threading
from pathlib import Path

import mlx.core as mx
import uvicorn

from ..decode import MAX_DRAFT_TOKENS
from ..models.io.layout import text_config
from ..models.distributed import distributed_group
from ..models.io.loader import generation_defaults, load_config, resolve_model_path
from ..options import (UserError, add_model_arguments, add_sampling_arguments,
                       drafting_from_args, load_from_args, parse_json_arg, sampling_defaults,
                       sampling_from_args)
from .app import create_app
from .distributed import LeaderSync, run_follower
from .engine import Engine
from .http_guard import (LOCAL_HOST_NAMES, GuardConfig, add_cors, host_name as host_name_of,
                         is_loopback, split_list, timed_http_protocol)
from .memory_budget import MAX_WAIT_SECONDS, MemoryBudget, parse_memory_budget
from .metrics import ServerMetrics
from .prefix_cache import PrefixCache
from .state import ServerState, max_token_chars

log = logging.getLogger("mlx_mtp.server")


def _size(text: str) -> int:
    """'2G', '512M', '1000000' -> bytes."""
    t = str(text).strip().upper().rstrip("B").rstrip("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    try:
        if t and t[-1] in mult:
            return int(float(t[:-1]) * mult[t[-1]])
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 512M, 2G, 1000000)")


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"not a positive number of seconds: {text!r}")
    return value


def _memory_budget(text: str) -> int:
    try:
        return parse_memory_budget(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e))


def _add_memory_arguments(p):
    """What the server may hold in memory: the budget, and the prompt cache in memory and on
    disk."""
    p.add_argument("--memory-budget", type=_memory_budget, default=None, metavar="GB",
                   help="KV and state memory the running requests, the prompt cache and its "
                        "sessions may hold: GB (e.g. 12), a fraction of the RAM (e.g. 0.6) or "
                        "a size (e.g. 512M). "
                        "Requests that do not fit wait in the queue; 429 when one never could "
                        "(default: none)")
    p.add_argument("--memory-budget-wait", type=_positive_seconds, default=MAX_WAIT_SECONDS,
                   metavar="SECONDS",
                   help="How long a request may wait for room under --memory-budget before "
                        f"it is answered 429 with Retry-After (default {MAX_WAIT_SECONDS:.0f})")
    p.add_argument("--prompt-cache-size", type=int, default=32,
                   help="Maximum number of prompt-prefix states kept (0 disables; default 32)")
    p.add_argument("--prompt-cache-bytes", type=_size, default=2 << 30,
                   help="Maximum memory of the prompt-prefix cache (default 2G)")
    p.add_argument("--prompt-cache-dir", default=None, metavar="DIR",
                   help="Also keep prompt-prefix states of long prompts in DIR, so a restarted "
                        "server resumes conversations without recomputing them")
    p.add_argument("--prompt-cache-disk-bytes", type=_size, default=10 << 30, metavar="N",
                   help="Size bound of --prompt-cache-dir, least recently used out (default 10G)")
    p.add_argument("--prompt-cache-min-tokens", type=int, default=1024, metavar="N",
                   help="Only prefixes of at least N tokens go to disk (default 1024)")
    p.add_argument("--prompt-cache-key", default=None, metavar="FILE",
                   help="Prove --prompt-cache-dir entries by an HMAC under the secret in FILE "
                        "(made 0600 if missing; outside that directory); others are deleted")


def add_arguments(p):
    add_model_arguments(p, server=True)
    p.add_argument("--host", default="127.0.0.1", help="Address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="Port (default 8080)")
    add_sampling_arguments(p)
    p.add_argument("--max-tokens", "-m", type=int, default=512,
                   help="Default max_tokens of a request (default 512)")
    p.add_argument("--chat-template", default=None,
                   help="Chat template to use instead of the model's (a file or a Jinja string)")
    p.add_argument("--chat-template-args", default=None,
                   help='JSON passed to the chat template, e.g. \'{"enable_thinking": true}\' '
                        "(requests may override with chat_template_kwargs)")
    p.add_argument("--max-kv-size", "--max-model-len", type=int, default=None,
                   dest="max_kv_size",
                   help="Context limit in tokens (prompt + completion); default: the model's "
                        "max_position_embeddings")
    p.add_argument("--prefill-step-size", type=int, default=512,
                   help="Largest prompt chunk run in one scheduler iteration (default 512)")
    p.add_argument("--max-num-batched-tokens", type=int, default=128,
                   dest="max_batched_tokens",
                   help="Token budget of a scheduler iteration while streams decode (vLLM's "
                        "chunked prefill): their rows' tokens first, prompts get the rest, "
                        "at least 64 (default 128; larger: faster prompts, slower streams)")
    p.add_argument("--max-concurrency", "--decode-concurrency", type=int, default=16,
                   dest="max_concurrency",
                   help="Maximum number of requests in the running batch (default 16)")
    p.add_argument("--max-queue", type=int, default=1024,
                   help="Maximum number of waiting requests before answering 503 (default 1024)")
    _add_memory_arguments(p)
    p.add_argument("--api-key", default=os.environ.get("MLX_MTP_API_KEY"),
                   help="Require 'Authorization: Bearer KEY' (default: $MLX_MTP_API_KEY)")
    p.add_argument("--protect-metrics", action="store_true",
                   help="/metrics requires the API key too (default: open, like /health)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="Model name(s) in the API (default: the model directory's name)")
    p.add_argument("--reasoning-parser", choices=["qwen3", "none"], default="qwen3",
                   help="Split <think>...</think> into a reasoning field (default qwen3)")
    p.add_argument("--reasoning-field", choices=["reasoning_content", "reasoning", "both"],
                   default="reasoning_content",
                   help="Name of the reasoning field in responses (default reasoning_content)")
    p.add_argument("--tool-call-parser", choices=["auto", "hermes", "qwen3_coder", "none"],
                   default="auto",
                   help="Tool-call format; auto accepts both Hermes JSON and Qwen3-Coder XML")
    p.add_argument("--allowed-origins", nargs="*", default=None,
                   help="Comma-separated origins allowed to call the server from a browser "
                        "(CORS), '*' for any (default: none; without --api-key, requests from "
                        "other origins are refused)")
    p.add_argument("--allowed-hosts", nargs="*", default=None,
                   help="Comma-separated Host names accepted, '*' for any (default: local "
                        "names on a loopback --host, any otherwise)")
    p.add_argument("--max-request-bytes", type=_size, default=16 << 20,
                   help="Largest request body accepted (default 16M; larger: 413)")
    p.add_argument("--read-timeout", type=float, default=30.0,
                   help="Seconds a client may take to send a request's headers, and again "
                        "its body (default 30)")
    p.add_argument("--timeout-keep-alive", type=float, default=5.0,
                   help="Seconds an idle kept-alive connection stays open (default 5)")
    p.add_argument("--log-level", default="INFO",
                   choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                   type=str.upper)
    p.add_argument("--log-interval", type=float, default=10.0,
                   help="Seconds between throughput/acceptance log lines (0 disables)")
    p.add_argument("--distributed-timeout", type=float, default=120.0,
                   help="Under mlx.launch: seconds without an answer from another rank "
                        "before it counts as lost (requests then fail with 503; default 120)")
    p.add_argument("--shutdown-timeout", type=float, default=5.0,
                   help="Seconds to wait for open connections on shutdown (default 5)")


def _read_template(value: str) -> str:
    """A template file's contents, or the argument itself (an inline Jinja template)."""
    try:
        p = Path(value).expanduser()
        if "\n" not in value and p.is_file():
            return p.read_text()
    except OSError:  # not a usable path (too long...): inline template
        pass
    return value


def _set_chat_template(tokenizer, template: str):
    """Replace the chat template the tokenizer renders with."""
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    inner.chat_template = template
    if getattr(tokenizer, "_chat_template", None) is not None:
        tokenizer._chat_template = None  # a custom renderer would bypass the new template


def _check_port(host: str, port: int):
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise UserError(f"cannot resolve --host {host!r}: {e}")
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as e:
            raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e} "
                            "(is another server running? pick another --port)")


def _session_store(args, model, metrics):
    if not getattr(args, "prompt_cache_dir", None):
        return None
    from ..decode.sequence import reference_state
    from .session_proof import load_key
    from .session_store import SessionStore, model_fingerprint

    key = None
    if getattr(args, "prompt_cache_key", None):
        try:
            key = load_key(args.prompt_cache_key)
        except (OSError, ValueError) as e:
            raise UserError(f"--prompt-cache-key {args.prompt_cache_key}: "
                            f"{getattr(e, 'strerror', None) or e}")
    try:
        store = SessionStore(args.prompt_cache_dir, model_fingerprint(model),
                             args.prompt_cache_disk_bytes, args.prompt_cache_min_tokens, key=key,
                             reference=reference_state(model))
    except OSError as e:
        raise UserError(f"--prompt-cache-dir {args.prompt_cache_dir}: {e.strerror or e}")
    store.on_restore = metrics.prefix_cache_disk_hits.inc
    return store


def build_state(args, model, tokenizer, config: dict, drafting, sampling_defaults: dict,
                template_args: dict, model_path=None, sync=None) -> ServerState:
    k = drafting.k
    text_cfg = text_config(config)
    ctx = args.max_kv_size or text_cfg.get("max_position_embeddings") or 32768
    vocab = text_cfg.get("vocab_size") or len(tokenizer.get_vocab())
    # The API names the model by its directory, never by a path of this machine;
    # requests may still name it by the path they know.
    resolved = str(Path(args.model).expanduser().resolve()) if args.model else None
    names = args.served_model_name or [Path(resolved).name if resolved else "mlx-mtp-demo"]
    aliases = set(names)
    if args.model:
        aliases.update({args.model, resolved, Path(resolved).name})
    num_layers = model.num_mtp_layers
    metrics = ServerMetrics(names[0])
    engine = Engine(
        model, tokenizer, num_draft_tokens=k, adaptive=drafting.adaptive,
        max_concurrency=args.max_concurrency, prefill_step_size=args.prefill_step_size,
        max_batched_tokens=args.max_batched_tokens,
        prefix_cache=PrefixCache(args.prompt_cache_size, args.prompt_cache_bytes,
                                 disk=_session_store(args, model, metrics)),
        metrics=metrics, max_queue=args.max_queue, model_name=names[0],
        log_interval=args.log_interval, sync=sync, draft_sources=drafting.sources,
        memory=MemoryBudget(args.memory_budget, max_wait=args.memory_budget_wait),
    )
    return ServerState(
        engine=engine, tokenizer=tokenizer, model_name=names[0], aliases=aliases,
        context_length=int(ctx), vocab_size=int(vocab), default_max_tokens=args.max_tokens,
        sampling_defaults=sampling_defaults, template_args=template_args,
        reasoning_parser=args.reasoning_parser, reasoning_field=args.reasoning_field,
        tool_call_parser=args.tool_call_parser, api_key=args.api_key or None,
        protect_metrics=args.protect_metrics, max_chars_per_token=max_token_chars(tokenizer),
        model_path=str(model_path) if model_path else str(args.model or ""),
        num_mtp_layers=num_layers, num_draft_tokens=k, adaptive=drafting.adaptive,
        max_draft_tokens=MAX_DRAFT_TOKENS, images=_image_inputs(args, model),
        block_drafter=model.block_drafter is not None,
    )


def _image_inputs(args, model):
    """The server's image settings, for a model that takes images (else None)."""
    if model.image_encoder is None:
        return None
    from .images import ImageInputs

    return ImageInputs(model.image_encoder,
                       allow_files=getattr(args, "allow_image_files", False),
                       allow_urls=getattr(args, "allow_image_urls", False))


def run(args) -> int:
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.setLevel(args.log_level)
    template_args = parse_json_arg(args.chat_template_args, "--chat-template-args")
    _check_args(args)
    # Under mlx.launch: rank 0 serves HTTP, the other ranks follow its steps.
    group = distributed_group(args.distributed)
    leader = group is None or group.rank() == 0
    drafting = drafting_from_args(args, distributed=group is not None)
    k = drafting.k

    if leader:
        _check_port(args.host, args.port)  # before spending minutes loading a model
    path = resolve_model_path(args.model)
    model_defaults = generation_defaults(args.model)
    sampling_from_args(args, model_defaults)  # validates the server-wide defaults
    defaults = sampling_defaults(args, model_defaults)
    if args.seed is not None:
        mx.random.seed(args.seed)
    log.info("Loading %s (MTP %s)", path, f"K={k}" if k else "off")
    model, tokenizer = load_from_args(args, mtp=k > 0, group=group)
    if not leader:
        return run_follower(model, args.distributed_timeout)
    if args.chat_template:
        _set_chat_template(tokenizer, _read_template(args.chat_template))
    sync = None if group is None else LeaderSync(model, args.distributed_timeout)
    state = build_state(args, model, tokenizer, load_config(path), drafting, defaults,
                        template_args, model_path=path, sync=sync)
    if sync is not None:
        sync.attach(state.engine)
    _serve(args, state, _guarded_app(args, state))
    if group is not None:  # the engine thread may sit in a collective of a lost rank
        logging.shutdown()
        os._exit(0)
    return 0


def _check_args(args):
    """Numeric limits and flag combinations, before anything is loaded."""
    for flag, v, lo in (("--max-tokens", args.max_tokens, 1),
                        ("--prefill-step-size", args.prefill_step_size, 1),
                        ("--max-num-batched-tokens", args.max_batched_tokens, 1),
                        ("--max-concurrency", args.max_concurrency, 1),
                        ("--max-queue", args.max_queue, 1),
                        ("--prompt-cache-size", args.prompt_cache_size, 0)):
        if v < lo:
            raise UserError(f"{flag} must be >= {lo} (got {v})")
    if args.quantized_kv_start:
        raise UserError("--quantized-kv-start applies to one sequence (generate, bench): the "
                        "server's batched caches are quantized from the first token")
    if args.max_kv_size is not None and args.max_kv_size < 2:
        raise UserError(f"--max-kv-size must be >= 2 (got {args.max_kv_size})")
    if args.max_request_bytes < 1024:
        raise UserError(f"--max-request-bytes must be at least 1K (got {args.max_request_bytes})")
    for flag, v in (("--read-timeout", args.read_timeout),
                    ("--timeout-keep-alive", args.timeout_keep_alive)):
        if not v > 0:
            raise UserError(f"{flag} must be > 0 (got {v})")
    if not 0 < args.port < 65536:
        raise UserError(f"--port must be between 1 and 65535 (got {args.port})")
    if not args.distributed_timeout > 0:
        raise UserError(f"--distributed-timeout must be > 0 (got {args.distributed_timeout})")
    if args.prompt_cache_dir and (args.prompt_cache_size == 0 or args.distributed):
        raise UserError("--prompt-cache-dir needs the in-memory prompt cache "
                        "(--prompt-cache-size > 0) and a single process (no --distributed)")
    if args.memory_budget is not None and args.distributed:
        raise UserError("--memory-budget needs a single process (no --distributed)")
    if args.prompt_cache_key and not args.prompt_cache_dir:
        raise UserError("--prompt-cache-key proves --prompt-cache-dir entries: give both")
    if args.prompt_cache_key and Path(args.prompt_cache_key).expanduser().resolve().is_relative_to(
            Path(args.prompt_cache_dir).expanduser().resolve()):
        raise UserError("--prompt-cache-key must live outside --prompt-cache-dir "
                        "(whoever can write entries there could read it)")
    if args.prompt_cache_disk_bytes < 1 or args.prompt_cache_min_tokens < 1:
        raise UserError("--prompt-cache-disk-bytes and --prompt-cache-min-tokens must be >= 1")


def _guarded_app(args, state: ServerState):
    """The app behind the HTTP guard (body size, read timeout, hosts, origins) and CORS."""
    origins = split_list(args.allowed_origins)
    hosts = split_list(args.allowed_hosts)
    if not hosts and is_loopback(args.host):
        hosts = list(LOCAL_HOST_NAMES)
    guard = GuardConfig(max_body_bytes=args.max_request_bytes, read_timeout=args.read_timeout,
                        allowed_hosts={host_name_of(h) for h in hosts} if hosts else None,
                        allowed_origins=set(origins), check_origin=state.api_key is None)
    app = create_app(state, guard)
    if origins:  # outermost: CORS headers on every answer, errors included
        add_cors(app, origins)
    return app


class _Server(uvicorn.Server):
    """uvicorn, stopping the engine's streams at the first signal and exiting with 0."""

    def __init__(self, config, engine: Engine):
        super().__init__(config)
        self.engine = engine

    @contextlib.contextmanager
    def capture_signals(self):
        # uvicorn's version re-raises the signal after the graceful
        # shutdown (exit status 130/143); a clean stop here exits with 0.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        sigs = (signal.SIGINT, signal.SIGTERM)
        original = {s: signal.signal(s, self.handle_exit) for s in sigs}
        try:
            yield
        finally:
            for s, h in original.items():
                signal.signal(s, h)

    def handle_exit(self, sig, frame):
        # End running streams now (they get an error event) instead of
        # letting the graceful shutdown wait for them; a second Ctrl-C
        # forces the exit.
        self.engine.shutdown(timeout=0)
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True


def _serve(args, state: ServerState, app):
    """Start the engine, serve until stopped, then stop the engine and flush the caches."""
    engine = state.engine
    engine.start()
    config = uvicorn.Config(app, host=args.host, port=args.port,
                            http=timed_http_protocol(args.read_timeout),
                            timeout_keep_alive=args.timeout_keep_alive,
                            log_level=args.log_level.lower(),
                            timeout_graceful_shutdown=args.shutdown_timeout,
                            access_log=args.log_level == "DEBUG")
    log.info("mlx-mtp serving %s at http://%s:%d/v1 (MTP: %s, max concurrency %d, "
             "context %d tokens)", state.model_name, args.host, args.port,
             f"{state.num_mtp_layers} layer(s), K={state.num_draft_tokens}"
             f"{' adaptive' if state.adaptive else ''}" if state.num_draft_tokens else "off",
             args.max_concurrency, state.context_length)
    try:
        _Server(config, engine).run()  # exits the process with 1 if the port cannot be bound
    finally:
        engine.shutdown()
        state.prompt_workers.shutdown()
        if engine.prefix_cache.disk is not None:  # queued prompt states reach the disk
            engine.prefix_cache.disk.flush(timeout=30)
    log.info("Server stopped.")
