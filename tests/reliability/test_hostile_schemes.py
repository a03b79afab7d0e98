"""Every inbound verification scheme under hostile input, as properties.

``tests/ingest/test_schemes.py`` already proves, per scheme, that random headers and
bodies are refused with a reason (never an exception), that a signature made with another
secret never verifies, and that flipping one body byte breaks a signature. This module
reuses its schemes and helpers and adds what an attacker holding *one genuine request*
can try: lifting its signature onto another body, timestamp or id; header values no
honest sender produces (lone surrogates, NUL, Latin-1 bytes as WSGI hands them over);
rotation lists padded with junk; and generic-HMAC configurations drawn at random. Pure:
no database.
"""

import base64
import contextlib
import string

import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st

from ingest.schemes import Request, UnparseableBody, VerificationFailed, get_scheme
from tests.ingest.test_schemes import (
    NOW,
    PROPERTY,
    SCHEMES_UNDER_TEST,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    fixed_secret,
    reason,
)

# Schemes whose signed content holds the event id, and the header carrying it. (A generic
# source with an ``id_header`` but no ``{id}`` in its template does not sign the id:
# docs/security.md says what that costs.)
SIGNED_ID = {
    "standard": (SCHEMES_UNDER_TEST["standard"], "webhook-id"),
    "hmac-id-signed": (
        get_scheme("hmac", {"id_header": "x-id", "signed_template": "{id}.{body}"}),
        "x-id",
    ),
}

# Every code point, surrogates and controls included: ``_text`` must turn what cannot be
# encoded into a refusal, never a UnicodeEncodeError.
any_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=80)
# What a WSGI server hands over: header bytes decoded as Latin-1.
latin1_text = st.binary(max_size=80).map(lambda b: b.decode("latin-1"))


def signed(scheme_id: str, body: bytes, *, timestamp: int = NOW, event_id: str = "evt_1"):
    scheme = SCHEMES_UNDER_TEST[scheme_id]
    return scheme.sign(
        body=body, secret=fixed_secret(scheme_id), timestamp=timestamp, event_id=event_id
    )


@pytest.mark.parametrize("scheme_id", SCHEMES_UNDER_TEST)
@PROPERTY
@given(body=st.binary(max_size=300), other=st.binary(max_size=300))
def test_a_genuine_signature_never_verifies_another_body(scheme_id, body, other):
    assume(other != body)
    headers = signed(scheme_id, body)
    secrets = [fixed_secret(scheme_id)]

    assert reason(SCHEMES_UNDER_TEST[scheme_id], headers, body, secrets=secrets) is None
    assert reason(SCHEMES_UNDER_TEST[scheme_id], headers, other, secrets=secrets) == (
        "bad_signature"
    )


@pytest.mark.parametrize("scheme_id", [*TIMESTAMP_HEADER, "stripe"])
@PROPERTY
@given(body=st.binary(max_size=200), shift=st.integers(-300, 300))
def test_a_genuine_signature_never_verifies_under_another_timestamp(scheme_id, body, shift):
    """A replayer who refreshes the timestamp (to get inside the window) breaks the MAC."""
    assume(shift != 0)
    headers = signed(scheme_id, body, timestamp=NOW - 1000)
    if scheme_id == "stripe":
        old = headers["stripe-signature"]
        headers["stripe-signature"] = old.replace(f"t={NOW - 1000}", f"t={NOW + shift}")
    else:
        headers[TIMESTAMP_HEADER[scheme_id]] = str(NOW + shift)

    got = reason(SCHEMES_UNDER_TEST[scheme_id], headers, body, secrets=[fixed_secret(scheme_id)])

    assert got == "bad_signature"


@pytest.mark.parametrize("scheme_id", SIGNED_ID)
@PROPERTY
@given(body=st.binary(max_size=200), other_id=st.text(string.printable, min_size=1, max_size=40))
def test_a_genuine_signature_never_verifies_under_another_event_id(scheme_id, body, other_id):
    """Otherwise one captured request could be replayed under fresh ids past dedupe."""
    assume(other_id.strip() and other_id.strip() != "evt_1")
    scheme, id_header = SIGNED_ID[scheme_id]
    secret = fixed_secret(scheme_id)
    headers = scheme.sign(body=body, secret=secret, timestamp=NOW, event_id="evt_1")
    assert reason(scheme, headers, body, secrets=[secret]) is None

    got = reason(scheme, {**headers, id_header: other_id}, body, secrets=[secret])

    assert got in ("bad_signature", "malformed_signature")


@pytest.mark.parametrize("scheme_id", SCHEMES_UNDER_TEST)
@PROPERTY
@given(
    body=st.binary(max_size=200),
    values=st.lists(st.one_of(any_text, latin1_text), min_size=1, max_size=4),
    data=st.data(),
)
def test_header_values_no_honest_sender_produces_are_refused_with_a_reason(
    scheme_id, body, values, data
):
    """Lone surrogates, NUL and high Latin-1 in any header of a genuine request: refused
    with a reason or, where that header is not signed, still verified. Never a crash."""
    headers = signed(scheme_id, body)
    names = sorted(headers)
    for value in values:
        headers[data.draw(st.sampled_from(names), label="header")] = value
    scheme = SCHEMES_UNDER_TEST[scheme_id]

    try:
        scheme.verify(Request(headers, body), secrets=[fixed_secret(scheme_id)], now=NOW)
    except VerificationFailed:
        return
    # It verified: then the signature header itself must be the genuine one.
    assert (
        headers[SIGNATURE_HEADER[scheme_id]] == signed(scheme_id, body)[SIGNATURE_HEADER[scheme_id]]
    )


def junk_secrets(scheme_id: str) -> st.SearchStrategy[str]:
    """Secrets an operator might have lying around: empty, not base64, other real ones."""
    other_valid = st.binary(min_size=1, max_size=40).map(
        (lambda b: "whsec_" + base64.b64encode(b).decode())
        if scheme_id == "standard"
        else (lambda b: b.hex())
    )
    return st.one_of(st.just(""), st.just("whsec_"), st.just("whsec_!!"), any_text, other_valid)


@pytest.mark.parametrize("scheme_id", SCHEMES_UNDER_TEST)
@PROPERTY
@given(body=st.binary(max_size=200), data=st.data(), include=st.booleans())
def test_rotation_accepts_iff_the_signers_secret_is_among_the_configured_ones(
    scheme_id, body, data, include
):
    configured = data.draw(st.lists(junk_secrets(scheme_id), max_size=6), label="junk")
    assume(fixed_secret(scheme_id) not in configured)
    if include:
        at = data.draw(st.integers(0, len(configured)), label="position")
        configured.insert(at, fixed_secret(scheme_id))

    got = reason(SCHEMES_UNDER_TEST[scheme_id], signed(scheme_id, body), body, secrets=configured)

    if include:
        assert got is None
    else:
        assert got in ("bad_signature", "no_secret")


TEMPLATES = ["{body}", "{timestamp}.{body}", "{id}.{timestamp}.{body}", "v0:{timestamp}:{body}"]
header_names = st.text(string.ascii_lowercase + string.digits + "-", min_size=1, max_size=20)
generic_options = st.fixed_dictionaries(
    {},
    optional={
        "header": st.one_of(header_names, any_text),
        "prefix": st.one_of(st.sampled_from(["", "sha256=", "v1,"]), any_text),
        "algorithm": st.sampled_from(["sha256", "sha1", "sha512", "SHA256", "md5", ""]),
        "encoding": st.sampled_from(["hex", "base64", "HEX", "base32"]),
        "timestamp_header": header_names,
        "id_header": header_names,
        "signed_template": st.one_of(
            st.sampled_from(TEMPLATES),
            any_text.map(lambda t: t + "{body}"),
            any_text,
        ),
        "id_field": st.text(max_size=10),
        "type_field": st.text(max_size=10),
    },
)


@PROPERTY
@given(options=generic_options, body=st.binary(max_size=200), other=st.binary(max_size=200))
# Found by this test: a prefix starting with a space signed fine but could never verify
# (header values arrive stripped); such a prefix is now refused.
@example(options={"prefix": " "}, body=b"", other=b"\x00")
def test_any_generic_hmac_configuration_is_refused_or_round_trips_and_refuses_forgeries(
    options, body, other
):
    try:
        scheme = get_scheme("hmac", options)
    except ValueError:
        return  # the defined refusal path for a bad configuration
    try:
        headers = scheme.sign(body=body, secret="k", timestamp=NOW, event_id="e1")
    except VerificationFailed:
        # A template that cannot be encoded can never be signed, so never verified either.
        return
    assume(other != body)

    assert reason(scheme, headers, body, secrets=["k"]) is None
    assert reason(scheme, headers, body, secrets=["not-k"]) == "bad_signature"
    assert reason(scheme, headers, other, secrets=["k"]) == "bad_signature"
    with contextlib.suppress(UnparseableBody):
        scheme.extract(Request(headers, body), scheme.parse(Request(headers, body)))


@pytest.mark.parametrize(
    "options",
    [
        {"header": "x-sig", "timestamp_header": "X-Sig"},  # signing overwrote the signature
        {"id_header": "x-ts", "timestamp_header": "x-ts"},
        {"header": "x sig"},
        {"header": "x-sig\n"},
        {"timestamp_header": "x-tś"},
    ],
)
def test_generic_hmac_header_options_that_could_never_work_are_refused(options):
    """Found by the property above: a timestamp header named like the signature header
    signed requests that could never verify."""
    with pytest.raises(ValueError, match="header"):
        get_scheme("hmac", options)
