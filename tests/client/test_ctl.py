"""``prefixctl`` against a real daemon process (one per module: each start costs seconds), and
against a small fake server for the states and failures a real one will not show on demand."""

import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
from concurrent import futures

import grpc
import pytest

from prefixd.api import prefixd_pb2 as pb
from prefixd.api import prefixd_pb2_grpc as pb_grpc
from prefixd.client import ctl, ctl_lookup, ctl_render
from tests.daemon.harness import ROOT, start_daemon


def layout(model_id: str) -> pb.KVLayout:
    return pb.KVLayout(model_id=model_id, num_layers=2, num_kv_heads=2, head_dim=8,
                       dtype="float16", block_size=16)


def packed(ids) -> bytes:
    return struct.pack(f"<{len(ids)}i", *ids)


@pytest.fixture(scope="module")
def daemon():
    with start_daemon(lease_s=30.0) as d:
        yield d


def run_ctl(capsys, *argv) -> tuple[int, str, str]:
    """``prefixctl argv`` in-process: (exit status, stdout, stderr)."""
    code = ctl.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_ctl_process(*argv, env=None) -> subprocess.CompletedProcess:
    """``prefixctl argv`` as its own process, like an operator runs it."""
    return subprocess.run([sys.executable, "-m", "prefixd.client.ctl", *argv], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT, **(env or {})),
                          capture_output=True, text=True, timeout=120)


def commit_prompt(stub, model_id: str, ids) -> int:
    """Attach for ``model_id``, open and commit ``ids``, release and detach; the blocks stay."""
    session = stub.Attach(pb.AttachRequest(client_name="test", layout=layout(model_id))).session_id
    seq = stub.Open(pb.OpenRequest(session_id=session, tokens=packed(ids))).sequence
    indexed = stub.Commit(pb.CommitRequest(session_id=session, seq_id=seq.seq_id)).indexed_blocks
    stub.Release(pb.ReleaseRequest(session_id=session, seq_id=seq.seq_id))
    stub.Detach(pb.DetachRequest(session_id=session))
    return indexed


# -- a real daemon --------------------------------------------------------------------------------


def test_status_lists_a_pool_once_a_client_attached(daemon, capsys):
    code, out, _ = run_ctl(capsys, "--socket", daemon.socket, "status")
    assert code == 0
    assert "serving" in out and f"pid       {daemon.pid()}" in out and "tenant default" in out
    assert "status-model" not in out
    commit_prompt(daemon.stub(), "status-model", list(range(100, 148)))  # 3 full blocks
    code, out, _ = run_ctl(capsys, "--socket", daemon.socket, "status")
    assert code == 0
    assert "status-model  (layers=2 kv_heads=2 head_dim=8 float16 block_size=16)" in out
    assert "device           3 / 256 blocks cached" in out
    assert "host             3 / 1024 blocks cached" in out  # crash durability: in shm


def test_status_as_a_process_finds_the_socket_in_prefixd_socket(daemon):
    done = run_ctl_process("status", env={"PREFIXD_SOCKET": daemon.socket})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("prefixd ") and "serving" in done.stdout
    assert daemon.socket in done.stdout


def test_stats_json_counts_the_opens_made_through_the_stubs(daemon, capsys):
    code, out, err = run_ctl(capsys, "--socket", daemon.socket, "stats", "--json")
    assert code == 0, err
    before = json.loads(out)["values"]["prefixd_opens_total"]
    stub = daemon.stub()
    session = stub.Attach(pb.AttachRequest(client_name="test", layout=layout("stats-model"))).session_id
    for i in range(3):
        seq = stub.Open(pb.OpenRequest(session_id=session, tokens=packed([7, 8, i]))).sequence
        stub.Release(pb.ReleaseRequest(session_id=session, seq_id=seq.seq_id))
    stub.Detach(pb.DetachRequest(session_id=session))
    done = run_ctl_process("--socket", daemon.socket, "stats", "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["values"]["prefixd_opens_total"] == before + 3
    assert doc["tenant"] == "default" and doc["pools"]["stats-model"]["cache"]["opens"] == 3


def test_stats_json_keeps_two_layouts_of_one_model_apart(daemon, capsys):
    """Regression: the document keyed pools by model id alone, so a second layout of the same
    model (a vLLM at block 128 beside a client at block 16) overwrote the first's counters."""
    stub = daemon.stub()
    sessions = []
    for block_size, opens in ((16, 1), (32, 2)):
        lay = layout("twin-model")
        lay.block_size = block_size
        session = stub.Attach(pb.AttachRequest(client_name="twin", layout=lay)).session_id
        sessions.append(session)
        for i in range(opens):
            seq = stub.Open(pb.OpenRequest(session_id=session, tokens=packed([5, 6, i]))).sequence
            stub.Release(pb.ReleaseRequest(session_id=session, seq_id=seq.seq_id))
    code, out, err = run_ctl(capsys, "--socket", daemon.socket, "stats", "--json")
    for session in sessions:
        stub.Detach(pb.DetachRequest(session_id=session))
    assert code == 0, err
    twins = {k: v for k, v in json.loads(out)["pools"].items() if v["layout"]["model_id"] == "twin-model"}
    assert len(twins) == 2, sorted(twins)
    assert sorted((v["layout"]["block_size"], v["cache"]["opens"]) for v in twins.values()) == [(16, 1), (32, 2)]


def test_stats_table_has_one_line_per_value(daemon, capsys):
    code, out, _ = run_ctl(capsys, "--socket", daemon.socket, "stats")
    assert code == 0
    lines = dict(line.rsplit(None, 1) for line in out.splitlines())
    assert lines['prefixd_rpc_calls_total{method="Stats"}'].isdigit()
    assert "prefixd_sessions" in lines


def test_lookup_reports_the_cached_tokens_of_a_committed_prompt(daemon, capsys):
    prompt = list(range(500, 564))  # 4 blocks of 16
    assert commit_prompt(daemon.stub(), "lookup-model", prompt) == 4
    ids = [str(t) for t in prompt + [1, 2, 3, 4, 5]]
    code, out, err = run_ctl(capsys, "--socket", daemon.socket, "lookup", "--model", "lookup-model", *ids)
    assert code == 0, err
    assert out.startswith("cached 64 of 69 tokens (model lookup-model), by best tier: device 64,")
    code, out, _ = run_ctl(capsys, "--socket", daemon.socket, "lookup", "--model", "lookup-model",
                           ",".join(ids[5:]))
    assert code == 0 and out.startswith("cached 0 of 64 tokens")  # another prefix: no hit


def test_lookup_leaves_no_session_behind(daemon, capsys):
    """prefixctl attaches to look up: it must detach, not wait for the lease to end its session."""
    commit_prompt(daemon.stub(), "lookup-model", list(range(16)))
    code, _, err = run_ctl(capsys, "--socket", daemon.socket, "lookup", "--model", "lookup-model", "1")
    assert code == 0, err
    assert daemon.stub().Status(pb.StatusRequest()).sessions == 0


def test_lookup_of_an_unknown_model_names_the_pools(daemon, capsys):
    commit_prompt(daemon.stub(), "lookup-model", list(range(16)))
    code, out, err = run_ctl(capsys, "--socket", daemon.socket, "lookup", "--model", "nope", "1", "2")
    assert code == 1 and not out
    assert "no pool of model 'nope'" in err and "lookup-model" in err


def test_lookup_of_text_through_a_local_tokenizer(daemon, capsys, tmp_path):
    pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    words = [f"w{i}" for i in range(40)]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {"[UNK]": 0, **{w: 1000 + i for i, w in enumerate(words)}}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]"}))
    commit_prompt(daemon.stub(), "text-model", [1000 + i for i in range(32)])  # w0 .. w31
    code, out, err = run_ctl(capsys, "--socket", daemon.socket, "lookup", "--model", "text-model",
                             "--text", " ".join(words), "--tokenizer", str(tmp_path))
    assert code == 0, err
    assert out.startswith("cached 32 of 40 tokens (model text-model)")


def test_checkpoint_reports_the_pools_it_folded(daemon, capsys):
    commit_prompt(daemon.stub(), "status-model", list(range(100, 148)))
    num_pools = len(daemon.stub().Status(pb.StatusRequest()).pools)
    code, out, err = run_ctl(capsys, "--socket", daemon.socket, "checkpoint")
    assert code == 0, err
    assert out == f"checkpointed {num_pools} pool{'' if num_pools == 1 else 's'}\n"
    assert "checkpoint on request pools=" in daemon.log_text()


# -- no daemon ------------------------------------------------------------------------------------


def test_no_socket_file_exits_3_naming_the_socket(capsys, tmp_path):
    path = str(tmp_path / "absent.sock")
    for command in ("status", "stats", "checkpoint"):
        code, out, err = run_ctl(capsys, "--socket", path, command)
        assert code == 3 and not out
        assert path in err and "no such socket" in err and "prefixd serve" in err
        assert len(err.splitlines()) == 1


def test_a_socket_nobody_listens_on_exits_3(capsys):
    """A daemon killed with -9 leaves its socket file: prefixctl must say nothing answers."""
    base = tempfile.mkdtemp(prefix="ctl-", dir="/tmp")  # short: Unix socket paths hold 107 bytes
    path = os.path.join(base, "dead.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)  # bound, never listening: connect() is refused
        code, out, err = run_ctl(capsys, "--socket", path, "status")
    finally:
        sock.close()
        os.unlink(path)
        os.rmdir(base)
    assert code == 3 and not out
    assert path in err and "nothing answers" in err and len(err.splitlines()) == 1


def test_default_socket_follows_the_daemons_lookup(monkeypatch):
    monkeypatch.setenv("PREFIXD_SOCKET", "/srv/p.sock")
    assert ctl.default_socket() == "/srv/p.sock"
    monkeypatch.delenv("PREFIXD_SOCKET")
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/7")
    assert ctl.default_socket() == "/run/user/7/prefixd/prefixd.sock"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    monkeypatch.setenv("XDG_STATE_HOME", "/var/st")
    assert ctl.default_socket() == "/var/st/prefixd/prefixd.sock"
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", "/home/u")
    assert ctl.default_socket() == "/home/u/.local/state/prefixd/prefixd.sock"


# -- a fake daemon: states and failures on demand -------------------------------------------------


class FakeDaemon(pb_grpc.PrefixCacheServicer):
    def __init__(self) -> None:
        self.status = pb.StatusReply(state="serving", pid=42, version="0.1.0", tenant="t")

    def Status(self, request, context):
        return self.status

    def Checkpoint(self, request, context):
        context.abort(grpc.StatusCode.DATA_LOSS, "the log failed (fsync: EIO): restart the daemon")


@pytest.fixture
def fake():
    base = tempfile.mkdtemp(prefix="ctl-", dir="/tmp")
    path = os.path.join(base, "fake.sock")
    servicer = FakeDaemon()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_PrefixCacheServicer_to_server(servicer, server)
    server.add_insecure_port("unix:" + path)
    server.start()
    servicer.socket = path
    yield servicer
    server.stop(None).wait()
    for name in os.listdir(base):
        os.unlink(os.path.join(base, name))
    os.rmdir(base)


def test_status_of_a_recovering_daemon_shows_progress_and_exits_4(fake, capsys):
    fake.status = pb.StatusReply(state="recovering", records_replayed=1200, records_total=5000,
                                 pid=42, version="0.1.0", tenant="t")
    code, out, _ = run_ctl(capsys, "--socket", fake.socket, "status")
    assert code == 4
    assert "recovering (replayed 1200 of 5000 log records, 24%)" in out


def test_other_commands_wait_for_a_stopping_daemon_with_exit_4(fake, capsys):
    fake.status = pb.StatusReply(state="stopping")
    code, out, err = run_ctl(capsys, "--socket", fake.socket, "checkpoint")
    assert code == 4 and not out
    assert "is stopping" in err


def test_a_refused_call_is_one_line_with_its_code_and_exit_1(fake, capsys):
    code, out, err = run_ctl(capsys, "--socket", fake.socket, "checkpoint")
    assert code == 1 and not out
    assert err == "prefixctl: Checkpoint failed: DATA_LOSS: the log failed (fsync: EIO): restart the daemon\n"


def test_an_rpc_the_daemon_lacks_is_one_line_too(fake, capsys):
    code, _, err = run_ctl(capsys, "--socket", fake.socket, "stats")  # FakeDaemon has no Stats
    assert code == 1 and err.startswith("prefixctl: Stats failed: UNIMPLEMENTED")
    assert len(err.splitlines()) == 1


# -- pieces ---------------------------------------------------------------------------------------


def test_the_only_pool_is_the_default_and_several_need_model():
    one = [pb.PoolStatus(model_id="a", layout=layout("a"))]
    assert ctl_lookup.pick_layout(one, None).model_id == "a"
    two = one + [pb.PoolStatus(model_id="b", layout=layout("b"))]
    with pytest.raises(LookupError, match="2 pools .*a, b.*--model"):
        ctl_lookup.pick_layout(two, None)
    assert ctl_lookup.pick_layout(two, "b").model_id == "b"
    with pytest.raises(LookupError, match="no pool on this socket"):
        ctl_lookup.pick_layout([], None)


def test_token_ids_parse_from_words_lists_and_commas():
    assert ctl_lookup.parse_token_ids(["1", "2,3", "[4, 5]"]) == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="not an integer"):
        ctl_lookup.parse_token_ids(["1", "x"])
    with pytest.raises(ValueError, match="out of range"):
        ctl_lookup.parse_token_ids([str(2**31)])


def test_bad_lookup_arguments_exit_2_without_calling(capsys, tmp_path):
    path = str(tmp_path / "absent.sock")  # no daemon: usage errors come first
    code, _, err = run_ctl(capsys, "--socket", path, "lookup", "--text", "hi")
    assert code == 2 and "--text needs --tokenizer" in err
    code, _, err = run_ctl(capsys, "--socket", path, "lookup", "1", "--text", "hi", "--tokenizer", "x")
    assert code == 2 and "not both" in err


def test_status_without_pools_says_how_one_appears():
    text = ctl_render.status_text(pb.StatusReply(state="serving", pid=1, uptime_s=3725.0), "/s")
    assert "up 1h 2m" in text and "none yet" in text
