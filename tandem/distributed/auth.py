"""Who may join the step channel: peers that prove they hold the group's secret.

On one node rank 0 draws a random secret per engine and hands it to the workers it starts
through their environment (never argv, which every local user can read). Across nodes, and
under torchrun (which starts the ranks, not tandem), the operator sets the same
TANDEM_TP_SECRET on each. Before any step travels, both ends run an
HMAC-SHA256 challenge-response: rank 0 refuses a peer without the secret, and a worker
refuses a rank 0 without it (the rendezvous store that names rank 0's address takes writes
from anyone). Frames have fixed sizes and are read under a timeout, so a stranger can
neither run code nor hold up start-up for longer than the timeout.
"""
from __future__ import annotations

import hmac
import os
import secrets
import socket
import struct

SECRET_ENV = "TANDEM_TP_SECRET"
MIN_SECRET_CHARS = 16
_NONCE = 32
_MAC = 32  # sha256
_HELLO = struct.Struct(f"!I{_NONCE}s{_MAC}s")  # rank, the worker's nonce, its proof


class AuthenticationError(ConnectionError):
    """A step-channel peer did not prove it holds the group's secret."""


def group_secret(nnodes: int) -> str:
    """One node: a fresh random secret. Several: the operator's, the same on every node."""
    if nnodes == 1:
        return secrets.token_hex(32)
    return operator_secret("a multi-node tensor-parallel group")


def operator_secret(group: str) -> str:
    """The secret the operator gave every process of `group` (whoever starts the ranks hands
    them the secret: tandem when it spawns them, the operator otherwise)."""
    secret = os.environ.get(SECRET_ENV, "")
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(f"{group} needs the same secret of at least {MIN_SECRET_CHARS} characters in "
                         f"{SECRET_ENV} on every node (e.g. `export {SECRET_ENV}=$(openssl rand -hex 32)`)")
    return secret


def verify_worker(sock: socket.socket, key: bytes, ranks: set[int], timeout_s: float) -> int:
    """Rank 0's side of a new connection: the peer's rank, once it proved the secret and is
    one of `ranks`; then prove it back (the peer sent its own nonce for that)."""
    sock.settimeout(timeout_s)
    challenge = secrets.token_bytes(_NONCE)
    sock.sendall(challenge)
    rank, nonce, proof = _HELLO.unpack(_recv_exact(sock, _HELLO.size))
    if not hmac.compare_digest(proof, _mac(key, b"worker", rank, challenge)):
        raise AuthenticationError("wrong secret")
    if rank not in ranks:
        raise AuthenticationError(f"rank {rank} is not expected (or already connected)")
    sock.sendall(_mac(key, b"leader", rank, nonce))
    return rank


def prove(sock: socket.socket, key: bytes, rank: int, timeout_s: float) -> None:
    """A worker's side: answer rank 0's challenge, then check rank 0's answer to ours."""
    sock.settimeout(timeout_s)
    challenge = _recv_exact(sock, _NONCE)
    nonce = secrets.token_bytes(_NONCE)
    sock.sendall(_HELLO.pack(rank, nonce, _mac(key, b"worker", rank, challenge)))
    if not hmac.compare_digest(_recv_exact(sock, _MAC), _mac(key, b"leader", rank, nonce)):
        raise AuthenticationError(f"the step channel at {sock.getpeername()} does not hold this group's "
                                  f"secret ({SECRET_ENV} differs between nodes?)")


def _mac(key: bytes, role: bytes, rank: int, nonce: bytes) -> bytes:
    # The role is in the message so neither side's proof can be replayed as the other's.
    return hmac.digest(key, role + rank.to_bytes(4, "big") + nonce, "sha256")


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise AuthenticationError(f"the peer closed the connection during authentication (it "
                                      f"refused us: a different {SECRET_ENV}, or a rank it does not expect?)")
        buf += chunk
    return bytes(buf)
