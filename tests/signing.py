"""Celery message signing for the tests: a key and self-signed certificate generated per test, and an app set up
to sign every task message with them and to accept only signed ones (`task_serializer = "auth"`)."""

from __future__ import annotations

import datetime
from pathlib import Path

from celery import Celery
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID


def make_certificate(directory: Path, name: str = "fanin-tests") -> Path:
    """Writes `key.pem` and `certs/<name>.pem` under `directory` (the store is `certs/*.pem`); returns directory."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    (directory / "certs").mkdir(parents=True, exist_ok=True)
    (directory / "key.pem").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    (directory / "certs" / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return directory


def configure_signing(app: Celery, directory: str | Path) -> None:
    """Sign task messages with the key in `directory` and accept only messages signed by a certificate in its store.
    Results stay JSON (they are stored in PostgreSQL, not sent through the broker)."""
    d = Path(directory)
    app.conf.update(
        task_serializer="auth",
        accept_content=["auth"],
        result_serializer="json",
        result_accept_content=["json"],
        security_key=str(d / "key.pem"),
        security_certificate=str(d / "certs" / "fanin-tests.pem"),
        security_cert_store=str(d / "certs" / "*.pem"),
        security_digest="sha256",
    )
    app.setup_security(allowed_serializers=["json"])
