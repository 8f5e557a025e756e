"""prompt_logprobs: equal to log_softmax of a full-sequence forward of the same model (float32),
however the prefill is split, batched, overlapped or cached."""
import random

import pytest
import torch

from tandem import LLM, SamplingParams
import tandem.sampling.prompt_logprobs as prompt_logprobs_module
from tandem.sampling.prompt_logprobs import compute_prompt_logprobs
from tandem.scheduler.scheduler import Scheduler
from tiny_models import TEST_DEVICE, load_hf, make_tiny_model
from workload import step_without_host_syncs

VOCAB = 256
ATOL = 2e-4 if TEST_DEVICE == "cpu" else 2e-3  # CUDA: batched vs whole-sequence kernels


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("plp"), "llama")
    return path, load_hf(path)


def _prompts(seed: int, n: int, lo: int = 2, hi: int = 70) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _reference(hf, prompt: list[int]) -> torch.Tensor:
    """[len - 1, V]: row p - 1 is the log-distribution of token p given tokens < p."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def check_against_reference(hf, prompt: list[int], got: list, k: int) -> None:
    ref = _reference(hf, prompt)
    assert len(got) == len(prompt) and got[0] is None
    for p, entry in enumerate(got[1:]):
        token, row = prompt[p + 1], ref[p]
        assert token in entry
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=ATOL)
        assert entry[token].rank == int((row >= row[token]).sum()), (p, token)
        top = torch.topk(row, k)
        for tid, value in zip(top.indices.tolist(), top.values.tolist()):
            assert entry[tid].logprob == pytest.approx(value, abs=ATOL)
        assert len(entry) == len(set(top.indices.tolist()) | {token})
        assert {tid: lp.rank for tid, lp in entry.items() if tid != token} == {
            tid: i + 1 for i, tid in enumerate(top.indices.tolist()) if tid != token}


def _generate(path, prompts, k, max_tokens=3, **options):
    llm = LLM(str(path), device=TEST_DEVICE, dtype="float32", **options)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, prompt_logprobs=k)
    try:
        return llm.generate(prompts, sp, use_tqdm=False), llm
    finally:
        llm.close()


@pytest.mark.parametrize("options", [
    dict(),
    dict(chunked_prefill_size=8, max_prefill_tokens=24),
    dict(chunked_prefill_size=8, enable_mixed_batch=True, mixed_prefill_budget=5),
    dict(disable_overlap=True, chunked_prefill_size=16),
    dict(enable_prefix_caching=False, chunked_prefill_size=16, enable_mixed_batch=True),
], ids=["whole", "chunked", "mixed", "no-overlap", "no-prefix-cache"])
@pytest.mark.parametrize("k", [0, 5])
def test_prompt_logprobs_match_a_full_forward(tiny, options, k):
    path, hf = tiny
    prompts = _prompts(k + 7, 6) + [[5], [7, 9]]
    outs, _ = _generate(path, prompts, k, **options)
    for prompt, out in zip(prompts, outs):
        check_against_reference(hf, prompt, out.prompt_logprobs, k)
        assert len(out.token_ids) == 3


def test_mixed_batches_beside_decodes_and_plain_requests(tiny):
    """Requests with and without prompt logprobs arriving while others decode: scored rows sit
    between plain prefill rows and decode rows of one step."""
    path, hf = tiny
    llm = LLM(str(path), device=TEST_DEVICE, dtype="float32", chunked_prefill_size=8, enable_mixed_batch=True,
              mixed_prefill_budget=12)
    engine, prompts = llm.engine, _prompts(3, 8)
    for i, prompt in enumerate(prompts):
        sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=3 if i % 2 else None)
        engine.add_request(prompt, sp, request_id=str(i))
        engine.step()
    while engine.has_unfinished():
        engine.step()
    for i, prompt in enumerate(prompts):
        got = engine.output(str(i)).prompt_logprobs
        if i % 2 == 0:
            assert got is None
            continue
        from tandem.outputs import prompt_logprobs
        check_against_reference(hf, prompt, prompt_logprobs(got, str), 3)
    llm.close()


def test_prefix_cache_on_and_off_give_the_same_prompt_logprobs(tiny):
    """A prompt whose prefix is cached (a plain request ran it first) still reports every
    position: a request asking for prompt logprobs recomputes the cached part."""
    path, hf = tiny
    shared = _prompts(11, 1, 40, 40)[0]
    prompts = [shared + [9, 10, 11], shared + [12]]
    runs = {}
    for cache in (True, False):
        llm = LLM(str(path), device=TEST_DEVICE, dtype="float32", enable_prefix_caching=cache)
        llm.generate([shared + [7]], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)  # warm the cache
        outs = llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2),
                            use_tqdm=False)
        runs[cache] = outs
        for prompt, out in zip(prompts, outs):
            check_against_reference(hf, prompt, out.prompt_logprobs, 2)
            assert out.num_cached_tokens == 0
        again = llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
        assert (again[0].num_cached_tokens > 0) == cache  # what it computed was cached for others
        llm.close()
    for a, b in zip(runs[True], runs[False]):
        assert a.prompt_logprobs == b.prompt_logprobs and a.token_ids == b.token_ids


def test_n_samples_compute_prompt_logprobs_once(tiny):
    path, hf = tiny
    prompt = _prompts(5, 1, 30, 30)[0]
    llm = LLM(str(path), device=TEST_DEVICE, dtype="float32")
    sp = SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=1, prompt_logprobs=1)
    assert [s.prompt_logprobs for s in sp.samples()] == [1, None, None]
    out = llm.generate([prompt], sp, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    check_against_reference(hf, prompt, out.prompt_logprobs, 1)
    llm.close()


def test_preempted_requests_report_each_prompt_logprob_once(tiny, monkeypatch):
    """A pool too small for every request at once: requests are preempted (some in the middle
    of a chunked prefill, some after it) and re-prefilled; each still reports its prompt once,
    exactly, and one whose prompt was scored takes its prefix from the cache again."""
    path, hf = tiny
    readmitted = []  # (prompt logprobs held, owed in all, cached tokens matched)
    admit = Scheduler._admit

    def recording(self, req, matched):
        if req.num_preemptions and req.params.prompt_logprobs is not None:  # not the CUDA warm-up's
            readmitted.append((len(req.prompt_logprobs), len(req.prompt_token_ids) - 1, matched))
        return admit(self, req, matched)
    monkeypatch.setattr(Scheduler, "_admit", recording)
    prompts = _prompts(23, 6, 40, 60)
    llm = LLM(str(path), device=TEST_DEVICE, dtype="float32", max_total_tokens=200, chunked_prefill_size=16)
    sp = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert any(0 < held < owed for held, owed, _ in readmitted)  # preempted mid-prefill
    assert any(held == owed and matched > 0 for held, owed, matched in readmitted)
    assert all(matched <= held for held, owed, matched in readmitted if held < owed)
    for prompt, out in zip(prompts, outs):
        check_against_reference(hf, prompt, out.prompt_logprobs, 2)
    llm.close()


def test_aborted_during_prefill_reports_none(tiny):
    path, _ = tiny
    llm = LLM(str(path), device=TEST_DEVICE, dtype="float32", chunked_prefill_size=8)
    engine = llm.engine
    engine.add_request(_prompts(2, 1, 60, 60)[0], SamplingParams(max_tokens=4, prompt_logprobs=1), "a")
    engine.step()
    engine.abort("a")
    while engine.has_unfinished():
        assert all(o.prompt_logprobs is None for o in engine.step())
    assert engine.output("a").prompt_logprobs is None and engine.output("a").finish_reason == "abort"
    llm.close()


def test_prompt_logprobs_arrive_with_the_first_output(tiny):
    path, _ = tiny
    llm = LLM(str(path), device=TEST_DEVICE, dtype="float32", chunked_prefill_size=8)
    engine = llm.engine
    engine.add_request(_prompts(4, 1, 30, 30)[0], SamplingParams(max_tokens=3, prompt_logprobs=0), "a")
    seen = []
    while engine.has_unfinished():
        seen += [(len(o.new_token_ids), o.prompt_logprobs) for o in engine.step()]
    assert seen[0][0] == 1 and len(seen[0][1]) == 30 and all(lp is None for _, lp in seen[1:])
    llm.close()


def test_speculative_decoding_keeps_prompt_logprobs(tiny):
    """The prefill of a speculating engine is a plain prefill: same values."""
    path, hf = tiny
    prompts = _prompts(41, 4, 10, 50)
    outs, _ = _generate(path, prompts, 2, max_tokens=8, chunked_prefill_size=16,
                        speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    for prompt, out in zip(prompts, outs):
        check_against_reference(hf, prompt, out.prompt_logprobs, 2)


def test_structured_output_prefill_scores_the_raw_prompt(tiny_text_model):
    """A constrained request's sampling is queued after the forward (masks wait for the host):
    its prompt logprobs travel with that later copy, unmasked."""
    hf = load_hf(tiny_text_model)
    llm = LLM(str(tiny_text_model), device=TEST_DEVICE, dtype="float32", chunked_prefill_size=8)
    prompt = list(range(100, 130))
    sp = SamplingParams(max_tokens=4, temperature=0, choice=["yes", "no"], prompt_logprobs=2)
    out = llm.generate([prompt], sp, use_tqdm=False)[0]
    assert out.text in ("yes", "no")
    check_against_reference(hf, prompt, out.prompt_logprobs, 2)
    llm.close()


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="tensor parallelism on gloo (the CPU)")
def test_tensor_parallel_prompt_logprobs_match_the_full_forward(tmp_path):
    """Both ranks run the same scored rows (the LM head's gather is a collective): rank 0
    reports the same values as one rank, with a vocabulary padded for sharding, and with
    preemptions in the middle of prefills (a worker re-admits a request afresh)."""
    path = make_tiny_model(tmp_path, "qwen3", vocab_size=255)
    hf = load_hf(path)
    prompts = [[t % 255 for t in p] for p in _prompts(23, 6, 40, 60)]
    with LLM(str(path), tensor_parallel_size=2, device="cpu", dtype="float32", max_total_tokens=200,
             max_running_requests=16, chunked_prefill_size=16) as llm:
        sp = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, prompt_logprobs=4)
        outs = llm.generate(prompts, sp, use_tqdm=False)
    assert sum(o.num_preemptions for o in outs) > 0
    for prompt, out in zip(prompts, outs):
        check_against_reference(hf, prompt, out.prompt_logprobs, 4)


def test_long_prompts_in_small_lm_head_chunks_and_grown_buffers(tiny, monkeypatch):
    """The engine's scored rows in chunks of 3 rows, and prompts long enough (x the top 20) to
    grow the pinned result buffers past their first size, still give the full forward's values."""
    monkeypatch.setattr(prompt_logprobs_module, "CHUNK_ELEMENTS", 3 * VOCAB)
    path, hf = tiny
    prompts = _prompts(51, 1, 10, 10) + _prompts(52, 2, 200, 300)
    llm = LLM(str(path), device=TEST_DEVICE, dtype="float32", chunked_prefill_size=128)
    head, rows = llm.engine.model.compute_logits, []

    def counted(hidden, out=None):
        rows.append(hidden.shape[0])
        return head(hidden, out)
    llm.engine.model.compute_logits = counted  # the runner reads it at each step
    sp = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=20)
    outs = [llm.generate([p], sp, use_tqdm=False)[0] for p in prompts]  # short first: the buffers grow
    assert max(rows) == 3 and len(rows) > 150
    assert max(ring["top_ids"].numel() for ring in llm.engine.copier.prompt) >= 127 * 20
    for prompt, out in zip(prompts, outs):
        check_against_reference(hf, prompt, out.prompt_logprobs, 20)
    llm.close()


def test_chunks_of_the_lm_head_give_the_same_values():
    """The bounded chunks (here 3 rows) equal one pass over every row."""
    torch.manual_seed(0)
    hidden, weight = torch.randn(20, 16), torch.randn(50, 16)
    idx, targets = torch.tensor([0, 2, 3, 5, 7, 8, 9, 11, 19]), torch.randint(0, 50, (9,))
    whole = compute_prompt_logprobs(hidden, idx, targets, 4, lambda h: h @ weight.t(), 50, rows_per_chunk=100)
    chunked = compute_prompt_logprobs(hidden, idx, targets, 4, lambda h: h @ weight.t(), 50, rows_per_chunk=3)
    ref = torch.log_softmax(hidden[idx] @ weight.t(), dim=-1)
    torch.testing.assert_close(whole.logprobs, ref.gather(1, targets[:, None]).squeeze(1))
    for name in ("logprobs", "ranks", "top_ids", "top_logprobs"):
        torch.testing.assert_close(getattr(chunked, name), getattr(whole, name))


def test_params_accept_prompt_logprobs_in_range():
    assert SamplingParams(prompt_logprobs=20).prompt_logprobs == 20
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prompt_logprobs_run_without_host_syncs(tiny):
    """On CUDA, under sync-debug "error": scored prefill chunks in mixed batches beside graph
    decodes add no host sync, and the values still match the full forward."""
    path, hf = tiny
    llm = LLM(str(path), device="cuda", dtype="float32", enable_mixed_batch=True, chunked_prefill_size=16)
    engine = llm.engine
    llm.generate([[5, 6, 7, 8] * 10], SamplingParams(max_tokens=4, prompt_logprobs=3), use_tqdm=False)  # compile
    prompts = _prompts(31, 12, 20, 90)
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                  prompt_logprobs=5 if i % 3 else None), request_id=f"g{i}")
    step_without_host_syncs(engine)
    from tandem.outputs import prompt_logprobs
    for i, prompt in enumerate(prompts):
        got = engine.output(f"g{i}").prompt_logprobs
        if i % 3:
            check_against_reference(hf.to("cpu"), prompt, prompt_logprobs(got, str), 5)
    llm.close()
