"""The engine thread's step loop: which requests wait, prefill, decode, finish or abort.

A step is either a prefill of waiting requests (a group within free slots and a padded-token
budget, ``max_num_batched_tokens``; their rows then join the running cache) or one decode step for
every running row. A context longer than the budget is prefilled alone in chunks of the budget,
one chunk per step, and waits in the queue in between (``PrefillProgress``); its chunk boundaries
depend on its own context only, so a seeded request's logits do not depend on what else runs.

Whose prefill runs next (``_rank``): lowest first, the prefill clock (context tokens prefilled
so far) when it arrived plus ``SHORT_FIRST_WEIGHT`` times the context tokens it has left (the
prefix cache's and its chunks' already done are not counted). So a short new prompt goes before
long ones queued ahead of it (shortest remaining first), and a long one is passed over only while
the clock has not yet moved by that weight times what it has left, which ages it (no
starvation). One context at a time holds a chunk cache: while one is part-way, only prefills
that take one forward may go before it. Ties keep arrival order, the part-way context first.
Rows a pause sent back to recompute were running: they go first.

Decodes are never starved: while rows are running, at most one prefill forward runs between two
decode steps, and only once the decode steps since the last prefill took at least as long as it
did (prefill gets at most about half of the engine's time while streams decode). One exception
lets a new short prompt in without waiting for a long chunk's share to be repaid: a prefill of a
single forward may cut in after one decode step, once per repayment, its time added to what the
decode steps owe, so the share holds.
Rows that finish or are aborted leave the cache right after the step that ends them;
``running[i]`` is always cache row ``i``. A failed prefill fails only its group; a failed decode
fails the batch and starts from an empty cache.

The prefix cache (``prefix_cache``) gives a prefill the KV of a context's cached blocks, and
keeps each prefilled prompt's blocks and each leaving row's prompt and output blocks. A waiting
request whose next uncached block a request of the forming group is about to store waits one
prefill: so the n choices of a request (n engine requests with one prompt) prefill it once, and
the others take it from the cache. Prompts with images bypass the cache; seeded requests and
prompt-logprob requests store their blocks but never read them (see ``_next_group``).

Control commands (pause, resume, new weights, a new weight version, LoRA adapter loads and
unloads) are applied between steps in the order they arrive, so every token is sampled by
exactly one weight version; a request is pinned to the adapter version loaded when it arrived.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from tokenwire.engine.base import (
    DEFAULT_WEIGHT_VERSION,
    EngineError,
    EngineOutput,
    FinishReason,
    SamplingSupport,
    TokenLogprob,
    WeightsError,
)
from tokenwire.engine.hf.handoff import (
    Abort,
    Add,
    Command,
    Emits,
    LoadAdapter,
    NewWeights,
    Pause,
    Reply,
    Request,
    ResetPrefixCache,
    Resume,
    SetVersion,
    Stop,
    UnloadAdapter,
    deliver,
)
from tokenwire.engine.hf.prefix_cache import BLOCK_TOKENS, LayerKV, PrefixCache, block_keys
from tokenwire.engine.hf.routing import RouteLog
from tokenwire.engine.hf.runner import ModelRunner, PromptScores
from tokenwire.engine.stopping import check_stop

logger = logging.getLogger(__name__)

# How much a waiting prompt's remaining prefill counts against its age in ``_rank``. At 1 the
# order is by when each would finish prefilling alone, and under a steady flood of long prompts
# (each waiting for several others) the older long ones outrank a new short one, which then waits
# for them all (a probe's p90 TTFT 14-17x of solo on a quiet machine). At 8, a long prompt is
# passed by newer shorter ones until the clock has moved by 8x what it has left: bounded, and
# longer than a flood's prompts wait for each other, so a new short prompt goes next.
SHORT_FIRST_WEIGHT = 8


@dataclass(frozen=True, slots=True)
class LiveAdapter:
    """A LoRA adapter version the engine holds: its slot, and what salts the prefix-cache keys
    of KV computed under it (unique per load)."""

    slot: int
    salt: bytes


class Scheduler:
    """Runs steps until told to stop; all its state belongs to the engine thread.

    ``num_running``, ``num_waiting``, ``steps``, ``tokens_generated``, ``kv_cache_bytes``,
    ``prefill_steps`` and ``max_prefills_between_decodes`` are published for ``stats()`` as
    plain ints (atomic reads from the event loop).
    """

    def __init__(
        self,
        runner: ModelRunner,
        inbox: queue.SimpleQueue[Command],
        *,
        max_num_seqs: int,
        max_model_len: int,
        prefix_cache_bytes: int,
        max_num_batched_tokens: int,
    ) -> None:
        self.runner = runner
        self.max_num_batched_tokens = max_num_batched_tokens
        self.inbox = inbox
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.running: list[Request] = []  # index == cache row
        self.waiting: deque[Request] = deque()
        self.prefix = PrefixCache(prefix_cache_bytes)
        self.stopping = False
        self.paused = False
        # "wait" pauses (every concurrent caller's) answered once the requests in flight finish.
        self._drain_replies: list[Reply] = []
        self._drain_count = 0
        # Set by a prefill; the busy -> idle edge then frees what the peak batch held.
        self._memory_to_release = False
        self.weight_version = DEFAULT_WEIGHT_VERSION
        self.adapters: dict[int, LiveAdapter] = {}  # by ``AdapterVersion.id``
        self.num_running = 0
        self.num_waiting = 0
        self.steps = 0
        self.tokens_generated = 0
        self.kv_cache_bytes = 0
        self.prefix_stats: dict[str, int] = {}
        # Fairness: prefill forwards, the most that ran while rows waited for a decode step
        # (the scheduler keeps it at 1), the decode time owed before the next prefill, whether
        # a short prefill cut in since the last regular one, and the prefill clock (``_rank``).
        self.prefill_steps = 0
        self.max_prefills_between_decodes = 0
        self._prefills_since_decode = 0
        self._decode_owed = 0.0
        self._cut_in = False
        self._prefill_clock = 0

    def run(self) -> None:
        """Step until a ``Stop`` arrives, then end every stream, late arrivals included."""
        with torch.inference_mode():
            while not self.stopping:
                emits: Emits = []
                idle = self.paused or not (self.running or self.waiting)
                if idle and self._memory_to_release and not self.running:
                    self.runner.release_idle_memory()
                    self._memory_to_release = False
                    self._publish()
                self._drain_inbox(emits, block=idle)
                if self.stopping:
                    self._abort_all(emits)
                elif self.paused:
                    pass
                elif (
                    self.waiting
                    and len(self.running) < self.max_num_seqs
                    and (group := self._prefill_turn())
                ):
                    self._memory_to_release = True
                    self._count_prefill()
                    began = time.perf_counter()
                    try:
                        self._prefill_step(group, emits)
                    except Exception as exc:  # only the group fails; the running cache is intact
                        logger.exception("hf engine: prefill failed; failing its requests")
                        self._fail(group, exc, emits)
                    # A regular prefill owes its own time; a cut-in adds its time to what is owed.
                    owed = self._decode_owed if self._cut_in else 0.0
                    self._decode_owed = owed + time.perf_counter() - began
                elif self.running:
                    self._prefills_since_decode = 0
                    began = time.perf_counter()
                    try:
                        self._decode_step(emits)
                    except Exception as exc:
                        logger.exception("hf engine: decode step failed; failing the batch")
                        self._fail(self.running, exc, emits)
                        self.running = []
                        self.runner.reset_cache()
                    self._decode_owed -= time.perf_counter() - began
                self._finish_drain()
                self._publish()
                deliver(emits)
        self._refuse_late_requests()

    def _prefill_turn(self) -> list[Request]:
        """The group to prefill now, taken off the queue, or [] when the running rows decode.

        Always a group when no row is running; else only right after a decode step, once the
        decode steps since the last prefill took as long as it did (owe nothing), or once per
        such repayment for a group of one forward (a short prompt cutting in).
        """
        if self.running and self._prefills_since_decode:
            return []
        regular = not self.running or self._decode_owed <= 0
        if not regular and self._cut_in:
            return []
        group = self._next_group()
        if not regular and self._chunked(group[0]):
            return []
        self._cut_in = not regular
        self._take(group)
        return group

    def _count_prefill(self) -> None:
        self.prefill_steps += 1
        if self.running:  # running rows wait for this forward
            self._prefills_since_decode += 1
            self.max_prefills_between_decodes = max(
                self.max_prefills_between_decodes, self._prefills_since_decode
            )

    def _restart_prefills(self) -> None:
        """Forget chunked prefills under way (new weights, or a pause freeing KV): they start
        over."""
        for req in self.waiting:
            req.progress = None

    def _refuse_late_requests(self) -> None:
        """Requests that raced with shutdown still get a final output."""
        emits: Emits = []
        while True:
            try:
                cmd = self.inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, Add):
                emits.append((cmd.request.sink, self._output(cmd.request, [], "abort")))
            elif not isinstance(cmd, Abort | Stop):
                cmd.reply.send(EngineError("the engine is shutting down"))
        deliver(emits)

    def _drain_inbox(self, emits: Emits, block: bool) -> None:
        """Apply queued commands in order (an abort never hits a later request with its id)."""
        try:
            cmd = self.inbox.get() if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(cmd, Stop):
                self.stopping = True
            elif isinstance(cmd, Add):
                self._admit(cmd.request, emits)
            elif isinstance(cmd, Abort):
                self._apply_aborts({cmd.request_id}, emits)
            else:
                self._control(cmd, emits)
            try:
                cmd = self.inbox.get_nowait()
            except queue.Empty:
                break

    def _admit(self, req: Request, emits: Emits) -> None:
        """Queue a request in the slot of its adapter version (if it runs under one)."""
        if req.adapter is not None:
            live = self.adapters.get(req.adapter.id)
            if live is None:  # the registry holds a version for its requests: a bug
                emits.append((req.sink, EngineError(f"LoRA adapter {req.adapter} is not held")))
                return
            req.adapter_slot = live.slot
            # KV under another adapter version must never answer this one's lookups.
            req.salt = hashlib.blake2b(req.salt + live.salt, digest_size=16).digest()
        req.admitted_at = self._prefill_clock
        if self.runner.routing is not None:
            req.routes = RouteLog()
        self.waiting.append(req)

    def _load_adapter(self, cmd: LoadAdapter) -> None:
        """Put an adapter version in a slot no other version holds (the registry keeps the
        count within the slots)."""
        slots = self.runner.adapters
        assert slots is not None, "HFEngine.load_adapter refuses a load with LoRA off"
        busy = {live.slot for live in self.adapters.values()}
        slot = next((s for s in range(1, slots.max_loras + 1) if s not in busy), None)
        if slot is None:
            raise WeightsError(f"every one of the {slots.max_loras} adapter slots is taken")
        slots.put(slot, cmd.weights)
        salt = hashlib.blake2b(f"lora:{cmd.adapter.id}".encode(), digest_size=16).digest()
        self.adapters[cmd.adapter.id] = LiveAdapter(slot, salt)

    def _control(self, cmd: Command, emits: Emits) -> None:
        """Pause, resume, swap weights or set the version, between two steps."""
        if isinstance(cmd, Pause):
            in_flight = len(self.running) + len(self.waiting)
            if cmd.mode == "abort":
                self._abort_all(emits)
            elif cmd.mode == "wait" and in_flight:
                if not self._drain_replies:
                    self._drain_count = in_flight
                self._drain_replies.append(cmd.reply)
                return
            if cmd.clear_cache:  # as vLLM's clear_cache: the prefix cache goes too
                self._recompute_running(emits)
                self.prefix.clear()
            self.paused = True
            cmd.reply.send(in_flight)
        elif isinstance(cmd, Resume):
            self.paused = False
            self._finish_drain(force=True)
            cmd.reply.send(None)
        elif isinstance(cmd, NewWeights):
            try:
                cmd.load()
            except Exception as exc:  # a refused checkpoint, or a broadcast that broke off
                cmd.reply.send(exc)
                return
            finally:
                # Even a broken-off broadcast may have changed some weights: KV of the old
                # ones must not serve new requests.
                self.prefix.clear()
                self._restart_prefills()
                for req in self.running:
                    req.stale_kv = True
            if cmd.version is not None:
                self.weight_version = cmd.version
            cmd.reply.send(None)
        elif isinstance(cmd, LoadAdapter):
            try:
                self._load_adapter(cmd)
            except WeightsError as exc:
                cmd.reply.send(exc)
                return
            cmd.reply.send(None)
        elif isinstance(cmd, UnloadAdapter):
            live = self.adapters.pop(cmd.adapter.id, None)  # none of its requests is left
            if live is not None and self.runner.adapters is not None:
                self.runner.adapters.clear(live.slot)
            cmd.reply.send(None)
        elif isinstance(cmd, ResetPrefixCache):
            self.prefix.clear()
            cmd.reply.send(True)
        elif isinstance(cmd, SetVersion):
            self.weight_version = cmd.version
            cmd.reply.send(None)

    def _finish_drain(self, *, force: bool = False) -> None:
        """Answer the "wait" pauses once nothing is in flight (or a resume came first)."""
        if not self._drain_replies or not (force or not (self.running or self.waiting)):
            return
        replies, self._drain_replies = self._drain_replies, []
        self.paused = not force
        for reply in replies:
            reply.send(self._drain_count)

    def _recompute_running(self, emits: Emits) -> None:
        """Drop the running rows' KV: they prefill prompt + output again on resume (with the
        weights loaded by then). Rows with images cannot (their pixels are gone): aborted."""
        kept = []
        for req in self.running:
            if req.has_images:
                req.finish = "abort"
                emits.append((req.sink, self._output(req, [], "abort")))
            else:
                req.recompute = True
                kept.append(req)
        self.running = []
        self.runner.reset_cache()
        self._restart_prefills()
        self.waiting.extendleft(reversed(kept))

    def _version(self, req: Request) -> str:
        """The version that samples ``req``'s tokens: its adapter's, else the base weights'."""
        return self.weight_version if req.adapter is None else req.adapter.version

    def _output(
        self, req: Request, token_ids: list[int], finish: FinishReason | None = None
    ) -> EngineOutput:
        return EngineOutput(
            token_ids,
            finish_reason=finish,
            weight_version=self._version(req),
            routed_experts=req.routes.unsent() if req.routes is not None else None,
        )

    def _apply_aborts(self, ids: set[str], emits: Emits) -> None:
        kept: deque[Request] = deque()
        for req in self.waiting:
            if req.request_id in ids:
                emits.append((req.sink, self._output(req, [], "abort")))
            else:
                kept.append(req)
        self.waiting = kept
        for req in self.running:
            if req.request_id in ids and req.finish is None:
                req.finish = "abort"
                emits.append((req.sink, self._output(req, [], "abort")))
        self._drop_finished()

    def _abort_all(self, emits: Emits) -> None:
        ids = {r.request_id for r in self.waiting} | {r.request_id for r in self.running}
        self._apply_aborts(ids, emits)

    @staticmethod
    def _fail(requests: list[Request], exc: Exception, emits: Emits) -> None:
        """End the streams of ``requests`` with an error (once each)."""
        for req in requests:
            if req.finish is None:
                req.finish = "abort"
                emits.append((req.sink, exc))

    def _publish(self) -> None:
        self.num_running = len(self.running)
        self.num_waiting = len(self.waiting)
        cache = self.runner.cache
        self.kv_cache_bytes = cache.nbytes if cache is not None else 0
        self.prefix_stats = self.prefix.stats()

    def _rank(self, req: Request) -> tuple[bool, int]:
        """A waiting request's place, lowest first (see the module docstring)."""
        return (not req.recompute, req.admitted_at + SHORT_FIRST_WEIGHT * self._to_prefill(req))

    def _to_prefill(self, req: Request) -> int:
        """The context tokens its prefill has left to compute."""
        if req.progress is not None:
            return len(req.context) - req.progress.done
        return len(req.context) - self._cached_blocks(req) * BLOCK_TOKENS

    def _cached_blocks(self, req: Request) -> int:
        """How many leading blocks of its context the prefix cache gives its next prefill
        (always leaving one token to prefill: its logits sample the first output token)."""
        return self.prefix.match(self._usable_keys(req)) if self._reads_cache(req) else 0

    @staticmethod
    def _reads_cache(req: Request) -> bool:
        """Seeded and prompt-scoring requests compute their prompt from scratch: cached KV was
        computed in another batch shape, and a seed promises the same ids whatever ran before."""
        return not (req.wants_prompt_logprobs or req.seeded)

    def _usable_keys(self, req: Request) -> list[bytes]:
        return self._context_keys(req)[: (len(req.context) - 1) // BLOCK_TOKENS]

    def _next_group(self) -> list[Request]:
        """The requests of the next prefill forward, in ``_rank`` order, within free slots and
        the token budget; they stay queued until ``_take``.

        Sets each one's ``num_cached``. A request waits for a later group when a request of this
        one will store its next uncached block (see the module docstring). A context longer than
        the budget goes alone (chunked), as does one part-way through its chunks; while one is,
        no other starts chunks.
        """
        part_way = any(r.progress is not None for r in self.waiting)
        free = self.max_num_seqs - len(self.running)
        group: list[Request] = []
        coming: set[bytes] = set()  # blocks this group's prompts will store
        longest = 0
        for req in sorted(self.waiting, key=self._rank):
            if req.progress is not None:  # its chunk cache is its own: it goes alone
                if not group:
                    group.append(req)
                break
            if group and (req.wants_prompt_logprobs or group[0].wants_prompt_logprobs):
                break  # full-logit prefills run alone: their logits are [P, V]
            if group and (req.seeded or group[0].seeded):
                break  # seeded prefills run alone: left padding would move their logits
            if group and req.media is not None:
                break
            if len(group) >= free:
                break
            usable = self._usable_keys(req)
            hit = self._cached_blocks(req)
            if hit < len(usable) and usable[hit] in coming:
                continue
            req.num_cached = hit * BLOCK_TOKENS
            chunked = self._chunked(req)
            if chunked and part_way:
                continue
            new_longest = max(longest, len(req.context) - req.num_cached)
            if group and new_longest * (len(group) + 1) > self.max_num_batched_tokens:
                break
            coming.update(self._context_keys(req))
            group.append(req)
            longest = new_longest
            if req.media is not None or chunked:
                break
        return group

    def _take(self, group: list[Request]) -> None:
        """Take a group off the queue to prefill it (and count its prefix-cache lookups)."""
        for req in group:
            if req.progress is None and self._reads_cache(req) and self._context_keys(req):
                self.prefix.record(req.num_cached // BLOCK_TOKENS)
        chosen = {id(r) for r in group}
        self.waiting = deque(r for r in self.waiting if id(r) not in chosen)

    def _context_keys(self, req: Request) -> list[bytes]:
        """The prefix-cache keys of the next prefill's context ([]: it bypasses the cache)."""
        if not self.prefix.enabled or req.has_images:
            return []
        if req.prompt_keys is None:
            req.prompt_keys = block_keys(req.prompt, salt=req.salt)
        if req.recompute:
            return block_keys(req.context, req.prompt_keys, salt=req.salt)
        return req.prompt_keys

    def _chunked(self, req: Request) -> bool:
        """Its prefill takes more than one forward (a prompt with images never does: its vision
        tower and M-RoPE positions run once, in one forward)."""
        if req.media is not None:
            return False
        return req.progress is not None or (
            len(req.context) - req.num_cached > self.max_num_batched_tokens
        )

    def _cached_past(self, req: Request) -> LayerKV | None:
        """The prefix cache's KV of the ``num_cached`` tokens ``_next_group`` matched."""
        if not req.num_cached:
            return None
        keys = self._context_keys(req)[: req.num_cached // BLOCK_TOKENS]
        if req.routes is not None:  # the cached positions' routing comes with their KV
            req.routes.add(0, self.prefix.routes(keys))
        return self.prefix.fetch(keys)

    def _prefill_step(self, group: list[Request], emits: Emits) -> None:
        """Prefill a group ``_take`` took off the queue (or a chunk of its one context)."""
        head = group[0]
        if self._chunked(head):
            if head.progress is None:
                past, start = self._cached_past(head), head.num_cached
            else:
                past, start = None, head.progress.done
            end = min(len(head.context), start + self.max_num_batched_tokens)
            prefilled = self.runner.prefill_chunk(head, past, end)
            del past
            self._prefill_clock += end - start
        else:
            pasts = [self._cached_past(r) for r in group]
            prefilled = self.runner.prefill(group, pasts)
            del pasts
            self._prefill_clock += sum(len(r.context) - r.num_cached for r in group)
        self.steps += 1
        if prefilled is None:  # more chunks to come: back in the queue (first among its ties)
            self.waiting.appendleft(head)
            return
        for i, req in enumerate(group):
            req.stale_kv = False
            if req.routes is not None and req.routes.kv_differs:
                continue  # a recomputation routed otherwise: its KV has no rows to keep with
            self.prefix.keep(
                self._context_keys(req),
                len(req.context),
                lambda i=i: self.runner.prefilled_row(prefilled, i),
                self._routes(req),
            )
        self._sample_and_emit(group, prefilled.logits, emits, first=True, prompt=prefilled.prompt)
        alive = [i for i, r in enumerate(group) if r.finish is None]
        if alive:
            self.runner.join(prefilled, alive)
            self.running.extend(group[i] for i in alive)

    def _decode_step(self, emits: Emits) -> None:
        logits = self.runner.decode(self.running)
        self.steps += 1
        self._sample_and_emit(self.running, logits, emits, first=False)
        self._drop_finished()

    def _sample_and_emit(
        self,
        rows: list[Request],
        logits: torch.Tensor,
        emits: Emits,
        *,
        first: bool,
        prompt: PromptScores | None = None,
    ) -> None:
        picks = self._sample(rows, logits, emits)
        self.tokens_generated += len(rows)
        for i, (req, pick) in enumerate(zip(rows, picks, strict=True)):
            if pick is None:  # its sampling failed: that request alone has ended
                continue
            token, lp, support = pick
            is_first = not req.output  # a recomputed row has sent its first output already
            req.output.append(token)
            req.last_token = token
            req.finish, stop_reason = self._finish(req, token)
            req.recompute = False
            out = EngineOutput(
                new_token_ids=[token],
                logprobs=[lp] if lp is not None else None,
                finish_reason=req.finish,
                stop_reason=stop_reason,
                weight_version=self._version(req),
                sampling_masks=[support] if support is not None else None,
                routed_experts=req.routes.unsent() if req.routes is not None else None,
            )
            if first and is_first:
                out.num_prompt_tokens = len(req.prompt)
                out.num_cached_tokens = req.num_cached
                if prompt is not None and i == 0:
                    out.prompt_logprobs = prompt.logprobs
                    out.prompt_token_id_logprobs = prompt.token_id_logprobs
            emits.append((req.sink, out))

    def _sample(
        self, rows: list[Request], logits: torch.Tensor, emits: Emits
    ) -> list[tuple[int, TokenLogprob | None, SamplingSupport | None] | None]:
        """One (token, logprob, support) per row; a row whose sampling fails ends alone.

        The batch is sampled at once; only if that fails is each row retried on its own, so one
        request's values can never fail the others'.
        """
        try:
            result = self.runner.sample(rows, logits)
            return list(zip(result.token_ids, result.logprobs, result.supports, strict=True))
        except Exception:
            logger.exception("hf engine: sampling failed; retrying the rows one by one")
        picks: list[tuple[int, TokenLogprob | None, SamplingSupport | None] | None] = []
        for i, req in enumerate(rows):
            try:
                alone = self.runner.sample([req], logits[i : i + 1])
                picks.append((alone.token_ids[0], alone.logprobs[0], alone.supports[0]))
            except Exception as exc:
                req.finish = "abort"
                emits.append((req.sink, exc))
                picks.append(None)
        return picks

    def _finish(self, req: Request, token: int) -> tuple[FinishReason | None, int | None]:
        """Whether ``token`` ends the request, and its stop reason (``engine.stopping``)."""
        n = len(req.output)
        return check_stop(
            token,
            n,
            req.params,
            self.runner.eos_token_ids,
            context_full=len(req.prompt) + n >= self.max_model_len,
        )

    def _drop_finished(self) -> None:
        """Remove finished rows from the cache and mirror the cache's row moves; their prompt
        and output blocks go to the prefix cache first."""
        done = [i for i, r in enumerate(self.running) if r.finish is not None]
        if not done:
            return
        for i in done:
            self._keep_row(i)
        moves = self.runner.drop(done)
        rows = self.running
        for src, dst in moves:
            rows[dst] = rows[src]
        del rows[len(rows) - len(done) :]

    def _keep_row(self, row: int) -> None:
        """Store a leaving row's blocks: its prompt and outputs but the last (never fed)."""
        req = self.running[row]
        if req.stale_kv or not req.output or not self._context_keys(req):
            return
        if req.routes is not None and req.routes.kv_differs:
            return
        tokens = [*req.prompt, *req.output[:-1]]
        keys = block_keys(tokens, req.prompt_keys or (), salt=req.salt)
        self.prefix.keep(keys, len(tokens), lambda: self.runner.running_row(row), self._routes(req))

    @staticmethod
    def _routes(req: Request) -> np.ndarray | None:
        """The routing rows kept beside a request's KV (None: capture is off)."""
        return req.routes.rows() if req.routes is not None and req.routes.length else None
