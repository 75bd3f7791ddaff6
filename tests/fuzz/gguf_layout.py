"""Byte offsets of a GGUF v2/v3 file's header fields, for tests and the fuzz suite that patch them."""

import struct

# Sizes of GGUF's fixed-width value types (8 is a string, 9 an array).
FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def gguf_layout(data):
    """Offsets into `data` of every header field (lengths and counts are u64).

    Returns {"kv": {key: {"key_len", "type", "value", "ty"}}, "tensors": {name: {"name",
    "name_len", "name_at", "n_dims", "dims", "type", "offset"}} (in file order), "tensor_count": 8,
    "kv_count": 16, "end_of_header": ...}.
    """
    assert data[:4] == b"GGUF" and struct.unpack_from("<I", data, 4)[0] in (2, 3)
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    pos = 24

    def skip_value(pos, ty):
        if ty in FIXED:
            return pos + FIXED[ty]
        if ty == 8:
            (n,) = struct.unpack_from("<Q", data, pos)
            return pos + 8 + n
        assert ty == 9
        et, n = struct.unpack_from("<IQ", data, pos)
        pos += 12
        if et in FIXED:
            return pos + n * FIXED[et]
        for _ in range(n):
            pos = skip_value(pos, et)
        return pos

    kv = {}
    for _ in range(n_kv):
        (klen,) = struct.unpack_from("<Q", data, pos)
        key = data[pos + 8 : pos + 8 + klen].decode()
        type_at = pos + 8 + klen
        (ty,) = struct.unpack_from("<I", data, type_at)
        kv[key] = {"key_len": pos, "type": type_at, "value": type_at + 4, "ty": ty}
        pos = skip_value(type_at + 4, ty)
    tensors = {}
    for _ in range(n_tensors):
        (nlen,) = struct.unpack_from("<Q", data, pos)
        name = data[pos + 8 : pos + 8 + nlen].decode()
        nd_at = pos + 8 + nlen
        (nd,) = struct.unpack_from("<I", data, nd_at)
        type_at = nd_at + 4 + 8 * nd
        tensors[name] = {
            "name": name,
            "name_len": pos,
            "name_at": pos + 8,
            "n_dims": nd_at,
            "dims": nd_at + 4,
            "type": type_at,
            "offset": type_at + 4,
        }
        pos = type_at + 12
    return {"kv": kv, "tensors": tensors, "tensor_count": 8, "kv_count": 16, "end_of_header": pos}


def patched(data, offset, fmt, value):
    """`data` with `value` packed as `fmt` at `offset`."""
    out = bytearray(data)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)
