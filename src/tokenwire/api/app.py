"""The FastAPI application: middlewares, routers, and the model loaded in the background.

The model loads after the server starts listening, so /health can say 503 while it loads.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import FastAPI

from tokenwire import __version__
from tokenwire.api.asgi import FrontConfig, FrontedApp
from tokenwire.api.control_key import STATELESS, TaggedRoutes
from tokenwire.api.direct import direct_routes
from tokenwire.api.errors import install_error_handlers
from tokenwire.api.metrics import Metrics
from tokenwire.api.openapi import install_openapi
from tokenwire.api.routes import (
    anthropic,
    control,
    derender,
    extend,
    frameworks,
    generate,
    info,
    lora,
    openai,
    render,
    responses_api,
    sessions,
    sglang,
    tokenize,
)
from tokenwire.engine.base import Engine
from tokenwire.engine.factory import create_engine
from tokenwire.media.prompt import IMAGE_PAD
from tokenwire.media.service import MediaService
from tokenwire.model_source import resolve_model_dir
from tokenwire.pipeline.context import ModelRuntime, Pipeline, ServingConfig
from tokenwire.pipeline.core_link import CoreEngine, CoreLink
from tokenwire.pipeline.session_store import SessionStore
from tokenwire.settings import Settings
from tokenwire.structured.grammar import GrammarCompiler
from tokenwire.text.chat_template import (
    ChatTemplate,
    RequestTemplateWorkers,
    load_model_chat_template,
)
from tokenwire.text.token_table import token_table
from tokenwire.text.token_text import TokenTextDecoder
from tokenwire.text.tokenizer import Tokenizer

logger = logging.getLogger("tokenwire")
# Collection thresholds once the model is loaded (Python's default: 700, 10, 10). The first is
# above the 230k objects a 32k-token top-5 derender body keeps alive while it is handled.
GC_THRESHOLDS = (500_000, 20, 20)


def create_app(
    settings: Settings, engine: Engine | None = None, *, core: CoreLink | None = None
) -> FrontedApp:
    """The app for ``settings``; ``engine`` (unstarted) replaces the one ``--engine`` names, so
    tests can run everything above the engine on a scripted one. ``core``: the app of one of
    ``--api-server-count``'s frontends, whose jobs, control plane and sessions are the core's
    (``api.api_servers``)."""
    session_store = None
    if core is None:
        session_store = SessionStore(
            settings.session_store_path,
            max_bytes=settings.session_store_bytes,
            ttl_s=settings.session_ttl_s,
            max_session_bytes=settings.session_bytes_each,
        )
    else:
        engine = CoreEngine(core)
    pipeline = Pipeline(
        config=ServingConfig.from_settings(settings),
        sessions=session_store,
        allowed_lora_roots=tuple(Path(os.path.realpath(p)) for p in settings.allowed_lora_paths),
        core=core,
    )
    metrics = Metrics()
    metrics.watch_death(lambda: pipeline.engine_death is not None)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        loading = asyncio.create_task(_load_runtime(pipeline, settings, metrics, engine))
        try:
            yield
        finally:
            pipeline.shut_down()
            loading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loading
            if pipeline.runtime is not None:
                await pipeline.runtime.engine.shutdown()
                await pipeline.runtime.media.aclose()
                if pipeline.runtime.request_templates is not None:
                    await pipeline.runtime.request_templates.aclose()
            if session_store is not None:
                session_store.close()

    app = FrontedApp(
        title="tokenwire",
        version=__version__,
        summary="Token-in/token-out LLM server for reinforcement-learning loops",
        lifespan=lifespan,
    )
    app.state.pipeline = pipeline
    app.state.metrics = metrics
    install_error_handlers(app)
    install_openapi(app)
    routers = [
        info.router,
        tokenize.router,
        render.router,
        extend.router,
        generate.router,
        derender.router,
        openai.router,
        anthropic.router,
        responses_api.router,
        sessions.router,
        sglang.router,
    ]
    if settings.enable_rl_control:
        routers.extend([control.router, frameworks.router])
        if settings.enable_lora:
            routers.append(lora.router)
    for router in routers:
        app.include_router(router)
    if settings.api_key and not settings.control_api_key:
        logger.warning(
            "--control-api-key is unset: control routes take --api-key, which a router in front "
            "of this server sends with every request it forwards"
        )
    front = FrontConfig(
        metrics=metrics,
        api_keys=settings.api_key,
        control_api_key=settings.control_api_key or None,
        router_api_key=settings.router_api_key,
        control_routes=TaggedRoutes(route for router in routers for route in router.routes),
        stateless_routes=TaggedRoutes(
            (route for router in routers for route in router.routes), STATELESS
        ),
        max_bytes=settings.max_request_bytes,
        read_timeout_s=settings.request_read_timeout_s,
        direct=direct_routes(routers),
    )
    app.set_front(front)
    return app


async def _load_runtime(
    pipeline: Pipeline, settings: Settings, metrics: Metrics, engine: Engine | None
) -> None:
    try:
        model_dir = await asyncio.to_thread(resolve_model_dir, settings.model, logger.info)
        tokenizer = await asyncio.to_thread(Tokenizer.load, model_dir)
        # Per-id byte table for token texts: built once here, not on a first request.
        table = await asyncio.to_thread(token_table, tokenizer)
        chat_template = await asyncio.to_thread(_load_chat_template, settings, model_dir, tokenizer)
        image_pad_id = tokenizer.backend.token_to_id(IMAGE_PAD)
        media = await MediaService.build(
            model_dir,
            policy=settings.media_policy(),
            cache_bytes=settings.media_cache_bytes,
            image_pad_id=image_pad_id,
            on_cache_hit=metrics.media_cache_hits.labels("image").inc,
            on_cache_miss=metrics.media_cache_misses.labels("image").inc,
        )
        request_templates = None
        if settings.trust_request_chat_template:
            request_templates = RequestTemplateWorkers(
                settings.request_template_limits(), tokenizer.special_tokens_map
            )
            await request_templates.start()
        if engine is None:
            engine = create_engine(
                settings.engine,
                model_dir,
                max_model_len=settings.max_model_len,
                max_num_seqs=settings.max_num_seqs,
                device=settings.device,
                dtype=settings.dtype,
                extra_args=settings.engine_args,
                prefix_cache_bytes=settings.prefix_cache_bytes,
                max_logprobs=settings.max_logprobs,
                max_loras=settings.max_loras if settings.enable_lora else 0,
                max_lora_rank=settings.max_lora_rank,
                max_num_batched_tokens=settings.max_num_batched_tokens,
                engine_threads=settings.engine_threads,
                allow_nonfinite_weights=settings.allow_nonfinite_weights,
                logprobs_mode=settings.logprobs_mode,
                return_routed_experts=settings.enable_return_routed_experts,
            )
        await engine.start()
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        pipeline.load_error = f"Model failed to load: {exc}"
        logger.exception("model failed to load")
        return
    metrics.watch_engine(engine.stats)
    runtime = ModelRuntime(
        tokenizer=tokenizer,
        chat_template=chat_template,
        engine=engine,
        max_model_len=engine.max_model_len,
        vocab_size=min(tokenizer.vocab_size, engine.vocab_size),
        eos_token_ids=frozenset(engine.eos_token_ids),
        media=media,
        decoder=TokenTextDecoder(tokenizer, table),
        request_templates=request_templates,
        grammars=(
            GrammarCompiler(tokenizer.hf, engine.vocab_size, engine.eos_token_ids)
            if "structured_outputs" in engine.features
            else None
        ),
    )
    _settle_heap()
    pipeline.runtime = runtime
    if pipeline.core is not None:
        return  # a frontend: the core loads the --lora-modules adapters
    try:
        for module in settings.lora_modules:  # as vLLM: a static adapter that fails stops it
            name, _, path = module.partition("=")
            await pipeline.control.adapters.load_path(name, path)
    except Exception as exc:
        pipeline.runtime = None
        pipeline.load_error = f"--lora-modules: {getattr(exc, 'message', exc)}"
        logger.error(pipeline.load_error)
        await engine.shutdown()
        return
    logger.info(
        "model %s ready from %s (max_model_len=%d)",
        pipeline.config.served_name,
        model_dir,
        engine.max_model_len,
    )


def _settle_heap() -> None:
    """Take the start-up heap (torch, transformers, the model, token tables: millions of
    objects) out of the collector's reach, and collect the young generation less often.

    Without the freeze every full collection walks everything the load left behind:
    ``orjson.loads`` of a 2 MB derender body took 150 ms instead of 11 ms. A request's objects
    die with it (no cycles), so a collection that runs while they live only walks them, at about
    0.5 µs each: 65k tracked containers of a 19 MB body cost 32 ms per collection. Collections
    count allocations net of deallocations, so a first threshold above what one request keeps
    alive means they almost never see one; cyclic garbage then waits at most 500k allocations.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def _load_chat_template(settings: Settings, model_dir, tokenizer: Tokenizer) -> ChatTemplate | None:
    source = (
        settings.chat_template.read_text(encoding="utf-8")
        if settings.chat_template
        else load_model_chat_template(model_dir)
    )
    if source is None:
        logger.warning("the model has no chat template: chat requests will be refused")
        return None
    template = ChatTemplate(
        source, special_tokens=tokenizer.special_tokens_map, allow_jinja2_fallback=True
    )
    if template.engine != "minijinja":
        logger.warning("minijinja cannot render this chat template; using jinja2's sandbox instead")
    return template
