"""The checked-in stubs are exactly what grpcio-tools makes from the .proto."""

import pathlib

import pytest

grpc_tools = pytest.importorskip("grpc_tools.protoc")

PROTO_ROOT = pathlib.Path(__file__).resolve().parents[1] / "proto"
GENERATED = ("controller_pb2.py", "controller_pb2_grpc.py", "controller_pb2.pyi")


def test_stubs_match_proto(tmp_path):
    status = grpc_tools.main([
        "grpc_tools.protoc", f"-I{PROTO_ROOT}", f"--python_out={tmp_path}",
        f"--grpc_python_out={tmp_path}", f"--pyi_out={tmp_path}",
        str(PROTO_ROOT / "vcap/v1/controller.proto")])
    assert status == 0
    for name in GENERATED:
        fresh = (tmp_path / "vcap/v1" / name).read_text()
        checked_in = (PROTO_ROOT / "vcap/v1" / name).read_text()
        assert fresh == checked_in, (
            f"proto/vcap/v1/{name} is stale: regenerate with "
            "python -m grpc_tools.protoc -I proto --python_out=proto --grpc_python_out=proto "
            "--pyi_out=proto proto/vcap/v1/controller.proto")
