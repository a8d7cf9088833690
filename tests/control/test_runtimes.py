"""runtime.engine in the spec: which engine a text deployment runs, and what vLLM is started with."""
import json
import sys
from pathlib import Path

import pytest

from inferd.control.launch import spec_plans
from inferd.control.runtimes import RuntimeProcess, llamacpp_settings, replica_slots, vllm_command
from inferd.control.spec import SpecError, load_spec
from inferd.gateway.runtimes import vllm_gauges

SPEC = """
deployments:
  - name: chat
    model: {source: default}
    runtime: {engine: vllm, python: PYTHON, args: [--enforce-eager], max_num_seqs: 8, max_model_len: 1024,
              kv_cache_gib: 0.5, dtype: float32, num_threads: 1}
  - name: chat
    version: v2
    role: canary
    model: {source: default}
    runtime: {max_num_seqs: 8}
"""


def write(tmp_path, text: str):
    path = tmp_path / "deploy.yaml"
    path.write_text(text.replace("PYTHON", sys.executable))
    return path


def test_a_vllm_deployment_beside_an_inferd_canary_of_the_same_name(tmp_path):
    spec = load_spec(write(tmp_path, SPEC))
    vllm, inferd = spec.deployments
    assert vllm.engine.engine == "vllm" and vllm.engine.args == ["--enforce-eager"] and vllm.runtime.max_num_seqs == 8
    assert inferd.engine.engine == "inferd"
    plans = spec_plans(spec)
    replica = plans[0].replicas[0]
    assert isinstance(replica, RuntimeProcess) and replica.name == "chat" and not isinstance(plans[1].replicas[0],
                                                                                           RuntimeProcess)
    cmd = vllm_command(sys.executable, tmp_path, "chat", vllm.runtime, vllm.engine.args, "127.0.0.1", 8001)
    flags = {flag: value for flag, value in zip(cmd[3:], cmd[4:]) if flag.startswith("--")
             and not value.startswith("--")}
    assert cmd[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"] and flags["--model"] == str(tmp_path)
    assert flags["--max-num-seqs"] == "8" and flags["--max-model-len"] == "1024" and flags["--dtype"] == "float32"
    assert flags["--kv-cache-memory-bytes"] == str(2**29) and flags["--scheduling-policy"] == "priority"
    assert "--enable-prefix-caching" in cmd and "--enable-prompt-tokens-details" in cmd
    assert cmd[-1] == "--enforce-eager" and "--api-key" not in cmd  # the key goes in the environment


@pytest.mark.parametrize("edit, message", [
    (("engine: vllm", "engine: sglang"), r"deployments\[0\].runtime.engine: must be one of inferd, vllm"),
    (("python: PYTHON", "python: /nonexistent/python"), r"deployments\[0\].runtime.python: no Python with vllm"),
    (("dtype: float32", "quantization: int8"), r"deployments\[0\].runtime.quantization: vllm cannot honour"),
    (("max_num_seqs: 8}", "max_num_seqs: 8, python: PYTHON}"), r"deployments\[1\].runtime.python: python and args"),
    (("args: [--enforce-eager]", "args: --enforce-eager"), r"deployments\[0\].runtime.args: expected a list"),
])
def test_engine_errors_name_the_field(tmp_path, edit, message):
    with pytest.raises(SpecError, match=message):
        load_spec(write(tmp_path, SPEC.replace(*edit)))


def test_vllm_gauges_are_read_from_its_metrics():
    text = ('# HELP vllm:kv_cache_usage_perc KV-cache usage.\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="chat"} 0.25\n'
            'vllm:num_requests_running{engine="0",model_name="chat"} 3.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="chat"} 1.0\n'
            'vllm:num_requests_waiting_by_reason{engine="0",model_name="chat",reason="capacity"} 1.0\n')
    assert vllm_gauges(text) == {"kv_cache_usage": 0.25, "running": 3.0, "waiting": 1.0}


LLAMACPP = """
deployments:
  - name: chat
    model: {source: default}
    runtime: {engine: llama.cpp, python: PYTHON, max_num_batched_tokens: 256, max_model_len: 2048, num_threads: 1}
"""


def test_a_llamacpp_deployment_serves_the_gguf_with_one_slot_and_its_key_in_a_private_file(tmp_path):
    from inferd.control.launch import slots_of
    from inferd.models.loader import default_model_path
    spec = load_spec(write(tmp_path, LLAMACPP))
    d = spec.deployments[0]
    assert d.engine.engine == "llama.cpp" and slots_of(d) == 1 == replica_slots("llama.cpp", d.runtime)
    replica = spec_plans(spec)[0].replicas[0]
    assert isinstance(replica, RuntimeProcess) and replica.engine == "llama.cpp"
    config = llamacpp_settings(default_model_path(), "chat", d.runtime, "127.0.0.1", 8001, "k")
    model = config["models"][0]
    assert config["api_key"] == "k" and config["interrupt_requests"] is False and config["port"] == 8001
    assert model["model"] == str(default_model_path()) and model["model_alias"] == "chat"
    assert (model["n_ctx"], model["n_batch"], model["n_threads"], model["cache"]) == (2048, 256, 1, False)
    cmd, _ = replica._llamacpp(sys.executable)
    try:
        assert cmd[1:4] == ["-m", "llama_cpp.server", "--config_file"] and replica.api_key not in " ".join(cmd)
        assert oct(replica.folder.stat().st_mode & 0o777) == "0o700"  # only this user reads the key
        assert json.loads(Path(cmd[4]).read_text())["api_key"] == replica.api_key
    finally:
        replica.stop()
    assert not replica.folder.exists()


@pytest.mark.parametrize("edit, message", [
    (("num_threads: 1}", "num_threads: 1, max_num_seqs: 8}"), r"runtime.max_num_seqs: llama.cpp cannot honour"),
    (("num_threads: 1}", "num_threads: 1, dtype: float32}"), r"runtime.dtype: llama.cpp cannot honour"),
    (("source: default", "source: TMP"), r"runtime.engine: llama.cpp serves a .gguf file"),
    (("python: PYTHON", "python: /nonexistent/python"), r"runtime.python: no Python with llama.cpp found .*"
                                                        r"INFERD_LLAMACPP_PYTHON.*scripts/install-llamacpp.sh"),
])
def test_llamacpp_errors_name_the_field(tmp_path, edit, message):
    edit = (edit[0], edit[1].replace("TMP", str(tmp_path)))
    with pytest.raises(SpecError, match=message):
        load_spec(write(tmp_path, LLAMACPP.replace(*edit)))
