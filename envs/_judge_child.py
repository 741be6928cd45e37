"""The two halves of a Python test of the `code` reward, each run in a sandbox of its own
(envs/code_judge.py starts them and relays their messages; envs/code_verifier.py has the rules).

- `serve(program)`, in the program's sandbox: import the program as the module `solution`, then
  answer the judge's requests (fetch names, call, get or set an attribute, iterate, index, ...)
  on the objects of that module, one JSON line in, one JSON line out;
- `judge()`, in the judge's sandbox: run each test it is sent, with the names the test uses from
  `solution` bound to proxies (`Remote`) whose every use is a request to that test's program
  process, and report how each test ended on its own pipe, which no program's process can
  reach.

Values cross as plain data only: JSON with tags for what JSON lacks (`{"$": "tuple", "v": [...]}`,
dicts as lists of pairs, sets, bytes, complex, fractions, decimals, ints too long for decimal
text). Anything else the program returns stays in its process and crosses as a handle, a
`Remote` in the judge that compares equal only to itself; so every comparison a test makes is
the judge's own, on values the judge built. Each side reads its requests or answers on its
original stdin and writes them on its original stdout; the code's own stdin is then empty and
its prints go to stderr, so neither can disturb the protocol by accident.

This file is sent as code into the sandbox (with one line calling `serve` or `judge`): the
standard library only.
"""

import builtins
import json
import os
import sys

_MAX_LINE = 64 << 20  # bytes of one message (the caller's output cap is the real bound)
_BIG_INT_BITS = 13_000  # past ~4,000 decimal digits ints travel in hex (int_max_str_digits)


def _protocol_fds() -> tuple[int, int]:
    """The protocol's pipe: this process's original stdin and stdout. The code's own stdin is
    then an empty pipe, and its stdout its stderr."""
    fin, fout = os.dup(0), os.dup(1)
    r, w = os.pipe()
    os.close(w)
    os.dup2(r, 0)
    os.close(r)
    os.dup2(2, 1)
    return fin, fout


class _Lines:
    def __init__(self, fd: int) -> None:
        self.fd, self.buf, self.seen = fd, bytearray(), 0

    def read(self) -> bytes | None:
        """The next line without its newline; None at the end of the pipe."""
        while True:
            end = self.buf.find(b"\n", self.seen)
            if end >= 0:
                line = bytes(self.buf[:end])
                del self.buf[: end + 1]
                self.seen = 0
                return line
            self.seen = len(self.buf)
            chunk = os.read(self.fd, 1 << 16)
            if not chunk or len(self.buf) > _MAX_LINE:
                return None
            self.buf += chunk


def _write(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


# -- plain values ---------------------------------------------------------------------------------


def encode(x, handle):
    """`x` as JSON-able plain data; `handle(obj)` names (as {"$": "ref"}) what is not."""
    if x is None or x is True or x is False:
        return x
    if isinstance(x, int):
        x = int(x)
        return x if x.bit_length() < _BIG_INT_BITS else {"$": "int", "v": hex(x)}
    if isinstance(x, float):
        return float(x)
    if isinstance(x, str):
        return str(x)
    if isinstance(x, list):
        return [encode(v, handle) for v in x]
    if isinstance(x, dict):
        return {"$": "dict", "v": [[encode(k, handle), encode(v, handle)] for k, v in x.items()]}
    for kind in (tuple, set, frozenset):
        if isinstance(x, kind):
            return {"$": kind.__name__, "v": [encode(v, handle) for v in x]}
    if isinstance(x, (bytes, bytearray)):
        return {"$": type(x).__name__ if type(x) in (bytes, bytearray) else "bytes",
                "v": bytes(x).decode("latin-1")}  # fmt: skip
    if isinstance(x, complex):
        return {"$": "complex", "v": [x.real, x.imag]}
    fractions, decimal = sys.modules.get("fractions"), sys.modules.get("decimal")
    if fractions is not None and isinstance(x, fractions.Fraction):
        return {"$": "fraction", "v": [encode(x.numerator, None), encode(x.denominator, None)]}
    if decimal is not None and isinstance(x, decimal.Decimal):
        return {"$": "decimal", "v": str(x)}
    if handle is None:
        raise TypeError(f"cannot send a {type(x).__name__} (plain data only)")
    return {"$": "ref", "v": handle(x)}


def _fraction(v):
    from fractions import Fraction

    return Fraction(decode(v[0], None), decode(v[1], None))


def _decimal(v):
    from decimal import Decimal

    return Decimal(str(v))


_TAGS = {
    "tuple": lambda v, r: tuple(decode(i, r) for i in v),
    "set": lambda v, r: {decode(i, r) for i in v},
    "frozenset": lambda v, r: frozenset(decode(i, r) for i in v),
    "dict": lambda v, r: {decode(k, r): decode(i, r) for k, i in v},
    "bytes": lambda v, r: str(v).encode("latin-1"),
    "bytearray": lambda v, r: bytearray(str(v).encode("latin-1")),
    "complex": lambda v, r: complex(float(v[0]), float(v[1])),
    "int": lambda v, r: int(str(v), 16),
    "fraction": lambda v, r: _fraction(v),
    "decimal": lambda v, r: _decimal(v),
}


def decode(x, remote):
    """The value `encode` wrote; `remote(ref)` gives the object a handle names. Raises
    ValueError (or whatever a malformed value raises) on anything else."""
    if x is None or type(x) in (bool, int, float, str):
        return x
    if type(x) is list:
        return [decode(v, remote) for v in x]
    if type(x) is dict and set(x) == {"$", "v"}:
        tag = x["$"]
        if tag == "ref" and remote is not None and type(x["v"]) is int:
            return remote(x["v"])
        if tag in _TAGS:
            return _TAGS[tag](x["v"], remote)
    raise ValueError("not plain data")


def _builtin_name(e: BaseException) -> str:
    """The nearest built-in exception class of `e` (a test may catch ValueError, not MyError)."""
    for cls in type(e).__mro__:
        if getattr(builtins, cls.__name__, None) is cls:
            return cls.__name__
    return "Exception"


# -- the program's side -----------------------------------------------------------------------

_OPS = {
    "call": lambda o, m, d: o(*d(m["args"]), **{k: d(v) for k, v in m["kwargs"].items()}),
    "getattr": lambda o, m, d: getattr(o, m["name"]),
    "setattr": lambda o, m, d: setattr(o, m["name"], d(m["value"])),
    "iter": lambda o, m, d: iter(o),
    "next": lambda o, m, d: next(o),
    "len": lambda o, m, d: len(o),
    "getitem": lambda o, m, d: o[d(m["key"])],
    "setitem": lambda o, m, d: o.__setitem__(d(m["key"]), d(m["value"])),
    "contains": lambda o, m, d: d(m["key"]) in o,
    "bool": lambda o, m, d: bool(o),
    "repr": lambda o, m, d: repr(o),
    "str": lambda o, m, d: str(o),
}


def serve(program: str) -> None:
    """Import `program` as `solution`, then answer requests until stdin ends."""
    fin, fout = _protocol_fds()
    code = compile(program, "solution.py", "exec", dont_inherit=True)
    module = type(sys)("solution")
    sys.modules["solution"] = module
    exec(code, vars(module))
    objects: list = [module]  # a handle is an index here; the objects live as long as this
    refs: dict[int, int] = {id(module): 0}

    def handle(obj) -> int:
        if id(obj) not in refs:
            refs[id(obj)] = len(objects)
            objects.append(obj)
        return refs[id(obj)]

    def plain(value):
        return decode(value, objects.__getitem__)

    lines = _Lines(fin)
    while (line := lines.read()) is not None:
        try:
            m = json.loads(line)
            if m["op"] == "names":
                names = vars(module)
                out = [[n, encode(names[n], handle)] for n in m["names"] if n in names]
            else:
                out = encode(_OPS[m["op"]](objects[m["ref"]], m, plain), handle)
            reply: dict = {"ok": out}
        except Exception as e:
            reply = {"raise": [_builtin_name(e), _text(e)]}
        _write(fout, json.dumps(reply).encode() + b"\n")


def _text(e: BaseException) -> str:
    try:
        return str(e)[:2000]
    except Exception:
        return ""


# -- the judge's side ---------------------------------------------------------------------------


class _Ended(BaseException):
    """The program's process ended, or answered with something that is not plain data."""


class _Channel:
    """The judge's side of the protocol: requests out, the current program's answers in."""

    def __init__(self) -> None:
        self.fin, self.fout = _protocol_fds()
        self.lines = _Lines(self.fin)
        self.begin(0)

    def begin(self, test: int) -> None:
        """Test number `test`, against a fresh process of the program."""
        self.test = test
        self.remotes: dict[int, Remote] = {}
        self.ended = False  # its process ended before the test did
        self.broken = ""  # why an answer could not be read
        self.unsendable = ""  # what the test tried to send that is not plain data

    def remote(self, ref: int):
        if ref not in self.remotes:
            self.remotes[ref] = Remote(ref)
        return self.remotes[ref]

    def send(self, value):
        return encode(value, self._handle)

    def _handle(self, obj) -> int:
        if type(obj) is Remote:
            return obj._ref
        # a value of the test's own (a function, an instance of its class) stays here
        self.unsendable = self.unsendable or f"the test sends a {type(obj).__name__}"
        raise TypeError(f"cannot send a {type(obj).__name__} to the program (plain data only)")

    def _answer(self) -> bytes | None:
        """The current program's next line; None once its process has ended. The caller frames
        each line the program writes as `P<test> <line>` and its end as `E<test>`."""
        answer, end = b"P%d " % self.test, b"E%d" % self.test
        while (line := self.lines.read()) is not None:
            if line.startswith(answer):
                return line[len(answer) :]
            if line == end:
                break
            # a late line of an earlier test's program: not an answer to this test
        return None

    def ask(self, message: dict):
        if self.ended or self.broken:
            raise _Ended(self.broken or "the program's process ended")
        _write(self.fout, json.dumps(message).encode() + b"\n")
        line = self._answer()
        if line is None:
            self.ended = True
            raise _Ended("the program's process ended")
        try:
            reply = json.loads(line)
            if "ok" in reply:
                return decode(reply["ok"], self.remote)
            name, text = reply["raise"]
            kind = getattr(builtins, str(name), None)
        except Exception as e:  # RecursionError included: a reply nested too deep
            self.broken = f"the program's answer is not plain data ({e!r:.200})"
            raise _Ended(self.broken) from None
        if not (isinstance(kind, type) and issubclass(kind, Exception)):
            kind = RuntimeError
        raise kind(str(text))


_channel: _Channel | None = None


def _ask(op: str, ref: int, **fields):
    assert _channel is not None
    return _channel.ask({"op": op, "ref": ref, **fields})


def _send(value):
    assert _channel is not None
    return _channel.send(value)


class Remote:
    """An object of the program, used through requests; equal only to itself."""

    __slots__ = ("_ref",)

    def __init__(self, ref: int) -> None:
        object.__setattr__(self, "_ref", ref)

    def __call__(self, *args, **kwargs):
        kw = {str(k): _send(v) for k, v in kwargs.items()}
        return _ask("call", self._ref, args=[_send(a) for a in args], kwargs=kw)

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)  # protocols Python probes for stay this side
        return _ask("getattr", self._ref, name=name)

    def __setattr__(self, name: str, value) -> None:
        _ask("setattr", self._ref, name=name, value=_send(value))

    def __iter__(self):
        return _ask("iter", self._ref)

    def __next__(self):
        return _ask("next", self._ref)

    def __len__(self):
        return _ask("len", self._ref)

    def __getitem__(self, key):
        return _ask("getitem", self._ref, key=_send(key))

    def __setitem__(self, key, value) -> None:
        _ask("setitem", self._ref, key=_send(key), value=_send(value))

    def __contains__(self, key) -> bool:
        return _ask("contains", self._ref, key=_send(key)) is True

    def __bool__(self) -> bool:
        return _ask("bool", self._ref) is True

    def __repr__(self) -> str:
        text = _ask("repr", self._ref)
        return text if type(text) is str else "<object of the program>"

    def __str__(self) -> str:
        text = _ask("str", self._ref)
        return text if type(text) is str else "<object of the program>"


def _global_names(code) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, type(code)):
            names |= _global_names(const)
    return names


def judge() -> None:
    """Run each test the caller sends (`T<n> <JSON string>`) against its program's process and
    report each verdict (`V<JSON>`), until stdin ends."""
    global _channel
    _channel = channel = _Channel()
    while (line := channel.lines.read()) is not None:
        if line[:1] != b"T":
            continue  # a late line of a program whose test is over
        number, _, test = line[1:].partition(b" ")
        channel.begin(int(number))
        verdict = _run_test(json.loads(test), channel)
        _write(channel.fout, b"V" + json.dumps(verdict).encode() + b"\n")


def _run_test(test: str, channel: _Channel) -> dict:
    verdict: dict = {}
    try:
        code = compile(test, "<test>", "exec", dont_inherit=True)
        # the names the test may take from the program: never a builtin's (a program's own
        # `sorted` must not answer for the test's), never a dunder
        wanted = sorted(n for n in _global_names(code) - set(dir(builtins)) if n[:2] != "__")
        module = type(sys)("solution")
        for name, value in channel.ask({"op": "names", "names": wanted}):
            if name in wanted:  # only what was asked: never a builtin's name, whatever it sends
                setattr(module, name, value)
        sys.modules["solution"] = module
        scope = {"__name__": "__main__", "__builtins__": builtins}
        scope.update((k, v) for k, v in vars(module).items() if k[:2] != "__")
        exec(code, scope)
        verdict["pass"] = True
    except BaseException as e:
        verdict["error"] = f"{type(e).__name__}: {_text(e)}".split("\n", 1)[0]
    for key in ("ended", "broken", "unsendable"):
        if getattr(channel, key):
            verdict[key] = getattr(channel, key)
    return verdict
