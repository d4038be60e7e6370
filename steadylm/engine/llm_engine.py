"""The engine API every entry point builds on: add a request, step, abort, read outputs.

`step()` is three calls: schedule, execute, update. If execute raises, the step's requests are
run again one by one: a request that fails alone finishes with the error and the others go on
unharmed. The engine reports itself unhealthy only after repeated consecutive steps in which
nothing could run at all (not even a one-token probe), and keeps the cause in its log and stats.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from steadylm import kernels, parallel, platform
from steadylm.config import EngineConfig, ModelConfig
from steadylm.engine.block_manager import BlockManager, cache_salt
from steadylm.engine.executor import Executor, InProcessExecutor
from steadylm.engine.model_runner import ModelRunner
from steadylm.engine.request import Request, RequestOutput, RequestStatus, SamplingParams
from steadylm.engine.scheduler import Scheduler, SchedulerOutput
from steadylm.engine.speculative import SpecStats, Speculator
from steadylm.engine.step import ContractBuilder, StepContract
from steadylm.engine.structured import StructuredOutputManager
from steadylm.errors import ConfigError, EngineDeadError, RequestError
from steadylm.memory import MemoryPlan, graph_blocker, plan_memory

logger = logging.getLogger("steadylm")

MAX_CONSECUTIVE_FAULTS = 3
# The step log is a window of the latest steps (a bench or demo run reads its own steps back),
# not a history: 100,000 records held 86 MB and were still filling after 15 minutes of serving.
STEP_LOG_LEN = 4096
INTERNAL_ID_PREFIX = "\x00steadylm-"  # ids of the engine's own requests; refused from callers


@dataclass(frozen=True, slots=True)
class StepRecord:
    num_seqs: int
    num_tokens: int
    kv_blocks_used: int
    seconds: float
    model_seconds: float = 0.0  # of which inside the model forward and logits
    num_preempted: int = 0


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_free: int
    num_preemptions: int
    prefix_cache_hit_rate: float
    num_steps: int
    num_generated_tokens: int
    num_prompt_tokens: int
    healthy: bool
    last_error: str | None
    fault_counts: dict[str, int] = field(default_factory=dict)
    num_request_faults: int = 0
    spec_decode: SpecStats | None = None  # speculative decoding's counters (None: off)
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache, since start
    prefix_cache_hits: int = 0  # of those, tokens found there


class LLMEngine:
    def __init__(
        self,
        executor: Executor,
        model_config: ModelConfig,
        config: EngineConfig,
        plan: MemoryPlan,
        device: torch.device,
        dtype: torch.dtype,
        tokenizer: Any = None,
    ) -> None:
        self.model_config = model_config
        self.config = config
        self.plan = plan
        self.device = device
        self.dtype = dtype
        self.tokenizer = tokenizer
        self.session_len = plan.session_len
        self.executor = executor
        self.runner = executor.runner  # rank 0's (tests and tools read its model and cache)
        self.kv_cache = self.runner.kv_cache
        if device.type == "cpu":
            platform.tune_cpu_allocator()
            # Built (once per machine) or loaded now, not inside the first request's step; a
            # bad STEADYLM_CPU_DECODE_LAYERS or STEADYLM_CPU_AMX_GEMV fails here too.
            logger.info(
                "CPU kernels: %s; decode layers: %s; AMX GEMV: %s",
                kernels.status(),
                platform.cpu_decode_layers(),
                platform.cpu_amx_gemv(),
            )
        elif device.type == "cuda":  # a bad STEADYLM_CUDA_KERNELS fails here, not in a step
            logger.info("CUDA small-op kernels: %s", platform.cuda_kernels())
        watermark = config.watermark_blocks
        if watermark is None:
            watermark = max(1, plan.num_blocks // 100) if plan.num_blocks > 8 else 0
        # Everything besides the tokens that changes a block's KV goes into its cache key.
        salt = cache_salt(model_config, str(dtype), config.quant_policy, plan.block_size)
        self.block_manager = BlockManager(
            plan.num_blocks, plan.block_size, config.enable_prefix_caching, watermark, salt
        )
        spec = config.speculative_config
        self.speculator = Speculator(spec) if spec is not None else None
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_batch_size,
            plan.max_prefill_token_num,
            self.speculator,
            config.scheduling_policy,
        )
        self.contracts = ContractBuilder()  # what the runner has been told, request by request
        self.structured = StructuredOutputManager(
            tokenizer, model_config.vocab_size, model_config.eos_token_ids
        )
        self.bitmask_seconds = 0.0  # filling structured-output bitmasks (benchmarks read it)
        self.requests: dict[str, Request] = {}
        self._reported: dict[str, int] = {}
        self._ids = itertools.count()
        self.consecutive_faults = 0
        self.last_error: str | None = None  # logged and counted; never sent to clients
        self.fault_counts: dict[str, int] = {}  # engine faults by exception type
        self.num_request_faults = 0  # requests that failed alone (their own fault)
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        self._last_stats_log = time.monotonic()
        self.step_log: deque[StepRecord] = deque(maxlen=STEP_LOG_LEN)
        if device.type == "cuda":
            self._check_activation_estimate()

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls, model_dir: str, config: EngineConfig | None = None, tokenizer: Any = None
    ) -> LLMEngine:
        from steadylm.loader import checkpoint_weight_bytes, load_model
        from steadylm.memory import awq_layout, weight_bytes_from_config

        config = config or EngineConfig()
        mc = ModelConfig.from_path(model_dir)
        device = platform.resolve_device(config.device)
        dtype = platform.resolve_dtype(config.dtype, mc, device)
        if device.type == "cpu":
            platform.tune_cpu_allocator()  # before loading: the weights are allocated too
            kernels.status()  # built (once per machine) before the workers would race to
        if mc.quantization or config.tp > 1:  # per rank / the repacked int4 layout
            size = torch.tensor([], dtype=dtype).element_size()
            layout = awq_layout(device.type)
            weights = weight_bytes_from_config(mc, size, config.tp, layout=layout)
        else:
            weights = checkpoint_weight_bytes(model_dir, dtype)
        # The LM head's int8 copy for greedy steps, where the CPU model will keep one.
        weights += kernels.planned_screen_bytes(
            mc.vocab_size, mc.hidden_size, dtype, device, mc.tie_word_embeddings, config.tp
        )
        plan = make_plan(mc, config, device, dtype, weights)
        if config.tp > 1:
            from steadylm.engine.executor import TPExecutor

            executor = TPExecutor(model_dir, mc, config, plan, torchrun=parallel.under_torchrun())
        else:
            model = load_model(model_dir, mc, dtype, device)
            executor = InProcessExecutor(ModelRunner.create(model, config, plan, device, dtype))
        return cls(executor, mc, config, plan, device, dtype, tokenizer)

    @classmethod
    def from_model(cls, model: nn.Module, config: EngineConfig, tokenizer: Any = None) -> LLMEngine:
        """Wrap an already-built model (tests, the demo)."""
        from steadylm.loader import model_weight_bytes

        if config.tp > 1:
            raise ConfigError(
                f"tp={config.tp} needs a model directory (each rank loads its own shard); "
                "use LLMEngine.from_pretrained",
                param="tp",
            )
        mc = model.cfg
        param = next(model.parameters())
        weights = model_weight_bytes(model)
        plan = make_plan(mc, config, param.device, param.dtype, weights)
        runner = ModelRunner.create(model, config, plan, param.device, param.dtype)
        executor = InProcessExecutor(runner)
        return cls(executor, mc, config, plan, param.device, param.dtype, tokenizer)

    def _check_activation_estimate(self) -> None:
        """On CUDA, run one dummy prefill of max_prefill_token_num tokens and compare its
        measured peak with the plan's activation reserve (reported, never fatal)."""
        n = min(self.plan.max_prefill_token_num, self.block_manager.capacity_tokens - 1)
        req = Request(self._internal_id("profile"), [0] * n, SamplingParams(max_new_tokens=1))
        try:
            torch.cuda.synchronize(self.device)
            base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.block_manager.allocate(req, n)
            self._run_alone(req, n)
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) - base
            self.plan.notes.append(
                f"activation check: a {n}-token step peaked at {peak / 2**20:.0f} MiB; the plan "
                f"reserves {self.plan.activation_bytes / 2**20:.0f} MiB"
            )
            logger.info("%s", self.plan.notes[-1])
        except Exception as exc:  # a measurement only: never block startup on it
            logger.warning("activation check skipped: %s", exc)
        finally:
            self.block_manager.free(req)
            self._release_alone(req)

    def _run_alone(self, req: Request, n: int) -> dict:
        """Run one internal request's step outside the schedule (profile, probe)."""
        contract = self.contracts.build([(req, n)], [], self.block_manager.block_table)
        return self.executor.execute(contract)

    def _release_alone(self, req: Request) -> None:
        """Drop an internal request's runner state now (no later step will carry it)."""
        self.contracts.sent.pop(req.request_id, None)
        self.executor.apply(StepContract(finished_ids=[req.request_id]))

    # ---- requests -----------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        params = params or SamplingParams()
        if params.priority and self.config.scheduling_policy != "priority":
            raise RequestError(  # vLLM says the same: the order would silently be FCFS
                f"priority={params.priority} needs scheduling_policy='priority' "
                "(--scheduling-policy priority); this engine schedules first come, first served",
                param="priority",
            )
        ids = self._encode(prompt)
        self._check_prompt(ids)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if not isinstance(request_id, str) or request_id.startswith(INTERNAL_ID_PREFIX):
            raise RequestError(f"request_id {request_id!r} is not allowed", param="request_id")
        if request_id in self.requests:
            raise RequestError(f"request_id {request_id!r} is already in use", param="request_id")
        constraint = self.structured.constraint(params, ids, params.stop_token_ids)
        req = Request(
            request_id=request_id,
            prompt_token_ids=ids,
            params=params,
            eos_token_ids=self.model_config.eos_token_ids,
            max_total_tokens=min(len(ids) + params.max_new_tokens, self.session_len),
            constraint=constraint,
        )
        self.requests[request_id] = req
        self._reported[request_id] = 0
        self.num_prompt_tokens += len(ids)
        self.scheduler.add_request(req)
        return request_id

    def _internal_id(self, kind: str) -> str:
        return f"{INTERNAL_ID_PREFIX}{kind}-{next(self._ids)}"

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(
                    "a text prompt needs a tokenizer; pass token ids instead", param="prompt"
                )
            return list(self.tokenizer.encode(prompt))
        ids = list(prompt)
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise RequestError(
                f"token ids must be ints in [0, {vocab}); got {bad[:5]}", param="prompt"
            )
        return ids

    def _check_prompt(self, ids: list[int]) -> None:
        n = len(ids)
        if n == 0:
            raise RequestError("the prompt is empty; give at least one token", param="prompt")
        capacity = self.block_manager.capacity_tokens
        if n + 1 > self.session_len:
            raise RequestError(
                f"the prompt has {n} tokens; with one new token that is longer than "
                f"session_len={self.session_len}. Shorten the prompt or raise session_len "
                f"(KV capacity is {capacity} tokens).",
                param="prompt",
            )
        if n + 1 > capacity:
            raise RequestError(
                f"the prompt has {n} tokens; with one new token that is more than the whole KV "
                f"cache ({capacity} tokens). Raise the KV cache size or shorten the prompt.",
                param="prompt",
            )

    def abort(
        self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> RequestOutput | None:
        """End a request now (its blocks are freed): aborted, or stopped (a stop string seen
        by the caller). Return its final output, or None if it is unknown or finished."""
        req = self.scheduler.abort(request_id, status)
        if req is None:
            return None
        return self._outputs([req])[0]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # ---- the step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        m0 = self.executor.model_seconds
        out = self.scheduler.schedule()
        failed: list[Request] = []
        try:
            sampled = self.execute(out)
        except EngineDeadError:
            raise  # the tensor-parallel group is gone: nothing to retry on
        except Exception as exc:  # find who caused it: one bad request must not fail others
            out, sampled, failed = self._isolate_fault(out, exc)
        else:
            self.consecutive_faults = 0
        generated = sum(len(tokens) for tokens, _ in sampled.values())
        self.num_generated_tokens += generated
        decode_only = bool(out.scheduled) and all(
            s.num_new_tokens == 1 + len(s.spec_token_ids) and s.request.num_output_tokens
            for s in out.scheduled
        )
        self._collect_prompt_logprobs(out, sampled)
        used = self.block_manager.num_used_blocks  # before finished requests free theirs
        self.scheduler.update(out, sampled)
        for req in out.trimmed:  # the runner cuts its table with the next contract
            self.contracts.truncate(
                req.request_id, len(self.block_manager.block_table(req.request_id))
            )
        self.step_log.append(
            StepRecord(
                len(out.scheduled),
                out.num_tokens,
                used,
                time.perf_counter() - t0,
                self.executor.model_seconds - m0,
                len(out.preempted),
            )
        )
        if self.speculator is not None and decode_only and not failed:
            drafted = any(s.spec_token_ids for s in out.scheduled)
            self.speculator.observe(
                time.perf_counter() - t0, len(out.scheduled), generated, drafted
            )
        touched = [s.request for s in out.scheduled] + out.errored + out.expired + failed
        self._maybe_log_stats()
        return self._outputs(touched)

    def execute(self, out: SchedulerOutput) -> dict[str, tuple[int, dict | None]]:
        """Turn a schedule into the step contract (data only) and have the runner run it."""
        token_bitmask = self._token_bitmask(out)  # before the contract: it may drop requests
        contract = self.contracts.build(
            [(s.request, s.num_new_tokens, s.spec_token_ids) for s in out.scheduled],
            out.preempted,
            self.block_manager.block_table,
        )
        contract.token_bitmask = token_bitmask
        return self.executor.execute(contract)

    def _collect_prompt_logprobs(self, out: SchedulerOutput, sampled: dict) -> None:
        """Requests that asked for prompt logprobs get them when their prompt is computed
        (the step that samples their first token)."""
        for s in out.scheduled:
            req = s.request
            if (
                req.params.prompt_logprobs is not None
                and req.prompt_logprobs is None
                and req.request_id in sampled
            ):
                req.prompt_logprobs = self.runner.take_prompt_logprobs(req.request_id)

    def _token_bitmask(self, out: SchedulerOutput) -> dict:
        """The allowed-token rows of the requests that sample this step under a constraint.
        A request whose matcher cannot fill its row fails alone: finished with the error and
        taken out of this step (before its contract is built)."""
        constrained = [
            s.request
            for s in out.scheduled
            if s.request.constraint is not None
            and s.request.num_computed_tokens + s.num_new_tokens == s.request.num_tokens
            and s.request.constraint.mode() is not None
        ]
        if not constrained:
            return {}
        t0 = time.perf_counter()
        try:
            rows = list(self.structured.fill([r.constraint for r in constrained]))
        except Exception:  # find which one: fill them one by one
            rows = []
            for req in list(constrained):
                try:
                    rows += list(self.structured.fill([req.constraint]))
                except Exception as exc:
                    logger.error("structured output of %s failed: %s", req.request_id, exc)
                    constrained.remove(req)
                    self.scheduler.fail_one(req, f"structured output failed: {exc}")
                    out.errored.append(req)
                    out.scheduled = [s for s in out.scheduled if s.request is not req]
        self.bitmask_seconds += time.perf_counter() - t0
        return {r.request_id: row for r, row in zip(constrained, rows)}

    def _isolate_fault(
        self, out: SchedulerOutput, exc: Exception
    ) -> tuple[SchedulerOutput, dict, list[Request]]:
        """A step raised. Run each of its requests alone (re-running a chunk rewrites the same
        KV slots): those that succeed go on as if nothing happened, those that fail alone finish
        with the error. The engine counts a fault against its health only when nothing could
        run, not even a one-token probe; a fault that one request causes is that request's."""
        logger.warning(
            "engine step failed (%s: %s); retrying its %d request(s) one by one",
            type(exc).__name__,
            exc,
            len(out.scheduled),
        )
        survivors, sampled, failed = [], {}, []
        errors: dict[str, str] = {}
        for s in out.scheduled:
            try:
                sampled.update(self.executor.run([(s.request.request_id, s.num_new_tokens)]))
                survivors.append(s)
            except EngineDeadError:
                raise
            except Exception as alone:
                errors[s.request.request_id] = f"{type(alone).__name__}: {alone}"
                failed.append(s.request)
        engine_fault = not survivors and not self._probe()
        for req in failed:
            cause = errors[req.request_id]
            self.scheduler.fail_one(
                req,
                f"engine fault: {cause}"
                if engine_fault
                else f"request failed in the engine: {cause}",
            )
            logger.error("request %s failed: %s", req.request_id, cause)
        if engine_fault:
            self.consecutive_faults += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            self.fault_counts[type(exc).__name__] = self.fault_counts.get(type(exc).__name__, 0) + 1
            logger.error("engine fault (%d in a row): %s", self.consecutive_faults, self.last_error)
        else:
            self.consecutive_faults = 0
            self.num_request_faults += len(failed)
        kept = SchedulerOutput(scheduled=survivors, preempted=out.preempted, errored=out.errored)
        return kept, sampled, failed

    def _probe(self) -> bool:
        """Can the engine run a step at all? One token through the model, greedy, in a free
        block (a request that failed alone has just released its blocks)."""
        req = Request(self._internal_id("probe"), [0], SamplingParams(max_new_tokens=1))
        if not self.block_manager.can_allocate(req, 1):
            return False
        self.block_manager.allocate(req, 1)
        try:
            self._run_alone(req, 1)
            return True
        except EngineDeadError:
            raise
        except Exception:
            logger.exception("the engine's probe step failed too")
            return False
        finally:
            self.block_manager.free(req)
            self._release_alone(req)

    def _outputs(self, touched: list[Request]) -> list[RequestOutput]:
        outputs = []
        for req in touched:
            done = self._reported.get(req.request_id)
            if done is None:
                continue
            new = req.output_token_ids[done:]
            if not new and not req.is_finished:
                continue
            first = done == 0 and bool(new)
            outputs.append(
                RequestOutput(
                    request_id=req.request_id,
                    new_token_ids=new,
                    num_prompt_tokens=req.num_prompt_tokens,
                    num_output_tokens=req.num_output_tokens,
                    finished=req.is_finished,
                    finish_reason=req.finish_reason,
                    error=req.error,
                    new_logprobs=req.output_logprobs[done:],
                    num_cached_tokens=req.num_cached_tokens,
                    num_preemptions=req.num_preemptions,
                    arrival_time=req.arrival_time,
                    scheduled_time=req.scheduled_time,
                    first_token_time=req.first_token_time,
                    finish_time=req.finish_time,
                    prompt_logprobs=req.prompt_logprobs if first else None,
                )
            )
            self._reported[req.request_id] = req.num_output_tokens
            if req.is_finished:
                self._forget(req)
        idle = not self.scheduler.has_unfinished
        if idle and self.contracts.pending_finished and self.executor.dead_error is None:
            # Idle: no next step will carry these, so tell the runner now.
            self.executor.apply(StepContract(finished_ids=self.contracts.pending_finished))
            self.contracts.pending_finished = []
        return outputs

    def _forget(self, req: Request) -> None:
        if self.speculator is not None:  # a finished answer joins the suffix store
            done = req.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
            self.speculator.finish(req.request_id, req.output_token_ids if done else [])
        self._reported.pop(req.request_id, None)
        self.requests.pop(req.request_id, None)
        self.contracts.finish(req.request_id)  # the runner drops its state with the next step

    def abort_all(self, error: str | None = None) -> list[RequestOutput]:
        """Finish every unfinished request: aborted, or failed with `error` (a dead loop)."""
        status = RequestStatus.FINISHED_ERROR if error else RequestStatus.FINISHED_ABORTED
        reqs = list(self.requests.values())
        for req in reqs:
            self.scheduler.abort(req.request_id, status, error)
        return self._outputs(reqs)

    # ---- convenience --------------------------------------------------------------------
    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Logits (T, V) of every position of `token_ids`, computed through the paged cache
        (chunked by max_prefill_token_num, KV quantization applied) and freed afterwards.
        Call between steps; it needs enough free blocks for the whole sequence."""
        ids = self._encode(token_ids)
        self._check_prompt(ids[:-1] or ids)
        req = Request(self._internal_id("score"), ids, SamplingParams(max_new_tokens=1))
        bm = self.block_manager
        if not bm.can_allocate(req, len(ids)):
            raise RequestError(
                f"scoring {len(ids)} tokens needs {bm.blocks_needed(len(ids))} free KV blocks; "
                f"{bm.num_free_blocks} are free. Score when the engine is idle or shorten it.",
                param="prompt",
            )
        bm.allocate(req, len(ids))
        chunks = []
        try:
            while req.num_computed_tokens < len(ids):
                n = min(len(ids) - req.num_computed_tokens, self.plan.max_prefill_token_num)
                self.executor.apply(self.contracts.build([(req, n)], [], bm.block_table))
                chunks.append(self.executor.all_logits(req.request_id, n))
                req.num_computed_tokens += n
        finally:
            bm.free(req)
            self._release_alone(req)
        return torch.cat(chunks)

    def perplexity(self, token_ids: list[int]) -> float:
        """exp(mean negative log-likelihood of tokens 1..T-1 given their prefix)."""
        logits = self.score(token_ids)
        target = torch.tensor(token_ids[1:], device=logits.device)
        nll = torch.nn.functional.cross_entropy(logits[:-1], target)
        return float(torch.exp(nll))

    def generate(
        self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[Request]:
        """Run prompts to completion; returns the finished requests in prompt order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        reqs = [self.requests[i] for i in ids]
        while self.has_unfinished():
            self.step()
        return reqs

    @property
    def healthy(self) -> bool:
        return self.executor.dead_error is None and self.consecutive_faults < MAX_CONSECUTIVE_FAULTS

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do at tp=1). Idempotent."""
        self.executor.shutdown()

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_total=bm.num_blocks,
            kv_blocks_used=bm.num_used_blocks,
            kv_blocks_free=bm.num_free_blocks,
            num_preemptions=self.scheduler.stats.num_preemptions,
            prefix_cache_hit_rate=bm.hit_rate,
            prefix_cache_queries=bm.query_tokens,
            prefix_cache_hits=bm.hit_tokens,
            num_steps=self.scheduler.stats.num_steps,
            num_generated_tokens=self.num_generated_tokens,
            num_prompt_tokens=self.num_prompt_tokens,
            healthy=self.healthy,
            last_error=self.executor.dead_error or self.last_error,
            fault_counts=dict(self.fault_counts),
            num_request_faults=self.num_request_faults,
            spec_decode=None if self.speculator is None else self.speculator.snapshot(),
        )

    def _maybe_log_stats(self) -> None:
        now = time.monotonic()
        if now - self._last_stats_log < self.config.log_stats_interval_s:
            return
        self._last_stats_log = now
        s = self.stats()
        reasons = {}
        for r in self.scheduler.waiting:
            reasons[r.wait_reason] = reasons.get(r.wait_reason, 0) + 1
        spec = ""
        if s.spec_decode is not None and s.spec_decode.num_drafts:
            sd = s.spec_decode
            spec = (
                f", speculative: acceptance {100 * sd.acceptance_rate:.1f}%, mean accepted "
                f"length {sd.mean_acceptance_length:.2f} over {sd.num_drafts} drafts"
            )
        logger.info(
            "running %d, waiting %d %s, KV blocks %d/%d used, preemptions %d, prefix hit %.1f%%%s",
            s.num_running,
            s.num_waiting,
            reasons or "",
            s.kv_blocks_used,
            s.kv_blocks_total,
            s.num_preemptions,
            100 * s.prefix_cache_hit_rate,
            spec,
        )


def _captures_cuda_graphs(mc: ModelConfig, config: EngineConfig, device: torch.device) -> bool:
    """Decode CUDA graphs run on CUDA at tp=1 with the Triton attention backend, unless
    eager_mode. At tp > 1 a replayed graph's all-reduces would run outside the collective
    timeout that turns a dead rank into an error, so those engines decode eagerly."""
    if device.type != "cuda" or config.eager_mode:
        return False
    why = None
    if config.tp > 1:
        why = "tp > 1 (a replayed graph's all-reduces would bypass --dist-timeout-s)"
    elif platform.attention_backend(device) != "triton":
        why = "the torch attention backend plans on the host (STEADYLM_ATTENTION_BACKEND)"
    else:
        why = graph_blocker(mc)
    if why:
        logger.info("decode runs eagerly, without CUDA graphs: %s", why)
    return why is None


def make_plan(
    mc: ModelConfig,
    config: EngineConfig,
    device: torch.device,
    dtype: torch.dtype,
    weight_bytes: int,
) -> MemoryPlan:
    mem = platform.device_memory(device)
    plan = plan_memory(
        mc,
        config,
        mem,
        torch.tensor([], dtype=dtype).element_size(),
        weight_bytes=weight_bytes,
        is_cpu=device.type == "cpu",
        local_ranks=parallel.local_ranks(config.tp),
        cuda_graphs=_captures_cuda_graphs(mc, config, device),
    )
    logger.info("%s", plan.table())
    for note in plan.notes:
        logger.warning("%s", note)
    return plan
