"""The layers of a decode step as one C++ call (inferd/models/decode_loop.py): bit for bit the Python loop."""
import pytest
import torch

from inferd.engine.model_runner import Chunk
from inferd.kernels.select import bf16_weights
from inferd.kernels.variants import load_kernels
from inferd.models.int4_kernel import load_int4_kernel
from inferd.models.llama import LlamaForCausalLM
from tests.engine.test_engine import greedy, make_engine, prompts, run

loop = load_kernels()
int4 = load_int4_kernel()
cpp = load_kernels()
pytestmark = pytest.mark.skipif(loop is None or cpp is None, reason="no C++ kernels built for this CPU")


def formats():
    """(dtype, quantization) pairs whose linears all have our kernels at a few rows on this CPU."""
    out = []
    if int4 is not None and int4.int4_linear_fp32_native():
        out.append(("float32", "int4"))
    if int4 is not None and int4.int4_linear_bf16_native():
        out.append(("bfloat16", "int4"))
    if cpp is not None and cpp.one_row_linear_native():
        out.append(("bfloat16", "none"))  # the one-row loop's weights: one row, or 2-64 where the CPU has AMX
    if cpp is not None and cpp.bf16w_linear_native() and bf16_weights():
        out.append(("auto", "none"))  # float32 rows on the weights kept in bf16, at every row count
    return out


def python_loop_only(monkeypatch):
    monkeypatch.setattr(LlamaForCausalLM, "_loop", lambda self, meta, rows: None)


@pytest.mark.parametrize("dtype,quantization", formats())
def test_the_cpp_loop_gives_the_python_loops_tokens(dtype, quantization, monkeypatch):
    reqs = {f"r{i}": (p, greedy(12)) for i, p in enumerate(prompts(6, seed=47))}
    reqs |= {"alone": (prompts(1, seed=5)[0], greedy(30))}  # decodes on its own at the end: one row
    engine = make_engine(dtype=dtype, quantization=quantization, max_num_seqs=4)
    with_loop = run(engine, reqs)[0]
    loops = engine.runner.model._loops
    assert loops.get(1) is not None  # one row ran as one C++ call
    if quantization == "int4" or dtype == "auto" or cpp.amx_linear_native():  # at most 4 rows: a kernel at each
        assert len(loops) > 1 and all(plan is not None for plan in loops.values())
    python_loop_only(monkeypatch)
    assert run(make_engine(dtype=dtype, quantization=quantization, max_num_seqs=4), reqs)[0] == with_loop


@pytest.mark.parametrize("dtype,quantization", formats())
def test_one_call_and_one_call_a_layer_give_the_python_loops_logits(dtype, quantization, monkeypatch):
    engine = make_engine(dtype=dtype, quantization=quantization)
    engine.add_request("a", prompts(1, seed=3)[0], greedy(8))
    engine.step()  # its prefill
    item = engine.scheduler.schedule().decodes[0]
    decode = [Chunk(item.seq, item.seq.num_computed_tokens, item.seq.token_ids[-1:], 1)]
    runner, calls = engine.runner, []
    whole = runner.forward(decode, [])
    by_layer = runner.forward(decode, [], lambda: calls.append(1))  # a forward that may stop between layers
    assert runner.model._loops[1] is not None and len(calls) == runner.model.config.num_layers
    python_loop_only(monkeypatch)
    python = runner.forward(decode, [])
    assert torch.equal(whole, python) and torch.equal(by_layer, python)


def test_no_plan_where_a_linear_has_no_kernel_of_ours():
    engine = make_engine(dtype="float32")  # oneDNN's dense products
    run(engine, {"a": (prompts(1)[0], greedy(4))})
    assert engine.runner.model._loops == {1: None}
    engine = make_engine(dtype="float32", cpp_kernels=False)  # torch's small ops
    run(engine, {"a": (prompts(1)[0], greedy(4))})
    assert all(plan is None for plan in engine.runner.model._loops.values())


def test_a_plan_refuses_inconsistent_inputs():
    with pytest.raises(RuntimeError, match="inconsistent sizes"):
        loop.make_plan([torch.zeros(1)], [1, 1, 1, 1], [1e-5, 1.0])
    with pytest.raises(RuntimeError, match="no such plan"):
        loop.run_plan(-1, 0, 1, *[torch.zeros(1)] * 9, 16)
    empty = loop.make_plan([], [0, 1, 1, 1], [1e-5, 1.0])
    with pytest.raises(RuntimeError, match="out of range"):
        loop.run_plan(empty, 0, 1, *[torch.zeros(1)] * 9, 16)
    loop.drop_plan(empty)
