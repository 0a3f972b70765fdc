"""A model's OpenSSF Model Signing signature, checked offline after its sha256 pin.

The signature is a Sigstore bundle as the `model-signing` package writes it, over exactly the model file
(one GGUF). FORK.json names it with two keys beside `files`:

    "signature": the bundle's path, relative to the FORK.json's directory ("model.gguf.sig")
    "signer": who must have signed it, one of
        {"kind": "key", "public_key": "<an EC public key PEM, or the path of one>"}
        {"kind": "certificate", "certificate_chain": ["<PEM path>", ...], "identity": "<optional>"}
        {"kind": "sigstore", "identity": "<email or URI>", "issuer": "<OIDC issuer>",
         "trust_config": "<path of a Sigstore ClientTrustConfig JSON>"}

A FORK.json with neither key is an unsigned pin, as before. Everything else is refused with its reason,
never skipped: one key without the other, an unknown kind, a bundle that is missing, made for other
bytes or by another signer, and `model-signing` not installed (the `signing` extra).

Verification reads only local files. Sigstore keyless needs Sigstore's trust root, which model-signing
fetches over TUF unless it is given a trust config, so a `sigstore` signer without `trust_config` is
refused. model-signing hashes the model again for its manifest: a signed model is read twice at the gate
(the bundle's digest is compared with the pin's first, so a mismatch is refused without the second read).
The signer, as a short string (`model_signer`: "key sha256:<hex>", "certificate <identity> sha256:<hex>",
"sigstore <identity> (<issuer>)"), goes to the Verified record, `GET /bankml` and every receipt.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bankml.errors import Refused, Unreadable

MAX_BUNDLE_BYTES = 1 << 20  # a bundle with a certificate chain and a log entry is a few KiB
MAX_PEM_BYTES = 1 << 20
INSTALL = "install bankml[signing] (the model-signing package)"
KINDS = ("key", "certificate", "sigstore")


@dataclass(frozen=True)
class Signature:
    """What a FORK.json names: the bundle, and the signer it must verify against."""

    name: str  # the bundle's path as FORK.json writes it (what messages show)
    bundle: str  # where it is
    base: str  # the FORK.json's directory: the signer's relative paths start there
    signer: dict[str, Any]


def named(fork_text: str, fork_path: str | None) -> Signature | None:
    """The signature a FORK.json names, checked for shape (not yet verified); None when it names none.
    Raises Refused with what is wrong, and when model-signing is not installed."""
    try:
        doc = json.loads(fork_text)
    except ValueError:
        return None  # the pin refuses a FORK.json that is not JSON
    if not isinstance(doc, dict) or ("signature" not in doc and "signer" not in doc):
        return None
    sig, signer = doc.get("signature"), doc.get("signer")
    if not isinstance(sig, str) or not sig:
        raise Refused("FORK.json names a signer but no `signature` (the path of the model's Sigstore bundle)")
    if not isinstance(signer, dict):
        raise Refused(f"FORK.json names the signature {sig} but no `signer` object (who must have signed it)")
    kind = signer.get("kind")
    if kind not in KINDS:
        raise Refused(f"FORK.json's signer kind {kind!r} is not one of {', '.join(KINDS)}")
    if kind == "sigstore":
        for key in ("identity", "issuer"):
            if not isinstance(signer.get(key), str) or not signer[key]:
                raise Refused(f"FORK.json's sigstore signer needs `{key}`")
        if not isinstance(signer.get("trust_config"), str) or not signer["trust_config"]:
            raise Refused("a Sigstore keyless signature is verified offline only against a trust root: "
                          "give the signer `trust_config` (a Sigstore ClientTrustConfig JSON, as model_signing's "
                          "--trust_config takes); without it model-signing would fetch Sigstore's TUF root")
    if fork_path is None:
        raise Refused(f"FORK.json names the signature {sig}, but where that FORK.json lives is not known here "
                      "(its paths are relative to it)")
    _model_signing()
    base = os.path.dirname(os.path.abspath(fork_path))
    return Signature(sig, os.path.join(base, sig), base, signer)


def _model_signing():
    try:
        import model_signing.verifying  # noqa: F401  (heavy: sigstore, protobuf; only for a signed pin)
    except ImportError as e:
        raise Refused(f"FORK.json names a signature; {INSTALL} to verify it ({e})") from None
    import model_signing

    return model_signing


def verify_signature(model_path: str, sig: Signature, sha256: str) -> str:
    """Verify `sig` over the model file (whose pinned sha256 is `sha256`); return the signer as a short
    string. Raises Refused with the reason."""
    ms = _model_signing()
    name = os.path.basename(model_path)
    data = _read_bundle(sig)
    bundle, statement = _parse_bundle(data, sig.name)
    signed = _signed_sha256(statement)
    if signed is not None and signed != sha256:
        raise Refused(f"{name}: the signature {sig.name} signs sha256 {signed}, the file's is {sha256}: refused")
    kind = sig.signer["kind"]
    with tempfile.TemporaryDirectory(prefix="bankml-signature-") as tmp:
        bundle_file = os.path.join(tmp, "bundle.sig")  # the bytes checked above are the bytes verified
        Path(bundle_file).write_bytes(data)
        if kind == "key":
            config, label = _key_verifier(ms, sig, bundle, tmp)
        elif kind == "certificate":
            config, label = _certificate_verifier(ms, sig, bundle, tmp)
        else:
            config, label = _sigstore_verifier(ms, sig)
        try:
            config.verify(os.path.realpath(model_path), bundle_file)
        except Exception as e:  # model-signing raises ValueError, InvalidSignature, KeyError, sigstore's errors...
            raise Refused(f"{name}: the signature {sig.name} does not verify against {label}: "
                          f"{_why(e, tmp, model_path)}: refused") from None
    return label


def _read_bundle(sig: Signature) -> bytes:
    try:
        with open(sig.bundle, "rb") as f:
            data = f.read(MAX_BUNDLE_BYTES + 1)
    except OSError as e:
        raise Refused(f"cannot read the signature {sig.name}: {e.strerror or e}: refused") from None
    if len(data) > MAX_BUNDLE_BYTES:
        raise Refused(f"the signature {sig.name} is over {MAX_BUNDLE_BYTES} bytes: not a Sigstore bundle")
    return data


def _parse_bundle(data: bytes, name: str) -> tuple[dict, dict]:
    """The bundle and the in-toto statement in its DSSE envelope (not yet verified)."""
    try:
        bundle = json.loads(data)
        payload = base64.b64decode(bundle["dsseEnvelope"]["payload"], validate=True)
        statement = json.loads(payload)
        if not isinstance(statement, dict):
            raise ValueError
    except (ValueError, KeyError, TypeError, binascii.Error, RecursionError):
        raise Refused(f"the signature {name} is not a model-signing bundle (a Sigstore bundle with a DSSE "
                      "envelope)") from None
    return bundle, statement


def _signed_sha256(statement: dict) -> str | None:
    """The sha256 the statement signs for a single file, or None when it says it otherwise (another hash,
    shards, several files: model-signing's own comparison decides then)."""
    predicate = statement.get("predicate")
    resources = predicate.get("resources") if isinstance(predicate, dict) else None
    if not isinstance(resources, list) or len(resources) != 1 or not isinstance(resources[0], dict):
        return None
    one = resources[0]
    serialization = predicate.get("serialization")
    method = serialization.get("method") if isinstance(serialization, dict) else None
    if method != "files" or one.get("algorithm") != "sha256" or not isinstance(one.get("digest"), str):
        return None
    return one["digest"].lower()


def _pem(value: Any, base: str, what: str) -> bytes:
    """A PEM given inline or as a path relative to the FORK.json's directory."""
    if not isinstance(value, str) or not value:
        raise Refused(f"FORK.json's signer needs `{what}`: a PEM, or the path of one")
    if value.lstrip().startswith("-----BEGIN"):
        return value.encode("ascii", errors="replace")
    try:
        with open(os.path.join(base, value), "rb") as f:
            return f.read(MAX_PEM_BYTES)
    except OSError as e:
        raise Unreadable(f"cannot read the signer's {what} {value}: {e.strerror or e}") from None


def key_label(public_key) -> tuple[bytes, str]:
    """An EC public key's PEM (SubjectPublicKeyInfo) and `key sha256:<hex>` of that PEM: the hint
    model-signing writes in the bundle."""
    from cryptography.hazmat.primitives import serialization

    pem = public_key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return pem, "key sha256:" + hashlib.sha256(pem).hexdigest()


def _key_verifier(ms, sig: Signature, bundle: dict, tmp: str):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    try:
        public = serialization.load_pem_public_key(_pem(sig.signer.get("public_key"), sig.base, "public_key"))
    except ValueError:
        raise Refused("FORK.json's signer public_key is not a PEM public key") from None
    if not isinstance(public, ec.EllipticCurvePublicKey):
        raise Refused("FORK.json's signer public_key is not an elliptic-curve key (model-signing signs with EC keys)")
    pem, label = key_label(public)
    hint = ((bundle.get("verificationMaterial") or {}).get("publicKey") or {}).get("hint")
    if isinstance(hint, str) and hint and f"key sha256:{hint}" != label:
        raise Refused(f"the signature {sig.name} was made by key sha256:{hint}, not by FORK.json's signer "
                      f"{label}: refused")
    key_file = os.path.join(tmp, "signer.pub")
    Path(key_file).write_bytes(pem)
    return ms.verifying.Config().use_elliptic_key_verifier(public_key=key_file), label


def _certificate_verifier(ms, sig: Signature, bundle: dict, tmp: str):
    from cryptography import x509

    chain = sig.signer.get("certificate_chain")
    if not isinstance(chain, list) or not chain or not all(isinstance(c, str) and c for c in chain):
        raise Refused("FORK.json's certificate signer needs `certificate_chain`: the PEM paths of the "
                      "certificates it must chain to (never the system's store)")
    pems = []
    for c in chain:
        pems.append(_pem(c, sig.base, "certificate_chain"))
        try:
            x509.load_pem_x509_certificates(pems[-1])
        except ValueError:
            raise Refused(f"FORK.json's signer certificate_chain {c[:64]} is not a PEM certificate") from None
    leaf = _leaf(bundle, sig.name)
    names = _identities(leaf)
    want = sig.signer.get("identity")
    if want is not None and want not in names:
        raise Refused(f"the signature {sig.name} was made by the certificate of {', '.join(names) or 'no one'}, "
                      f"not {want}: refused")
    label = f"certificate {want or (names[0] if names else leaf.subject.rfc4514_string())} sha256:" + \
        leaf.fingerprint(_sha256()).hex()
    chain_file = os.path.join(tmp, "chain.pem")
    Path(chain_file).write_bytes(b"\n".join(pems))
    return ms.verifying.Config().use_certificate_verifier(certificate_chain=[chain_file]), label


def _leaf(bundle: dict, name: str):
    from cryptography import x509

    try:
        raw = bundle["verificationMaterial"]["x509CertificateChain"]["certificates"][0]["rawBytes"]
        return x509.load_der_x509_certificate(base64.b64decode(raw, validate=True))
    except (KeyError, IndexError, TypeError, ValueError, binascii.Error):
        raise Refused(f"the signature {name} carries no signing certificate (was it made with a key, or "
                      "keyless?)") from None


def _identities(cert) -> list[str]:
    """A certificate's names: its SAN emails, URIs and DNS names, then its CN."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    out: list[str] = []
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        for kind in (x509.RFC822Name, x509.UniformResourceIdentifier, x509.DNSName):
            out += [str(v) for v in san.get_values_for_type(kind)]
    except x509.ExtensionNotFound:
        pass
    out += [str(a.value) for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    return out


def _sha256():
    from cryptography.hazmat.primitives import hashes

    return hashes.SHA256()


def _sigstore_verifier(ms, sig: Signature):
    identity, issuer = sig.signer["identity"], sig.signer["issuer"]
    trust = Path(sig.base, sig.signer["trust_config"])
    if not trust.is_file():
        raise Refused(f"cannot read the signer's trust_config {sig.signer['trust_config']}: refused")
    try:
        config = ms.verifying.Config().use_sigstore_verifier(identity=identity, oidc_issuer=issuer,
                                                             trust_config=trust)
    except Exception as e:  # a trust config sigstore cannot read
        raise Refused(f"the signer's trust_config {sig.signer['trust_config']} is not a Sigstore trust config: "
                      f"{_why(e, '', '')}") from None
    return config, f"sigstore {identity} ({issuer})"


_SPACES = re.compile(r"\s+")


def _why(e: BaseException, tmp: str, model_path: str) -> str:
    """model-signing's reason, on one line, without this machine's paths."""
    text = str(e) or type(e).__name__
    for path in filter(None, (tmp, os.path.dirname(os.path.realpath(model_path)) if model_path else "",
                              os.path.dirname(os.path.abspath(model_path)) if model_path else "")):
        text = text.replace(path + os.sep, "").replace(path, "")
    return _SPACES.sub(" ", text).strip()[:300]


def sign_model(model_path: str, private_key_path: str, bundle_path: str) -> tuple[dict[str, Any], str]:
    """Sign exactly the model file with an EC private key (PEM, unencrypted) into a Sigstore bundle at
    `bundle_path`; return FORK.json's `signer` for it (the public key inline) and its `model_signer`.
    Raises Refused (model-signing absent, not an EC key) or Unreadable."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    try:
        import model_signing.signing
    except ImportError as e:
        raise Refused(f"bankml fork --sign: {INSTALL} to sign ({e})") from None
    try:
        with open(private_key_path, "rb") as f:
            data = f.read(MAX_PEM_BYTES)
    except OSError as e:
        raise Unreadable(f"cannot read the signing key {private_key_path}: {e.strerror or e}") from None
    try:
        private = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as e:  # TypeError: an encrypted key
        raise Refused(f"the signing key {private_key_path} is not an unencrypted PEM private key: {e}") from None
    if not isinstance(private, ec.EllipticCurvePrivateKey):
        raise Refused(f"the signing key {private_key_path} is not an elliptic-curve key (model-signing signs "
                      "with P-256, P-384 or P-521)")
    pem, label = key_label(private.public_key())
    try:
        model_signing.signing.Config().use_elliptic_key_signer(private_key=private_key_path).sign(
            os.path.realpath(model_path), bundle_path)
    except OSError as e:
        raise Unreadable(f"cannot sign {model_path}: {e.strerror or e}") from None
    except ValueError as e:  # an unsupported curve
        raise Refused(f"cannot sign with {private_key_path}: {e}") from None
    return {"kind": "key", "public_key": pem.decode("ascii")}, label
