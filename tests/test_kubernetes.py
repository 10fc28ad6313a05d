"""docs/kubernetes: the manifests validate against Kubernetes' schemas and say what Fern accepts."""

from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from sidecar.cli import build_parser
from sidecar.metrics import LANE_FAMILIES

ROOT = Path(__file__).resolve().parents[1] / "docs" / "kubernetes"
KUBERNETES_VERSION = "1.33.0"


def _documents(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((ROOT / name).read_text()) if d]


def _by_kind(docs: list[dict]) -> dict[str, dict]:
    return {d["kind"]: d for d in docs}


@pytest.mark.parametrize("doc", _documents("fern.yaml"), ids=lambda d: d["kind"])
def test_each_manifest_validates_strictly(doc):
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_pods_run_fern_serve_with_flags_it_accepts_and_no_open_door():
    docs = _by_kind(_documents("fern.yaml"))
    (container,) = docs["Deployment"]["spec"]["template"]["spec"]["containers"]
    args = build_parser().parse_args(container["args"])
    assert args.verb == "serve"
    assert args.tls_cert and args.tls_key and args.token_file and args.metrics_token_file
    assert not args.insecure
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": args.port, "http": args.http_port, "metrics": args.metrics_port}
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"


def test_the_service_is_headless_and_every_selector_picks_the_pods():
    docs = _by_kind(_documents("fern.yaml"))
    labels = docs["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert docs["Service"]["spec"]["clusterIP"] == "None"
    assert docs["Service"]["spec"]["selector"].items() <= labels.items()
    assert docs["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert docs["Deployment"]["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_the_scaler_targets_the_deployment_on_metrics_fern_exports():
    (scaled,) = _documents("keda.yaml")
    deployment = _by_kind(_documents("fern.yaml"))["Deployment"]
    assert scaled["kind"] == "ScaledObject" and scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert scaled["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    exported = {f.name for f in LANE_FAMILIES}
    used = set(re.findall(r"\b(fern_[a-z_]+)\{", trigger["metadata"]["query"]))
    assert used and used <= exported, used - exported
    assert set(re.findall(r'lane="(\w+)"', trigger["metadata"]["query"])) <= {"online", "batch"}
    float(trigger["metadata"]["threshold"])
