"""Remote boxes over SSH: a server on the remote's loopback, and the box's GPUs via nvidia-smi."""

from monitor.ssh.source import SSH_REASONS, SshSource, server_source
from monitor.ssh.target import SshTarget, is_ssh_url, parse_target, ssh_url

__all__ = ["SSH_REASONS", "SshSource", "SshTarget", "is_ssh_url", "parse_target",
           "server_source", "ssh_url"]
