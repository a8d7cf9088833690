"""Scheduling policies: FCFS, priority classes with preemption of lower classes when blocks run out, and
prompts that join a step in flight."""
import asyncio
import threading
from collections import defaultdict

import pytest

from inferd.engine.async_engine import AsyncEngine
from inferd.engine.engine import Arrivals
from inferd.engine.request import ResponseFormat, SamplingParams
from tests.engine.test_engine import MODEL, assert_no_leak, greedy, make_engine, prompts

INTERACTIVE, BATCH = 0, 1


def first_scheduled(policy: str) -> list[str]:
    engine = make_engine(scheduling_policy=policy, max_num_seqs=1)
    ps = prompts(3, seed=3)
    engine.add_request("batch-a", ps[0], greedy(2), priority=BATCH)
    engine.add_request("batch-b", ps[1], greedy(2), priority=BATCH)
    engine.add_request("inter", ps[2], greedy(2), priority=INTERACTIVE)
    order = []
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                order.append(out.request_id)
    assert_no_leak(engine)
    return order


def test_priority_runs_a_higher_class_first_fcfs_does_not():
    assert first_scheduled("priority") == ["inter", "batch-a", "batch-b"]
    assert first_scheduled("fcfs") == ["batch-a", "batch-b", "inter"]


def outputs(engine, requests: dict[str, tuple[list[int], SamplingParams, int]]) -> dict[str, list[int]]:
    tokens, first_at = defaultdict(list), {}
    for rid, (ids, params, priority) in requests.items():
        engine.add_request(rid, ids, params, priority=priority)
    step = 0
    while engine.has_work():
        step += 1
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
            first_at.setdefault(out.request_id, step)  # the step of its first token
    assert_no_leak(engine)
    return tokens, first_at


def test_an_interactive_request_preempts_batch_work_when_blocks_run_out():
    ps = prompts(3, seed=5)
    long = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    alone = {rid: outputs(make_engine(), {rid: (ps[i], long, 0)})[0][rid] for i, rid in enumerate(["b1", "b2", "i"])}
    engine = make_engine(num_kv_blocks=40, block_size=4, lower_class_seqs=2)  # 160 slots: the two batch requests
    # fill them (both keep stepping beside the interactive one: lower_class_seqs=2)
    engine.add_request("b1", ps[0], long, priority=BATCH)
    engine.add_request("b2", ps[1], long, priority=BATCH)
    for _ in range(30):
        engine.step()  # b1 and b2 hold most blocks now
    tokens, first_at = outputs(engine, {"i": (ps[2], long, INTERACTIVE)})
    assert engine.scheduler.num_preemptions >= 1
    assert tokens["i"] == alone["i"]  # recomputed sequences and the interactive one: same greedy tokens
    assert first_at["i"] == 1  # its first token came in the very next step: batch work made room


def test_an_interactive_request_takes_a_batch_sequences_slot_when_all_are_running():
    ps = prompts(3, seed=7)
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    alone = {rid: outputs(make_engine(), {rid: (ps[i], long, 0)})[0][rid] for i, rid in enumerate(["b1", "b2", "i"])}
    engine = make_engine(max_num_seqs=2, lower_class_seqs=2)  # blocks to spare: only the slots are short
    engine.add_request("b1", ps[0], long, priority=BATCH)
    engine.add_request("b2", ps[1], long, priority=BATCH)
    for _ in range(10):
        engine.step()
    tokens, first_at = outputs(engine, {"i": (ps[2], long, INTERACTIVE)})
    assert engine.scheduler.num_preemptions == 1  # one batch sequence gave its slot, once
    assert first_at["i"] == 1 and tokens["i"] == alone["i"]
    fcfs = make_engine(max_num_seqs=2, scheduling_policy="fcfs")
    fcfs.add_request("b1", ps[0], long, priority=BATCH)
    fcfs.add_request("b2", ps[1], long, priority=BATCH)
    for _ in range(10):
        fcfs.step()
    _, first_at = outputs(fcfs, {"i": (ps[2], long, INTERACTIVE)})
    assert fcfs.scheduler.num_preemptions == 0 and first_at["i"] > 1  # FCFS: it waits for a slot


def test_while_an_interactive_request_runs_only_lower_class_seqs_batch_sequences_step():
    ps = prompts(4, seed=9)
    long = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    alone = {rid: outputs(make_engine(), {rid: (ps[i], long, 0)})[0][rid]
             for i, rid in enumerate(["b1", "b2", "b3", "i"])}
    engine = make_engine(max_num_seqs=8, lower_class_seqs=1)
    for i, rid in enumerate(["b1", "b2", "b3"]):
        engine.add_request(rid, ps[i], long, priority=BATCH)
    for _ in range(5):
        engine.step()
    engine.add_request("i", ps[3], long, priority=INTERACTIVE)
    tokens, stepped_beside = defaultdict(list), []
    while engine.has_work():
        outs = engine.step()
        for out in outs:
            tokens[out.request_id] += out.token_ids
        ids = {o.request_id for o in outs if o.token_ids}
        if "i" in ids and not any(o.finished for o in outs if o.request_id == "i"):
            stepped_beside.append(len(ids - {"i"}))
    assert_no_leak(engine)
    assert stepped_beside and max(stepped_beside) <= 1  # one batch sequence at a time beside the interactive one
    assert engine.scheduler.num_preemptions == 0  # held back, not preempted: their blocks stayed
    assert tokens["i"] == alone["i"] and all(tokens[r][-5:] == alone[r][-5:] for r in ("b1", "b2", "b3"))


def step_seeing(engine) -> tuple[list[str], list[str], list]:
    """One engine step; the request ids it decodes and prefills, and its outputs."""
    batch = engine.scheduler.schedule()
    decodes, prefills = [s.seq.request_id for s in batch.decodes], [s.seq.request_id for s in batch.prefills]
    return decodes, prefills, engine.run_batch(batch) if batch.seqs else []


def test_a_tenant_that_runs_nothing_is_prefilled_before_one_that_runs_many():
    ps = prompts(7, seed=11)
    long_prompts = [p * 3 for p in ps]  # 9 to 57 tokens: more than the 8 a step leaves for prompts below
    for policy, first in (("priority", "a"), ("fcfs", "f4")):
        engine = make_engine(max_num_batched_tokens=64, scheduling_policy=policy)
        for i in range(4):
            engine.add_request(f"f{i}", long_prompts[i], greedy(20), cache_namespace="flooder")
        while len(engine.scheduler.running) < 4 or any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running):
            engine.step()  # the flooder's four decode now
        engine.add_request("f4", long_prompts[4], greedy(20), cache_namespace="flooder")
        engine.add_request("a", long_prompts[5], greedy(20), cache_namespace="tenant-a")
        engine.scheduler.max_num_batched_tokens = 4 + 8  # four decodes and one 8-token chunk per step
        decodes, prefills, _ = step_seeing(engine)
        assert sorted(decodes) == ["f0", "f1", "f2", "f3"] and prefills == [first], policy
        engine.scheduler.max_num_batched_tokens = 256
        while engine.has_work():
            engine.step()
        assert_no_leak(engine)


def test_a_step_that_prefills_an_interactive_prompt_computes_no_batch_prompt_chunk():
    ps = prompts(2, seed=13)
    engine = make_engine(max_num_batched_tokens=8)
    engine.add_request("b", ps[0] * 6, greedy(5), priority=BATCH)  # 18+ tokens: chunks of 8
    _, prefills, _ = step_seeing(engine)
    assert prefills == ["b"] and engine.scheduler.running[0].num_uncomputed_tokens > 1  # b is mid-prompt
    engine.add_request("i", ps[1][:4], greedy(5), priority=INTERACTIVE)  # 4 tokens: 4 of the budget left over
    _, prefills, _ = step_seeing(engine)
    assert prefills == ["i"]  # b's next chunk waits, though the budget had room for part of it
    while engine.has_work():
        engine.step()
    assert_no_leak(engine)


def test_a_batch_step_outranked_by_an_arrival_stops_and_loses_nothing():
    ps = prompts(3, seed=17)
    long = greedy(12)
    ps[0] = ps[0] * 2  # b1 takes more than one step's 8 tokens
    alone = {rid: outputs(make_engine(), {rid: (ps[i], long, 0)})[0][rid] for i, rid in enumerate(["b1", "b2", "i"])}
    engine = make_engine(max_num_batched_tokens=8)
    engine.add_request("b1", ps[0], long, priority=BATCH)
    engine.add_request("b2", ps[1], long, priority=BATCH)
    asked = []
    tokens = defaultdict(list)
    for out in engine.step(outranked=lambda p: asked.append(p) or True):  # an interactive request "arrived"
        tokens[out.request_id] += out.token_ids
    assert asked == [BATCH] and engine.num_interrupted_steps == 1 and not tokens  # it stopped at its first layer
    assert all(s.num_computed_tokens == 0 for s in engine.scheduler.running)  # and counted nothing as computed
    engine.add_request("i", ps[2], long, priority=INTERACTIVE)
    while engine.has_work():  # a step that holds the interactive request is never stopped
        for out in engine.step(outranked=lambda p: "i" in engine.seqs):
            tokens[out.request_id] += out.token_ids
    assert engine.num_interrupted_steps == 1
    assert_no_leak(engine)
    assert all(tokens[r] == alone[r] for r in ("b1", "b2", "i"))  # the stopped step's K/V were written again


def test_prompts_that_arrive_mid_step_are_prefilled_there_at_any_layer_and_change_no_output():
    ps = prompts(5, seed=29)
    ps[4] = ps[4] * 6  # longer than the budget the running step leaves: its rest is computed in later chunks
    reqs = {f"r{i}": (ps[i], greedy(6)) for i in range(5)}
    alone = {rid: outputs(make_engine(), {rid: (ids, p, 0)})[0][rid] for rid, (ids, p) in reqs.items()}
    for layer in range(MODEL.config.num_layers):  # before the first layer and after it
        engine = make_engine(max_num_batched_tokens=48)
        tokens, asked, nested = defaultdict(list), [], []
        for rid in ("r0", "r1"):
            engine.add_request(rid, *reqs[rid])
        for out in engine.step():  # both prefilled: the next step decodes them
            tokens[out.request_id] += out.token_ids

        def added():
            asked.append(len(asked))
            if len(asked) - 1 != layer:
                return False
            for rid in ("r2", "r3", "r4"):
                engine.add_request(rid, *reqs[rid])
            return True
        stepped = engine.step(arrivals=Arrivals(added, nested.extend))
        assert [out.request_id for out in nested] == ["r2", "r3"]  # r4 has prompt left
        assert [out.request_id for out in stepped] == ["r0", "r1"]
        assert engine.num_nested_prefills == 3 and len(asked) == layer + 1  # then the step's budget is spent
        for out in nested + stepped:
            tokens[out.request_id] += out.token_ids
        while engine.has_work():
            for out in engine.step(arrivals=Arrivals(lambda: False, nested.extend)):
                tokens[out.request_id] += out.token_ids
        assert_no_leak(engine)
        assert dict(tokens) == alone, f"joined before layer {layer}"


@pytest.mark.parametrize("dtype", ["float32", "auto"])  # auto on AVX2: the weights kept in bf16, our kernel
def test_an_arrival_whose_prefill_inside_the_step_wants_no_logits_yet_changes_no_output(dtype):
    short, long = prompts(2, seed=41)
    long = long * 30  # more than the step's budget leaves it: the nested chunk ends mid-prompt, no logits (0 rows)
    reqs = {"short": (short, greedy(4)), "long": (long, greedy(4))}
    alone = {rid: outputs(make_engine(dtype=dtype), {rid: (ids, p, 0)})[0][rid] for rid, (ids, p) in reqs.items()}
    engine, tokens, nested = make_engine(max_num_batched_tokens=48, dtype=dtype), defaultdict(list), []
    engine.add_request("short", *reqs["short"])
    for out in engine.step():
        tokens[out.request_id] += out.token_ids

    def added():
        if "long" in engine.seqs:
            return False
        engine.add_request("long", *reqs["long"])
        return True
    for out in engine.step(arrivals=Arrivals(added, nested.extend)):
        tokens[out.request_id] += out.token_ids
    assert engine.num_nested_prefills == 1 and not nested  # its first chunk ran inside the step, with no output
    while engine.has_work():
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
    assert_no_leak(engine)
    assert dict(tokens) == alone


def test_a_worse_class_or_a_grammar_does_not_join_a_step():
    ps = prompts(2, seed=31)
    json_object = SamplingParams(max_tokens=4, response_format=ResponseFormat("json_object"))
    for params, priority in ((greedy(4), BATCH), (json_object, INTERACTIVE)):
        engine, delivered = make_engine(), []
        engine.add_request("i", ps[0], greedy(4), priority=INTERACTIVE)
        engine.step()

        def added():
            if "new" in engine.seqs:
                return False
            engine.add_request("new", ps[1], params, priority=priority)
            return True
        assert [out.request_id for out in engine.step(arrivals=Arrivals(added, delivered.extend))] == ["i"]
        assert not delivered and engine.num_nested_prefills == 0
        assert [s.request_id for s in engine.scheduler.waiting] == ["new"]
        while engine.has_work():
            engine.step()
        assert_no_leak(engine)


def test_the_async_engine_prefills_an_arrival_inside_the_step_in_flight_and_holds_an_abort_for_its_end():
    engine, ps = make_engine(), prompts(3, seed=37)
    alone = outputs(make_engine(), {"new": (ps[2], greedy(3), 0)})[0]["new"]
    first, pause = engine.runner.model.layer_ops()[0], threading.Event()
    in_step, go, qkv = threading.Event(), threading.Event(), first.qkv

    def paused(x):
        if pause.is_set():
            pause.clear()
            in_step.set()
            go.wait(30)
        return qkv(x)
    first.qkv = paused

    async def main() -> list[int]:
        async_engine = AsyncEngine(engine)
        async_engine.start()
        try:
            running = async_engine.generate("running", ps[0], greedy(40))
            victim = async_engine.generate("victim", ps[1], greedy(400))  # it cannot end by itself in this test
            await anext(running), await anext(victim)  # victim may itself be prefilled inside running's step
            nested = engine.num_nested_prefills
            pause.set()
            await asyncio.to_thread(in_step.wait, 30)  # a decode step of both is inside its first layer
            new = asyncio.create_task(collect(async_engine.generate("new", ps[2], greedy(3))))
            await asyncio.sleep(0.1)  # its request is in the inbox
            await victim.aclose()  # and the abort behind it
            go.set()
            tokens = await new
            assert engine.num_nested_prefills == nested + 1
            await collect(running)
            return tokens
        finally:
            await async_engine.stop()

    async def collect(stream) -> list[int]:
        return [t async for out in stream for t in out.token_ids]
    assert asyncio.run(main()) == alone
    assert not engine.seqs
    assert_no_leak(engine)
