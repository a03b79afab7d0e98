"""Inbound sources: who may post to ``/ingest/<slug>/``, with which scheme and
secrets. The receive view reads them through a per-process cache (``source_for``);
refusals are counted per source and reason (``count_refusal``)."""

import functools
import hashlib
import ipaddress
import logging
import time
from collections.abc import Sequence
from datetime import datetime

from django.core.checks import Error
from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from deliveries.core import encryption, ratelimit
from deliveries.core.prometheus import INBOUND_REFUSED
from ingest.conf import settings

from .mail import split_plus
from .models import Source, SourceSecret, VerificationFailure
from .schemes import address_in, get_scheme

logger = logging.getLogger("ingest")


# The receive view's per-process cache of sources and their secrets: without it every
# request spends two queries before its one write. A change made in this process (a
# save or delete of a source or secret, admin included) clears it at once
# (ingest.apps wires the signals); other processes see it within
# INGEST_SOURCE_CACHE_SECONDS. Secrets are cached with their expiry and filtered at use,
# so an expiring secret still stops on time.
_SOURCE_CACHE: dict[str, tuple[float, Source | None]] = {}
_SOURCE_CACHE_MAX = 1000  # unknown slugs are cached too; bounded against slug floods


def source_for(slug: str) -> Source | None:
    """The enabled source ``slug`` (None if unknown or disabled), with its configured
    ``verifier`` (its scheme), ``accepted_content_types`` and ``cached_secrets``
    [(secret, expires_at)] attached."""
    ttl = settings.INGEST_SOURCE_CACHE_SECONDS
    now = time.monotonic()
    hit = _SOURCE_CACHE.get(slug)
    if hit is not None and hit[0] > now:
        return hit[1]
    source = Source.objects.filter(slug=slug, enabled=True).first()
    if source is not None:
        source.verifier = verifier_for(source)
        source.accepted_content_types = tuple(source.content_types or source.verifier.content_types)
        source.cached_secrets = _stored_secrets(source)
    if ttl > 0:
        if len(_SOURCE_CACHE) >= _SOURCE_CACHE_MAX:
            _SOURCE_CACHE.clear()
        _SOURCE_CACHE[slug] = (now + ttl, source)
    return source


def forget_sources(**_signal_kwargs) -> None:
    """Empty this process's source cache (connected to Source/SourceSecret changes)."""
    _SOURCE_CACHE.clear()


def source_create(
    *, slug: str, scheme: str, secrets: Sequence[str], options: dict | None = None, **fields
) -> Source:
    verifier = get_scheme(scheme, options or None)  # refuses an unknown scheme or bad options
    fields.setdefault("max_body_bytes", verifier.default_max_body_bytes)
    if scheme == "smtp" and not verifier.addresses:
        raise ValueError("an smtp source needs 'addresses': the listener refuses all others")
    if verifier.is_email:
        for secret in secrets:
            verifier.signing_key(secret)  # "user:password" where a credential is one
    with transaction.atomic():
        source = Source.objects.create(slug=slug, scheme=scheme, options=options or {}, **fields)
        for secret in secrets:
            SourceSecret.objects.create(source=source, secret=secret)
    return source


def source_throttle(source: Source) -> int:
    """Seconds to wait if ``source`` is over its rate limit this second, else 0. Counted
    per second in the shared cache (deliveries/core/ratelimit.py): the limit holds across every
    web process and host."""
    if not source.rate_limit:
        return 0
    hits, _ = ratelimit.hit(f"ingest-rate:{source.id}", window=1.0)
    return 1 if hits > source.rate_limit else 0


def email_throttle(source: Source, *, sender: str = "", recipient: str = "") -> str | None:
    """The refusal reason if one more message from ``sender`` (an envelope sender) or
    for ``recipient`` (its address without the plus tag, so that tags cannot spread a
    flood) is past its per-minute limit (``INBOUND_EMAIL_RATE_PER_SENDER``,
    ``..._PER_RECIPIENT``; 0: none), else None. Counted in the shared cache like
    ``source_throttle``: the limit holds across every listener and web process."""

    for kind, address, limit in (
        ("sender", sender, settings.INBOUND_EMAIL_RATE_PER_SENDER),
        (
            "recipient",
            split_plus(recipient)[0] if recipient else "",
            settings.INBOUND_EMAIL_RATE_PER_RECIPIENT,
        ),
    ):
        if not address or not limit:
            continue
        digest = hashlib.sha256(address.lower().encode()).hexdigest()[:32]
        hits, _ = ratelimit.hit(f"email-{kind}:{source.id}:{digest}", window=60.0)
        if hits > limit:
            return f"{kind}_rate_limited"
    return None


def count_refusal(source: Source, reason: str, request=None, remote: str = "") -> None:
    """Count a refused request per source and reason; never creates work."""
    record_refusal(source, reason, remote=remote or _remote(request))
    INBOUND_REFUSED.labels(source.slug, reason).inc()
    logger.info(
        "inbound refused",
        extra={"action": "ingest.refused", "source": source.slug, "reason": reason},
    )


def record_refusal(source: Source, reason: str, *, remote: str = "", n: int = 1) -> None:
    """Add ``n`` to the source's refusal row for ``reason`` (``VerificationFailure``):
    the count every process shares, which survives restarts. The SMTP listener counts
    its refusals as it answers and writes them here in batches."""
    now = timezone.now()
    sample = {"at": now.isoformat(), "remote": remote}
    updated = VerificationFailure.objects.filter(source=source, reason=reason).update(
        count=F("count") + n, last_at=now, sample=sample
    )
    if not updated:
        try:
            with transaction.atomic():
                VerificationFailure.objects.create(
                    source=source,
                    reason=reason,
                    count=n,
                    first_at=now,
                    last_at=now,
                    sample=sample,
                )
        except IntegrityError:  # a concurrent first failure created it
            VerificationFailure.objects.filter(source=source, reason=reason).update(
                count=F("count") + n, last_at=now, sample=sample
            )


def _remote(request) -> str:
    return remote_address(request) if request is not None else ""


def remote_address(request) -> str:
    """The address a request to the receive view came from: its REMOTE_ADDR, unless that
    is one of ``INGEST_TRUSTED_PROXIES``; then the last address in X-Forwarded-For that is
    not one of them (what a client writes there itself sits before it, and is not read).
    What an allow-list (a mail source's ``allow_ips``) and the stored evidence see."""
    remote = request.META.get("REMOTE_ADDR", "")
    proxies = trusted_proxies(tuple(settings.INGEST_TRUSTED_PROXIES))
    if not proxies or not address_in(remote, proxies):
        return remote
    hops = request.META.get("HTTP_X_FORWARDED_FOR", "").split(",")
    for hop in reversed([h.strip() for h in hops if h.strip()]):
        if not address_in(hop, proxies):
            return hop[:100]
    return remote


@functools.lru_cache(maxsize=8)
def trusted_proxies(cidrs: tuple[str, ...]) -> tuple:
    """The networks of ``INGEST_TRUSTED_PROXIES``; one that does not read is left out (no
    proxy trusted by mistake) and named by the check ``ingest.E001``."""
    networks = []
    for cidr in cidrs:
        try:
            networks.append(ipaddress.ip_network(str(cidr).strip(), strict=False))
        except ValueError:
            continue
    return tuple(networks)


def check_trusted_proxies(app_configs, **kwargs) -> list[Error]:
    """``ingest.E001``: every INGEST_TRUSTED_PROXIES entry is a network."""
    problems = []
    for cidr in settings.INGEST_TRUSTED_PROXIES:
        try:
            ipaddress.ip_network(str(cidr).strip(), strict=False)
        except ValueError:
            problems.append(
                Error(f"INGEST_TRUSTED_PROXIES: {cidr!r} is not a network.", id="ingest.E001")
            )
    return problems


# --- What verification reads of a source ---------------------------------------------


def verifier_for(source: Source):
    """The source's configured scheme: the one ``source_for`` attached (built once per
    cache period, not per request), else built now."""
    return getattr(source, "verifier", None) or get_scheme(source.scheme, source.options or None)


def live_secrets(source: Source, now: datetime) -> list[str]:
    """The secrets not yet expired, newest first (from the cache when the source came
    from ``source_for``)."""
    secrets = getattr(source, "cached_secrets", None)
    if secrets is None:
        secrets = _stored_secrets(source)
    return [secret for secret, expires_at in secrets if expires_at is None or expires_at > now]


def _stored_secrets(source: Source) -> tuple[tuple[str, datetime | None], ...]:
    """(secret, expires_at) of every secret of ``source``, newest first, decrypted; one
    that no configured key opens is logged and left out."""
    rows = (
        SourceSecret.objects.filter(source=source)
        .order_by("-created_at")
        .values_list("id", "secret_encrypted", "legacy_plaintext", "expires_at")
    )
    found = []
    for secret_id, token, legacy, expires_at in rows:
        secret = encryption.reveal_or_skip(token, legacy, row=f"source secret {secret_id}")
        if secret is not None:
            found.append((secret, expires_at))
    return tuple(found)
