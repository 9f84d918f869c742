"""Journey: GPU boxes reached by SSH, added from the Servers pane's dialog (an ssh:// URL and the
remote port) and read through a real sshd on 127.0.0.1 into a real `servescope serve`; the box's
GPUs (an nvidia-smi script on the remote's PATH) reach the Monitor's charts, and a box without
nvidia-smi says why in the Why column."""

from __future__ import annotations

import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QDialogButtonBox

from monitor.ssh.tunnel import SSH_CONFIG_ENV
from tests.app.test_journey_servers import go_to, table_names, table_row
from tests.app.user import DialogAnswerer, button, click_row, raw_errors
from tests.monitor.sshd import shared_engine_server, start_sshd


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    server = start_sshd(tmp_path_factory.mktemp("sshd"))
    yield server
    server.close()


@pytest.fixture(scope="module")
def engine(demo_gguf):
    return shared_engine_server(demo_gguf)


def fill_ssh_server(qtbot, name: str, box: str, port: int):
    """An answer to the Add server dialog: the name, the box's ssh:// URL, the remote port."""

    def answer(dialog) -> None:
        qtbot.keyClicks(dialog.name, name)
        assert not dialog.remote_port.isEnabled()  # an http URL has no remote port
        dialog.url.selectAll()
        qtbot.keyClicks(dialog.url, box)
        assert dialog.remote_port.isEnabled()
        dialog.remote_port.lineEdit().selectAll()
        qtbot.keyClicks(dialog.remote_port, str(port))
        ok = dialog.findChild(QDialogButtonBox).button(QDialogButtonBox.StandardButton.Ok)
        qtbot.mouseClick(ok, Qt.MouseButton.LeftButton)

    return answer


def add_ssh_server(qtbot, servers, name: str, box: str, port: int) -> None:
    answerer = DialogAnswerer(fill_ssh_server(qtbot, name, box, port))
    qtbot.mouseClick(button(servers, "Add server"), Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: name in table_names(servers), timeout=15_000)
    answerer.stop()
    assert answerer.seen == ["Add server"]


def test_journey_gpu_boxes_over_ssh(make_window, sshd, engine, qtbot, monkeypatch):
    monkeypatch.setenv(SSH_CONFIG_ENV, str(sshd.ssh_config))  # stands in for ~/.ssh/config
    port = int(engine.url.rsplit(":", 1)[1])
    window = make_window()
    servers, monitor = window.pane("servers"), window.pane("monitor")
    assert servers.service.wait_for_database(30)
    go_to(qtbot, window, "Servers")

    add_ssh_server(qtbot, servers, "gpubox", "ssh://box", port)
    add_ssh_server(qtbot, servers, "bare", "ssh://bare", port)
    assert table_row(servers, "gpubox")["URL"] == f"ssh://box/{port}"
    # The hub's own scrapes, through the tunnel: up, detected, and nothing to say why.
    qtbot.waitUntil(lambda: table_row(servers, "gpubox")["Status"] == "up"
                    and table_row(servers, "gpubox")["Kind"] == "servescope", timeout=20_000)
    assert table_row(servers, "gpubox")["Why"] == ""
    qtbot.waitUntil(lambda: table_row(servers, "bare")["Why"].startswith(
        "no_nvidia_smi: no nvidia-smi on the remote"), timeout=20_000)
    bare = table_row(servers, "bare")
    assert bare["Status"] == "up"
    assert bare["Last error"].startswith("nvidia-smi is not on the PATH of ssh://bare")

    # Test connection: a fresh tunnel of its own, and the banner says what came through it.
    click_row(qtbot, servers.table, table_names(servers).index("gpubox"))
    with qtbot.waitSignal(servers.tester.succeeded, timeout=20_000):
        qtbot.mouseClick(button(servers, "Test connection"), Qt.MouseButton.LeftButton)
    assert any(n.message.startswith("gpubox is up: a servescope server (")
               and "through ssh://box; 2 GPU(s) from nvidia-smi" in n.message
               for n in window.notifications.notifications())

    # Edit server shows the box and its remote port apart again (then Cancel).
    shown: dict[str, object] = {}

    def look(dialog) -> None:
        shown.update(url=dialog.url.text(), port=dialog.remote_port.value())
        dialog.reject()

    answerer = DialogAnswerer(look)
    qtbot.mouseClick(button(servers, "Edit server"), Qt.MouseButton.LeftButton)
    answerer.stop()
    assert shown == {"url": "ssh://box", "port": port}

    # Load tests need an HTTP URL: the pane says so rather than failing later.
    qtbot.mouseClick(button(servers, "Load test"), Qt.MouseButton.LeftButton)
    assert any("reached through SSH" in n.message
               for n in window.notifications.notifications())

    # The Monitor draws the box's GPUs beside its server's series; the bare box has none.
    go_to(qtbot, window, "Monitor")
    charts = monitor.charts

    def drawn(chart: str, key: str) -> bool:
        return key in charts[chart].data and charts[chart].data[key][0].size > 0

    qtbot.waitUntil(lambda: drawn("sm", "gpubox/1/util_pct") and drawn("power", "gpubox/0/power_w")
                    and drawn("kv", "gpubox/kv_cache_usage") and drawn("kv", "bare/kv_cache_usage"),
                    timeout=20_000)
    assert charts["power"].data["gpubox/0/power_w"][1][-1] == 112.47
    assert charts["sm"].data["gpubox/1/util_pct"][1][-1] == 97.0
    assert drawn("memory", "gpubox/0/memory_used_bytes")
    assert not [k for c in charts.values() for k in c.data if k.startswith(("bare/0/", "bare/1/"))]
    assert raw_errors(window) == []
