"""The engine: requests in, tokens out, the CPU one step ahead of the GPU.

    loop:
        batch   <- schedule(step N+1)          # host only, no device reads
        launch(batch)                          # forward + sampling queued on the device
        process(result of step N)              # the one completion wait
It is the same code with overlap off: then each step is processed right after its launch.
"""
import hashlib
import itertools
import logging
import time
import weakref
from time import perf_counter
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from tandem import lifetime
from tandem.attention import make_attention_backend
from tandem.diagnostics.compiles import Compiles, watch_compiles
from tandem.diagnostics.debug_checks import DebugChecks
from tandem.diagnostics.errors import EngineDeadError, FatalErrorGuard, first_line, is_out_of_memory
from tandem.distributed.runtime import SingleProcess
from tandem.diagnostics.timeline import StepRecord, Timeline
from tandem.grammar import GrammarManager, MaskFill
from tandem.limits import context_error
from tandem.cuda_graph import DecodeGraphs, default_buckets
from tandem.kernels.extend_attention import extend_block_rows
from tandem.cascade_layout import max_group_rows, target_work_items
from tandem.config import EngineConfig, ModelConfig, resolve_device, resolve_dtype, resolve_kv_cache_dtype
from tandem.memory.allocator import SlotAllocator
from tandem.memory.host_kv import HostKVPool
from tandem.memory.kv_cache import KVCache, is_fp8
from tandem.memory.prefix_cache import HostTier, PrefixCache
from tandem.memory_budget import (MemoryBudget, graph_reserve, measure_activations, plan_kv_pool,
                                  profile_forward, request_buffers)
from tandem.memory.req_to_token import ReqToTokenTable
from tandem.models.checkpoint import builtin_model_path, open_checkpoint, open_tokenizer
from tandem.models.linear import check_fp8_support, quantize_model_fp8
from tandem.models.decoder import DecoderModel
from tandem.models.loader import load_model
from tandem.outputs import CompletionOutput, RequestOutput, StepOutput, TokenLogprob
from tandem.overlap.future_map import FutureMap
from tandem.overlap.kv_tier_copy import CopyPace, KVTierCopier, TierCopyStats
from tandem.overlap.results import ResultCopier
from tandem.overlap.staging import InputStager
from tandem.overlap.streams import StreamSet
from tandem.request import Request, Status
from tandem.prefill_graphs import MAX_ROWS, PrefillGraphs, graph_token_limit, prefill_buckets
from tandem.runner import ModelRunner, PendingResult
from tandem.sampling import Sampler, SamplingParams
from tandem.sampling.prompt_logprobs import PromptLogprobs
from tandem.sampling.bias import BAN, BadWordsMask, min_tokens_bias, static_bias
from tandem.sampling.params import check_unicode
from tandem.scheduler import ScheduledBatch, Scheduler, SchedulerConfig, request_slot_count
from tandem.scheduler.cascade import CascadeRule
from tandem.speculative.config import SpeculativeConfig
from tandem.speculative.draft import DraftProposer, check_draft
from tandem.speculative.graphs import VerifyGraphs
from tandem.speculative.metrics import SpecCounters
from tandem.speculative.planner import VerifyPlanner, note_plain, note_verified
from tandem.speculative.state import SpecState
from tandem.text import RequestText, token_pieces
from tandem.warmup import warm_up

log = logging.getLogger("tandem")


class Engine:
    def __init__(self, cfg: EngineConfig, parallel=None):
        """`parallel`: this process's part in a tensor-parallel group (rank 0's `Leader` or a
        worker's runtime), built by the entry point (`tandem.entrypoints.ranks.build_engine`);
        None for one process. The engine owns it from here: close() or a failed start closes it."""
        self.cfg = cfg
        self.closed = False
        self.parallel = parallel if parallel is not None else SingleProcess()
        try:
            if self.parallel.tp.size != cfg.tensor_parallel_size:
                raise ValueError(f"tensor_parallel_size={cfg.tensor_parallel_size} needs its ranks: build "
                                 "the engine with tandem.entrypoints.ranks.build_engine (LLM() and the "
                                 "commands do)")
            self.device = resolve_device(cfg.device)
            path = cfg.model if cfg.model is not None else builtin_model_path()
            ckpt = open_checkpoint(path, allow_pickle=cfg.allow_pickle, config_only=cfg.dummy_weights)
            self.model_config = ModelConfig.from_hf(ckpt.config)
            self._build(cfg, ckpt, path)
        except BaseException:
            self.parallel.close()  # no worker outlives a failed start
            raise

    def _build(self, cfg: EngineConfig, ckpt, path) -> None:
        self.dtype = resolve_dtype(cfg.dtype, self.device, self.model_config.dtype)
        self.kv_dtype = self._kv_cache_dtype()  # before the model loads: a bad value fails fast
        self.tokenizer = open_tokenizer(cfg.tokenizer, ckpt)
        if cfg.tokenizer is not None and len(self.tokenizer) > self.model_config.vocab_size:
            raise ValueError(f"tokenizer={cfg.tokenizer!r} has {len(self.tokenizer)} tokens, more than the "
                             f"model's vocabulary ({self.model_config.vocab_size})")
        self.token_pieces = token_pieces(self.tokenizer)  # ids' texts, learned once for every request
        self.max_model_len = min(cfg.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings)
        # Request slots: the running requests' plus spares (admissions beside leaving requests).
        self.num_request_slots = request_slot_count(cfg.max_running_requests)
        started = time.monotonic()
        self.model = load_model(ckpt, self.model_config, self.dtype, self.device,
                                self.max_model_len, cfg.dummy_weights, self.parallel.tp)
        log.info("loaded %s in %.1fs", path, time.monotonic() - started)
        self._quantize()
        self.speculative = self._speculative_config()
        self.draft_model = self._load_draft()
        self.gemm_tuning = self._tune_gemms()
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        self._eos_ids: frozenset[int] = frozenset()  # _shared_eos_ids
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.backend = make_attention_backend(cfg.attention_backend, self.device, cfg.experiments)
        self.debug = DebugChecks.from_env()  # TANDEM_DEBUG_*: read once, for this engine's life
        self._build_memory()
        self.parallel.connect(self.device)
        self._build_loop()
        # A worker's steps are rank 0's plan: the same step loop, fed by the step channel.
        self.scheduler = self.parallel.plan_source(self.scheduler, self.runner.admit, self.kv_tier)
        self.parallel.ready()
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._carried: list[StepOutput] = []  # made outside step() (aborts, cancel): the next step returns them
        self.pending: PendingResult | None = None
        self.timeline = None
        self._previous_forward_end = None
        self.step_id = 0
        self.completed_step = -1
        self.fatal = FatalErrorGuard(log)
        self.collector = lifetime.ShadowCollector(cfg.experiments.collect_in_shadow)
        self.warm_up_s = self._warm_up()
        self.builds_while_serving = Compiles()  # Triton builds after the warm-up (none expected)
        self._stop_build_watch = (watch_compiles(_warn_of_build(self.builds_while_serving))
                                  if self.warm_up_s > 0 else lambda: None)
        weakref.finalize(self, self._stop_build_watch)  # an engine dropped unclosed stops watching too
        self.timeline = (Timeline(cfg.timeline if isinstance(cfg.timeline, str) else None,
                                  max_records=cfg.timeline_max_records) if cfg.timeline else None)
        self.runner.timing = self.timeline is not None and self.device.type == "cuda"
        lifetime.freeze(self)  # what was built so far lives as long as the engine: no GC scans

    # ---- construction ----
    def _warm_up(self) -> float:
        """Compile and load every kernel serving hits before the first request (CUDA)."""
        mode = self.cfg.warm_up
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"warm_up must be auto, on or off; got {mode!r}")
        if mode == "off" or (mode == "auto" and self.device.type != "cuda"):
            return 0.0
        if self.parallel.tp.rank > 0:  # a tensor-parallel worker runs rank 0's warm-up steps
            return 0.0
        seconds = warm_up(self)
        log.info("warm-up: %.1fs", seconds)
        return seconds

    def _speculative_config(self) -> SpeculativeConfig | None:
        # Under tensor parallelism every rank keeps the same device state and verdicts (the
        # logits are gathered, draws counter-keyed); a draft model runs whole on every rank.
        return SpeculativeConfig.from_user(self.cfg.speculative_config)

    def _load_draft(self) -> DecoderModel | None:
        """The draft model of speculative_config's method 'draft_model', in the target's dtype
        (not quantized); the context is capped at the draft's."""
        spec, cfg = self.speculative, self.cfg
        if spec is None or spec.method != "draft_model":
            return None
        try:
            ckpt = open_checkpoint(spec.model, allow_pickle=cfg.allow_pickle, config_only=cfg.dummy_weights)
            config = ModelConfig.from_hf(ckpt.config)
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"speculative_config: the draft model {spec.model!r}: {e}") from None
        check_draft(config, ckpt.load_tokenizer(), self.model_config, self.tokenizer)
        if config.max_position_embeddings < self.max_model_len:
            if cfg.max_model_len is not None:
                raise ValueError(f"speculative_config: the draft model takes {config.max_position_embeddings} "
                                 f"positions, fewer than max_model_len={cfg.max_model_len}")
            log.warning("the draft model takes %d positions: max_model_len %d -> %d",
                        config.max_position_embeddings, self.max_model_len, config.max_position_embeddings)
            self.max_model_len = config.max_position_embeddings
        started = time.monotonic()
        model = load_model(ckpt, config, self.dtype, self.device, self.max_model_len, cfg.dummy_weights)
        log.info("loaded the draft model %s in %.1fs", spec.model, time.monotonic() - started)
        return model

    def _kv_cache_dtype(self) -> torch.dtype:
        """The KV pools' element type (target and draft alike, every rank the same)."""
        dtype = resolve_kv_cache_dtype(self.cfg.kv_cache_dtype, self.dtype)
        if is_fp8(dtype):  # the kernels' e4m3 conversions need the FP8 hardware too
            check_fp8_support(self.device, f"kv_cache_dtype={self.cfg.kv_cache_dtype!r}")
        return dtype

    def _quantize(self) -> None:
        if self.cfg.quantization is None:
            return
        if self.cfg.quantization != "fp8":
            raise ValueError(f"quantization must be None or 'fp8'; got {self.cfg.quantization!r}")
        check_fp8_support(self.device)
        if self.device.type == "cuda" and self.dtype != torch.bfloat16:
            raise ValueError(f"quantization='fp8' on CUDA needs dtype bfloat16, got {self.dtype}")
        n = quantize_model_fp8(self.model, fused_input=self.cfg.experiments.fp8_fused_input)
        log.info("quantized %d linear layers to fp8 (e4m3, per output channel)", n)

    def _tune_gemms(self) -> dict:
        """Before graph capture: the captured forward uses each layer's tuned plan."""
        mode = self.cfg.small_m_gemm
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"small_m_gemm must be auto, on or off; got {mode!r}")
        if mode == "on" and self.device.type != "cuda":
            raise ValueError("small_m_gemm='on' needs a CUDA device")
        # float32 models keep cuBLAS: the kernels' tl.dot would round inputs to tf32.
        if mode == "off" or self.device.type != "cuda" or self.dtype == torch.float32:
            return {}
        from tandem.kernels.gemm_tuner import tune_model
        models = [self.model] + ([self.draft_model] if self.draft_model is not None else [])
        return tune_model(torch.nn.ModuleList(models), self.dtype,
                          fuse_norm=self.cfg.experiments.fused_norm_gemm)

    def _build_memory(self) -> None:
        mc, cfg = self.model.local_config, self.cfg  # this rank's KV heads
        per_token = KVCache.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, self.kv_dtype)
        draft = self.draft_model.local_config if self.draft_model is not None else None
        if draft is not None:  # the draft's KV has the target pool's slots
            per_token += KVCache.bytes_per_token(draft.num_layers, draft.num_kv_heads, draft.head_dim,
                                                 self.kv_dtype)
        self.memory: MemoryBudget | None = None
        if cfg.max_total_tokens is not None:
            num_tokens = cfg.max_total_tokens
        elif self.device.type == "cuda":
            self.memory = self._plan_device_memory(per_token)
            num_tokens = self.memory.kv_pool // per_token
            log.info("%s", self.memory.describe(num_tokens))
        else:
            num_tokens = cfg.cpu_kv_cache_bytes // per_token
        num_tokens = min(num_tokens, cfg.max_running_requests * self.max_model_len)
        num_tokens = self.parallel.agree_min("kv_tokens", num_tokens)  # every rank the same pool
        if num_tokens < 2:
            raise ValueError(f"KV pool of {num_tokens} tokens is too small")
        self.max_model_len = min(self.max_model_len, num_tokens)
        self.kv = KVCache(mc.num_layers, num_tokens + 1, mc.num_kv_heads, mc.head_dim, self.kv_dtype, self.device)
        self.draft_kv = (KVCache(draft.num_layers, num_tokens + 1, draft.num_kv_heads, draft.head_dim, self.kv_dtype,
                                 self.device) if draft is not None else None)
        self.kv_slots = SlotAllocator(num_tokens)  # slot 0 is the dummy slot
        self.streams = StreamSet.create(self.device)
        self.kv_tier = self._build_host_tier()
        self.tier_pace = (CopyPace(self.kv_tier.host.token_bytes, most_tokens=cfg.max_prefill_tokens)
                          if self.kv_tier is not None else None)
        host = (HostTier(self.kv_tier.host.host_slots, self.kv_tier.write_back, self.kv_tier.load,
                         self.kv_tier.require, self.kv_tier.done,
                         load_tokens_per_step=cfg.max_prefill_tokens,
                         admit_after_prefetch=cfg.experiments.host_kv_prefetch
                         and cfg.experiments.host_kv_admit_after_prefetch,
                         fifo_beyond_prefetch=cfg.experiments.host_kv_fifo_beyond_prefetch,
                         prefetch_requests=cfg.experiments.host_kv_prefetch_requests)
                if self.kv_tier is not None else None)
        self.prefix_cache = PrefixCache(self.kv_slots, enabled=cfg.enable_prefix_caching,
                                        debug=self.debug.prefix_cache, host=host)
        self.req_slots = SlotAllocator(self.num_request_slots)  # row 0 is the padding row
        self.table = ReqToTokenTable(self.num_request_slots, self.max_model_len, self.device)
        log.info("KV pool: %d tokens (%.1f MiB, %s)", num_tokens, num_tokens * per_token / 2**20,
                 str(self.kv_dtype).removeprefix("torch."))

    def _build_host_tier(self) -> KVTierCopier | None:
        """The prefix cache's host tier (host_kv_cache_gb > 0): pinned on CUDA."""
        cfg = self.cfg
        if cfg.host_kv_cache_gb < 0:
            raise ValueError(f"host_kv_cache_gb must be >= 0; got {cfg.host_kv_cache_gb}")
        if cfg.host_kv_cache_gb == 0 or not cfg.enable_prefix_caching:
            return None
        # Every cache the pool's slots index moves with them: a draft's KV shares the target's.
        caches = [self.kv] + ([self.draft_kv] if self.draft_kv is not None else [])
        per_token = HostKVPool.bytes_per_token(caches)
        num = self.parallel.agree_min("host_kv_tokens", HostKVPool.num_slots_for(cfg.host_kv_cache_gb, per_token))
        if num < 1:
            raise ValueError(f"host_kv_cache_gb={cfg.host_kv_cache_gb} holds no token ({per_token} bytes each)")
        host = HostKVPool(caches, num, pin=self.device.type == "cuda")
        log.info("host KV tier: %d tokens (%.1f GiB pinned%s)", num, num * per_token / 2**30,
                 ", target and draft KV" if len(caches) > 1 else "")
        return KVTierCopier(caches, host, self.streams, precise=cfg.experiments.host_kv_precise_fence)

    def _plan_device_memory(self, per_token: int) -> MemoryBudget:
        """Profile the largest step, then give the pool what is left of total x utilization."""
        mc, cfg, dev = self.model_config, self.cfg, self.device
        tokens = cfg.max_prefill_tokens
        activations = measure_activations(dev, lambda: profile_forward(
            self.model, self.backend, mc.num_layers, mc.num_kv_heads, mc.head_dim, self.kv_dtype, dev,
            tokens, self.max_model_len, mc.vocab_size, cfg.max_running_requests))
        free, total = torch.cuda.mem_get_info(dev)
        models = [self.model] + ([self.draft_model] if self.draft_model is not None else [])
        weights = sum(t.nbytes for m in models for t in itertools.chain(m.parameters(), m.buffers()))
        graphs = graph_reserve(self._graph_max_batch(), mc.vocab_size, activations, tokens,
                               self._prefill_graph_tokens())
        buffers = request_buffers(self.num_request_slots, self.max_model_len, mc.vocab_size)
        return plan_kv_pool(total, cfg.gpu_memory_utilization, total - free, weights, activations, buffers,
                            graphs, per_token, min_tokens=self._min_pool_tokens())

    def _min_pool_tokens(self) -> int:
        """A pool must hold one request of the context the user asked for; without an explicit
        max_model_len a smaller pool only shortens the context (down to one prefill step)."""
        if self.cfg.max_model_len is not None:
            return self.max_model_len
        return min(self.max_model_len, self.cfg.max_prefill_tokens)

    def _graphs_usable(self) -> bool:
        cfg = self.cfg
        if cfg.cuda_graph not in ("auto", "on", "off"):
            raise ValueError(f"cuda_graph must be auto, on or off; got {cfg.cuda_graph!r}")
        usable = self.device.type == "cuda" and self.backend.name == "triton"
        if cfg.cuda_graph == "on" and not usable:
            raise ValueError("cuda_graph='on' needs a CUDA device and the Triton attention backend")
        return usable and cfg.cuda_graph != "off"

    def _graph_buckets(self) -> list[int]:
        return default_buckets(min(self.cfg.cuda_graph_max_batch, self.cfg.max_running_requests))

    def _graph_max_batch(self) -> int:
        return self._graph_buckets()[-1] if self._graphs_usable() else 0

    def _prefill_graph_tokens(self) -> int:
        """The largest prefill step graphed (0: none). Not with a draft model: its forward reads
        the same batch, and its attention tiles can differ from the block table's."""
        if not (self._graphs_usable() and self.cfg.experiments.prefill_graphs) or self.draft_model is not None:
            return 0
        params = sum(p.numel() for p in self.model.parameters())
        tokens = graph_token_limit(params, self.cfg.max_prefill_tokens, self.cfg.experiments.prefill_graph_max_tokens)
        return tokens if tokens >= 16 else 0

    def _build_loop(self) -> None:
        cfg, rows, spec = self.cfg, self.cfg.max_running_requests, self.speculative
        max_tokens = max(cfg.max_prefill_tokens, self.max_model_len) + rows
        reused = 4 * max(cfg.max_prefill_tokens, self.max_model_len)  # reused-prefix table entries
        k = spec.num_speculative_tokens if spec is not None else 0
        # A verify step: 2 ints per query token, 4 per row, 3 per reserved slot (2 (k + 1) a row).
        verify = rows * (2 * (k + 1) + 5 + 6 * (k + 1)) if spec is not None else 0
        # Per token: id, position, KV slot, request slot, and for prompt logprobs row and target.
        cascade = 8 * rows + 4 * 512  # a cascade plan: 4 ints a row, <= rows / 2 + 1 offsets, 4 a work item
        self.stager = InputStager(self.streams, capacity=6 * max_tokens + reused + 10 * rows + 16 + verify + cascade,
                                  coarse=cfg.experiments.coarse_war_barrier)
        # A verify row's result: accepted, proposed, then its k + 1 samples.
        self.copier = ResultCopier(self.streams, max_rows=rows * (k + 3) if spec is not None else rows)
        slots = self.num_request_slots  # per-request state: request slots (rows: a step's batch rows)
        self.sampler = Sampler(self.model_config.vocab_size, slots + 1, self.device)
        self.spec_state = self._spec_state(k) if spec is not None else None
        self.spec_counters = SpecCounters(k)
        self.future_map = FutureMap(slots, self.device, debug=self.debug.future_map)
        # Constraints are refused under tensor parallelism: no grammar pool to prepare there.
        self.grammar = GrammarManager(self.tokenizer, self.model_config.vocab_size, sorted(self.eos_token_ids),
                                      self.streams, rows, cfg.grammar_threads, cfg.grammar_compile_timeout,
                                      enabled=self.parallel.tp.size == 1)
        cascade = self._cascade_rule()
        graphs = self._capture_graphs(cascade)
        self.runner = ModelRunner(self.model, self.kv, self.table, self.backend, self.sampler,
                                  self.future_map, self.streams, self.stager, self.copier, graphs,
                                  mirror=self.parallel.sender, spec=self.spec_state,
                                  verify_graphs=self._capture_verify_graphs(),
                                  single_query_graphs=self._capture_verify_graphs(single_query=True), cascade=cascade,
                                  prefill_graphs=self._capture_prefill_graphs(graphs))
        self.scheduler = Scheduler(
            SchedulerConfig(rows, cfg.max_prefill_tokens, cfg.chunked_prefill_size, cfg.enable_mixed_batch,
                            cfg.schedule_policy, max_reused_tokens_per_step=reused,
                            mixed_prefill_budget=cfg.mixed_prefill_budget,
                            admit_beside_leaving=cfg.experiments.admit_beside_leaving,
                            held_places=cfg.experiments.host_kv_held_places),
            self.prefix_cache, self.req_slots, on_admit=self.runner.admit,
            verify=VerifyPlanner(spec, cfg.experiments.spec_verify_min_match) if spec is not None else None)

    def _cascade_rule(self) -> CascadeRule | None:
        """The experiment's switch; off under tensor parallelism (workers' requests carry no
        tree paths, and every rank must run the same attention) and speculative decoding (the
        draft model's forward reads the same batch with its own head layout)."""
        mode = self.cfg.experiments.cascade_attention
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"experiments.cascade_attention must be auto, on or off; got {mode!r}")
        if mode == "off" or self.parallel.tp.size > 1 or self.speculative is not None:
            return None
        cfg = self.model_config
        rows = max_group_rows(cfg.num_heads, cfg.num_kv_heads)
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count if self.device.type == "cuda" else 4
        items = target_work_items(sms, cfg.num_kv_heads)
        kv_bytes = KVCache.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.kv_dtype)
        rule = CascadeRule.forced(rows, items) if mode == "on" else CascadeRule.for_model(rows, items, kv_bytes)
        # A group's queries must fit the shared pass's tile: too few rows fit, nothing groups.
        return rule if rule.max_group_rows >= rule.min_group_rows else None

    def _spec_state(self, k: int) -> SpecState:
        spec, rows = self.speculative, self.num_request_slots  # per request slot
        if spec.method == "ngram":
            return SpecState.ngram(rows, self.max_model_len, k, spec.prompt_lookup_min, spec.prompt_lookup_max,
                                   self.device, fused=self.device.type == "cuda" and self.backend.name == "triton")
        draft = DraftProposer(self.draft_model, self.draft_kv, self.backend, self.table, k, self.sampler.token_hash,
                              rows, self.device, coupled=self.cfg.experiments.spec_coupled_draft)
        return SpecState(rows, self.max_model_len, k, self.device, draft)

    def _capture_graphs(self, cascade: CascadeRule | None) -> DecodeGraphs | None:
        if not self._graphs_usable():
            return None
        draft = self.spec_state.draft if self.spec_state is not None else None
        graphs = DecodeGraphs(self.model, self.kv, self.table, self.backend, self.future_map, self.streams,
                              self.stager, self._graph_buckets(), self.max_model_len, draft, cascade,
                              per_ring_slot=self.cfg.experiments.decode_graph_per_ring_slot)
        graphs.capture()
        return graphs

    def _capture_prefill_graphs(self, decode: DecodeGraphs | None) -> PrefillGraphs | None:
        """Prefill-only steps up to `_prefill_graph_tokens()`, in the decode graphs' memory pool
        and logits buffer."""
        tokens = self._prefill_graph_tokens()
        if decode is None or not tokens:
            return None
        block = extend_block_rows(self.model_config.head_dim)
        buckets = prefill_buckets(tokens, min(MAX_ROWS, decode.max_batch), block)
        graphs = PrefillGraphs(self.model, self.kv, self.table, self.backend, self.streams, self.stager,
                               buckets, block, self.max_model_len, decode.logits)
        graphs.capture(decode.pool)
        return graphs

    def _capture_verify_graphs(self, single_query: bool = False) -> VerifyGraphs | None:
        """Verify steps of up to disable_by_batch_size rows, graphed like decode steps; with
        `single_query`, the set for the verify steps where no row proposes (one query a row;
        `Experiments.verify_single_query_graphs`)."""
        spec = self.speculative
        if spec is None or not self._graphs_usable():
            return None
        if single_query and not self.cfg.experiments.verify_single_query_graphs:
            return None
        buckets = [b for b in self._graph_buckets() if b <= spec.disable_by_batch_size]
        if not buckets or buckets[-1] < min(spec.disable_by_batch_size, self.cfg.max_running_requests):
            buckets.append(min(spec.disable_by_batch_size, self.cfg.max_running_requests))
        graphs = VerifyGraphs(self.model, self.kv, self.table, self.backend, self.future_map, self.streams,
                              self.stager, self.spec_state, buckets, self.max_model_len,
                              extend_max_rows=self.cfg.experiments.verify_extend_max_rows,
                              queries=1 if single_query else None)
        graphs.capture()
        return graphs

    # ---- lifetime ----
    def close(self) -> None:
        """Release everything the engine holds: device memory goes back to what it was before
        the engine (once nothing else in the process holds it). Idempotent; afterwards every
        request or step raises."""
        if self.closed:
            return
        self.closed = True
        self._stop_build_watch()
        usable = not self.dead
        self.parallel.close()  # tensor-parallel workers first: they stop stepping with rank 0
        if usable and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # nothing queued may still touch the pool
        if self.timeline is not None:
            self.timeline.close()
        if self.kv_tier is not None:
            self.kv_tier.close()  # the pinned pool itself goes with _DEVICE_STATE below
        if self.runner.graphs is not None:
            self.runner.graphs.close()
        for verify in (self.runner.verify_graphs, self.runner.single_query_graphs):
            if verify is not None:
                verify.close()
        if self.runner.prefill_graphs is not None:
            self.runner.prefill_graphs.close()
        self.grammar.shutdown()  # its compile threads end; queued compilations are cancelled
        pinned = usable and self.kv_tier is not None and self.device.type == "cuda"
        # Drop every reference to device state; the scheduler's admit hook refers back to
        # the engine, so this also breaks the engine's reference cycles.
        for name in _DEVICE_STATE:
            vars(self).pop(name, None)
        self.requests, self._carried, self.pending = {}, [], None
        lifetime.return_memory(self, self.device, usable)
        if pinned:
            _return_pinned_memory()  # the host tier's pool is gone: its pinned pages go back to the OS

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("the engine is closed (close() was called); create a new one")

    # ---- requests ----
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, detokenize: bool = True) -> str:
        """Queue a request; returns its id. `detokenize=False`: the engine makes no text for it
        unless it has stop strings (they need the text, step by step): each output names the ids
        whose text the caller makes (`StepOutput.text_ids`), and `output()` has no text."""
        self._check_open()
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}; "
                            "build one with SamplingParams(**...)")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token-id lists")
            check_unicode(prompt, "prompt")
            ids = tuple(self.tokenizer.encode(prompt))
        else:
            ids = _token_ids(prompt)
        self._check_prompt(ids, params)
        self.grammar.check(params)
        if params.constraint is not None and self.parallel.tp.size > 1:
            raise ValueError("structured output (constraint) is not supported with tensor_parallel_size > 1 yet")
        bias, bad_words = static_bias(params, self.tokenizer, self.model_config.vocab_size)
        if sum(value == BAN for _, value in bias) >= self.model_config.vocab_size:
            raise ValueError(f"{NO_TOKEN_ERROR}: bad_words ban every token of the vocabulary")
        if bad_words and params.constraint is not None:
            raise ValueError("bad_words of several tokens cannot be combined with structured output yet")
        if (bias or bad_words or params.min_tokens) and self.parallel.tp.size > 1:  # ranks > 0 lack them
            raise ValueError("logit_bias, bad_words and min_tokens are not supported with "
                             "tensor_parallel_size > 1 yet")
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        seed = params.seed if params.seed is not None else _derived_seed(self.cfg.seed, rid)
        stop_ids = frozenset() if params.ignore_eos else self._shared_eos_ids()
        if params.stop_token_ids:
            stop_ids = stop_ids | frozenset(params.stop_token_ids)
        engine_text = self.tokenizer is not None and (detokenize or bool(params.stop))
        text = (RequestText(self.tokenizer, ids, params.stop, params.skip_special_tokens,
                            params.include_stop_str_in_output, self.token_pieces) if engine_text else None)
        req = Request(rid, ids, params, seed, max_samples=params.max_tokens or self.max_model_len - len(ids),
                      stop_ids=stop_ids, prompt=prompt if isinstance(prompt, str) else None, text=text,
                      text_outside=self.tokenizer is not None and not engine_text,
                      bias=bias, min_tokens_bias=min_tokens_bias(params, stop_ids))
        if bad_words:  # their last token is banned after the rest: the per-step mask path
            self.grammar.give_mask(req, BadWordsMask(self.model_config.vocab_size, bad_words, ids))
        self.requests[rid] = req
        if params.constraint is not None:
            self.grammar.add(req)  # scheduled once its grammar compiled (off the loop)
        else:
            self.scheduler.add(req)
        return rid

    def _shared_eos_ids(self) -> frozenset[int]:
        """The EOS ids as one set object shared by the requests that stop on them alone: each
        step looks every row's token up in its request's set, and one set stays in the CPU's
        caches where a set per request would not."""
        eos = frozenset(self.eos_token_ids)
        if eos != self._eos_ids:
            self._eos_ids = eos
        return self._eos_ids

    def _check_prompt(self, ids: tuple[int, ...], params: SamplingParams) -> None:
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}")
        too_long = context_error(self.max_model_len, len(ids), params.max_tokens)
        if too_long:
            raise ValueError(too_long)
        if params.num_samples != 1:
            raise ValueError("Engine.add_request runs one sequence: expand n / best_of into "
                             "separate requests (LLM.generate and the server do)")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none")

    def abort(self, request_id: str) -> None:
        self._end(request_id, "abort")

    def _end(self, request_id: str, reason: str, error: str | None = None, error_status: int = 500,
             error_code: str | None = None) -> None:
        """Finish a request from outside the sampled tokens (abort, or a step that failed);
        the caller gets its final output at the next step."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return
        self._finish(req, reason)
        self._carried.append(StepOutput(request_id, [], req.text.finish() if req.text else "", True, reason,
                                        num_cached_tokens=req.num_cached_tokens, error=error,
                                        error_status=error_status, error_code=error_code,
                                        text_ids=_no_text_ids(req)))

    def has_unfinished(self) -> bool:
        return not self.closed and (self.scheduler.has_work() or self.pending is not None
                                    or bool(self._carried) or self.grammar.has_pending())

    def output(self, request_id: str) -> RequestOutput:
        req = self.requests[request_id]
        lps = req.output_logprobs if req.params.logprobs is not None else None
        seq = CompletionOutput(0, req.text.text if req.text else "", list(req.output_token_ids),
                               sum(lp.logprob for lp in lps) if lps is not None else None, lps,
                               req.finish_reason, req.stop_reason)
        prompt_lps = self._prompt_logprobs(req) if req.params.prompt_logprobs is not None else None
        return RequestOutput(request_id, req.prompt, list(req.prompt_token_ids), [seq], prompt_lps,
                             num_preemptions=req.num_preemptions, num_cached_tokens=req.num_cached_tokens)

    def cancel(self, request_ids: list[str]) -> None:
        """Abort exactly these requests and forget them; every other request keeps running.

        The in-flight step is processed here (its results for other requests are kept for the
        next `step()`), so no launched step can still read the cancelled requests' KV: it is
        free when this returns.
        """
        gone = set(request_ids)
        for rid in request_ids:
            self.abort(rid)
        outputs: list[StepOutput] = []
        self._process_in_flight(outputs)
        self._carried = [o for o in self._carried + outputs if o.request_id not in gone]
        for rid in request_ids:
            if rid in self.requests:
                self.release(rid)

    def release(self, request_id: str) -> None:
        """Forget a finished request's bookkeeping (its KV was already freed or deferred)."""
        req = self.requests.pop(request_id)
        assert req.finished, "release() of a running request"

    # ---- the loop ----
    def step(self) -> list[StepOutput]:
        """One turn of the loop. A sticky CUDA error stops the engine: it is logged once and
        every later call raises EngineDeadError at once, touching no CUDA state."""
        self._check_open()
        self.fatal.check()
        self.parallel.check()
        try:
            return self._step()
        except Exception as exc:
            self.parallel.check(grace_s=2.0)  # a dead worker explains a failed collective: say that
            self.fatal.observe(exc)
            raise

    def _step(self) -> list[StepOutput]:
        outputs, self._carried = self._carried, []
        try:
            self._run_step(outputs)
        except BaseException:
            self._carried = outputs + self._carried  # nothing processed is lost: the next step() returns it
            raise
        outputs += self._carried  # requests failed with their step
        self._carried = []
        return outputs

    def _run_step(self, outputs: list[StepOutput]) -> None:
        self._admit_compiled(outputs)
        t0 = perf_counter()
        batch = self.scheduler.schedule(self.step_id, process_in_flight=lambda: self._process_in_flight(outputs))
        if batch is None:  # nothing to launch: the pending result is processed at once
            self._process_in_flight(outputs)
            return
        masked = self.grammar.constrains(batch)
        masks_first = masked and not self.cfg.experiments.grammar_overlap  # the A/B: masks before the forward
        if self.pending is not None and (self._process_first(batch) or masks_first):
            self._process_in_flight(outputs)
        t1 = perf_counter()
        if self.kv_tier is not None:  # the forward waits on the device for the tier copies it needs
            self.kv_tier.require(self.kv_slots.copy_needed, cause="slot_reuse")  # cooling slots this plan took
            copies = self.kv_tier.fence(self.streams.forward, timed=self.timeline is not None)
            if self.runner.mirror is not None:
                self.runner.mirror.tier_copies(copies, self.kv_tier.fenced)  # each rank copies its own shard
        try:
            launched = self.runner.launch(batch, defer_sampling=masked)
        except BaseException as exc:
            self._launch_failed(batch, exc, outputs)
            return
        if self.timeline is not None:
            launched.record = _step_record(batch, t0, t1, perf_counter())
            launched.record.stage_ahead_ms = launched.staged_ahead_ms
            if self.kv_tier is not None:
                launched.record.host_load_tokens, launched.record.host_write_back_tokens = self.kv_tier.fenced_tokens
                launched.tier_wait = self.kv_tier.fence_wait
        previous, self.pending = self.pending, launched  # in flight before anything else can fail
        early_window = self.kv_tier is not None and self.cfg.experiments.host_kv_window_before_wait
        deferred_error = self._tier_window() if early_window else None
        if previous is not None:
            self.scheduler.prepare_waiting()  # host time the wait for step N would idle away
            if deferred_error is None and not masked and batch.is_decode:
                deferred_error = self._plan_ahead(batch.step + 1)
        try:
            if masked:  # N's tokens first: fill N+1's masks and queue its sampling, then N's text
                self._sample_masked_then_text(launched, previous, outputs)
            elif previous is not None:
                outputs.extend(self._process(previous))  # step N's result, while step N+1 runs
        except BaseException as exc:
            if launched.host is None:  # N+1's sampling never ran: undo the step as a failed launch
                self.pending = None
                self._launch_failed(batch, exc, outputs)  # its step number is planned again, like a launch's
                return
            self._count_launched(launched)  # N+1 is fully queued: it stays in flight
            raise
        self._count_launched(launched)
        if deferred_error is not None:
            raise deferred_error  # after step N's outputs are in `outputs`: none is lost
        if self.cfg.disable_overlap:
            self._process_in_flight(outputs)
        if self.kv_tier is not None and not early_window:
            self._move_between_tiers()
        if self.prefix_cache.debug:
            self.prefix_cache.check(self.scheduler.kv_holders())

    def _tier_window(self) -> BaseException | None:
        """The tier window before step N's result is waited for: its host work (tree walks,
        copy launches) fills time the host would spend waiting, not the gap before the next
        plan. Returns its error instead of raising it, so that N is processed first."""
        try:
            self._move_between_tiers()
        except BaseException as exc:  # noqa: B036 (re-raised by the caller once N is processed)
            return exc
        return None

    def _plan_ahead(self, step: int) -> BaseException | None:
        """In the wait for step N, after a decode step N+1 was launched: plan a prefill step
        N+2 now (`Scheduler.plan_ahead`), not after N's result, where only the short decode
        step covers its plan, and stage its inputs (`ModelRunner.stage_ahead`). A masked step's
        plan is not followed ahead (its sampling, after the wait, may still roll it back).
        Returns its error instead of raising it, so that N is processed first."""
        exp = self.cfg.experiments
        if not exp.plan_prefill_ahead:
            return None
        try:
            planned = self.scheduler.plan_ahead(step)
        except BaseException as exc:  # noqa: B036 (re-raised by the caller once N is processed)
            return exc
        if planned is not None and exp.stage_prefill_ahead:
            self.runner.stage_ahead(planned)
        return None

    def _move_between_tiers(self) -> None:
        """The window after a launch: host-tier copies queued now run beside the forward, and
        the next plan (which may need a prefill step's slots) finds them done. Loads go first
        (a waiting request's TTFT), write-ahead takes what is left of the window's copy time."""
        cfg, cache, tier, exp = self.cfg, self.prefix_cache, self.kv_tier, self.cfg.experiments
        started = time.perf_counter()
        self.tier_pace.tick(started, prefill=self.pending is not None and self.pending.batch.has_prefill)
        window = self.tier_pace.window(shared=exp.host_kv_shared_pace)
        load_rate, write_back_rate = tier.bytes_per_s("load"), tier.bytes_per_s("write_back")
        next_need = cfg.max_prefill_tokens + len(self.scheduler.running)
        if exp.host_kv_prefetch:
            before = tier.queued_bytes()
            rates = (load_rate, write_back_rate) if exp.host_kv_prefetch_evicts else (load_rate,)
            cache.prefetch(self.scheduler.waiting, keep=next_need, most=window.tokens(*rates), evict=exp.host_kv_prefetch_evicts)
            (loaded, written), (load0, written0) = tier.queued_bytes(), before
            window.spend(loaded - load0, load_rate)
            window.spend(written - written0, write_back_rate)
        if exp.host_kv_write_ahead:
            cache.write_ahead(next_need, most=window.tokens(write_back_rate))
            if exp.host_kv_evict_ahead and self.scheduler.waiting:  # a prefill plan may come next
                cache.evict_ahead(next_need)
        if self.pending is not None and self.pending.record is not None:
            self.pending.record.tier_window_ms = (time.perf_counter() - started) * 1e3

    def _count_launched(self, launched: PendingResult) -> None:
        """A step is numbered and recorded once it is fully queued (a step undone before that
        gives its number to the retry)."""
        self.step_id += 1
        if launched.record is not None:
            self.timeline.add(launched.record)

    def _sample_masked_then_text(self, launched: PendingResult, previous: PendingResult | None,
                                 outputs: list[StepOutput]) -> None:
        """Step N+1's masks need step N's tokens, accepted by their grammars, not their text:
        so N's tokens are taken, N+1's mask fill starts on the fill thread, N's text is made
        (its stop strings, its outputs) while it fills, and N+1's sampling is queued behind
        the masks. Whatever the text or the masks do, both run: none of N's outputs is lost
        to a mask failure, and N+1 is fully queued unless its masks or sampling failed. A
        request whose constraints leave no token ends with an error after N's text (a stop
        string in it may have ended it first)."""
        taken = self._process_tokens(previous) if previous is not None else None
        batch, no_token = launched.batch, []
        try:
            fill = self.grammar.start_masks(batch)
            try:
                if taken is not None and self.cfg.experiments.grammar_fill_beside_text:  # off: the A/B
                    read, taken = taken, None  # made once, even if it fails
                    outputs.extend(self._process_text(read))
            finally:  # after a failed text too: the fill joined, N+1's sampling queued
                no_token = self._sample_masked(launched, fill)
        finally:
            self.grammar.mark_consumed(batch)  # write-after-read on the mask ring, on every path
            if taken is not None:  # the A/B's order (text after the sampling), or the masks failed first
                outputs.extend(self._process_text(taken))
        for req in no_token:
            self._end(req.rid, "error", NO_TOKEN_ERROR, error_status=400, error_code="no_allowed_token")

    def _sample_masked(self, launched: PendingResult, fill: MaskFill) -> list[Request]:
        """Queue a constrained step's sampling behind its token masks (`fill`, started).
        Returns the requests whose constraints leave no token at this sample: their rows are
        drawn unmasked, and the caller ends them with an error (the token is dropped)."""
        masks = self.grammar.finish_masks(fill)
        self.runner.sample(launched, masks.bitmask, masks.ready)
        return masks.no_token

    def _launch_failed(self, batch: ScheduledBatch, exc: BaseException, outputs: list[StepOutput]) -> None:
        """A step that did not launch commits nothing: its plan is rolled back, so no KV slot,
        table row or counter refers to it, and the device state its rows' next steps read is
        rewritten (`_resync_rows`). Out of memory fails just the step's requests, with the
        error as their status, and the engine keeps serving the rest; anything else (an
        interrupt, a bug, a sticky CUDA error) propagates to the caller, who may step on (the
        earlier step's outputs, processed here, come with the next step)."""
        self._fence_failed_launch()
        with self.streams.use(self.streams.forward):
            self.future_map.forget_reads()  # the retry reads the decode inputs this attempt read
        self.scheduler.rollback(batch.step)
        self.scheduler.on_step_completed(self.completed_step)  # releases a rollback made due
        if self.runner.mirror is not None:  # the workers already run this step: ranks cannot agree now
            raise EngineDeadError(f"tensor-parallel step launch failed on rank 0: {first_line(exc)}") from exc
        self._process_in_flight(outputs)  # every earlier step processed: the host knows each row's tokens
        self._resync_rows(batch)
        if not is_out_of_memory(exc):
            raise  # called from the launch's except clause: re-raises exc with its traceback
        message = f"the engine could not run this request's step: {first_line(exc)}"
        log.error("step %d failed to launch; failing its %d requests: %s", batch.step, len(batch.rows),
                  first_line(exc), exc_info=exc)
        for row in batch.rows:
            self._end(row.req.rid, "error", message)

    def _resync_rows(self, batch: ScheduledBatch) -> None:
        """The failed attempt may have queued its sampling before it failed: the next inputs
        stashed in the FutureMap, penalty counts, speculation's lengths and history advanced.
        The retry must read what the attempt read, so each running row's state is written
        again from the host's tokens (the rare path; the step loop itself keeps no undo log)."""
        rows = [row.req for row in batch.rows if row.req.slot and not row.req.finished]
        for req in rows:
            self.runner.start_request(req.slot, req.prompt_token_ids, req.params, req.output_token_ids, req.seed)
        decoding = [req for req in rows if req.output_token_ids]
        if decoding:
            self.runner.stash_last_tokens([r.slot for r in decoding], [r.output_token_ids[-1] for r in decoding])

    def _fence_failed_launch(self) -> None:
        """The failed attempt may have queued kernels that still read its staging ring slot,
        its sampling inputs and the plan's KV slots, all of which the retry of this step
        number reuses. A device-wide synchronize on this rare path fences every one of them
        (an event would cover the staging slot only). A device too broken to synchronize has
        failed already: its error surfaces with the launch's own."""
        if self.device.type != "cuda":
            return
        try:
            torch.cuda.synchronize(self.device)
        except Exception as sync_error:  # a sticky CUDA error: the launch's exception says more
            log.error("synchronize after a failed launch: %s", first_line(sync_error))

    def _admit_compiled(self, outputs: list[StepOutput]) -> None:
        """Constrained requests enter the scheduler once their grammar compiled."""
        idle = not self.scheduler.has_work() and self.pending is None
        ready, failed = self.grammar.take_ready(block=idle)
        for req in ready:
            self.scheduler.add(req)
        for f in failed:  # only that request ends; a bad spec is the client's, one line is enough
            log.log(logging.INFO if f.status < 500 else logging.ERROR, "request %s: %s", f.req.rid, f.message)
            self._finish(f.req, "error")
            outputs.append(StepOutput(f.req.rid, [], "", True, "error", error=f.message,
                                      error_status=f.status, error_code=f.code,
                                      text_ids=_no_text_ids(f.req)))

    def _process_first(self, batch: ScheduledBatch) -> bool:
        """Consecutive-prefill switch: finish the previous prefill before the next one."""
        return (self.cfg.experiments.process_before_consecutive_prefill and batch.has_prefill
                and self.pending.batch.has_prefill)

    def _process_in_flight(self, outputs: list[StepOutput]) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            outputs.extend(self._process(pending))

    def _process(self, pending: PendingResult) -> list[StepOutput]:
        """A step's result, whole: its tokens and their text, row by row."""
        return self._process_text(self._process_tokens(pending, with_text=True))

    def _process_tokens(self, pending: PendingResult, with_text: bool = False) -> "_ReadStep":
        """Wait for the step's result and take its tokens (`_take_token`); their text too
        `with_text`, else `_process_text` makes it later."""
        self.collector.before_wait(pending.batch.num_tokens, pending.host.copy_done)  # host time the wait would idle
        t0 = perf_counter()
        pending.host.wait()
        t_wait = perf_counter() - t0
        read = self._read_result(pending, with_text)
        read.wait_s, read.host_s = t_wait, perf_counter() - t0
        return read

    def _process_text(self, read: "_ReadStep") -> list[StepOutput]:
        """The taken tokens' text and outputs; then the step's books close."""
        t0 = perf_counter()
        outputs = read.outputs
        for req, token, lp, reason, emitted in read.taken:
            outputs.append(self._token_output_or_fail(req, token, lp, reason, emitted))
        pending = read.pending
        self.scheduler.on_step_completed(pending.batch.step)
        if self.kv_tier is not None:
            self.kv_tier.collect()  # tier copies that completed: their stats, their keep-alives
        if pending.record is not None:
            pending.record.process_ms = (read.host_s + perf_counter() - t0) * 1e3
            pending.record.host_wait_ms = read.wait_s * 1e3
            self.timeline.completed(pending.record, pending.forward_start, pending.forward_end,
                                    self._previous_forward_end, pending.mask_wait, pending.tier_wait)
            self._previous_forward_end = pending.forward_end
        return outputs

    def _read_result(self, pending: PendingResult, with_text: bool) -> "_ReadStep":
        host = pending.host
        tokens = host.token_ids.tolist()  # pinned memory, already complete: no device sync
        logprobs = host.logprobs.tolist() if host.logprobs is not None else None
        top_ids = host.top_ids.tolist() if host.top_ids is not None else None
        top_lps = host.top_logprobs.tolist() if host.top_logprobs is not None else None
        self.completed_step = pending.batch.step
        # Before the tokens: a first token carries them all. Rank 0's are the ones reported (a
        # worker re-admits a preempted request afresh: it keeps no books of them).
        if host.prompt is not None and self.parallel.tp.rank == 0:
            self._read_prompt_logprobs(pending.batch, host.prompt)
        read = _ReadStep(pending)
        if pending.batch.is_verify:  # its text is made with its tokens (a masked step never follows one)
            read.outputs = self._read_verify(pending.batch, pending.verify_queries, tokens, logprobs, top_ids,
                                             top_lps, pending.record)
            return read
        reqs, sample_indices = pending.batch.sampled
        # Per row per step, kept lean (issue 21): a row's request is cold in the CPU's caches
        # after the forward, so each attribute a row reads costs; locals are bound once.
        finished, take, output = Status.FINISHED, self._take_token, self._token_output
        plain_output = self._plain_token_output
        add_output, add_taken = read.outputs.append, read.taken.append
        speculating = self.speculative is not None  # only its verify steps pause a request's proposals
        # A step without logprobs whose text is made now: a row whose token only joins its request
        # (not a stop id, not its first or last sample, no grammar) takes it inline, two calls
        # and their checks fewer (~4% of the result's host time at 256 rows on the CPU box).
        inline = logprobs is None and with_text
        lps = itertools.repeat(None) if logprobs is None else _row_logprobs(reqs, tokens, logprobs, top_ids, top_lps)
        for req, emitted, token, lp in zip(reqs, sample_indices, tokens, lps):
            if req.status is finished:
                continue  # one-step lag: the token after a finish is dropped, never emitted
            out_ids = req.output_token_ids
            assert emitted == len(out_ids), "result out of order"
            if speculating and req.spec_pause:
                note_plain(req)
            try:
                if (inline and emitted + 1 < req.max_samples and token not in req.stop_ids and req.mask is None
                        and req.first_token_time is not None):
                    out_ids.append(token)  # `_take_token` where nothing finishes the request
                    add_output(plain_output(req, token))
                    continue
                reason = take(req, token, lp)
                if with_text:
                    add_output(output(req, token, lp, reason))
                else:
                    add_taken((req, token, lp, reason, emitted))
            except Exception as exc:  # noqa: BLE001 (ends only this request: _token_failed)
                add_output(self._token_failed(req, token, emitted, exc))
        return read

    def _plain_token_output(self, req: Request, token: int) -> StepOutput:
        """`_token_output` of a token that is not a stop id, taken without a finish."""
        text = req.text
        if text is None or req.text_outside:  # no text made here (the caller's, where it makes it)
            out = StepOutput(req.rid, [token], "", False, None, None, req.num_cached_tokens)
            if req.text_outside:
                out.text_ids = [token]
            return out
        new_text, stop = text.append_token(token)
        if stop is None:
            return StepOutput(req.rid, [token], new_text, False, None, None, req.num_cached_tokens)
        self._stop_string_matched(req, stop, None)
        return StepOutput(req.rid, [token], new_text + text.finish(), True, "stop", None, req.num_cached_tokens)

    def _read_prompt_logprobs(self, batch: ScheduledBatch, host: PromptLogprobs) -> None:
        """Each scored row's logprob, rank and top k, appended in prompt order (pinned memory,
        complete: no device sync)."""
        logprobs, ranks = host.logprobs.tolist(), host.ranks.tolist()
        top_ids = host.top_ids.tolist() if host.top_ids is not None else None
        top_lps = host.top_logprobs.tolist() if host.top_logprobs is not None else None
        at = 0
        for row in batch.rows:
            if row.prompt_logprobs is None:
                continue
            req, (a, b) = row.req, row.prompt_logprobs
            first, at = at, at + b - a
            if req.finished:
                continue  # aborted while the step ran: nothing more is reported
            assert len(req.prompt_logprobs) == a, "prompt logprobs out of order"
            k = req.params.prompt_logprobs
            for j, q in enumerate(range(first, at)):
                top = _top_pairs(top_ids, top_lps, q, k)
                req.prompt_logprobs.append(TokenLogprob(req.prompt_token_ids[a + j + 1], logprobs[q], top, ranks[q]))

    @staticmethod
    def _prompt_logprobs(req: Request) -> list[TokenLogprob | None] | None:
        """vLLM's order, None for the first token (nothing scores it); None while incomplete
        (a request aborted during its prefill)."""
        if req.prompt_logprobs_owed:
            return None
        return [None, *req.prompt_logprobs]

    def _read_verify(self, batch: ScheduledBatch, queries: list[int], flat: list[int], logprobs, top_ids,
                     top_lps, record: StepRecord | None) -> list[StepOutput]:
        """A verify step's rows: [accepted, proposed, samples...] each. The emitted tokens go
        through the same per-token processing as plain decoding (a stop, stop string or
        max_tokens cuts the run); the request's counts learn what its row really computed, and
        the step's timeline record what it proposed and accepted."""
        width, outputs, first_token = self.speculative.num_speculative_tokens + 3, [], 0
        self.spec_counters.verify_steps += 1
        proposed_total = accepted_total = 0
        for i, row in enumerate(batch.rows):
            req, at = row.req, i * width
            token_index, first_token = first_token, first_token + queries[i]
            if req.finished:
                continue  # one-step lag: what a finished request's last row computed is dropped
            accepted, proposed = flat[at], flat[at + 1]
            req.spec_extra -= row.spec_k
            req.num_scheduled_samples += accepted
            req.num_computed += accepted  # the row's last token and its accepted proposals
            self.spec_counters.count(proposed, accepted)
            note_verified(req, row.spec_k, accepted)
            proposed_total, accepted_total = proposed_total + proposed, accepted_total + accepted
            outs = []
            for m, token in enumerate(flat[at + 2:at + 3 + accepted]):  # emitted at query m
                lp = None
                if logprobs is not None and req.params.logprobs is not None:
                    n, q = req.params.logprobs, token_index + m
                    lp = TokenLogprob(token, logprobs[q], _top_pairs(top_ids, top_lps, q, n))
                outs.append(self._append_token_or_fail(req, token, lp))
                if req.finished:
                    break
            outputs.append(_merged(outs))
        if record is not None:
            record.proposed, record.accepted = proposed_total, accepted_total
        return outputs

    def _append_token_or_fail(self, req: Request, token: int, lp: TokenLogprob | None) -> StepOutput:
        """A failure while processing one request's token (its grammar refuses it, the
        detokenizer or a stop check raises) ends only that request, with the error."""
        emitted = len(req.output_token_ids)
        try:
            return self._token_output(req, token, lp, self._take_token(req, token, lp))
        except Exception as exc:  # noqa: BLE001
            return self._token_failed(req, token, emitted, exc)

    def _token_output_or_fail(self, req: Request, token: int, lp: TokenLogprob | None, reason: str | None,
                              emitted: int) -> StepOutput:
        try:
            return self._token_output(req, token, lp, reason)
        except Exception as exc:  # noqa: BLE001 (ends only this request)
            return self._token_failed(req, token, emitted, exc)

    def _token_failed(self, req: Request, token: int, emitted: int, exc: Exception) -> StepOutput:
        """Its token's processing raised: the request ends with the error, its outputs as
        they were before the token (`emitted` of them); no other request is touched."""
        log.error("request %s: processing its token %d failed: %s", req.rid, token, first_line(exc),
                  exc_info=exc)
        del req.output_token_ids[emitted:], req.output_logprobs[emitted:]
        if req.finished:  # its count or grammar finished it before its text failed
            req.finish_reason = "error"
        else:
            self._finish(req, "error")
        return StepOutput(req.rid, [], "", True, "error", num_cached_tokens=req.num_cached_tokens,
                          error=f"the engine could not process this request's token: {first_line(exc)}",
                          text_ids=_no_text_ids(req))

    def _take_token(self, req: Request, token: int, lp: TokenLogprob | None) -> str | None:
        """The token joins the request's outputs and its grammar. Returns the finish its text
        cannot change the fact of (a stop id, a completed grammar, the length), the request
        finished then; None: its text decides (`_token_output`)."""
        req.output_token_ids.append(token)
        grammar_done = req.mask is not None and self.grammar.accept(req, token)
        if lp is not None:
            req.output_logprobs.append(lp)
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        if token in req.stop_ids:
            reason = "stop"
            req.stop_reason = token if token in (req.params.stop_token_ids or ()) else None
        elif grammar_done:
            reason = "stop"
        elif len(req.output_token_ids) >= req.max_samples:
            reason = "length"
        else:
            return None
        self._finish(req, reason)
        return reason

    def _token_output(self, req: Request, token: int, lp: TokenLogprob | None, reason: str | None) -> StepOutput:
        """The taken token's text and its step output. A stop string in the text ends the
        request, and outranks a finish by length or a completed grammar (it names the stop)."""
        text, new_text, text_ids = req.text, "", None
        if req.text_outside:  # the caller makes the text: name the ids that carry it
            text_ids = [] if token in req.stop_ids and not req.params.include_stop_str_in_output else [token]
        elif text is not None:
            if token in req.stop_ids:
                if req.params.include_stop_str_in_output:
                    new_text = text.append_token(token)[0]
            else:
                new_text, stop = text.append_token(token)
                if stop is not None:
                    reason = self._stop_string_matched(req, stop, reason)
            if reason is not None:
                new_text += text.finish()
        # Positional arguments only: a keyword costs the call ~0.3 us (every row of every step).
        out = StepOutput(req.rid, [token], new_text, reason is not None, reason,
                         [lp] if lp is not None else None, req.num_cached_tokens)
        if text_ids is not None:
            out.text_ids = text_ids
        if len(req.output_token_ids) == 1 and req.params.prompt_logprobs is not None:  # params: cold
            out.prompt_logprobs = self._prompt_logprobs(req)  # with the first output
        return out

    def _stop_string_matched(self, req: Request, stop: str, reason: str | None) -> str:
        """A stop string in the token's text ends the request (unless `reason` already did)
        and names the finish: it outranks a finish by length or a completed grammar."""
        req.stop_reason = stop
        if reason is None:
            self._finish(req, "stop")
        req.finish_reason = "stop"
        return "stop"

    def _finish(self, req: Request, reason: str) -> None:
        req.status, req.finish_reason = Status.FINISHED, reason
        self.scheduler.finish(req, self.completed_step)

    def reset_prefix_cache(self) -> int:
        """Drop every cached prefix that no running request uses; returns the KV slots freed."""
        return self.prefix_cache.reset()

    @property
    def dead(self) -> bool:
        """Stopped for good (a sticky CUDA error, a dead worker): touch nothing but close()."""
        return self.fatal.dead or self.parallel.failure is not None

    # ---- introspection ----
    def resolved_settings(self) -> dict[str, str | int | bool]:
        """What this engine made of its configuration's "auto" values and budgets."""
        return {"device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."),
                "kv_cache_dtype": str(self.kv_dtype).removeprefix("torch."),
                "max_model_len": self.max_model_len, "kv_capacity_tokens": self.kv_slots.count,
                "attention_backend": self.backend.name, "cuda_graphs": self.runner.graphs is not None,
                "tensor_parallel_size": self.parallel.tp.size}

    def stats(self) -> dict:
        cached = self.prefix_cache.evictable_tokens
        used = self.kv_slots.count - self.kv_slots.num_free - cached
        return {"running": sum(not r.finished for r in self.scheduler.running),
                "waiting": len(self.scheduler.waiting),
                "kv_cache_usage": used / self.kv_slots.count,  # held by requests (cache excluded)
                "kv_free_tokens": self.kv_slots.num_free,
                "kv_capacity_tokens": self.kv_slots.count,
                "prefix_cache_tokens": cached,  # held only by the cache: evictable
                "prefix_cache_hit_tokens": self.prefix_cache.hit_tokens,
                "prefix_cache_queried_tokens": self.prefix_cache.queried_tokens,
                **self._host_tier_stats(),
                "cuda_graph_memory_mib": sum(g.memory_bytes for g in (self.runner.graphs, self.runner.verify_graphs,
                                                                      self.runner.single_query_graphs,
                                                                      self.runner.prefill_graphs) if g is not None) / 2**20,
                "prefill_graph_steps": self.runner.prefill_graphs.replays if self.runner.prefill_graphs else 0,
                "num_preemptions": self.scheduler.num_preemptions,
                "steps_planned_ahead": self.scheduler.steps_planned_ahead,  # prefill plans made in a wait
                "steps_staged_ahead": self.runner.steps_staged_ahead,  # launched with inputs staged in a wait
                "kernel_builds_while_serving": len(self.builds_while_serving.kernels),  # after the warm-up
                "cascade_steps": self.runner.cascade_steps,  # decode steps with shared-prefix groups
                "cascade_rows": self.runner.cascade_rows,  # rows those steps grouped, summed
                "memory": self.memory.as_dict() if self.memory is not None else None,
                "steps": self.step_id, **(self.spec_counters.as_dict() if self.speculative is not None else {})}


    def _host_tier_stats(self) -> dict:
        """The host tier's figures (zeros when it is off); copy times are device times of the
        copies that completed."""
        tier, cache = self.kv_tier, self.prefix_cache
        copies = tier.stats if tier is not None else TierCopyStats()
        return {"host_cache_hit_tokens": cache.host_hit_tokens,
                "host_cache_tokens": cache.tree.host_tokens,
                "host_cache_capacity_tokens": tier.host.host_slots.count if tier is not None else 0,
                "host_load_bytes": copies.load_bytes, "host_load_seconds": copies.load_seconds,
                "host_write_back_bytes": copies.write_back_bytes,
                "host_write_back_seconds": copies.write_back_seconds,
                "host_copy_waits": copies.fence_waits,
                "host_prefetch_tokens": cache.tier_moves.prefetched,
                "host_admission_load_tokens": cache.tier_moves.admission_loaded,
                "host_write_ahead_tokens": cache.tier_moves.written_ahead,
                "host_eviction_write_back_tokens": copies.write_back_tokens - cache.tier_moves.written_ahead}


def _return_pinned_memory() -> None:
    """Pinned blocks freed by torch stay cached for reuse; give them back (newer torch names it
    torch.accelerator.empty_host_cache; older releases have only the private call)."""
    empty = getattr(torch.accelerator, "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()


def _top_pairs(top_ids: list[list[int]] | None, top_lps: list[list[float]] | None, row: int,
               n: int) -> list[tuple[int, float]]:
    """Row `row`'s first `n` top logprobs as (token id, logprob) pairs, best first: a
    `TokenLogprob.top`. Empty when `n` is 0 or the step computed no top logprobs
    (`top_ids` None: no request in it asked for any)."""
    if not n or top_ids is None:
        return []
    return list(zip(top_ids[row][:n], top_lps[row][:n]))


def _row_logprobs(reqs: list[Request], tokens: list[int], logprobs: list[float], top_ids: list[list[int]] | None,
                  top_lps: list[list[float]] | None) -> list[TokenLogprob | None]:
    """Each sampled row's TokenLogprob where its request (`reqs`: each sampled row's) asked for
    logprobs, else None (a step with logprobs; the result loop of a step without reads no params)."""
    out = []
    for i, (req, token) in enumerate(zip(reqs, tokens)):
        n = req.params.logprobs
        out.append(None if n is None else TokenLogprob(token, logprobs[i], _top_pairs(top_ids, top_lps, i, n)))
    return out


def _no_text_ids(req: Request) -> list[int] | None:
    """`StepOutput.text_ids` of an output that carries no token: none to detokenize, where the
    caller makes the request's text (a finished one ends it); None where the engine does."""
    return [] if req.text_outside else None


def _merged(outs: list[StepOutput]) -> StepOutput:
    """One request's tokens of one step as one output (a verify row emits several)."""
    if len(outs) == 1:
        return outs[0]
    last = outs[-1]
    lps = [lp for o in outs for lp in (o.new_logprobs or [])]
    text_ids = None if last.text_ids is None else [t for o in outs for t in o.text_ids]
    return StepOutput(last.request_id, [t for o in outs for t in o.new_token_ids], "".join(o.new_text for o in outs),
                      last.finished, last.finish_reason, lps or None, last.num_cached_tokens, last.error,
                      last.error_status, last.error_code, text_ids=text_ids)


def _warn_of_build(builds: Compiles) -> Callable[[str, float], None]:
    """A build after the warm-up stalls the step that met the new shape (and every request in
    it): counted, and said once per build. Holds no reference to the engine."""
    def note(kernel: str, seconds: float) -> None:
        builds.note(kernel, seconds)
        log.warning("Triton built kernel %s while serving (%.2f s, the step waited): the warm-up did "
                    "not reach this shape", kernel, seconds)
    return note


@dataclass
class _ReadStep:
    """A step's result between its two phases: tokens taken (`_read_result`), text to make
    (`_process_text`)."""
    pending: PendingResult
    outputs: list[StepOutput] = field(default_factory=list)  # made already (with their text, or failed)
    # (request, token, logprob, finish reason known without the text, outputs before it)
    taken: list[tuple] = field(default_factory=list)
    wait_s: float = 0.0  # the wait for the result
    host_s: float = 0.0  # the wait and the tokens' processing


def _step_record(batch: ScheduledBatch, t_start: float, t_launch: float, t_end: float) -> StepRecord:
    """A timeline record of a launched step: its shape (for rooflines) and host times."""
    if batch.is_decode and not batch.is_verify:  # one new token a row: one sum (every step, every row)
        tokens = batch.size
        context = pairs = sum(batch.columns.positions) + tokens
    else:
        tokens = context = pairs = 0
        for r in batch.rows:
            n = r.num_new
            tokens += n
            context += r.start + n
            pairs += n * r.start + n * (n + 1) // 2
    return StepRecord(
        batch.step, batch.size, tokens, batch.is_decode, context_tokens=context, attn_pairs=pairs,
        host_start=t_start, schedule_ms=(t_launch - t_start) * 1e3, launch_ms=(t_end - t_launch) * 1e3,
        plan_ahead_ms=batch.planned_ahead_ms, num_sampled=batch.num_sampled,
        verify_k=sum(r.spec_k for r in batch.rows) if batch.is_verify else None)


NO_TOKEN_ERROR = "no token satisfies the request's constraints (its grammar allows only tokens it bans)"

# What close() drops: everything that holds device memory or refers back to the engine.
_DEVICE_STATE = ("model", "backend", "kv", "kv_tier", "kv_slots", "prefix_cache", "grammar", "req_slots", "table",
                 "streams", "stager", "copier", "sampler", "future_map", "runner", "scheduler", "spec_state",
                 "draft_model", "draft_kv")


def _token_ids(prompt) -> tuple[int, ...]:
    """Token ids as given: ints only (numpy ints too), never coerced (1.9, "12", True are errors).
    A tuple, as `Request.prompt_token_ids` holds them."""
    ids = tuple(prompt)
    if set(map(type, ids)) <= {int}:  # the common case, checked in C (a 9k-token prompt: 6 ms -> 0.1 ms)
        return ids
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, (int, np.integer))]
    if bad:
        raise ValueError(f"prompt token ids must be ints; got {bad[0]!r} ({type(bad[0]).__name__})")
    return tuple(int(t) for t in ids)


def _derived_seed(engine_seed: int, request_id: str) -> int:
    """A request's seed when it gave none: stable across runs and processes (unlike hash())."""
    digest = hashlib.blake2b(f"{engine_seed}:{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2
