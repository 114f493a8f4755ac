"""Issue 7.6: who may change the policy. Loopback by default; beyond the machine a bearer token
(constant-time compare) or mutual TLS, else the sidecar refuses to start; read-only RPCs stay
open; every accepted change is audited (who, when, old, new); segments are 0600 (0660 with a
group) and a segment owned by another user is refused."""

import datetime
import hmac
import logging
import os
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from vcap.engine_hook.sim import SimConfig, create_segment
from vcap.segment import Segment, SegmentConfig, SegmentError
from vcap.sidecar import auth, vcapctl
from vcap.sidecar.app import Sidecar, SidecarConfig
from vcap.v1 import controller_pb2 as pb
from vcap.v1 import controller_pb2_grpc as pb_grpc

from ._helpers import wait_for

CONFIG = SegmentConfig(stride=6, max_bs=16, num_moe_layers=2, ring_slots=4)
SET = pb.SetPolicyRequest(policy=pb.Policy(mode=pb.MODE_FIXED, fixed_k=2), reason="auth test")


def _attached(segment_name, **config):
    engine = Segment.create(segment_name, CONFIG)
    sidecar = Sidecar(SidecarConfig(segment=segment_name, metrics_address="", **config)).start()
    wait_for(lambda: sidecar.link.attach_count, 10, "attach")
    return engine, sidecar


def test_loopback_needs_nothing_and_every_change_is_audited(segment_name, caplog):
    engine, sidecar = _attached(segment_name, grpc_address="127.0.0.1:0")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{sidecar.grpc_port}") as channel, \
                caplog.at_level(logging.INFO, logger="vcap.audit"):
            stub = pb_grpc.ControllerStub(channel)
            stub.SetPolicy(SET, timeout=10)
            stub.SetPolicy(pb.SetPolicyRequest(policy=pb.Policy(mode=pb.MODE_FIXED, fixed_k=3)), timeout=10)
            with pytest.raises(grpc.RpcError):
                stub.SetPolicy(pb.SetPolicyRequest(policy=pb.Policy(mode=pb.MODE_FIXED, fixed_k=9)), timeout=10)
        audits = [r.getMessage() for r in caplog.records if r.name == "vcap.audit"]
        assert len(audits) == 2, audits  # accepted changes only
        first, second = audits
        assert "by ipv4:127.0.0.1:" in first and "(auth test)" in first  # who, why
        assert f"at {datetime.date.today():%Y-%m-%d}T" in first  # when
        assert "generation 0 -> 1" in first and "old none" in first and "new fixed k=2" in first
        assert "generation 1 -> 2" in second and "old fixed k=2; new fixed k=3" in second
    finally:
        sidecar.stop()
        engine.unlink()


def test_beyond_loopback_without_credentials_refuses_to_start(segment_name):
    with pytest.raises(ValueError, match="listens beyond this machine: give --auth-token-file"):
        Sidecar(SidecarConfig(segment=segment_name, grpc_address="0.0.0.0:0", metrics_address=""))
    result = subprocess.run([sys.executable, "-m", "vcap.sidecar.cli", "--segment", segment_name,
                             "--grpc", "0.0.0.0:50999", "--metrics", ""], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "listens beyond this machine" in result.stderr and "--tls-cert" in result.stderr


def test_token_over_tls_guards_every_method_in_constant_time(segment_name, tmp_path, monkeypatch, caplog):
    """Beyond loopback the token guards reads too (they disclose the segment, the engine's pid,
    the policy and the statistics) and travels over TLS; health stays open."""
    _certificates(tmp_path)
    token = "a-long-enough-bearer-token-0123456789"
    (tmp_path / "token").write_text(token + "\n")
    (tmp_path / "token").chmod(0o400)
    compared = []
    real = hmac.compare_digest
    monkeypatch.setattr(auth.hmac, "compare_digest", lambda a, b: compared.append(1) or real(a, b))
    with caplog.at_level(logging.INFO, logger="vcap.sidecar"):
        engine, sidecar = _attached(segment_name, grpc_address="0.0.0.0:0", auth_token_file=str(tmp_path / "token"),
                                    tls_cert=str(tmp_path / "server.pem"), tls_key=str(tmp_path / "server.key"))
    # the start-up hint names what vcapctl needs here
    assert any("get` shows the policy in force" in r.getMessage() and "--tls-ca" in r.getMessage()
               and "--token-file" in r.getMessage() for r in caplog.records), caplog.text
    good = (("authorization", f"Bearer {token}"),)
    try:
        credentials = grpc.ssl_channel_credentials((tmp_path / "ca.pem").read_bytes())
        with grpc.secure_channel(f"127.0.0.1:{sidecar.grpc_port}", credentials) as channel:
            stub = pb_grpc.ControllerStub(channel)
            before = engine.read_block(engine.layout.control_offset)
            for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", token),),
                             (("authorization", f"Bearer {token}x"),)):
                for call in (lambda: stub.SetPolicy(SET, metadata=metadata, timeout=10),
                             lambda: stub.SetControlMode(pb.SetControlModeRequest(
                                 control_mode=pb.CONTROL_MODE_MANUAL), metadata=metadata, timeout=10),
                             lambda: stub.GetPolicy(pb.GetPolicyRequest(), metadata=metadata, timeout=10),
                             lambda: stub.GetStats(pb.GetStatsRequest(), metadata=metadata, timeout=10),
                             lambda: next(stub.WatchStats(pb.WatchStatsRequest(), metadata=metadata, timeout=10))):
                    with pytest.raises(grpc.RpcError) as caught:
                        call()
                    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
                    assert ("does not match the sidecar's" if metadata else "authorization: Bearer <token>") \
                        in caught.value.details()
            assert engine.read_block(engine.layout.control_offset) == before
            assert compared, "the token was not compared with hmac.compare_digest"
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            stub.GetPolicy(pb.GetPolicyRequest(), metadata=good, timeout=10)
            stub.GetStats(pb.GetStatsRequest(), metadata=good, timeout=10)
            next(stub.WatchStats(pb.WatchStatsRequest(), metadata=good, timeout=10))
            state = stub.SetPolicy(SET, metadata=good, timeout=10)
            assert engine.read_policy()[1] == state.generation
    finally:
        sidecar.stop()
        engine.unlink()


def test_token_in_clear_beyond_loopback_refused_or_shouted(segment_name, tmp_path, caplog):
    token = tmp_path / "token"
    token.write_text("a-long-enough-bearer-token-0123456789")
    token.chmod(0o600)
    with pytest.raises(ValueError, match="the token travels in clear.*--tls-cert and --tls-key"):
        Sidecar(SidecarConfig(segment=segment_name, grpc_address="0.0.0.0:0", metrics_address="",
                              auth_token_file=str(token)))
    result = subprocess.run([sys.executable, "-m", "vcap.sidecar.cli", "--segment", segment_name,
                             "--grpc", "0.0.0.0:0", "--metrics", "", "--auth-token-file", str(token)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "travels in clear" in result.stderr and "Traceback" not in result.stderr
    engine, sidecar = _attached(segment_name, grpc_address="0.0.0.0:0", auth_token_file=str(token),
                                allow_cleartext_token=True)
    sidecar.stop()
    engine.unlink()
    assert any("THE TOKEN TRAVELS IN CLEAR" in warning for warning in sidecar.warnings)


def test_world_readable_token_file_refused(segment_name, tmp_path):
    token = tmp_path / "token"
    token.write_text("a-long-enough-bearer-token-0123456789")
    token.chmod(0o644)
    with pytest.raises(ValueError, match="readable by every local user.*chmod o-r"):
        Sidecar(SidecarConfig(segment=segment_name, grpc_address="127.0.0.1:0", metrics_address="",
                              auth_token_file=str(token)))
    token.chmod(0o440)  # group-readable (a Kubernetes secret mounted for the pod's group) is fine
    Sidecar(SidecarConfig(segment=segment_name, grpc_address="127.0.0.1:0", metrics_address="",
                          auth_token_file=str(token)))


def test_short_token_file_refused(segment_name, tmp_path):
    (tmp_path / "token").write_text("short")
    (tmp_path / "token").chmod(0o600)
    with pytest.raises(ValueError, match="at least 16 characters"):
        Sidecar(SidecarConfig(segment=segment_name, grpc_address="0.0.0.0:0", metrics_address="",
                              auth_token_file=str(tmp_path / "token")))


def _certificates(directory):
    """A CA, a server certificate for 127.0.0.1, a client certificate, and a rogue client
    certificate from another CA; PEM files in ``directory``."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    import ipaddress

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(common):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    def issue(subject, key, issuer, issuer_key, ca=False, san=None):
        builder = (x509.CertificateBuilder().subject_name(name(subject)).issuer_name(name(issuer))
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    def write(stem, key, cert):
        (directory / f"{stem}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        (directory / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    keys = {stem: ec.generate_private_key(ec.SECP256R1()) for stem in ("ca", "rogue-ca", "server", "client", "rogue")}
    write("ca", keys["ca"], issue("vcap test CA", keys["ca"], "vcap test CA", keys["ca"], ca=True))
    write("rogue-ca", keys["rogue-ca"], issue("rogue CA", keys["rogue-ca"], "rogue CA", keys["rogue-ca"], ca=True))
    write("server", keys["server"], issue("vcap-sidecar", keys["server"], "vcap test CA", keys["ca"],
                                          san=[x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                               x509.DNSName("localhost")]))
    write("client", keys["client"], issue("operator-alice", keys["client"], "vcap test CA", keys["ca"]))
    write("rogue", keys["rogue"], issue("mallory", keys["rogue"], "rogue CA", keys["rogue-ca"]))


def test_mutual_tls(segment_name, tmp_path, caplog):
    _certificates(tmp_path)
    read = lambda stem: (tmp_path / stem).read_bytes()  # noqa: E731
    engine, sidecar = _attached(segment_name, grpc_address="0.0.0.0:0", tls_cert=str(tmp_path / "server.pem"),
                                tls_key=str(tmp_path / "server.key"), tls_client_ca=str(tmp_path / "ca.pem"))
    target = f"127.0.0.1:{sidecar.grpc_port}"
    try:
        good = grpc.ssl_channel_credentials(read("ca.pem"), read("client.key"), read("client.pem"))
        with grpc.secure_channel(target, good) as channel, caplog.at_level(logging.INFO, logger="vcap.audit"):
            stub = pb_grpc.ControllerStub(channel)
            state = stub.SetPolicy(SET, timeout=10)
            assert engine.read_policy()[1] == state.generation
        assert any("cert CN=operator-alice" in r.getMessage() for r in caplog.records if r.name == "vcap.audit")
        before = engine.read_block(engine.layout.control_offset)
        for credentials in (grpc.ssl_channel_credentials(read("ca.pem")),  # no client certificate
                            grpc.ssl_channel_credentials(read("ca.pem"), read("rogue.key"), read("rogue.pem"))):
            with grpc.secure_channel(target, credentials) as channel:
                with pytest.raises(grpc.RpcError) as caught:
                    pb_grpc.ControllerStub(channel).SetPolicy(SET, timeout=10)
                assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        with grpc.insecure_channel(target) as channel:  # plaintext to a TLS port
            with pytest.raises(grpc.RpcError):
                pb_grpc.ControllerStub(channel).GetPolicy(pb.GetPolicyRequest(), timeout=5)
        assert engine.read_block(engine.layout.control_offset) == before
    finally:
        sidecar.stop()
        engine.unlink()


def test_segment_modes(segment_name):
    segment = create_segment(segment_name, SimConfig(max_bs=8, num_moe_layers=2))
    assert os.stat(segment.path).st_mode & 0o777 == 0o600
    segment.unlink()
    gid = os.getgroups()[-1] if os.getgroups() else os.getgid()
    segment = create_segment(segment_name, SimConfig(max_bs=8, num_moe_layers=2), group=gid)
    info = os.stat(segment.path)
    assert info.st_mode & 0o777 == 0o660 and info.st_gid == gid
    segment.unlink()


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_segment_really_owned_by_another_user_is_refused(segment_name):
    segment = Segment.create(segment_name, CONFIG)
    os.chown(segment.path, 65534, 65534)  # nobody
    with pytest.raises(SegmentError, match="owned by uid 65534, not by this user"):
        Segment.attach(segment_name)
    segment.unlink()


def test_vcapctl_reaches_a_sidecar_beyond_loopback_with_tls_and_token(segment_name, tmp_path, capsys):
    """Every vcapctl command sends the token and speaks TLS (issue 14 follow-up): against a sidecar
    on 0.0.0.0 with a token over TLS, and one with mutual TLS."""
    _certificates(tmp_path)
    token = tmp_path / "token"
    token.write_text("a-long-enough-bearer-token-0123456789\n")
    token.chmod(0o400)
    engine, sidecar = _attached(segment_name, grpc_address="0.0.0.0:0", auth_token_file=str(token),
                                tls_cert=str(tmp_path / "server.pem"), tls_key=str(tmp_path / "server.key"))

    def ctl(*args, target=None):
        capsys.readouterr()
        rc = vcapctl.main(["--target", target or f"127.0.0.1:{sidecar.grpc_port}", *args])
        out = capsys.readouterr()
        return rc, out.out + out.err

    tls = ["--tls-ca", str(tmp_path / "ca.pem")]
    auth_flags = tls + ["--token-file", str(token)]
    try:
        for command in (["get"], ["set", "--k", "3"], ["set", "--threshold", "0.3"], ["watch", "--count", "1"],
                        ["history"], ["rollback"], ["set", "--mode", "auto"]):
            rc, out = ctl(*auth_flags, *command)
            assert rc == 0, (command, out)
        policy, generation, _ = engine.read_policy()
        assert (policy.mode, policy.fixed_k, generation) == ("fixed", 3, 3)
        assert sidecar.control.control_mode == "auto"
        # the certificate names 127.0.0.1 and localhost: another name is refused unless overridden
        rc, out = ctl(*auth_flags, "--tls-server-name", "localhost", "get")
        assert rc == 0, out
        rc, out = ctl(*auth_flags, "--tls-server-name", "vcap.elsewhere.example", "get")
        assert rc == 1 and "TLS handshake" in out and "--tls-server-name" in out
        # without the token every command is refused, reads included; without TLS none connects
        for command in (["get"], ["history"], ["watch", "--count", "1"], ["rollback", "1"]):
            rc, out = ctl(*tls, *command)
            assert rc == 1 and "UNAUTHENTICATED" in out and "--token-file" in out, (command, out)
        rc, out = ctl("--token-file", str(token), "get")
        assert rc == 1 and "UNAUTHENTICATED" not in out and "needs --tls-ca" in out, out
        rc, out = ctl("--tls-cert", str(tmp_path / "client.pem"), "get")
        assert rc == 2 and "--tls-cert needs --tls-ca" in out
        rc, out = ctl(*tls, "--tls-cert", str(tmp_path / "client.pem"), "get")
        assert rc == 2 and "needs both --tls-cert and --tls-key" in out
    finally:
        sidecar.stop()
        engine.unlink()

    engine, sidecar = _attached(segment_name, grpc_address="0.0.0.0:0", tls_cert=str(tmp_path / "server.pem"),
                                tls_key=str(tmp_path / "server.key"), tls_client_ca=str(tmp_path / "ca.pem"))
    try:
        mutual = tls + ["--tls-cert", str(tmp_path / "client.pem"), "--tls-key", str(tmp_path / "client.key")]
        rc, out = ctl(*mutual, "set", "--k", "2", "--reason", "mtls")
        assert rc == 0, out
        rc, out = ctl(*mutual, "history")
        assert rc == 0 and "(cert CN=operator-alice)" in out and "(mtls)" in out
        rogue = tls + ["--tls-cert", str(tmp_path / "rogue.pem"), "--tls-key", str(tmp_path / "rogue.key")]
        assert ctl(*rogue, "get")[0] == 1
    finally:
        sidecar.stop()
        engine.unlink()
