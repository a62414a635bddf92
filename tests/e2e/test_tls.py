"""TLS, as vLLM takes it (`--ssl-keyfile`, `--ssl-certfile`, `--ssl-ca-certs`, `--ssl-cert-reqs`):
a CA, a server certificate for 127.0.0.1 and a client certificate, made with `openssl` for the
test; the server answers https verified against that CA and refuses plain http; with client
certificates required, a client without one is refused and one with a certificate from the CA is
served. Bad flags are refused at start-up, naming the flag."""

from __future__ import annotations

import shutil
import ssl
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import MODEL_NAME, ServerProcess

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command"),
]

EC_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _issue(folder: Path, name: str, subject: str, extensions: str) -> None:
    """`name`.key and `name`.pem: a key and a certificate for `subject`, signed by ca.pem."""
    (folder / f"{name}.ext").write_text(extensions)
    _openssl("req", *EC_KEY, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject, cwd=folder)
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext", cwd=folder,
    )  # fmt: skip


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("pki")
    _openssl(
        "req", "-x509", *EC_KEY, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=llmserve test CA",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=folder,
    )  # fmt: skip
    leaf = "basicConstraints=CA:FALSE\nsubjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n"
    _issue(
        folder, "server", "/CN=127.0.0.1", leaf + "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n"
    )
    _issue(folder, "client", "/CN=a client", leaf + "extendedKeyUsage=clientAuth\n")
    return folder


def _context(pki: Path, client_cert: bool = False) -> ssl.SSLContext:
    """A client's TLS context that trusts only the test CA (and shows the client certificate)."""
    ctx = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    if client_cert:
        ctx.load_cert_chain(str(pki / "client.pem"), str(pki / "client.key"))
    return ctx


def _ssl_flags(pki: Path) -> list[str]:
    return ["--ssl-keyfile", str(pki / "server.key"), "--ssl-certfile", str(pki / "server.pem")]


def test_https_verified_against_the_ca(tiny_model_dir: Path, pki: Path) -> None:
    server = ServerProcess(tiny_model_dir, *_ssl_flags(pki), tls=_context(pki)).start()
    try:
        assert server.url.startswith("https://")
        body = {"model": MODEL_NAME, "prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0}
        r = httpx.post(f"{server.url}/v1/completions", json=body, verify=_context(pki), timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        # the openai client over https, trusting the test CA
        client = server.client(http_client=httpx.Client(verify=_context(pki)))
        assert [m.id for m in client.models.list()] == [MODEL_NAME]
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(f"{server.url}/health", timeout=10)  # the system's CAs do not know the test CA
        with pytest.raises(httpx.HTTPError):  # plain http to the TLS port gets no HTTP answer
            httpx.get(server.url.replace("https://", "http://") + "/health", timeout=10)
        assert f"listening on https://127.0.0.1:{server.port}" in server.log()
    finally:
        server.stop()


def test_client_certificates_required(tiny_model_dir: Path, pki: Path) -> None:
    flags = [*_ssl_flags(pki), "--ssl-ca-certs", str(pki / "ca.pem"), "--ssl-cert-reqs", "2"]
    server = ServerProcess(tiny_model_dir, *flags, tls=_context(pki, client_cert=True)).start()
    try:
        r = httpx.get(f"{server.url}/v1/models", verify=_context(pki, client_cert=True), timeout=10)
        assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL_NAME
        with pytest.raises(httpx.HTTPError):  # no client certificate: the handshake fails
            httpx.get(f"{server.url}/v1/models", verify=_context(pki), timeout=10)
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--ssl-certfile", "/nonexistent.pem"], "--ssl-certfile: cannot read '/nonexistent.pem'"),
        (["--ssl-keyfile", "KEY"], "ssl_keyfile needs ssl_certfile"),
        (["--ssl-cert-reqs", "2", "--ssl-certfile", "CERT"], "ssl_cert_reqs needs ssl_ca_certs"),
    ],
)
def test_bad_tls_flags_are_refused(tiny_model_dir: Path, pki: Path, flags: list[str], message: str) -> None:
    flags = [{"KEY": str(pki / "server.key"), "CERT": str(pki / "server.pem")}.get(f, f) for f in flags]
    done = subprocess.run(
        [sys.executable, "-m", "llmserve.cli.main", "serve", str(tiny_model_dir), *flags],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode != 0 and message in done.stderr, done.stderr
