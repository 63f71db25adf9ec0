#!/usr/bin/env python3
"""Extracts Jane Austen's six novels from the R package janeaustenr as UTF-8 text files.

Usage: extract_austen.py RDATA_RDB OUT_DIR

RDATA_RDB is usr/lib/R/site-library/janeaustenr/data/Rdata.rdb from the Debian package
r-cran-janeaustenr; its index Rdata.rdx must sit beside it. Writes OUT_DIR/<name>.txt for each of
the six novels (emma, mansfieldpark, northangerabbey, persuasion, prideprejudice,
sensesensibility); other objects of the database (the austen_books data frame, which repeats the
same text) are skipped.

Each novel is an R character vector with one element per line of the book. A file holds those
lines joined with "\n" plus a final "\n", so line i of the file is element i of the vector. An
NA element (R's NA_STRING) becomes an empty line, which keeps that correspondence; the number of
NAs is reported (janeaustenr 1.0.0 has none). Strings marked latin1 in R are re-encoded to UTF-8.

The formats, as R writes them (R's src/main/serialize.c and src/library/base/R/lazyload.R):
  Rdata.rdx  gzip'd serialized R list(variables = list(name = c(offset, length), ...),
             references = list(...), compressed = TRUE | 2 | 3)
  Rdata.rdb  records at those offsets: 4-byte big-endian uncompressed length, then (compressed =
             TRUE) a zlib stream, or (2, 3) one type byte ('2' bzip2, 'Z' xz, '0' stored) and the data
  each record, once decompressed, is R's XDR serialization: "X\n", version (2 or 3), writer and
  reader R versions, for version 3 the native encoding, then the object.

Only the Python standard library is used (zlib, struct; bz2/lzma only for records that need them).
Anything unexpected stops the script with a message naming the file and the offset.
"""
import os
import struct
import sys
import zlib

NOVELS = ("emma", "mansfieldpark", "northangerabbey", "persuasion", "prideprejudice",
          "sensesensibility")

# SEXP types (Rinternals.h) and the pseudo-types of the serialization format (serialize.c).
NILSXP, SYMSXP, LISTSXP, CLOSXP, ENVSXP, PROMSXP, LANGSXP = 0, 1, 2, 3, 4, 5, 6
SPECIALSXP, BUILTINSXP, CHARSXP, LGLSXP, INTSXP, REALSXP, CPLXSXP, STRSXP = 7, 8, 9, 10, 13, 14, 15, 16
DOTSXP, VECSXP, EXPRSXP, BCODESXP, EXTPTRSXP, WEAKREFSXP, RAWSXP, S4SXP = 17, 19, 20, 21, 22, 23, 24, 25
REFSXP, NILVALUE_SXP, GLOBALENV_SXP, UNBOUNDVALUE_SXP, MISSINGARG_SXP = 255, 254, 253, 252, 251
BASENAMESPACE_SXP, NAMESPACESXP, PACKAGESXP, PERSISTSXP = 250, 249, 248, 247
EMPTYENV_SXP, BASEENV_SXP, ATTRLANGSXP, ATTRLISTSXP, ALTREP_SXP = 242, 241, 240, 239, 238
# CHARSXP encoding bits, in the "levels" part of the flags.
LATIN1_MASK, UTF8_MASK, BYTES_MASK, ASCII_MASK = 1 << 2, 1 << 3, 1 << 1, 1 << 6

NA_INTEGER = -2**31


class FormatError(Exception):
    pass


class RSymbol(str):
    """An R symbol (a name), kept apart from character data."""


class RObject:
    """A parsed R value: type, value (list, bytes, numbers...) and attributes as a dict."""

    def __init__(self, sexptype, value, attributes=None):
        self.type = sexptype
        self.value = value
        self.attributes = attributes or {}


class Reader:
    """Reads one XDR serialization (a decompressed record). `where` names the record in messages."""

    def __init__(self, data, where):
        self.data = data
        self.pos = 0
        self.where = where
        self.refs = []
        self.native_encoding = "UTF-8"

    def fail(self, what):
        raise FormatError(f"{self.where}, byte {self.pos} of the decompressed record: {what}")

    def take(self, n):
        if n < 0 or self.pos + n > len(self.data):
            self.fail(f"truncated: wanted {n} bytes, {len(self.data) - self.pos} left")
        b = self.data[self.pos:self.pos + n]
        self.pos += n
        return b

    def int(self):
        return struct.unpack(">i", self.take(4))[0]

    def length(self):
        n = self.int()
        if n == -1:  # long vector: two more ints, upper and lower 32 bits
            hi, lo = struct.unpack(">II", self.take(8))
            n = (hi << 32) | lo
        elif n < 0:
            self.fail(f"negative length {n}")
        return n

    def header(self):
        fmt = self.take(2)
        if fmt != b"X\n":
            self.pos -= 2
            self.fail(f"serialization format {fmt!r} is not XDR (b'X\\n'); "
                      "ascii/binary R serializations are not supported")
        version = self.int()
        self.int()  # R version that wrote it
        self.int()  # minimal R version to read it
        if version == 3:
            n = self.int()
            self.native_encoding = self.take(n).decode("ascii", "replace")
        elif version != 2:
            self.fail(f"serialization version {version} (only 2 and 3 are known)")

    def charsxp_text(self, levels, n):
        """The text of a CHARSXP of length n (already read) with encoding bits `levels`."""
        raw = self.take(n)
        start = self.pos - n
        if levels & BYTES_MASK:
            self.pos = start
            self.fail("a string marked as bytes (no encoding) cannot be turned into text")
        if levels & LATIN1_MASK:
            return raw.decode("latin-1")
        enc = "utf-8" if levels & (UTF8_MASK | ASCII_MASK) else self.native_encoding
        try:
            return raw.decode(enc)
        except (LookupError, UnicodeDecodeError) as e:
            self.pos = start
            self.fail(f"string of {n} bytes is not valid {enc}: {e}")

    def item(self):
        at = self.pos
        flags = self.int()
        t = flags & 0xFF
        levels = flags >> 12
        has_attr = bool(flags & (1 << 9))
        has_tag = bool(flags & (1 << 10))

        if t == NILVALUE_SXP:
            return None
        if t in (EMPTYENV_SXP, BASEENV_SXP, GLOBALENV_SXP, UNBOUNDVALUE_SXP, MISSINGARG_SXP,
                 BASENAMESPACE_SXP):
            return RObject(t, None)
        if t == REFSXP:
            i = flags >> 8 or self.int()
            if not 1 <= i <= len(self.refs):
                self.pos = at
                self.fail(f"reference {i} to an object not read yet ({len(self.refs)} so far)")
            return self.refs[i - 1]
        if t in (PERSISTSXP, NAMESPACESXP, PACKAGESXP):
            if self.int() != 0:
                self.fail("persistent string vector does not start with 0")
            obj = RObject(t, [self.item() for _ in range(self.int())])
            self.refs.append(obj)
            return obj
        if t == SYMSXP:
            name = self.item()
            if not isinstance(name, str):
                self.pos = at
                self.fail("symbol whose name is not a string")
            sym = RSymbol(name)
            self.refs.append(sym)
            return sym
        if t == ENVSXP:
            env = RObject(ENVSXP, None)
            self.refs.append(env)  # before its contents, which may refer to it
            self.int()  # locked
            enclos, frame, hashtab, attrib = self.item(), self.item(), self.item(), self.item()
            env.value = {"enclos": enclos, "frame": frame, "hashtab": hashtab}
            env.attributes = attrib if isinstance(attrib, dict) else {}
            return env
        if t in (LISTSXP, LANGSXP, CLOSXP, PROMSXP, DOTSXP, ATTRLANGSXP, ATTRLISTSXP):
            # A pairlist: read iteratively along its CDRs. Returned as a dict tag -> value when every
            # cell has a tag (attributes, named lists), else as an RObject holding (tag, value) pairs.
            cells, first_attr = [], None
            while True:
                attr = self.item() if has_attr else None
                if first_attr is None:
                    first_attr = attr
                tag = self.item() if has_tag else None
                cells.append((tag, self.item()))
                at = self.pos
                flags = self.int()
                t2 = flags & 0xFF
                if t2 not in (LISTSXP, ATTRLISTSXP) or t not in (LISTSXP, ATTRLISTSXP):
                    self.pos = at
                    rest = self.item()
                    if rest is not None and t in (LISTSXP, ATTRLISTSXP):
                        self.pos = at
                        self.fail(f"pairlist ends in a type {t2} object instead of NULL")
                    break
                has_attr = bool(flags & (1 << 9))
                has_tag = bool(flags & (1 << 10))
            if t in (LISTSXP, ATTRLISTSXP) and all(isinstance(k, str) for k, _ in cells):
                return {k: v for k, v in cells}
            return RObject(t, cells, first_attr if isinstance(first_attr, dict) else None)
        if t in (SPECIALSXP, BUILTINSXP):
            return RObject(t, self.take(self.int()).decode("latin-1"))
        if t == CHARSXP:
            n = self.int()
            return None if n == -1 else self.charsxp_text(levels, n)

        if t in (LGLSXP, INTSXP):
            n = self.length()
            value = list(struct.unpack(f">{n}i", self.take(4 * n)))
        elif t == REALSXP:
            n = self.length()
            value = list(struct.unpack(f">{n}d", self.take(8 * n)))
        elif t == CPLXSXP:
            n = self.length()
            v = struct.unpack(f">{2 * n}d", self.take(16 * n))
            value = [complex(v[2 * i], v[2 * i + 1]) for i in range(n)]
        elif t == RAWSXP:
            value = self.take(self.length())
        elif t == STRSXP:
            value = []
            for _ in range(self.length()):
                el_at = self.pos
                el_flags = self.int()
                if el_flags & 0xFF != CHARSXP:
                    self.pos = el_at
                    self.fail(f"element of a character vector has type {el_flags & 0xFF}, not CHARSXP (9)")
                n = self.int()
                value.append(None if n == -1 else self.charsxp_text(el_flags >> 12, n))
        elif t in (VECSXP, EXPRSXP):
            value = [self.item() for _ in range(self.length())]
        elif t == S4SXP:
            value = None
        elif t == ALTREP_SXP:
            # A compact/deferred vector: class info, its state, attributes. Only the wrapper and
            # deferred-string classes carry a plain vector in their state; anything else stops here.
            info, state, attr = self.item(), self.item(), self.item()
            cls = info.value[0][1] if isinstance(info, RObject) and info.value else info
            self.pos = at
            self.fail(f"ALTREP object (class {cls!r}) is not supported; re-save the data without ALTREP")
        else:
            self.pos = at
            self.fail(f"unsupported SEXP type {t} (flags 0x{flags:08x})")
        attributes = {}
        if has_attr:
            a = self.item()
            if not isinstance(a, dict):
                self.fail("attributes are not a tagged pairlist")
            attributes = a
        return RObject(t, value, attributes)


def parse(data, where):
    r = Reader(data, where)
    r.header()
    obj = r.item()
    if r.pos != len(data):
        r.fail(f"{len(data) - r.pos} bytes left over after the object")
    return obj


def read_record(rdb, blob, offset, length, compressed):
    where = f"{rdb}, record at offset {offset}"
    rec = blob[offset:offset + length]
    if offset < 0 or length < 5 or len(rec) != length:
        raise FormatError(f"{where}: the index gives a record of {length} bytes, ending at offset "
                          f"{offset + length}, but the file has {len(blob)} bytes (truncated?)")
    expect = struct.unpack(">I", rec[:4])[0]
    body = rec[4:]
    try:
        if compressed in (2, 3):
            kind, body = body[:1], body[1:]
            if kind == b"0":
                data = body
            elif kind == b"2":
                import bz2
                data = bz2.decompress(body)
            elif kind == b"Z":
                import lzma
                data = lzma.decompress(body, format=lzma.FORMAT_RAW,
                                       filters=[{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}])
            else:
                raise FormatError(f"{where}: unknown compression type byte {kind!r}")
        elif compressed:
            data = zlib.decompress(body)
        else:
            data = body
    except (zlib.error, OSError, ValueError, ImportError) as e:
        if isinstance(e, FormatError):
            raise
        raise FormatError(f"{where}: cannot decompress the record: {e}") from None
    if len(data) != expect:
        raise FormatError(f"{where}: record header says {expect} bytes, decompressed {len(data)}")
    return parse(data, where)


def read_index(rdx):
    try:
        with open(rdx, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise FormatError(f"cannot read the index {rdx}: {e}") from None
    try:
        data = zlib.decompress(raw, 47)  # gzip or zlib header, as readRDS accepts
    except zlib.error as e:
        raise FormatError(f"{rdx}, offset 0: not a gzip/zlib stream: {e}") from None
    index = parse(data, f"{rdx} (decompressed)")
    names = index.attributes.get("names") if isinstance(index, RObject) else None
    if not (isinstance(index, RObject) and index.type == VECSXP and names):
        raise FormatError(f"{rdx}: the index is not a named list")
    index = dict(zip(names.value, index.value))
    variables = index.get("variables")
    if not (isinstance(variables, RObject) and variables.type == VECSXP and "names" in variables.attributes):
        raise FormatError(f"{rdx}: the index has no named list 'variables'")
    compressed = index.get("compressed")
    compressed = compressed.value[0] if isinstance(compressed, RObject) and compressed.value else 1
    entries = {}
    for name, pos in zip(variables.attributes["names"].value, variables.value):
        if not (isinstance(pos, RObject) and pos.type in (INTSXP, REALSXP) and len(pos.value) == 2):
            raise FormatError(f"{rdx}: entry {name!r} is not c(offset, length)")
        entries[name] = (int(pos.value[0]), int(pos.value[1]))
    return entries, compressed


def write_atomic(path, text):
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)
    os.replace(tmp, path)


def main(argv):
    if len(argv) != 3:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    rdb, out_dir = argv[1], argv[2]
    rdx = os.path.splitext(rdb)[0] + ".rdx"
    try:
        entries, compressed = read_index(rdx)
        missing = [n for n in NOVELS if n not in entries]
        if missing:
            raise FormatError(f"{rdx}: no object named {', '.join(missing)} (found {', '.join(sorted(entries))})")
        with open(rdb, "rb") as f:
            blob = f.read()
        texts = {}
        for name in NOVELS:
            offset, length = entries[name]
            obj = read_record(rdb, blob, offset, length, compressed)
            if not (isinstance(obj, RObject) and obj.type == STRSXP):
                kind = obj.type if isinstance(obj, RObject) else type(obj).__name__
                raise FormatError(f"{rdb}, record at offset {offset}: {name} is of type {kind}, not a character vector")
            texts[name] = obj.value
    except FormatError as e:
        print(f"extract_austen.py: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"extract_austen.py: error: {e}", file=sys.stderr)
        return 1
    os.makedirs(out_dir, exist_ok=True)
    total = 0
    for name, lines in texts.items():
        nas = sum(1 for s in lines if s is None)
        text = "\n".join("" if s is None else s for s in lines) + "\n"
        path = os.path.join(out_dir, name + ".txt")
        write_atomic(path, text)
        size = len(text.encode("utf-8"))
        total += size
        print(f"extract_austen: {name}.txt  {len(lines)} lines, {size} bytes" + (f", {nas} NA lines left empty" if nas else ""))
    print(f"extract_austen: {len(texts)} novels, {total} bytes in {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
