"""TLS material and contexts: a cluster's CA and the certificate its members serve with.

A directory holds `ca.pem` (what every peer trusts), `cert.pem` and `key.pem` (what the members
serve with, signed by that CA, naming the hosts they answer on). `make_local` writes such a
directory for a cluster on one machine (`kvpool up --tls`); for real hosts, give your own files
with the same names. Clients need only `ca.pem` (KVPOOL_TLS_CA).
"""

import datetime
import ipaddress
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

CA_FILE, CERT_FILE, KEY_FILE = "ca.pem", "cert.pem", "key.pem"
VALID_DAYS = 825


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    cert: Path | None = None  # None: a client's (trusts the CA, serves nothing)
    key: Path | None = None

    @classmethod
    def in_dir(cls, directory: str | os.PathLike) -> "TlsFiles":
        directory = Path(directory)
        files = cls(directory / CA_FILE, directory / CERT_FILE, directory / KEY_FILE)
        for path in (files.ca, files.cert, files.key):
            if not path.exists():
                raise ValueError(f"TLS directory {directory} has no {path.name}")
        return files

    def server_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.cert, self.key)
        return context

    def client_context(self) -> ssl.SSLContext:
        try:
            context = ssl.create_default_context(cafile=str(self.ca))
        except FileNotFoundError as exc:  # ssl does not say which file
            raise FileNotFoundError(exc.errno, exc.strerror, str(self.ca)) from None
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        return context

    def grpc_server_credentials(self):
        import grpc

        return grpc.ssl_server_credentials([(self.key.read_bytes(), self.cert.read_bytes())])

    def grpc_channel_credentials(self):
        import grpc

        return grpc.ssl_channel_credentials(root_certificates=self.ca.read_bytes())


def add_tls_argument(parser) -> None:
    parser.add_argument("--tls-dir", default=None, metavar="DIR",
                        help="serve and connect with TLS: DIR holds ca.pem, cert.pem and key.pem "
                             "(`kvpool up --tls` makes them); etcd is reached over TLS too")


def files_of(parser, args) -> "TlsFiles | None":
    try:
        return TlsFiles.in_dir(args.tls_dir) if args.tls_dir else None
    except ValueError as exc:
        parser.error(str(exc))


def client_files(ca: str | os.PathLike | None = None) -> TlsFiles | None:
    """A client's TLS: the CA it was given ("" for none), else $KVPOOL_TLS_CA; None for plain TCP."""
    if ca is None:
        ca = os.environ.get("KVPOOL_TLS_CA")
    return TlsFiles(Path(ca)) if ca else None


def make_local(directory: str | os.PathLike, hosts=("127.0.0.1", "localhost"), private: bool = False) -> TlsFiles:
    """A CA and a member certificate for `hosts`, written to `directory` (kept if already there). The CA's
    key is not kept: no other certificate can be signed by it. private: the directory 0700 and every file
    0600 (material only its members read, e.g. etcd's peer certificates); else the CA and certificate 0644."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    directory = Path(directory)
    if all((directory / name).exists() for name in (CA_FILE, CERT_FILE, KEY_FILE)):
        return TlsFiles.in_dir(directory)
    directory.mkdir(mode=0o700 if private else 0o777, parents=True, exist_ok=True)
    if private:
        os.chmod(directory, 0o700)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvpool cluster CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    names = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                                                                 "kvpool member")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            # Key identifiers: Python 3.13's default contexts verify strictly (VERIFY_X509_STRICT) and refuse
            # a certificate without its issuer's.
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH,
                                                  x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    public = 0o600 if private else 0o644
    _write(directory / CA_FILE, ca.public_bytes(pem), public)
    _write(directory / CERT_FILE, cert.public_bytes(pem), public)
    _write(directory / KEY_FILE, key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                                   serialization.NoEncryption()), 0o600)
    return TlsFiles.in_dir(directory)


def _write(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, mode)
