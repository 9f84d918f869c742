"""Where an ssh:// server entry points: the SSH destination and the port on the remote's side.

One URL holds both, so a server entry stays a name and a URL in storage:
``ssh://[user@]host[:ssh_port]/[remote_host:]remote_port[/path][?gpus=off]``. The remote host is
as the SSH server sees it (127.0.0.1, the remote's loopback, unless given); ``gpus=off`` skips
sampling the remote's GPUs with nvidia-smi. The host may be an alias of the user's ~/.ssh/config.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

SCHEME = "ssh"
# What ssh(1) accepts as a host or user name here. Anything else is refused, and a leading "-"
# above all: ssh would read "-oProxyCommand=..." as an option, i.e. run a local command.
_NAME = re.compile(r"[A-Za-z0-9_.%\[\]:-]+")
_USER = re.compile(r"[A-Za-z0-9_.-]+")
_REMOTE = re.compile(r"(?:(?P<host>[A-Za-z0-9_.-]+|\[[0-9A-Fa-f:.]+\]):)?(?P<port>\d{1,5})")


def is_ssh_url(url: str) -> bool:
    """Whether ``url`` names a server reached through SSH."""
    return url.strip().lower().startswith(f"{SCHEME}://")


@dataclass(frozen=True)
class SshTarget:
    """An SSH destination and the port it forwards to on the remote's side."""

    host: str
    remote_port: int
    user: str | None = None
    port: int | None = None
    remote_host: str = "127.0.0.1"
    path: str = ""
    gpus: bool = True

    @property
    def destination(self) -> str:
        """What a user would type after ``ssh``."""
        return f"{self.user}@{self.host}" if self.user else self.host

    @property
    def box(self) -> str:
        """The SSH side as a URL, for messages: ssh://user@host[:port]."""
        return f"{SCHEME}://{self.destination}" + (f":{self.port}" if self.port else "")

    @property
    def http_url(self) -> str:
        """The server's URL as seen from the remote box (the tunnel carries it)."""
        return f"http://{self.remote_host}:{self.remote_port}{self.path}"

    @property
    def url(self) -> str:
        """The one URL that says all of this (what a server entry stores)."""
        remote = (f"{self.remote_port}" if self.remote_host == "127.0.0.1"
                  else f"{self.remote_host}:{self.remote_port}")
        return f"{self.box}/{remote}{self.path}" + ("" if self.gpus else "?gpus=off")


def parse_target(url: str) -> SshTarget:
    """The target an ssh:// URL names; ValueError says what is wrong, in one sentence."""
    parts = urlsplit(url.strip())
    if parts.scheme.lower() != SCHEME or not parts.netloc:
        raise ValueError(f"{url!r} is not an ssh:// URL; use e.g. ssh://user@gpu-box/8000")
    userinfo, _, hostport = parts.netloc.rpartition("@")
    if ":" in userinfo:
        raise ValueError("put no password in an ssh:// URL; servescope logs in with your SSH "
                         "keys and agent, as ssh does")
    host, port = _split_port(hostport, url)
    if not host or host.startswith("-") or not _NAME.fullmatch(host):
        raise ValueError(f"{host!r} in {url!r} is not a host name ssh accepts")
    if userinfo and (userinfo.startswith("-") or not _USER.fullmatch(userinfo)):
        raise ValueError(f"{userinfo!r} in {url!r} is not a user name ssh accepts")
    remote, _, rest = parts.path.lstrip("/").partition("/")
    match = _REMOTE.fullmatch(remote)
    if not match or not 0 < int(match["port"]) < 65536:
        raise ValueError(f"{url!r} names no remote port; add it after the host, e.g. "
                         f"{SCHEME}://{parts.netloc}/8000 for port 8000 on the remote's loopback")
    gpus = parse_qs(parts.query).get("gpus", ["on"])[-1].lower()
    if gpus not in ("on", "off"):
        raise ValueError(f"gpus={gpus} in {url!r}: use gpus=off, or leave it out")
    return SshTarget(host=host, remote_port=int(match["port"]), user=userinfo or None,
                     port=port, remote_host=(match["host"] or "127.0.0.1").strip("[]"),
                     path=f"/{rest}" if rest else "", gpus=gpus == "on")


def _split_port(hostport: str, url: str) -> tuple[str, int | None]:
    if hostport.startswith("["):  # [v6]:port
        host, _, tail = hostport[1:].partition("]")
        port = tail.removeprefix(":")
    elif hostport.count(":") == 1:
        host, _, port = hostport.partition(":")
    else:
        host, port = hostport, ""
    if not port:
        return host, None
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{port!r} in {url!r} is not an SSH port")
    return host, int(port)


def ssh_url(box: str, remote_port: int | None) -> str:
    """The entry URL of an SSH box (ssh://user@host[:port], perhaps with its remote part
    already) and a remote port (None: the box URL must name one)."""
    box = box.strip()
    if remote_port is None:
        return parse_target(box).url
    base = urlsplit(box)
    if base.path.strip("/"):
        raise ValueError(f"{box!r} already names a remote port; give it there or in the "
                         "remote port field, not both")
    query = f"?{base.query}" if base.query else ""
    return parse_target(f"{base.scheme}://{base.netloc}/{remote_port}{query}").url
