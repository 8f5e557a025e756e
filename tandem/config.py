"""Model and engine configuration."""
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from tandem.distributed.launch import Launch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2: q/k/v projections carry a bias
    qk_norm: bool  # Qwen3: RMSNorm on each head of q and k before RoPE
    eos_token_ids: list[int]
    bos_token_id: int | None
    dtype: torch.dtype | None  # what the checkpoint says, if it says

    @staticmethod
    def from_hf(cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else cfg.get("model_type", "<missing>")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; tandem supports "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        rope = cfg.get("rope_parameters") or {}
        rope_theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling")
        if scaling is None and rope.get("rope_type", "default") != "default":
            scaling = rope
        if scaling is not None and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
            scaling = None
        if scaling is not None and scaling.get("rope_type", scaling.get("type")) != "llama3":
            raise ValueError(f"unsupported rope_scaling {scaling!r}; only llama3-style scaling is")
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        max_pos = cfg.get("max_position_embeddings", 4096)
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        if window and window < max_pos:
            # Without sliding-window attention, cap the context so semantics stay exact.
            max_pos = window
        dtype = cfg.get("dtype") or cfg.get("torch_dtype")
        return ModelConfig(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            dtype=_DTYPES.get(str(dtype).replace("torch.", "")) if dtype else None,
        )


def resolve_dtype(name: str, device: torch.device, model_dtype: torch.dtype | None) -> torch.dtype:
    """`auto` is float32 on the CPU (fast and exact there) and the checkpoint's 16-bit type on CUDA."""
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        return model_dtype if model_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {name!r}")
    return _DTYPES[name]


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV pool's element type: `auto` is the model's; `fp8`/`fp8_e4m3` is e4m3fn with no
    scale (tandem.memory.kv_cache.FP8_MAX bounds what it stores)."""
    if name == "auto":
        return model_dtype
    if name in ("fp8", "fp8_e4m3"):
        return torch.float8_e4m3fn
    if name == "fp8_e5m2":  # vLLM's other FP8 format: say what is supported instead
        raise ValueError("kv_cache_dtype='fp8_e5m2' is not supported: tandem's FP8 KV cache is e4m3 only "
                         "(kv_cache_dtype='fp8' or 'fp8_e4m3')")
    raise ValueError(f"kv_cache_dtype must be one of auto, fp8, fp8_e4m3; got {name!r}")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"device must be one of auto, cpu, cuda; got {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but torch sees no CUDA device")
    return torch.device(name)


def knob(default: Any, help: str, *, aliases: tuple[str, ...] = (), metavar: str | None = None) -> Any:
    """A user option: its default and the help text every command line shows (`tandem.options`
    turns each knob into one flag; `aliases` are extra spellings, `metavar` names the value)."""
    return field(default=default, metadata={"help": help, "aliases": aliases, "metavar": metavar})


@dataclass
class Experiments:
    """A/B switches of the engine's internals, for benchmarks and tests that compare both sides
    (`LLM(..., experiments=Experiments(grammar_overlap=False))`); not command-line options."""

    # Wait for the whole forward stream before reusing a staging slot, not its `consumed` event.
    coarse_war_barrier: bool = False
    # Process a prefill batch before launching the next one: better TTFT of the first, lower throughput.
    process_before_consecutive_prefill: bool = False
    # Fill grammar token masks while the forward runs (off: before the step is queued).
    grammar_overlap: bool = True
    # With it: the mask fill runs on the fill thread while the previous step's text is made,
    # and the step's sampling is queued after both (off: fill, sample, then the text).
    grammar_fill_beside_text: bool = True
    # Decode attention over an e4m3 KV pool (kv_cache_dtype="fp8"): convert each V tile to f16
    # where it is loaded, before its trip through shared memory (`kernels.kv_dtype.f16_where_loaded`).
    # Off, Triton stages V as bytes and, since the PV dot reads it transposed, reads it back a byte
    # at a time (64 `ld.shared.b8` a thread a 64-key tile; PTX 3,323 lines against bf16's 2,680);
    # on, V takes `ldmatrix.trans` as a bf16 pool's does (2,778 lines). On since session 48: the
    # split kernel 0.90x on the H100 (b256, 768-token contexts; e4m3 -> f16 is exact).
    fp8_v_f16_where_loaded: bool = True
    # Split-K decode attention: each row picks its split count from its own length (on the
    # device); off spreads every row over the grid's splits, sized for the longest context.
    attention_split_by_context: bool = True
    # Host KV tier: copy cold prefixes to the host ahead of GPU pressure (off: only when evicted,
    # and the forward that reuses their slots waits for the copy).
    host_kv_write_ahead: bool = True
    # Host KV tier: load the host part of the first waiting requests' matches a step before their
    # admission (off: at admission, and their first forward waits for the load).
    host_kv_prefetch: bool = True
    # Host KV tier: prefetch may evict colder cached prefixes for its loads (off: free slots only,
    # which a full pool does not have: loads then wait for the admission that needs them).
    host_kv_prefetch_evicts: bool = True
    # Host KV tier: while requests run, the queue's head waits (up to PrefixCache's
    # MAX_PREFETCH_WAITS plans) for prefetch to load its match's host part instead of loading it
    # at admission, where the step's forward would wait for the copy (off: loads at admission).
    host_kv_admit_after_prefetch: bool = True
    # Host KV tier: a waiting request beyond the ones prefetch loads for (PREFETCH_REQUESTS),
    # its prefix partly on the host, keeps its place: the requests behind it wait too (off: they
    # pass it, as they pass a request prefetch is loading). Off: it lost on the H200 at dfb50b0
    # (multiturn A/B, docs/benchmarks.md session 17): on, 1,765 output tok/s, TTFT p50/p99
    # 3.5/7.5 s, GPU busy 0.87, the batch 10.3 of 12 (admissions stop while the head loads);
    # off, 2,380 tok/s, 1.2/9.0 s, 0.93 (conversations whose histories stay on the GPU keep
    # passing the others: the p99 tail); the tier off, 1,978 tok/s, 3.0/6.5 s.
    host_kv_fifo_beyond_prefetch: bool = False
    # Host KV tier: how many waiting requests at the queue's head prefetch loads for (and, with
    # the FIFO experiment, the ones that may be passed). Whether more makes FIFO drain less is
    # the next A/B (session 17 ran 4 only).
    host_kv_prefetch_requests: int = 4  # = prefix_cache.PREFETCH_REQUESTS (a test holds them equal)
    # Host KV tier: of the waiting requests admission holds while prefetch loads their host part
    # (`Hold.SKIP`), the first this many (queue order) keep a running place: the requests behind
    # them are admitted only into the places left, so a held request whose load ends finds a place
    # instead of a running set filled by later conversations whose histories stayed on the GPU
    # (the TTFT p99 tail). On the CPU replay of the multiturn workload (docs/benchmarks.md,
    # session 52): 1 cut the modeled p99 7.61 -> 5.37 s (tier off 6.10) for a run 5% longer.
    # H100 at c3dd75a (session 53), 0 against 1: TTFT p99 8.47-8.49 -> 4.67-4.69 s (tier off
    # 6.32), p50 1.04 -> 2.14-2.17 s (tier off 2.92), output tok/s 0.96x (1.23x tier off), GPU
    # busy 0.995 -> 0.9986. 0: none (the admission before session 53).
    host_kv_held_places: int = 1
    # n-gram speculation: a row verifies when its known tokens end in an n-gram of at least this
    # many tokens (clamped to prompt_lookup_min..max) seen earlier, followed by a token. On the
    # built-in model's tasks, the proposals after a one-token match were accepted 12-17 % of the
    # time (0.6 tokens on average), about what the verify step costs over a decode step; after a
    # two-token match, 38-58 % (docs/benchmarks.md, session 28). 1: any match (before session 28).
    spec_verify_min_match: int = 2
    # A running request whose every sample is launched leaves its running place to an
    # admission before its finish is processed (a spare request slot holds the newcomer until
    # the leaving one's steps complete): at the running limit, the next prefill can then be
    # planned in the wait (`Scheduler.plan_ahead`). Off: admissions wait for the finish. On the
    # CPU replay of the host tier's workload, 26 of 34 prefills found the running set full in
    # the wait (docs/benchmarks.md, session 34).
    admit_beside_leaving: bool = True
    # The garbage collector's passes run in the host's wait for a long step (lifetime.ShadowCollector),
    # not wherever an allocation trips them (off: CPython's automatic passes only). On since session
    # 49: the host-tier workload on H100s, GPU busy tier on 0.9976 / 0.9973 / 0.9974 automatic,
    # 0.9993 / 0.9994 / 0.9973 with it (in the third, two forced full passes of 15-21 ms ran in
    # waits with less left to run); tier off 0.9988 automatic, 0.9992 / 0.9997 with it.
    collect_in_shadow: bool = True
    # Graphed verify steps of at most this many rows (bucket) score each row's k + 1 queries
    # in the extend layout (one extend attention launch a layer), larger ones as one decode
    # row per query. H200, built-in shape, one row, 512 cached tokens (`tandem bench
    # spec-verify`): the extend layout's forward 1.065 against 1.187 ms at k 4, 1.071 / 1.263
    # at k 7, 1.097 / 1.239 at k 8, 1.107 / 1.240 at k 15 (docs/benchmarks.md, session 34).
    # 0: never (the layout before session 34). In the engine at 8 and 32 rows (H100, k 7, session
    # 37) the extend layout's verify steps cost more: 1.245 -> 1.364 ms at 8 rows, 1.637 -> 1.870
    # at 32 (copy task), though spec-verify's microbenchmark had it winning (session 35).
    verify_extend_max_rows: int = 1
    # Graphed verify steps where no row proposes (after a verify, when the host's guess finds
    # no match) replay a second graph set of one query a row, at a plain step's cost, instead
    # of the k + 1 queries' graphs (H100, k 15, batch 1: 1.35 against 0.68 ms of GPU; 10 of the
    # copy task's 59 steps, session 34). Off: the k + 1 queries' graphs.
    verify_single_query_graphs: bool = True
    # Draft-model proposals for sampled rows drawn with the noise plain sampling uses at the same
    # output index (Gumbel-max coupling) and verified as point masses, as n-gram's are: the
    # emitted tokens are plain decoding's, whichever steps speculate. Off: drawn with their own
    # noise and verified by rejection sampling against the draft's distribution (the issue's
    # method; a higher acceptance in theory).
    spec_coupled_draft: bool = False
    # Host KV tier: one step's copy time per window for both directions, which the one copy
    # stream runs back to back (off: a step's worth each, two steps of copies per step).
    host_kv_shared_pace: bool = True
    # Host KV tier: the processing window (prefetch, write-ahead) runs before the wait for the
    # previous step's result, inside the time the host would spend waiting for it (off: after
    # that result is processed, where it delays the next plan: H200 at a8a74e0, the window
    # before a small prefill step took 1.6 ms of the ~4.3 ms the GPU idled there).
    host_kv_window_before_wait: bool = True
    # Host KV tier: a forward waits on the device only for the copies it depends on (the loads
    # it reads, the copies of evicted slots its plan reuses: `KVTierCopier.fence`); off, for
    # every copy queued before it, the window's prefetch and write-ahead included (the fence
    # before session 37: on the H100 at 26a6bf8, 26 decode steps waited 15 ms in all for
    # copies none of them read).
    host_kv_precise_fence: bool = True
    # Host KV tier: after write-ahead, the window also evicts the written-ahead prefixes the next
    # plan would evict (no copy: their host copies exist), so a prefill step's plan allocates
    # from free slots (off: the plan evicts, on the host's path between two forwards).
    host_kv_evict_ahead: bool = True
    # Separate batches: while the host waits for the step in flight, a prefill step that will
    # follow the decode step just launched is planned (`Scheduler.plan_ahead`), so its plan
    # (admission, matches, tier loads, slots) is not on the host's path between the two
    # forwards, where only the decode step covers it (off: planned after the wait).
    plan_prefill_ahead: bool = True
    # With plan_prefill_ahead: that prefill step's inputs are also staged in the wait (built
    # and copied into its ring slot, `ModelRunner.stage_ahead`), so its launch only queues work
    # (off: staged at its launch, ~3-4 ms of host time on the H200 for ~50k ints of new tokens
    # and cached prefixes, on the path between the two forwards: docs/benchmarks.md, session 26).
    stage_prefill_ahead: bool = True
    # Cascade decode attention (rows sharing a cached prefix read it once per group): auto groups
    # by `CascadeRule`'s measured crossover (groups of >= 8 rows over >= 511 shared tokens, steps
    # saving >= 5 GiB of KV reads), on groups every shared prefix (>= 2 rows), off never. Auto
    # since session 40 (H100, 2f20c1d): the shared-prefix workload 1.57x (29,440 against 18,727
    # output tok/s; 3.74x the cache off), start-up and graph memory unchanged (19.3 against
    # 19.7 s, 326 MiB). Session 41 (9ccce6a): n=16 samples of 512-token prompts 1.09x; host ms a
    # 256-row step without sharing within noise of off (docs/benchmarks.md).
    cascade_attention: str = "auto"
    # Decode at small batch (issue 21): RoPE writes the new K/V into the cache in the same launch
    # (off: a separate KV-write kernel per layer).
    fused_kv_write: bool = True
    # Decode at small batch (issue 21): residual add + RMSNorm run in the prologue of the next
    # projection's small-M GEMM where the tuner found that faster (off: a norm kernel per norm).
    fused_norm_gemm: bool = True
    # FP8 weights above the small-M kernels (issue 21: FP8 lost to bf16 there): the RMSNorm or
    # SiLU-mul in front of a projection writes its input as FP8 rows with their scales (off: a
    # quantization launch of its own before each cuBLAS FP8 GEMM, 4 a layer).
    fp8_fused_input: bool = True
    # Split-K decode attention: the last split program of each row merges (off: a separate
    # merge launch per layer). Off: on the H200 (session 13) it saved 7 us of a 0.95 ms batch-1
    # step and took back PDL's 59 us gain when both were on (docs/benchmarks.md).
    fused_decode_merge: bool = False
    # Prefill-only steps up to a bucketed token count replay CUDA graphs (tandem.prefill_graphs;
    # off: they launch eagerly, ~9 kernels a layer from Python). Needs cuda_graph on.
    prefill_graphs: bool = True
    # The largest prefill step graphed, in tokens, where the model's GRAPH_MAX_FLOPS allows
    # (tandem.prefill_graphs.LARGEST_BUCKET; 2048 until session 26).
    prefill_graph_max_tokens: int = 8192  # = prefill_graphs.LARGEST_BUCKET (a test holds them equal)
    # Decode graphs: one per (bucket, staging ring slot), each reading its ring slot's device
    # buffer in place; off: one per bucket, reading the graphs' own input buffer, into which the
    # step's ring slot is copied on the forward stream before the replay (one device copy a
    # step). On the H200 at a14d1c1 `cudaGraphLaunch` took 0.2-0.4 ms of host a step in the
    # loop, against 0.011 ms for one graph replayed back to back (docs/benchmarks.md, session
    # 30); `python3 -m tandem.bench.graph_launch` says whether alternating graphs is the cause.
    decode_graph_per_ring_slot: bool = True

    @classmethod
    def from_overrides(cls, pairs: list[str]) -> "Experiments":
        """Benchmarks' `--experiment NAME=VALUE` (repeatable): booleans take on/off, true/false, 1/0."""
        exp = cls()
        for pair in pairs:
            name, sep, value = pair.partition("=")
            if not sep or name not in cls.__dataclass_fields__:
                known = ", ".join(cls.__dataclass_fields__)
                raise ValueError(f"--experiment takes NAME=VALUE with NAME one of {known}; got {pair!r}")
            if isinstance(getattr(exp, name), bool):
                if value.lower() not in _BOOL_WORDS:
                    raise ValueError(f"--experiment {name} takes on/off, got {value!r}")
                setattr(exp, name, _BOOL_WORDS[value.lower()])
            elif isinstance(getattr(exp, name), int):
                if not value.isdigit():
                    raise ValueError(f"--experiment {name} takes a count, got {value!r}")
                setattr(exp, name, int(value))
            else:
                setattr(exp, name, value)
        return exp


_BOOL_WORDS = {"on": True, "true": True, "1": True, "off": False, "false": False, "0": False}


Dtype = Literal["auto", "float32", "bfloat16", "float16"]
KVCacheDtype = Literal["auto", "fp8", "fp8_e4m3"]
AutoOnOff = Literal["auto", "on", "off"]


@dataclass
class EngineConfig:
    """The engine's user options; defaults suit a single GPU or a small CPU run. Every knob is a
    flag of `tandem serve/generate/chat` and a keyword of `LLM()`. Not here: the debug checks
    (environment, `tandem.diagnostics.debug_checks`), the A/B experiments (`experiments`) and
    where a tensor-parallel group's ranks run (`launch`, flags of `tandem serve` only)."""

    model: str | None = knob(None, "HF directory or .gguf file (default: the built-in SmolLM2-135M-Instruct)",
                             metavar="PATH")
    tokenizer: str | None = knob(None, "a tokenizer directory (transformers' files) instead of the "
                                       "checkpoint's own", metavar="DIR")
    dtype: Dtype = knob("auto", "auto: float32 on the CPU, the checkpoint's 16-bit type on CUDA")
    device: Literal["auto", "cpu", "cuda"] = knob("auto", "auto: CUDA when torch sees a GPU")
    dummy_weights: bool = knob(False, "random weights (a config.json is enough)")
    allow_pickle: bool = knob(False, "load pickle (.bin) checkpoints, which can run code")
    disable_overlap: bool = knob(False, "process each step before the next is launched")
    max_total_tokens: int | None = knob(None, "KV pool size in tokens (None: sized from memory)")
    gpu_memory_utilization: float = knob(0.85, "fraction of the GPU's memory for weights, activations, "
                                               "graphs and KV")
    cpu_kv_cache_bytes: int = knob(1 << 30, "KV budget on the CPU, in bytes")
    max_running_requests: int = knob(256, "requests decoding at once")
    max_prefill_tokens: int = knob(8192, "per-step token budget for prefill chunks")
    chunked_prefill_size: int | None = knob(4096, "split prompts longer than this (None: never)")
    enable_mixed_batch: bool = knob(False, "put prefill chunks and decodes in one forward")
    mixed_prefill_budget: int | None = knob(
        None, "mixed batches: prefill tokens a step carries beside its decodes (None: one chunk less the decodes)")
    enable_prefix_caching: bool = knob(True, "reuse the KV of cached prompt prefixes (radix tree)",
                                       aliases=("--prefix-caching",))
    # Off by default: pinned memory is taken from the OS up front (it cannot be swapped), and a
    # safe size depends on what else the host runs; the user knows, the engine cannot.
    host_kv_cache_gb: float = knob(0.0, "GiB of pinned host memory per rank for prefixes evicted from the "
                                        "KV pool (a second prefix-cache tier; 0: off)")
    schedule_policy: Literal["fcfs", "lpm"] = knob(
        "fcfs", "admission order: first come first served, or longest cached prefix first")
    attention_backend: Literal["auto", "torch", "triton"] = knob(
        "auto", "auto: Triton on CUDA when importable, else the torch reference")
    cuda_graph: AutoOnOff = knob("auto", "decode steps replay CUDA graphs (auto: on with CUDA + Triton)")
    cuda_graph_max_batch: int = knob(512, "largest decode batch captured in a graph (capped by "
                                                  "max_running_requests)")
    warm_up: AutoOnOff = knob("auto", "run every kernel shape class at start (auto: on with CUDA)")
    small_m_gemm: AutoOnOff = knob("auto", "weight-streaming Triton GEMMs for <= 16 rows, tuned per "
                                           "shape at startup (auto: on with CUDA; off: cuBLAS everywhere)")
    quantization: Literal["fp8"] | None = knob(None, "fp8: per-channel e4m3 weights, quantized at load")
    kv_cache_dtype: KVCacheDtype = knob("auto", "auto: the KV cache in the model's dtype; fp8 (= fp8_e4m3): "
                                                "e4m3 with scale 1.0, saturated at +-448 (half the bytes)")
    max_model_len: int | None = knob(None, "context length (None: the model's)")
    seed: int = knob(0, "unseeded requests derive their sampling seeds from it")
    # One process per rank (rank 0 is this one); where the ranks run is `launch`.
    tensor_parallel_size: int = knob(1, "tensor parallelism: ranks (GPUs) per engine", aliases=("--tp",))
    # False: off; True: kept in memory (engine.timeline); a path: also written there as JSON lines.
    timeline: bool | str = knob(False, "write every engine step's host and device times to PATH as a "
                                       "JSON line (default: off; a server keeps them in memory for "
                                       "/metrics either way)", metavar="PATH")
    timeline_max_records: int | None = knob(None, "steps the timeline keeps in memory (None: all; "
                                                  "the server keeps 4096 unless told)")
    grammar_threads: int = knob(2, "threads compiling grammars (token masks are filled on one thread)")
    # A compilation cannot be stopped (its thread runs on); the request waiting for it can.
    grammar_compile_timeout: float = knob(
        60.0, "seconds a grammar may compile before the requests waiting for it fail with a 400")
    # vLLM's keys: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n,
    # "prompt_lookup_min": m, "disable_by_batch_size": b} (tandem.speculative.config).
    speculative_config: dict | None = knob(
        None, "speculative decoding, a JSON object: {\"method\": \"ngram\", \"num_speculative_tokens\": 4} "
              "(vLLM's keys; default: off)", metavar="JSON")
    launch: Launch = field(default_factory=Launch)
    experiments: Experiments = field(default_factory=Experiments)
