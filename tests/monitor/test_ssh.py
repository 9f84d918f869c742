"""Remote boxes over SSH against a real sshd on 127.0.0.1 (tests/monitor/sshd.py) forwarding to a
real `servescope serve` of the demo model, with an nvidia-smi script on the remote's PATH."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from monitor.recording import Recording
from monitor.remote import PrometheusSource, ServerConfig
from monitor.ssh import SshSource, parse_target, ssh_url
from monitor.ssh.smi import parse_row, query
from monitor.ssh.tunnel import SSH_CONFIG_ENV
from tests.monitor.sshd import free_port, keygen, shared_engine_server, start_sshd

MIB = 2**20


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    server = start_sshd(tmp_path_factory.mktemp("sshd"))
    yield server
    server.close()


@pytest.fixture(scope="module")
def engine(demo_gguf):
    return shared_engine_server(demo_gguf)


@pytest.fixture(autouse=True)
def client_config(request, monkeypatch):
    """The test's ssh_config stands in for ~/.ssh/config (ssh -F, through SSH_CONFIG_ENV)."""
    if "sshd" in request.fixturenames:
        monkeypatch.setenv(SSH_CONFIG_ENV, str(request.getfixturevalue("sshd").ssh_config))


def wait_for(predicate, timeout: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_an_ssh_url_names_the_box_and_the_remote_port():
    t = parse_target("ssh://alice@gpu-box:2222/8000")
    assert (t.user, t.host, t.port, t.remote_host, t.remote_port) == \
        ("alice", "gpu-box", 2222, "127.0.0.1", 8000)
    assert t.http_url == "http://127.0.0.1:8000" and t.gpus
    assert t.url == "ssh://alice@gpu-box:2222/8000"
    other = parse_target("ssh://Box.Lan/10.0.0.5:9400/metrics?gpus=off")
    assert other.host == "Box.Lan" and other.http_url == "http://10.0.0.5:9400/metrics"
    assert not other.gpus and parse_target(other.url) == other
    assert ssh_url("ssh://alice@gpu-box", 8000) == "ssh://alice@gpu-box/8000"
    for url, says in (("ssh://gpu-box", "names no remote port"),
                      ("ssh://alice:hunter2@gpu-box/8000", "no password"),
                      ("ssh://-oProxyCommand=touch%20x/8000", "not a host name"),
                      ("ssh://gpu-box/8000?gpus=maybe", "gpus=off")):
        with pytest.raises(ValueError, match=says):
            ServerConfig("x", url)


def test_nvidia_smi_rows_become_the_nvml_series():
    fields = query("clocks_event_reasons.active").split(",")
    index, values = parse_row("1, 97, 61, 80512, 81559, [N/A], 700.00, 67, 1755, 2619, 3, "
                              "0x0000000000000004", fields)
    assert index == 1 and "power_w" not in values  # [N/A]: not reported, not a zero
    assert values == {"util_pct": 97.0, "mem_util_pct": 61.0, "memory_used_bytes": 80512 * MIB,
                      "memory_total_bytes": 81559 * MIB, "power_limit_w": 700.0,
                      "temperature_c": 67.0, "sm_clock_mhz": 1755.0, "mem_clock_mhz": 2619.0,
                      "ecc_corrected_total": 3.0, "throttle_reasons": 4.0}
    assert parse_row("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA "
                     "driver.", fields) is None


def test_a_box_is_recorded_through_the_tunnel_and_survives_a_dropped_connection(
        sshd, engine, tmp_path):
    """The server's metrics come through the tunnel, the box's GPUs from nvidia-smi over the
    same connection; the connection is cut from the server's side mid-recording, comes back
    with back-off, nothing read is lost from storage, and a second source never stops."""
    from storage.db import open_database
    from storage.queries import series_window

    port = int(engine.url.rsplit(":", 1)[1])
    httpx.post(f"{engine.url}/v1/completions", timeout=120,
               json={"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0})
    direct = httpx.get(f"{engine.url}/metrics").text
    changes: list[tuple[str, str, str | None]] = []
    box = SshSource(ServerConfig("box", f"ssh://box/{port}", interval_s=0.5))
    beside = PrometheusSource(ServerConfig("beside", engine.url, interval_s=0.5))
    db = open_database(f"sqlite:///{tmp_path / 'ssh.db'}")
    recording = Recording([box, beside],
                          on_status=lambda n, s: changes.append((n, s.state, s.reason)))
    recording.attach_database(db)
    hub = recording.start().hub
    try:
        wait_for(lambda: hub.latest("box/1/throttle_reasons") is not None
                 and hub.latest("box/generation_tokens_total") is not None, what="first scrape")
        status = hub.statuses()["box"]
        assert status.state == "up" and status.kind == "servescope" and status.reason is None
        assert "through ssh://box; 2 GPU(s) from nvidia-smi" in status.message
        # The server's own counter, read through the tunnel, is what it says directly.
        generated = next(float(line.split()[-1]) for line in direct.splitlines()
                         if line.startswith("vllm:generation_tokens_total"))
        assert hub.latest("box/generation_tokens_total") == generated >= 3
        assert hub.latest("box/requests_running") == 0.0
        assert hub.latest("box/0/memory_total_bytes") == 81559 * MIB
        assert hub.latest("box/0/power_w") == 112.47 and hub.latest("box/1/power_w") is None
        assert hub.latest("box/1/throttle_reasons") == 4.0  # SW power cap
        assert hub.latest("box/0/temperature_c") == 41.0

        assert sshd.drop_sessions() >= 1
        dropped_at = time.time()
        wait_for(lambda: ("box", "down", "ssh_dropped") in changes, what="the drop")
        assert "dropped" in hub.statuses()["box"].last_error
        wait_for(lambda: changes[-1][:2] == ("box", "up"), what="the reconnect")
        wait_for(lambda: hub.series("box/0/util_pct", since=dropped_at + 0.1)[0].size >= 3,
                 what="GPU rows after the reconnect")
    finally:
        assert recording.stop()
    try:
        assert [c for c in changes if c[0] == "box"] == [
            ("box", "up", None), ("box", "down", "ssh_dropped"), ("box", "up", None)]
        assert hub.statuses()["beside"].failed_scrapes == 0
        # Every point the hub held is in storage, before and after the drop.
        for key in ("box/0/util_pct", "box/1/memory_used_bytes", "box/requests_running",
                    "beside/requests_running"):
            live_ts, live = hub.series(key)
            stored_ts, stored = series_window(db, key, live_ts[0] - 1, live_ts[-1] + 1, "raw")
            assert live_ts.size > 3 and list(stored) == list(live), key
            assert list(stored_ts * 1000) == [int(t * 1000) for t in live_ts], key  # ms, as stored
        # The other source kept its schedule through the drop: no gap beyond a slot or two.
        ts, _ = hub.series("beside/requests_running")
        assert (ts[1:] - ts[:-1]).max() < 1.6
    finally:
        recording.close()


def failing_config(sshd, tmp_path: Path, case: str) -> tuple[str, Path | None]:
    """(URL, known_hosts to check untouched) of each failure case."""
    if case == "unknown_key":
        empty = tmp_path / "known_hosts"
        empty.write_text("")
        sshd.write_client_config(tmp_path / "cfg", known_hosts=empty)
        return "ssh://box/9", empty
    if case == "changed_key":
        pub = Path(f"{sshd.other_key}.pub").read_text().split()[:2]
        wrong = tmp_path / "known_hosts"
        wrong.write_text(f"[127.0.0.1]:{sshd.port} {' '.join(pub)}\n")
        sshd.write_client_config(tmp_path / "cfg", known_hosts=wrong)
        return "ssh://box/9", wrong
    if case == "auth":
        sshd.write_client_config(tmp_path / "cfg", key=sshd.other_key)
        return "ssh://box/9", None
    sshd.write_client_config(tmp_path / "cfg")
    if case == "unreachable":
        return f"ssh://box:{free_port()}/9", None  # nothing listens there
    return f"ssh://box/{free_port()}", None  # "port_closed": sshd is up, the server is not


@pytest.mark.parametrize("case,reason,says", [
    ("unknown_key", "ssh_host_key_unknown", "is not in your known_hosts"),
    ("changed_key", "ssh_host_key_changed", "differs from the one in your known_hosts"),
    ("auth", "ssh_auth", "Permission denied (publickey)); add your key to the agent"),
    ("unreachable", "ssh_unreachable", "cannot be reached (connect to host 127.0.0.1 port"),
    ("port_closed", "remote_port_closed", "(connect failed: Connection refused)"),
])
def test_each_ssh_failure_is_one_sentence(sshd, tmp_path, monkeypatch, case, reason, says):
    url, known_hosts = failing_config(sshd, tmp_path, case)
    monkeypatch.setenv(SSH_CONFIG_ENV, str(tmp_path / "cfg"))
    before = known_hosts.read_text() if known_hosts else None
    source = SshSource(ServerConfig("box", url, interval_s=5))
    try:
        status = source.test_connection()
        source.poll(time.time())  # within the back-off: still the same reason
        assert source.status.reason == reason and source.status.failed_scrapes == 1
    finally:
        source.close()
    assert (status.state, status.reason) == ("down", reason)
    assert says in status.last_error and "\n" not in status.last_error
    assert status.last_error.endswith((".", "?"))
    if known_hosts is not None:  # a key is never added or replaced
        assert known_hosts.read_text() == before


def test_a_box_without_nvidia_smi_has_no_gpu_series_and_says_why(sshd, engine):
    port = int(engine.url.rsplit(":", 1)[1])
    source = SshSource(ServerConfig("bare", f"ssh://bare/{port}", interval_s=0.5))
    try:
        status = source.test_connection()
        time.sleep(0.6)
        samples = source.poll(time.time()).samples
    finally:
        source.close()
    assert (status.state, status.reason) == ("up", "no_nvidia_smi")
    assert status.last_error.startswith("nvidia-smi is not on the PATH of ssh://bare")
    assert samples and not [s for s in samples if s.series.startswith(("bare/0/", "bare/1/"))]


def test_an_older_driver_is_asked_for_its_throttle_reasons_by_their_old_name(sshd, engine):
    port = int(engine.url.rsplit(":", 1)[1])
    source = SshSource(ServerConfig("old", f"ssh://old/{port}", interval_s=0.5))
    try:
        status = source.test_connection()
        fields = list(source.connection.gpu.fields)
        time.sleep(0.6)
        values = {s.series: s.value for s in source.poll(time.time()).samples}
    finally:
        source.close()
    assert (status.state, status.reason) == ("up", None)
    assert "2 GPU(s) from nvidia-smi" in status.message
    assert fields[-1] == "clocks_throttle_reasons.active"
    assert values["old/1/throttle_reasons"] == 4.0 and values["old/0/util_pct"] >= 0


def test_a_key_held_only_by_the_agent_logs_in(sshd, engine, tmp_path, monkeypatch):
    """No key file named anywhere, the private key deleted once the agent holds it: the login
    can only have come from the user's agent (SSH_AUTH_SOCK)."""
    port = int(engine.url.rsplit(":", 1)[1])
    key = tmp_path / "agent_ed25519"
    with (sshd.root / "authorized_keys").open("a") as keys:
        keys.write(" ".join(keygen(key)) + "\n")
    sock = tmp_path / "agent.sock"
    agent = subprocess.Popen(["ssh-agent", "-D", "-a", str(sock)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        wait_for(sock.exists, 10, "the agent")
        monkeypatch.setenv("SSH_AUTH_SOCK", str(sock))
        subprocess.run(["ssh-add", "-q", str(key)], check=True, capture_output=True)
        key.unlink()
        key.with_suffix(".pub").unlink()
        monkeypatch.setenv(SSH_CONFIG_ENV, str(sshd.write_client_config(tmp_path / "cfg",
                                                                        agent_only=True)))
        source = SshSource(ServerConfig("agent", f"ssh://box/{port}?gpus=off", interval_s=0.5))
        try:
            status = source.test_connection()
        finally:
            source.close()
    finally:
        agent.terminate()
        agent.wait(5)
    assert (status.state, status.kind, status.reason) == ("up", "servescope", None)


def test_record_reads_ssh_servers(sshd, engine, tmp_path, capsys):
    from monitor.cli import main
    from storage.db import open_database
    from storage.queries import list_series

    port = int(engine.url.rsplit(":", 1)[1])
    url = f"sqlite:///{tmp_path / 'r.db'}"
    code = main(["record", "--db", url, "--server", f"gpubox=ssh://box/{port}",
                 "--server", f"quiet=ssh://box/{port}?gpus=off", "--duration", "2.5",
                 "--interval", "0.5", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "gpubox is up: " in err and "through ssh://box" in err
    summary = json.loads(out)
    assert summary["sources"] == {"gpubox": "up", "quiet": "up"} and summary["samples"] > 20
    db = open_database(url)
    try:
        assert "gpubox/0/util_pct" in list_series(db, "gpubox")
        quiet = list_series(db, "quiet")
        assert "quiet/requests_running" in quiet and not [k for k in quiet if "/0/" in k]
    finally:
        db.close()
