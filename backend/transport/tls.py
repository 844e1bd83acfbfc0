"""The TLS contexts of a connection: a client's (verifying the node) and a node's listener's."""

from __future__ import annotations

import ssl

from backend.errors import ConfigError

__all__ = ["client_tls_context", "server_tls_context"]


def client_tls_context(ca_file: str = "") -> ssl.SSLContext:
    """TLS for connecting to nodes: certificate and host name verified against ``ca_file`` or the system trust."""
    try:
        return ssl.create_default_context(cafile=ca_file or None)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError("tls_ca", f"cannot load CA certificates from {ca_file}: {exc}") from None


def server_tls_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """TLS for a node's listener: its certificate chain and private key (PEM)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError("--tls-cert", f"cannot load {cert_file} with key {key_file}: {exc}") from None
    return context
