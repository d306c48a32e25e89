"""Plain data across the sandbox's wall: the tagged JSON the program's values travel in.

The sandbox's harness runs this module's text (it uses the standard library only and no
``__future__`` import, so it can sit inside the harness) to encode each probe's value; the supervisor
decodes with :func:`decode_values`, which rebuilds only plain Python values (no object of the
program's, so no ``__eq__`` of its own). :mod:`rltk.rewards.programs.sandbox` reads the file's text, so
the sandbox needs nothing else of rltk.
"""

import json


def encode_value(value, depth=0):
    """``value`` as tagged JSON-ready data; ``TypeError`` for anything that is not plain data.

    Lists and scalars as JSON, ``{"tuple": [...]}``, ``{"set": [...]}``,
    ``{"frozenset": [...]}``, ``{"dict": [[k, v], ...]}``, ``{"bytes": hex}``, ``{"complex": [re, im]}``.
    Subclasses of these types are taken as their base type (a subclass's own ``__eq__`` is dropped).
    """
    if depth > 100:
        raise TypeError("value nested deeper than 100 levels")
    if value is None or value is True or value is False:
        return value
    if isinstance(value, int):
        return int.__index__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, complex):
        return {"complex": [complex.__getattribute__(value, "real"), complex.__getattribute__(value, "imag")]}
    if isinstance(value, (bytes, bytearray)):
        return {"bytes": bytes(value).hex()}
    if isinstance(value, list):
        return [encode_value(v, depth + 1) for v in list.__iter__(value)]
    if isinstance(value, tuple):
        return {"tuple": [encode_value(v, depth + 1) for v in tuple.__iter__(value)]}
    if isinstance(value, frozenset):
        return {"frozenset": [encode_value(v, depth + 1) for v in frozenset.__iter__(value)]}
    if isinstance(value, set):
        return {"set": [encode_value(v, depth + 1) for v in set.__iter__(value)]}
    if isinstance(value, dict):
        return {"dict": [[encode_value(k, depth + 1), encode_value(dict.__getitem__(value, k), depth + 1)]
                         for k in dict.__iter__(value)]}
    raise TypeError(f"a value of type {type(value).__name__} is not plain data")


def decode_values(payload):
    """The probes' values from the harness's payload, rebuilt as plain Python data (strict)."""
    data = json.loads(payload)
    if not isinstance(data, list):
        raise ValueError("probe values must be a JSON list")
    return [_decode(v) for v in data]


_CONTAINERS = {"tuple": tuple, "set": set, "frozenset": frozenset}


def _decode(data):
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, list):
        return [_decode(v) for v in data]
    if not isinstance(data, dict) or len(data) != 1:
        raise ValueError("not a tagged value")
    (tag, body), = data.items()
    if tag in _CONTAINERS and isinstance(body, list):
        return _CONTAINERS[tag](_decode(v) for v in body)
    if tag == "dict" and isinstance(body, list) and all(isinstance(p, list) and len(p) == 2 for p in body):
        return {_decode(k): _decode(v) for k, v in body}
    if tag == "bytes" and isinstance(body, str):
        return bytes.fromhex(body)
    if tag == "complex" and isinstance(body, list) and len(body) == 2 \
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in body):
        return complex(*body)
    raise ValueError(f"unknown tag {tag!r}")




