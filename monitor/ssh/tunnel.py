"""One `ssh` process per remote box: the port forward and the nvidia-smi loop on one connection.

The system's OpenSSH client, not a Python SSH library: it is what the user's terminal runs, so
~/.ssh/config (Include, Match, ProxyJump, certificates, hardware keys), known_hosts (hashed or
not) and the agent apply exactly as they do there. servescope adds only what an unattended
recorder needs: no prompts (BatchMode), never a new or changed host key (StrictHostKeyChecking
yes), liveness probes, a connection of its own (no ControlMaster), and the forward on a Unix
socket in a private folder (0600, so no other local user can use the tunnel).
"""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field

from monitor.ssh import smi
from monitor.ssh.target import SshTarget

# An ssh_config read instead of ~/.ssh/config (ssh -F), e.g. a team's shared one.
SSH_CONFIG_ENV = "SERVESCOPE_SSH_CONFIG"
CONNECT_TIMEOUT_S = 10
# ssh's keep-alive: a silent drop (cable, sleep, NAT timeout) is noticed within 5 s x 3.
ALIVE_INTERVAL_S, ALIVE_COUNT = 5, 3
MAX_ROWS = 100_000


class SshError(Exception):
    """An SSH connection that failed; ``reason`` is a key of SSH_REASONS."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def ssh_command(target: SshTarget, socket_path: str, interval_s: float,
                ssh: str = "ssh", config: str | None = None) -> list[str]:
    """The ssh command line: forward ``socket_path`` to the remote port, and run the nvidia-smi
    loop unless the target says gpus=off."""
    options = {"BatchMode": "yes", "StrictHostKeyChecking": "yes",
               "ExitOnForwardFailure": "yes", "ConnectTimeout": str(CONNECT_TIMEOUT_S),
               "ServerAliveInterval": str(ALIVE_INTERVAL_S),
               "ServerAliveCountMax": str(ALIVE_COUNT), "ControlMaster": "no",
               "ControlPath": "none", "StreamLocalBindUnlink": "yes",
               "PermitLocalCommand": "no"}
    cmd = [ssh, "-T"]
    for key, value in options.items():
        cmd += ["-o", f"{key}={value}"]
    if config:
        cmd += ["-F", config]
    if target.port:
        cmd += ["-p", str(target.port)]
    if target.user:
        cmd += ["-l", target.user]
    cmd += ["-L", f"{socket_path}:{target.remote_host}:{target.remote_port}"]
    if not target.gpus:
        return [*cmd, "-N", "--", target.host]
    script = smi.remote_script(max(100, round(interval_s * 1000)))
    return [*cmd, "--", target.host, f"/bin/sh -c '{script}'"]


def classify(lines: list[str], target: SshTarget) -> tuple[str, str]:
    """(reason, sentence) for an ssh that exited before its forward was up."""
    text = "\n".join(lines)
    detail = last_line(lines)
    host, dest = target.box, target.destination
    if "IDENTIFICATION HAS CHANGED" in text or "has changed and you have requested" in text:
        return "ssh_host_key_changed", (
            f"The SSH host key of {host} differs from the one in your known_hosts, so servescope "
            f"refuses to connect (if the change is expected, check the new key and remove the "
            f"old one with ssh-keygen -R {target.host}).")
    if "host key is known for" in text or "Host key verification failed" in text:
        return "ssh_host_key_unknown", (
            f"The SSH host key of {host} is not in your known_hosts, so servescope will not "
            f"connect (check and accept it once with `ssh {dest}` in a terminal).")
    if "Permission denied" in text or "Too many authentication failures" in text:
        return "ssh_auth", (
            f"{host} refused the SSH login ({detail}); add your key to the agent (ssh-add) or "
            f"name it with IdentityFile in ~/.ssh/config.")
    if any(s in text for s in ("Could not resolve", "Connection refused", "timed out",
                               "No route to host", "Network is unreachable", "Connection closed",
                               "Connection reset", "kex_exchange_identification")):
        return "ssh_unreachable", f"The SSH host {host} cannot be reached ({detail})."
    return "ssh", f"ssh to {host} failed: {detail or 'it exited without saying why'}."


def last_line(lines: list[str]) -> str:
    """ssh's last own line, without its "ssh: " prefix (what a user would act on)."""
    for line in reversed(lines):
        line = line.strip().removeprefix("ssh: ")
        if line and not line.startswith(("@", "Warning:")):
            return line.rstrip(".")
    return ""


@dataclass
class GpuStream:
    """What the remote nvidia-smi loop has said: rows not yet taken, its state and why."""

    state: str = "starting"  # "starting", "sampling", "missing", "failed", "off"
    message: str = ""
    fields: list[str] = field(default_factory=list)
    rows: collections.deque = field(default_factory=lambda: collections.deque(maxlen=MAX_ROWS))
    gpus: set[int] = field(default_factory=set)
    attempts: list[str] = field(default_factory=list)  # each run's last message


class Connection:
    """A running ``ssh`` for one target: `open()` waits until the forward is up (or raises
    SshError), `alive` says whether it still runs, `failure()` why it ended."""

    def __init__(self, target: SshTarget, socket_path: str, interval_s: float) -> None:
        self.target = target
        self.socket_path = socket_path
        self.interval_s = interval_s
        self.gpu = GpuStream(state="starting" if target.gpus else "off")
        self._stderr: collections.deque = collections.deque(maxlen=200)
        self._changed = threading.Condition()
        self._proc: subprocess.Popen | None = None
        self._threads: list[threading.Thread] = []

    def open(self, timeout_s: float = CONNECT_TIMEOUT_S + 5) -> None:
        ssh = shutil.which("ssh")
        if ssh is None:
            raise SshError("ssh", "The ssh command is not installed (servescope uses your "
                                  "OpenSSH client and its configuration); install openssh-client.")
        with contextlib.suppress(OSError, ValueError):
            os.unlink(self.socket_path)
        cmd = ssh_command(self.target, self.socket_path, self.interval_s, ssh,
                          os.environ.get(SSH_CONFIG_ENV) or None)
        try:
            self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, errors="replace",
                                          bufsize=1, start_new_session=True)
        except OSError as exc:  # not executable, out of processes or file descriptors
            raise SshError("ssh", f"{ssh} could not be started ({exc.strerror or exc}).") from exc
        self._threads = [threading.Thread(target=self._read_stdout, daemon=True,
                                          name=f"servescope-ssh-out-{self.target.host}"),
                         threading.Thread(target=self._read_stderr, daemon=True,
                                          name=f"servescope-ssh-err-{self.target.host}")]
        for thread in self._threads:
            thread.start()
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(self.socket_path):
            if self._proc.poll() is not None:
                self._threads[1].join(1.0)  # ssh's last words
                raise SshError(*classify(self.stderr(), self.target))
            if time.monotonic() > deadline:
                self.close()
                raise SshError("ssh_unreachable", f"{self.target.box} did not finish the SSH "
                                                  f"login within {timeout_s:g} s.")
            time.sleep(0.02)

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stderr(self) -> list[str]:
        return [line for _, line in list(self._stderr)]

    def failure(self) -> str:
        """Why a connection that was up ended, in ssh's words."""
        self._threads[1].join(1.0)
        return last_line(self.stderr()) or f"ssh exited with status {self._proc.returncode}"

    def refused(self, since: float, wait_s: float = 0.5) -> str | None:
        """ssh's word that the remote side refused a forwarded connection made at or after
        ``since`` (time.time()); waits up to ``wait_s`` for it, as it may trail the error."""
        deadline = time.monotonic() + wait_s
        with self._changed:
            while True:
                for ts, line in list(self._stderr):
                    if ts >= since and "open failed" in line:
                        return line.split("open failed:", 1)[1].strip()
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._changed.wait(left)

    def take_rows(self) -> list[tuple[float, int, dict[str, float]]]:
        """GPU rows read since the last call, oldest first."""
        rows = []
        while self.gpu.rows:
            rows.append(self.gpu.rows.popleft())
        return rows

    def close(self) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                proc.stdin.close()  # the remote loop sees EOF and the session ends cleanly
            proc.terminate()
            try:
                proc.wait(2.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(2.0)
        for thread in self._threads:
            thread.join(1.0)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.close()
        with contextlib.suppress(OSError, ValueError):
            os.unlink(self.socket_path)

    # ---- reader threads
    def _read_stderr(self) -> None:
        for line in self._proc.stderr:
            with self._changed:
                self._stderr.append((time.time(), line.rstrip("\n")))
                self._changed.notify_all()

    def _read_stdout(self) -> None:
        for line in self._proc.stdout:
            self._gpu_line(line.rstrip("\n"))

    def _gpu_line(self, line: str) -> None:
        gpu = self.gpu
        if line.startswith(smi.MARK + "fields "):
            gpu.fields = line.removeprefix(smi.MARK + "fields ").split(",")
            gpu.attempts.append("")
        elif line.startswith(smi.MARK + "exit "):
            self._gpu_exit(int(line.split()[-1]) if line.split()[-1].isdigit() else -1)
        elif (row := smi.parse_row(line, gpu.fields)) is not None:
            gpu.rows.append((time.time(), *row))
            gpu.gpus.add(row[0])
            gpu.state = "sampling"
        elif line.strip() and gpu.attempts:
            gpu.attempts[-1] = line.strip()[:300]

    def _gpu_exit(self, status: int) -> None:
        gpu, dest = self.gpu, self.target.box
        if status == smi.NOT_FOUND:
            gpu.state = "missing"
            gpu.message = (f"nvidia-smi is not on the PATH of {dest}, so it has no GPU series "
                           "(install the NVIDIA driver's utilities there, or add its DCGM "
                           "exporter as a server).")
            return
        if len(gpu.attempts) < len(smi.THROTTLE_FIELDS):
            return  # an older driver that lacks the field's new name: the script tries again
        said = next((m for m in gpu.attempts if m and "not a valid field" not in m),
                    gpu.attempts[-1])
        gpu.state = "failed"
        gpu.message = (f"nvidia-smi on {dest} stopped with exit status {status}"
                       + (f" ({said.rstrip('.')})" if said else "")
                       + ", so it has no GPU series.")

