"""The binding's ctypes structs against the C header, as the C compiler lays it out.

A small C program generated from the header's own struct declarations prints every field's
offset and size and each struct's size (`offsetof`, `sizeof`); the ctypes structs in
dsv4/_native.py must match them field for field. A field appended to the header without the
binding, a reordered field or a wrong C type fails here instead of corrupting memory. The
version-1 header frozen in tests/c/abi_v1 is checked the same way against the current one:
every version-1 field keeps its offset and size, and appended fields start past version 1's
size."""

import ctypes
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from dsv4 import _native

ROOT = Path(__file__).resolve().parents[2]
HEADER = ROOT / "include" / "dsv4.h"
HEADER_V1 = ROOT / "tests" / "c" / "abi_v1" / "dsv4.h"

# Each struct of the header and the binding's ctypes struct for it.
BOUND = {
    "dsv4_request": _native.Request,
    "dsv4_event": _native.Event,
    "dsv4_metrics": _native.Metrics,
    "dsv4_units": _native.Units,
}


def declared_structs(header_text):
    """{struct name: [field names in order]} of every `typedef struct { ... } name;`."""
    structs = {}
    for m in re.finditer(r"typedef struct \{(.*?)\} (dsv4_\w+);", header_text, re.S):
        body = re.sub(r"/\*.*?\*/|//[^\n]*", "", m.group(1), flags=re.S)
        fields = []
        for decl in body.split(";"):
            decl = decl.strip()
            if decl:
                name = re.search(r"(\w+)\s*(\[[^\]]*\])?$", decl)
                assert name, "cannot read the field declaration {!r}".format(decl)
                fields.append(name.group(1))
        structs[m.group(2)] = fields
    return structs


def c_layout(header, tmp_path):
    """{struct: {"size": n, "fields": [(name, offset, size), ...]}} as the C compiler sees
    `header`."""
    structs = declared_structs(header.read_text())
    assert structs, "no structs found in {}".format(header)
    lines = ["#include <stddef.h>", "#include <stdio.h>",
             '#include "{}"'.format(header.resolve()), "int main(void) {"]
    for name, fields in structs.items():
        lines.append('printf("S {0} %zu\\n", sizeof({0}));'.format(name))
        for f in fields:
            lines.append('printf("F {0} {1} %zu %zu\\n", offsetof({0}, {1}), '
                         'sizeof((({0} *)0)->{1}));'.format(name, f))
    lines += ["return 0;", "}"]
    src = tmp_path / (header.parent.name + "_layout.c")
    exe = tmp_path / (header.parent.name + "_layout")
    src.write_text("\n".join(lines) + "\n")
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        pytest.fail("no C compiler `{}`: install one or set CC (the layout test needs "
                    "offsetof from the real C compiler)".format(cc))
    subprocess.run([cc, "-std=c11", "-Wall", "-Werror", str(src), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    layout = {name: {"size": None, "fields": []} for name in structs}
    for line in out.splitlines():
        parts = line.split()
        if parts[0] == "S":
            layout[parts[1]]["size"] = int(parts[2])
        else:
            layout[parts[1]]["fields"].append((parts[2], int(parts[3]), int(parts[4])))
    return layout


@pytest.fixture(scope="module")
def current(tmp_path_factory):
    return c_layout(HEADER, tmp_path_factory.mktemp("current"))


@pytest.fixture(scope="module")
def version_1(tmp_path_factory):
    return c_layout(HEADER_V1, tmp_path_factory.mktemp("abi_v1"))


def test_every_struct_of_the_header_has_a_ctypes_struct(current):
    assert set(current) == set(BOUND), (
        "the header's structs and the binding's differ: add a ctypes Structure to "
        "bindings/python/dsv4/_native.py and to BOUND here")


@pytest.mark.parametrize("name", sorted(BOUND))
def test_ctypes_struct_matches_the_c_layout(current, name):
    cls = BOUND[name]
    c = current[name]
    assert [f for f, _ in cls._fields_] == [f for f, _, _ in c["fields"]], (
        "{}: the ctypes fields differ from the header's (names and order)".format(name))
    for field, offset, size in c["fields"]:
        got = getattr(cls, field)
        assert (got.offset, got.size) == (offset, size), (
            "{}.{}: ctypes puts it at offset {} with {} bytes, C at {} with {}: fix its type in "
            "_native.py".format(name, field, got.offset, got.size, offset, size))
    assert ctypes.sizeof(cls) == c["size"], name


def test_event_message_is_appended_after_version_1(current):
    assert _native.Event.message.offset == 88
    assert ("message", 88, ctypes.sizeof(ctypes.c_void_p)) in current["dsv4_event"]["fields"]


def test_request_pd_fields_are_appended_after_version_1(current):
    # Version 2 of dsv4_request: pd_room (uint64_t) at 128, pd_peer (const char *) at 136.
    pointer = ctypes.sizeof(ctypes.c_void_p)
    assert (_native.Request.pd_room.offset, _native.Request.pd_room.size) == (128, 8)
    assert (_native.Request.pd_peer.offset, _native.Request.pd_peer.size) == (136, pointer)
    fields = current["dsv4_request"]["fields"]
    assert fields[19:21] == [("pd_room", 128, 8), ("pd_peer", 136, pointer)]


def test_request_stop_sequences_and_ignore_eos_are_appended_after_version_2(current):
    # Version 3 of dsv4_request: starts at version 2's size (144), never in its tail.
    pointer = ctypes.sizeof(ctypes.c_void_p)
    fields = current["dsv4_request"]["fields"]
    assert fields[21:] == [("stop_sequences", 144, pointer), ("stop_sequence_lens", 152, pointer),
                           ("stop_sequences_len", 160, 8), ("ignore_eos", 168, 1)]
    assert ctypes.sizeof(_native.Request) == 176
    assert current["dsv4_request"]["size"] == 176


def test_version_1_fields_keep_their_place_and_new_ones_follow_its_size(current, version_1):
    # Version 1's sizes as the header's preamble freezes them.
    assert {n: version_1[n]["size"] for n in ("dsv4_request", "dsv4_event", "dsv4_metrics")} \
        == {"dsv4_request": 128, "dsv4_event": 88, "dsv4_metrics": 504}
    assert "dsv4_request 128, dsv4_event 88 (up to elapsed_us), dsv4_metrics 504 bytes" \
        in " ".join(HEADER.read_text().replace("*", " ").split())
    for name, old in version_1.items():
        assert name in current, "{} was removed from the header: structs are never removed" \
            .format(name)
        new = current[name]
        n = len(old["fields"])
        assert new["fields"][:n] == old["fields"], (
            "{}: a version-1 field moved or changed size; fields are only appended"
            .format(name))
        assert new["size"] >= old["size"], name
        if old["fields"][0][0] != "struct_size":
            # Unversioned (dsv4_units, nested in dsv4_metrics): it never changes at all.
            assert new == old, "{} changed; it has no struct_size, so it never may".format(name)
        for field, offset, _ in new["fields"][n:]:
            assert offset >= old["size"], (
                "{}.{} at offset {} lies inside version 1's {} bytes (an old caller's tail "
                "padding): pad so it starts at or after them".format(
                    name, field, offset, old["size"]))
