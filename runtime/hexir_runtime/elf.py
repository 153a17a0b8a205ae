"""What a shared object would make the dynamic loader do besides mapping it, read before dlopen.

dlopen runs code before it returns: the library's constructors (DT_INIT, DT_INIT_ARRAY,
DT_PREINIT_ARRAY; destructors, DT_FINI and DT_FINI_ARRAY, run at exit), its IFUNC resolvers
(R_*_IRELATIVE relocations, and any symbol of type STT_GNU_IFUNC the library defines: resolved
by relocation or by dlsym), and every library it names in DT_NEEDED, DT_AUXILIARY or DT_FILTER,
found along DT_RPATH/DT_RUNPATH (`$ORIGIN` is the memfd's /proc/self/fd: a crafted RUNPATH
reaches the current directory). A DT_SONAME makes later loads of that name (`libcuda.so.1`)
resolve to the library. The compiler links its libraries with `-nostartfiles`, so they have
none of these: the only libraries they need are libc and libm, which the Python process
has loaded already. `check_dynamic` refuses anything else, and any ELF it cannot read
exactly as the loader would (the dynamic section is read at its address through the PT_LOAD
segments, as the loader reads it in memory, not at its own file offset; a repeated tag, of
which the loader keeps the last, is refused), and every relocation the loader would apply: its
symbol must be one whose type was checked, its target in a writable segment, and nothing the
loader asserts on (an assertion ends the process).
"""

from __future__ import annotations

import mmap
import struct

from .errors import HxbFormatError

#: The only libraries a module's library may name in DT_NEEDED (both loaded in any Python process).
ALLOWED_NEEDED = ("libc.so.6", "libm.so.6")

_PT_LOAD, _PT_DYNAMIC, _PT_GNU_STACK, _PF_X, _PF_W = 1, 2, 0x6474E551, 1, 2
_DT_NEEDED, _DT_STRTAB, _DT_SYMTAB, _DT_HASH, _DT_GNU_HASH = 1, 5, 6, 4, 0x6FFFFEF5
_DT_STRSZ, _DT_PLTRELSZ, _DT_PLTREL, _DT_JMPREL = 10, 2, 20, 23
_DT_RELA, _DT_RELASZ, _DT_RELAENT, _DT_SYMENT, _DT_RELACOUNT = 7, 8, 9, 11, 0x6FFFFFF9
# Relocation tables the runtime does not read (x86-64 and aarch64 use RELA; RELR writes unchecked addresses).
_UNREAD = {17: "DT_REL", 18: "DT_RELSZ", 19: "DT_RELENT", 35: "DT_RELRSZ", 36: "DT_RELR", 37: "DT_RELRENT"}
# The values the loader asserts on (an assertion ends the process): (tag, its name, the value it must have).
_ASSERTED = ((_DT_RELAENT, "DT_RELAENT", 24), (_DT_SYMENT, "DT_SYMENT", 24), (_DT_PLTREL, "DT_PLTREL", _DT_RELA))
_RUNS_CODE = {12: "a constructor (DT_INIT)", 13: "a destructor (DT_FINI)", 25: "constructors (DT_INIT_ARRAY)",
              26: "destructors (DT_FINI_ARRAY)", 32: "pre-constructors (DT_PREINIT_ARRAY)"}
_LOADS_OTHERS = {15: "DT_RPATH", 29: "DT_RUNPATH", 14: "DT_SONAME", 0x7FFFFFFD: "DT_AUXILIARY",
                 0x7FFFFFFF: "DT_FILTER", 0x6FFFFEFC: "DT_AUDIT", 0x6FFFFEFB: "DT_DEPAUDIT"}
_IRELATIVE = {62: 37, 183: 1032}  # e_machine -> its R_*_IRELATIVE (x86_64, aarch64)
_COPY = {62: 5, 183: 1024}  # e_machine -> its R_*_COPY, which copies as many bytes as a symbol says
_RELATIVE = {62: (8, 38)}  # e_machine -> the only types ld.so accepts among the first DT_RELACOUNT (it asserts)
_STT_GNU_IFUNC = 10


class _Image:
    """A little-endian ELF64's bytes and its PT_LOAD segments, read by address; every read is bounds-checked."""

    def __init__(self, data: memoryview, fail) -> None:
        self.data, self.fail, self.loads = data, fail, []

    def read(self, layout: str, offset: int) -> tuple[int, ...]:
        size = struct.calcsize(layout)
        if offset < 0 or offset + size > len(self.data):
            self.fail(f"is truncated or corrupt: {size} bytes at offset {offset} lie outside its {len(self.data)}")
        return struct.unpack_from("<" + layout, self.data, offset)

    def offset(self, address: int, size: int, what: str) -> int:
        """The file offset of `size` bytes at `address`, which must lie in one segment's file bytes."""
        return self.span(address, size, what)[0]

    def span(self, address: int, size: int, what: str) -> tuple[int, int]:
        """`offset`, and how many bytes of the segment's file bytes follow it (what memory holds there)."""
        for start, offset, filesz in self.loads:
            if start <= address and address + size <= start + filesz:
                return offset + address - start, start + filesz - address
        self.fail(f"is corrupt: its {what} ({size} bytes at address {address:#x}) lies in no loaded segment")

    def string(self, address: int, limit: int, what: str) -> str:
        start, available = self.span(address, 1, what)
        end = bytes(self.data[start : start + min(limit, available)]).find(b"\0")
        if end < 0:
            self.fail(f"is corrupt: its {what} has no end")
        return bytes(self.data[start : start + end]).decode("utf-8", "replace")


def check_dynamic(blob: memoryview | bytes, field: str, what: str) -> None:
    """HxbFormatError(field, ...) naming `what` and what was found, unless the ELF shared object
    `blob` is one dlopen maps without running any of its code or loading any other library."""

    def fail(reason: str) -> None:
        raise HxbFormatError(field, f"{what} {reason}")

    image = _Image(memoryview(blob).cast("B"), fail)
    if bytes(image.data[:4]) != b"\x7fELF" or len(image.data) < 64 or bytes(image.data[4:6]) != b"\x02\x01":
        fail("is not a 64-bit little-endian ELF shared object")
    e_type, machine = image.read("HH", 16)
    table, entry_size, count = image.read("Q", 32)[0], image.read("H", 54)[0], image.read("H", 56)[0]
    if e_type != 3:
        fail(f"is not a shared object (ELF type {e_type})")
    if entry_size < 56 or count == 0xFFFF:
        fail("is corrupt: its program header table is malformed")
    dynamic, writable = [], []
    page = mmap.PAGESIZE
    for i in range(count):
        kind, flags, offset, address, _, filesz, memsz = image.read("IIQQQQQ", table + i * entry_size)
        if offset + filesz > len(image.data) or filesz > memsz:
            fail(f"is truncated or corrupt: its segment {i} ends past its {len(image.data)} bytes")
        if kind == _PT_LOAD:
            if image.loads and address // page < -(-(image.loads[-1][0] + image.loads[-1][3]) // page):
                fail(f"is corrupt: its loaded segment {i} overlaps or precedes the one before it")
            image.loads.append((address, offset, filesz, memsz))
            if flags & _PF_W:
                writable.append((address, memsz))
        elif kind == _PT_DYNAMIC:
            dynamic.append((address, filesz))
        elif kind == _PT_GNU_STACK and flags & _PF_X:
            fail("asks for an executable stack (PT_GNU_STACK)")
    if len(dynamic) != 1:
        fail(f"has {len(dynamic)} dynamic segments (PT_DYNAMIC), not 1")
    image.loads = [(address, offset, filesz) for address, offset, filesz, _ in image.loads]
    address, size = dynamic[0]
    start = image.offset(address, size, "dynamic section")
    tags: dict[int, list[int]] = {}
    for at in range(start, start + size - 15, 16):
        tag, value = image.read("qQ", at)
        if tag == 0:
            break
        tags.setdefault(tag, []).append(value)
    else:
        fail("is corrupt: its dynamic section has no DT_NULL end")
    for tag, values in tags.items():
        if len(values) > 1 and tag != _DT_NEEDED:  # the loader keeps the last, which a check of the first misses
            fail(f"is corrupt: its dynamic section has {len(values)} entries of tag {tag}, not 1")
    for tag, value in _RUNS_CODE.items():
        if tag in tags:
            fail(f"has {value}: a library must run no code when it is loaded (link it with -nostartfiles, "
                 "and without __attribute__((constructor)))")
    for tag, name in _LOADS_OTHERS.items():
        if tag in tags:
            fail(f"has a {name} entry: a library may name no other library and no search path")
    strings, limit = _one(tags, _DT_STRTAB, fail), _one(tags, _DT_STRSZ, fail)
    for value in tags.get(_DT_NEEDED, []):
        needed = _string(image, strings, value, limit)
        if needed not in ALLOWED_NEEDED:
            fail(f"needs the library {needed!r} (DT_NEEDED): a library may need only {', '.join(ALLOWED_NEEDED)}")
    symbols, count = _one(tags, _DT_SYMTAB, fail), _symbol_count(image, tags, fail)
    _check_relocations(image, tags, machine, count, writable, fail)
    for i in range(count):
        name, info, _, section = image.read("IBBH", image.offset(symbols + 24 * i, 24, "symbol table"))
        if info & 0xF == _STT_GNU_IFUNC and section != 0:
            fail(f"defines an IFUNC symbol {_string(image, strings, name, limit)!r}, whose resolver would run "
                 "when it is loaded or looked up")


def _one(tags: dict[int, list[int]], tag: int, fail) -> int:
    if len(tags.get(tag, [])) != 1:
        fail(f"is corrupt: its dynamic section has {len(tags.get(tag, []))} entries of tag {tag}, not 1")
    return tags[tag][0]


def _string(image: _Image, strings: int, index: int, limit: int) -> str:
    if index >= limit:
        image.fail(f"is corrupt: a name at {index} lies past its string table's {limit} bytes")
    return image.string(strings + index, limit - index, "string table")


def _check_relocations(image: _Image, tags: dict[int, list[int]], machine: int, symbols: int,
                       writable: list[tuple[int, int]], fail) -> None:
    """Refuse relocations that would run code (IRELATIVE, or a symbol outside the `symbols` whose types
    were checked: the loader indexes the symbol table directly), write outside the writable segments,
    or that the loader would assert on."""
    for tag, name in _UNREAD.items():
        if tag in tags:
            fail(f"has a {name} entry: a library's relocations may be only DT_RELA and DT_JMPREL ones")
    for tag, name, value in _ASSERTED:
        if tags.get(tag, [value]) != [value]:
            fail(f"is corrupt: its {name} is {tags[tag][0]}, not {value}")
    tables = []
    if _DT_RELA in tags:
        _one(tags, _DT_RELAENT, fail)  # the loader reads it without looking whether it is there
        tables.append((_one(tags, _DT_RELA, fail), _one(tags, _DT_RELASZ, fail), tags.get(_DT_RELACOUNT, [0])[0]))
    if _DT_JMPREL in tags:
        tables.append((_one(tags, _DT_JMPREL, fail), _one(tags, _DT_PLTRELSZ, fail), 0))
    for address, size, relative in tables:
        if size % 24:
            fail(f"is corrupt: its relocation table of {size} bytes is no whole number of 24-byte entries")
        start = image.offset(address, size, "relocation table")
        for i in range(size // 24):
            target, info = image.read("QQ", start + 24 * i)
            kind, symbol = info & 0xFFFFFFFF, info >> 32
            if kind == _IRELATIVE.get(machine):
                fail("has an IFUNC resolver (an IRELATIVE relocation), which would run when it is loaded")
            if kind == _COPY.get(machine):
                fail(f"has a COPY relocation at {target:#x}, which would copy as many bytes as a symbol says")
            if i < relative and machine in _RELATIVE and kind not in _RELATIVE[machine]:
                fail(f"is corrupt: its relocation {i} of type {kind} lies among the first {relative} "
                     "(DT_RELACOUNT), which must be relative ones")
            if symbol >= symbols:
                fail(f"is corrupt: a relocation at {target:#x} names symbol {symbol}, past the {symbols} "
                     "its hash table counts")
            # R_*_NONE (type 0, which the linker may leave at address 0) writes nothing
            if kind and not any(begin <= target and target + 8 <= begin + memsz for begin, memsz in writable):
                fail(f"is corrupt: a relocation writes at {target:#x}, outside its writable loaded segments")


def _symbol_count(image: _Image, tags: dict[int, list[int]], fail) -> int:
    """How many entries of the dynamic symbol table a lookup can reach: DT_HASH's nchain, and the
    end of DT_GNU_HASH's last chain (every chain ends at or before the one of the highest bucket's);
    the larger where a library has both."""
    if _DT_HASH not in tags and _DT_GNU_HASH not in tags:
        fail("is corrupt: it has no symbol hash table (DT_HASH or DT_GNU_HASH)")
    counts = []
    if _DT_HASH in tags:
        counts.append(image.read("I", image.offset(_one(tags, _DT_HASH, fail) + 4, 4, "hash table"))[0])
    if _DT_GNU_HASH in tags:
        start = image.offset(_one(tags, _DT_GNU_HASH, fail), 16, "hash table")
        buckets, first, blooms, _ = image.read("IIII", start)
        buckets_at = start + 16 + 8 * blooms
        last = max((image.read("I", buckets_at + 4 * i)[0] for i in range(buckets)), default=0)
        chains = buckets_at + 4 * buckets
        while last >= first and not image.read("I", chains + 4 * (last - first))[0] & 1:  # an end has bit 0 set
            last += 1
        counts.append(max(first, last + 1))
    return max(counts)
