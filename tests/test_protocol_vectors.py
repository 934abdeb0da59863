"""The test vectors of tests/vectors (PROTOCOL.md §7): broker.common.protocol encodes each message to the file's bytes,
decodes the file back to the same values, and PROTOCOL.md §7 shows the same bytes as the files."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shmbroker.broker.common import protocol as P

VECTORS = Path(__file__).resolve().parent / "vectors"
PROTOCOL_MD = VECTORS.parent.parent / "docs" / "PROTOCOL.md"


def _tensor() -> P.TensorDesc:
    return P.TensorDesc(index=0, dtype=P.DType.FP32, offset=0, nbytes=1024, shape=(1, 256))


SUBMIT = P.SubmitBatch(1, 0x0123456789ABCDEF, [P.SubmitRequest(1, 0, 1, 1, 0, [_tensor()])])
DONE = P.DoneBatch(1, [P.Result(1, 0, 1, P.Status.OK, [_tensor()])])
DONE_TWO = P.DoneBatch(1, [
    P.Result(2, 1, 1, P.Status.OK, [_tensor()]),
    P.Result(3, 2, 1, P.Status.BAD_SHAPE, [], "inputs['x'].shape: expected [N, 256], got [1, 255]"),
])
# file name -> the values it encodes, in the order PROTOCOL.md §7 shows them
CASES: dict[str, P.SubmitBatch | P.DoneBatch] = {"submit": SUBMIT, "done": DONE, "done_two_results": DONE_TWO}


def read_vector(name: str) -> list[bytes]:
    """A vector file's frames: one line each, in hex."""
    return [bytes.fromhex(line) for line in (VECTORS / f"{name}.hex").read_text().splitlines()]


def encode(values: P.SubmitBatch | P.DoneBatch) -> list[bytes]:
    return P.encode_submit(values) if isinstance(values, P.SubmitBatch) else P.encode_done(values)


def test_every_vector_file_is_checked() -> None:
    assert {p.stem for p in VECTORS.glob("*.hex")} == set(CASES)


@pytest.mark.parametrize("name", CASES)
def test_encoding_gives_the_vector_byte_for_byte(name: str) -> None:
    assert encode(CASES[name]) == read_vector(name)


@pytest.mark.parametrize("name", CASES)
def test_the_vector_decodes_to_its_values(name: str) -> None:
    head, body = read_vector(name)
    values = CASES[name]
    if isinstance(values, P.SubmitBatch):
        assert P.read_envelope([head, body]) is P.MsgKind.SUBMIT
        assert P.decode_submit(body) == values
    else:
        assert P.read_envelope([head, body]) is P.MsgKind.DONE
        assert P.decode_done(body) == values


def _section_7_dumps() -> list[bytes]:
    """The bodies that PROTOCOL.md §7 dumps in hex (``0000: 01 00 ...`` lines; a comment may follow them)."""
    text = PROTOCOL_MD.read_text()
    section = text[text.index("## 7. Worked example"):text.index("## 8. ")]
    bodies = []
    for block in re.findall(r"```\n(.*?)```", section, re.S):
        body = bytearray()
        for m in re.finditer(r"^\s*([0-9a-f]{4}): ([0-9a-f]{2}(?: [0-9a-f]{2})*)", block, re.M):
            assert int(m.group(1), 16) == len(body), f"offset {m.group(1)} in PROTOCOL.md §7 is not the next byte"
            body += bytes.fromhex(m.group(2))
        bodies.append(bytes(body))
    return bodies


def test_protocol_md_section_7_shows_the_vectors() -> None:
    assert _section_7_dumps() == [read_vector(name)[1] for name in CASES]
    assert "tests/vectors/" in PROTOCOL_MD.read_text()
