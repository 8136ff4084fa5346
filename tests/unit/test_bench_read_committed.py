"""The statistics of bench/read_committed.py, offline."""
from bench.read_committed import Event, compare, cpu_rows, dist, holds, pct, per_request


def test_pct_nearest_rank():
    assert pct([], 50) is None
    assert pct([3.0], 99) == 3.0
    vals = [float(i) for i in range(1, 101)]
    assert pct(vals, 50) == 50.0
    assert pct(vals, 99) == 99.0
    assert pct(vals, 100) == 100.0
    assert dist([1.0, 2.0, 3.0]) == {"n": 3, "p50": 2.0, "p99": 3.0, "max": 3.0, "mean": 2.0}


def ev(rid, seq, kind, t, attempt="a", part=0):
    return Event(rid, attempt, seq, kind, part, t)


def test_per_request_ttft_gaps_and_final():
    submitted = {"r1": 10.0, "r2": 11.0}
    events = [ev("r1", 0, "started", 10.1), ev("r1", 1, "tokens", 10.3), ev("r1", 2, "tokens", 10.5),
              ev("r1", 3, "done", 10.6), ev("r2", 0, "started", 11.2), ev("r2", 1, "tokens", 11.4),
              ev("r2", 2, "tokens", 12.4), ev("x", 1, "tokens", 0.0)]  # an id not submitted: ignored
    r = per_request(submitted, events)
    assert r["requests_with_tokens"] == 2
    assert r["ttft_s"]["n"] == 2 and abs(r["ttft_s"]["max"] - 0.4) < 1e-9
    assert sorted(round(g, 6) for g in [r["gap_s"]["p50"], r["gap_s"]["max"]]) == [0.2, 1.0]
    assert r["final_s"]["n"] == 1 and abs(r["final_s"]["p50"] - 0.6) < 1e-9


def test_gaps_do_not_span_attempts():
    events = [ev("r", 1, "tokens", 1.0, "a"), ev("r", 1, "tokens", 9.0, "b"), ev("r", 2, "tokens", 9.5, "b")]
    r = per_request({"r": 0.0}, events)
    assert r["gap_s"]["n"] == 1 and abs(r["gap_s"]["max"] - 0.5) < 1e-9
    assert r["ttft_s"]["p50"] == 1.0  # the first tokens of any attempt


def test_holds_worst_and_aborted():
    unc = [ev("r", 1, "tokens", 1.0), ev("r", 2, "tokens", 2.0, part=3), ev("r", 3, "done", 2.5, "dead")]
    com = [ev("r", 1, "tokens", 1.01), ev("r", 2, "tokens", 7.0, part=3)]
    h = holds(unc, com)
    assert h["hold_s"]["n"] == 2 and abs(h["hold_s"]["max"] - 5.0) < 1e-9
    assert h["only_uncommitted"] == 1  # the aborted done
    assert h["worst"]["seq"] == 2 and h["worst"]["partition"] == 3


def test_compare_and_cpu_rows():
    unc = {"ttft_s": {"p50": 0.1, "p99": 0.2}, "gap_s": {"p50": 0.02, "p99": 0.05}}
    com = {"ttft_s": {"p50": 0.2, "p99": 0.2}, "gap_s": {"p50": 0.02, "p99": 0.5}}
    c = compare(unc, com)
    assert c["ttft_s_p50"] == 2.0 and c["ttft_s_p99"] == 1.0 and abs(c["gap_s_p99"] - 10.0) < 1e-9
    tx = {"broker_cpu_s": 4.0, "wall_s": 10.0, "idle": {"window_s": 5.0, "broker_cpu_s": 0.5}}
    base = {"broker_cpu_s": 2.0, "wall_s": 10.0, "idle": {"window_s": 5.0, "broker_cpu_s": 0.5}}
    rows = cpu_rows(tx, base, 10)
    assert rows["transactional"]["per_request_ms"] == 400.0
    assert rows["transactional"]["per_request_net_ms"] == 300.0  # 4.0 - 0.5 * 10/5 over 10 requests
    assert rows["baseline"]["per_request_net_ms"] == 100.0
    assert rows["ratio_net"] == 3.0 and rows["ratio_raw"] == 2.0


def test_beside_takes_the_streams_of_the_held_partition_during_the_hold():
    from bench.read_committed import beside

    unc = [ev("a", 1, "tokens", 1.0, part=0), ev("a", 2, "tokens", 1.1, part=0),
           ev("b", 1, "tokens", 1.05, part=1), ev("c", 1, "tokens", 9.0, part=0)]
    com = [ev("a", 1, "tokens", 1.0, part=0), ev("a", 2, "tokens", 8.0, part=0)]
    b = beside({"a": 0.5, "b": 0.5, "c": 0.5}, unc, com, partition=0, t0=0.9, t1=8.0)
    assert b["requests"] == 1  # b wrote elsewhere, c after the hold
    assert abs(b["read_committed"]["gap_s"]["max"] - 7.0) < 1e-9
    assert abs(b["read_uncommitted"]["gap_s"]["max"] - 0.1) < 1e-9


def test_the_paced_engine_yields_a_token_per_step_and_finishes_at_max_tokens():
    from bench.paced_engine import PacedEngine
    from inferline.worker.engine.request import EngineRequest, SamplingParams

    eng = PacedEngine(step_s=0.0)
    eng.add_request(EngineRequest("r", SamplingParams(max_tokens=3), prompt="one two"))
    eng.add_request(EngineRequest("s", SamplingParams(max_tokens=9), prompt="x"))
    outs = [eng.step() for _ in range(3)]
    r = [o for step in outs for o in step if o.request_id == "r"]
    assert [o.started for o in r] == [True, False, False] and [o.finished for o in r] == [False, False, True]
    assert r[-1].finish_reason == "length" and r[-1].num_output_tokens == 3 and r[-1].num_prompt_tokens == 2
    eng.abort("s", "cancelled")
    (last,) = eng.step()
    assert (last.request_id, last.finish_reason) == ("s", "cancelled") and not eng.has_unfinished_requests()


def test_several_stream_lengths_and_rates_run_each_config_per_length_and_rate_and_name_it():
    from bench.read_committed import config_of, configs, fleet_cores, parse_args

    assert configs(parse_args(["--delivery", "before,after"])) == [("before", 48, 20.0), ("after", 48, 20.0)]
    assert configs(parse_args(["--delivery", "before,txn-1s", "--max-tokens", "256,48"])) == [
        ("before/256", 256, 20.0), ("txn-1s/256", 256, 20.0), ("before/48", 48, 20.0), ("txn-1s/48", 48, 20.0)]
    assert configs(parse_args(["--delivery", "after", "--max-tokens", "256,48", "--rate", "20,80"])) == [
        ("after/256@20", 256, 20.0), ("after/48@20", 48, 20.0), ("after/256@80", 256, 80.0), ("after/48@80", 48, 80.0)]
    assert config_of("txn-1s/256@80") == "txn-1s" and config_of("after") == "after"
    assert fleet_cores(8.7) == "870" and fleet_cores(None) == "-"


def test_the_request_counter_counts_only_the_worker_clients_requests_by_api(monkeypatch):
    import asyncio
    from types import SimpleNamespace

    from aiokafka.client import AIOKafkaClient

    from bench.read_committed import RequestCounter

    async def sent(client, node_id, request, **kw):
        return node_id

    class ProduceRequest_v7: ...  # noqa: N801 - named as aiokafka names its request classes

    class EndTxnRequest: ...

    monkeypatch.setattr(AIOKafkaClient, "send", sent)
    worker, reader = SimpleNamespace(_client_id="inferline"), SimpleNamespace(_client_id="aiokafka-0.14")

    async def traffic():
        for client, request in ((worker, ProduceRequest_v7()), (worker, ProduceRequest_v7()),
                                (worker, EndTxnRequest()), (reader, ProduceRequest_v7())):
            assert await AIOKafkaClient.send(client, 3, request) == 3

    with RequestCounter("inferline") as counter:
        asyncio.run(traffic())
    assert counter.counts == {"Produce": 2, "EndTxn": 1}
    assert AIOKafkaClient.send is sent
