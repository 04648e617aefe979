"""Certificates made by a test (the `cryptography` package): a CA, a server certificate and a
client certificate it signed, and a self-signed server certificate no CA vouches for. PEM
files in a directory of the test's own; nothing is fetched or kept."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path
from typing import NamedTuple

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


class Pair(NamedTuple):
    cert: str
    key: str


class Certs(NamedTuple):
    ca: str  # the CA's certificate
    server: Pair  # signed by the CA, for localhost and 127.0.0.1
    client: Pair  # signed by the CA (mutual TLS)
    self_signed: Pair  # a server certificate that signed itself


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(d: Path, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Pair:
    c, k = d / f"{stem}.crt", d / f"{stem}.key"
    c.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    k.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                    serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()))
    return Pair(str(c), str(k))


def _cert(cn: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name,
          signer: ec.EllipticCurvePrivateKey, ca: bool, server: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    b = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(issuer)
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5))
         .not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if server:
        b = b.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False)
    return b.sign(signer, hashes.SHA256())


def make_certs(d: Path) -> Certs:
    d.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert("xpuctl test CA", ca_key, _name("xpuctl test CA"), ca_key, ca=True, server=False)
    ca_pair = _write(d, "ca", ca, ca_key)
    pairs = []
    for stem, server in (("server", True), ("client", False)):
        key = ec.generate_private_key(ec.SECP256R1())
        pairs.append(_write(d, stem, _cert(stem, key, ca.subject, ca_key, False, server), key))
    own = ec.generate_private_key(ec.SECP256R1())
    self_signed = _write(d, "self", _cert("localhost", own, _name("localhost"), own, False, True),
                         own)
    return Certs(ca_pair.cert, pairs[0], pairs[1], self_signed)
