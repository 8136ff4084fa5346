"""What `auto` picks on CUDA (attention on Triton) through Kafka: a worker on the Triton kernels,
under the interpreter on the CPU, answers a request on the real broker. The engine alone on these
kernels against HF: tests/kernels/test_triton_engine.py."""

from __future__ import annotations


import pytest

from tests.engine_fixtures import prompt_ids
from tests.worker_fixtures import topics  # noqa: F401 - a fixture
from tests.kernels.test_triton_engine import hf_greedy  # noqa: F401


@pytest.mark.kafka
@pytest.mark.slow
async def test_worker_on_triton_kernels_answers_through_kafka(
    kafka_bootstrap, topics, tmp_path, monkeypatch, model_runner, hf_model
):
    """`python -m inferline.worker` with TRITON_INTERPRET=1 and
    INFERLINE_MODEL__ATTENTION_BACKEND=triton (plus linears and elementwise ops on PyTorch, as on
    CUDA) answers with HF's greedy tokens."""
    from inferline.contract.schema import TokensEvent
    from tests.worker_fixtures import collect, final_done, request, spawn_worker, submit, wait_log

    ids = prompt_ids(model_runner.tokenizer, 0)
    expected = hf_greedy(hf_model, ids, 6)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the worker process inherits it
    log = tmp_path / "worker.log"
    proc = spawn_worker(
        kafka_bootstrap,
        topics,
        log,
        model={"attention_backend": "triton", "cpu_linear": "torch", "cpu_fused_ops": "torch"},
    )
    try:
        await wait_log(log, "intake.assigned", proc, timeout=180)
        assert (
            '"attention": "triton"' in log.read_text()
            and '"triton_target": "interpreter"' in log.read_text()
        )
        req = request(topics.replies, max_tokens=6, ignore_eos=True)
        del req["prompt"]
        (rid,) = await submit(kafka_bootstrap, topics.requests, [{**req, "prompt_token_ids": ids}])
        events = (await collect(kafka_bootstrap, topics.replies, [rid], timeout=600))[rid]
    finally:
        proc.kill()
        proc.wait()
    done = final_done(events)
    assert done.finish_reason == "length" and done.error is None, done
    assert [t for e in events if isinstance(e, TokensEvent) for t in e.token_ids] == expected
