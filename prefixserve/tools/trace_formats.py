"""Prompt logs and block-hash traces, read into the requests the estimator replays.

Every input ends up as a ``Workload``: a list of ``TraceRequest`` plus the rule that turns a
request's block identities into the block hashes of the simulated block size. Two families:

* **Token-derived** (``tokens``, ``text``, ``chat``): token ids, given or produced by the model's
  tokenizer and chat template, are chain-hashed by ``prefixserve.core`` itself (cache salt, LoRA
  id and images included, as in the engine), once, at the simulated block size. A record's
  ``mm_inputs`` (``[{"offset", "length", "hash"}]``) names the images whose placeholder tokens
  ``[offset, offset + length)`` the prompt holds: each hash enters the extra keys of every block
  its run overlaps (``core/request.py``), so the same image at the same place hits and another
  image misses from the block its run starts in.
* **Block-hash traces** (``mooncake``, ``bailian``, ``kvcache-tester``): one id per trace block.
  Ids are *chained* when an equal id means an equal block with an equal history (Mooncake,
  kv-cache-tester within a session); Bailian-style ids hash a block's own content only and are
  chained here (an exact trie: block ``i`` is identified by its id and the chained id of block
  ``i - 1``). kv-cache-tester ids are local to a session and are moved into a range of their own
  per session.

Block sizes: when the trace's blocks are larger than the simulated ones (Mooncake's 512-token
blocks replayed at 16), trace block ``i`` becomes ``k`` sub-blocks ``(i, 0 .. k - 1)``, encoded
as the int ``i * k + j``; when they are smaller (Bailian's 16-token blocks replayed at 64), a
simulated block is identified by the chained id of its last trace block. Only **full** simulated
blocks get a hash, as in the engine: the tokens after the last full block (the partial tail, or
tokens a trace gives no id for) are always computed and never cached.
"""

from __future__ import annotations

import gzip
import itertools
import json
import lzma
import os
import sys
from array import array
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, cast

import numpy as np

from prefixserve.core.request import MultiModalInput
from prefixserve.core.retention import (
    CACHE_CONTROL_PRIORITY,
    CACHE_CONTROL_TTLS,
    Retention,
    RetentionRange,
)

FORMATS = ("tokens", "text", "chat", "mooncake", "bailian", "kvcache-tester")
"""Input formats. ``text`` and ``chat`` are one reader: a line may hold either field."""

DEFAULT_TRACE_BLOCK_SIZES = {"mooncake": 512, "bailian": 16, "kvcache-tester": 64}
"""Block size of ``hash_ids`` when neither the record nor ``--trace-block-size`` gives one."""

MAX_BAD_LINE_EXAMPLES = 5

MAX_BREAKPOINTS = 4
"""``cache_control`` breakpoints a line may carry (as Anthropic's API allows)."""

ProgressCallback = Callable[[float], None]
"""Called now and then with the fraction of the input read so far."""


class TraceError(Exception):
    """The input cannot be read; the message names the file and, for a bad line, its number."""


class LineError(ValueError):
    """One line (or one request inside it) is not a valid record; the message says why."""


@dataclass(slots=True)
class TraceRequest:
    """One request as the replay sees it.

    ``ids`` are the request's block identities (see ``Workload.block_keys``), ``num_blocks`` the
    number of full simulated blocks that have a hash: those of the prompt, then those of the
    known output that decoding fills. ``num_decoded_tokens`` is the number of output tokens whose
    KV the engine computes: all known output tokens but the last (generating the last one ends
    the request, so it is never fed back); 0 when no output is known. ``num_output_tokens`` is
    the output's length as the record gives it (its tokens, or a Mooncake ``output_length``), the
    decode work of ``estimate --clients``; 0 when unknown. ``time`` is the arrival in
    seconds when the trace has one (Mooncake ``timestamp``), ``retention`` a token line's own
    ``retention`` field (the HTTP API's shape). ``lora_id`` is the
    record's LoRA id (token and text logs), and ``shared_ids`` then the block identities the
    request would have without it (what ``estimate`` compares to price splitting by adapter).
    """

    ids: Sequence[Hashable]
    num_blocks: int
    num_prompt_tokens: int
    num_decoded_tokens: int = 0
    time: float | None = None
    retention: Retention | None = None
    lora_id: int | str | None = None
    shared_ids: Sequence[Hashable] | None = None
    num_output_tokens: int = 0


@dataclass
class Workload:
    """Parsed requests in file order, and how their ids map to simulated block hashes."""

    path: str
    format: str
    block_size: int
    requests: list[TraceRequest]
    trace_block_size: int | None = None
    expansion: int = 1
    chained_here: bool = False
    bad_lines: int = 0
    bad_line_examples: list[str] = field(default_factory=list)

    def block_keys(self, request: TraceRequest) -> list[Hashable]:
        """The block hashes of the request's ``num_blocks`` full simulated blocks, in order.

        With ``expansion == 1`` the ids are the hashes; otherwise id ``i`` stands for the
        ``expansion`` sub-blocks ``i * expansion + j`` (ids are then non-negative ints)."""
        k = self.expansion
        if k == 1:
            return list(request.ids)
        keys: list[Hashable] = []
        extend = keys.extend
        for i in cast("Sequence[int]", request.ids):  # ints, as said above
            start = i * k
            extend(range(start, start + k))
        del keys[request.num_blocks:]
        return keys

    @property
    def num_prompt_tokens(self) -> int:
        return sum(r.num_prompt_tokens for r in self.requests)

    @property
    def num_prompt_blocks(self) -> int:
        """Full prompt blocks with a hash, over all requests (the blocks one replay looks up)."""
        bs = self.block_size
        return sum(min(r.num_blocks, r.num_prompt_tokens // bs) for r in self.requests)


@dataclass(frozen=True)
class ReadOptions:
    """How to read an input. ``format`` None detects it from the first record;
    ``trace_block_size`` None takes the trace's own (record field or format default);
    ``chain`` None chains only the formats whose ids are per-block content hashes."""

    format: str | None = None
    block_size: int = 16
    trace_block_size: int | None = None
    chain: bool | None = None
    tokenizer: str | None = None
    skip_bad_lines: bool = False


# ----------------------------------------------------------------------------- opening


def open_binary(path: str) -> tuple[IO[bytes], IO[bytes] | None, int]:
    """Opens ``path`` (``-`` for stdin), decompressing xz or gzip found by their magic bytes.

    Returns the stream of lines, the raw file for progress (None for stdin) and its size."""
    if path == "-":
        return sys.stdin.buffer, None, 0
    try:
        raw = open(path, "rb")  # noqa: SIM115 - closed by the caller
    except OSError as exc:
        raise TraceError(f"{path}: cannot open: {exc.strerror or exc}") from None
    magic = raw.read(6)
    raw.seek(0)
    size = os.fstat(raw.fileno()).st_size
    if magic.startswith(b"\xfd7zXZ\x00"):
        return lzma.open(raw), raw, size
    if magic.startswith(b"\x1f\x8b"):
        # a binary file object, though typeshed's GzipFile does not derive from IO[bytes]
        return cast(IO[bytes], gzip.open(raw)), raw, size
    return raw, raw, size


def iter_records(stream: IO[bytes]) -> Iterator[tuple[int, dict[str, Any] | LineError]]:
    """``(line number, JSON object or the reason it is not one)`` for each non-blank line."""
    for number, line in enumerate(stream, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except UnicodeDecodeError:
            yield number, LineError("not UTF-8 text")
            continue
        except ValueError as exc:
            yield number, LineError(f"not valid JSON ({exc})")
            continue
        if not isinstance(record, dict):
            yield number, LineError(f"expected a JSON object, got {type(record).__name__}")
            continue
        yield number, record


def detect_format(record: dict[str, Any]) -> str | None:
    """The format a record belongs to, from the fields it has; None when none matches."""
    if isinstance(record.get("requests"), list):
        return "kvcache-tester"
    if "hash_ids" in record:
        if any(key in record for key in ("chat_id", "parent_chat_id", "turn")):
            return "bailian"
        return "mooncake"
    if "token_ids" in record:
        return "tokens"
    if "messages" in record:
        return "chat"
    if "prompt" in record:
        return "text"
    return None


# ----------------------------------------------------------------------------- validation


def _int_field(record: dict[str, Any], key: str, *, minimum: int, default: int | None = None
               ) -> int:
    value = record.get(key, default)
    if value is None:
        raise LineError(f"missing {key!r}")
    if type(value) is not int:
        raise LineError(f"{key!r} must be an integer, got {value!r}")
    if value < minimum:
        raise LineError(f"{key!r} must be at least {minimum}, got {value}")
    return value


IntList = array | list[int]
"""Integers as an ``array('q')`` when they all fit in 64 bits (8 bytes each), else a list."""


def _int_list(record: dict[str, Any], key: str, *, allow_empty: bool) -> IntList:
    """The list of integers in ``record[key]``, as an ``array('q')`` when they fit."""
    values = record.get(key)
    if not isinstance(values, list):
        raise LineError(f"{key!r} must be a list of integers")
    if not values and not allow_empty:
        raise LineError(f"{key!r} is empty")
    try:
        return array("q", values)  # checks, in C, that every value is an integer
    except (TypeError, OverflowError):
        pass
    for position, value in enumerate(values):
        if type(value) is not int:
            raise LineError(f"{key}[{position}] is {value!r}, not an integer")
    return values


def _int_view(values: IntList) -> np.ndarray:
    """``values`` as an int64 numpy array (no copy for an array) for vector operations."""
    if isinstance(values, array):
        return np.frombuffer(values, dtype=np.int64) if values else np.zeros(0, np.int64)
    return np.array(values, dtype=object)


def _check_non_negative(values: IntList, key: str) -> None:
    if len(values) and (lowest := int(_int_view(values).min())) < 0:
        raise LineError(f"{key!r} holds a negative value ({lowest})")


def _largest(values: IntList) -> int:
    return int(_int_view(values).max()) if len(values) else -1


def _cache_salt(record: dict[str, Any]) -> str | None:
    salt = record.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise LineError(f"'cache_salt' must be a string, got {salt!r}")
    return salt


def _lora_id(record: dict[str, Any]) -> int | str | None:
    lora = record.get("lora_id")
    if lora is not None and (type(lora) is not int and not isinstance(lora, str)):
        raise LineError(f"'lora_id' must be an integer or a string, got {lora!r}")
    return lora


def _mm_inputs(record: dict[str, Any], num_prompt_tokens: int) -> tuple[MultiModalInput, ...]:
    """A line's ``mm_inputs``: ``[{"offset": int >= 0, "length": int >= 1, "hash": str}]``,
    each run inside the prompt's ``num_prompt_tokens`` tokens and apart from the others."""
    value = record.get("mm_inputs")
    if value is None:
        return ()
    if not isinstance(value, list):
        raise LineError("'mm_inputs' must be a list of {\"offset\", \"length\", \"hash\"} "
                        "objects")
    inputs: list[MultiModalInput] = []
    for position, entry in enumerate(value):
        where = f"mm_inputs[{position}]"
        if not isinstance(entry, dict):
            raise LineError(f"{where} is {entry!r}, not an object")
        try:
            offset = _int_field(entry, "offset", minimum=0)
            length = _int_field(entry, "length", minimum=1)
        except LineError as exc:
            raise LineError(f"{where}: {exc}") from None
        content_hash = entry.get("hash")
        if not isinstance(content_hash, str) or not content_hash:
            raise LineError(f"{where}: 'hash' must be a non-empty string, got {content_hash!r}")
        if offset + length > num_prompt_tokens:
            raise LineError(f"{where} covers tokens {offset}..{offset + length - 1}, past the "
                            f"end of the prompt's {num_prompt_tokens} tokens")
        inputs.append(MultiModalInput(offset, length, content_hash))
    runs = sorted(inputs)
    for before, after in itertools.pairwise(runs):
        if after.offset < before.offset + before.length:
            raise LineError(f"'mm_inputs' overlap: the run at token {after.offset} starts "
                            f"inside the run at token {before.offset}")
    return tuple(inputs)


def _refuse_mm_inputs(record: dict[str, Any]) -> None:
    """A block-hash record's ids already name its images: ``mm_inputs`` there is a bad line."""
    if record.get("mm_inputs") is not None:
        raise LineError("'mm_inputs' needs a prompt of token ids, text or messages: a block-hash "
                        "trace's ids already name each block's content, images included")


# ----------------------------------------------------------------------------- token-derived


class _TokenHasher:
    """Chain-hashes token ids with ``prefixserve.core`` (salt and LoRA id as extra keys)."""

    def __init__(self, block_size: int) -> None:
        from prefixserve.core import KVCacheManager

        self.block_size = block_size
        self._manager = KVCacheManager(1, block_size)
        self._count = 0

    def request(self, prompt: Sequence[int], output: Sequence[int], salt: str | None,
                lora: int | str | None, mm: Sequence[MultiModalInput] = ()) -> TraceRequest:
        """The request for ``prompt`` followed by the decoded part of ``output``, with the
        images ``mm`` in the prompt."""
        from prefixserve.core import CacheRequest
        from prefixserve.core.hashing import hash_value_of

        decoded = list(output[:-1])
        self._count += 1
        tokens = list(prompt) + decoded

        def chain_of(lora_id: int | str | None) -> list[Hashable]:
            cache_request = CacheRequest(f"h{self._count}", tokens, cache_salt=salt,
                                         lora_id=lora_id, mm_inputs=mm)
            chain = self._manager.block_hashes(cache_request)
            self._manager.free_block_hashes(cache_request)
            return [hash_value_of(block_hash) for block_hash in chain]

        ids = chain_of(lora)
        shared = chain_of(None) if lora is not None else None
        return TraceRequest(ids, len(ids), len(prompt), len(decoded), lora_id=lora,
                            shared_ids=shared, num_output_tokens=len(output))


class _TokenReader:
    """``{"token_ids": [...], "output_token_ids"?, "cache_salt"?, "lora_id"?, "mm_inputs"?}``."""

    def __init__(self, options: ReadOptions) -> None:
        self.hasher = _TokenHasher(options.block_size)

    def parse(self, record: dict[str, Any]) -> list[TraceRequest]:
        prompt = _int_list(record, "token_ids", allow_empty=False)
        _check_non_negative(prompt, "token_ids")
        output: IntList = []
        if record.get("output_token_ids") is not None:
            output = _int_list(record, "output_token_ids", allow_empty=True)
            _check_non_negative(output, "output_token_ids")
        request = self.hasher.request(prompt, output, _cache_salt(record), _lora_id(record),
                                      _mm_inputs(record, len(prompt)))
        request.retention = _retention(record)
        return [request]


def _retention(record: dict[str, Any]) -> Retention | None:
    """A line's ``retention`` (``{"priority", "duration"}`` or ``{"ranges": [{"start", "end",
    "priority", "duration"}]}``, durations in seconds, None: no expiry) and its
    ``cache_control`` breakpoints (:func:`_breakpoints`), together."""
    ranges = _retention_ranges(record.get("retention")) + _breakpoints(record.get("cache_control"))
    return Retention(ranges) if ranges else None


def _retention_ranges(value: Any) -> tuple[RetentionRange, ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise LineError("'retention' must be an object")
    try:
        if "ranges" in value:
            return tuple(RetentionRange(int(r.get("start", 0)), r.get("end"),
                                        int(r["priority"]), r.get("duration"))
                         for r in value["ranges"])
        return Retention.whole_prompt(int(value["priority"]), value.get("duration")).ranges
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise LineError(f"bad 'retention': {exc}") from None


def _breakpoints(value: Any) -> tuple[RetentionRange, ...]:
    """``cache_control``: one breakpoint or a list of at most four, each ``{"tokens": N,
    "ttl": "5m" | "1h" | seconds}`` (``ttl`` "5m" when absent): the first ``N`` prompt tokens
    are kept at ``CACHE_CONTROL_PRIORITY`` for the TTL, refreshed on every hit, as the
    server's Messages API keeps a breakpoint's prefix."""
    if value is None:
        return ()
    points = value if isinstance(value, list) else [value]
    if len(points) > MAX_BREAKPOINTS:
        raise LineError(f"'cache_control' has {len(points)} breakpoints, at most "
                        f"{MAX_BREAKPOINTS} are allowed")
    out = []
    for point in points:
        if not isinstance(point, dict) or isinstance(point.get("tokens"), bool) or \
                not isinstance(point.get("tokens"), int) or point["tokens"] < 1:
            raise LineError("bad 'cache_control': each breakpoint is {\"tokens\": N, "
                            "\"ttl\": \"5m\" | \"1h\" | seconds} with N >= 1")
        ttl = point.get("ttl", "5m")
        seconds = CACHE_CONTROL_TTLS.get(ttl) if isinstance(ttl, str) else ttl
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds <= 0:
            raise LineError(f"bad 'cache_control': ttl {ttl!r} is not \"5m\", \"1h\" or a "
                            "positive number of seconds")
        out.append(RetentionRange(0, point["tokens"], CACHE_CONTROL_PRIORITY, float(seconds)))
    return tuple(out)


class _TextReader:
    """``{"prompt": str}`` or ``{"messages": [...]}`` (OpenAI chat), optional ``"response"``,
    ``"cache_salt"``, ``"lora_id"``, ``"mm_inputs"`` (offsets in the tokenised prompt);
    tokenised with the model's tokenizer and chat template."""

    def __init__(self, options: ReadOptions) -> None:
        self.hasher = _TokenHasher(options.block_size)
        self.tokenizer_name = options.tokenizer
        self._tokenizer: Any = None

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from prefixserve.model.text.tokenizer import load_tokenizer

            try:
                self._tokenizer = load_tokenizer(self.tokenizer_name)
            except (OSError, ValueError) as exc:
                name = self.tokenizer_name or "the default model"
                raise TraceError(f"cannot load the tokenizer of {name}: {exc}") from None
        return self._tokenizer

    def _prompt_ids(self, record: dict[str, Any]) -> list[int]:
        if "messages" in record:
            messages = record["messages"]
            if not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) for m in messages):
                raise LineError("'messages' must be a non-empty list of message objects")
            try:
                return list(self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True))
            except (ValueError, TypeError, KeyError) as exc:
                raise LineError(f"chat template failed: {exc}") from None
        prompt = record.get("prompt")
        if not isinstance(prompt, str):
            raise LineError("'prompt' must be a string")
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def _output_ids(self, record: dict[str, Any]) -> list[int]:
        response = record.get("response")
        if response is None:
            return []
        if isinstance(response, dict):
            response = response.get("content")
        if not isinstance(response, str):
            raise LineError("'response' must be a string or a message with string content")
        ids = self.tokenizer.encode(response, add_special_tokens=False)
        eos = self.tokenizer.eos_token_ids
        return ids + [eos[0]] if eos else ids

    def parse(self, record: dict[str, Any]) -> list[TraceRequest]:
        prompt = self._prompt_ids(record)
        if not prompt:
            raise LineError("the prompt tokenises to nothing")
        request = self.hasher.request(prompt, self._output_ids(record), _cache_salt(record),
                                      _lora_id(record), _mm_inputs(record, len(prompt)))
        request.retention = _retention(record)
        return [request]


# ----------------------------------------------------------------------------- hash traces


class _BlockIds:
    """Turns trace ids into the ids a ``TraceRequest`` holds, at the simulated block size.

    ``add(ids, input_length, namespace)`` takes the ids of one request's trace blocks (namespace:
    an int separating id spaces, e.g. one per kv-cache-tester session)."""

    def __init__(self, block_size: int, chain: bool) -> None:
        self.block_size = block_size
        self.chain = chain
        self.trace_block_size: int | None = None
        self._trie: dict[tuple[int, int], int] = {}
        self._space_base: dict[int, int] = {}
        self._next_base = 0

    def set_trace_block_size(self, size: int) -> None:
        """Fixes the trace's block size on first call; later calls must agree."""
        if self.trace_block_size is None:
            bs = self.block_size
            if size % bs and bs % size:
                raise TraceError(f"the trace's blocks have {size} tokens and --block-size is "
                                 f"{bs}: one must be a multiple of the other")
            self.trace_block_size = size
        elif size != self.trace_block_size:
            raise LineError(f"block size {size} differs from the trace's {self.trace_block_size}")

    @property
    def expansion(self) -> int:
        """Simulated blocks per trace block (1 when trace blocks are not larger)."""
        tbs = self.trace_block_size or self.block_size
        return max(1, tbs // self.block_size)

    def reserve_space(self, namespace: int, max_id: int) -> None:
        """Gives ``namespace`` its own id range ``[base, base + max_id]`` (unchained ids only)."""
        self._space_base[namespace] = self._next_base
        self._next_base += max_id + 1

    def _chained(self, ids: IntList, namespace: int) -> list[int]:
        trie = self._trie
        parent = -1 - namespace
        out = []
        for block_id in ids:
            key = (parent, block_id)
            node = trie.get(key)
            if node is None:
                node = trie[key] = len(trie)
            out.append(node)
            parent = node
        return out

    def add(self, ids: IntList, input_length: int, namespace: int = 0) -> TraceRequest:
        tbs = self.trace_block_size
        assert tbs is not None
        if len(ids) > -(-input_length // tbs):
            raise LineError(f"{len(ids)} hash_ids for input_length {input_length}: at most "
                            f"ceil({input_length} / {tbs}) = {-(-input_length // tbs)}")
        if self.chain:
            ids = self._chained(ids, namespace)
        else:
            _check_non_negative(ids, "hash_ids")
            base = self._space_base.get(namespace, 0)
            if base and isinstance(ids, array):
                ids = array("q", (_int_view(ids) + base).tobytes())
            elif base:
                ids = [base + i for i in ids]
        bs = self.block_size
        full = input_length // bs
        if tbs >= bs:
            k = tbs // bs
            num_blocks = min(len(ids) * k, full)
            ids = ids[: -(-num_blocks // k)]
        else:
            m = bs // tbs
            num_blocks = min(len(ids) // m, full)
            ids = ids[m - 1: num_blocks * m: m]
        return TraceRequest(_compact(ids), num_blocks, input_length)


def _compact(ids: IntList) -> IntList:
    """``ids`` as an ``array('q')`` (8 bytes an id) when they fit, else as the list."""
    if isinstance(ids, array):
        return ids
    try:
        return array("q", ids)
    except OverflowError:
        return ids


class _MooncakeReader:
    """``{"hash_ids": [...], "input_length": n, "output_length"?, "timestamp"?,
    "block_size"?}``: chained ids of ``block_size``-token blocks (default 512). Bailian
    records (``chat_id``, ``turn``, 16-token per-block content hashes) use the same fields."""

    def __init__(self, options: ReadOptions, fmt: str) -> None:
        chain = options.chain if options.chain is not None else fmt == "bailian"
        self.blocks = _BlockIds(options.block_size, chain)
        self.default_block_size = DEFAULT_TRACE_BLOCK_SIZES[fmt]
        self.forced_block_size = options.trace_block_size

    def _trace_block_size(self, record: dict[str, Any]) -> int:
        if self.forced_block_size is not None:
            return self.forced_block_size
        if record.get("block_size") is not None:
            return _int_field(record, "block_size", minimum=1)
        return self.default_block_size

    def parse(self, record: dict[str, Any]) -> list[TraceRequest]:
        if "hash_ids" not in record:
            raise LineError("no 'hash_ids' field")
        _refuse_mm_inputs(record)
        ids = _int_list(record, "hash_ids", allow_empty=True)
        input_length = _int_field(record, "input_length", minimum=1)
        output_length = _int_field(record, "output_length", minimum=0, default=0)
        self.blocks.set_trace_block_size(self._trace_block_size(record))
        request = self.blocks.add(ids, input_length)
        request.num_output_tokens = output_length
        if isinstance(record.get("timestamp"), int | float):
            request.time = record["timestamp"] / 1000.0
        return [request]


class _KVCacheTesterReader:
    """One session a line: ``{"id", "block_size": 64, "requests": [...]}``; a request is
    ``{"in", "out", "hash_ids", ...}``, a sub-agent an entry with its own ``requests`` (replayed
    where it appears). Ids are local to the session: each session gets its own id range."""

    def __init__(self, options: ReadOptions) -> None:
        self.blocks = _BlockIds(options.block_size, bool(options.chain))
        self.forced_block_size = options.trace_block_size
        self._sessions = 0

    def _flatten(self, entries: list[Any], where: str) -> Iterator[tuple[str, dict[str, Any]]]:
        for position, entry in enumerate(entries):
            here = f"{where}[{position}]"
            if not isinstance(entry, dict):
                raise LineError(f"{here} is not an object")
            if "requests" in entry:
                if not isinstance(entry["requests"], list):
                    raise LineError(f"{here}.requests is not a list")
                yield from self._flatten(entry["requests"], f"{here}.requests")
            else:
                yield here, entry

    def parse(self, record: dict[str, Any]) -> list[TraceRequest]:
        if not isinstance(record.get("requests"), list):
            raise LineError("no 'requests' list (expected one kv-cache-tester session a line)")
        if self.forced_block_size is not None:
            self.blocks.set_trace_block_size(self.forced_block_size)
        else:
            self.blocks.set_trace_block_size(
                _int_field(record, "block_size", minimum=1,
                           default=DEFAULT_TRACE_BLOCK_SIZES["kvcache-tester"]))
        parsed: list[tuple[IntList, int, int]] = []
        max_id = -1
        for where, entry in self._flatten(record["requests"], "requests"):
            try:
                _refuse_mm_inputs(entry)
                ids = _int_list(entry, "hash_ids", allow_empty=True)
                input_length = _int_field(entry, "in", minimum=1)
                output_length = _int_field(entry, "out", minimum=0, default=0)
            except LineError as exc:
                raise LineError(f"{where}: {exc}") from None
            max_id = max(max_id, _largest(ids))
            parsed.append((ids, input_length, output_length))
        self._sessions += 1
        namespace = self._sessions
        if not self.blocks.chain:
            self.blocks.reserve_space(namespace, max_id)
        requests = []
        for position, (ids, input_length, output_length) in enumerate(parsed):
            try:
                requests.append(self.blocks.add(ids, input_length, namespace))
            except LineError as exc:
                raise LineError(f"request {position}: {exc}") from None
            requests[-1].num_output_tokens = output_length
        return requests


# ----------------------------------------------------------------------------- driver


def _make_reader(fmt: str, options: ReadOptions) -> Any:
    if fmt == "tokens":
        return _TokenReader(options)
    if fmt in ("text", "chat"):
        return _TextReader(options)
    if fmt in ("mooncake", "bailian"):
        return _MooncakeReader(options, fmt)
    return _KVCacheTesterReader(options)


class _BadLines:
    """Counts bad lines, or raises on the first one when they are not to be skipped."""

    def __init__(self, path: str, skip: bool) -> None:
        self.path = path
        self.skip = skip
        self.count = 0
        self.examples: list[str] = []

    def add(self, number: int, error: LineError) -> None:
        message = f"{self.path}:{number}: {error}"
        if not self.skip:
            raise TraceError(message + " (use --skip-bad-lines to skip such lines)")
        self.count += 1
        if len(self.examples) < MAX_BAD_LINE_EXAMPLES:
            self.examples.append(message)


def read_workload(path: str, options: ReadOptions,
                  progress: ProgressCallback | None = None) -> Workload:
    """Reads every record of ``path`` into a ``Workload`` (requests in file order).

    Raises ``TraceError`` for an unreadable file, an undetectable format, a bad line (unless
    ``options.skip_bad_lines``, which counts it instead) or an input with no request."""
    if options.format is not None and options.format not in FORMATS:
        raise TraceError(f"unknown format {options.format!r}; choose one of {', '.join(FORMATS)}")
    stream, raw, size = open_binary(path)
    bad = _BadLines(path, options.skip_bad_lines)
    fmt = options.format
    reader: Any = None
    requests: list[TraceRequest] = []
    try:
        for count, (number, record) in enumerate(iter_records(stream)):
            if progress is not None and raw is not None and count % 256 == 0:
                progress(raw.tell() / size if size else 1.0)
            if isinstance(record, LineError):
                bad.add(number, record)
                continue
            if reader is None:
                fmt = fmt or detect_format(record)
                if fmt is None:
                    bad.add(number, LineError(
                        "cannot tell the format: expected one of the fields token_ids, prompt, "
                        "messages, hash_ids or requests (or pass --format)"))
                    continue
                reader = _make_reader(fmt, options)
            try:
                requests.extend(reader.parse(record))
            except LineError as exc:
                bad.add(number, exc)
    except (OSError, EOFError, lzma.LZMAError) as exc:
        raise TraceError(f"{path}: cannot read: {exc}") from None
    finally:
        stream.close()
        if raw is not None:
            raw.close()
    if not requests:
        raise TraceError(f"{path}: no request to replay")
    assert fmt is not None
    blocks = getattr(reader, "blocks", None)
    return Workload(
        path=path,
        format=fmt,
        block_size=options.block_size,
        requests=requests,
        trace_block_size=blocks.trace_block_size if blocks else None,
        expansion=blocks.expansion if blocks else 1,
        chained_here=bool(blocks and blocks.chain),
        bad_lines=bad.count,
        bad_line_examples=bad.examples,
    )
