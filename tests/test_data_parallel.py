"""`tandem serve --dp 2`: two engine processes behind one front end, driven by `openai`."""
import asyncio

import openai

from test_server import _metrics, running_server


def test_dp2_serves_64_concurrent_requests_on_both_replicas(tiny_text_model, tmp_path):
    log = tmp_path / "server.log"
    with running_server(tiny_text_model, log, "--dp", "2", "--max-running-requests", "32") as (url, proc):
        async def main():
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            async with client:
                return await asyncio.gather(*(
                    client.completions.create(model="llama", prompt=f"Request {i}: once upon",
                                              max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
                    for i in range(64)))

        results = asyncio.run(main())
        assert [r.choices[0].finish_reason for r in results] == ["length"] * 64
        assert all(r.usage.completion_tokens == 8 for r in results)
        m = _metrics(url)
        per_replica = [m[f'tandem_replica_requests_total{{replica="{i}"}}'] for i in (0, 1)]
        assert sum(per_replica) == 64 and min(per_replica) >= 16, per_replica
        assert m["tandem_generation_tokens_total"] == 64 * 8  # summed over the replicas
    assert proc.returncode == 0, log.read_text()
