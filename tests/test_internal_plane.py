"""The drafter's internal plane is closed (docs/architecture.md, "Contracts"), tried as a local attacker
would, over real sockets against a real drafter process: no secret or a wrong one is UNAUTHENTICATED; a
second Rounds stream is refused while the verifier's is served (which goes on), but a verifier whose process
died is not locked out; Reload loads only folders below its root and never echoes filesystem errors; ring names in Hello
are checked (no path, no symlink)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import grpc
import pytest

from services import Service, free_port
from tandem import internal_secret
from tandem.rpc.drafter.v1 import PROTOCOL_VERSION
from tandem.rpc.drafter.v1 import drafter_pb2 as pb
from tandem.rpc.drafter.v1 import drafter_pb2_grpc as pb_grpc

SECRET = "s3cret-for-tests-" + "x" * 16


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    from draft_checkpoints import make_draft, write_pair

    root = tmp_path_factory.mktemp("plane")
    target = write_pair(root / "models")
    (root / "models" / "not_a_head").mkdir()
    os.symlink(root / "models" / "not_a_head", root / "models" / "alias")
    make_draft(root / "outside_head", target, seed=3)
    os.symlink(root / "outside_head", root / "models" / "link_out")
    return root


@pytest.fixture(scope="module")
def drafter(pair_dirs, tmp_path_factory):
    models = pair_dirs / "models"
    service = Service("drafter", ["--model", str(models / "draft"), "--target-model", str(models / "target")],
                      free_port(), tmp_path_factory.mktemp("logs") / "drafter.log",
                      env={internal_secret.ENV: SECRET}).start()
    yield service
    service.stop()


def target_info(pair_dirs) -> pb.TargetInfo:
    from tandem.configs.model import ModelConfig
    from tandem.configs.eagle3 import DraftConfig, validate_draft

    target = ModelConfig.from_dir(pair_dirs / "models" / "target")
    layers = validate_draft(DraftConfig.from_dir(pair_dirs / "models" / "draft"), target)
    return pb.TargetInfo(model="t", hidden_size=target.hidden_size, vocab_size=target.vocab_size,
                         num_layers=target.num_layers, capture_layers=list(layers)), len(layers) * target.hidden_size


def hello(ring_fields: dict, target: pb.TargetInfo) -> pb.VerifierMessage:
    return pb.VerifierMessage(hello=pb.Hello(protocol_version=PROTOCOL_VERSION, ring=pb.RingSpec(**ring_fields),
                                             target=target))


def raw_stream(address: str, message: pb.VerifierMessage, metadata=()) -> grpc.RpcError | pb.DrafterMessage:
    """Open a Rounds stream, send one message → the first reply, or the error that ended the stream."""
    with grpc.insecure_channel(address) as channel:
        try:
            return next(iter(pb_grpc.DrafterStub(channel).Rounds(iter([message]), metadata=metadata, timeout=10)))
        except grpc.RpcError as e:
            return e


@pytest.fixture()
def ring(pair_dirs):
    from tandem.ring import HiddenRing

    _, width = target_info(pair_dirs)
    with HiddenRing.create(64, width, "float32") as r:
        yield r


def verifier_client(address: str, ring, target, secret=SECRET):
    from verifier.drafter_client import DrafterClient

    client = DrafterClient(address, ring, target, deadline_s=5.0, reconnect_interval_s=0.2, secret=secret)
    client.start()
    return client


@pytest.mark.parametrize("metadata", [(), ((internal_secret.METADATA_KEY, "wrong-" + SECRET),),
                                      ((internal_secret.METADATA_KEY, SECRET[:-1]),)])
def test_rounds_and_reload_without_the_secret_are_unauthenticated(drafter, pair_dirs, ring, metadata):
    target, _ = target_info(pair_dirs)
    refused = "refused a call without the internal secret"
    logged = drafter.log().count(refused)  # (the drafter and its log serve every parameter set)
    error = raw_stream(drafter.address, hello(ring.spec.to_fields(), target), metadata)
    assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(drafter.address) as channel, pytest.raises(grpc.RpcError) as e:
        pb_grpc.DrafterStub(channel).Reload(pb.ReloadRequest(draft_model=str(pair_dirs / "models" / "draft")),
                                            metadata=metadata, timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    if logged == 0:  # (a refusal within 5 s of the last line is counted into the next one: tandem.log_limit)
        time.sleep(0.1)
        assert drafter.log().count(refused) == 1


def test_tandem_reload_drafter_without_the_secret_says_which_flag_gives_it(drafter, pair_dirs, monkeypatch):
    from tandem.errors import TandemError
    from tandem.reload_client import reload_drafter

    monkeypatch.delenv(internal_secret.ENV, raising=False)
    with pytest.raises(TandemError, match="UNAUTHENTICATED: .*give --internal-secret-file"):
        reload_drafter(drafter.address, str(pair_dirs / "models" / "draft"), timeout_s=10)
    with pytest.raises(TandemError, match="UNAUTHENTICATED") as e:  # (a wrong secret: no hint to give one)
        reload_drafter(drafter.address, str(pair_dirs / "models" / "draft"), timeout_s=10, secret="wrong")
    assert "--internal-secret-file" not in str(e.value)


def test_a_second_stream_is_refused_and_the_verifiers_goes_on(drafter, pair_dirs, ring):
    target, _ = target_info(pair_dirs)
    client = verifier_client(drafter.address, ring, target)
    try:
        assert client.wait_connected(10.0)
        error = raw_stream(drafter.address, hello(ring.spec.to_fields(), target),
                           internal_secret.metadata(SECRET))
        assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.ALREADY_EXISTS
        assert client.available and client.draft([], None) == []  # the verifier's stream still answers rounds
    finally:
        client.close()


_DOOMED_VERIFIER = textwrap.dedent("""
    import sys, time
    from tandem.ring import HiddenRing
    from tandem.rpc.drafter.v1 import drafter_pb2 as pb
    from verifier.drafter_client import DrafterClient
    ring = HiddenRing.create(64, int(sys.argv[2]), "float32")
    client = DrafterClient(sys.argv[1], ring, pb.TargetInfo.FromString(bytes.fromhex(sys.argv[3])), 5.0,
                           secret=sys.argv[4])
    client.start()
    assert client.wait_connected(20.0)
    print("connected", flush=True)
    time.sleep(120)
""")


def test_a_verifier_whose_process_died_is_not_locked_out(drafter, pair_dirs, ring):
    target, width = target_info(pair_dirs)
    doomed = subprocess.Popen([sys.executable, "-c", _DOOMED_VERIFIER, drafter.address, str(width),
                               target.SerializeToString().hex(), SECRET], stdout=subprocess.PIPE, text=True)
    try:
        assert doomed.stdout.readline().strip() == "connected"
        os.kill(doomed.pid, signal.SIGKILL)  # its stream is never closed by it
        doomed.wait(10)
        client = verifier_client(drafter.address, ring, target)  # the verifier, restarted
        try:
            assert client.wait_connected(10.0), drafter.log()
            assert client.draft([], None) == []
        finally:
            client.close()
    finally:
        if doomed.poll() is None:
            doomed.kill()


def reload(drafter, folder) -> grpc.RpcError:
    with grpc.insecure_channel(drafter.address) as channel, pytest.raises(grpc.RpcError) as e:
        pb_grpc.DrafterStub(channel).Reload(pb.ReloadRequest(draft_model=str(folder)),
                                            metadata=internal_secret.metadata(SECRET), timeout=60)
    return e.value


def test_reload_loads_only_below_its_root_and_echoes_no_filesystem_error(drafter, pair_dirs):
    models = pair_dirs / "models"
    for folder in ("/etc", pair_dirs / "outside_head", models / ".." / "outside_head", models / "link_out",
                   models / "no_such_head", models):
        error = reload(drafter, folder)
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED, (folder, error.details())
        assert error.details() == (f"draft_model: not an EAGLE-3 folder below this drafter's reload root "
                                   f"{os.path.realpath(models)} (--reload-root)")  # (the default: the head's parent)
    error = reload(drafter, models / "alias")  # below the root (a link to a folder there), but nothing to load
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "not_a_head" not in error.details()  # where the link leads is not the caller's to learn
    assert "Errno" not in error.details() and "No such" not in error.details()
    # A head below the root loads (the default root: the starting head's parent folder).
    with grpc.insecure_channel(drafter.address) as channel:
        reply = pb_grpc.DrafterStub(channel).Reload(pb.ReloadRequest(draft_model=str(models / "draft")),
                                                    metadata=internal_secret.metadata(SECRET), timeout=60)
    assert reply.generation == 2


def test_ring_names_in_hello_are_checked_and_links_never_followed(drafter, pair_dirs, ring, tmp_path):
    target, _ = target_info(pair_dirs)
    secret_file = tmp_path / "private"
    secret_file.write_bytes(b"\0" * ring.spec.nbytes)
    link = "tandem-evil-1"
    os.symlink(secret_file, f"/dev/shm/{link}")
    try:
        for name in ("../../" + str(secret_file).lstrip("/"), "tandem-/../../etc/passwd", link.upper(),
                     "tandem-1/../../x", link):
            error = raw_stream(drafter.address, hello({**ring.spec.to_fields(), "name": name}, target),
                               internal_secret.metadata(SECRET))
            assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.FAILED_PRECONDITION, name
    finally:
        os.unlink(f"/dev/shm/{link}")


def test_tandem_ups_secret_folder_is_private_and_a_killed_launchers_is_cleared(tmp_path, monkeypatch):
    import socket
    import tempfile

    from tandem import stack_secret

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    host = socket.gethostname()
    orphan = tmp_path / f"tandem-up-{ended.pid}@{host}-abc"  # left by a launcher SIGKILLed (its pid is gone)
    orphan.mkdir()
    (orphan / "internal-secret").write_text("old secret")
    living = tmp_path / f"tandem-up-{os.getppid()}@{host}-def"  # a running launcher's
    elsewhere = tmp_path / f"tandem-up-{ended.pid}@not-{host}-ghi"  # another host's (a container sharing /tmp)
    other = tmp_path / "tandem-up-notapid"
    for folder in (living, elsewhere, other):
        folder.mkdir()
    path = stack_secret.write(SECRET)
    assert open(path).read() == SECRET and oct(os.stat(path).st_mode & 0o777) == "0o600"
    assert oct(os.stat(os.path.dirname(path)).st_mode & 0o777) == "0o700"
    assert os.path.basename(os.path.dirname(path)).startswith(f"tandem-up-{os.getpid()}@{host}-")
    assert not orphan.exists() and living.exists() and elsewhere.exists() and other.exists()


def test_the_drafter_maps_the_verifiers_ring_read_only(drafter, pair_dirs, ring):
    """The drafter never writes the verifier's ring: its mapping of the segment (its /proc maps) has no write bit."""
    target, _ = target_info(pair_dirs)
    client = verifier_client(drafter.address, ring, target)
    try:
        assert client.wait_connected(10.0), drafter.log()
        maps = [line for line in Path(f"/proc/{drafter.proc.pid}/maps").read_text().splitlines()
                if ring.spec.name in line]
        assert maps, f"no mapping of {ring.spec.name} in the drafter"
        assert all(line.split()[1] == "r--s" for line in maps), maps
    finally:
        client.close()
