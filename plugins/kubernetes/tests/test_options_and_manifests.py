"""The options a user writes, checked against the client's models when the config loads, and
the manifests ``planaria kubernetes manifest`` prints, checked against them again."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from planaria.scheduler.api import LaunchSpec
from planaria_kubernetes import KubernetesOptions, pods
from planaria_kubernetes.manifest import check, cluster_name, manifests

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "kubernetes.yaml"


def manifest(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "planaria", "kubernetes", "manifest", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_misspelt_volume_field_is_an_error_naming_its_path() -> None:
    with pytest.raises(ValidationError) as caught:
        KubernetesOptions(image="x", volumes=[{"name": "w", "hostPat": {"path": "/w"}}])
    assert "[0].hostPat: Extra inputs are not permitted" in str(caught.value)


def test_a_bad_quantity_and_a_bad_toleration_are_errors() -> None:
    with pytest.raises(ValidationError, match="'lots' is not a Kubernetes quantity"):
        KubernetesOptions(image="x", limits={"nvidia.com/gpu": "lots"})
    with pytest.raises(
        ValidationError, match=r"tolerationSeconds: Input should be a valid integer"
    ):
        KubernetesOptions(image="x", tolerations=[{"key": "k", "tolerationSeconds": "soon"}])


def test_the_pod_is_valid_and_keeps_the_token_out_of_its_spec() -> None:
    options = KubernetesOptions(
        image="trainer:1",
        limits={"huawei.com/Ascend910": "8"},
        shm_size="32Gi",
        node_selector={"pool": "npu"},
    )
    spec = LaunchSpec(
        job="Big Job",
        command=("python", "-m", "planaria", "agent"),
        env={"PLANARIA_TOKEN": "s3cret", "PLANARIA_MASTER": "http://10.0.0.5:1234"},
        run_id="Big Job-20261203-120000-ab12",
    )
    pod = pods.pod(spec, options, "node-3", owner=None, excluded=["kube-b"])
    raw = pods.as_dict(pod)
    assert check([raw]) == []
    assert "s3cret" not in yaml.safe_dump(raw)
    token = next(e for e in raw["spec"]["containers"][0]["env"] if e["name"] == "PLANARIA_TOKEN")
    assert token["valueFrom"]["secretKeyRef"]["name"] == pods.secret_name(spec)
    assert raw["metadata"]["name"] == pods.pod_name(spec, "node-3")
    assert len(raw["metadata"]["name"]) <= 63 and raw["metadata"]["name"].islower()
    terms = raw["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert terms["nodeSelectorTerms"][0]["matchExpressions"] == [
        {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["kube-b"]}
    ]
    shm = next(v for v in raw["spec"]["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}
    assert raw["spec"]["restartPolicy"] == "Never"
    secret = pods.as_dict(pods.secret(spec, None))
    assert check([secret]) == []


def test_the_manifests_of_the_example_are_valid_and_least_privilege() -> None:
    done = manifest(str(EXAMPLE))
    assert done.returncode == 0, done.stderr
    objects = list(yaml.safe_load_all(done.stdout))
    assert check(objects) == []
    kinds = [o["kind"] for o in objects]
    assert kinds == [
        "ConfigMap", "ServiceAccount", "Role", "RoleBinding", "ClusterRole",
        "ClusterRoleBinding", "Job",
    ]  # fmt: skip
    job = objects[-1]
    assert job["spec"]["backoffLimit"] == 0
    # The master's run directory is on the volume the nodes share (for `--resume`).
    master = job["spec"]["template"]["spec"]
    assert {"name": "work", "mountPath": "/work"} in master["containers"][0]["volumeMounts"]
    assert "work" in [v["name"] for v in master["volumes"]]
    rules = {r["resources"][0]: r["verbs"] for r in objects[2]["rules"]}
    assert set(rules) == {"pods", "secrets", "events"}
    assert "patch" in objects[4]["rules"][0]["verbs"]  # the example cordons
    config = yaml.safe_load(objects[0]["data"]["job.yaml"])
    assert config["scheduler"]["backend"] == "kubernetes"
    # Without cordon the master may only read nodes.
    plain = manifest(str(EXAMPLE), "--set", "scheduler.options.cordon=false")
    assert plain.returncode == 0, plain.stderr
    cluster_role = list(yaml.safe_load_all(plain.stdout))[4]
    assert cluster_role["rules"][0]["verbs"] == ["get", "list", "watch"]


def test_the_docs_show_the_manifests_the_command_prints() -> None:
    done = manifest(str(EXAMPLE))
    assert done.returncode == 0, done.stderr
    docs = (ROOT / "docs" / "kubernetes.md").read_text()
    assert done.stdout.strip() in docs, "docs/kubernetes.md shows an outdated manifest"


def test_the_manifest_of_a_job_for_another_scheduler_is_refused(tmp_path: Path) -> None:
    done = manifest(str(ROOT / "examples" / "local.yaml"))
    assert done.returncode == 2
    assert "scheduler.backend: is 'local'" in done.stderr


DNS_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
JOB_NAME = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9_.-]{0,62}\Z")  # job.name's own pattern
NAMESPACE = st.from_regex(DNS_LABEL.pattern.replace("^", r"\A").replace("$", r"\Z")) | st.text(
    min_size=1, max_size=80
)


def _cluster_names(namespace: str, job: str) -> set[str]:
    objects = manifests(job, "{}", KubernetesOptions(image="x", namespace=namespace))
    raw = [pods.as_dict(o) for o in objects]
    return {o["metadata"]["name"] for o in raw if o["kind"].startswith("Cluster")}


def test_jobs_of_two_namespaces_whose_names_join_alike_get_their_own_cluster_role() -> None:
    first = _cluster_names("team-a", "train")
    second = _cluster_names("team", "a-train")
    assert len(first) == len(second) == 1
    assert first != second
    assert first.pop().startswith("planaria-team-a-train-nodes-")


@given(st.tuples(NAMESPACE, JOB_NAME), st.tuples(NAMESPACE, JOB_NAME))
def test_cluster_wide_names_are_valid_and_one_per_namespace_and_job(
    one: tuple[str, str], other: tuple[str, str]
) -> None:
    names = {cluster_name(*one), cluster_name(*other)}
    assert len(names) == (1 if one == other else 2)
    for name in names:
        assert DNS_LABEL.match(name), name
    assert _cluster_names(*one) == {cluster_name(*one)}
