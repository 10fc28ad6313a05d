"""Regenerates the committed gRPC code in sidecar/wire from protos/ (or checks it is current)."""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parents[2] / "protos"
PROTO_FILE = "fern/v1/embedder.proto"
WIRE_DIR = Path(__file__).resolve().parent
GENERATED = ("embedder_pb2.py", "embedder_pb2.pyi", "embedder_pb2_grpc.py")
# The generated stub refuses to import under a grpcio older than the version it names. protoc's
# plugin names its own release; the committed code names this floor instead (the one pyproject.toml
# asks for), so a newer grpcio-tools regenerates the same code and no user is refused for nothing.
GRPC_FLOOR = "1.85.1"
_STAMP = re.compile(r"^GRPC_GENERATED_VERSION = '[^']*'$", re.M)


def generate() -> dict[str, str]:
    """Runs protoc on the .proto and returns the generated files' text by name."""
    from grpc_tools import protoc  # only needed by developers, not at run time
    import grpc_tools

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    with tempfile.TemporaryDirectory() as out:
        rc = protoc.main([
            "protoc", f"-I{PROTO_ROOT}", f"-I{include}",
            f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}",
            str(PROTO_ROOT / PROTO_FILE),
        ])
        if rc != 0:
            raise RuntimeError(f"protoc failed on {PROTO_FILE} (exit {rc})")
        gen_dir = Path(out) / "fern" / "v1"
        files = {name: (gen_dir / name).read_text() for name in GENERATED}
    # protoc writes absolute imports rooted at protos/; the package lives in sidecar.wire.
    stub = files["embedder_pb2_grpc.py"].replace("from fern.v1 import embedder_pb2", "from sidecar.wire import embedder_pb2")
    files["embedder_pb2_grpc.py"] = _STAMP.sub(f"GRPC_GENERATED_VERSION = '{GRPC_FLOOR}'", stub, count=1)
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the committed code is stale")
    args = parser.parse_args(argv)
    stale = []
    for name, text in generate().items():
        path = WIRE_DIR / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    if stale:
        print(f"stale generated code: {', '.join(stale)}; run python -m sidecar.wire.generate", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
