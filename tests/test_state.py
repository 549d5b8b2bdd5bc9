"""The signed state annotation: encode, decode, sign, verify, rotate keys (webhook.admission.state)."""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from webhook.admission.csinode import INT32_MAX
from webhook.admission.state import (
    FORMAT_VERSION,
    STATE_ANNOTATION,
    Approval,
    Correction,
    DeclaredVersion,
    EntryState,
    GuardState,
    PinnedLabel,
    StateKeys,
    StateProblem,
    decode_state,
    encode_state,
    format_time,
    parse_time,
)

T0 = datetime(2026, 11, 30, 2, 0, tzinfo=UTC)
UID = "9f1c2a7e-3d64-4c1b-8f0e-2b6a5d4c3e21"
OTHER_UID = "0d4e6b1c-7a2f-4f3e-9c8d-5b6a7e8f9a0b"
KEY = b"state-test-key-number-one-32byte"
OLD_KEY = b"state-test-key-number-zero-32byt"
KEYS = StateKeys([KEY])
EBS = "ebs.csi.aws.com"


def sample_state(uid: str = UID) -> GuardState:
    return GuardState(
        uid=uid,
        entries={
            EBS: EntryState(
                count=23,
                changed_at=T0,
                writer_version="v1.37.0",
                frozen_until=T0 + timedelta(hours=6),
                correction=Correction(at=T0, before=25, after=23, basis="resource-exhausted"),
            ),
            "pd.csi.storage.gke.io": EntryState(count=None, changed_at=T0 - timedelta(days=1)),
        },
        approvals=(
            Approval(
                driver=EBS,
                reason="hardware replacement",
                min_count=0,
                max_count=0,
                expires=T0 + timedelta(hours=2),
                ticket="OPS-1",
                approved_by="alice",
                approved_at=T0 - timedelta(minutes=3),
            ),
        ),
    )


def sign_document(doc: dict[str, Any], keys: StateKeys = KEYS) -> str:
    """Sign an arbitrary document as encode_state does (to craft states the encoder would never write)."""
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    return json.dumps({**doc, "sig": keys.sign(canonical)}, sort_keys=True, separators=(",", ":"))


# -- round trip ----------------------------------------------------------------------------------------------------


def test_a_state_survives_encode_and_decode() -> None:
    state = sample_state()

    decoded = decode_state(encode_state(state, KEYS), UID, KEYS)

    assert decoded.problem is None
    assert decoded.detail == ""
    assert decoded.state == state


def test_the_encoding_is_compact_sorted_json_with_format_version_uid_and_signature() -> None:
    value = encode_state(sample_state(), KEYS)
    doc = json.loads(value)

    assert list(doc) == ["approvals", "drivers", "sig", "uid", "v"]
    assert (doc["v"], doc["uid"]) == (FORMAT_VERSION, UID)
    assert doc["drivers"][EBS] == {
        "changedAt": "2026-11-30T02:00:00.000Z",
        "correction": {"at": "2026-11-30T02:00:00.000Z", "basis": "resource-exhausted", "from": 25, "to": 23},
        "count": 23,
        "frozenUntil": "2026-11-30T08:00:00.000Z",
        "writerVersion": "v1.37.0",
    }
    assert doc["approvals"][0]["approvedBy"] == "alice"
    assert " " not in value.replace("hardware replacement", "")
    assert len(base64.urlsafe_b64decode(doc["sig"])) == 32


def test_equal_states_encode_to_identical_bytes() -> None:
    assert encode_state(sample_state(), KEYS) == encode_state(sample_state(), KEYS)


def test_the_annotation_name_has_a_slash_that_json_patch_must_escape() -> None:
    assert STATE_ANNOTATION == "csinode-guard.io/state"


# -- problems ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        pytest.param(None, StateProblem.MISSING, id="no annotation is missing"),
        pytest.param("", StateProblem.MISSING, id="an empty annotation is missing"),
        pytest.param("{not json", StateProblem.MALFORMED, id="text that is not JSON is malformed"),
        pytest.param("[1, 2]", StateProblem.MALFORMED, id="a JSON list is malformed"),
        pytest.param('{"v": 1, "uid": "x"}', StateProblem.MALFORMED, id="a document without signature is malformed"),
        pytest.param('{"v": 1, "sig": 7}', StateProblem.MALFORMED, id="a signature that is not text is malformed"),
        pytest.param("[" * 100_000, StateProblem.MALFORMED, id="JSON nested too deep is malformed"),
        pytest.param(
            sign_document({"v": 1, "uid": UID, "drivers": {}, "approvals": []}, StateKeys([OLD_KEY])),
            StateProblem.BAD_SIGNATURE,
            id="a state signed with an unknown key has a bad signature",
        ),
        pytest.param(
            sign_document({"v": 2, "uid": UID, "drivers": {}, "approvals": []}),
            StateProblem.UNSUPPORTED_VERSION,
            id="a signed state of another format version is unsupported",
        ),
        pytest.param(
            sign_document({"v": 1, "uid": UID, "drivers": [EBS], "approvals": []}),
            StateProblem.MALFORMED,
            id="a signed state with drivers as a list is malformed",
        ),
        pytest.param(
            sign_document({"v": 1, "uid": UID, "drivers": {EBS: {"count": "23"}}, "approvals": []}),
            StateProblem.MALFORMED,
            id="a signed state with a count that is text is malformed",
        ),
        pytest.param(
            sign_document({"v": 1, "uid": UID, "drivers": {EBS: {"count": 1, "changedAt": "noon"}}}),
            StateProblem.MALFORMED,
            id="a signed state with a time that does not parse is malformed",
        ),
        pytest.param(
            sign_document({"v": 1, "uid": UID, "drivers": {}, "approvals": [{"driver": EBS}]}),
            StateProblem.MALFORMED,
            id="a signed state with an incomplete approval is malformed",
        ),
    ],
)
def test_unusable_states_are_ignored_with_the_reason(value: str | None, problem: StateProblem) -> None:
    decoded = decode_state(value, UID, KEYS)
    assert decoded.state is None
    assert decoded.problem is problem


def respelled_signature(value: str, how: str) -> str:
    signature = json.loads(value)["sig"]
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    if how == "unused bits":  # 32 bytes leave 2 unused bits in the last character before '='
        last = alphabet.index(signature[-2])
        spelled = signature[:-2] + alphabet[last ^ 1] + "="
        assert base64.urlsafe_b64decode(spelled) == base64.urlsafe_b64decode(signature)
    elif how == "stray character":
        spelled = signature[:10] + "!" + signature[10:]
    else:
        spelled = signature[:10] + "\\n" + signature[10:]  # an escaped newline inside the JSON string
    return value.replace(signature, spelled)


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        pytest.param(
            lambda v: respelled_signature(v, "unused bits"),
            StateProblem.BAD_SIGNATURE,
            id="a signature respelled in its unused bits",
        ),
        pytest.param(
            lambda v: respelled_signature(v, "stray character"),
            StateProblem.BAD_SIGNATURE,
            id="a signature with a stray character",
        ),
        pytest.param(
            lambda v: respelled_signature(v, "newline"), StateProblem.BAD_SIGNATURE, id="a signature with a newline"
        ),
        pytest.param(lambda v: " " + v, StateProblem.MALFORMED, id="leading whitespace"),
        pytest.param(lambda v: v.replace(",", ", ", 1), StateProblem.MALFORMED, id="whitespace between fields"),
        pytest.param(lambda v: json.dumps(json.loads(v)), StateProblem.MALFORMED, id="the same document re-encoded"),
    ],
)
def test_a_respelled_annotation_is_not_what_the_guard_wrote(edit: Any, problem: StateProblem) -> None:
    value = encode_state(sample_state(), KEYS)
    edited = edit(value)

    assert edited != value
    decoded = decode_state(edited, UID, KEYS)
    assert (decoded.state, decoded.problem) == (None, problem)


def test_a_state_recorded_for_another_object_is_ignored() -> None:
    decoded = decode_state(encode_state(sample_state(OTHER_UID), KEYS), UID, KEYS)
    assert (decoded.state, decoded.problem, decoded.detail) == (
        None,
        StateProblem.OTHER_OBJECT,
        "state was recorded for another object",
    )


def test_a_state_cannot_be_used_for_an_object_without_uid() -> None:
    value = encode_state(sample_state(""), KEYS)
    assert decode_state(value, "", KEYS).problem is StateProblem.OTHER_OBJECT


# -- tampering (property) ------------------------------------------------------------------------------------------

EPOCH = datetime(2020, 1, 1, tzinfo=UTC)
ms_times = st.integers(min_value=0, max_value=80 * 365 * 86400 * 1000).map(
    lambda ms: EPOCH + timedelta(milliseconds=ms)
)
counts = st.one_of(st.none(), st.integers(min_value=0, max_value=INT32_MAX))
names = st.text(min_size=1, max_size=8)

corrections = st.builds(
    Correction, at=ms_times, before=counts, after=counts, basis=st.sampled_from(["resource-exhausted", "justification"])
)
entries = st.builds(
    EntryState,
    count=counts,
    changed_at=ms_times,
    writer_version=st.one_of(st.none(), st.sampled_from(["v1.37.0", "v1.34.2-eks-1a2b3c"]), names),
    frozen_until=st.one_of(st.none(), ms_times),
    correction=st.one_of(st.none(), corrections),
    pinned=st.one_of(st.none(), st.builds(PinnedLabel, label=names, value=st.text(max_size=12))),
    removed_at=st.one_of(st.none(), ms_times),
)
approvals = st.builds(
    Approval,
    driver=names,
    reason=st.text(max_size=12),
    min_count=st.integers(0, 100),
    max_count=st.integers(0, 100),
    expires=ms_times,
    ticket=st.text(max_size=10),
    approved_by=st.text(max_size=8),
    approved_at=ms_times,
)
states = st.builds(
    GuardState,
    uid=st.just(UID),
    entries=st.dictionaries(names, entries, max_size=3),
    approvals=st.lists(approvals, max_size=2).map(tuple),
    declared=st.dictionaries(
        names,
        st.builds(DeclaredVersion, version=st.text(max_size=10), set_by=st.text(max_size=8), set_at=ms_times),
        max_size=2,
    ),
    scope=st.one_of(st.none(), st.text(max_size=20)),
    sequence=st.integers(0, 2**40),
    cut=st.integers(0, 2**20),
)
PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(states)
def test_any_state_survives_encode_and_decode(state: GuardState) -> None:
    assert decode_state(encode_state(state, KEYS), UID, KEYS).state == state


@PROPERTY
@given(states, st.data())
def test_an_edited_annotation_is_detected_every_time(state: GuardState, data: st.DataObject) -> None:
    value = encode_state(state, KEYS)
    index = data.draw(st.integers(0, len(value) - 1), label="index")
    replacement = data.draw(st.characters().filter(lambda c: c != value[index]), label="replacement")
    edited = value[:index] + replacement + value[index + 1 :]

    assert decode_state(edited, UID, KEYS).state is None


@PROPERTY
@given(states, st.data())
def test_an_inserted_or_deleted_character_is_detected_every_time(state: GuardState, data: st.DataObject) -> None:
    value = encode_state(state, KEYS)
    if data.draw(st.booleans(), label="insert"):
        index = data.draw(st.integers(0, len(value)), label="index")
        inserted = data.draw(st.one_of(st.sampled_from(" \t\n\r"), st.characters()), label="inserted")
        edited = value[:index] + inserted + value[index:]
    else:
        index = data.draw(st.integers(0, len(value) - 1), label="index")
        edited = value[:index] + value[index + 1 :]

    assert edited != value
    assert decode_state(edited, UID, KEYS).state is None


@PROPERTY
@given(states, st.data())
def test_an_edited_field_is_detected_every_time(state: GuardState, data: st.DataObject) -> None:
    doc = json.loads(encode_state(state, KEYS))
    signature = doc.pop("sig")
    field = data.draw(st.sampled_from(sorted(doc)), label="field")
    doc[field] = data.draw(
        st.one_of(st.none(), st.integers(), st.text(), st.just({}), st.just([])).filter(lambda v: v != doc[field]),
        label="value",
    )
    edited = json.dumps({**doc, "sig": signature}, sort_keys=True, separators=(",", ":"))

    assert decode_state(edited, UID, KEYS).state is None


@PROPERTY
@given(states, st.data())
def test_a_truncated_annotation_is_detected_every_time(state: GuardState, data: st.DataObject) -> None:
    value = encode_state(state, KEYS)
    cut = data.draw(st.integers(0, len(value) - 1), label="cut")
    assert decode_state(value[:cut], UID, KEYS).state is None


@PROPERTY
@given(states, st.one_of(st.binary(min_size=32, max_size=32), st.binary(min_size=16, max_size=64)))
def test_a_forged_signature_is_detected_every_time(state: GuardState, forged: bytes) -> None:
    doc = json.loads(encode_state(state, KEYS))
    doc["sig"] = base64.urlsafe_b64encode(forged).decode("ascii")
    value = json.dumps(doc, sort_keys=True, separators=(",", ":"))

    assert decode_state(value, UID, KEYS).problem is StateProblem.BAD_SIGNATURE


@PROPERTY
@given(states, st.binary(min_size=16, max_size=64).filter(lambda k: k != KEY))
def test_a_state_signed_with_another_key_is_detected_every_time(state: GuardState, other_key: bytes) -> None:
    value = encode_state(state, StateKeys([other_key]))
    assert decode_state(value, UID, KEYS).problem is StateProblem.BAD_SIGNATURE


@PROPERTY
@given(states, st.uuids().map(str).filter(lambda u: u != UID))
def test_a_state_copied_from_another_object_is_detected_every_time(state: GuardState, other_uid: str) -> None:
    copied = encode_state(GuardState(uid=other_uid, entries=state.entries, approvals=state.approvals), KEYS)
    assert decode_state(copied, UID, KEYS).problem is StateProblem.OTHER_OBJECT


# -- keys ----------------------------------------------------------------------------------------------------------


def test_key_rotation_verifies_with_old_and_new_and_signs_with_new() -> None:
    old_keys = StateKeys([OLD_KEY])
    rotated = StateKeys([KEY, OLD_KEY])
    signed_before = encode_state(sample_state(), old_keys)

    assert decode_state(signed_before, UID, rotated).state == sample_state()

    signed_after = encode_state(sample_state(), rotated)
    assert signed_after == encode_state(sample_state(), StateKeys([KEY]))
    assert decode_state(signed_after, UID, StateKeys([KEY])).state == sample_state()
    assert decode_state(signed_after, UID, old_keys).problem is StateProblem.BAD_SIGNATURE


def test_after_the_old_key_is_dropped_states_it_signed_are_ignored() -> None:
    signed_before = encode_state(sample_state(), StateKeys([OLD_KEY]))
    assert decode_state(signed_before, UID, StateKeys([KEY])).problem is StateProblem.BAD_SIGNATURE


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        pytest.param([], "at least one state HMAC key is required", id="no key"),
        pytest.param([b"short"], "at least 16 bytes", id="a key shorter than 16 bytes"),
        pytest.param([KEY, b"x" * 15], "at least 16 bytes", id="a short key among good ones"),
    ],
)
def test_state_keys_refuse_missing_or_short_keys(keys: list[bytes], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StateKeys(keys)


def test_state_keys_repr_shows_no_key_material() -> None:
    keys = StateKeys([KEY, OLD_KEY])

    for text in (repr(keys), str(keys), f"{keys}", f"{keys!r}"):
        assert text == "StateKeys(<2 key(s)>)"
        for key in (KEY, OLD_KEY):
            assert key.decode() not in text
            assert key.hex() not in text
            assert base64.b64encode(key).decode() not in text


@pytest.mark.parametrize(
    "signature",
    [
        pytest.param("not base64 at all!", id="text that is not base64"),
        pytest.param("é", id="a non-ASCII signature"),
        pytest.param("", id="an empty signature"),
    ],
)
def test_verify_refuses_signatures_that_do_not_decode(signature: str) -> None:
    assert KEYS.verify(b"payload", signature) is False


def test_verify_accepts_its_own_signature() -> None:
    assert KEYS.verify(b"payload", KEYS.sign(b"payload")) is True
    assert KEYS.verify(b"payload!", KEYS.sign(b"payload")) is False


# -- values --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("when", "text"),
    [
        pytest.param(T0, "2026-11-30T02:00:00.000Z", id="UTC with milliseconds and Z"),
        pytest.param(T0.replace(microsecond=123_456), "2026-11-30T02:00:00.123Z", id="microseconds are cut"),
        pytest.param(
            datetime(2026, 11, 30, 3, 0, tzinfo=timezone(timedelta(hours=1))),
            "2026-11-30T02:00:00.000Z",
            id="other offsets are converted to UTC",
        ),
    ],
)
def test_format_time(when: datetime, text: str) -> None:
    assert format_time(when) == text


@pytest.mark.parametrize(
    ("text", "when"),
    [
        pytest.param("2026-11-30T02:00:00Z", T0, id="Z"),
        pytest.param("2026-11-30T02:00:00z", T0, id="lower case z"),
        pytest.param("2026-11-30T03:00:00+01:00", T0, id="an offset"),
        pytest.param("2026-11-30T02:00:00", T0, id="a naive time is UTC"),
        pytest.param("2026-11-30T02:00:00.000Z", T0, id="milliseconds"),
    ],
)
def test_parse_time(text: str, when: datetime) -> None:
    parsed = parse_time(text)
    assert parsed == when
    assert parsed.tzinfo is not None


def test_parse_time_refuses_text_that_is_not_a_time() -> None:
    with pytest.raises(ValueError):
        parse_time("tomorrow")


def test_with_entry_replaces_one_entry_and_leaves_the_original_alone() -> None:
    state = sample_state()
    entry = EntryState(count=30, changed_at=T0 + timedelta(minutes=5))

    changed = state.with_entry(EBS, entry)

    assert changed.entries[EBS] == entry
    assert changed.entries["pd.csi.storage.gke.io"] == state.entries["pd.csi.storage.gke.io"]
    assert state.entries[EBS].count == 23


def test_pruned_drops_expired_approvals_and_entries_of_drivers_that_are_gone() -> None:
    state = sample_state()

    assert state.pruned(T0).approvals == state.approvals
    assert state.pruned(T0 + timedelta(hours=2)).approvals == ()
    assert set(state.pruned(T0, [EBS, "efs.csi.aws.com"]).entries) == {EBS}
    assert set(state.pruned(T0).entries) == {EBS, "pd.csi.storage.gke.io"}


@pytest.mark.parametrize(
    ("driver", "count", "now", "covers"),
    [
        pytest.param(EBS, 5, T0, True, id="a count inside the range"),
        pytest.param(EBS, 0, T0, True, id="the lower bound"),
        pytest.param(EBS, 10, T0, True, id="the upper bound"),
        pytest.param(EBS, 11, T0, False, id="above the range"),
        pytest.param(EBS, None, T0, False, id="unbounded is never covered"),
        pytest.param("pd.csi.storage.gke.io", 5, T0, False, id="another driver"),
        pytest.param(EBS, 5, T0 + timedelta(hours=1), False, id="at the expiry"),
        pytest.param(EBS, 5, T0 + timedelta(hours=1) - timedelta(milliseconds=1), True, id="just before the expiry"),
    ],
)
def test_approval_covers(driver: str, count: int | None, now: datetime, covers: bool) -> None:
    approval = Approval(
        driver=EBS,
        reason="r",
        min_count=0,
        max_count=10,
        expires=T0 + timedelta(hours=1),
        ticket="",
        approved_by="alice",
        approved_at=T0,
    )
    assert approval.covers(driver, count, now) is covers


@pytest.mark.parametrize("uid", ["9f1c2d3e-4b5a-6978-8a9b-0c1d2e3f4a5b", "é\u2028\"\\x", 'a"b', "ü"])
def test_the_written_state_is_exactly_the_canonical_form_of_its_document(uid: str) -> None:
    entry = EntryState(count=3, changed_at=T0, writer_version="v1.2.3")
    state = GuardState(uid=uid, entries={"dé/x": entry, EBS: entry})
    text = encode_state(state, KEYS)
    assert text == json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    assert decode_state(text, uid, KEYS).state == state
