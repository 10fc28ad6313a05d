"""The committed generated code in sidecar/wire matches protos/fern/v1/embedder.proto."""

from sidecar.wire import embedder_pb2 as pb
from sidecar.wire import generate


def test_generated_code_matches_proto():
    assert generate.main(["--check"]) == 0


def test_the_stubs_grpcio_floor_is_the_one_the_package_asks_for():
    import tomllib
    from pathlib import Path

    from sidecar.wire import embedder_pb2_grpc

    project = tomllib.loads((Path(generate.__file__).parents[2] / "pyproject.toml").read_text())["project"]
    assert f"grpcio>={generate.GRPC_FLOOR}" in project["dependencies"]
    assert embedder_pb2_grpc.GRPC_GENERATED_VERSION == generate.GRPC_FLOOR


def test_descriptor_is_the_versioned_service():
    service = pb.DESCRIPTOR.services_by_name["Embedder"]
    assert service.full_name == "fern.v1.Embedder"
    assert set(service.methods_by_name) == {"Embed", "EmbedStream", "ListModels", "Rerank"}
    stream = service.methods_by_name["EmbedStream"]
    assert stream.client_streaming and stream.server_streaming


def test_request_carries_every_design_field():
    fields = set(pb.EmbedRequest.DESCRIPTOR.fields_by_name)
    assert {"request_id", "model", "texts", "token_ids", "lane", "prompt_name", "normalize",
            "truncation", "dimensions", "encoding", "return_sparse"} <= fields
    # normalize is optional so "unset" means the model's default, not False.
    assert pb.EmbedRequest.DESCRIPTOR.fields_by_name["normalize"].has_presence
