import hashlib
import subprocess
import sys

import pytest

from inferd.control.launch import replica_args, spec_plans
from inferd.control.spec import SpecError, load_spec
from inferd.models.loader import default_model_path
from tests.server import ROOT


@pytest.fixture(scope="module")
def digest() -> str:
    with default_model_path().open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write(tmp_path, text: str):
    path = tmp_path / "deploy.yaml"
    path.write_text(text)
    return path


GOOD = """
deployments:
  - name: smol
    model: {{source: default, sha256: "{digest}"}}
    runtime: {{dtype: float32, max_num_seqs: 8, max_model_len: 1024, num_threads: 1}}
    replicas: 2
    price: {{input_usd_per_mtok: 0.05, output_usd_per_mtok: 0.2}}
    router: {{policy: least_loaded}}
  - name: hosted
    external: {{base_url: "https://api.example.com/v1", model: gpt-4o-mini}}
"""


def test_a_valid_spec_loads_into_plans(tmp_path, digest):
    spec = load_spec(write(tmp_path, GOOD.format(digest=digest)))
    assert [d.name for d in spec.deployments] == ["smol", "hosted"]
    smol = spec.deployments[0]
    assert smol.router.policy == "least_loaded" and smol.price.output_usd_per_mtok == 0.2
    args = replica_args(smol.model.source, smol.name, smol.runtime)
    assert args[:2] == ["--served-model-name", "smol"] and "--num-threads" in args
    plans = spec_plans(spec)
    assert len(plans[0].replicas) == 2 and plans[1].replicas == []


CONTROL = GOOD + """
  - name: smol
    version: v2
    role: canary
    model: {{source: default}}
    rollout: {{weight: 0.2, min_requests: 10}}
  - name: tiny
    model: {{source: default}}
    autoscaling: {{min_replicas: 0, max_replicas: 3, scale_to_zero: true, target_ttft_ms: 800}}
    replicas: 0
    placement: {{backend: ray, num_cpus: 1}}
    fallbacks: [hosted]
    degradation:
      steps: [{{action: reject_late}}, {{action: cap_max_tokens, max_tokens: 64}}, {{action: route, to: smol}}]
"""


def test_control_plane_fields_load(tmp_path, digest):
    spec = load_spec(write(tmp_path, CONTROL.format(digest=digest)))
    canary, tiny = spec.deployments[2], spec.deployments[3]
    assert (canary.name, canary.role, canary.version, canary.rollout.weight) == ("smol", "canary", "v2", 0.2)
    assert tiny.autoscaling.scale_to_zero and tiny.placement.backend == "ray" and tiny.fallbacks == ["hosted"]
    assert [s.action for s in tiny.degradation.steps] == ["reject_late", "cap_max_tokens", "route"]


@pytest.mark.parametrize("edit, message", [
    (("role: canary", "role: shadow"), r"deployments\[2\].role: must be one of"),
    (("version: v2", "version: v1"), r"deployments\[2\].version: the canary must differ"),
    (("weight: 0.2", "weight: 1.5"), r"deployments\[2\].rollout.weight: must be between 0 and 1"),
    (("scale_to_zero: true, ", ""), r"deployments\[3\].autoscaling.min_replicas: 0 needs scale_to_zero"),
    (("replicas: 0\n", "replicas: 4\n"), r"deployments\[3\].replicas: 4 is outside"),
    (("backend: ray", "backend: k8s"), r"deployments\[3\].placement.backend: must be one of"),
    (("fallbacks: [hosted]", "fallbacks: [nowhere]"), r"deployments\[3\].fallbacks\[0\]: 'nowhere' is not"),
    (("max_tokens: 64", "max_tokens: 0"), r"deployments\[3\].degradation.steps\[1\].max_tokens"),
    (("to: smol", "to: tiny"), r"deployments\[3\].degradation.steps\[2\].to: route needs another"),
    (("target_ttft_ms: 800", "target_ttft: 800"), r"deployments\[3\].autoscaling.target_ttft: unknown field"),
])
def test_control_plane_errors_name_the_field(tmp_path, digest, edit, message):
    with pytest.raises(SpecError, match=message):
        load_spec(write(tmp_path, CONTROL.format(digest=digest).replace(*edit)))


@pytest.mark.parametrize("edit, message", [
    (("max_num_seqs: 8", "max_num_seqs: 8, max_seqs: 3"), "deployments[0].runtime.max_seqs: unknown field"),
    (("max_num_seqs: 8", "max_num_seqs: eight"), "deployments[0].runtime.max_num_seqs: expected int"),
    (("dtype: float32", "dtype: int4"), "deployments[0].runtime.dtype: must be one of"),
    (("num_threads: 1", "num_threads: 512"), "deployments[0].runtime.num_threads: 512 threads"),
    (("replicas: 2", "replicas: 0"), "deployments[0].replicas: must be at least 1"),
    (("policy: least_loaded", "policy: random"), "deployments[0].router: router policy must be one of"),
    (("name: hosted", "name: smol"), "deployments[1].name: 'smol' has two stable versions"),
    (("model: gpt-4o-mini}", "model: gpt-4o-mini, api_key_env: INFERD_NO_SUCH_VAR}"),
     "deployments[1].external.api_key_env: $INFERD_NO_SUCH_VAR is not set"),
    (("model: gpt-4o-mini}", "model: gpt-4o-mini, api: watsonx}"), "deployments[1].external.api: must be one of"),
    (("model: gpt-4o-mini}", "model: gpt-4o-mini, auth: x-api-key}"),
     "deployments[1].external.auth: bearer, or x-api-key for api: anthropic"),
    (("model: gpt-4o-mini}", "model: gpt-4o-mini, api: bedrock}"),
     "deployments[1].external.base_url: not bedrock-runtime.REGION.amazonaws.com, and $AWS_REGION is not set"),
])
def test_errors_name_the_field(tmp_path, digest, edit, message):
    with pytest.raises(SpecError, match=message.replace("$", r"\$").replace("[", r"\[").replace("]", r"\]")):
        load_spec(write(tmp_path, GOOD.format(digest=digest).replace(*edit)))


def test_a_digest_mismatch_is_an_error(tmp_path, digest):
    with pytest.raises(SpecError, match=r"deployments\[0\].model.sha256: the model's digest is"):
        load_spec(write(tmp_path, GOOD.format(digest="0" * 64)))


def test_config_check_command(tmp_path, digest):
    ok = subprocess.run([sys.executable, "-m", "inferd.cli", "config", "check",
                         str(write(tmp_path, GOOD.format(digest=digest)))], capture_output=True, text=True, cwd=ROOT)
    assert ok.returncode == 0 and "smol (2 replica(s)), hosted (external)" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "inferd.cli", "config", "check",
                          str(write(tmp_path, "deployments: []"))], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 1 and "at least one" in bad.stderr


EMBEDDING = """
deployments:
  - name: chat
    model: {source: default}
  - name: minilm
    kind: embedding
    model: {source: default}
    runtime: {max_batch_tokens: 4096, max_queue_delay_ms: 1, truncate: true}
    replicas: 2
"""


def test_an_embedding_deployment_takes_its_kinds_settings(tmp_path):
    spec = load_spec(write(tmp_path, EMBEDDING))
    minilm = spec.deployments[1]
    assert minilm.kind == "embedding" and minilm.runtime.max_batch_tokens == 4096 and minilm.runtime.truncate
    args = replica_args(minilm.model.source, minilm.name, minilm.runtime, kind=minilm.kind)
    assert args[:4] == ["--kind", "embedding", "--served-model-name", "minilm"] and "--truncate" in args
    assert spec.deployments[0].runtime.max_num_seqs == 64  # text keeps the engine's settings


@pytest.mark.parametrize("change, error", [
    (("max_batch_tokens: 4096", "max_num_seqs: 4"), "deployments[1].runtime.max_num_seqs: unknown field"),
    (("kind: embedding", "kind: vision"), "deployments[1].kind: must be one of text, embedding"),
    (("max_queue_delay_ms: 1", "max_queue_delay_ms: -1"), "deployments[1].runtime.max_queue_delay_ms: must be"),
])
def test_embedding_settings_are_checked_by_their_kind(tmp_path, change, error):
    with pytest.raises(SpecError, match=error.replace("[", r"\[").replace("]", r"\]")):
        load_spec(write(tmp_path, EMBEDDING.replace(*change)))


def test_a_fallback_must_be_of_the_same_kind(tmp_path):
    text = EMBEDDING.replace("    replicas: 2\n", "    replicas: 2\n    fallbacks: [chat]\n")
    with pytest.raises(SpecError, match="is a text deployment, not embedding"):
        load_spec(write(tmp_path, text))


QUALITY = """
deployments:
  - name: smol
    model: {source: default}
    runtime: {dtype: float32, num_threads: 1}
    quality: {split: acceptance, floor: {answer: 0.3, decline: 0.5}, limit: 4}
"""


def test_a_quality_spec_loads_with_its_floor(tmp_path):
    q = load_spec(write(tmp_path, QUALITY)).deployments[0].quality
    assert (q.set, q.split, q.limit, q.floor.as_dict()) == ("default", "acceptance", 4, {"answer": 0.3, "decline": 0.5})


@pytest.mark.parametrize("edit, message", [
    (("answer: 0.3", "answer: 1.3"), r"deployments\[0\].quality.floor.answer: a share between 0 and 1"),
    (("answer: 0.3", "answers: 0.3"), r"deployments\[0\].quality.floor.answers: unknown field"),
    (("split: acceptance", "split: test"), r"deployments\[0\].quality: unknown split 'test'"),
    (("split: acceptance", "set: /no/such/set"), r"deployments\[0\].quality: /no/such/set: "),
])
def test_quality_errors_name_the_field(tmp_path, edit, message):
    with pytest.raises(SpecError, match=message):
        load_spec(write(tmp_path, QUALITY.replace(*edit)))
