"""Secrets at rest: every secret the service must read back is stored as a Fernet token.

Fernet (``cryptography``) is AES-128-CBC with an HMAC-SHA256 over the whole token, so a
token that was altered or made under another key is refused rather than decrypted into
garbage. The keys are ``SECRETS_ENCRYPTION_KEYS``, newest first: the first encrypts,
any of them decrypts (``MultiFernet``), which is what lets keys rotate without a
flag day (docs/security.md, "Secrets at rest"; the procedure is in docs/operations.md).
With the setting empty the one key is derived from ``SECRET_KEY`` (HKDF-SHA256), so a
fresh clone runs; ``check --deploy`` says so (``deliveries.W030``), and the entry
``from-secret-key`` names that key in the list.

The columns that hold tokens are named ``*_encrypted``; the models expose the secret
through a property whose setter encrypts, so the plain value never reaches a query.
Models that hold any list them in ``encrypted_secret_fields`` as (token column, legacy
plain-text column) pairs: ``rotate_encryption_keys`` finds them there.
"""

from __future__ import annotations

import base64
import functools
import logging
from collections.abc import Iterable

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from django.core.exceptions import ImproperlyConfigured
from django.db import transaction

from deliveries.core.conf import settings

logger = logging.getLogger("deliveries.encryption")

# The HKDF "info" of the development key: binds the derived key to this one use, so it
# is not SECRET_KEY itself nor what another use of SECRET_KEY derives.
_DERIVED_KEY_INFO = b"trusty-webhooks secrets at rest v1"

# An entry of SECRETS_ENCRYPTION_KEYS that stands for the key derived from SECRET_KEY:
# how a deployment that started without the setting keeps reading its tokens while it
# moves to a key of its own (docs/operations.md, "Encryption keys").
FROM_SECRET_KEY = "from-secret-key"  # noqa: S105 - a placeholder name, not a key

# Rows read and rewritten per transaction by the migrations and the rotation command.
BATCH = 500


class UnreadableSecret(ImproperlyConfigured):
    """A stored token that no configured key opens: a key was removed from
    SECRETS_ENCRYPTION_KEYS while rows still needed it, or the row was tampered with.
    The message names the row, never the token."""


def derived_key(secret_key: str) -> bytes:
    """The Fernet key used when SECRETS_ENCRYPTION_KEYS is empty (development, tests)."""
    hkdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_DERIVED_KEY_INFO)
    return base64.urlsafe_b64encode(hkdf.derive(secret_key.encode()))


def configured_keys() -> tuple[str, ...]:
    """The keys in force, newest first: the setting's (``from-secret-key`` standing for
    the derived key), or the derived key alone when the setting is empty."""
    keys = settings.SECRETS_ENCRYPTION_KEYS or (FROM_SECRET_KEY,)  # stripped, none empty
    derived = derived_key(settings.SECRET_KEY).decode()
    return tuple(derived if k == FROM_SECRET_KEY else k for k in keys)


def encrypts_under_derived_key() -> bool:
    """True when new secrets are encrypted under the key derived from SECRET_KEY."""
    keys = settings.SECRETS_ENCRYPTION_KEYS
    return not keys or keys[0] == FROM_SECRET_KEY


def key_problem(key: str) -> str | None:
    """Why ``key`` is not a Fernet key (32 url-safe base64 bytes), or None."""
    try:
        Fernet(key)
    except (ValueError, TypeError) as exc:
        return str(exc)
    return None


@functools.lru_cache(maxsize=8)
def _box_for(keys: tuple[str, ...]) -> MultiFernet:
    try:
        return MultiFernet([Fernet(k) for k in keys])
    except (ValueError, TypeError) as exc:
        raise ImproperlyConfigured(
            f"SECRETS_ENCRYPTION_KEYS: a key is not a Fernet key ({exc})"
        ) from None


def _box() -> MultiFernet:
    # Looked up per call (a dict hit): settings changed by a test or a reload take effect.
    return _box_for(configured_keys())


def encrypt(secret: str) -> str:
    """A token of ``secret`` under the newest key."""
    return _box().encrypt(secret.encode()).decode()


def decrypt(token: str, *, row: str = "a row") -> str:
    """The secret in ``token``; UnreadableSecret (naming ``row``) if no key opens it."""
    try:
        return _box().decrypt(token.encode()).decode()
    except InvalidToken:
        raise UnreadableSecret(
            f"the secret of {row} opens under none of SECRETS_ENCRYPTION_KEYS"
        ) from None


def reveal(token: str | None, legacy_plaintext: str = "", *, row: str = "a row") -> str:
    """The secret a row holds: its token decrypted, or, on a row a previous release
    wrote (no token yet), the legacy plain-text column. The one place that reads both
    shapes."""
    if token is None:
        return legacy_plaintext
    return decrypt(token, row=row)


def reveal_or_skip(token: str | None, legacy_plaintext: str, *, row: str) -> str | None:
    """``reveal`` for readers of many rows (a worker's batch, a source's secrets): an
    unreadable row is logged and left out (None), so one bad row cannot stop the
    deliveries of every other endpoint in the batch."""
    try:
        return reveal(token, legacy_plaintext, row=row)
    except UnreadableSecret as exc:
        logger.error(str(exc), extra={"action": "secrets.unreadable", "row": row})
        return None


def encrypt_plaintext_rows(model, *, token_field: str, plaintext_field: str) -> int:
    """Encrypt the rows that have no token yet and blank their plain text, in batches of
    BATCH rows, one short transaction each. Works on historical models (migrations).
    Returns how many rows it encrypted."""

    def seal(row) -> dict:
        return {token_field: encrypt(getattr(row, plaintext_field)), plaintext_field: ""}

    return _rewrite_rows(model, {f"{token_field}__isnull": True}, token_field, seal)


def decrypt_to_plaintext_rows(model, *, token_field: str, plaintext_field: str) -> int:
    """The reverse of :func:`encrypt_plaintext_rows`: the plain text back, no token (what
    a release before encryption reads). Used only by reverse migrations."""

    def unseal(row) -> dict:
        return {plaintext_field: decrypt(getattr(row, token_field)), token_field: None}

    return _rewrite_rows(model, {f"{token_field}__isnull": False}, token_field, unseal)


def reencrypt_rows(model, *, token_field: str) -> int:
    """Re-encrypt every token under the newest key (``MultiFernet.rotate``). Returns how
    many rows it rewrote."""
    box = _box()

    def rotate(row) -> dict:
        try:
            return {token_field: box.rotate(getattr(row, token_field).encode()).decode()}
        except InvalidToken:
            raise UnreadableSecret(
                f"the secret of {model._meta.label} {row.pk} opens under none of "
                "SECRETS_ENCRYPTION_KEYS"
            ) from None

    return _rewrite_rows(model, {f"{token_field}__isnull": False}, token_field, rotate)


def _rewrite_rows(model, selection: dict, token_field: str, change) -> int:
    """Apply ``change(row) -> {field: value}`` to the rows matching ``selection``, by
    primary key in batches. Each UPDATE is guarded on the token it read: a row changed
    meanwhile (a new secret saved through the admin, encrypted already) is left as the
    change made it."""
    done, last_pk = 0, None
    while True:
        rows = model.objects.filter(**selection).order_by("pk")
        if last_pk is not None:
            rows = rows.filter(pk__gt=last_pk)
        batch = list(rows[:BATCH])
        if not batch:
            return done
        with transaction.atomic():
            for row in batch:
                done += model.objects.filter(
                    pk=row.pk, **{token_field: getattr(row, token_field)}
                ).update(**change(row))
        last_pk = batch[-1].pk


def rotate_all(all_models: Iterable) -> dict[str, int]:
    """Re-encrypt every stored secret under the newest key, and encrypt any a previous
    release left in plain text, in the models that declare ``encrypted_secret_fields``.
    Returns rows rewritten per "app.Model.field". Safe while the service runs: every
    token it writes opens under the keys the running processes already have."""
    counts = {}
    for model in all_models:
        for token_field, plaintext_field in getattr(model, "encrypted_secret_fields", ()):
            counts[f"{model._meta.label}.{token_field}"] = reencrypt_rows(
                model, token_field=token_field
            ) + encrypt_plaintext_rows(
                model, token_field=token_field, plaintext_field=plaintext_field
            )
    return counts
