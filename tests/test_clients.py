"""Third-party clients against a live `tandem serve`: langchain-openai, litellm, and a load
run of 64 streamed requests. They come with the `clients` extra (`pip install -e .[clients]`,
done by .ci/run); without it these tests skip."""
import json
import os
import warnings

import pytest

from test_server import running_server

# litellm fetches a model-price map from GitHub at import unless told to use its bundled copy.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
langchain_openai = pytest.importorskip("langchain_openai")
with warnings.catch_warnings():  # litellm's own pydantic models warn as it imports
    warnings.simplefilter("ignore", UserWarning)
    litellm = pytest.importorskip("litellm")
# ... and as they build their schemas on first use.
pytestmark = pytest.mark.filterwarnings("ignore:.*ReadOnly.*:UserWarning")


@pytest.fixture(scope="module")
def url(tiny_text_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("clients") / "server.log"
    with running_server(tiny_text_model, log, "--max-running-requests", "64") as (url, proc):
        yield url
    assert proc.returncode == 0, log.read_text()


def test_langchain_chat_openai_invoke_stream_batch(url):
    chat = langchain_openai.ChatOpenAI(base_url=url + "/v1", api_key="none", model="llama", max_tokens=8,
                                       temperature=0, max_retries=0)
    whole = chat.invoke("Tell me a story.")
    assert whole.content and whole.response_metadata["finish_reason"] in ("length", "stop")
    streamed = "".join(chunk.content for chunk in chat.stream("Tell me a story."))
    assert streamed == whole.content  # greedy: the stream adds up to the same text
    batch = chat.batch(["Tell me a story.", "Hi", "What is 2+2?"])
    assert [m.content for m in batch][0] == whole.content and all(m.content for m in batch)


def test_litellm_completion_both_providers_and_context_window_error(url):
    messages = [{"role": "user", "content": "Tell me a story."}]
    vllm = litellm.completion(model="hosted_vllm/llama", api_base=url + "/v1", messages=messages,
                              max_tokens=6, temperature=0)
    assert vllm.choices[0].message.content and vllm.usage.completion_tokens <= 6
    stream = litellm.completion(model="openai/llama", api_base=url + "/v1", api_key="none", messages=messages,
                                max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == vllm.choices[0].message.content
    # litellm classifies by message: tandem's wording is vLLM's, so this is a context-window error.
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(model="hosted_vllm/llama", api_base=url + "/v1", messages=messages, max_tokens=1000)


def test_load_run_of_64_streamed_requests_has_no_failure(url, tmp_path):
    """The load generator (`tandem bench serve`: streamed completions, usage-counted tokens;
    aiperf's own install pins older pyzmq / prometheus-client than the server needs)."""
    from tandem.bench.serve import bench_serve_main
    out = tmp_path / "load.json"
    rc = bench_serve_main(["--base-url", url, "--rates", "inf", "--num-prompts", "64", "--input-len", "16:64",
                           "--output-len", "16:32", "--text-prompts", "--json", str(out)])
    assert rc == 0
    (result,) = json.loads(out.read_text())["results"]
    assert (result["completed"], result["failed"]) == (64, 0)
    assert result["output_token_throughput"] > 0 and result["ttft_ms"]["p50"] > 0 and result["itl_ms"]["p50"] > 0
