#!/usr/bin/env python3
"""qcr.py -- a coding agent in one file, driven by an editor over the Agent Client Protocol.

qcr reads and edits files, searches, runs shell commands and keeps a plan, using any
OpenAI-compatible model server (a hosted API, or Ollama / llama.cpp / vLLM / LM Studio on
your own machine). An editor such as Zed starts it as a child process and speaks ACP v1 to
it: JSON-RPC 2.0, one JSON object per line, over stdin and stdout.

Run it:
    python3 qcr.py --acp            # serve ACP on stdin/stdout (what an editor runs)
    python3 qcr.py --selftest       # prove it works: no model, no network needed
    python3 qcr.py --help

Reading guide -- the file reads top to bottom as a lesson in the protocol
(`grep -n '^# [0-9]' qcr.py` prints the contents):
    0. Header       constants: protocol version, JSON-RPC error codes, limits
    1. Wire         JSON-RPC 2.0 over newline-delimited JSON: Connection, RpcError
    2. ACP          the Agent class: one handler per ACP method, session/update builders
    3. Sessions     Session records and SessionStore (one JSON file per session)
    4. Providers    the OpenAI-compatible streaming client, SSE parsing, ProviderError
    5. Tools        the tool registry and the tools: files, search, shell, planning
    6. Agent loop   run_turn(): model -> tool calls -> permission -> results -> model ...
    7. MCP          the client for MCP servers (stdio, streamable HTTP, SSE) and plugins
    8. Config       Config and load_config(): file, environment, precedence
    9. Client side  headless -p, --client, the self-test and its scripted model server
   10. CLI          main()

Files qcr writes (all under ~/.qcr/):
    sessions/<sessionId>.json   each session, rewritten atomically after every step
    qcr.log                     diagnostics (stdout is reserved for protocol frames)

Security: qcr runs shell commands and changes files when the model asks. In the
"default" mode every change and every command needs the user's approval first;
"auto-edit" approves file changes but still asks before commands; "plan" refuses both.
One policy decides every call, from the effects each tool declares (section 5, "The
permission policy"). qcr itself executes only: bash for approved Shell commands, approved or
user-configured MCP servers, `git ls-files` with every program-running setting overridden,
and, for Grep, ripgrep (`rg --no-config`) when installed or else itself (`--search-worker`).
"""
from __future__ import annotations

# =============================================================================================
# 0. Header: imports, the protocol's constants, limits
# =============================================================================================

import asyncio
import json
import os
import re
import stat
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

__version__ = "0.1.0"

PROTOCOL_VERSION = 1               # ACP major version; the only one qcr speaks

# JSON-RPC 2.0 error codes, and the two that ACP adds.
PARSE_ERROR = -32700               # the line was not JSON
INVALID_REQUEST = -32600           # JSON, but not a request/notification/response object
METHOD_NOT_FOUND = -32601          # no such method
INVALID_PARAMS = -32602            # params missing or of the wrong type
INTERNAL_ERROR = -32603            # a bug in qcr: the traceback goes to stderr
REQUEST_CANCELLED = -32800         # the request was abandoned (shutdown)
AUTH_REQUIRED = -32000             # ACP: the user must sign in first
RESOURCE_NOT_FOUND = -32002        # ACP: e.g. an unknown session id

MAX_FRAME_BYTES = 128 * 1024 * 1024    # longest accepted input line, bytes
STREAM_BATCH = 256                     # streamed events held for the loop, at most
SHUTDOWN_GRACE = 1.5                   # seconds a running turn gets to wind down at EOF
SESSION_ID_RE = re.compile(r"acp-[0-9a-f]{16}-[0-9a-f]{16}")

MODES = [   # the session modes, in the order the editor lists them
    {"id": "default", "name": "Default",
     "description": "Ask before changing files or running commands"},
    {"id": "plan", "name": "Plan",
     "description": "Read-only: explore and plan; files and commands are off limits"},
    {"id": "auto-edit", "name": "Auto-edit",
     "description": "Change files without asking; still ask before running commands"},
    {"id": "yolo", "name": "YOLO",
     "description": "Run everything without asking: changes, commands, other folders"},
]
MODE_IDS = [m["id"] for m in MODES]
NO_MODEL = "(none)"        # the model selector's only choice when no model is configured


def log(message: str, *, error: bool = False) -> None:
    """Write a diagnostic line to ~/.qcr/qcr.log; errors (bugs) also go to stderr.

    In --acp mode stdout carries protocol frames only, and some clients show every
    stderr line to the user as an error, so routine diagnostics go to the file alone.
    """
    line = time.strftime("%Y-%m-%d %H:%M:%S ") + message.rstrip() + "\n"
    try:
        home = private_dir(os.path.join(os.path.expanduser("~"), ".qcr"))
        with open(os.open(os.path.join(home, "qcr.log"), os.O_WRONLY | os.O_APPEND |
                          os.O_CREAT, 0o600), "a", encoding="utf-8") as f:
            f.write(line)
    except OSError:
        pass
    if error:
        sys.stderr.write(line)
        sys.stderr.flush()


def private_dir(path: str) -> str:
    """A folder of qcr's own (~/.qcr, its sessions): made readable by the user alone."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    if stat.S_IMODE(os.stat(path).st_mode) & 0o077:
        os.chmod(path, 0o700)
    return path


def write_private(path: str, text: str) -> None:
    """Replace a file atomically, readable by the user alone: a temporary file, fsync,
    rename. Nothing is left behind when the disk is full or the write fails."""
    temporary = f"{path}.{os.getpid()}.tmp"
    try:
        with open(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w",
                  encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


CHILD_GROUPS: set = set()      # process groups qcr started and has not stopped yet


async def start_process(*argv: str, **options: Any) -> Any:
    """asyncio.create_subprocess_exec, in its own process group, safe to cancel.

    A cancel (session/cancel, SIGTERM) can land while the child is being started: the
    program exists but the caller never gets its handle to stop it. The start is shielded,
    and a child started for a caller that has gone is killed with its whole group. Every
    group is kept in CHILD_GROUPS until stop_group(), so that however qcr ends -- its own
    loop crashing included -- stop_children() leaves nothing it started behind.
    """
    starting = asyncio.ensure_future(asyncio.create_subprocess_exec(
        *argv, start_new_session=True, **options))
    try:
        proc = await asyncio.shield(starting)
        CHILD_GROUPS.add(proc.pid)
        return proc
    except asyncio.CancelledError:
        try:
            proc = await starting
            stop_group(proc.pid)
            await proc.wait()
        except (OSError, asyncio.CancelledError):
            pass
        raise


def stop_group(pid: int) -> None:
    """Kill a process group qcr started: the program and everything it started."""
    import signal
    CHILD_GROUPS.discard(pid)
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


def stop_children() -> None:
    for pid in list(CHILD_GROUPS):
        stop_group(pid)


# =============================================================================================
# 1. Wire: JSON-RPC 2.0 over newline-delimited JSON
# =============================================================================================
#
# Every message is one JSON object on one line. A *request* has an id and expects exactly one
# *response* carrying the same id (echoed with its JSON type: Zed sends UUID strings, other
# clients integers); a *notification* has no id and gets no answer. Both peers send requests:
# the client asks the agent to run a prompt, the agent asks the client for permission while
# that prompt runs. So the read loop never waits on a handler: each request runs as its own
# task, and our own requests wait on futures that the read loop resolves by id.
#
#   -> {"jsonrpc":"2.0","id":"7f3a","method":"session/cancel"...}      client request
#   <- {"jsonrpc":"2.0","id":"7f3a","result":{}}                          our response
#   <- {"jsonrpc":"2.0","id":0,"method":"session/request_permission",...} our request

class RpcError(Exception):
    """A JSON-RPC error response: code, message and optional data."""

    def __init__(self, code: int, message: str, data: Any = None):
        super().__init__(message)
        self.code, self.message, self.data = code, message, data

    def to_dict(self) -> dict:
        error = {"code": self.code, "message": self.message}
        if self.data is not None:
            error["data"] = self.data
        return error

    @classmethod
    def parse_error(cls, detail: str) -> RpcError:
        return cls(PARSE_ERROR, "Parse error: " + detail)

    @classmethod
    def invalid_request(cls, detail: str) -> RpcError:
        return cls(INVALID_REQUEST, "Invalid request: " + detail)

    @classmethod
    def method_not_found(cls, method: str) -> RpcError:
        return cls(METHOD_NOT_FOUND, "Method not found: " + method, {"method": method})

    @classmethod
    def invalid_params(cls, field_name: str, why: str) -> RpcError:
        return cls(INVALID_PARAMS, f"Invalid params: {field_name} {why}", {"field": field_name})

    @classmethod
    def internal_error(cls, detail: str) -> RpcError:
        return cls(INTERNAL_ERROR, "Internal error: " + detail)

    @classmethod
    def resource_not_found(cls, what: str, **data) -> RpcError:
        return cls(RESOURCE_NOT_FOUND, "Resource not found: " + what, data or None)


class NumberTooLarge(ValueError):
    """A JSON number beyond a double (1e999): it would come back out as Infinity."""


class TooDeep(ValueError):
    """JSON nested deeper than Python's parser goes: valid, but not taken."""


def top_level(text: str) -> dict:
    """The plain values (id, method) of a JSON object too deep to parse, found by a scan
    that skips everything below the top level -- so that such a request still gets its
    answer (-32602) under its own id."""
    found, depth, key, start = {}, 0, None, None
    for token in re.finditer(r'"(?:[^"\\]|\\.)*"|[{}\[\],:]', text):
        mark = token.group(0)
        if mark in "{[":
            if depth == 1:
                key = None              # a compound value: not one of the plain ones
            depth += 1
        elif mark in "}]" or mark == ",":
            if depth == 1:
                if key is not None and start is not None:
                    try:
                        found[key] = json.loads(text[start:token.start()])
                    except ValueError:
                        pass
                key = start = None
            depth -= mark in "}]"
        elif mark == ":" and depth == 1:
            start = token.end()
        elif depth == 1 and start is None:
            key = loads(mark) if mark.startswith('"') else None
    return found


def loads(data: Any) -> Any:
    """Strict JSON: NaN and Infinity are not JSON, and a peer may reject a frame holding
    them -- nor is a number too large for a double, which would turn into Infinity."""
    def reject(constant: str) -> Any:
        raise ValueError(f"{constant} is not valid JSON")

    def number(text: str) -> float:
        value = float(text)
        if value in (float("inf"), float("-inf")):
            raise NumberTooLarge(f"the number {text[:24]} is too large")
        return value
    try:
        return json.loads(data, parse_constant=reject, parse_float=number)
    except RecursionError:
        raise TooDeep("the JSON is nested too deeply") from None


LONE_SURROGATE = re.compile(r"\\ud[89ab][0-9a-f]{2}(?!\\ud[c-f])|"
                            r"(?<!\\ud[89ab][0-9a-f]{2})\\ud[c-f][0-9a-f]{2}")


COMPACT = json.JSONEncoder(separators=(",", ":"))    # one encoder, not one per frame


def encode_frame(message: dict) -> bytes:
    """One message as one line. ASCII-only JSON cannot contain a raw newline or U+2028."""
    text = COMPACT.encode(message)
    if "\\ud" in text and LONE_SURROGATE.search(text):   # strict parsers (serde) reject these
        text = COMPACT.encode(without_surrogates(message))
    return text.encode("ascii") + b"\n"


def without_surrogates(value: Any) -> Any:
    """A copy with lone UTF-16 surrogates replaced: a byte of a file name that is not UTF-8
    (Python keeps it as U+DC80..U+DCFF) becomes a readable \\xNN, any other (a model's
    stray escape) U+FFFD -- strict JSON parsers (serde, llama.cpp's) reject them all."""
    if isinstance(value, str):
        return SURROGATE.sub(lambda m: f"\\x{ord(m.group(0)) - 0xdc00:02x}"
                             if "\udc80" <= m.group(0) <= "\udcff" else "\ufffd", value)
    if isinstance(value, list):
        return [without_surrogates(v) for v in value]
    if isinstance(value, dict):
        return {k: without_surrogates(v) for k, v in value.items()}
    return value


SURROGATE = re.compile("[\ud800-\udfff]")


def valid_id(value: Any) -> bool:
    """JSON-RPC ids are strings, numbers or null (booleans are not numbers here)."""
    return value is None or isinstance(value, str) or (
        isinstance(value, (int, float)) and not isinstance(value, bool))


class Connection:
    """One JSON-RPC peer over a byte stream in and a frame writer out.

    `on_request(method, params)` is awaited for each incoming request and its return value
    becomes the result; `on_notification(method, params)` is called for notifications.
    `request()` and `notify()` talk the other way. `send()` is the only code that writes
    frames, and it writes each one whole, so frames never interleave.
    """

    def __init__(self, write: Callable[[bytes], None], on_request, on_notification,
                 trace: Optional[Callable[[str, bytes], None]] = None,
                 cancel_method: Optional[str] = "$/cancel_request"):
        self.write, self.trace = write, trace
        self.on_request, self.on_notification = on_request, on_notification
        self.cancel_method = cancel_method   # told for a request of ours we abandon
        self.pending: dict = {}      # our request id -> future awaiting the peer's response
        self.tasks: set = set()      # request handlers still running
        self.handling: dict = {}     # their request id -> (method, params, handler task)
        self.on_cancel = lambda method, params, task: task.cancel()   # their $/cancel_request
        self.next_id = 0
        self.bad_frames = 0          # lines that were not JSON-RPC frames

    # -- writing ----------------------------------------------------------------------------
    def send(self, message: dict) -> None:
        frame = encode_frame(message)
        if self.trace:
            self.trace("<-", frame)
        self.write(frame)

    def notify(self, method: str, params: dict) -> None:
        self.send({"jsonrpc": "2.0", "method": method, "params": params})

    async def request(self, method: str, params: dict) -> Any:
        """Send a request to the peer and wait for its result (RpcError on an error reply)."""
        request_id, self.next_id = self.next_id, self.next_id + 1
        future = asyncio.get_running_loop().create_future()
        self.pending[request_id] = future
        try:
            self.send({"jsonrpc": "2.0", "id": request_id, "method": method, "params": params})
            return await future
        except asyncio.CancelledError:       # we no longer want it: say so (ACP's $/ form)
            if self.cancel_method and (future.cancelled() or not future.done()):
                self.notify(self.cancel_method, {"requestId": request_id})
            raise
        finally:
            self.pending.pop(request_id, None)

    def reply(self, request_id: Any, result: Any = None, error: Optional[RpcError] = None):
        if error is not None:
            self.send({"jsonrpc": "2.0", "id": request_id, "error": error.to_dict()})
        else:
            self.send({"jsonrpc": "2.0", "id": request_id,
                       "result": {} if result is None else result})

    # -- reading ----------------------------------------------------------------------------
    async def serve(self, reader: asyncio.StreamReader) -> None:
        """Read frames until EOF. One bad frame never ends the loop."""
        skip_tail = False
        while True:
            try:
                line = await reader.readline()
            except ValueError as e:   # longer than the reader's limit; the reader dropped it
                self.reply(None, error=RpcError.invalid_request(
                    f"frame longer than {MAX_FRAME_BYTES} bytes"))
                skip_tail = "not found" in str(e)   # the rest of it is still to come
                continue
            if not line:
                return
            if skip_tail:
                skip_tail = False
                continue
            self.receive(line)

    def receive(self, line: bytes) -> None:
        """Classify one incoming line and route it: request, notification or response."""
        if self.trace:
            self.trace("->", line)
        line = line.strip()
        if not line:
            return
        try:
            message = loads(line.decode("utf-8"))
        except NumberTooLarge as e:     # a frame all the same: its params are what is wrong
            message = json.loads(line, parse_float=lambda text: 0.0)
            if isinstance(message, dict) and valid_id(message.get("id")):
                if "method" not in message:       # an answer of theirs: our request fails
                    return self._resolve({"id": message.get("id"), "error": {
                        "code": INVALID_PARAMS, "message": str(e)}})
                if "id" in message:
                    self.reply(message.get("id"), error=RpcError.invalid_params("params", str(e)))
                return
            self.bad_frames += 1
            return self.reply(None, error=RpcError.parse_error(str(e)))
        except TooDeep as e:       # valid JSON: a request's params are what is wrong
            fields = top_level(line.decode("utf-8", "replace"))
            if isinstance(fields.get("method"), str) and valid_id(fields.get("id")) and \
                    fields.get("id") is not None:
                return self.reply(fields["id"], error=RpcError.invalid_params("params", str(e)))
            self.bad_frames += 1
            return self.reply(None, error=RpcError.parse_error(str(e)))
        except (ValueError, RecursionError) as e:   # includes invalid UTF-8
            self.bad_frames += 1
            return self.reply(None, error=RpcError.parse_error(str(e)[:200]))
        if isinstance(message, list):
            return self.reply(None, error=RpcError.invalid_request(
                "batches are not supported by ACP"))
        if not isinstance(message, dict):
            return self.reply(None, error=RpcError.invalid_request("a frame must be an object"))
        has_id, request_id = "id" in message, message.get("id")
        if not valid_id(request_id):
            return self.reply(None, error=RpcError.invalid_request(
                "id must be a string, an integer or null"))
        if message.get("jsonrpc") != "2.0":
            return self.reply(request_id, error=RpcError.invalid_request('jsonrpc must be "2.0"'))
        method = message.get("method")
        if method is None and ("result" in message or "error" in message):
            return self._resolve(message)
        if not isinstance(method, str):
            return self.reply(request_id, error=RpcError.invalid_request(
                "method must be a string"))
        params = message.get("params")
        if not has_id and method == "$/cancel_request" and isinstance(params, dict):
            # the request it names as of now: a later request may reuse the id
            target = self.handling.get(json.dumps(params.get("requestId")))
            if target is not None:
                asyncio.get_running_loop().call_soon(self._cancel, *target)
            return
        if not has_id:   # queued behind the requests already read, so that a cancel
            # that follows a prompt in the same read finds that prompt's turn started
            asyncio.get_running_loop().call_soon(self._notification, method, params)
            return
        task = asyncio.ensure_future(self._answer(request_id, method, params))
        self.tasks.add(task)
        key = json.dumps(request_id)
        self.handling[key] = (method, params, task)
        task.add_done_callback(self.tasks.discard)
        task.add_done_callback(lambda _: self.handling.pop(key, None))

    async def _answer(self, request_id: Any, method: str, params: Any) -> None:
        """Run one request handler and send its response -- the single error boundary."""
        try:
            if params is None:
                params = {}
            if not isinstance(params, dict):
                raise RpcError.invalid_params("params", "must be an object")
            result = await self.on_request(method, params)
        except RpcError as e:
            self.reply(request_id, error=e)
        except asyncio.CancelledError:
            self.reply(request_id, error=RpcError(REQUEST_CANCELLED, "Request cancelled"))
        except Exception as e:
            import traceback
            log(f"handler for {method} crashed:\n{traceback.format_exc()}", error=True)
            self.reply(request_id, error=RpcError.internal_error(f"{type(e).__name__}: {e}"))
        else:
            self.reply(request_id, result)

    def _cancel(self, method: str, params: Any, task: asyncio.Future) -> None:
        """The peer abandons a request of theirs: it is still answered -- by the handler
        (`on_cancel` may end it its own way) or with -32800."""
        if not task.done():
            self.on_cancel(method, params, task)

    def _notification(self, method: str, params: Any) -> None:
        try:
            self.on_notification(method, params if isinstance(params, dict) else {})
        except Exception:
            import traceback
            log(f"notification {method} failed:\n{traceback.format_exc()}", error=True)

    def _resolve(self, message: dict) -> None:
        future = self.pending.get(message.get("id"))
        if future is None or future.done():
            log(f"ignored a response to no request of ours: id={message.get('id')!r}")
            return
        error = message.get("error")
        if error is not None:
            error = error if isinstance(error, dict) else {}
            future.set_exception(RpcError(error.get("code", INTERNAL_ERROR),
                                          str(error.get("message", "error")), error.get("data")))
        else:
            future.set_result(message.get("result"))

    def cancel_pending(self) -> None:
        """Give up on every request we are still waiting on (used at shutdown)."""
        for future in self.pending.values():
            if not future.done():
                future.cancel()


# =============================================================================================
# 2. ACP: the agent's side of the Agent Client Protocol
# =============================================================================================
#
# The client (the editor) calls these methods; each handler below *is* one ACP method, and a
# handler's name is its wire name with "/" turned into "_". The flow of a session:
#
#   initialize -> session/new -> session/prompt ... (session/cancel at any time) -> EOF
#
# While a prompt runs the agent streams `session/update` notifications: text and thought
# chunks, tool calls and their updates, the plan. The prompt's response -- its stop reason --
# comes last, after every update of the turn has been written.
#
#   <- {"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"acp-…","update":
#       {"sessionUpdate":"agent_message_chunk","content":{"type":"text","text":"Hi"}}}}
#   <- {"jsonrpc":"2.0","id":3,"result":{"stopReason":"end_turn"}}

RPC_METHODS: dict = {}     # wire method name -> handler, filled by @rpc


def rpc(method: str):
    """Register an Agent method as the handler of an ACP request."""
    def register(handler):
        RPC_METHODS[method] = handler
        return handler
    return register


# -- session/update builders, named after the sessionUpdate kinds ------------------------------

def text_block(text: str) -> dict:
    return {"type": "text", "text": text}


def text_content(text: str) -> dict:
    """Tool-call content: a content block wrapped as ToolCallContent."""
    return {"type": "content", "content": text_block(text)}


def diff_content(path: str, old_text: Optional[str], new_text: str) -> dict:
    """Tool-call content the editor renders as a diff; old_text None means a new file."""
    return {"type": "diff", "path": path, "oldText": old_text, "newText": new_text}


CHUNK_KINDS = ("agent_message_chunk", "agent_thought_chunk", "user_message_chunk")


def new_id(prefix: str) -> str:
    return f"{prefix}-{os.urandom(8).hex()}"


def message_chunk(kind: str, text: str) -> dict:
    """agent_message_chunk, agent_thought_chunk or user_message_chunk."""
    return {"sessionUpdate": kind, "content": text_block(text)}


def tool_call(call_id: str, title: str, kind: str, locations: list, raw_input: Any,
              name: Optional[str] = None) -> dict:
    """A tool call's card; `name` is the tool as the model called it (`title` is for people)."""
    card = {"sessionUpdate": "tool_call", "toolCallId": call_id, "title": title, "kind": kind,
            "status": "pending", "locations": locations, "rawInput": raw_input}
    if name:
        card["name"] = name
    return card


def tool_call_update(call_id: str, **fields) -> dict:
    return {"sessionUpdate": "tool_call_update", "toolCallId": call_id, **fields}


def plan(entries: list) -> dict:
    return {"sessionUpdate": "plan", "entries": entries}


def current_mode_update(mode_id: str) -> dict:
    return {"sessionUpdate": "current_mode_update", "currentModeId": mode_id}


def config_option_update(options: list) -> dict:
    return {"sessionUpdate": "config_option_update", "configOptions": options}


def session_info_update(title: str, updated_at: str) -> dict:
    return {"sessionUpdate": "session_info_update", "title": title, "updatedAt": updated_at}


def usage_update(used: int, size: int, estimated: bool = False,
                 cost: Optional[float] = None) -> dict:
    """How full the model's context is (`_meta.estimated` when qcr counted it itself), and
    what the session has cost so far when the model's price is known."""
    update: dict = {"sessionUpdate": "usage_update", "used": used, "size": size}
    if cost is not None:
        update["cost"] = {"amount": round(cost, 6), "currency": "USD"}
    if estimated:
        update["_meta"] = {"estimated": True}
    return update


# -- reading params ----------------------------------------------------------------------------

def need(params: dict, name: str, kind: type = str) -> Any:
    """A required param of the given type, or -32602 naming it."""
    value = params.get(name)
    if value is None:
        raise RpcError.invalid_params(name, "is required")
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise RpcError.invalid_params(name, "must be " + {str: "a string", list: "an array",
                                                          dict: "an object"}.get(kind, "valid"))
    return value


def need_cwd(params: dict) -> str:
    cwd = need(params, "cwd")
    if not os.path.isabs(cwd):
        raise RpcError.invalid_params("cwd", "must be an absolute path")
    if not os.path.isdir(cwd):
        raise RpcError.invalid_params("cwd", "is not an existing directory")
    return os.path.normpath(cwd)


def need_dirs(params: dict) -> list:
    """additionalDirectories: more absolute, existing folders the session may use."""
    dirs = params.get("additionalDirectories", [])
    if not isinstance(dirs, list):
        raise RpcError.invalid_params("additionalDirectories", "must be an array")
    for i, folder in enumerate(dirs):
        if not isinstance(folder, str) or not os.path.isabs(folder) or \
                not os.path.isdir(folder):
            raise RpcError.invalid_params(f"additionalDirectories[{i}]",
                                          "must be an absolute path to a folder")
    return [os.path.normpath(d) for d in dirs]


def need_session_id(params: dict) -> str:
    """A session id of qcr's own form: never a path, whatever the client sends."""
    session_id = need(params, "sessionId")
    if not SESSION_ID_RE.fullmatch(session_id):
        raise RpcError.invalid_params("sessionId", "is not a qcr session id")
    return session_id


def need_mcp_servers(params: dict) -> list:
    """mcpServers is required by the schema; a missing list is taken as empty."""
    servers = params.get("mcpServers", [])
    if not isinstance(servers, list):
        raise RpcError.invalid_params("mcpServers", "must be an array")
    return servers


async def prompt_content(blocks: Any, read_link: Callable) -> tuple:
    """Turn a prompt's content blocks into (text, images) for one user message.

    Text is kept as is; an embedded resource (an @-mention in Zed) is included with its URI;
    a resource_link to a local file is read (`read_link`); other links are mentioned by URI;
    images are kept as image content blocks.
    """
    if not isinstance(blocks, list):
        raise RpcError.invalid_params("prompt", "must be an array of content blocks")
    parts, images = [], []
    for i, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            text = block.get("text")
            if not isinstance(text, str):
                raise RpcError.invalid_params(f"prompt[{i}].text", "must be a string")
            parts.append(text)
        elif kind == "resource":
            resource = block.get("resource")
            if not isinstance(resource, dict) or not isinstance(resource.get("uri"), str):
                raise RpcError.invalid_params(f"prompt[{i}].resource", "must have a uri")
            if isinstance(resource.get("text"), str):
                parts.append(context_block(resource["uri"], resource["text"]))
            else:
                parts.append(f"\n[binary resource {quote_uri(resource['uri'])} was attached; "
                             "not shown]")
        elif kind == "resource_link":
            uri = block.get("uri")
            if not isinstance(uri, str) or "\0" in uri or "%00" in uri:
                raise RpcError.invalid_params(f"prompt[{i}].uri", "must be a string (no NUL)")
            parts.append(await read_link(uri))
        elif kind == "image":
            data, mime = block.get("data"), block.get("mimeType")
            if not isinstance(data, str) or not isinstance(mime, str) or \
                    not mime.startswith("image/"):
                raise RpcError.invalid_params(f"prompt[{i}]", "must be an image with base64 "
                                              "data and an image/* mimeType")
            images.append({"type": "image", "data": data, "mimeType": mime})
        elif kind == "audio":
            parts.append("\n[audio was attached, but qcr does not send audio to the model]")
        else:
            raise RpcError.invalid_params(f"prompt[{i}].type", f"is not a content type: {kind!r}")
    text = "".join(parts)
    if not text.strip() and not images:
        raise RpcError.invalid_params("prompt", "is empty")
    return text, images


def quote_uri(uri: str) -> str:
    """A URI safe to put between quotes in the model's context."""
    return uri.replace('"', "%22").replace("<", "%3C").replace(">", "%3E").replace("\n", "%0A")


def context_block(uri: str, text: str) -> str:
    return f'\n<context uri="{quote_uri(uri)}">\n{text}\n</context>'



def local_path(uri: str) -> Optional[str]:
    """The path of a file:// URI on this machine, else None."""
    from urllib.parse import unquote, urlparse
    parsed = urlparse(uri)
    if parsed.scheme != "file" or parsed.netloc not in ("", "localhost"):
        return None
    return unquote(parsed.path)


def read_linked_file(uri: str) -> str:
    """The text of a local file:// link for the model, or a mention of any other link."""
    path = local_path(uri)
    if path is None:
        return f"\n[link: {quote_uri(uri)}]"
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):   # a FIFO or device would block
            return f"\n[link to {quote_uri(path)}: not a regular file; not read]"
        with open(path, "rb") as f:
            data = f.read(LINKED_FILE_BYTES + 1)
    except OSError as e:
        return f"\n[link to {quote_uri(path)}: could not read it: {e.strerror}]"
    if b"\0" in data[:8192]:
        return f"\n[link to binary file {quote_uri(path)}; not shown]"
    text = data[:LINKED_FILE_BYTES].decode("utf-8", "replace")
    more = "\n[... truncated; read the rest with ReadFile]" \
        if len(data) > LINKED_FILE_BYTES else ""
    return context_block(uri, text + more)


LINKED_FILE_BYTES = 256 * 1024      # most of a linked file that goes into a prompt


class Agent:
    """The ACP agent: the client's requests arrive here, one handler per method.

    It owns the live sessions, the configuration and the connection to the client; the
    agent loop (section 6) runs each prompt and reports through `update()`.
    """

    def __init__(self, config: Config, store: Optional[SessionStore] = None):
        self.config = config
        self.store = store or SessionStore(os.path.join(config.home, "sessions"))
        self.conn: Optional[Connection] = None
        self.client_capabilities: dict = {}
        self.sessions: dict = {}
        self.ledger = Ledger(os.path.join(config.home, "permissions.json"))
        self.searched = False        # looked for a local model server already
        self.signed_out = False      # `logout`: no new session until `authenticate`
        self.scheduler: Optional[asyncio.Future] = None    # runs due jobs (CronCreate)
        self.notice = ""             # what that search found, for the first session

    def client_can(self, *keys: str) -> bool:
        """Did the client advertise this capability? (`true`, or `{}` for object flags)"""
        value: Any = self.client_capabilities
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        return value is True or isinstance(value, dict)

    # -- routing ------------------------------------------------------------------------------
    async def on_request(self, method: str, params: dict) -> Any:
        handler = RPC_METHODS.get(method)
        if handler is None:
            raise RpcError.method_not_found(method)
        return await handler(self, params)

    def on_notification(self, method: str, params: dict) -> None:
        session_id = params.get("sessionId")
        if method == "session/cancel" and isinstance(session_id, str):
            session = self.sessions.get(session_id)
            if session is not None:
                session.cancel()
        # Anything else -- notifications/initialized, … -- is ignored.

    def cancel_request(self, method: str, params: Any, task: asyncio.Future) -> None:
        """$/cancel_request from the client: a prompt ends as session/cancel ends it
        (answered `cancelled`); any other request is answered -32800."""
        if method == "session/prompt" and isinstance(params, dict):
            self.on_notification("session/cancel", {"sessionId": params.get("sessionId")})
        else:
            task.cancel()

    def update(self, session: Session, update: dict) -> None:
        """Send one session/update and keep it for replay on session/load. The chunks of one
        message share a `messageId`; a chunk of another kind, or a tool call or plan between
        them, starts a new message."""
        if session.origin:          # a scheduled turn: say so on every update
            update = dict(update, _meta={**(update.get("_meta") or {}), **session.origin})
        kind = update["sessionUpdate"]
        if kind in CHUNK_KINDS:
            if session.message is None or session.message[0] != kind:
                session.message = (kind, new_id("msg"))
            update = dict(update, messageId=session.message[1])
        elif kind in ("tool_call", "tool_call_update", "plan"):
            session.message = None
        self.conn.notify("session/update", {"sessionId": session.id, "update": update})
        session.record(update)

    def tell(self, session: Session, severity: str, text: str) -> None:
        """Say something that is qcr's, not the model's (a retry, a server that did not
        start, a problem in the configuration): a `notice` when the client shows them (they
        are live, never replayed), else the same words in the answer, as before."""
        if not self.client_can("session", "notices"):
            self.update(session, message_chunk("agent_message_chunk", text))
            return
        plain = re.sub(r"^\W*\[(note|warning|error|mcp)\]\s*|[_`*]", "", text.strip())
        if plain.startswith("[") and plain.endswith("]"):       # a retry's [ ... ]
            plain = plain[1:-1]
        title, _, rest = plain.partition("\n")
        notice = {"sessionUpdate": "notice", "severity": severity,
                  "title": title[:200] or severity}
        if rest.strip() or len(title) > 200:
            notice["description"] = plain
        if session.origin:
            notice["_meta"] = session.origin
        self.conn.notify("session/update", {"sessionId": session.id, "update": notice})

    def schedule(self) -> None:
        """Make sure the scheduler runs while any open session has jobs."""
        if self.scheduler is None or self.scheduler.done():
            self.scheduler = asyncio.ensure_future(self.run_jobs())

    async def run_jobs(self) -> None:
        """Start each due job as a turn of its session once the session is idle."""
        while any(s.jobs for s in self.sessions.values()):
            now = time.time()
            for session in list(self.sessions.values()):
                if not session.armed:           # reopened, and the user has not acted yet
                    continue
                due = [j for j in session.jobs if j["next"] <= now]
                if not due or (session.turn is not None and not session.turn.done()):
                    continue                      # nothing due, or a turn runs: wait
                job = due[0]
                if job["recurring"]:
                    job["next"] = next_run(job["schedule"], now)
                else:
                    session.jobs.remove(job)
                session.cancelling = False
                session.origin = {"source": "cron", "jobId": job["id"]}   # before it starts
                session.turn = asyncio.ensure_future(run_job(self, session, job["prompt"]))
            await asyncio.sleep(JOB_TICK)

    def session(self, params: dict) -> Session:
        session_id = need(params, "sessionId")
        session = self.sessions.get(session_id)
        if session is None:
            raise RpcError.resource_not_found(f"no session {session_id}", sessionId=session_id)
        return session

    async def saved(self, session: Session) -> None:
        """Save the session and wait until it is on disk (a failure is told, not raised)."""
        done = self.save(session)
        if done is not None:
            await asyncio.wait([done])

    async def update_saved(self, session: Session, update: dict) -> None:
        """Send an update only once the state it reports is on disk: a step the user saw
        completed survives a kill that comes right after."""
        if session.origin:
            update = dict(update, _meta=session.origin)
        session.record(update)
        await self.saved(session)
        self.conn.notify("session/update", {"sessionId": session.id, "update": update})

    def save(self, session: Session) -> Optional[asyncio.Future]:
        """Write the session to disk (off the loop); a failure is told once in the thread."""
        if session.deleted:
            return None
        session.updated = time.time()
        if self.store.sizes.get(session.id, 0) > self.config.max_session_chars:
            session.trim(self.config.max_session_chars // 2)
        done = asyncio.wrap_future(self.store.save(session))

        def report(future: Any) -> None:
            error = None if future.cancelled() else future.exception()
            if error is not None and not session.unsaved and session.messages:  # (else
                # the thread is not shown yet: the next save, after a prompt, tells)
                session.unsaved = True
                log(f"could not save session {session.id}: {error}")
                why = str(error) if isinstance(error, SessionConflict) else \
                    f"this session cannot be saved, so it will not reopen after a restart: {error}"
                self.tell(session, "warning", f"\n[warning] {why}\n")
        done.add_done_callback(report)
        return done

    # -- lifecycle ----------------------------------------------------------------------------
    @rpc("initialize")
    async def initialize(self, params: dict) -> dict:
        # Any protocolVersion is accepted -- 1, "1", or the pre-release date strings -- and
        # the answer is always the one version qcr speaks; the client decides if it can.
        if "protocolVersion" not in params:
            raise RpcError.invalid_params("protocolVersion", "is required")
        capabilities = params.get("clientCapabilities", params.get("capabilities"))
        self.client_capabilities = capabilities if isinstance(capabilities, dict) else {}
        return {
            "protocolVersion": PROTOCOL_VERSION,
            "agentCapabilities": {
                "loadSession": True,
                "promptCapabilities": {"image": True, "audio": False, "embeddedContext": True},
                "mcpCapabilities": {"http": True, "sse": True},
                "sessionCapabilities": {"list": {}, "resume": {}, "close": {}, "delete": {},
                                        "additionalDirectories": {}},
                "auth": {"logout": {}},
            },
            "authMethods": self.auth_methods(),
            "agentInfo": {"name": "qcr", "title": "qcr", "version": __version__},
        }

    def auth_methods(self) -> list:
        """How the user can give qcr a model: setup in a terminal (when the client can run
        one), or "I have configured it" -- read the configuration again and look again."""
        methods = [{"id": "reload", "name": "Use my configuration",
                    "description": "Read ~/.qcr/config.json and the environment again, and "
                                   "look for a model server on this machine"}]
        if self.client_can("auth", "terminal"):
            methods.insert(0, {"id": "login", "type": "terminal", "args": ["--login"],
                               "name": "Set up a model",
                               "description": "Choose a model server, key and model in a "
                                              "terminal; saved to ~/.qcr/config.json"})
        return methods

    @rpc("logout")
    async def logout(self, params: dict) -> dict:
        """Forget the saved keys (in ~/.qcr/config.json); until the user signs in again --
        `authenticate` -- a new session answers -32000, so the editor asks for sign-in."""
        path = os.path.join(self.config.home, "config.json")

        def forget() -> None:
            saved = read_config_file(Config(), path, False)
            kept = {k: v for k, v in saved.items() if k not in ("apiKey", "anthropicApiKey")}
            if kept != saved:
                write_private(path, json.dumps(kept, indent=2) + "\n")
        await asyncio.to_thread(forget)
        self.config = await asyncio.to_thread(load_config, self.config.config_file or None)
        self.signed_out = True
        return {}

    @rpc("authenticate")
    async def authenticate(self, params: dict) -> dict:
        method_id = need(params, "methodId")
        if method_id not in [m["id"] for m in self.auth_methods()]:
            raise RpcError.invalid_params("methodId", f"names no auth method of qcr: "
                                                      f"{method_id!r}")
        self.config = await asyncio.to_thread(load_config, self.config.config_file or None)
        self.searched = self.signed_out = False
        await self.ensure_model()
        return {}

    async def ensure_model(self) -> None:
        """Before a session: with no model configured, look for a model server on this
        machine (or ask the configured one for its models); with none at all, answer
        -32000 so the editor shows its sign-in screen."""
        config = self.config
        if self.signed_out:
            raise RpcError(AUTH_REQUIRED, "Authentication required: you signed out of qcr; "
                           "sign in again to start a session")
        if config.provider != "openai" or (config.base_url and config.model):
            return
        if not self.searched:
            self.searched = True
            urls = [config.base_url] if config.base_url else config.local_servers
            found = await asyncio.to_thread(discover, urls, config.api_key)
            if found:
                url, models = found
                if not config.base_url:
                    config.base_url = url
                    self.notice = (f"[note] No model was configured, so qcr uses the model "
                                   f"server it found at {url}. Pick a model in the model "
                                   "selector; `python3 qcr.py --login` saves a choice.\n\n")
                config.models = list(config.models) + [m for m in models
                                                       if m not in config.models]
                config.model = config.model or models[0]
        if not config.base_url:
            raise RpcError(AUTH_REQUIRED, "Authentication required: no model is configured, "
                           "and no model server answered on this machine (tried "
                           f"{', '.join(config.local_servers) or 'none'}). Set one up: "
                           "`python3 qcr.py --login`, or OPENAI_BASE_URL and OPENAI_MODEL "
                           "(or ANTHROPIC_API_KEY) in the agent's env -- see the README.")

    # -- sessions -----------------------------------------------------------------------------
    @rpc("session/new")
    async def session_new(self, params: dict) -> dict:
        cwd, servers, dirs = need_cwd(params), need_mcp_servers(params), need_dirs(params)
        await self.ensure_model()
        session_id = f"acp-{os.urandom(8).hex()}-{os.urandom(8).hex()}"   # CSPRNG
        session = Session(id=session_id, cwd=cwd, model=self.config.model, mcp_servers=servers,
                          additional_dirs=dirs, notice=self.notice)
        self.notice = ""
        self.sessions[session_id] = session
        self.save(session)           # listed, resumable and deletable from now on
        self.after_answer(session)
        return {"sessionId": session_id, "modes": self.modes(session),
                "configOptions": self.config_options(session)}

    @rpc("session/load")
    async def session_load(self, params: dict) -> dict:
        """Reopen a saved session, replaying everything the user saw before answering."""
        session = await self.reopen(params)
        message = None
        for update in session.replay():
            kind = update.get("sessionUpdate")
            if kind in CHUNK_KINDS:       # a run of one kind is one message, as it was live
                message = message if message and message[0] == kind else (kind, new_id("msg"))
                update = dict(update, messageId=message[1])
            elif kind in ("tool_call", "plan"):
                message = None
            elif kind == "compaction_update" and not self.client_can("session", "compaction"):
                summary = "".join(b.get("text", "") for b in update.get("summary") or [])
                update = message_chunk("agent_message_chunk", "[the conversation was "
                                       f"compacted]\n\n{summary}\n\n" if summary else "")
                if not summary:
                    continue
            self.conn.notify("session/update", {"sessionId": session.id, "update": update})
        self.after_answer(session)
        return {"modes": self.modes(session), "configOptions": self.config_options(session)}

    @rpc("session/resume")
    async def session_resume(self, params: dict) -> dict:
        """Reopen a saved session without replaying it (the client still shows it)."""
        session = await self.reopen(params)
        self.after_answer(session)
        return {"modes": self.modes(session), "configOptions": self.config_options(session)}

    async def reopen(self, params: dict) -> Session:
        """The session named in a load/resume request, from memory or from its file.

        A damaged file never stops the editor: it is moved aside, kept for the user, and
        the thread starts empty with a message saying so.
        """
        session_id = need_session_id(params)
        cwd, servers, dirs = need_cwd(params), need_mcp_servers(params), need_dirs(params)
        await self.ensure_model()
        session = self.sessions.get(session_id)
        if session is None:
            try:
                session = await self.store.load(session_id)
            except SessionDamaged as e:
                aside = await self.store.run(self.store.move_aside, session_id)
                log(f"session {session_id} is damaged ({e}); moved to {aside}")
                session = Session(id=session_id, cwd=cwd, notice=(
                    f"[error] The saved session could not be read ({e}). The file was kept "
                    f"as {aside}; this thread starts empty."))
            self.sessions[session_id] = session
        session.cwd, session.mcp_servers, session.additional_dirs = cwd, servers, dirs
        session.model = session.model or self.config.model
        return session

    def after_answer(self, session: Session) -> None:
        """Once the session's answer is written: its commands, usage and any notice.

        Updates for a session the client does not know yet are dropped (Zed does), so
        these are queued to run right after the response goes out.
        """
        async def send() -> None:
            if session.mcp_ready is None:        # the session's MCP servers, in the background
                session.mcp_ready = asyncio.ensure_future(self.start_mcp(session))
            if session.notice:
                self.tell(session, "error" if "[error]" in session.notice else "info",
                          session.notice)
                session.notice = ""
            await self.announce_commands(session)
            if session.jobs:
                self.schedule()
            if session.context_used:
                priced = price_of(self.config, session.model) is not None
                self.update(session, usage_update(session.context_used,
                                                  context_window(self.config, session.model),
                                                  cost=session.cost if priced else None))
        asyncio.get_running_loop().call_soon(asyncio.ensure_future, send())

    async def start_mcp(self, session: Session) -> None:
        """Start the session's MCP servers together; say once which ones failed."""
        starting = []
        for name, spec, approval in await asyncio.to_thread(
                session_mcp_specs, self.config, session.cwd, session.mcp_servers):
            if approval and not await self.approve_server(session, name, spec):
                continue
            server = session.mcp[name] = McpServer(name, spec, self.config, not approval)
            starting.append(server.start())
        if starting:
            await asyncio.wait(starting)
        for server in session.mcp.values():
            if server.error:
                self.tell(session, "warning", (
                    f"[mcp] the server {server.name} did not start, "
                    f"so its tools are missing: {server.error}\n\n"))

    async def approve_server(self, session: Session, name: str, spec: dict) -> bool:
        """A project plugin's server starts (or is connected to) only once the policy clears
        it: an execute need for a command, a network need for a URL. The ledger key covers
        everything that decides what runs or where data goes -- command, arguments, env,
        folder, URL, headers -- so a change to any of it asks again."""
        key = "mcp-server:" + digest(json.dumps(spec, sort_keys=True))
        if spec["type"] == "stdio":        # the plugin's own files are part of what runs
            key += ":" + await asyncio.to_thread(folder_fingerprint, spec["cwd"])
            shown = "$ " + " ".join([spec["command"]] + spec["args"]) + f"\n(in {spec['cwd']})"
            shown += "".join(f"\n{k}={v}" for k, v in spec.get("env", {}).items())
            row = "execute"
        else:
            shown = f"{spec['type']} {spec['url']}" + "".join(
                f"\n{k}: …" for k in spec.get("headers", {}))
            row = (await host_need(spec["url"]))[0]
        call_id = "mcp-" + os.urandom(6).hex()
        card = tool_call(call_id, printable(f"Start the project plugin's MCP server {name}: "
                                            + shown.splitlines()[0].lstrip("$ ")),
                         "execute" if row == "execute" else "fetch",
                         [{"path": spec["cwd"]}] if spec.get("cwd") else [], spec)
        self.update(session, card)
        ctx = ToolContext(self, session, call_id, None, card)
        try:
            await ctx.permit([text_content(printable(shown))],
                             (row, key, f"the project's MCP server {name} as shown"))
        except ToolError as e:
            ctx.update(status="failed", content=[text_content(f"Not started: {e}")])
            return False
        ctx.update(status="completed", content=[text_content("Started.")])
        return True

    def mcp_tools(self, session: Session) -> dict:
        """The session's MCP tools by the name the model calls them."""
        tools = {}
        for server in session.mcp.values():   # a stopped server restarts on its next call
            if server.tools:
                for spec in server.tools:
                    made = mcp_tool(server, spec)
                    tools[made.name] = made
        return tools

    async def stop_mcp(self, session: Session) -> None:
        if session.mcp_ready is not None and not session.mcp_ready.done():
            session.mcp_ready.cancel()
        servers = list(session.mcp.values())
        session.mcp.clear()
        if servers:
            await asyncio.wait([asyncio.ensure_future(s.stop()) for s in servers], timeout=5)

    async def announce_commands(self, session: Session) -> None:
        """Read the command files (off the loop); send available_commands_update if the set
        differs from what was last sent."""
        session.command_table = await asyncio.to_thread(find_commands, self.config,
                                                        session.cwd)
        commands = [c.available() for c in session.command_table.values()]
        if commands != session.commands:
            session.commands = commands
            self.update(session, {"sessionUpdate": "available_commands_update",
                                  "availableCommands": commands})

    @rpc("session/list")
    async def session_list(self, params: dict) -> dict:
        cwd, cursor = params.get("cwd"), params.get("cursor")
        if cwd is not None and (not isinstance(cwd, str) or not os.path.isabs(cwd)):
            raise RpcError.invalid_params("cwd", "must be an absolute path")
        if cursor is not None and not (isinstance(cursor, str) and cursor.isdigit() and
                                       len(cursor) <= 9):
            raise RpcError.invalid_params("cursor", "is not a cursor from session/list")
        start = int(cursor or 0)
        found = [m for m in await self.store.run(self.store.list)
                 if cwd is None or m["cwd"] == os.path.normpath(cwd)]
        page = found[start:start + LIST_PAGE]
        result: dict = {"sessions": [
            {"sessionId": m["sessionId"], "cwd": m["cwd"], "updatedAt": iso_time(m["updated"]),
             **({"additionalDirectories": m["additionalDirectories"]}
                if m.get("additionalDirectories") else {}),
             **({"title": m["title"]} if isinstance(m.get("title"), str) and m["title"]
                else {})} for m in page]}
        if start + LIST_PAGE < len(found):
            result["nextCursor"] = str(start + LIST_PAGE)
        return result

    @rpc("session/close")
    async def session_close(self, params: dict) -> dict:
        """Cancel what runs, then let go of the session (its file stays)."""
        session = self.session(params)
        turn = session.turn
        session.cancel()
        if turn is not None and not turn.done():
            await asyncio.wait([turn], timeout=SHUTDOWN_GRACE)
        await self.saved(session)        # after the prompt's own answer, which waits on it
        self.sessions.pop(session.id, None)
        await self.stop_mcp(session)
        return {}

    @rpc("session/delete")
    async def session_delete(self, params: dict) -> dict:
        session_id = need_session_id(params)
        session = self.sessions.pop(session_id, None)
        if session is not None:
            session.deleted = True
            session.cancel()
            await self.stop_mcp(session)
        existed = await self.store.run(self.store.delete, session_id)  # after queued saves
        if not existed and session is None:
            raise RpcError.resource_not_found(f"no session {session_id}", sessionId=session_id)
        return {}

    # -- modes and configuration --------------------------------------------------------------
    def modes(self, session: Session) -> dict:
        return {"currentModeId": session.mode, "availableModes": MODES}

    def models(self, session: Session) -> list:
        """The model selector's choices: the session's, the configured one, the extras."""
        models = []
        for model in [session.model, self.config.model] + list(self.config.models):
            if model and model not in models:
                models.append(model)
        return models or [NO_MODEL]

    def config_options(self, session: Session) -> list:
        """The session's selectors: mode, model, the reasoning effort (for a model that takes
        one), automatic compaction (a switch when the client draws boolean options). Zed
        shows these and ignores `modes` when present."""
        models = self.models(session)
        options = [
            {"id": "mode", "name": "Mode", "category": "mode", "type": "select",
             "currentValue": session.mode,
             "options": [{"value": m["id"], "name": m["name"], "description": m["description"]}
                         for m in MODES]},
            {"id": "model", "name": "Model", "category": "model", "type": "select",
             "currentValue": session.model or models[0],
             "options": [{"value": m, "name": m} for m in models]},
        ]
        levels = effort_levels(self.config, session.model)
        if levels:
            options.append({"id": "thought_level", "name": "Thinking", "category":
                            "thought_level", "type": "select",
                            "currentValue": session.effort if session.effort in levels
                            else "default",
                            "options": [{"value": "default", "name": "Model default"}] +
                                       [{"value": v, "name": EFFORTS[v]} for v in levels]})
        compaction = {"id": "auto_compact", "name": "Compact automatically",
                      "description": "Summarise older turns when the context window fills",
                      "category": "_qcr_context"}
        if self.client_can("session", "configOptions", "boolean"):
            options.append(dict(compaction, type="boolean", currentValue=session.auto_compact))
        else:
            options.append(dict(compaction, type="select",
                                currentValue="on" if session.auto_compact else "off",
                                options=[{"value": "on", "name": "On"},
                                         {"value": "off", "name": "Off"}]))
        return options

    def set_effort(self, session: Session, value: Any, field_name: str) -> None:
        levels = effort_levels(self.config, session.model)
        if value != "default" and value not in levels:
            raise RpcError.invalid_params(field_name, "must be one of " + ", ".join(
                ["default"] + levels) if levels else f"{session.model} takes no effort level")
        session.effort = "" if value == "default" else value
        self.options_changed(session)

    def set_auto_compact(self, session: Session, value: Any, field_name: str) -> None:
        value = {"on": True, "off": False}.get(value, value)    # (the select's form)
        if not isinstance(value, bool):
            raise RpcError.invalid_params(field_name, "must be true or false (on or off)")
        session.auto_compact = value
        self.options_changed(session)

    def options_changed(self, session: Session) -> None:
        """Show the session's options as they are now, and keep them."""
        self.update(session, config_option_update(self.config_options(session)))
        self.save(session)

    def set_mode(self, session: Session, mode_id: Any, field_name: str) -> None:
        if mode_id not in MODE_IDS:
            raise RpcError.invalid_params(field_name, f"must be one of {', '.join(MODE_IDS)}")
        session.mode = mode_id
        # Keep both views of the mode in sync, whichever one the client uses.
        self.update(session, current_mode_update(mode_id))
        self.options_changed(session)

    def set_model(self, session: Session, model: Any, field_name: str) -> None:
        if model not in self.models(session):
            raise RpcError.invalid_params(
                field_name, f"must be one of {', '.join(self.models(session))}")
        session.model = "" if model == NO_MODEL else model
        self.options_changed(session)

    @rpc("session/set_mode")
    async def session_set_mode(self, params: dict) -> dict:
        self.set_mode(self.session(params), params.get("modeId"), "modeId")
        return {}

    @rpc("session/set_config_option")
    async def session_set_config_option(self, params: dict) -> dict:
        session, config_id = self.session(params), need(params, "configId")
        if config_id == "mode":
            self.set_mode(session, params.get("value"), "value")
        elif config_id == "model":
            self.set_model(session, params.get("value"), "value")
        elif config_id == "thought_level":
            self.set_effort(session, params.get("value"), "value")
        elif config_id == "auto_compact":
            self.set_auto_compact(session, params.get("value"), "value")
        else:
            raise RpcError.invalid_params("configId", "must be one of mode, model, "
                                                      "thought_level, auto_compact")
        return {"configOptions": self.config_options(session)}

    @rpc("session/set_model")
    async def session_set_model(self, params: dict) -> dict:
        """The older, unstable way to pick a model; still sent by some clients."""
        self.set_model(self.session(params), params.get("modelId"), "modelId")
        return {}

    # -- prompts ------------------------------------------------------------------------------
    @rpc("session/prompt")
    async def session_prompt(self, params: dict) -> dict:
        session = self.session(params)
        if session.origin and session.turn is not None and not session.turn.done():
            await asyncio.wait([session.turn])    # a scheduled turn runs: the user's comes next
        if session.turn is not None and not session.turn.done():
            raise RpcError.invalid_request(
                f"session {session.id} is already running a turn; send session/cancel first")
        session.turn = pending = asyncio.get_running_loop().create_future()   # busy now
        session.cancelling, session.armed = False, True
        try:
            text, images = await prompt_content(
                params.get("prompt"), lambda uri: self.read_link(session, uri))
            await self.announce_commands(session)     # the command files may have changed
        except BaseException:
            session.turn = None
            raise
        if pending.cancelled():      # cancelled while its links or commands were read
            return {"stopReason": "cancelled"}
        session.turn = asyncio.ensure_future(run_prompt(self, session, text, images))
        try:
            stop_reason = await session.turn
        except asyncio.CancelledError:
            if not session.turn.cancelled():
                raise
            stop_reason = "cancelled"    # cancelled before the turn even started
        await self.saved(session)        # the answer comes once the turn's end is on disk
        return {"stopReason": stop_reason}

    async def read_link(self, session: Session, uri: str) -> str:
        """A resource_link's text: through the editor when it can (unsaved changes), else
        from disk."""
        path = local_path(uri)
        if path and self.client_can("fs", "readTextFile") and within(path, session.roots()):
            try:
                result = await self.conn.request("fs/read_text_file",
                                                 {"sessionId": session.id, "path": path})
                if isinstance(result, dict) and isinstance(result.get("content"), str):
                    return context_block(uri, result["content"][:LINKED_FILE_BYTES])
            except RpcError:
                pass
        return await asyncio.to_thread(read_linked_file, uri)

    # -- shutdown -----------------------------------------------------------------------------
    async def shutdown(self) -> None:
        """At stdin EOF: cancel running turns, let them answer, stop children, save."""
        if self.scheduler is not None:
            self.scheduler.cancel()
        turns = [s.turn for s in self.sessions.values() if s.turn and not s.turn.done()]
        for session in self.sessions.values():
            session.cancel()
        if turns:
            await asyncio.wait(turns, timeout=SHUTDOWN_GRACE)
        if self.conn is not None:
            self.conn.cancel_pending()
            if self.conn.tasks:
                await asyncio.wait(list(self.conn.tasks), timeout=0.3)
        for session in list(self.sessions.values()):
            await self.stop_mcp(session)
        await asyncio.get_running_loop().run_in_executor(None, self.store.flush)


# =============================================================================================
# 3. Sessions: what a conversation is, and where it is kept
# =============================================================================================
#
# A session holds two histories. `messages` is what the model sees (OpenAI chat shape: system
# prompt excluded, rebuilt each turn). `transcript` is what the user saw: the session/update
# payloads of every turn, with streamed chunks joined and each tool call merged with its
# updates into its final state, so session/load can replay the thread as it looked live.
# Compaction shortens `messages` only; the transcript keeps everything.
#
# Each session is one file in ~/.qcr/sessions, replaced atomically after every step. Its first
# line is the metadata session/list needs (id, cwd, title, times, and the length of the
# second line, so a truncated file is caught without reading it all); the second line is
# the body: messages, transcript, plan, remembered approvals.

def iso_time(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


@dataclass
class Session:
    """One conversation: what the model sees (`messages`), what the user saw (`transcript`,
    replayed on load), its mode, model, roots and remembered answers. The fields above
    `roots()` are saved; the rest lives only while this process runs."""
    id: str
    cwd: str
    mode: str = "default"
    model: str = ""
    title: str = ""
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)
    messages: list = field(default_factory=list)       # the model's context
    transcript: list = field(default_factory=list)     # the user's view, for replay
    additional_dirs: list = field(default_factory=list)   # more project folders (roots)
    mcp_servers: list = field(default_factory=list)    # as the editor sent them
    mcp: dict = field(default_factory=dict)            # name -> McpServer (running ones)
    mcp_ready: Optional[asyncio.Future] = None         # the servers' start-up
    allowed: dict = field(default_factory=dict)        # "always" answers: key -> decision
    plan: list = field(default_factory=list)           # the latest plan entries
    context_used: int = 0         # tokens in the model's context at the last model call
    context_mark: int = 0         # len(messages) then: what came after is estimated
    turn: Optional[asyncio.Future] = None              # the running prompt turn
    cancelling: bool = False
    unsaved: bool = False                              # a save failed (told the user once)
    deleted: bool = False                              # session/delete: never save again
    text_tools: bool = False          # the model takes no tool definitions: text protocol
    jobs: list = field(default_factory=list)           # scheduled prompts (CronCreate)
    effort: str = ""                  # reasoning effort chosen (thought_level); "" = default
    auto_compact: bool = True         # compact when the window fills
    cost: float = 0.0                 # what the model calls cost so far, in USD (prices)
    changes: list = field(default_factory=list)        # file changes, for /undo (bounded)
    origin: Optional[dict] = None     # {"source": "cron", ...} while a job's turn runs
    armed: bool = False               # the user acted in this process: its jobs may run
    notice: str = ""                                   # said in the thread when reopened
    commands: Optional[list] = None                    # the slash commands last announced
    message: Optional[tuple] = None                    # (chunk kind, messageId) being sent
    command_table: dict = field(default_factory=dict)  # name -> Command, read at each prompt
    notes: list = field(default_factory=list)          # project instructions, read each turn
    seen: dict = field(default_factory=dict)           # path -> digest of what qcr last read

    def roots(self) -> list:
        """The folders the session may use freely: its cwd and any additional ones."""
        return [self.cwd] + self.additional_dirs
    _run: Optional[list] = None       # [kind, [texts]] of the chunk run being streamed
    _tool_at: dict = field(default_factory=dict)       # tool call id -> transcript index

    def cancel(self) -> None:
        if self.turn is not None and not self.turn.done() and not self.cancelling:
            self.cancelling = True
            self.turn.cancel()

    def record(self, update: dict) -> None:
        """Keep one update for replay: chunks are joined, tool updates merged into the call."""
        kind = update["sessionUpdate"]
        if kind.endswith("_message_chunk") or kind == "agent_thought_chunk":
            if update["content"].get("type") != "text":     # an image: kept as it came
                self._close_run()
                self.transcript.append(update)
                return
            if self._run is not None and self._run[0] == kind:
                self._run[1].append(update["content"]["text"])
                return
            self._close_run()
            self._run = [kind, [update["content"]["text"]]]
            return
        self._close_run()
        if kind == "tool_call":
            self._tool_at[update["toolCallId"]] = len(self.transcript)
            self.transcript.append(update)
        elif kind == "tool_call_update":
            at = self._tool_at.get(update["toolCallId"])
            if at is not None:   # entries are replaced, never mutated: a save may be reading
                merged = {**self.transcript[at], **update, "sessionUpdate": "tool_call"}
                self.transcript[at] = merged
        elif kind == "plan":
            self.transcript.append(update)
        elif kind in ("compaction_update", "compaction_summary_chunk"):
            self.record_compaction(update)
        # Mode, config, title and command updates are state, replayed from the session's fields.

    def record_compaction(self, update: dict) -> None:
        """A compaction is one entity of the thread: its updates patch it, its summary
        chunks append to it; it replays in its final form."""
        key = "compaction:" + str(update.get("compactionId"))
        at = self._tool_at.get(key)
        entry = dict(self.transcript[at]) if at is not None else {
            "sessionUpdate": "compaction_update", "compactionId": update.get("compactionId"),
            "status": "in_progress"}
        if update["sessionUpdate"] == "compaction_summary_chunk":
            so_far = "".join(b.get("text", "") for b in entry.get("summary") or [])
            entry["summary"] = [text_block(so_far + update["content"].get("text", ""))]
        else:
            entry.update({k: v for k, v in update.items() if k != "sessionUpdate"})
        if at is None:
            self._tool_at[key] = len(self.transcript)
            self.transcript.append(entry)
        else:
            self.transcript[at] = entry

    def reshow(self, call_id: str, **fields) -> None:
        """Change how a tool call replays (not what was sent): an editor terminal's card
        replays as its output, since a new process cannot show a dead terminal."""
        at = self._tool_at.get(call_id)
        if at is not None:
            self.transcript[at] = {**self.transcript[at], **fields}

    def trim(self, keep_chars: int) -> None:
        """Keep the file bounded (maxSessionChars): the oldest part of the replay goes, so
        that the rest of it holds about keep_chars. (What the model sees is bounded by
        compaction; this is the user's view of long-past turns.)"""
        self._close_run()
        total, cut = 0, 0
        for at in range(len(self.transcript) - 1, -1, -1):
            total += len(json.dumps(self.transcript[at]))
            if total > keep_chars:
                cut = at + 1
                break
        if cut == 0:
            return
        note = message_chunk("agent_message_chunk", "[the earlier part of this thread was not "
                             "kept: the session passed its size bound, maxSessionChars]\n\n")
        self.transcript = [note] + self.transcript[cut:]
        self._tool_at = {k: at - cut + 1 for k, at in self._tool_at.items() if at >= cut}

    def _close_run(self) -> None:
        if self._run is not None:
            kind, texts = self._run
            self.transcript.append(message_chunk(kind, "".join(texts)))
            self._run = None

    def replay(self) -> list:
        """The updates that rebuild the thread in a client that reopens this session."""
        self._close_run()
        updates = list(self.transcript)
        if self.title:
            updates.append(session_info_update(self.title, iso_time(self.updated)))
        return updates

    def to_json(self) -> dict:
        """The file's content: metadata (META_KEYS) and body, as one dict of shallow copies."""
        self._close_run()
        return {"version": 2, "sessionId": self.id, "cwd": self.cwd,
                "additionalDirectories": list(self.additional_dirs), "mode": self.mode,
                "model": self.model, "title": self.title, "createdAt": iso_time(self.created),
                "updatedAt": iso_time(self.updated), "created": self.created,
                "updated": self.updated, "contextUsed": self.context_used,
                "messages": list(self.messages), "transcript": list(self.transcript),
                "plan": list(self.plan), "allowed": dict(self.allowed),
                "jobs": [dict(j) for j in self.jobs], "effort": self.effort,
                "autoCompact": self.auto_compact, "cost": self.cost,
                "changes": list(self.changes)}

    @classmethod
    def from_json(cls, session_id: str, data: dict) -> Session:
        """A session from its file, trusting nothing in it: the id is the file's name, and
        entries of the wrong shape are dropped rather than sent to the client."""
        def text(key: str) -> str:
            return data[key] if isinstance(data.get(key), str) else ""

        def number(key: str) -> float:
            value = data.get(key)
            return float(value) if isinstance(value, (int, float)) else time.time()
        messages = data.get("messages") if isinstance(data.get("messages"), list) else []
        transcript = data.get("transcript") if isinstance(data.get("transcript"), list) else []
        allowed = data.get("allowed") if isinstance(data.get("allowed"), dict) else {}
        session = cls(id=session_id, cwd=text("cwd"), mode=text("mode"), model=text("model"),
                      title=text("title"), created=number("created"), updated=number("updated"),
                      messages=[m for m in messages if isinstance(m, dict)
                                and isinstance(m.get("role"), str)],
                      transcript=[u for u in transcript if replayable(u)],
                      allowed={k: v for k, v in allowed.items() if isinstance(v, dict)
                               and isinstance(v.get("allow"), bool)
                               and isinstance(v.get("label"), str)})
        dirs = data.get("additionalDirectories")
        session.additional_dirs = [d for d in dirs if isinstance(d, str)] \
            if isinstance(dirs, list) else []
        jobs = data.get("jobs") if isinstance(data.get("jobs"), list) else []
        session.jobs = [j for j in jobs if isinstance(j, dict) and isinstance(j.get("id"), str)
                        and isinstance(j.get("schedule"), str) and isinstance(j.get("prompt"),
                                                                              str)
                        and isinstance(j.get("recurring"), bool)
                        and isinstance(j.get("next"), (int, float))]
        latest_plan = [u for u in session.transcript if u["sessionUpdate"] == "plan"]
        session.plan = latest_plan[-1]["entries"] if latest_plan else []
        used = data.get("contextUsed")
        if isinstance(used, int) and not isinstance(used, bool) and used > 0:
            session.context_used, session.context_mark = used, len(session.messages)
        if session.mode not in MODE_IDS:
            session.mode = "default"
        session.effort = text("effort") if text("effort") in EFFORTS else ""
        session.auto_compact = data.get("autoCompact") is not False
        changes = data.get("changes") if isinstance(data.get("changes"), list) else []
        session.changes = [c for c in changes if undoable(c)]
        cost = data.get("cost")
        session.cost = float(cost) if isinstance(cost, (int, float)) and \
            not isinstance(cost, bool) and 0 <= cost < 1e12 else 0.0
        for i, update in enumerate(session.transcript):
            if update["sessionUpdate"] == "tool_call":
                session._tool_at[update["toolCallId"]] = i
        return session


def undoable(change: Any) -> bool:
    """Is a saved /undo record of the shape qcr writes?"""
    return isinstance(change, dict) and isinstance(change.get("id"), str) and \
        isinstance(change.get("path"), str) and isinstance(change.get("source", ""), str) and \
        all(change.get(k) is None or isinstance(change.get(k), str) for k in ("before", "after"))


def replayable(update: Any) -> bool:
    """Is a saved transcript entry of a shape qcr itself writes?"""
    if not isinstance(update, dict):
        return False
    kind = update.get("sessionUpdate")
    if kind in ("user_message_chunk", "agent_message_chunk", "agent_thought_chunk"):
        content = update.get("content")
        return isinstance(content, dict) and (
            content.get("type") == "text" and isinstance(content.get("text"), str) or
            content.get("type") == "image" and isinstance(content.get("data"), str) and
            isinstance(content.get("mimeType"), str))
    if kind == "tool_call":
        return isinstance(update.get("toolCallId"), str) and isinstance(update.get("title"), str)
    if kind == "plan":
        entries = update.get("entries")
        return isinstance(entries, list) and all(
            isinstance(e, dict) and isinstance(e.get("content"), str) for e in entries)
    if kind == "compaction_update":
        summary = update.get("summary") or []
        return isinstance(update.get("compactionId"), str) and \
            isinstance(update.get("status"), str) and isinstance(summary, list) and all(
                isinstance(b, dict) and isinstance(b.get("text"), str) for b in summary)
    return False


META_KEYS = ("version", "sessionId", "cwd", "additionalDirectories", "title", "mode", "model",
             "createdAt", "updatedAt", "created", "updated", "contextUsed", "generation")
LIST_PAGE = 50      # sessions per session/list page


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


class SessionDamaged(Exception):
    """A session file that cannot be read back (truncated, corrupt, not qcr's)."""


class SessionConflict(Exception):
    """Another qcr process wrote the session since this one read it: ours went aside."""


class SessionStore:
    """One file per session under `root`, written off the event loop.

    All file work goes through a single worker thread, so writes land in the order they
    were asked for, and a list or delete sees every save asked for before it. Each write is
    a temporary file, fsync, then rename: a crash (even SIGKILL) leaves the old file or the
    new one, never half of one.
    """

    def __init__(self, root: str):
        self.root = root
        self._executor = None
        self.known: dict = {}     # session id -> the file's generation as this process left it
        self.waiting: dict = {}   # session id -> [newest snapshot, its future]: not yet written
        self.sizes: dict = {}     # session id -> characters of the body last written
        self.lock = threading.Lock()

    def path(self, session_id: str) -> str:
        if not SESSION_ID_RE.fullmatch(session_id):    # never a path outside root
            raise RpcError.invalid_params("sessionId", "is not a qcr session id")
        return os.path.join(self.root, session_id + ".json")

    def submit(self, fn: Callable, *args) -> Any:
        """Run fn in the store's worker thread; a concurrent.futures.Future."""
        from concurrent.futures import ThreadPoolExecutor
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="qcr-store")
        return self._executor.submit(fn, *args)

    def run(self, fn: Callable, *args) -> Any:
        """The same, awaitable from the event loop."""
        return asyncio.wrap_future(self.submit(fn, *args))

    def save(self, session: Session) -> Any:
        """Queue a write of the session; a concurrent.futures.Future of the write that will
        hold this state. Saves never fall behind: while a session's write waits its turn, a
        newer snapshot replaces the one it would write, and both callers share it."""
        from concurrent.futures import Future
        snapshot = session.to_json()      # shallow copies: later appends don't race the write
        with self.lock:
            waiting = self.waiting.get(session.id)
            if waiting is not None:
                waiting[0] = snapshot
                return waiting[1]
            self.waiting[session.id] = [snapshot, Future()]
            done = self.waiting[session.id][1]
        self.submit(self._write_newest, session.id)
        return done

    def _write_newest(self, session_id: str) -> None:
        with self.lock:
            snapshot, done = self.waiting.pop(session_id)
        try:
            self._write(self.path(session_id), snapshot)
        except Exception as e:
            done.set_exception(e)
        else:
            done.set_result(None)

    def _write(self, path: str, data: dict) -> None:
        """Write a snapshot -- unless another process wrote the file since this one last
        read or wrote it: then ours goes beside it (`<id>.json.conflict-<pid>`), both are
        kept, and SessionConflict says where."""
        session_id = data["sessionId"]
        on_disk = self.generation(path)
        known = self.known.get(session_id)
        generation = max(on_disk or 0, known or 0) + 1
        body = json.dumps({k: v for k, v in data.items() if k not in META_KEYS},
                          separators=(",", ":"))
        meta = {k: data[k] for k in META_KEYS if k in data}
        meta.update(generation=generation, bodyChars=len(body))   # ASCII: chars are bytes
        self.sizes[session_id] = len(body)
        text = json.dumps(meta, separators=(",", ":")) + "\n" + body + "\n"
        private_dir(self.root)
        if on_disk is not None and on_disk != known:
            aside = f"{path}.conflict-{os.getpid()}"
            write_private(aside, text)
            raise SessionConflict(f"another qcr changed this session since it was opened "
                                  f"here; its version was kept, and this thread's is in {aside}")
        write_private(path, text)
        self.known[session_id] = generation

    def generation(self, path: str) -> Optional[int]:
        """The generation of the session file at path; None if there is none (or no
        readable one: a damaged file is overwritten, as a lost one would be)."""
        try:
            with open(path, "rb") as f:
                meta = loads(f.readline().decode("ascii"))
        except (OSError, ValueError):
            return None
        value = meta.get("generation", 0) if isinstance(meta, dict) else 0
        return value if isinstance(value, int) else 0

    def flush(self) -> None:
        """Wait for every save asked for so far."""
        if self._executor is not None:
            self.submit(lambda: None).result()

    @staticmethod
    def read_meta(f: Any) -> dict:
        """The metadata line of an open session file, checked against the file's size."""
        first = f.readline()
        meta = loads(first.decode("ascii"))
        if not isinstance(meta, dict) or not isinstance(meta.get("bodyChars"), int):
            raise SessionDamaged("no metadata line")
        if os.fstat(f.fileno()).st_size != len(first) + meta["bodyChars"] + 1:
            raise SessionDamaged("the file is truncated")
        return meta

    def read(self, session_id: str) -> dict:
        """The whole file as one dict; SessionDamaged if it cannot be trusted."""
        self.sweep(session_id)
        try:
            with open(self.path(session_id), "rb") as f:
                meta = self.read_meta(f)
                body = loads(f.read().decode("ascii"))
        except FileNotFoundError:
            raise
        except (OSError, ValueError, RecursionError) as e:
            raise SessionDamaged(str(e)) from None
        if not isinstance(body, dict):
            raise SessionDamaged("the body is not a JSON object")
        generation = meta.get("generation", 0)
        self.known[session_id] = generation if isinstance(generation, int) else 0
        return {**body, **meta}

    async def load(self, session_id: str) -> Session:
        """A saved session; -32002 if there is none, SessionDamaged if it is unreadable."""
        try:
            data = await self.run(self.read, session_id)
        except FileNotFoundError:
            raise RpcError.resource_not_found(f"no saved session {session_id}",
                                              sessionId=session_id) from None
        return Session.from_json(session_id, data)

    def sweep(self, session_id: str) -> None:
        """Remove temporary files that a killed qcr left behind for this session."""
        prefix = session_id + ".json."
        try:
            names = [n for n in os.listdir(self.root) if n.startswith(prefix)]
        except OSError:
            return
        for name in names:
            pid = name[len(prefix):-len(".tmp")]
            if name.endswith(".tmp") and pid.isdigit() and not process_alive(int(pid)):
                try:
                    os.remove(os.path.join(self.root, name))
                except OSError:
                    pass

    def move_aside(self, session_id: str) -> str:
        """Keep a damaged file for the user, out of the way; returns where it went."""
        path = self.path(session_id)
        aside = f"{path}.damaged-{time.strftime('%Y%m%d-%H%M%S')}"
        os.replace(path, aside)
        return aside

    def delete(self, session_id: str) -> bool:
        self.known.pop(session_id, None)
        try:
            os.remove(self.path(session_id))
            return True
        except FileNotFoundError:
            return False

    def list(self) -> list:
        """Metadata of every readable session, newest first; damaged files are skipped."""
        try:
            names = [n for n in os.listdir(self.root) if n.endswith(".json")]
        except OSError:
            return []
        found = []
        for name in names:
            if not SESSION_ID_RE.fullmatch(name[:-5]):
                continue
            try:
                with open(os.path.join(self.root, name), "rb") as f:
                    meta = self.read_meta(f)
            except (OSError, ValueError, SessionDamaged):
                continue
            if isinstance(meta.get("cwd"), str) and isinstance(meta.get("updated"), (int, float)):
                found.append(dict(meta, sessionId=name[:-5]))
        return sorted(found, key=lambda m: m["updated"], reverse=True)


# =============================================================================================
# 4. Providers: streaming replies from a model server
# =============================================================================================
#
# Two wire formats cover nearly every model. OpenAI's chat completions -- spoken by OpenAI,
# Ollama, llama.cpp, vLLM, LM Studio, OpenRouter, Gemini's compatible endpoint -- stream
# server-sent events like these:
#
#   data: {"choices":[{"index":0,"delta":{"content":"Hel"}}]}
#   data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_1",
#          "function":{"name":"ReadFile","arguments":"{\"pa"}}]}}]}
#   data: [DONE]
#
# Anthropic's Messages API streams typed events (content_block_start, content_block_delta,
# message_delta, ...). Messages are kept in one canonical shape (OpenAI's) and each provider
# converts at its edge. urllib blocks, so each request runs in a daemon thread that feeds an
# asyncio queue; the agent loop streams every delta to the client as it arrives. Cancel shuts
# the socket down, which ends the thread's blocking read at once. Busy servers (429, 5xx) and
# failed connections are retried with backoff -- but only before the first byte of a reply.

MAX_EVENT_BYTES = 16 << 20    # longest line (one event) read from a model or MCP stream


class ProviderError(Exception):
    """The model call failed; the message says what happened and how to fix it.

    `retry` marks failures worth another try (busy server, lost connection) when nothing
    of the reply has arrived yet; `retry_after` is the server's own advice, in seconds.
    """

    def __init__(self, message: str, status: Optional[int] = None, retry: bool = False,
                 retry_after: Optional[float] = None, summary: str = "",
                 nobody_home: bool = False, detail: str = ""):
        super().__init__(message)
        self.detail = detail               # the server's own words, without qcr's hints
        self.status, self.retry, self.retry_after = status, retry, retry_after
        self.summary = summary or message.split(". ")[0]   # for the one-line retry note
        self.nobody_home = nobody_home    # this machine refused: no server is listening


NOT_CONFIGURED = ("no model is configured. Point qcr at an OpenAI-compatible server: set "
                  "OPENAI_BASE_URL (e.g. http://127.0.0.1:11434/v1 for Ollama) and "
                  "OPENAI_MODEL, plus OPENAI_API_KEY for a hosted API -- or ANTHROPIC_API_KEY "
                  "-- in the agent's \"env\" in your editor settings, or in ~/.qcr/config.json "
                  "(see the README), or run `python3 qcr.py --login`.")


def bounded_lines(stream: Any, limit: int = MAX_EVENT_BYTES) -> Any:
    """The lines of a response, none longer than `limit`: a server cannot make qcr hold a
    line of any size in memory (ValueError when one is longer)."""
    while True:
        line = stream.readline(limit + 1)
        if not line:
            return
        if len(line) > limit:
            raise ValueError(f"a line of the stream passed {limit // (1 << 20)} MiB")
        yield line


def parse_sse(lines) -> Any:
    """Yield the data of each server-sent event from an iterable of byte lines."""
    data: list = []
    for raw in lines:
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
                data = []
            continue
        name, _, value = line.partition(":")
        if name == "data":
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield "\n".join(data)


def takes_sampling_params(model: str) -> bool:
    """o-series and codex models reject temperature/top_p."""
    name = model.lower().rsplit("/", 1)[-1]
    return not (re.match(r"o\d", name) or "codex" in name)


def repair_json(text: str) -> Optional[Any]:
    """Arguments cut off mid-stream: close the open string and brackets, if that is all
    that is missing. None if the text still is not JSON."""
    stack, in_string, escaped = [], False, False
    for c in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (c == "\\", c != '"')
        elif c == '"':
            in_string = True
        elif c in "{[":
            stack.append("}" if c == "{" else "]")
        elif c in "}]" and stack:
            stack.pop()
    repaired = text + ('"' if in_string else "") + "".join(reversed(stack))
    try:
        return loads(repaired)
    except ValueError:
        return None


class ThinkTags:
    """Splits inline <think>...</think> (or <thinking>) text out of a content stream, so
    models that put their reasoning in the answer still show it as thoughts. A tag split
    across two chunks is held back until it is complete."""

    OPEN, CLOSE = ("<think>", "<thinking>"), ("</think>", "</thinking>")

    def __init__(self):
        self.thinking, self.held = False, ""

    def feed(self, text: str) -> list:
        """[(kind, text)] for the new text: kind is 'agent_message_chunk' or a thought."""
        if "<" not in text and not self.held:       # the usual chunk: no tag in sight
            return [(self.kind(), text)]
        text, self.held, out = self.held + text, "", []
        while text:
            tags = self.CLOSE if self.thinking else self.OPEN
            found = min(((text.find(t), t) for t in tags if t in text), default=None)
            if found is None:
                keep = max((len(text) - i for t in tags for i in range(len(text))
                            if t.startswith(text[i:])), default=0)
                self.held, text = text[len(text) - keep:], text[:len(text) - keep]
                out.append((self.kind(), text))
                break
            at, tag = found
            out.append((self.kind(), text[:at]))
            self.thinking, text = not self.thinking, text[at + len(tag):]
        return [(kind, t) for kind, t in out if t]

    def kind(self) -> str:
        return "agent_thought_chunk" if self.thinking else "agent_message_chunk"

    def flush(self) -> list:
        """At the reply's end: what was held back (a "<" that began no tag), as it was."""
        held, self.held = self.held, ""
        return [(self.kind(), held)] if held else []


@dataclass
class Reply:
    """One model reply as it streams in: text, thoughts, tool calls, why it stopped."""
    parts: list = field(default_factory=list)
    thoughts: list = field(default_factory=list)
    calls: list = field(default_factory=list)       # [{"id", "name", "arguments"}]
    finish: str = ""          # OpenAI's words: stop, length, tool_calls, content_filter
    usage: Optional[dict] = None
    thinking_blocks: list = field(default_factory=list)   # Anthropic's, signed, sent back
    started: bool = False     # a byte of the reply has arrived: too late to retry
    max_chars: int = 1 << 62          # the bounds a hostile server meets (Config.max_reply_…)
    max_calls: int = 1 << 62
    max_argument_chars: int = 1 << 62
    chars: int = 0                    # text and thoughts so far
    dropped: int = 0                  # tool calls past max_calls, not kept
    _slots: dict = field(default_factory=dict)      # stream index -> call (None: dropped)
    tags: ThinkTags = field(default_factory=ThinkTags)   # <think> in this reply's text

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def say(self, kind: str, text: str, emit: Callable) -> None:
        self.chars += len(text)
        if self.chars > self.max_chars:
            raise ProviderError(f"the model's reply passed {self.max_chars:,} characters, so "
                                "qcr stopped reading it there (maxReplyChars).",
                                summary="the reply was too long")
        (self.thoughts if kind == "agent_thought_chunk" else self.parts).append(text)
        emit(kind, text)

    def add_tool_delta(self, delta: Any) -> None:
        """Assemble tool calls from deltas: by index, arguments arriving in pieces; a delta
        with a new id on a used index starts a new call; one with neither id nor index
        continues the last call."""
        if not isinstance(delta, dict):
            return
        index, call_id = delta.get("index"), delta.get("id")
        function = delta.get("function") if isinstance(delta.get("function"), dict) else {}
        if index is not None and index in self._slots and self._slots[index] is None:
            return                              # a call that was dropped: its rest too
        slot = self._slots.get(index) if index is not None else (
            self.calls[-1] if self.calls and not call_id else None)
        if slot is None or (call_id and slot["id"] and call_id != slot["id"]):
            if len(self.calls) >= self.max_calls:
                self.dropped += 1
                self._slots[index] = None
                return
            slot = {"id": "", "name": "", "arguments": ""}
            self.calls.append(slot)
            self._slots[index] = slot
        if isinstance(call_id, str) and call_id and not slot["id"]:
            slot["id"] = call_id
        if isinstance(function.get("name"), str) and function["name"] and not slot["name"]:
            slot["name"] = function["name"]
        arguments = function.get("arguments")
        if isinstance(arguments, dict):        # some servers send the object itself
            arguments = json.dumps(arguments)
        if isinstance(arguments, str) and not slot.get("cut"):
            if len(slot["arguments"]) + len(arguments) > self.max_argument_chars:
                slot["cut"], slot["arguments"] = True, ""     # kept neither here nor saved
            else:
                slot["arguments"] += arguments

    def message(self) -> dict:
        """The assistant message for the model's context (canonical, OpenAI's shape)."""
        message: dict = {"role": "assistant", "content": self.text}
        if self.thoughts:
            message["reasoning_content"] = "".join(self.thoughts)
        if self.thinking_blocks:
            message["thinking_blocks"] = self.thinking_blocks
        if self.calls:
            for call in self.calls:
                call["id"] = call["id"] or "call_" + os.urandom(6).hex()
                if call["arguments"].strip():
                    try:
                        loads(call["arguments"])
                    except ValueError:
                        repaired = repair_json(call["arguments"])
                        if isinstance(repaired, dict):
                            call["arguments"] = json.dumps(repaired)
            message["tool_calls"] = [
                {"id": c["id"], "type": "function",
                 "function": {"name": c["name"], "arguments": c["arguments"] or "{}"}}
                for c in self.calls]
        return message


def open_url(url: str, data: Optional[bytes] = None, headers: Optional[dict] = None,
             secrets: Optional[dict] = None, timeout: Optional[float] = 30.0,
             redirects: int = 5, method: Optional[str] = None) -> Any:
    """Open an http(s) URL -- qcr's one HTTP client; the caller closes the response.

    `secrets` (an API key, an MCP server's headers) go to the URL's origin alone: a
    redirect to another origin (scheme, host and port) never carries them, and a redirect
    off http(s) is refused. With redirects=0 a redirect is not followed: it raises an
    HTTPError whose headers hold its Location. The proxy environment is honoured.
    """
    import urllib.error
    import urllib.request
    from urllib.parse import urlparse
    if urlparse(url).scheme not in ("http", "https"):
        raise urllib.error.URLError(f"only http(s) URLs are opened, not {url!r}")
    origin = origin_of(url)
    secrets = secrets or {}

    class Redirects(urllib.request.HTTPRedirectHandler):
        """urllib's redirects, bounded, with the secrets re-added on the same origin only."""
        max_redirections = redirects

        def redirect_request(self, request, fp, code, message, headers, new_url):
            if redirects == 0:
                return None
            if urlparse(new_url).scheme not in ("http", "https"):
                raise urllib.error.URLError(f"{url} redirected to {new_url}, which is not "
                                            "http(s)")
            new = super().redirect_request(request, fp, code, message, headers, new_url)
            if new is not None and origin_of(new_url) == origin:
                for name, value in secrets.items():
                    new.add_unredirected_header(name, value)
            return new
    request = urllib.request.Request(url, data, dict(headers or {}), method=method)
    for name, value in secrets.items():
        request.add_unredirected_header(name, value)   # never copied to a redirect
    opener = urllib.request.build_opener(Redirects)
    return opener.open(request, timeout=timeout)


def origin_of(url: str) -> tuple:
    from urllib.parse import urlparse
    parsed = urlparse(url)
    default = {"http": 80, "https": 443}.get(parsed.scheme)
    try:
        port = parsed.port or default
    except ValueError:
        port = None
    return parsed.scheme, (parsed.hostname or "").lower(), port


class HttpStream:
    """One streaming HTTP POST, read in a daemon thread into an asyncio queue.

    Queue items: ("data", obj) per event, ("whole", obj) for a non-streamed answer,
    ("error", ProviderError), and finally ("end", saw_done).
    """

    def __init__(self, url: str, headers: dict, body: bytes, timeout: float, base_url: str,
                 secrets: Optional[dict] = None):
        self.url, self.headers, self.body, self.secrets = url, headers, body, secrets
        self.timeout, self.base_url = timeout, base_url
        self.response = None
        self.aborted = False
    def start(self, queue: asyncio.Queue) -> None:
        """Read in a thread; items reach `queue` as lists: one loop wake-up per batch.

        The thread waits while a batch is full and the loop has not taken it, so a server
        that floods faster than the editor reads is held back by the editor's pace (and a
        cancel does not wait behind a backlog).
        """
        loop = asyncio.get_running_loop()
        batch: list = []
        lock = threading.Condition()

        def deliver() -> None:
            with lock:
                items = batch[:]
                batch.clear()
                lock.notify()
            queue.put_nowait(items)

        def put(kind: str, item: Any) -> None:
            if self.aborted:
                return
            with lock:
                while len(batch) >= STREAM_BATCH and not self.aborted:
                    lock.wait(0.1)
                batch.append((kind, item))
                first = len(batch) == 1
            if first:       # a wake-up is due only when the batch was empty
                loop.call_soon_threadsafe(deliver)
        threading.Thread(target=self._run, args=(put,), daemon=True, name="qcr-http").start()

    def _run(self, put: Callable) -> None:
        import urllib.error
        try:
            self.response = response = open_url(self.url, self.body, self.headers,
                                                self.secrets, self.timeout, method="POST")
            if self.aborted:
                return response.close()
            if "text/event-stream" not in response.headers.get("Content-Type", ""):
                return put("whole", loads(response.read(MAX_EVENT_BYTES)))   # not streamed
            for data in parse_sse(bounded_lines(response)):
                if data.strip() == "[DONE]":
                    return put("end", True)
                put("data", loads(data))
            put("end", False)
        except urllib.error.HTTPError as e:
            put("error", http_error(e.code, e.read(4000) if e.fp else b"", self.base_url,
                                    e.headers.get("Retry-After") if e.headers else None))
        except ValueError as e:
            put("error", ProviderError(f"the model server sent a malformed stream ({e})."))
        except Exception as e:
            if self.aborted:
                return
            reason = getattr(e, "reason", e)
            host = origin_of(self.url)[1]
            refused = isinstance(reason, ConnectionRefusedError) and (
                host in ("localhost", "::1") or host.startswith("127."))
            put("error", ProviderError(
                f"cannot reach the model server at {self.base_url} ({reason}). Is it running? "
                "Check the base URL: QCR_BASE_URL or OPENAI_BASE_URL in the environment, "
                "or baseUrl in ~/.qcr/config.json.", retry=True,
                summary=f"cannot reach the model server at {self.base_url}",
                nobody_home=refused))

    def abort(self) -> None:
        """Stop reading: shut the socket so the thread's blocking read returns now."""
        self.aborted = True
        response = self.response
        if response is not None:
            import socket
            try:
                response.fp.raw._sock.shutdown(socket.SHUT_RDWR)
            except Exception:
                pass


def http_error(status: int, body: bytes, base_url: str,
               retry_after: Optional[str] = None) -> ProviderError:
    """A ProviderError for an HTTP error status, with the server's words and a fix."""
    detail = body.decode("utf-8", "replace").strip()
    try:
        error = json.loads(detail).get("error")
        detail = error.get("message", detail) if isinstance(error, dict) else str(error or detail)
    except (ValueError, AttributeError):
        pass
    hint = {
        400: "the server rejected the request (does this model support tool calls?)",
        401: "the API key was refused: set OPENAI_API_KEY or ANTHROPIC_API_KEY (or apiKey / "
             "anthropicApiKey in ~/.qcr/config.json)",
        403: "access denied: check the API key and that it may use this model",
        404: f"not found: check the base URL ({base_url}; it usually ends in /v1) "
             "and the model name",
        429: "rate limited or out of quota: wait a moment and try again",
    }.get(status, "the model server failed; try again" if status >= 500 else "request failed")
    wait = None
    if retry_after:
        try:
            wait = max(0.0, float(retry_after))
        except ValueError:      # an HTTP date
            from email.utils import parsedate_to_datetime
            try:
                wait = max(0.0, parsedate_to_datetime(retry_after).timestamp() - time.time())
            except (TypeError, ValueError):
                wait = None
    error = ProviderError(f"the model server answered HTTP {status}: {detail[:500]} -- {hint}.",
                          status, retry=status == 429 or status >= 500, retry_after=wait,
                          summary=f"the model server answered HTTP {status}: "
                                  f"{detail.splitlines()[0][:120] if detail else hint}",
                          detail=detail)
    if rejects_tools(error):      # a 500 that says so will not change on a retry
        error.retry = False
    return error


RETRY_FIRST = 1.0              # seconds before the first retry; doubled each time, jittered
RETRY_MAX_WAIT = 20.0          # longest single wait between tries
NOBODY_HOME_BUDGET = 3.0       # seconds of retrying a refused connection on this machine


class Provider:
    """One model server: how to ask it (url, headers, body) and how to read its stream.

    `stream()` is shared: it starts the HTTP request, applies each event as it arrives, and
    retries a busy or unreachable server with backoff -- within `retryBudget` seconds, and
    only while nothing of the reply has arrived. Subclasses convert messages and events.
    """

    def __init__(self, config: Config, model: str):
        self.config, self.model = config, model
        self.effort = ""            # a level of effort_levels(), or "" for the model's default

    async def stream(self, messages: list, tools: list, reply: Reply,
                     emit: Callable[[str, str], None]) -> Reply:
        """Stream one reply into `reply`, calling emit(kind, text) for each chunk."""
        if not self.base_url() or not self.model:
            raise ProviderError(NOT_CONFIGURED)
        body = json.dumps(self.request_body(messages, tools)).encode()
        start, attempt = time.monotonic(), 0
        deadline = start + self.config.retry_budget
        while True:
            try:
                return await self.attempt(body, reply, emit)
            except ProviderError as e:
                attempt += 1
                if e.nobody_home:     # a local server not started: say so soon, not later
                    deadline = min(deadline, start + NOBODY_HOME_BUDGET)
                wait = e.retry_after if e.retry_after is not None else min(
                    RETRY_MAX_WAIT, RETRY_FIRST * 2 ** (attempt - 1)) * random_jitter()
                if e.nobody_home:
                    wait = min(wait, 0.5)
                if not e.retry or reply.started or time.monotonic() + wait > deadline:
                    raise
                emit("notice:warning", f"_[{e.summary}; retrying in {wait:.0f} s]_\n\n")
                await asyncio.sleep(wait)       # cancel lands here too

    async def attempt(self, body: bytes, reply: Reply, emit: Callable) -> Reply:
        call = HttpStream(self.url(), self.headers(), body, self.config.request_timeout,
                          self.base_url(), self.secrets())
        queue: asyncio.Queue = asyncio.Queue()
        call.start(queue)
        try:
            while not self.consume(await queue.get(), reply, emit):
                pass
        finally:
            call.abort()
        for kind, text in reply.tags.flush():      # a reply ending in "<" keeps it
            reply.say(kind, text, emit)
        return reply

    def consume(self, items: list, reply: Reply, emit: Callable) -> bool:
        """Apply a batch of stream items; True once the reply is complete."""
        for kind, item in items:
            if kind == "data":
                reply.started = True
                self.apply_event(item, reply, emit)
            elif kind == "whole":
                reply.started = True
                self.apply_whole(item, reply, emit)
                return True
            elif kind == "error":
                raise item
            else:
                if not item and not reply.finish:
                    raise ProviderError("the model stream ended before the reply was "
                                        "complete (the connection dropped); try again.",
                                        retry=not reply.started)
                return True
        return False

    def base_url(self) -> str:
        return self.config.base_url

    def url(self) -> str:
        raise NotImplementedError

    def headers(self) -> dict:
        return {"Content-Type": "application/json", "Accept": "text/event-stream",
                "User-Agent": f"qcr/{__version__}"}

    def secrets(self) -> dict:
        """The credentials: sent to the model server's origin and nowhere else."""
        return {}

    def request_body(self, messages: list, tools: list) -> dict:
        raise NotImplementedError

    def apply_event(self, event: Any, reply: Reply, emit: Callable) -> None:
        raise NotImplementedError

    def apply_whole(self, answer: Any, reply: Reply, emit: Callable) -> None:
        raise ProviderError("the model server did not stream its answer.")


def random_jitter() -> float:
    import random
    return random.uniform(0.5, 1.5)


class OpenAIProvider(Provider):
    """Chat completions: OpenAI and every server that speaks its API, quirks included."""

    def url(self) -> str:
        return self.config.base_url.rstrip("/") + "/chat/completions"

    def secrets(self) -> dict:
        return {"Authorization": "Bearer " + self.config.api_key} if self.config.api_key else {}

    def request_body(self, messages: list, tools: list) -> dict:
        body: dict = {"model": self.model, "messages": [self.outgoing(m) for m in messages],
                      "stream": True, "stream_options": {"include_usage": True}}
        if tools:
            body["tools"] = tools
        if self.config.temperature is not None and takes_sampling_params(self.model):
            body["temperature"] = self.config.temperature
        if self.config.max_tokens:
            body["max_tokens"] = self.config.max_tokens
        if self.effort:
            body["reasoning_effort"] = self.effort
        return body

    def outgoing(self, message: dict) -> dict:
        """A canonical message as this server takes it: qcr's own keys dropped; reasoning
        sent back only when configured (some servers require it, others reject it)."""
        out = {k: v for k, v in message.items() if k in ("role", "content", "tool_calls",
                                                           "tool_call_id", "name")}
        if self.config.send_reasoning and message.get("reasoning_content"):
            out["reasoning_content"] = message["reasoning_content"]
        if out.get("role") == "assistant" and out.get("content") is None:
            out["content"] = ""
        return out

    def apply_event(self, chunk: Any, reply: Reply, emit: Callable) -> None:
        if not isinstance(chunk, dict):
            return
        if chunk.get("error"):
            error = chunk["error"]
            message = error.get("message") if isinstance(error, dict) else error
            raise ProviderError(f"the model server reported an error mid-stream: {message}")
        if isinstance(chunk.get("usage"), dict):
            reply.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
            thought = delta.get("reasoning_content") or delta.get("reasoning")
            if isinstance(thought, str) and thought:
                reply.say("agent_thought_chunk", thought, emit)
            content = delta.get("content")
            if isinstance(content, str) and content:
                for kind, text in reply.tags.feed(content):
                    reply.say(kind, text, emit)
            for tool_delta in delta.get("tool_calls") or []:
                reply.add_tool_delta(tool_delta)
            if choice.get("finish_reason"):
                reply.finish = str(choice["finish_reason"])

    def apply_whole(self, completion: Any, reply: Reply, emit: Callable) -> None:
        """A server that ignored "stream": one JSON completion, replayed as one delta."""
        if not isinstance(completion, dict):
            raise ProviderError("the model server sent an answer qcr cannot read.")
        choices = []
        for choice in completion.get("choices") or []:
            message = choice.get("message") if isinstance(choice, dict) else None
            if isinstance(message, dict):
                calls = [dict(c, index=i) for i, c in enumerate(message.get("tool_calls") or [])
                         if isinstance(c, dict)]
                choices.append({"delta": dict(message, tool_calls=calls),
                                "finish_reason": choice.get("finish_reason") or "stop"})
        self.apply_event({"choices": choices, "usage": completion.get("usage"),
                          "error": completion.get("error")}, reply, emit)
        if not reply.finish:
            raise ProviderError("the model server's answer had no choices.")


ANTHROPIC_STOPS = {"end_turn": "stop", "stop_sequence": "stop", "pause_turn": "stop",
                   "tool_use": "tool_calls", "max_tokens": "length", "refusal": "content_filter"}


class AnthropicProvider(Provider):
    """Anthropic's Messages API: typed stream events; thinking blocks are kept with their
    signatures and sent back, as the API requires when tools are used."""

    def base_url(self) -> str:
        return self.config.anthropic_base_url

    def url(self) -> str:
        base = self.base_url().rstrip("/")
        return base + ("/messages" if base.endswith("/v1") else "/v1/messages")

    def headers(self) -> dict:
        return dict(super().headers(), **{"anthropic-version": "2023-06-01"})

    def secrets(self) -> dict:
        return {"x-api-key": self.config.anthropic_api_key}

    def request_body(self, messages: list, tools: list) -> dict:
        system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
        body: dict = {"model": self.model, "max_tokens": self.config.max_tokens or 8192,
                      "stream": True, "system": system,
                      "messages": to_anthropic([m for m in messages if m["role"] != "system"])}
        if tools:
            body["tools"] = [{"name": t["function"]["name"],
                              "description": t["function"]["description"],
                              "input_schema": t["function"]["parameters"]} for t in tools]
        budget = THINKING_BUDGETS.get(self.effort, 0 if self.effort == "off" else
                                      self.config.thinking_budget)
        if budget:
            body["thinking"] = {"type": "enabled", "budget_tokens": budget}
            body["max_tokens"] = max(body["max_tokens"], budget + 1024)
        elif self.config.temperature is not None:
            body["temperature"] = self.config.temperature
        return body

    def apply_event(self, event: Any, reply: Reply, emit: Callable) -> None:
        kind = event.get("type") if isinstance(event, dict) else None
        if kind == "error":
            error = event.get("error") if isinstance(event.get("error"), dict) else {}
            raise ProviderError(f"the model server reported an error mid-stream: "
                                f"{error.get('message', error)}",
                                retry=error.get("type") == "overloaded_error" and
                                not reply.parts and not reply.calls)
        if kind == "message_start":
            usage = (event.get("message") or {}).get("usage")
            if isinstance(usage, dict):
                reply.usage = {"prompt_tokens": usage.get("input_tokens", 0)}
        elif kind == "content_block_start":
            block = event.get("content_block") or {}
            if block.get("type") == "tool_use":
                reply.add_tool_delta({"index": event.get("index"), "id": block.get("id"),
                                      "function": {"name": block.get("name"), "arguments": ""}})
            elif block.get("type") in ("thinking", "redacted_thinking"):
                reply.thinking_blocks.append(dict(block))
            elif block.get("type") == "text" and block.get("text"):
                reply.say("agent_message_chunk", block["text"], emit)
        elif kind == "content_block_delta":
            delta = event.get("delta") or {}
            if delta.get("type") == "text_delta":
                reply.say("agent_message_chunk", delta.get("text", ""), emit)
            elif delta.get("type") == "thinking_delta" and reply.thinking_blocks:
                reply.thinking_blocks[-1]["thinking"] = \
                    reply.thinking_blocks[-1].get("thinking", "") + delta.get("thinking", "")
                reply.say("agent_thought_chunk", delta.get("thinking", ""), emit)
            elif delta.get("type") == "signature_delta" and reply.thinking_blocks:
                reply.thinking_blocks[-1]["signature"] = delta.get("signature", "")
            elif delta.get("type") == "input_json_delta":
                reply.add_tool_delta({"index": event.get("index"),
                                      "function": {"arguments": delta.get("partial_json", "")}})
        elif kind == "message_delta":
            stop = (event.get("delta") or {}).get("stop_reason")
            if stop:
                reply.finish = ANTHROPIC_STOPS.get(stop, "stop")
            usage = event.get("usage")
            if isinstance(usage, dict) and reply.usage is not None:
                reply.usage["completion_tokens"] = usage.get("output_tokens", 0)
                reply.usage["total_tokens"] = reply.usage.get("prompt_tokens", 0) + \
                    usage.get("output_tokens", 0)


def to_anthropic(messages: list) -> list:
    """Canonical messages as Anthropic takes them: tool calls as tool_use blocks, results as
    tool_result blocks in a user turn, images as base64 sources, roles alternating."""
    out: list = []

    def add(role: str, blocks: list) -> None:
        if out and out[-1]["role"] == role:
            out[-1]["content"].extend(blocks)
        else:
            out.append({"role": role, "content": blocks})
    for message in messages:
        role, content = message.get("role"), message.get("content")
        if role == "tool":
            add("user", [{"type": "tool_result", "tool_use_id": message.get("tool_call_id"),
                          "content": str(content or "")}])
        elif role == "assistant":
            blocks = list(message.get("thinking_blocks") or [])
            if content:
                blocks.append({"type": "text", "text": content})
            for call in message.get("tool_calls") or []:
                function = call.get("function") or {}
                try:
                    arguments = loads(function.get("arguments") or "{}")
                except ValueError:
                    arguments = {}
                blocks.append({"type": "tool_use", "id": call.get("id"),
                               "name": function.get("name"),
                               "input": arguments if isinstance(arguments, dict) else {}})
            add("assistant", blocks or [{"type": "text", "text": "(no reply)"}])
        else:
            add("user", user_blocks(content))
    if out and out[0]["role"] != "user":
        out.insert(0, {"role": "user", "content": [{"type": "text", "text": "(continue)"}]})
    return out


def user_blocks(content: Any) -> list:
    if not isinstance(content, list):
        return [{"type": "text", "text": str(content or "(empty)")}]
    blocks = []
    for part in content:
        if part.get("type") == "text":
            blocks.append({"type": "text", "text": part.get("text") or "(empty)"})
        elif part.get("type") == "image_url":
            url = (part.get("image_url") or {}).get("url", "")
            match = re.match(r"data:([^;]+);base64,(.*)", url, re.S)
            if match:
                blocks.append({"type": "image", "source": {
                    "type": "base64", "media_type": match.group(1), "data": match.group(2)}})
    return blocks


PROVIDERS = {"openai": OpenAIProvider, "anthropic": AnthropicProvider}


def make_provider(config: Config, model: str, effort: str = "") -> Provider:
    provider = PROVIDERS[config.provider](config, model)
    provider.effort = effort if effort in effort_levels(config, model) else ""
    return provider


EFFORTS = {"off": "Off", "low": "Low", "medium": "Medium", "high": "High"}
THINKING_BUDGETS = {"low": 2048, "medium": 8192, "high": 24576}    # Anthropic, tokens
REASONING_MODELS = re.compile(r"(^|[/:_ -])(o[1-9]|gpt-5|gpt-oss|deepseek-r|qwq|qwen3|"
                              r"magistral|grok-[3-9]|phi-4-reasoning)", re.I)


def effort_levels(config: Config, model: str) -> list:
    """The reasoning levels a model takes: Anthropic's thinking models a budget (or none),
    OpenAI-style reasoning models `reasoning_effort`; [] for models that take neither."""
    if config.provider == "anthropic":
        old = re.search(r"claude-(instant|2|3-(opus|sonnet|haiku|5))", model)
        return [] if old else ["off", "low", "medium", "high"]
    return ["low", "medium", "high"] if REASONING_MODELS.search(model or "") else []


# =============================================================================================
# 5. Tools: what the model can do
# =============================================================================================
#
# A tool is an async function registered with @tool: its docstring is the description the
# model reads, its parameters a small JSON schema. Every call shows up in the editor as a
# tool call card: announced as `pending` with a title, a kind (the card's icon) and the
# files it touches; `in_progress` once running; then `completed` or `failed` with content.
# A tool declares its effects, and calls `ctx.permit()` with what it is about to do just
# before it does it -- the one permission path (the policy below), which knows the mode,
# who started the turn and the user's remembered answers. A ToolError is an
# expected failure: its message goes back to the model as the result, so it can correct
# itself; it never ends the turn.

class ToolError(Exception):
    """An expected tool failure; the model reads the message."""


@dataclass
class ToolResult:
    """What a tool call produced: the model's text, the card's content, its raw output."""
    output: str                                    # what the model reads
    content: list = field(default_factory=list)    # what the user sees (ToolCallContent)
    raw: Any = None                                # rawOutput, shown when content is empty
    locations: Optional[list] = None               # replaces the announced locations
    replay: Optional[list] = None                  # content for a replay, if not `content`


@dataclass
class Tool:
    """One tool the model can call: its schema, what it may do (`effects`, which the
    permission policy decides on), and the card's icon (`kind`, which it never does)."""
    name: str
    kind: str                   # ACP ToolKind: read, edit, delete, move, search, execute, …
    run: Callable
    description: str
    parameters: dict
    effects: tuple              # what it may do: read, write, delete, execute, network, …
    title: Callable             # (args, ctx) -> the card's title
    modes: tuple = ()           # the modes that offer it to the model; () = all
    web: bool = False           # needs the network: not offered when "web" is false


TOOLS: dict = {}      # tool name as the model sees it -> Tool, filled by @tool


def tool(name: str, kind: str, params: dict, *, required: tuple = (), effects: tuple = (),
         title: Optional[Callable] = None, modes: tuple = (), web: bool = False):
    """Register an async function as a tool the model can call."""
    import inspect
    assert all(e in EFFECTS for e in effects), effects

    def register(run):
        TOOLS[name] = Tool(name, kind, run, inspect.cleandoc(run.__doc__ or name),
                           {"type": "object", "properties": params, "required": list(required)},
                           effects, title or (lambda args, ctx: name), modes, web)
        return run
    return register


def arg(type_name: str, description: str, **extra) -> dict:
    """One parameter's JSON schema."""
    return {"type": type_name, "description": description, **extra}


def tool_specs(mode: str, web: bool = True, extra: Optional[dict] = None) -> list:
    """The tools as the model is offered them (qcr's and `extra`, a session's MCP tools)."""
    every = list(TOOLS.values()) + list((extra or {}).values())
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": t.parameters}}
            for t in every if offered(t, mode, web)]


def offered(tool_: Tool, mode: str, web: bool = True) -> bool:
    """Does the model get this tool in this mode? Not when the policy refuses what it does
    there (plan mode: every change), nor web tools while the web is off."""
    if tool_.web and not web:
        return False
    return (not tool_.modes or mode in tool_.modes) and \
        all(verdict(mode, effect, "user") != REFUSE for effect in tool_.effects)


# -- The permission policy ---------------------------------------------------------------------
#
# Every call that touches the machine is decided here, once, at the moment it acts: qcr's
# tools, MCP tools of every transport, a project plugin's servers, and scheduled turns. The
# inputs are what the call will do -- its *effects*, declared by each tool (never read off
# its ACP kind, which is only the card's icon) -- where it does it (paths with symlinks
# resolved, inside or outside the session's folders; a host), the session's mode, who
# started the turn (the user, or a scheduled job), and the ledger of remembered answers.
# The verdict is allow, ask (the ledger, then a permission card) or refuse.

ALLOW, ASK, REFUSE = "allow", "ask", "refuse"
EFFECTS = ("read", "write", "delete", "execute", "network", "schedule", "mode")
POLICY = {   # what a call does, and where -> the verdict in each of MODE_IDS' modes
    #                      default  plan    auto-edit  yolo
    "read":               (ALLOW,  ALLOW,  ALLOW,     ALLOW),
    "read outside":       (ASK,    REFUSE, ASK,       ALLOW),
    "write":              (ASK,    REFUSE, ALLOW,     ALLOW),
    "write outside":      (ASK,    REFUSE, ASK,       ALLOW),
    "delete":             (ASK,    REFUSE, ALLOW,     ALLOW),
    "delete outside":     (ASK,    REFUSE, ASK,       ALLOW),
    "execute":            (ASK,    REFUSE, ASK,       ALLOW),   # also: writing inside .git
    "network":            (ASK,    ASK,    ASK,       ALLOW),
    "network private":    (ASK,    ASK,    ASK,       ASK),     # loopback, LAN, link-local
    "schedule":           (ASK,    REFUSE, ASK,       ALLOW),
    "mode":               (ASK,    ASK,    ASK,       ASK),     # ExitPlanMode's card
}
NOT_FROM_JOBS = ("schedule", "mode")   # what a scheduled turn may never do
PLAN_REFUSAL = ("Refused: the session is in plan mode, which is read-only. Explore and write "
                "the plan; the user switches the mode when it is time to make changes.")
JOB_REFUSAL = ("Refused: this turn was started by a scheduled job, and scheduled turns may "
               "not schedule prompts or change the mode; the user can, in a prompt of theirs.")
DECLINED = ("The user declined this. Do not try it again; ask the user what to do instead, "
            "or take another approach.")


def verdict(mode: str, row: str, origin: str) -> str:
    """The policy's answer for one effect (a POLICY row) in a mode, for a turn's origin."""
    if origin != "user" and row.split()[0] in NOT_FROM_JOBS:
        return REFUSE
    return POLICY[row][MODE_IDS.index(mode) if mode in MODE_IDS else 0]


def real_path(path: str, follow: bool = True) -> str:
    """The path with every symlink resolved -- but the last one when `follow` is false."""
    if follow:
        return os.path.realpath(path)
    return os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))


def path_need(roots: list, effect: str, real: str, home: str = "") -> tuple:
    """(POLICY row, ledger key, label) for an effect on a real path (symlinks resolved).

    A change where it could make a program run is execute: in a .git or .qcr folder (hooks,
    git configuration, plugins, commands), in the git folder a .git file names (worktrees,
    `gitdir: .bare`), in qcr's own home (its ledger, its MCP servers). Outside the roots is
    a row of its own -- and so is a write to a file with other names (hard links), which
    may be anywhere, .git/config included.
    """
    if effect != "read":
        guard = guarded_folder(real, roots, home)
        if guard:
            return "execute", f"Guarded={real}", f"this change inside {guard} ({real})"
    if not within(real, roots, resolved=True):
        folder = real if os.path.isdir(real) else os.path.dirname(real)
        words = {"read": "reading", "write": "changes", "delete": "deleting"}[effect]
        return f"{effect} outside", f"Outside:{effect}:{folder}", f"{words} in {folder}"
    if effect == "write" and hard_linked(real):
        return ("write outside", f"Outside:write:{real}",
                f"changes to {real}, which has other names (hard links) that may be anywhere")
    if effect == "read":
        return "read", "", ""
    return effect, "edit", "file changes"


def guarded_folder(real: str, roots: list, home: str) -> str:
    """The folder that makes a change at a real path a way to run programs, or "": a .git
    or .qcr folder, qcr's home, a git folder by another name (HEAD, objects/ and refs/ in
    it), or the one a .git file in a folder above names (`gitdir: .bare`)."""
    parts = real.lower().split(os.sep)
    for name in (".git", ".qcr"):
        if name in parts:
            return name
    if home and within(real, [home]):
        return home
    folder = os.path.dirname(real)
    while within(folder, roots, resolved=True):
        if all(os.path.exists(os.path.join(folder, n)) for n in ("HEAD", "objects", "refs")):
            return folder
        try:        # (a .git folder is covered by its name above)
            line = (read_own_file(os.path.join(folder, ".git"), folder, 4096) or "").strip()
        except OSError:
            line = ""
        if line.startswith("gitdir:"):
            named = os.path.realpath(os.path.join(folder, line[len("gitdir:"):].strip()))
            if within(real, [named], resolved=True):
                return named
        if folder == os.path.dirname(folder):
            break
        folder = os.path.dirname(folder)
    return ""


def hard_linked(real: str) -> bool:
    try:
        info = os.stat(real)
    except OSError:
        return False
    return stat.S_ISREG(info.st_mode) and info.st_nlink > 1


def check_args(tool_: Tool, args: Any) -> dict:
    """Validate (and gently coerce) the model's arguments; a ToolError names what is wrong."""
    if not isinstance(args, dict):
        raise ToolError("the arguments must be a JSON object")
    for name in tool_.parameters["required"]:
        if args.get(name) is None:
            raise ToolError(f"missing required argument {name!r}")
    checked = {}
    for name, spec in tool_.parameters["properties"].items():
        value = args.get(name)
        if value is not None:
            checked[name] = coerce(name, value, spec)
    return checked


def coerce(name: str, value: Any, spec: dict) -> Any:
    """Accept what weak models send -- "10" for 10, "true" for true -- and nothing worse.
    (A schema richer than one plain type, as MCP tools may have, is left to the tool.)"""
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind not in ("integer", "boolean", "array", "object", "string"):
        return value
    if kind == "integer":
        if isinstance(value, str) and re.fullmatch(r"-?\d+", value.strip()):
            value = int(value)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif kind == "boolean":
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if isinstance(value, bool):
            return value
    elif kind in ("array", "object"):
        if isinstance(value, str):
            try:
                value = loads(value)
            except ValueError:
                pass
        if isinstance(value, list if kind == "array" else dict):
            return value
    elif kind == "string":
        if isinstance(value, str):
            if "enum" in spec and value not in spec["enum"]:
                raise ToolError(f"argument {name!r} must be one of {', '.join(spec['enum'])}")
            return value
    raise ToolError(f"argument {name!r} must be {'an' if kind[0] in 'aeio' else 'a'} {kind}")


class ToolContext:
    """What a running tool may use: the session and its folders, the editor's buffers and
    terminals, and the permission policy, asked through `permit()`."""

    def __init__(self, agent: Agent, session: Session, call_id: str, tool_: Optional[Tool],
                 card: dict):
        self.agent, self.session, self.call_id, self.tool = agent, session, call_id, tool_
        self.card = card             # the tool_call as announced: kind, title, rawInput, …
        self.title = card.get("title", "")
        self.started = False
        self.approved: dict = {}     # path -> (its real path when the policy decided, follow)
        self.cleared: set = set()    # ledger keys the user allowed for this call

    @property
    def cwd(self) -> str:
        return self.session.cwd

    def display(self, path: str) -> str:
        """A path as the user would write it: relative inside the project."""
        relative = os.path.relpath(path, self.cwd)
        return path if relative.startswith("..") else relative

    def update(self, **fields) -> None:
        self.agent.update(self.session, tool_call_update(self.call_id, **fields))

    def start(self) -> None:
        if not self.started:
            self.started = True
            self.update(status="in_progress")

    def plan(self, entries: list) -> None:
        self.session.plan = entries
        self.agent.update(self.session, plan(entries))

    # -- paths --------------------------------------------------------------------------------
    def inside(self, path: str) -> bool:
        return within(path, self.session.roots())

    def resolve(self, path: Any) -> str:
        """An absolute path; a relative one is taken from the session's cwd."""
        if not isinstance(path, str) or not path.strip():
            raise ToolError("a path must be a non-empty string")
        if "\0" in path:
            raise ToolError("a path cannot contain a NUL character")
        return absolute(self.cwd, path)

    def on_path(self, effect: str, path: str) -> tuple:
        """The policy's need for an effect on a path; its real path is kept for `real()`.
        Deleting or moving acts on a link itself, not on what it points to."""
        follow = effect != "delete"
        self.approved[path] = (real_path(path, follow), follow)
        return path_need(self.session.roots(), effect, self.approved[path][0],
                         self.agent.config.home)

    def real(self, path: str) -> str:
        """The real path to open now -- refused if it no longer leads where it led when the
        policy decided (a folder swapped for a symlink while the card was open)."""
        then, follow = self.approved.get(path, ("", True))
        now = real_path(path, follow)
        if then != now:
            raise ToolError(f"{path} now leads to {now}, not where it led when this call "
                            "was cleared; nothing was done. Check the path and try again.")
        return now

    # -- files, through the editor when it offers them ----------------------------------------
    async def read(self, path: str, remember: bool = True) -> Optional[str]:
        """A file's text as the user sees it, None if there is no such file.

        Inside the project, and when the editor offers fs/read_text_file, the editor answers
        (unsaved changes included); otherwise the disk does. qcr remembers a digest of what
        it read, for the stale-write guard in read_for_change().
        """
        real = self.real(path)
        on_disk = await asyncio.to_thread(check_regular, real)   # a FIFO is never opened
        text = None
        if self.agent.client_can("fs", "readTextFile") and self.inside(real):
            try:
                result = await self.agent.conn.request(
                    "fs/read_text_file", {"sessionId": self.session.id, "path": real})
                if isinstance(result, dict) and isinstance(result.get("content"), str):
                    text = result["content"]
            except RpcError as e:      # the editor's word stands -- unless it has no such
                if e.code != METHOD_NOT_FOUND and on_disk:    # method, or no such file
                    raise ToolError(f"the editor could not read {path}: {e.message}") \
                        from None
        if text is None and on_disk:
            text = await asyncio.to_thread(read_text, real)
        if remember and text is not None:
            self.session.seen[path] = digest(text)
        return text

    async def read_for_change(self, path: str) -> Optional[str]:
        """The text of a file about to change -- refused if it changed since qcr read it.

        Reading it is a read of its own, cleared first: outside the roots, the tool's own
        answers ("old_string was not found") must not tell the model about a file the user
        has not let it read.
        """
        then = self.approved.get(path, (real_path(path), True))[0]
        await self.permit([], path_need(self.session.roots(), "read", then,
                                        self.agent.config.home))
        seen = self.session.seen.get(path)
        text = await self.read(path, remember=False)
        if seen is not None and (text is None or digest(text) != seen):
            raise StaleFile(f"{path} has changed since you last read it (in the editor, or "
                            "by a command). Read it again, then make the change.")
        return text

    async def write(self, path: str, text: str) -> None:
        """Write a file through the editor when it can (its buffers, its review of changes),
        else to disk -- at the real path checked now, never through a swapped link."""
        real = self.real(path)
        if self.agent.client_can("fs", "writeTextFile") and self.inside(real):
            try:
                os.makedirs(os.path.dirname(real), exist_ok=True)
                await self.agent.conn.request("fs/write_text_file", {
                    "sessionId": self.session.id, "path": real, "content": text})
                await self.read(path)      # format-on-save may have changed what landed
                return
            except OSError as e:
                raise ToolError(f"cannot create the folder for {path}: {e.strerror}") from None
            except RpcError as e:        # never behind the editor's back, unless it has no
                if e.code != METHOD_NOT_FOUND:                    # such method after all
                    raise ToolError(f"the editor refused to write {path}: {e.message}; "
                                    "nothing was written") from None
                log(f"fs/write_text_file is not there for {real}; writing to disk")
        await asyncio.to_thread(write_text, real, text)
        self.session.seen[path] = digest(text)

    def changed(self, path: str, before: Optional[str], after: Optional[str],
                source: str = "") -> None:
        """Keep what a file change replaced, for /undo: the exact previous text (None: the
        file did not exist), what the change left (None: deleted), a move's source. The
        oldest go first past UNDO_CHARS."""
        self.session.changes.append({"id": self.call_id, "path": path, "before": before,
                                     "after": after, "source": source, "at": time.time()})
        total = sum(len(c["before"] or "") + len(c["after"] or "")
                    for c in self.session.changes)
        while total > UNDO_CHARS and len(self.session.changes) > 1:
            gone = self.session.changes.pop(0)
            total -= len(gone["before"] or "") + len(gone["after"] or "")

    # -- permission ---------------------------------------------------------------------------
    async def permit(self, content: list, *needs: tuple) -> None:
        """Clear this call with the policy, or raise ToolError. Each need is (POLICY row,
        ledger key, label); a row of the "ask" kind is settled by a remembered answer for
        its key, else by one permission card for all of them, showing `content`."""
        unsettled = []
        for key, label in self.check(needs):
            remembered = await self.agent.ledger.lookup(self.session, key) if key else None
            if remembered is False:
                raise ToolError(DECLINED)
            if remembered is None and key not in self.cleared:
                unsettled.append((key, label))
        if unsettled and not content:     # say why a read asks: where it goes
            content = [text_content(
                f"{self.tool.name if self.tool else 'qcr'} wants to use {path}, which is "
                "outside the project's folders.") for path, (real, _) in self.approved.items()
                if not within(real, self.session.roots(), resolved=True)]
        if unsettled and not await self.ask(content, unsettled):
            raise ToolError(DECLINED)
        self.cleared.update(key for key, _ in unsettled)
        self.start()

    def check(self, needs: tuple) -> list:
        """The policy's verdicts for the needs: ToolError on a refusal, else the (key,
        label) of each that asks."""
        session, asks = self.session, []
        origin = (session.origin or {}).get("source", "user")
        for row, key, label in needs:
            effect = row.split()[0]
            if self.tool is not None and effect not in self.tool.effects:
                raise RuntimeError(f"{self.tool.name} did not declare the effect {effect}")
            answer = verdict(session.mode, row, origin)
            if answer == REFUSE and origin != "user" and effect in NOT_FROM_JOBS:
                raise ToolError(JOB_REFUSAL)
            if answer == REFUSE and row.endswith("outside"):
                raise ToolError(f"Refused: {label} is outside the project's folders, and "
                                f"{session.mode} mode stays inside them.")
            if answer == REFUSE:
                raise ToolError(PLAN_REFUSAL)
            if answer == ASK and all(key != k for k, _ in asks):
                asks.append((key, label))
        return asks

    async def ask(self, content: list, needs: list) -> bool:
        """The permission card: once, or remembered for the session, project or everywhere
        (for every need it covers)."""
        label = " and ".join(label for _, label in needs)
        options = [("allow_once", "Allow", "allow_once")]
        if all(key for key, _ in needs):
            options += [
                ("allow_session", f"Allow {label} for this session", "allow_always"),
                ("allow_project", f"Always allow {label} in this project", "allow_always"),
                ("allow_global", f"Always allow {label} everywhere", "allow_always")]
        options.append(("reject_once", "Reject", "reject_once"))
        if all(key for key, _ in needs):
            options += [
                ("reject_session", f"Reject {label} for this session", "reject_always"),
                ("reject_project", f"Always reject {label} in this project", "reject_always")]
        choice = await self.choose(content, options)
        if choice is None:
            raise ToolError("The permission request was cancelled or failed; not done.")
        allowed, _, scope = choice.partition("_")
        if scope in SCOPES:
            for key, label in needs:
                await self.agent.ledger.remember(self.session, scope, key, allowed == "allow",
                                                 label)
        return allowed == "allow"

    async def choose(self, content: list, options: list) -> Optional[str]:
        """Show a card with buttons (session/request_permission); the chosen optionId, or None
        if the request was cancelled or failed. The request carries the whole tool call --
        kind, title, rawInput, locations, status -- so a client that approves by kind
        cannot mistake a command for a read."""
        card = tool_call_update(self.call_id, title=self.title, content=content)
        self.session.record(card)    # the request itself carries it to the client
        announced = {k: v for k, v in self.card.items() if k != "sessionUpdate"}
        request = {"sessionId": self.session.id,
                   "toolCall": {**announced, "toolCallId": self.call_id, "title": self.title,
                                "content": content, "status": "pending"},
                   "options": [{"optionId": o, "name": n, "kind": k} for o, n, k in options]}
        try:
            result = await self.agent.conn.request("session/request_permission", request)
        except RpcError as e:
            log(f"session/request_permission failed: {e.message}")
            return None
        outcome = result.get("outcome") if isinstance(result, dict) else None
        outcome = outcome if isinstance(outcome, dict) else {}
        valid = {o for o, _, _ in options}
        if outcome.get("outcome") != "selected" or outcome.get("optionId") not in valid:
            return None
        return outcome["optionId"]


class StaleFile(ToolError):
    """The file changed since qcr last read it: the change is not made."""


SCOPES = ("session", "project", "global")


def absolute(cwd: str, path: str) -> str:
    """A path as the tools take it: ~ expanded, relative ones from the session's cwd."""
    return os.path.normpath(os.path.join(cwd, os.path.expanduser(path.strip())))


def within(path: str, roots: list, resolved: bool = False) -> bool:
    """Is the path in one of the folders, once symlinks are resolved (`resolved`: they are)?"""
    real = path if resolved else os.path.realpath(path)
    for root in roots:
        root = os.path.realpath(root)
        if real == root or real.startswith(root.rstrip(os.sep) + os.sep):
            return True
    return False


def digest(text: str) -> str:
    import hashlib
    return hashlib.sha1(text.encode("utf-8", "surrogatepass")).hexdigest()


class Ledger:
    """Remembered permission answers: a session's live in the session (and its file); a
    project's and everywhere's in ~/.qcr/permissions.json, shared by every qcr."""

    def __init__(self, path: str):
        self.path = path

    def read(self) -> dict:
        try:
            with open(self.path, encoding="utf-8") as f:
                data = loads(f.read())
        except (OSError, ValueError):
            data = {}
        data = data if isinstance(data, dict) else {}
        valid = lambda entries: {k: v for k, v in entries.items() if isinstance(v, dict) and
                                 isinstance(v.get("allow"), bool) and
                                 isinstance(v.get("label"), str)} \
            if isinstance(entries, dict) else {}
        projects = data.get("projects") if isinstance(data.get("projects"), dict) else {}
        return {"version": 1, "global": valid(data.get("global")),
                "projects": {p: valid(e) for p, e in projects.items()}}

    def change(self, edit: Callable[[dict], None]) -> None:
        """Read, edit and write the file under a lock, so that two qcr processes answering
        at once both keep their answers; the write is atomic and private."""
        private_dir(os.path.dirname(self.path))
        with open(os.open(self.path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)) as lock:
            try:
                import fcntl
                fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            except ImportError:        # no fcntl (Windows): the atomic write still holds
                pass
            data = self.read()
            edit(data)
            write_private(self.path, json.dumps(data, indent=1))

    async def scoped(self, session: Session) -> list:
        """(scope, key, entry) for every answer that applies to the session, nearest first."""
        data = await asyncio.to_thread(self.read)
        return ([("session", k, v) for k, v in session.allowed.items()] +
                [("project", k, v) for k, v in data["projects"].get(session.cwd, {}).items()] +
                [("global", k, v) for k, v in data["global"].items()])

    async def lookup(self, session: Session, key: str) -> Optional[bool]:
        for _, found, entry in await self.scoped(session):
            if found == key:
                return entry["allow"]
        return None

    async def remember(self, session: Session, scope: str, key: str, allow: bool,
                       label: str) -> None:
        entry = {"allow": allow, "label": label}
        if scope == "session":
            session.allowed[key] = entry
            return
        def edit(data: dict) -> None:
            (data["global"] if scope == "global" else
             data["projects"].setdefault(session.cwd, {}))[key] = entry
        try:
            await asyncio.to_thread(self.change, edit)
        except OSError as e:
            log(f"could not save {self.path}: {e}")
            session.allowed[key] = entry

    async def revoke(self, session: Session, scope: str, key: str) -> None:
        if scope == "session":
            session.allowed.pop(key, None)
            return
        await asyncio.to_thread(self.change, lambda data: (data["global"] if scope == "global" else
                                  data["projects"].get(session.cwd, {})).pop(key, None))


UNDO_CHARS = 8_000_000         # text kept for /undo, per session (the oldest go first)
READ_LINES = 2000              # lines ReadFile returns by default
READ_CHARS = 200_000           # most characters ReadFile returns at once
LINE_CHARS = 2000              # longer lines are cut in ReadFile and Grep output
LIST_LIMIT = 500               # most entries LS and Glob return
SEARCH_FILE_BYTES = 8 << 20    # Grep skips larger files
SEARCH_TIMEOUT = 60            # seconds before a Grep is stopped
SHELL_OUTPUT_CHARS = 30_000    # Shell keeps this much output: head and tail
SHELL_TIMEOUT = 120            # seconds, default for Shell; at most SHELL_TIMEOUT_MAX
SHELL_TIMEOUT_MAX = 600
SHOW_EVERY = 0.25              # seconds between updates of a running command's output


def check_regular(path: str) -> bool:
    """True for a regular file, False if nothing is there; ToolError for anything else.

    Opening a FIFO or a device would block the whole agent, so tools never do.
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return False
    except OSError as e:
        raise ToolError(f"cannot use {path}: {e.strerror}") from None
    if stat.S_ISDIR(mode):
        raise ToolError(f"{path} is a directory, not a file")
    if not stat.S_ISREG(mode):
        raise ToolError(f"{path} is not a regular file (a pipe, socket or device); "
                        "qcr does not open those")
    return True


def read_text(path: str) -> Optional[str]:
    """A text file's exact content (newlines untouched), None if it does not exist."""
    if not check_regular(path):
        return None
    try:
        with open(path, encoding="utf-8", newline="") as f:
            return f.read()
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise ToolError(f"{path} is a directory, not a file") from None
    except UnicodeDecodeError:
        raise ToolError(f"{path} is not UTF-8 text; qcr edits text files only") from None
    except OSError as e:
        raise ToolError(f"cannot read {path}: {e.strerror}") from None


def write_text(path: str, text: str) -> None:
    """Write a file's whole text -- never through a link at the last step of its path
    (the tools pass a real path: a link found there now was put there since)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(os.open(path, flags, 0o666), "w", encoding="utf-8", newline="") as f:
            f.write(text)
    except OSError as e:
        raise ToolError(f"cannot write {path}: {e.strerror}") from None


def count_lines(text: str) -> int:
    return text.count("\n") + (1 if text and not text.endswith("\n") else 0)


def path_title(verb: str, key: str = "path") -> Callable:
    return lambda args, ctx: f"{verb} {args.get(key) or ''}".strip()


# -- Files -------------------------------------------------------------------------------------

READ_WHOLE_BYTES = 16 << 20    # larger files are paged straight from disk


@tool("ReadFile", "read", {
    "path": arg("string", "The file, absolute or relative to the project root"),
    "offset": arg("integer", "First line to read, 1-based (default 1)"),
    "limit": arg("integer", f"How many lines to read (default {READ_LINES})"),
}, required=("path",), effects=("read",), title=path_title("Read"))
async def read_file(ctx: ToolContext, path: str, offset: int = 1, limit: int = READ_LINES):
    """Read a text file. Each line comes as: line number, a tab, the text. Long files are
    read a page at a time: pass offset and limit to read further."""
    full = ctx.resolve(path)
    await ctx.permit([], ctx.on_path("read", full))
    offset, limit = max(1, offset), max(1, limit)
    real = ctx.real(full)
    try:
        size, binary = await asyncio.to_thread(probe_file, real)
        if binary:
            return ToolResult(f"{full} is a binary file ({size} bytes); not shown.",
                              raw={"path": full, "binary": True, "bytes": size})
        if size > READ_WHOLE_BYTES:         # paged from disk, in bounded memory
            shown, total = await asyncio.to_thread(page_file, real, offset, limit)
        else:
            text = await ctx.read(full)
            if text is None:
                raise ToolError(f"no such file: {full}. Use LS or Glob to find the right path.")
            shown, total = await asyncio.to_thread(page_text, text, offset, limit)
    except OSError as e:
        raise ToolError(f"cannot read {full}: {e.strerror}") from None
    if total == 0:
        return ToolResult(f"{full} is empty.", raw={"path": full, "lines": 0})
    if not shown:
        raise ToolError(f"offset {offset} is past the end of {full} ({total} lines)")
    last = offset + len(shown) - 1
    output = "\n".join(shown)
    if last < total:
        output += (f"\n[lines {offset}-{last} of {total}; "
                   f"read on with offset={last + 1}]")
    return ToolResult(output, raw={"path": full, "lines": [offset, last], "totalLines": total},
                      locations=[{"path": full, "line": offset}])


def probe_file(path: str) -> tuple:
    """(size, looks binary) of a regular file; (0, False) if there is none."""
    if not check_regular(path):
        return 0, False
    with open(path, "rb") as f:
        return os.fstat(f.fileno()).st_size, b"\0" in f.read(8192)


def page_text(text: str, offset: int, limit: int) -> tuple:
    """Numbered lines offset..offset+limit-1 of a text (long ones cut), and its line count."""
    lines = text.split("\n") if text else []
    if text.endswith("\n"):
        lines.pop()
    shown, chars = [], 0
    for number in range(offset, min(offset + limit, len(lines) + 1)):
        if chars > READ_CHARS:
            break
        shown.append(numbered(number, lines[number - 1], False))
        chars += len(shown[-1])
    return shown, len(lines)


def page_file(path: str, offset: int, limit: int, block_size: int = 1 << 20) -> tuple:
    """page_text for a file too large to hold (a 400 MiB log, a 512 MB line): it is read in
    blocks, lines outside the page are only counted, and of a line on the page only its
    first LINE_CHARS characters are kept."""
    keep = LINE_CHARS * 4                  # bytes: LINE_CHARS characters of UTF-8 at most
    shown, chars, number, line, cut, ended = [], 0, 1, bytearray(), False, True
    buffer = bytearray(block_size)         # one buffer, reused: no allocation per block
    with open(path, "rb", buffering=0) as f:
        while True:
            size = f.readinto(buffer)
            if not size:
                break
            block = memoryview(buffer)[:size].tobytes() if size < block_size else buffer
            ended, start = block.endswith(b"\n"), 0
            before = offset - number
            if before > 0 and block.count(b"\n") < before:     # the page is further on
                number += block.count(b"\n")
                continue
            while start < len(block):
                if number < offset:                           # before the page: skip lines
                    end = block.find(b"\n", start)
                    if end < 0:
                        break
                    number, start = number + 1, end + 1
                elif len(shown) >= limit or chars > READ_CHARS:   # after it: count them
                    number += block.count(b"\n", start)
                    break
                else:                                          # on it: keep a line's head
                    end = block.find(b"\n", start)
                    piece = block[start:end if end >= 0 else len(block)]
                    cut = cut or len(line) + len(piece) > keep
                    line += piece[:max(keep - len(line), 0)]
                    if end < 0:
                        break
                    shown.append(numbered(number, line.decode("utf-8", "replace"), cut))
                    chars += len(shown[-1])
                    number, start, line, cut = number + 1, end + 1, bytearray(), False
    if line or cut:                       # a last line with no newline, on the page
        shown.append(numbered(number, line.decode("utf-8", "replace"), cut))
    return shown, number - (1 if ended else 0)


def numbered(number: int, line: str, cut: bool) -> str:
    """One line as ReadFile shows it: its number, a tab, its text (cut when long)."""
    line = line.rstrip("\r\n")
    if cut or len(line) > LINE_CHARS:
        line = line[:LINE_CHARS] + " [line cut]"
    return f"{number:6}\t{line}"


@tool("WriteFile", "edit", {
    "path": arg("string", "The file to create or replace"),
    "content": arg("string", "The whole new content of the file"),
}, required=("path", "content"), effects=("read", "write", "execute"),
    title=path_title("Write"))
async def write_file(ctx: ToolContext, path: str, content: str):
    """Create a file, or replace a file's whole content. Parent folders are created. To change
    part of an existing file, use EditFile."""
    full = ctx.resolve(path)
    need = ctx.on_path("write", full)
    old = await ctx.read_for_change(full)
    diff = diff_content(full, old, content)
    await ctx.permit([diff], need)
    await ctx.write(full, content)
    ctx.changed(full, old, content)
    verb = "Created" if old is None else "Replaced"
    return ToolResult(f"{verb} {full} ({count_lines(content)} lines).", [diff],
                      {"path": full, "created": old is None, "bytes": len(content.encode()),
                       "undo": f"/undo {ctx.call_id}"},
                      [{"path": full, "line": 1}])


@tool("EditFile", "edit", {
    "path": arg("string", "The file to edit"),
    "old_string": arg("string", "The exact text to replace, including whitespace; it must "
                                "occur exactly once unless replace_all is true"),
    "new_string": arg("string", "The text to put in its place"),
    "replace_all": arg("boolean", "Replace every occurrence (default false)"),
}, required=("path", "old_string", "new_string"), effects=("read", "write", "execute"),
    title=path_title("Edit"))
async def edit_file(ctx: ToolContext, path: str, old_string: str, new_string: str,
                    replace_all: bool = False):
    """Replace exact text in a file. Read the file first and copy old_string exactly,
    with its indentation. An empty old_string creates a new file with new_string."""
    full = ctx.resolve(path)
    need = ctx.on_path("write", full)
    text = await ctx.read_for_change(full)
    existed = text is not None
    if text is None:
        if old_string:
            raise ToolError(f"no such file: {full}. Create it with WriteFile.")
        text = ""
    elif not old_string and text:
        raise ToolError(f"{full} is not empty: old_string may be empty only to create a file "
                        "or fill an empty one.")
    if old_string == new_string:
        raise ToolError("old_string and new_string are the same; nothing would change.")
    count = text.count(old_string) if old_string else 1
    if count == 0 and "\r\n" in text and "\r" not in old_string:   # a CRLF file
        crlf = old_string.replace("\n", "\r\n")
        if text.count(crlf):
            old_string, new_string = crlf, new_string.replace("\n", "\r\n")
            count = text.count(crlf)
    if count == 0:
        raise ToolError(f"old_string was not found in {full}. Read the file again and copy "
                        "the exact text, including whitespace and indentation.")
    if count > 1 and not replace_all:
        raise ToolError(f"old_string occurs {count} times in {full}. Include more of the "
                        "surrounding lines to make it unique, or set replace_all to true.")
    if not old_string:
        new_text = new_string
    else:
        new_text = text.replace(old_string, new_string, -1 if replace_all else 1)
    line = text[:text.find(old_string)].count("\n") + 1 if old_string else 1
    diff = diff_content(full, text if existed else None, new_text)
    await ctx.permit([diff], need)
    await ctx.write(full, new_text)
    ctx.changed(full, text if existed else None, new_text)
    replaced = count if replace_all else 1
    return ToolResult(f"Edited {full}: replaced {replaced} occurrence(s) at line {line}.",
                      [diff], {"path": full, "replacements": replaced, "line": line,
                               "undo": f"/undo {ctx.call_id}"},
                      [{"path": full, "line": line}])


@tool("DeleteFile", "delete", {
    "path": arg("string", "The file to delete"),
}, required=("path",), effects=("read", "delete", "execute"), title=path_title("Delete"))
async def delete_file(ctx: ToolContext, path: str):
    """Delete a file (not a folder)."""
    full = ctx.resolve(path)
    if os.path.isdir(full):
        raise ToolError(f"{full} is a directory; DeleteFile deletes files only.")
    if not os.path.lexists(full):
        raise ToolError(f"no such file: {full}")
    need = ctx.on_path("delete", full)
    old = None
    try:
        old = await ctx.read_for_change(full)
        shown = diff_content(full, old or "", "")
    except StaleFile:
        raise
    except ToolError:
        shown = text_content(f"Delete {full}")     # not text: a sentence instead of a diff
    await ctx.permit([shown], need)
    try:
        await asyncio.to_thread(os.remove, ctx.real(full))
    except OSError as e:
        raise ToolError(f"cannot delete {full}: {e.strerror}") from None
    if old is not None:                   # (a file that is not text cannot come back)
        ctx.changed(full, old, None)
    ctx.session.seen.pop(full, None)
    return ToolResult(f"Deleted {full}.", [shown], {"path": full, "deleted": True, "undo": (
        f"/undo {ctx.call_id}" if old is not None else None)})


@tool("MoveFile", "move", {
    "source": arg("string", "The file or folder to move"),
    "destination": arg("string", "Where it goes; must not exist yet"),
}, required=("source", "destination"), effects=("read", "write", "delete", "execute"),
    title=lambda args, ctx: f"Move {args.get('source')} → {args.get('destination')}")
async def move_file(ctx: ToolContext, source: str, destination: str):
    """Move or rename a file or folder. Parent folders of the destination are created."""
    src, dst = ctx.resolve(source), ctx.resolve(destination)
    if not os.path.lexists(src):
        raise ToolError(f"no such file: {src}")
    if os.path.lexists(dst):
        raise ToolError(f"{dst} already exists; choose another destination or delete it first.")
    shown = text_content(f"Move {src} → {dst}")
    await ctx.permit([shown], ctx.on_path("delete", src), ctx.on_path("write", dst))
    try:
        await asyncio.to_thread(move_path, ctx.real(src), ctx.real(dst))
    except OSError as e:
        raise ToolError(f"cannot move {src}: {e.strerror or e}") from None
    ctx.changed(dst, None, None, source=src)
    ctx.session.seen.pop(src, None)
    return ToolResult(f"Moved {src} to {dst}.", [shown], {"source": src, "destination": dst,
                                                          "undo": f"/undo {ctx.call_id}"},
                      [{"path": dst}])


def move_path(source: str, destination: str) -> None:
    import shutil
    os.makedirs(os.path.dirname(destination), exist_ok=True)
    shutil.move(source, destination)


# -- Search ------------------------------------------------------------------------------------

def glob_regex(pattern: str) -> re.Pattern:
    """A glob as a regex over /-separated paths: *, ?, [abc], {a,b}, and ** for any depth."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
            continue
        c = pattern[i]
        if pattern.startswith("**", i):
            out.append(".*")
            i += 1
        elif c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c in "[{" and pattern.find("]" if c == "[" else "}", i) > i:
            end = pattern.find("]" if c == "[" else "}", i)
            inner = pattern[i + 1:end]
            if c == "[":
                out.append("[" + ("^" + inner[1:] if inner.startswith("!") else inner) + "]")
            else:
                out.append("(?:" + "|".join(re.escape(p) for p in inner.split(",")) + ")")
            i = end
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out) + r"\Z")


def glob_matcher(pattern: str) -> Callable[[str], bool]:
    """A pattern without "/" matches file names at any depth; one with "/", whole paths."""
    try:
        rx = glob_regex(pattern.lstrip("/") if "/" in pattern else pattern)
    except re.error as e:
        raise ToolError(f"invalid glob pattern {pattern!r}: {e}") from None
    if "/" in pattern:
        return lambda rel: rx.match(rel) is not None
    return lambda rel: rx.match(rel.rsplit("/", 1)[-1]) is not None


def walk_files(root: str) -> list:
    """Files under root, relative, /-separated, skipping .git and what .gitignore ignores.

    Inside a git work tree git itself answers (exactly right, and fast); elsewhere a walk
    applies the root's .gitignore patterns.
    """
    import subprocess
    try:
        listed = subprocess.run(
            git_command(root, "ls-files", "-z", "--cached", "--others", "--exclude-standard"),
            env=git_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, timeout=30)
        if listed.returncode == 0:     # (a tracked file deleted since may be listed)
            names = listed.stdout.decode("utf-8", "replace").split("\0")
            return sorted(set(names) - {""})
    except (OSError, subprocess.SubprocessError):
        pass
    rules = gitignore_rules(root)
    found, folders = [], [""]       # a stack, not recursion: trees of any depth
    while folders:
        prefix = folders.pop()
        try:
            entries = list(os.scandir(os.path.join(root, prefix) if prefix else root))
        except OSError:
            continue
        for entry in entries:
            rel = prefix + entry.name
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
            except OSError:
                continue
            if is_dir and entry.name != ".git" and not ignored(rel, True, rules):
                folders.append(rel + "/")
            elif not is_dir and not ignored(rel, False, rules):
                found.append(rel)
    return sorted(found)


# A repository's own configuration (.git/config, and what it includes) can name programs
# that git runs: core.fsmonitor on every file listing, a pager, diff and merge drivers,
# filters, credential helpers, ssh commands. The git commands qcr runs itself override
# each of them on the command line, which beats any configuration file.
GIT_SAFE = ("core.fsmonitor=false", "core.hooksPath=/dev/null", "core.pager=cat",
            "core.sshCommand=false", "core.askPass=", "credential.helper=",
            "diff.external=", "core.untrackedCache=false", "protocol.allow=never",
            "core.alternateRefsCommand=false", "uploadpack.packObjectsHook=false")


def git_command(root: str, *args: str) -> list:
    """A git command line for `root` that no repository configuration can make run a
    program; filters and textconv are never asked for by the commands qcr runs."""
    command = ["git"]
    for setting in GIT_SAFE:
        command += ["-c", setting]
    return command + ["-C", root, "--no-pager", *args]


def git_env() -> dict:
    """qcr's environment without what would point git elsewhere or at other programs."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("GIT_") or k in ("GIT_CEILING_DIRECTORIES",)}
    env.update(GIT_CONFIG_NOSYSTEM="1", GIT_TERMINAL_PROMPT="0", GIT_OPTIONAL_LOCKS="0",
               GIT_NO_REPLACE_OBJECTS="1")
    return env


def gitignore_rules(root: str) -> list:
    """The root .gitignore as (matcher, directories only) pairs; negations are skipped."""
    try:
        with open(os.path.join(root, ".gitignore"), encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    rules = []
    for line in lines:
        line = line.strip()
        if line and not line.startswith(("#", "!")):
            directory_only = line.endswith("/")
            line = line.rstrip("/")
            try:
                rules.append((glob_matcher(line if "/" not in line else "/" + line.lstrip("/")),
                              directory_only))
            except ToolError:
                pass     # a pattern git would not understand either
    return rules


def searchable(path: str, roots: list, folders: Optional[dict] = None) -> bool:
    """May Grep or Glob open or list this file? A regular file, and a link only when it
    stays inside the roots: never a device, FIFO or socket, never a way out -- through
    the file's folders either (a path git lists through a linked folder). `folders`
    remembers each folder's answer for the length of one search."""
    folder = os.path.dirname(path)
    inside = folders.get(folder) if folders is not None else None
    if inside is None:
        inside = within(folder, roots)
        if folders is not None:
            folders[folder] = inside
    if not inside:
        return False
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return os.path.islink(path) and within(path, roots) and os.path.isfile(path)
    except OSError:
        return False
    return True


def ignored(rel: str, is_dir: bool, rules: list) -> bool:
    return any(match(rel) for match, directory_only in rules if is_dir or not directory_only)


@tool("LS", "read", {
    "path": arg("string", "The folder to list (default: the project root)"),
}, effects=("read",), title=lambda args, ctx: f"List {args.get('path') or '.'}")
async def ls(ctx: ToolContext, path: str = "."):
    """List a folder: sub-folders end with "/", files show their size in bytes."""
    full = ctx.resolve(path)
    await ctx.permit([], ctx.on_path("read", full))
    try:
        lines, count = await asyncio.to_thread(list_folder, ctx.real(full))
    except FileNotFoundError:
        raise ToolError(f"no such folder: {full}") from None
    except NotADirectoryError:
        raise ToolError(f"{full} is a file; use ReadFile to read it.") from None
    except OSError as e:
        raise ToolError(f"cannot list {full}: {e.strerror}") from None
    return ToolResult("\n".join(lines) or f"{full} is empty.",
                      raw={"path": full, "entries": count}, locations=[{"path": full}])


def list_folder(path: str) -> tuple:
    """(lines for LS, how many entries): folders first, each file with its size."""
    entries = sorted(os.scandir(path), key=lambda e: (not e.is_dir(), e.name))
    lines = []
    for entry in entries[:LIST_LIMIT]:
        try:
            lines.append(entry.name + "/" if entry.is_dir() else
                         f"{entry.name}  ({entry.stat().st_size} bytes)")
        except OSError:
            lines.append(entry.name)
    if len(entries) > LIST_LIMIT:
        lines.append(f"[{len(entries) - LIST_LIMIT} more entries not shown]")
    return lines, len(entries)


@tool("Glob", "read", {
    "pattern": arg("string", 'A glob such as "**/*.py" or "src/**/test_*.ts"; a pattern '
                              'without "/" matches file names at any depth'),
    "path": arg("string", "The folder to search (default: the project root)"),
}, required=("pattern",), effects=("read",),
    title=lambda args, ctx: f"Find {args.get('pattern')}")
async def glob(ctx: ToolContext, pattern: str, path: str = "."):
    """Find files by name pattern. Skips .git and files that .gitignore ignores."""
    root = ctx.resolve(path)
    match = glob_matcher(pattern)
    await ctx.permit([], ctx.on_path("read", root))
    real = ctx.real(root)
    roots = [real] + ctx.session.roots()

    def find() -> list:
        if not os.path.isdir(real):
            raise ToolError(f"no such folder: {root}")
        folders: dict = {}
        return [f for f in walk_files(real)
                if match(f) and searchable(os.path.join(real, f), roots, folders)]
    files = await asyncio.to_thread(find)
    shown = [ctx.display(os.path.join(root, f)) for f in files[:LIST_LIMIT]]
    if len(files) > LIST_LIMIT:
        shown.append(f"[{len(files) - LIST_LIMIT} more files; narrow the pattern]")
    return ToolResult("\n".join(shown) or f"No files match {pattern!r} in {root}.",
                      raw={"pattern": pattern, "path": root, "matches": len(files)})


@tool("Grep", "search", {
    "pattern": arg("string", "A Python regular expression"),
    "path": arg("string", "A folder or file to search (default: the project root)"),
    "glob": arg("string", 'Only files matching this glob, e.g. "*.py"'),
    "ignore_case": arg("boolean", "Match case-insensitively (default false)"),
    "max_results": arg("integer", "Most matching lines to return (default 200)"),
}, required=("pattern",), effects=("read",),
    title=lambda args, ctx: f"Search for {args.get('pattern')}")
async def grep(ctx: ToolContext, pattern: str, path: str = ".", glob: Optional[str] = None,
               ignore_case: bool = False, max_results: int = 200):
    """Search file contents with a regular expression. Results come as path:line: text.
    Skips .git, files that .gitignore ignores, and binary files."""
    try:
        re.compile(pattern)
    except re.error as e:
        raise ToolError(f"invalid regular expression {pattern!r}: {e}") from None
    if glob:
        glob_matcher(glob)
    root = ctx.resolve(path)
    await ctx.permit([], ctx.on_path("read", root))
    real = ctx.real(root)
    if not os.path.exists(real):
        raise ToolError(f"no such file or folder: {root}")
    limit = max(1, min(max_results, 2000))
    hits = await run_search({"root": real, "pattern": pattern, "ignoreCase": ignore_case,
                             "glob": glob, "limit": limit + 1,
                             "roots": [real] + ctx.session.roots()})
    lines = [f"{ctx.display(p)}:{n}: {text}" for p, n, text in hits[:limit]]
    if len(hits) > limit:
        lines.append(f"[more than {limit} matches; narrow the search]")
    return ToolResult("\n".join(lines) or f"No matches for {pattern!r}.",
                      raw={"pattern": pattern, "path": root, "matches": len(hits[:limit])},
                      locations=[{"path": p, "line": n} for p, n, _ in hits[:20]])


async def run_search(request: dict) -> list:
    """Search with ripgrep when it is installed; else -- or when ripgrep cannot take the
    pattern (Python's lookarounds and backreferences) -- with search_files in a child
    process (`qcr.py --search-worker`).

    Python's re holds the GIL: in a thread, a catastrophic pattern such as (a+)+$ would
    freeze the whole agent, cancel included. A child can be killed -- by the timeout, or
    by cancel, which lands on the await below.
    """
    import subprocess
    hits = await run_ripgrep(request)
    if hits is not None:
        return hits
    proc = await start_process(
        sys.executable, "-I", "-S", os.path.abspath(__file__), "--search-worker",
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(json.dumps(request).encode()),
                                        SEARCH_TIMEOUT)
    except asyncio.TimeoutError:
        raise ToolError(f"the search ran over {SEARCH_TIMEOUT}s and was stopped; search a "
                        "smaller path or use a simpler pattern") from None
    finally:
        stop_group(proc.pid)
    try:
        return [tuple(hit) for hit in loads(out)["hits"]]
    except (ValueError, KeyError, TypeError):
        raise ToolError("the search failed") from None


async def run_ripgrep(request: dict) -> Optional[list]:
    """The search as ripgrep does it -- the same files (hidden ones too, not .git, not what
    .gitignore ignores, no links followed, none over SEARCH_FILE_BYTES, no binary ones), each
    still cleared by searchable(); None when there is no rg, or it rejects the pattern."""
    import shutil
    import subprocess
    rg = shutil.which("rg")
    if rg is None:
        return None
    argv = [rg, "--no-config", "--no-follow", "--hidden", "--no-require-git", "--glob", "!.git",
            "--null", "--line-number", "--with-filename", "--no-heading", "--color", "never",
            "--max-filesize", str(SEARCH_FILE_BYTES), "--max-columns", "0"]
    if request["ignoreCase"]:
        argv.append("--ignore-case")
    if request["glob"]:
        argv += ["--glob", request["glob"]]
    argv += ["--regexp", request["pattern"], "--", request["root"]]
    proc = await start_process(*argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, env=git_env(), limit=1 << 24)
    hits, folders = [], {}
    try:
        async def read() -> None:
            async for raw in proc.stdout:
                path, _, rest = raw.rstrip(b"\n").partition(b"\0")
                number, _, text = rest.partition(b":")
                name = os.fsdecode(path)
                if number.isdigit() and searchable(name, request["roots"], folders):
                    hits.append((name, int(number), text.decode("utf-8", "replace")
                                 .rstrip("\r")[:LINE_CHARS]))
                    if len(hits) >= request["limit"]:
                        return
        await asyncio.wait_for(read(), SEARCH_TIMEOUT)
        if len(hits) < request["limit"]:
            await asyncio.wait_for(proc.wait(), 5)
    except asyncio.TimeoutError:
        raise ToolError(f"the search ran over {SEARCH_TIMEOUT}s and was stopped; search a "
                        "smaller path or use a simpler pattern") from None
    finally:
        stop_group(proc.pid)
    # rg searches in parallel: its hits come in any order (and past the limit, any of them)
    return None if proc.returncode == 2 and not hits else sorted(hits)


def search_worker() -> int:
    """--search-worker: one search request on stdin, its hits as JSON on stdout."""
    request = json.load(sys.stdin)
    rx = re.compile(request["pattern"], re.IGNORECASE if request["ignoreCase"] else 0)
    hits = search_files(request["root"], rx, request["glob"], request["limit"],
                        request["roots"])
    sys.stdout.write(json.dumps({"hits": hits}))
    return 0


def search_files(root: str, rx: re.Pattern, pattern: Optional[str], limit: int,
                 roots: list) -> list:
    """(absolute path, line number, line) for up to `limit` matching lines."""
    if os.path.isfile(root):
        paths = [root]
    else:
        match = glob_matcher(pattern) if pattern else None
        paths = [os.path.join(root, f) for f in walk_files(root) if not match or match(f)]
    hits, folders = [], {}
    for path in paths:      # links are not searched (nor by ripgrep): their files are
        if os.path.islink(path) or not searchable(path, roots, folders):
            continue
        try:
            if os.path.getsize(path) > SEARCH_FILE_BYTES:
                continue
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            continue
        if b"\0" in data[:8192]:
            continue
        text = data.decode("utf-8", "replace")
        if not rx.search(text):
            continue
        for number, line in enumerate(text.split("\n"), 1):
            if rx.search(line):
                hits.append((path, number, line.rstrip("\r")[:LINE_CHARS]))
                if len(hits) >= limit:
                    return hits
    return hits


# -- Shell -------------------------------------------------------------------------------------

SCOPE_WORD = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*")        # a plain program name
SCOPE_LINE = re.compile(r"[A-Za-z0-9_.,:/=+@%^'\" -]*")           # nothing bash reads as syntax
WRAPPERS = {   # programs that run another program (or code) given in their arguments
    "env", "xargs", "sudo", "doas", "su", "runuser", "time", "nohup", "nice", "ionice",
    "timeout", "exec", "command", "builtin", "eval", "source", "watch", "strace", "ltrace",
    "chroot", "setsid", "stdbuf", "unbuffer", "script", "flock", "parallel", "find", "sed",
    "awk", "gawk", "mawk", "nawk", "busybox", "fakeroot", "systemd-run", "dbus-run-session",
    "ssh", "tmux", "screen", "expect", "gdb", "valgrind", "perf", "taskset", "chrt", "unshare",
    "nsenter", "firejail", "bwrap", "npx", "pnpx", "bunx", "uvx", "pipx", "dotnet"}
CODE_FLAGS = {  # the flags that hand a program code, or a program to run, on its command line
    "bash": ("-c",), "sh": ("-c",), "zsh": ("-c",), "dash": ("-c",), "ksh": ("-c",),
    "fish": ("-c",), "python": ("-c",), "python2": ("-c",), "python3": ("-c",),
    "pypy": ("-c",), "pypy3": ("-c",), "node": ("-e", "-p", "--eval", "--print"),
    "deno": ("eval",), "bun": ("-e", "--eval", "-p", "--print"), "perl": ("-e", "-E"),
    "ruby": ("-e",), "php": ("-r",), "lua": ("-e",), "Rscript": ("-e",), "osascript": ("-e",),
    "pwsh": ("-c", "-Command"), "tclsh": (),
    "git": ("-c", "--config-env", "-C", "--git-dir", "--work-tree", "--exec-path",
            "--namespace", "-x", "--exec", "--extcmd", "--upload-pack", "--receive-pack",
            "foreach"),
    "make": ("--eval", "-E"), "vim": ("-c", "+"), "nvim": ("-c", "+"), "emacs": ("--eval",),
    "tar": ("--checkpoint-action", "--to-command", "--use-compress-program", "-I",
            "--info-script", "-F", "--new-volume-script", "--rsh-command", "--rmt-command"),
    "rsync": ("-e", "--rsh", "--rsync-path"), "zip": ("-TT", "--unzip-command"),
    "man": ("-P", "--pager", "-H", "--html"), "npm": ("--script-shell",),
    "pytest": ("-p",), "less": ("--lesskey-src",)}
SUBCOMMANDS = {   # programs whose "always" covers one subcommand (`git status`), not all
    "git", "npm", "pnpm", "yarn", "bun", "deno", "cargo", "go", "docker", "podman", "kubectl",
    "helm", "pip", "pip3", "uv", "poetry", "gh", "brew", "apt", "apt-get", "dnf", "conda",
    "mvn", "gradle", "rustup", "terraform", "make", "bash", "sh", "zsh", "dash", "ksh", "fish",
    "python", "python2", "python3", "pypy", "pypy3", "node", "perl", "ruby", "php", "lua",
    "Rscript", "pwsh", "tclsh"}


def shell_scope(command: str) -> tuple:
    """What an "always" answer covers, and its label.

    A plain command ("pytest -q tests") generalises to every plain command with the same
    program -- and, for programs of many subcommands or scripts, the same subcommand or
    script (`git status`, `npm test`, `python3 -m pytest`) -- only when bash would split it
    exactly as qcr does: printable ASCII with nothing bash reads as syntax (;, &&, |, $(),
    >, globs, tabs, non-ASCII spaces ...), a first word that is a plain program name (not
    a path, not an assignment, not quoted), not a wrapper that runs another program (env,
    xargs, sudo, time ...), and no flag that hands the program code or a program to run
    (python3 -c, git -c, tar --to-command), however it is quoted or joined (`"-c"`,
    `-cCODE`, `-xc`). Anything else stays this exact command, so an approval of `printf a`
    never carries `printf b; rm -rf ~` along with it.
    """
    import shlex
    exact = ("Shell=" + command.strip(), "this exact command")
    try:
        words = shlex.split(command) if SCOPE_LINE.fullmatch(command) else []
    except ValueError:
        return exact
    first = words[0] if words else ""
    if not SCOPE_WORD.fullmatch(first) or command.split(" ")[0] != first or \
            first in WRAPPERS or any(hands_code(w, CODE_FLAGS.get(first, ()))
                                     for w in words[1:]):
        return exact
    scope = [first]
    if first in SUBCOMMANDS:
        for word in words[1:]:
            scope.append(word)
            if not word.startswith("-"):
                break
    named = " ".join(scope)
    return "Shell:" + named, f"`{named}` commands"


def hands_code(word: str, flags: tuple) -> bool:
    """Is this word one of the flags, in any of the forms a program reads it?"""
    for flag in flags:
        if word == flag or word.startswith(flag + "="):
            return True
        if flag.startswith("-") and not flag.startswith("--") and word.startswith("-") and \
                not word.startswith("--") and (flag[1:] in word[1:] if len(flag) == 2
                                               else word.startswith(flag)):
            return True
        if flag == "+" and word.startswith("+"):
            return True
    return False


def printable(text: str) -> str:
    """Text for a title or a terminal question: control, bidi and invisible characters are
    shown escaped, so a command cannot disguise what it is."""
    return HIDDEN.sub(lambda m: m.group(0).encode("unicode_escape").decode("ascii"), text)


HIDDEN = re.compile("[\x00-\x1f\x7f-\x9f\u00ad\u061c\u115f\u1160\u180e\u200b-\u200f"
                    "\u2028-\u202e\u2060-\u206f\u3164\ufe00-\ufe0f\ufeff\ufff9-\ufffb]")


@tool("Shell", "execute", {
    "command": arg("string", "The shell command line, run with bash -c"),
    "timeout": arg("integer", f"Seconds before it is killed (default {SHELL_TIMEOUT}, "
                              f"at most {SHELL_TIMEOUT_MAX})"),
}, required=("command",), effects=("execute",),
    title=lambda args, ctx: str(args.get("command") or "Shell").strip()[:300])
async def shell(ctx: ToolContext, command: str, timeout: int = SHELL_TIMEOUT):
    """Run a shell command in the project root and return its output (stdout and stderr
    together) and exit code. No input is connected: do not start interactive programs."""
    if not command.strip():
        raise ToolError("the command is empty")
    key, label = shell_scope(command)
    await ctx.permit([text_content(f"$ {printable(command)}")], ("execute", key, label))
    timeout = max(1, min(timeout, SHELL_TIMEOUT_MAX))
    if ctx.agent.client_can("terminal"):
        return await run_in_terminal(ctx, command, timeout)

    def show(output: str) -> None:     # the output so far, in the card, as it comes
        ctx.update(content=[text_content(output[-SHELL_OUTPUT_CHARS // 3:])])
    output, code, timed_out = await run_command(command, ctx.cwd, timeout, show,
                                                command_env(ctx.agent.config))
    status = (f"[timed out after {timeout}s; the command was killed]" if timed_out
              else f"[exit code {code}]")
    shown = output[-SHELL_OUTPUT_CHARS // 3:] if output else "(no output)"
    return ToolResult(f"{output}\n{status}".strip(), [text_content(f"{shown}\n{status}")],
                      {"exitCode": code, "timedOut": timed_out, "chars": len(output)})


SHELL = "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"


async def run_in_terminal(ctx: ToolContext, command: str, timeout: float) -> ToolResult:
    """Shell in the editor's own terminal: the user watches it live in the tool card.

    terminal/create (the shell as the command, "-c" and the line as its arguments -- never
    the whole line as a program name), then wait_for_exit raced against the timeout (kill
    when it runs out), output, and always release -- also when the turn is cancelled.
    """
    conn, ids = ctx.agent.conn, {"sessionId": ctx.session.id}
    try:
        created = await conn.request("terminal/create", dict(
            ids, command=SHELL, args=["-c", command], cwd=ctx.cwd,
            outputByteLimit=SHELL_OUTPUT_CHARS * 4,   # qcr's secrets blanked in its env
            env=[{"name": name, "value": ""} for name in secret_names(ctx.agent.config)]))
    except RpcError as e:
        raise ToolError(f"the editor could not start a terminal: {e.message}") from None
    terminal_id = created.get("terminalId") if isinstance(created, dict) else None
    if not isinstance(terminal_id, str):
        raise ToolError("the editor's terminal/create answer had no terminalId")
    ids["terminalId"] = terminal_id
    shown = [{"type": "terminal", "terminalId": terminal_id}]
    ctx.update(content=shown)
    released = False
    try:
        timed_out = False
        try:
            await asyncio.wait_for(conn.request("terminal/wait_for_exit", dict(ids)), timeout)
        except asyncio.TimeoutError:
            timed_out = True
            await conn.request("terminal/kill", dict(ids))
        result = await conn.request("terminal/output", dict(ids))
        await conn.request("terminal/release", dict(ids))
        released = True
    except RpcError as e:
        raise ToolError(f"the editor's terminal failed: {e.message}") from None
    finally:
        if not released:     # cancelled or failed: kill and release without waiting
            for method in ("terminal/kill", "terminal/release"):
                asyncio.ensure_future(conn.request(method, dict(ids))).add_done_callback(
                    lambda f: f.cancelled() or f.exception())
    result = result if isinstance(result, dict) else {}
    output = str(result.get("output", "")).rstrip("\n")
    if len(output) > SHELL_OUTPUT_CHARS:
        output = output[:SHELL_OUTPUT_CHARS // 2] + "\n[... output omitted ...]\n" + \
            output[-SHELL_OUTPUT_CHARS // 2:]
    exit_status = result.get("exitStatus") if isinstance(result.get("exitStatus"), dict) else {}
    code, signal_name = exit_status.get("exitCode"), exit_status.get("signal")
    status = (f"[timed out after {timeout:g}s; the command was killed]" if timed_out else
              f"[killed by signal {signal_name}]" if signal_name else f"[exit code {code}]")
    if result.get("truncated"):
        status = "[the start of the output was cut]\n" + status
    tail = output[-SHELL_OUTPUT_CHARS // 3:] if output else "(no output)"
    return ToolResult(f"{output}\n{status}".strip(), shown,
                      {"exitCode": code, "signal": signal_name, "timedOut": timed_out,
                       "terminalId": terminal_id},
                      replay=[text_content(f"$ {printable(command)}\n{tail}\n{status}")])


SECRET_NAME = re.compile(r"(^|_)(API_?KEY|ACCESS_KEY|SECRET_KEY|PRIVATE_KEY|TOKEN|SECRET|"
                         r"PASSWORD|PASSWD|CREDENTIALS?)($|_)", re.I)


def secret_names(config: Config) -> list:
    """The variables of qcr's environment a command must not see: names like *_API_KEY,
    *_TOKEN, *_SECRET, *_PASSWORD, and any variable holding one of the configured keys --
    less those that `passEnv` lets through."""
    keys = {k for k in (config.api_key, config.anthropic_api_key, config.search_key,
                        config.brave_key, config.tavily_key) if k}
    return sorted(name for name, value in os.environ.items()
                  if (SECRET_NAME.search(name) or value in keys) and name not in config.pass_env)


def command_env(config: Config) -> dict:
    """The environment of a Shell command: qcr's own, without its secrets, no pagers."""
    hidden = set(secret_names(config))
    env = {k: v for k, v in os.environ.items() if k not in hidden}
    env.update(PAGER="cat", GIT_PAGER="cat", GIT_TERMINAL_PROMPT="0")
    return env


async def run_command(command: str, cwd: str, timeout: float,
                      show: Optional[Callable[[str], None]] = None,
                      env: Optional[dict] = None) -> tuple:
    """Run `bash -c command` in its own process group: (output, exit code, timed out).

    `show` gets the output so far, at most every SHOW_EVERY seconds, while it runs.

    The whole group is killed when the command times out, when the turn is cancelled, and
    when the command exits but leaves background children holding the output pipe.
    """
    import subprocess
    proc = await start_process(
        SHELL, "-c", command, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    head, tail, total = bytearray(), bytearray(), 0
    half = SHELL_OUTPUT_CHARS // 2
    shown_at = time.monotonic()

    async def pump() -> None:
        nonlocal total, shown_at
        while True:
            chunk = await proc.stdout.read(65536)
            if not chunk:
                return
            total += len(chunk)
            room = half - len(head)
            head.extend(chunk[:max(room, 0)])
            tail.extend(chunk[max(room, 0):])
            del tail[:-half]
            if show and time.monotonic() - shown_at >= SHOW_EVERY:
                shown_at = time.monotonic()
                show((head + tail).decode("utf-8", "replace"))

    async def exited() -> None:
        # Not proc.wait(): from Python 3.12 it also waits for the pipes to close, which a
        # background child (`server &`) holds open long after the shell has exited.
        while proc.returncode is None:
            await asyncio.sleep(0.02)

    reader = asyncio.ensure_future(pump())
    timed_out = False
    try:
        try:
            await asyncio.wait_for(exited(), timeout)
            await asyncio.wait([reader], timeout=0.5)   # output still in the pipe
        except asyncio.TimeoutError:
            timed_out = True
    finally:
        stop_group(proc.pid)
        reader.cancel()
        if proc.returncode is None:
            await asyncio.wait([asyncio.ensure_future(exited())], timeout=2.0)
    text = head.decode("utf-8", "replace")
    if total > len(head) + len(tail):
        text += f"\n[... {total - len(head) - len(tail)} bytes of output omitted ...]\n"
    text += tail.decode("utf-8", "replace")
    return text.rstrip("\n"), proc.returncode, timed_out


# -- Planning ----------------------------------------------------------------------------------

@tool("Think", "think", {
    "thought": arg("string", "Your reasoning"),
}, required=("thought",), title=lambda args, ctx: "Think")
async def think(ctx: ToolContext, thought: str):
    """Think out loud: note reasoning or a decision before acting. Changes nothing."""
    return ToolResult("Noted.", [text_content(thought)])


PLAN_STATUSES = ("pending", "in_progress", "completed")


@tool("TodoWrite", "other", {
    "todos": arg("array", "The whole list, in order; it replaces the previous one", items={
        "type": "object", "required": ["content", "status"], "properties": {
            "content": {"type": "string"},
            "status": {"type": "string", "enum": list(PLAN_STATUSES)},
            "priority": {"type": "string", "enum": ["high", "medium", "low"]}}}),
}, required=("todos",), title=lambda args, ctx: "Update the plan")
async def todo_write(ctx: ToolContext, todos: list):
    """Keep a to-do list for a task of several steps; the user sees it as the plan. Send the
    whole list each time, with exactly one item in_progress while you work."""
    entries = []
    for i, item in enumerate(todos):
        if not isinstance(item, dict) or not isinstance(item.get("content"), str):
            raise ToolError(f"todos[{i}] must be an object with a content string")
        status = str(item.get("status", "pending")).lower().replace("-", "_")
        status = {"done": "completed", "complete": "completed", "todo": "pending",
                  "in progress": "in_progress", "active": "in_progress"}.get(status, status)
        if status not in PLAN_STATUSES:
            raise ToolError(f"todos[{i}].status must be one of {', '.join(PLAN_STATUSES)}")
        priority = str(item.get("priority", "medium")).lower()
        entries.append({"content": item["content"], "status": status,
                        "priority": priority if priority in ("high", "low") else "medium"})
    ctx.plan(entries)
    counts = {s: sum(e["status"] == s for e in entries) for s in PLAN_STATUSES}
    return ToolResult(f"Plan updated: {counts['pending']} pending, {counts['in_progress']} in "
                      f"progress, {counts['completed']} completed.", raw={"entries": entries})


# -- Web ---------------------------------------------------------------------------------------
#
# WebFetch reads a page (HTML becomes text with its links kept); WebSearch asks a search
# backend: SearXNG (a URL), Brave or Tavily (API keys), else DuckDuckGo's keyless HTML page.
# "web": false in the configuration takes both away, for machines with no network.

FETCH_BYTES = 2 << 20          # most of a page WebFetch reads
FETCH_CHARS = 60_000           # most text it returns
FETCH_TIMEOUT = 20             # seconds
FETCH_REDIRECTS = 5


def http_get(url: str, headers: Optional[dict] = None, data: Optional[bytes] = None,
             secrets: Optional[dict] = None, limit: int = FETCH_BYTES) -> tuple:
    """One hop of a GET (or a POST of `data`), redirects not followed: (url, content type,
    body bytes), or (url, None, the redirect's target). ToolError with the reason."""
    import urllib.error
    from urllib.parse import urljoin
    try:
        with open_url(url, data, {"User-Agent": f"Mozilla/5.0 (compatible; qcr/{__version__})",
                                  **(headers or {})}, secrets, FETCH_TIMEOUT, 0) as response:
            return url, response.headers.get("Content-Type", ""), response.read(limit)
    except urllib.error.HTTPError as e:
        location = e.headers.get("Location") if e.headers else None
        if e.code in (301, 302, 303, 307, 308) and location:
            return url, None, urljoin(url, location)
        raise ToolError(f"{url} answered HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise ToolError(f"cannot fetch {url}: {reason} (is this machine offline?)") from None


async def fetch(ctx: ToolContext, url: str, headers: Optional[dict] = None,
                data: Optional[bytes] = None, secrets: Optional[dict] = None) -> tuple:
    """http_get through the permission policy: the first host, and each host a redirect
    leads to, is cleared before qcr connects to it; secrets stay with the first origin."""
    first = origin_of(url)
    for _ in range(FETCH_REDIRECTS + 1):
        need = await host_need(url)
        await ctx.permit([text_content(f"{ctx.tool.name}: {printable(url)}")], need)
        final, kind, body = await asyncio.to_thread(
            http_get, url, headers, data, secrets if origin_of(url) == first else None)
        if kind is not None:
            return final, kind, body
        if not body.startswith(("http://", "https://")):
            raise ToolError(f"{url} redirected to {body}, which is not http(s)")
        url, data = body, None        # a redirect: GET the new URL, after the policy
    raise ToolError(f"{url}: more than {FETCH_REDIRECTS} redirects")


async def host_need(url: str) -> tuple:
    """The policy's need for a request to the URL's host: a host that is this machine or
    a private network (loopback, LAN, link-local, by name or by address) is its own row."""
    from urllib.parse import urlparse
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ToolError(f"only http and https URLs can be fetched, not {url!r}")
    scheme, host, port = origin_of(url)
    where = host if port == {"http": 80, "https": 443}[scheme] else f"{host}:{port}"
    private = await asyncio.to_thread(private_host, host)
    return ("network private" if private else "network", f"Host:{where}",
            f"requests to {where}")


def private_host(host: str) -> bool:
    """Does the name or address lead to this machine or a private network?"""
    import ipaddress
    import socket
    try:
        addresses = [ipaddress.ip_address(host.strip("[]"))]
    except ValueError:
        try:
            addresses = [ipaddress.ip_address(info[4][0].split("%")[0])
                         for info in socket.getaddrinfo(host, None)]
        except (OSError, ValueError, UnicodeError):
            return host == "localhost" or host.endswith((".localhost", ".local"))
    return any(not a.is_global or a.is_multicast for a in addresses)


def html_to_text(html: str, base: str) -> str:
    """Readable text from HTML: scripts and styles dropped, blocks on their own lines,
    headings and list items marked, links kept as [text](absolute url)."""
    from html.parser import HTMLParser
    from urllib.parse import urljoin

    class Reader(HTMLParser):
        """HTML to readable text: blocks as lines, links kept, scripts and styles dropped."""
        BLOCKS = {"p", "div", "section", "article", "br", "tr", "table", "ul", "ol", "pre",
                  "blockquote", "header", "footer", "main", "nav", "h1", "h2", "h3", "h4",
                  "h5", "h6", "li", "dt", "dd"}

        def __init__(self):
            super().__init__(convert_charrefs=True)
            self.out, self.skip, self.href, self.title = [], 0, None, ""
            self.in_title = False

        def handle_starttag(self, tag, attrs):
            if tag in ("script", "style", "noscript", "svg", "template"):
                self.skip += 1
            elif tag == "title":
                self.in_title = True
            elif tag == "a":
                self.href = dict(attrs).get("href")
                self.out.append("[")
            elif tag in self.BLOCKS:
                self.out.append("\n" + ("#" * int(tag[1]) + " " if tag[0] == "h" and
                                        tag[1:].isdigit() else "- " if tag == "li" else ""))

        def handle_endtag(self, tag):
            if tag in ("script", "style", "noscript", "svg", "template"):
                self.skip = max(0, self.skip - 1)
            elif tag == "title":
                self.in_title = False
            elif tag == "a":
                href = self.href
                self.out.append(f"]({urljoin(base, href)})" if href and
                                not href.startswith(("#", "javascript:")) else "]")
                self.href = None
            elif tag in self.BLOCKS:
                self.out.append("\n")

        def handle_data(self, data):
            if self.in_title:
                self.title += data
            elif not self.skip:
                self.out.append(re.sub(r"\s+", " ", data))
    reader = Reader()
    reader.feed(html)
    text = "".join(reader.out).replace("[]", "")
    text = re.sub(r"\[\s*\]\([^)]*\)", "", text)
    lines = [line.strip() for line in text.splitlines()]
    text = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()
    return (f"# {reader.title.strip()}\n\n" if reader.title.strip() else "") + text


@tool("WebFetch", "fetch", {
    "url": arg("string", "The http(s) URL"),
}, required=("url",), effects=("network",), title=lambda args, ctx: f"Fetch {args.get('url')}",
    web=True)
async def web_fetch(ctx: ToolContext, url: str):
    """Fetch a web page and read it as text (links kept as [text](url)). For documentation,
    issues, release notes -- anything on the web."""
    final, kind, data = await fetch(ctx, url.strip())
    charset = re.search(r"charset=([\w-]+)", kind)
    try:
        text = data.decode(charset.group(1) if charset else "utf-8", "replace")
    except LookupError:       # a charset Python does not know
        text = data.decode("utf-8", "replace")
    if "html" in kind or text.lstrip()[:15].lower().startswith(("<!doctype", "<html")):
        text = html_to_text(text, final)
    elif not kind.startswith("text/") and "json" not in kind and "xml" not in kind and \
            b"\0" in data[:4096]:
        raise ToolError(f"{final} is not text ({kind or 'unknown type'}, {len(data)} bytes)")
    if len(text) > FETCH_CHARS:
        text = text[:FETCH_CHARS] + f"\n[... cut at {FETCH_CHARS} characters]"
    return ToolResult(f"{final}\n\n{text}", [text_content(text[:2000])],
                      {"url": final, "contentType": kind, "chars": len(text)})


@tool("WebSearch", "search", {
    "query": arg("string", "What to search for"),
    "max_results": arg("integer", "How many results (default 5, at most 20)"),
}, required=("query",), effects=("network",),
    title=lambda args, ctx: f"Search the web for {args.get('query')}", web=True)
async def web_search(ctx: ToolContext, query: str, max_results: int = 5):
    """Search the web. Results come as title, URL and snippet; read a result with WebFetch."""
    count = max(1, min(max_results, 20))
    url, headers, data, secrets, parse = search_request(ctx.agent.config, query, count)
    _, _, body = await fetch(ctx, url, headers, data, secrets)
    try:
        results = parse(body)[:count]
    except (ValueError, AttributeError, TypeError):
        raise ToolError(f"the search backend's answer could not be read ({url})") from None
    if not results:
        return ToolResult(f"No results for {query!r}.", raw={"query": query, "results": []})
    lines = [f"{i}. {r['title']}\n   {r['url']}\n   {r['snippet']}"
             for i, r in enumerate(results, 1)]
    return ToolResult("\n".join(lines), [text_content("\n".join(lines))],
                      {"query": query, "results": results})


def search_request(config: Config, query: str, count: int) -> tuple:
    """The configured backend's request -- (url, headers, data, secrets, parse) -- where
    parse turns its answer into [{title, url, snippet}]."""
    from urllib.parse import quote_plus
    backend, key = config.search_backend, config.search_key
    if not backend:
        backend = "brave" if config.brave_key else "tavily" if config.tavily_key else \
            "searxng" if config.searxng_url else "duckduckgo"

    def results(items: Any, snippet: str) -> list:
        return [{"title": i.get("title", ""), "url": i.get("url", ""),
                 "snippet": i.get(snippet, "")} for i in items or [] if isinstance(i, dict)]
    if backend == "searxng":
        base = config.search_url or config.searxng_url.rstrip("/") + "/search"
        return (f"{base}?q={quote_plus(query)}&format=json", {}, None, None,
                lambda body: results(loads(body).get("results"), "content"))
    if backend == "brave":
        base = config.search_url or "https://api.search.brave.com/res/v1/web/search"
        return (f"{base}?q={quote_plus(query)}&count={count}", {"Accept": "application/json"},
                None, {"X-Subscription-Token": key or config.brave_key},
                lambda body: results((loads(body).get("web") or {}).get("results"),
                                     "description"))
    if backend == "tavily":
        base = config.search_url or "https://api.tavily.com/search"
        data = json.dumps({"api_key": key or config.tavily_key, "query": query,
                           "max_results": count}).encode()
        return (base, {"Content-Type": "application/json"}, data, None,
                lambda body: results(loads(body).get("results"), "content"))
    base = config.search_url or "https://html.duckduckgo.com/html/"
    return (f"{base}?q={quote_plus(query)}", {}, None, None,
            lambda body: duckduckgo_results(body.decode("utf-8", "replace")))


def duckduckgo_results(html: str) -> list:
    """Results from DuckDuckGo's keyless HTML page."""
    from html import unescape
    from urllib.parse import parse_qs, unquote, urlparse
    results = []
    for href, title, rest in re.findall(
            r'<a[^>]+class="result__a"[^>]+href="([^"]+)"[^>]*>(.*?)</a>(.*?)(?=<a[^>]+class='
            r'"result__a"|$)', html, re.S):
        target = parse_qs(urlparse(unescape(href)).query).get("uddg", [unescape(href)])[0]
        snippet = re.search(r'class="result__snippet"[^>]*>(.*?)</a>', rest, re.S)
        strip = lambda text: unescape(re.sub(r"<[^>]+>", "", text)).strip()
        results.append({"title": strip(title), "url": unquote(target),
                        "snippet": strip(snippet.group(1)) if snippet else ""})
    return results


# -- Interaction -------------------------------------------------------------------------------

@tool("AskUserQuestion", "other", {
    "question": arg("string", "The question, complete in itself"),
    "options": arg("array", "2 to 6 possible answers", items={"type": "string"}),
}, required=("question", "options"), title=lambda args, ctx: str(args.get("question") or
                                                                   "Question")[:200])
async def ask_user_question(ctx: ToolContext, question: str, options: list):
    """Ask the user to choose, when you cannot go on without their decision. They may also
    answer in their own words."""
    choices = [str(o).strip() for o in options if str(o).strip()][:10]
    if not choices:
        raise ToolError("give at least one option to choose from")
    shown = [text_content(question + "".join(f"\n- {c}" for c in choices))]
    if ctx.agent.client_can("elicitation", "form"):
        answer = await elicit(ctx, question, choices)
        if answer is not None:
            return ToolResult(answer, shown, {"answer": answer})
    choice = await ctx.choose(shown, [(f"answer-{i}", c, "allow_once")
                                      for i, c in enumerate(choices)])
    if choice is None:     # the design document's fallback: the editor cannot ask
        answer = ("The user could not be asked. Make the most sensible choice yourself and "
                  "say which you made and why.")
    else:
        answer = f"The user answered: {choices[int(choice.split('-')[1])]}"
    return ToolResult(answer, shown, {"answer": answer})


async def elicit(ctx: ToolContext, question: str, choices: list) -> Optional[str]:
    """A form in the editor (elicitation/create): a choice, or the user's own words. None if
    the editor failed, so the caller falls back to buttons."""
    try:
        result = await ctx.agent.conn.request("elicitation/create", {
            "sessionId": ctx.session.id, "toolCallId": ctx.call_id, "mode": "form",
            "message": question, "requestedSchema": {"type": "object", "properties": {
                "answer": {"type": "string", "title": "Answer",
                           "oneOf": [{"const": c, "title": c} for c in choices]},
                "comment": {"type": "string", "title": "Or in your own words"}}}})
    except RpcError as e:
        log(f"elicitation/create failed: {e.message}")
        return None
    result = result if isinstance(result, dict) else {}
    if result.get("action") != "accept":
        return (f"The user did not answer ({result.get('action', 'no answer')}). Make the most "
                "sensible choice yourself and say which.")
    content = result.get("content") if isinstance(result.get("content"), dict) else {}
    said = [f"The user answered: {content['answer']}" if content.get("answer") else "",
            f"The user wrote: {content['comment']}" if content.get("comment") else ""]
    return "\n".join(s for s in said if s) or "The user answered without choosing."


@tool("ExitPlanMode", "switch_mode", {
    "plan": arg("string", "The finished plan, in Markdown"),
}, required=("plan",), effects=("mode",), title=lambda args, ctx: "Ready to make changes?",
    modes=("plan",))
async def exit_plan_mode(ctx: ToolContext, plan: str):
    """In plan mode, once the plan is ready: show it to the user, who chooses whether to
    start making changes (and how) or to keep planning."""
    if ctx.session.mode != "plan":
        raise ToolError("the session is not in plan mode")
    ctx.check([("mode", None, "a change of mode")])     # the card below is the asking
    shown = [text_content(plan)]
    choice = await ctx.choose(shown, [
        ("auto-edit", "Start in auto-edit", "allow_always"),
        ("default", "Start in default (approve each edit)", "allow_once"),
        ("plan", "Keep planning", "reject_once")])
    if choice in ("auto-edit", "default"):
        ctx.agent.set_mode(ctx.session, choice, "mode")
        return ToolResult(f"The user approved the plan and switched to {choice} mode. Carry "
                          "the plan out now.", shown, {"mode": choice})
    return ToolResult("The user wants to keep planning. Ask what to change, or refine the "
                      "plan.", shown, {"mode": "plan"})


# -- Scheduling --------------------------------------------------------------------------------
#
# A job is a prompt the session runs later: at a five-field cron time ("0 9 * * 1-5") or
# after an interval ("every 10m"), once or again and again. Jobs are saved with the session
# and come back when it is reopened. When one is due and the session is idle, qcr runs it as
# a turn of its own, streamed like any other, with "_meta": {"source": "cron", "jobId": ...}
# on its updates; when a turn is running, the job waits for it.

INTERVAL_RE = re.compile(r"(?:every\s+)?(\d+)\s*(s|sec|m|min|h|hr|d|day)s?", re.I)
CRON_FIELDS = ((0, 59), (0, 23), (1, 31), (1, 12), (0, 6))   # minute hour day month weekday


def cron_sets(expression: str) -> list:
    """The five fields of a cron expression as sets of numbers; ValueError if malformed."""
    fields = expression.split()
    if len(fields) != 5:
        raise ValueError("a cron expression has five fields: minute hour day month weekday")
    sets = []
    for text, (low, high) in zip(fields, CRON_FIELDS):
        values: set = set()
        for part in text.split(","):
            body, _, step = part.partition("/")
            first, last = (low, high) if body == "*" else (
                (int(body.split("-")[0]), int(body.split("-")[1])) if "-" in body else
                (int(body), high if step else int(body)))
            if not low <= first <= last <= high + (1 if high == 6 else 0):
                raise ValueError(f"{part!r} is out of range {low}-{high}")
            values.update(v % 7 if high == 6 else v for v in range(first, last + 1,
                                                                    int(step or 1)))
        sets.append(values)
    return sets


def next_run(schedule: str, after: float) -> float:
    """When a schedule next fires after `after` (epoch seconds, local time for cron)."""
    interval = INTERVAL_RE.fullmatch(schedule.strip())
    if interval:
        unit = interval.group(2)[0].lower()
        return after + int(interval.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[unit]
    minutes, hours, days, months, weekdays = cron_sets(schedule)
    restricted_days = len(days) < 31 and len(weekdays) < 7
    moment = int(after // 60 + 1) * 60
    for _ in range(366 * 24 * 60):
        t = time.localtime(moment)
        day_ok = (t.tm_mday in days or (t.tm_wday + 1) % 7 in weekdays) if restricted_days \
            else (t.tm_mday in days and (t.tm_wday + 1) % 7 in weekdays)
        if t.tm_min in minutes and t.tm_hour in hours and t.tm_mon in months and day_ok:
            return float(moment)
        moment += 60
    raise ValueError("the schedule never fires within a year")


def describe_job(job: dict) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(job["next"]))
    return (f"{job['id']}: {job['schedule']} ({'recurring' if job['recurring'] else 'once'}), "
            f"next at {when}: {job['prompt'][:80]}")


@tool("CronCreate", "other", {
    "schedule": arg("string", 'A five-field cron expression ("*/15 9-17 * * 1-5") or an '
                              'interval ("every 10m", "30s", "2h", "1d")'),
    "prompt": arg("string", "The prompt to run then, as if the user had sent it"),
    "recurring": arg("boolean", "Run again and again (default true); false runs it once"),
}, required=("schedule", "prompt"), effects=("schedule",),
    title=lambda args, ctx: f"Schedule: {args.get('schedule')}")
async def cron_create(ctx: ToolContext, schedule: str, prompt: str, recurring: bool = True):
    """Schedule a prompt for later in this session: once, or on a repeating schedule."""
    try:
        upcoming = next_run(schedule, time.time())
    except (ValueError, KeyError) as e:
        raise ToolError(f"invalid schedule {schedule!r}: {e}") from None
    if not prompt.strip():
        raise ToolError("the prompt is empty")
    await ctx.permit([text_content(f"Run this prompt {schedule.strip()} "
                                   f"({'recurring' if recurring else 'once'}):\n{prompt}")],
                     ("schedule", "schedule", "scheduling prompts"))
    job = {"id": "job-" + os.urandom(3).hex(), "schedule": schedule.strip(),
           "prompt": prompt, "recurring": recurring, "next": upcoming}
    ctx.session.jobs.append(job)
    ctx.session.armed = True        # the user is here: this process may run the jobs
    ctx.agent.schedule()
    return ToolResult(f"Scheduled {describe_job(job)}", raw={"job": job})


@tool("CronList", "other", {}, title=lambda args, ctx: "Scheduled prompts")
async def cron_list(ctx: ToolContext):
    """List this session's scheduled prompts."""
    jobs = ctx.session.jobs
    return ToolResult("\n".join(describe_job(j) for j in jobs) or "Nothing is scheduled.",
                      raw={"jobs": jobs})


@tool("CronDelete", "other", {
    "id": arg("string", "The job's id, from CronCreate or CronList"),
}, required=("id",), effects=("schedule",), title=lambda args, ctx: f"Unschedule {args.get('id')}")
async def cron_delete(ctx: ToolContext, id: str):
    """Remove a scheduled prompt."""
    jobs = ctx.session.jobs
    if not any(j["id"] == id for j in jobs):
        raise ToolError(f"no job {id!r}; the jobs are: "
                        f"{', '.join(j['id'] for j in jobs) or 'none'}")
    await ctx.permit([text_content(f"Remove the scheduled prompt {id}")],
                     ("schedule", "schedule", "scheduling prompts"))
    ctx.session.jobs[:] = [j for j in jobs if j["id"] != id]
    return ToolResult(f"Removed {id}.", raw={"removed": id})


# =============================================================================================
# 6. Agent loop: one prompt turn
# =============================================================================================
#
# A turn is a loop: send the conversation to the model, stream its reply to the client, run
# the tool calls it asked for (each one announced, approved if it changes something, run,
# reported), append the results, and go again -- until the model answers without a tool call
# (end_turn), hits its length limit (max_tokens), is filtered (refusal), the loop limit is
# reached (max_turn_requests), or the user cancels (cancelled). The session is saved after
# every model reply and every tool result, so a crash loses at most the step in flight.

CONTEXT_FILES = ("QCR.md", "AGENTS.md", "CLAUDE.md")
CONTEXT_FILE_CHARS = 64 * 1024      # most of one context file that goes into the prompt


def system_prompt(agent: Agent, session: Session) -> str:
    """The instructions: who qcr is, where it works, the mode, and the project's own notes."""
    parts = [
        f"You are qcr, a coding agent working in the project at {session.cwd} through the "
        "user's editor. Use the tools to read, search and change the project; paths may be "
        "relative to the project root. Read a file before editing it. Keep a plan with "
        "TodoWrite for tasks of several steps. Answer in Markdown, briefly.",
        f"Today is {time.strftime('%Y-%m-%d')}. The platform is {sys.platform}.",
    ]
    if session.mode == "plan":
        parts.append("The session is in PLAN mode: it is read-only. Explore the project and "
                     "write a plan; do not try to change files or run commands. When the plan "
                     "is ready, call ExitPlanMode with it.")
    return "\n\n".join(parts + session.notes)


def project_notes(config: Config, cwd: str) -> list:
    """The project's instructions (AGENTS.md and the like) and steering files: read off the
    loop once a turn, not once a model call."""
    notes = []
    for name in CONTEXT_FILES:
        text = read_context_file(os.path.join(cwd, name), cwd)
        if text:
            notes.append(f"# {name} (project instructions)\n{text}")
    folders = [os.path.join(cwd, ".qcr")] + [folder for folder, _, _ in plugins(config, cwd)]
    for folder in folders:
        steering = os.path.join(folder, "steering")
        try:
            names = sorted(os.listdir(steering))
        except OSError:
            continue
        for name in names:
            text = read_context_file(os.path.join(steering, name), cwd) \
                if name.endswith(".md") else ""
            if text:
                notes.append(f"# Steering: {name}\n{text}")
    return notes


def read_context_file(path: str, project: str) -> str:
    try:
        return (read_own_file(path, project, CONTEXT_FILE_CHARS) or "").strip()
    except OSError as e:
        log(f"not reading {path}: {e}")
        return ""


def tool_message(call_id: str, text: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": without_surrogates(text)}


def merge_user_turns(messages: list) -> list:
    """Join back-to-back user messages (left by a failed turn): some servers want turns to
    alternate."""
    merged: list = []
    for message in messages:
        if merged and message.get("role") == "user" == merged[-1].get("role") and \
                isinstance(message.get("content"), str):
            merged[-1] = dict(merged[-1], content=f"{merged[-1]['content']}\n\n"
                                                   f"{message['content']}")
        else:
            merged.append(message)
    return merged


def close_open_calls(messages: list, why: str) -> None:
    """Answer tool calls left without a result (cancel, crash): models reject such a history."""
    for i in range(len(messages) - 1, -1, -1):
        message = messages[i]
        if message.get("role") == "assistant":
            answered = {m.get("tool_call_id") for m in messages[i + 1:]}
            for call in message.get("tool_calls") or []:
                if call.get("id") not in answered:
                    messages.append(tool_message(call.get("id"), why))
            return
        if message.get("role") == "user":
            return


async def run_turn(agent: Agent, session: Session, text: str, shown: str = "",
                   images: list = ()) -> str:
    """Run one prompt to its end; returns the ACP stop reason.

    `text` goes to the model; `shown` (the slash command the user typed, when `text` is its
    expansion) is what the thread shows and replays. Images go along as data URIs unless
    the model is configured as text-only.
    """
    open_turn(agent, session, text, shown, images)

    def emit(kind: str, chunk: str) -> None:
        """The stream's text and thoughts -- and, as "notice:<severity>", qcr's own notes."""
        if kind.startswith("notice:"):
            agent.tell(session, kind[len("notice:"):], chunk)
        else:
            agent.update(session, message_chunk(kind, chunk))

    if images and not agent.config.images:
        agent.tell(session, "info", f"[note] {len(images)} image(s) not sent: the model is "
                   "configured as text-only (images: false).\n\n")
    if agent.config.problems and not session.messages[:-1]:
        agent.tell(session, "warning", "[warning] " + "\n[warning] ".join(
            agent.config.problems) + "\n\n")
    provider = make_provider(agent.config, session.model, session.effort)
    reply: Optional[Reply] = None
    failures: dict = {}           # (tool, arguments, error) -> how often, this turn
    session.notes = await asyncio.to_thread(project_notes, agent.config, session.cwd)
    try:
        await learn_context_window(agent.config, session.model)
        for _ in range(agent.config.max_turn_requests):
            if session.auto_compact and needs_compaction(agent, session):
                await compact(agent, session, "", automatic=True)
            reply = bounded_reply(agent.config)
            await ask_model(agent, session, provider, reply, emit)
            calls, finish, dropped, reply = reply.calls, reply.finish, reply.dropped, None
            if finish == "length":
                return "max_tokens"
            if finish == "content_filter":
                return "refusal"
            if not calls:
                return "end_turn"
            for call in calls:
                await run_tool_call(agent, session, call)
                if going_nowhere(session, call, failures):
                    emit("agent_message_chunk", f"\n[note] The turn was stopped: the model "
                         f"made the same failing {call['name']} call {REPEAT_STOP} times.\n")
                    return "end_turn"
            if dropped:
                note = (f"[qcr] Your reply asked for {len(calls) + dropped} tool calls; qcr "
                        f"runs at most {len(calls)} from one reply (maxToolCalls), so the other "
                        f"{dropped} were not run. Ask for fewer at a time.")
                session.messages.append({"role": "user", "content": note})
                emit("agent_message_chunk", f"\n[note] {dropped} tool calls of that reply "
                     f"were not run: more than maxToolCalls ({len(calls)}).\n\n")
        return "max_turn_requests"
    except ProviderError as e:
        keep_partial(session, reply)
        emit("agent_message_chunk", ("\n\n" if reply and reply.parts else "") + f"[error] {e}")
        agent.save(session)
        return "end_turn"
    except asyncio.CancelledError:
        keep_partial(session, reply)
        close_open_calls(session.messages, "Not run: the user cancelled the turn.")
        agent.save(session)
        return "cancelled"


JOB_TICK = 0.5                 # seconds between looks at the scheduled jobs
REPEAT_WARN, REPEAT_STOP = 3, 5    # the same failing call: told to stop; the turn stopped


def going_nowhere(session: Session, call: dict, failures: dict) -> bool:
    """Count a call that failed exactly as before (same tool, arguments and error): the
    model is told at REPEAT_WARN, and the turn ends at REPEAT_STOP -- small models loop."""
    result = session.messages[-1].get("content", "")
    if not isinstance(result, str) or not result.startswith("Error:"):
        return False
    key = (call["name"], call["arguments"], result)
    failures[key] = failures.get(key, 0) + 1
    if failures[key] == REPEAT_WARN:
        session.messages.append({"role": "user", "content": (
            f"[qcr] You have made the same {call['name']} call {REPEAT_WARN} times, and it "
            "failed the same way each time. Do not repeat it: read the error, change the "
            "arguments or take another approach, or ask the user.")})
    return failures[key] >= REPEAT_STOP


async def run_job(agent: Agent, session: Session, prompt: str) -> str:
    """A scheduled prompt's turn (session.origin set): the prompt shown as the user's,
    every update marked. The model wrote that prompt, so it is never a slash command: it
    goes to the model as text, and the policy refuses its turn any change of mode or
    schedule."""
    try:
        if session.mcp_ready is not None and not session.mcp_ready.done():
            await asyncio.wait([session.mcp_ready], timeout=agent.config.mcp_start_timeout)
        return await run_turn(agent, session, prompt)
    finally:
        session.origin = None
        agent.save(session)


def model_messages(agent: Agent, session: Session, tools: list) -> list:
    """What goes to the model: the system prompt, then the conversation -- in the text
    protocol's form when the model takes no tool definitions."""
    system = system_prompt(agent, session)
    messages = merge_user_turns(session.messages)
    if session.text_tools or agent.config.tool_protocol == "text":
        session.text_tools = True
        system += "\n\n" + text_tool_instructions(tools)
        messages = as_text_protocol(messages)
    return [{"role": "system", "content": system}] + messages


# -- The text protocol for tool calls ------------------------------------------------------
#
# Some models (many small local ones) reject the `tools` parameter. For them qcr describes
# the tools in the system prompt and reads calls out of the answer: a fenced block
#     ```tool
#     {"name": "ReadFile", "arguments": {"path": "app.py"}}
#     ```
# per call; results come back as user messages. qcr switches on its own when a server
# answers 400 about tools, or always with toolProtocol: "text".

TOOL_BLOCK = re.compile(r"```tool\s*\n(.*?)```", re.S)


def rejects_tools(error: ProviderError) -> bool:
    """Does the server's own error say the model takes no tool definitions? (Its words
    only: never qcr's hint. llama.cpp without --jinja answers 500 "tools param requires
    --jinja flag"; others 400 "does not support tools".)"""
    text = error.detail.lower()
    return error.status in (400, 422, 500) and "tool" in text and any(
        word in text for word in ("support", "not ", "unknown", "invalid", "requires",
                                  "unrecognized", "unexpected"))


def text_tool_instructions(tools: list) -> str:
    described = "\n".join(
        f"- {t['function']['name']}: {t['function']['description'].splitlines()[0]} "
        f"Arguments: {json.dumps(t['function']['parameters']['properties'])}" for t in tools)
    return ("# Tools\nTo use a tool, write a fenced block tagged `tool` holding one JSON "
            "object with the tool's name and arguments, then stop and wait for the result:"
            "\n```tool\n{\"name\": \"ReadFile\", \"arguments\": {\"path\": \"README.md\"}}\n```"
            "\nSeveral blocks make several calls. Results come back in the next message. "
            "The tools:\n" + described)


def text_tool_calls(text: str) -> list:
    """The calls written as ```tool blocks, in the shape of streamed tool calls."""
    calls = []
    for block in TOOL_BLOCK.findall(text):
        try:
            call = loads(block.strip())
        except ValueError:
            call = repair_json(block.strip())
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            arguments = call.get("arguments", {})
            calls.append({"id": "call_" + os.urandom(6).hex(), "name": call["name"],
                          "arguments": json.dumps(arguments if isinstance(arguments, dict)
                                                  else {})})
    return calls


def as_text_protocol(messages: list) -> list:
    """Tool calls stay in the assistant's text (where the model wrote them); results become
    user messages."""
    out = []
    for message in messages:
        if message.get("role") == "tool":
            out.append({"role": "user", "content": f"[tool result]\n{message.get('content')}"})
        elif message.get("role") == "assistant" and message.get("tool_calls"):
            out.append({k: v for k, v in message.items() if k != "tool_calls"})
        else:
            out.append(message)
    return merge_user_turns(out)


def open_turn(agent: Agent, session: Session, text: str, shown: str, images: list) -> None:
    """The user's message: into the model's context (images as data URIs unless the model
    is text-only) and the thread's record; the session's title from its first prompt."""
    close_open_calls(session.messages, "Not run: the turn was interrupted.")
    content: Any = text
    if images and agent.config.images:
        content = [{"type": "text", "text": text}] + [
            {"type": "image_url",
             "image_url": {"url": f"data:{i['mimeType']};base64,{i['data']}"}}
            for i in images]
    session.messages.append({"role": "user", "content": content})
    if session.origin:      # nobody typed it: show it as it starts
        agent.update(session, message_chunk("user_message_chunk", shown or text))
    elif shown or text:
        session.record(message_chunk("user_message_chunk", shown or text))
    for image in images:
        session.record({"sessionUpdate": "user_message_chunk", "content": image})
    if not session.title:
        session.title = " ".join((shown or text).split())[:80] or "Untitled"
        agent.update(session, session_info_update(session.title, iso_time(time.time())))
    agent.save(session)


async def ask_model(agent: Agent, session: Session, provider: Provider, reply: Reply,
                    emit: Callable) -> None:
    """One model call, streamed into `reply` and appended to the context. A model that
    rejects tool definitions is switched to the text protocol and asked again."""
    tools = tool_specs(session.mode, agent.config.web, agent.mcp_tools(session))
    try:
        messages = model_messages(agent, session, tools)
        await provider.stream(messages, [] if session.text_tools else tools, reply, emit)
    except ProviderError as e:
        if not rejects_tools(e) or session.text_tools or reply.started:
            raise
        session.text_tools = True
        emit("notice:info", f"[note] {session.model} does not take tool "
             "definitions, so qcr asks for tool calls as text instead.\n\n")
        messages = model_messages(agent, session, tools)
        await provider.stream(messages, [], reply, emit)
    if session.text_tools:
        reply.calls = text_tool_calls(reply.text)
        reply.finish = "tool_calls" if reply.calls else reply.finish
    session.messages.append(reply.message())
    report_usage(agent, session, reply, messages, tools)
    agent.save(session)


def keep_partial(session: Session, reply: Optional[Reply]) -> None:
    """What the model had said when the turn broke off stays in its context."""
    if reply is not None and reply.parts:
        session.messages.append({"role": "assistant", "content": reply.text})


def bounded_reply(config: Config) -> Reply:
    """A Reply that holds a hostile server to the configured bounds."""
    return Reply(max_chars=config.max_reply_chars, max_calls=config.max_tool_calls,
                 max_argument_chars=config.max_argument_chars)


async def run_tool_call(agent: Agent, session: Session, call: dict) -> None:
    """Announce, check, approve, run and report one tool call. Its result joins the
    context and is saved before the client hears that it completed."""
    call_id = "call-" + os.urandom(6).hex()
    tool_ = TOOLS.get(call["name"]) or agent.mcp_tools(session).get(call["name"])
    try:
        args, bad_json = loads(call["arguments"] or "{}"), None
    except ValueError as e:
        args, bad_json = None, e
    fields = args if isinstance(args, dict) else {}
    title = printable(str(tool_.title(fields, session) if tool_ else call["name"] or
                          "Unknown tool"))
    locations = [{"path": absolute(session.cwd, p)}
                 for p in (fields.get(k) for k in ("path", "source", "destination"))
                 if isinstance(p, str) and p.strip() and "\0" not in p]
    card = tool_call(call_id, title, tool_.kind if tool_ else "other", locations,
                     args if args is not None else call["arguments"],
                     call["name"] if isinstance(call.get("name"), str) else None)
    agent.update(session, card)
    ctx = ToolContext(agent, session, call_id, tool_, card)
    try:
        if tool_ is None or (tool_.web and not agent.config.web):
            names = [t["function"]["name"] for t in tool_specs(
                session.mode, agent.config.web, agent.mcp_tools(session))]
            raise ToolError(f"there is no tool named {call['name']!r}; the tools are "
                            f"{', '.join(names)}.")
        if call.get("cut"):
            raise ToolError(f"the arguments were over {agent.config.max_argument_chars:,} "
                            "characters (maxToolArgumentChars), so they were dropped and "
                            "nothing was run. Send smaller pieces: several EditFile calls "
                            "instead of one huge WriteFile.")
        if bad_json is not None:
            raise ToolError(f"the arguments were not valid JSON ({bad_json}); send a JSON "
                            "object.")
        kwargs = check_args(tool_, args)
        if not tool_.effects:        # nothing for the policy to decide: it runs now
            ctx.start()
        result = await tool_.run(ctx, **kwargs)
    except ToolError as e:
        return await finish_call(agent, session, call_id, tool_message(call["id"], "Error: " +
                                                                       str(e)), failure(str(e)))
    except asyncio.CancelledError:
        fail_tool_call(agent, session, call, call_id, "Cancelled by the user.")
        raise
    except Exception as e:
        import traceback
        log(f"tool {call['name']} crashed:\n{traceback.format_exc()}", error=True)
        why = f"qcr failed inside the tool ({type(e).__name__}: {e})"
        return await finish_call(agent, session, call_id,
                                 tool_message(call["id"], "Error: " + why), failure(why))
    update = {"status": "completed", "content": result.content,
              "rawOutput": result.raw if result.raw is not None else {"output": result.output}}
    if result.locations is not None:
        update["locations"] = result.locations
    await finish_call(agent, session, call_id, tool_message(call["id"], result.output), update)
    if result.replay is not None:
        session.reshow(call_id, content=result.replay)


async def finish_call(agent: Agent, session: Session, call_id: str, message: dict,
                      update: dict) -> None:
    """The call's result into the context, on disk, and then shown as done."""
    session.messages.append(message)
    await agent.update_saved(session, tool_call_update(call_id, **update))


def failure(why: str) -> dict:
    return {"status": "failed", "content": [text_content(why)], "rawOutput": {"error": why}}


def fail_tool_call(agent: Agent, session: Session, call: dict, call_id: str, why: str) -> dict:
    agent.update(session, tool_call_update(call_id, **failure(why)))
    return tool_message(call["id"], "Error: " + why)


# -- Usage and compaction ----------------------------------------------------------------------
#
# After every model call the client hears how full the context is (usage_update): the
# server's own count when it sends one, else qcr's estimate (about four characters a token).
# Before a model call, when the context has passed `compactAt` of the window, the older
# part of the conversation is summarised by the model and replaced by that summary; the most
# recent turns and the current plan stay as they are. /compact does the same on demand.

CONTEXT_WINDOWS = [    # model name pattern -> context window in tokens; the first match wins
    (r"gpt-4\.1", 1_047_576), (r"gpt-5", 400_000), (r"gpt-4o|gpt-4-turbo", 128_000),
    (r"(^|/)o[1-9]", 200_000), (r"claude", 200_000), (r"gemini", 1_048_576),
    (r"qwen3-coder", 262_144), (r"qwen", 32_768), (r"deepseek", 128_000),
    (r"llama-?3\.[1-3]", 128_000), (r"codestral", 256_000), (r"mistral|mixtral", 32_768),
    (r"kimi|moonshot", 131_072), (r"glm", 128_000), (r"gpt-oss", 131_072),
]
DEFAULT_CONTEXT_WINDOW = 32_768    # tokens, for a model nobody has told qcr about
IMAGE_CHARS = 4000                 # an image counts as about 1,000 tokens
KEEP_SHARE = 0.3                   # compaction keeps recent turns up to this share of the window
SUMMARY_INTRO = ("[Summary of the earlier conversation, written when the context was "
                 "compacted. The turns after it are verbatim.]\n\n")
COMPACT_INSTRUCTIONS = (
    "You summarise a coding session so that it can go on without its full history. Write a "
    "complete, concise summary in Markdown bullets: the user's goals and requests (quote the "
    "latest one), decisions made, files read and changed (with paths) and how, commands run "
    "and their outcomes, errors and how they were resolved, and what remains to do. Invent "
    "nothing.")


def context_window(config: Config, model: str) -> int:
    """The model's context window: from the configuration, else what the server said, else
    the table, else the default."""
    if config.context_window:
        return config.context_window
    if config.server_windows.get(model):
        return config.server_windows[model]
    for pattern, size in CONTEXT_WINDOWS:
        if re.search(pattern, model.lower()):
            return size
    return DEFAULT_CONTEXT_WINDOW


async def learn_context_window(config: Config, model: str) -> None:
    """Ask the server once per model how large its context is, when the user has not said.

    vLLM lists `max_model_len` and OpenRouter-style servers `context_length` in /models;
    llama.cpp's server reports the `n_ctx` it really runs with at /props.
    """
    if config.context_window or not config.base_url or not model or \
            model in config.server_windows:
        return
    config.server_windows[model] = 0          # asked (once), whatever the answer

    def ask() -> int:
        base = config.base_url.rstrip("/")
        for url in (base + "/models", re.sub(r"/v1$", "", base) + "/props"):
            data = server_json(url, config.api_key, 2)
            if isinstance(data, dict) and isinstance(data.get("data"), list):
                for entry in data["data"]:
                    if isinstance(entry, dict) and entry.get("id") == model:
                        size = entry.get("max_model_len") or entry.get("context_length")
                        if isinstance(size, int) and size > 0:
                            return size
            if isinstance(data, dict):
                settings = data.get("default_generation_settings")
                size = (settings if isinstance(settings, dict) else data).get("n_ctx")
                if isinstance(size, int) and size > 0:
                    return size
        return 0
    config.server_windows[model] = await asyncio.to_thread(ask)


def estimate_tokens(messages: list) -> int:
    """About four characters a token, plus a little per message."""
    chars = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):       # text and images
            chars += sum(len(p.get("text", "")) if p.get("type") == "text" else IMAGE_CHARS
                         for p in content if isinstance(p, dict))
        else:
            chars += len(content) if isinstance(content, str) else len(json.dumps(content or ""))
        for call in message.get("tool_calls") or []:
            chars += len(json.dumps(call))
        chars += 16
    return chars // 4 + 1


def report_usage(agent: Agent, session: Session, reply: Reply, sent: list, tools: list) -> None:
    usage = reply.usage or {}
    total = usage.get("total_tokens")
    if not isinstance(total, int) or isinstance(total, bool):
        parts = [usage.get("prompt_tokens"), usage.get("completion_tokens")]
        total = sum(parts) if all(isinstance(p, int) for p in parts) else None
    estimated = not total
    if estimated:
        total = estimate_tokens(sent + [reply.message()]) + len(json.dumps(tools)) // 4
    session.context_used, session.context_mark = total, len(session.messages)
    price = None if estimated else price_of(agent.config, session.model)
    if price:
        session.cost += reply_cost(usage, price)
    agent.update(session, usage_update(total, context_window(agent.config, session.model),
                                       estimated, session.cost if price else None))


PRICES = {   # USD per million tokens, as published (2026); `prices` in the config wins
    "gpt-5*": {"input": 1.25, "output": 10, "cached": 0.125},
    "gpt-5-mini*": {"input": 0.25, "output": 2, "cached": 0.025},
    "gpt-4.1*": {"input": 2, "output": 8, "cached": 0.5},
    "gpt-4.1-mini*": {"input": 0.4, "output": 1.6, "cached": 0.1},
    "gpt-4o*": {"input": 2.5, "output": 10, "cached": 1.25},
    "gpt-4o-mini*": {"input": 0.15, "output": 0.6, "cached": 0.075},
    "o3*": {"input": 2, "output": 8, "cached": 0.5},
    "o4-mini*": {"input": 1.1, "output": 4.4, "cached": 0.275},
    "claude-opus-4*": {"input": 15, "output": 75, "cached": 1.5},
    "claude-sonnet-4*": {"input": 3, "output": 15, "cached": 0.3},
    "claude-3-7-sonnet*": {"input": 3, "output": 15, "cached": 0.3},
    "claude-3-5-haiku*": {"input": 0.8, "output": 4, "cached": 0.08},
}


def price_of(config: Config, model: str) -> Optional[dict]:
    """The price of a model, the longest matching pattern first: the configured `prices`
    (wherever the server is: a local proxy may bill), else the built-in table's -- but not
    for a server on this machine or network, which costs nothing (and sends no cost)."""
    import fnmatch
    import ipaddress
    from urllib.parse import urlparse

    def look_up(table: dict) -> Optional[dict]:
        found = [p for p in table if fnmatch.fnmatchcase(model, p)]
        return table[max(found, key=len)] if found else None
    if look_up(config.prices):
        return look_up(config.prices)
    url = config.anthropic_base_url if config.provider == "anthropic" else config.base_url
    host = urlparse(url or "https://api").hostname or ""
    try:
        if host == "localhost" or not ipaddress.ip_address(host).is_global:
            return None
    except ValueError:
        pass                       # a name: a hosted service
    return look_up(PRICES)


def reply_cost(usage: dict, price: dict) -> float:
    """What one reply cost, from the token counts the server reported."""
    def count(value: Any) -> int:
        return value if isinstance(value, int) and not isinstance(value, bool) else 0
    details = usage.get("prompt_tokens_details")
    cached = count(details.get("cached_tokens")) if isinstance(details, dict) else 0
    cached += count(usage.get("cache_read_input_tokens"))
    prompt = max(count(usage.get("prompt_tokens")) - cached, 0)
    return (prompt * price["input"] + cached * price.get("cached", price["input"]) +
            count(usage.get("completion_tokens")) * price["output"]) / 1e6


def context_now(session: Session) -> int:
    """Tokens in context: the last count, plus an estimate of what came after it."""
    if session.context_used and session.context_mark <= len(session.messages):
        return session.context_used + estimate_tokens(session.messages[session.context_mark:])
    return estimate_tokens(session.messages)


def needs_compaction(agent: Agent, session: Session) -> bool:
    window = context_window(agent.config, session.model)
    return context_now(session) > agent.config.compact_at * window and \
        compaction_cut(session.messages, int(window * KEEP_SHARE)) > 1


def compaction_cut(messages: list, keep_tokens: int) -> int:
    """Where the kept tail starts: the earliest turn boundary (a user or assistant message,
    so a tool call never loses its result) whose tail fits keep_tokens -- or, if even the
    last step is larger, that last step. 0 means there is nothing older to summarise."""
    cut, tail = 0, 0
    for i in range(len(messages) - 1, 0, -1):
        tail += estimate_tokens([messages[i]])
        if messages[i].get("role") in ("user", "assistant"):
            if tail > keep_tokens and cut:
                break
            cut = i
    return cut


def render_history(messages: list, limit: int) -> str:
    """Old messages as plain text for the summariser, long outputs clipped."""
    def clip(text: str, size: int) -> str:
        return text if len(text) <= size else text[:size] + f" [... {len(text) - size} more]"
    parts = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = " ".join(p.get("text", "") if p.get("type") == "text" else "[image]"
                               for p in content if isinstance(p, dict))
        content = content if isinstance(content, str) else json.dumps(content)
        if message.get("role") == "tool":
            parts.append("[tool result]\n" + clip(content, 2000))
            continue
        if content:
            parts.append(f"[{message.get('role')}]\n" + clip(content, 8000))
        for call in message.get("tool_calls") or []:
            function = call.get("function") or {}
            parts.append(f"[{message.get('role')} calls {function.get('name')}] "
                         + clip(str(function.get("arguments")), 1000))
    return "\n\n".join(parts)[-limit:]


async def compact(agent: Agent, session: Session, instructions: str, automatic: bool) -> bool:
    """Summarise the older part of the model's context, shown as its own tool call.

    Automatic compaction keeps the recent turns up to KEEP_SHARE of the window; /compact
    keeps only the last step."""
    window = context_window(agent.config, session.model)
    before = estimate_tokens(session.messages)
    show = CompactionShown(agent, session, {"instructions": instructions,
                                            "automatic": automatic})
    cut = compaction_cut(session.messages, int(window * KEEP_SHARE) if automatic else 0)
    if cut == 0:
        show.end("Nothing to compact: the whole conversation is recent.")
        return False
    show.working()
    request = render_history(session.messages[:cut], window * 2)
    if instructions:
        request += "\n\nIn the summary, also: " + instructions
    reply = Reply()
    try:
        await make_provider(agent.config, session.model).stream(
            [{"role": "system", "content": COMPACT_INSTRUCTIONS},
             {"role": "user", "content": request}], [], reply, lambda kind, text: None)
        if not reply.text.strip():
            raise ProviderError("the model returned an empty summary")
    except ProviderError as e:
        show.failed(f"Not compacted: {e}")
        return False
    except asyncio.CancelledError:
        show.failed("Cancelled by the user.", cancelled=True)
        raise
    summary = reply.text.strip()
    kept_plan = "".join(f"\n- [{e['status']}] {e['content']}" for e in session.plan)
    head = SUMMARY_INTRO + summary + (f"\n\nThe current plan:{kept_plan}" if kept_plan else "")
    session.messages[:cut] = [{"role": "user", "content": head}]
    after = estimate_tokens(session.messages)
    session.context_used, session.context_mark = after, len(session.messages)
    show.end(f"Compacted the conversation from about {before:,} to {after:,} tokens.",
             summary, {"tokensBefore": before, "tokensAfter": after, "summarisedMessages": cut})
    agent.update(session, usage_update(after, window, estimated=True))
    agent.save(session)
    return True


class CompactionShown:
    """How a compaction appears in the thread: as the protocol has it (compaction_update,
    compaction_summary_chunk) when the client advertised session.compaction, else as a
    tool card of its own."""

    def __init__(self, agent: Agent, session: Session, raw_input: dict):
        self.agent, self.session = agent, session
        self.protocol = agent.client_can("session", "compaction")
        self.id = new_id("compaction")
        if self.protocol:
            self.update(status="in_progress")
        else:
            agent.update(session, tool_call(self.id, "Compact the conversation", "other", [],
                                            raw_input))

    def update(self, **fields) -> None:
        self.agent.update(self.session, {"sessionUpdate": "compaction_update",
                                         "compactionId": self.id, **fields})

    def working(self) -> None:
        if not self.protocol:
            self.agent.update(self.session, tool_call_update(self.id, status="in_progress"))

    def end(self, said: str, summary: str = "", numbers: Optional[dict] = None) -> None:
        if not self.protocol:
            self.agent.update(self.session, tool_call_update(
                self.id, status="completed",
                content=[text_content(said + (f"\n\n{summary}" if summary else ""))],
                **({"rawOutput": numbers} if numbers else {})))
        elif not summary:
            self.update(status="cancelled", _meta={"qcr": {"reason": said}})
        else:
            self.agent.update(self.session, {"sessionUpdate": "compaction_summary_chunk",
                                             "compactionId": self.id,
                                             "content": text_block(summary)})
            self.update(status="completed", _meta={"qcr": numbers or {}})

    def failed(self, why: str, cancelled: bool = False) -> None:
        if not self.protocol:
            fail_tool_call(self.agent, self.session, {"id": ""}, self.id, why)
        elif cancelled:
            self.update(status="cancelled")
        else:
            self.update(status="failed", error=why)


# -- Slash commands ----------------------------------------------------------------------------
#
# The client shows the commands from available_commands_update in its "/" menu and sends the
# choice back as plain text: "/mode plan". Built-ins are handled here; a user command
# (~/.qcr/commands/NAME.md) or project command (<cwd>/.qcr/commands/NAME.md) is a Markdown
# prompt template whose $ARGUMENTS becomes what followed the name. Any other "/word" is
# ordinary text for the model.

@dataclass
class Command:
    """A slash command: a built-in (`run`) or a Markdown prompt template (`template`)."""
    name: str
    description: str
    hint: str = ""                     # shown in the input box; "" = takes no input
    template: Optional[str] = None     # a prompt template; None for a built-in
    run: Optional[Callable] = None     # a built-in: async (agent, session, args) -> stop reason

    def available(self) -> dict:
        command: dict = {"name": self.name, "description": self.description}
        if self.hint:
            command["input"] = {"hint": self.hint}
        return command


INIT_PROMPT = (
    "Explore this project -- its folders, README, build and test files, and a few central "
    "source files -- and write QCR.md at the project root for future sessions: what the "
    "project is, how to build, test and run it, its layout, the conventions to follow, and "
    "anything surprising. Keep it under 150 lines. If QCR.md exists, improve it instead.")


def find_commands(config: Config, cwd: str) -> dict:
    """Built-ins, then user commands, plugins' commands, and project commands (a later one
    wins a name; a built-in always does)."""
    commands = {c.name: c for c in BUILTIN_COMMANDS}
    folders = [os.path.join(config.home, "commands")] + \
        [os.path.join(folder, "commands") for folder, _, _ in plugins(config, cwd)] + \
        [os.path.join(cwd, ".qcr", "commands")]
    for folder in folders:
        try:
            names = sorted(os.listdir(folder))
        except OSError:
            continue
        for name in names:
            stem = name[:-3]
            if name.endswith(".md") and re.fullmatch(r"[A-Za-z0-9][\w.-]*", stem) and \
                    stem not in BUILTIN_NAMES:
                command = read_command(os.path.join(folder, name), stem, cwd)
                if command:
                    commands[stem] = command
    return commands


def read_command(path: str, name: str, project: str) -> Optional[Command]:
    """A prompt template; its description from front matter or its first line."""
    text = read_context_file(path, project)
    if not text:
        return None
    fields = {}
    front = re.match(r"---\n(.*?)\n---\n?", text, re.S)
    if front:
        for line in front.group(1).splitlines():
            key, _, value = line.partition(":")
            fields[key.strip().lower()] = value.strip().strip("\"'")
        text = text[front.end():]
    first = next((line.strip("# ").strip() for line in text.splitlines() if line.strip()), "")
    description = fields.get("description") or first[:100] or name
    hint = fields.get("argument-hint") or ("arguments" if "$ARGUMENTS" in text else "")
    return Command(name, description, hint, template=text.strip())


async def run_prompt(agent: Agent, session: Session, text: str, images: list = ()) -> str:
    """A prompt is a slash command, or a turn for the model. The session's MCP servers get
    a bounded wait to finish starting, so a turn never begins with half its tools."""
    if session.mcp_ready is not None and not session.mcp_ready.done():
        await asyncio.wait([session.mcp_ready], timeout=agent.config.mcp_start_timeout)
    match = re.match(r"/([A-Za-z0-9][\w.-]*)(?:\s+(.*))?\Z", text.strip(), re.S)
    command = session.command_table.get(match.group(1)) if match else None
    if command is None:
        return await run_turn(agent, session, text, images=images)
    args = (match.group(2) or "").strip()
    if command.run is not None:
        return await command.run(agent, session, args, text)
    if "$ARGUMENTS" in command.template:
        prompt = command.template.replace("$ARGUMENTS", args)
    else:
        prompt = command.template + (f"\n\n{args}" if args else "")
    return await run_turn(agent, session, prompt, shown=text, images=images)


def answer(agent: Agent, session: Session, typed: str, reply: str) -> str:
    """A built-in command's exchange, in the thread (and its replay), not in the model's."""
    session.record(message_chunk("user_message_chunk", typed))
    agent.update(session, message_chunk("agent_message_chunk", reply))
    return "end_turn"


async def command_init(agent: Agent, session: Session, args: str, typed: str) -> str:
    return await run_turn(agent, session, INIT_PROMPT + (f"\n\n{args}" if args else ""),
                          shown=typed)


async def command_compact(agent: Agent, session: Session, args: str, typed: str) -> str:
    session.record(message_chunk("user_message_chunk", typed))
    await compact(agent, session, args, automatic=False)
    return "end_turn"


async def command_mode(agent: Agent, session: Session, args: str, typed: str) -> str:
    if args not in MODE_IDS:
        return answer(agent, session, typed, f"The mode is **{session.mode}**. Choose one of: "
                      + ", ".join(f"`{m}`" for m in MODE_IDS) + " -- e.g. `/mode plan`.")
    agent.set_mode(session, args, "mode")
    return answer(agent, session, typed, f"Mode: **{args}**.")


async def command_model(agent: Agent, session: Session, args: str, typed: str) -> str:
    models = agent.models(session)
    if args not in models:
        return answer(agent, session, typed, f"The model is **{session.model or NO_MODEL}**. "
                      "Choose one of: " + ", ".join(f"`{m}`" for m in models) +
                      " (add more with `models` in ~/.qcr/config.json).")
    agent.set_model(session, args, "model")
    return answer(agent, session, typed, f"Model: **{args}**.")


async def command_undo(agent: Agent, session: Session, args: str, typed: str) -> str:
    """Revert file changes: the last one, the last N, or every change of one tool call --
    each a card with the reversing diff; a file changed since asks first."""
    changes = session.changes
    if args.isdigit() and int(args) > 0:
        picked = changes[-int(args):]
    elif args:
        picked = [c for c in changes if c["id"] == args]
    else:
        picked = changes[-1:]
    if not picked:
        return answer(agent, session, typed, "Nothing to undo." if not args else
                      f"No change of `{args}` is kept to undo; `/undo` reverts the last one.")
    session.record(message_chunk("user_message_chunk", typed))
    for change in reversed(picked):
        await undo_change(agent, session, change)
    agent.save(session)
    return "end_turn"


async def undo_change(agent: Agent, session: Session, change: dict) -> None:
    """One change reverted, as a tool card of its own (the user asked: no policy card, but
    a file that changed since the change asks before it is overwritten)."""
    path, source = change["path"], change.get("source") or ""
    card_id = new_id("undo")
    card = tool_call(card_id, f"Undo: {'move back ' + path if source else path}",
                     "move" if source else "edit", [{"path": source or path}],
                     {"undo": change["id"]}, "undo")
    agent.update(session, card)
    ctx = ToolContext(agent, session, card_id, None, card)

    async def confirm(why: str, shown: dict) -> None:
        choice = await ctx.choose([text_content(why), shown],
                                  [("allow_once", "Undo anyway", "allow_once"),
                                   ("reject_once", "Keep it as it is", "reject_once")])
        if choice != "allow_once":
            raise ToolError("kept as it is")
    try:
        if source:
            if os.path.lexists(source) or not os.path.lexists(path):
                raise ToolError(f"cannot move {path} back: {source} exists, or {path} is gone")
            shown = text_content(f"Moved {path} back to {source}")
            ctx.on_path("delete", path)
            need = ctx.on_path("write", source)
            if need[0] != "write":        # it leads elsewhere now: the user says so again
                await confirm(f"Undoing this means {need[2]}:", shown)
            await asyncio.to_thread(move_path, ctx.real(path), ctx.real(source))
        else:
            need = ctx.on_path("write", path)
            now = await ctx.read(path, remember=False)
            shown = diff_content(path, now, change["before"] or "")
            if now != change["after"]:
                await confirm(f"{path} has changed since that change; undoing it replaces "
                              "what is there now:", shown)
            elif need[0] != "write":      # outside the project now, or guarded: ask
                await confirm(f"Undoing this means {need[2]}:", shown)
            if change["before"] is None:
                if now is not None:
                    await asyncio.to_thread(os.remove, ctx.real(path))
            else:
                await ctx.write(path, change["before"])
    except (ToolError, OSError) as e:
        why = str(e) if isinstance(e, ToolError) else (e.strerror or str(e))
        agent.update(session, tool_call_update(card_id, status="failed",
                                               content=[text_content(f"Not undone: {why}")]))
        return
    session.changes.remove(change)
    agent.update(session, tool_call_update(card_id, status="completed", content=[shown]))
    messages = session.messages       # the model learns of it with the next prompt
    messages.append({"role": "user", "content": f"[The user reverted a change of yours "
                                                f"({change['id']}) to {path}.]"})


async def command_effort(agent: Agent, session: Session, args: str, typed: str) -> str:
    """How hard the model thinks (the Thinking selector): the levels the model takes."""
    levels = effort_levels(agent.config, session.model)
    if not levels:
        return answer(agent, session, typed, f"**{session.model or NO_MODEL}** takes no "
                      "reasoning effort setting.")
    if args not in levels + ["default"]:
        return answer(agent, session, typed, f"Thinking: **{session.effort or 'default'}**. "
                      "Choose one of: " + ", ".join(f"`{v}`" for v in ["default"] + levels) +
                      ".")
    agent.set_effort(session, args, "effort")
    return answer(agent, session, typed, f"Thinking: **{args}**.")


async def command_permissions(agent: Agent, session: Session, args: str, typed: str) -> str:
    """List the remembered answers that apply here (session, project, everywhere); revoke."""
    remembered = await agent.ledger.scoped(session)
    words = args.split()
    if words[:1] == ["revoke"] and len(words) == 2:
        if words[1] == "all":
            for scope, key, _ in remembered:
                await agent.ledger.revoke(session, scope, key)
            return answer(agent, session, typed, "Revoked every remembered answer that "
                          "applied here.")
        if words[1].isdigit() and 1 <= int(words[1]) <= len(remembered):
            scope, key, entry = remembered[int(words[1]) - 1]
            await agent.ledger.revoke(session, scope, key)
            return answer(agent, session, typed, f"Revoked: {describe_answer(scope, entry)}.")
    if not remembered:
        return answer(agent, session, typed, "No remembered answers apply here: every change "
                      "and command asks first (in the default mode).")
    lines = [f"{i}. {describe_answer(scope, entry)}"
             for i, (scope, _, entry) in enumerate(remembered, 1)]
    return answer(agent, session, typed, "Remembered answers:\n" + "\n".join(lines) +
                  "\n\n`/permissions revoke N` forgets one, `/permissions revoke all` all.")


def describe_answer(scope: str, entry: dict) -> str:
    where = {"session": "for this session", "project": "in this project",
             "global": "everywhere"}[scope]
    return f"{'allow' if entry['allow'] else 'reject'} {entry['label']} {where}"


BUILTIN_COMMANDS = [
    Command("init", "Explore the project and write QCR.md, the notes qcr reads every turn",
            "what to focus on (optional)", run=command_init),
    Command("compact", "Summarise the conversation so far to free context",
            "what the summary must keep (optional)", run=command_compact),
    Command("mode", "Switch mode: default, plan, auto-edit or yolo",
            "default | plan | auto-edit | yolo", run=command_mode),
    Command("model", "Switch the model", "model id", run=command_model),
    Command("undo", "Revert the last file change, the last N, or those of one tool call",
            "N | tool call id (optional)", run=command_undo),
    Command("effort", "How hard the model thinks: default, or the levels it takes",
            "default | low | medium | high", run=command_effort),
    Command("permissions", "List remembered approvals, or revoke them", "revoke N | revoke all",
            run=command_permissions),
]
BUILTIN_NAMES = {c.name for c in BUILTIN_COMMANDS}


# =============================================================================================
# 7. MCP: the tools of other programs
# =============================================================================================
#
# The editor hands qcr MCP servers in session/new (Zed passes the user's "context servers"),
# and ~/.qcr/mcp.json and plugins add more. qcr is their client: it speaks MCP's JSON-RPC --
# over a child's stdin/stdout (section 1's Connection again), over streamable HTTP, or over
# the older HTTP+SSE transport -- lists their tools, and offers them to the model as
# mcp__<server>__<tool>. Their calls go through the same tool-call cards and permission
# path as qcr's own tools; a tool that says it is read-only needs no approval.
#
#   -> {"jsonrpc":"2.0","id":0,"method":"initialize","params":{"protocolVersion":...}}
#   -> {"jsonrpc":"2.0","method":"notifications/initialized"}
#   -> {"jsonrpc":"2.0","id":1,"method":"tools/list","params":{}}

MCP_VERSIONS = ("2025-06-18", "2025-03-26", "2024-11-05")   # newest first
MCP_HTTP_TIMEOUT = 30          # seconds for one HTTP exchange with an MCP server
MCP_ENV = ("HOME", "LOGNAME", "PATH", "SHELL", "TERM", "USER", "LANG", "LC_ALL", "TMPDIR",
           "SYSTEMROOT")    # what a stdio server inherits from qcr's environment


class McpError(Exception):
    """An MCP server failed: could not start, crashed, timed out, or answered an error."""


class StdioTransport:
    """A server as a child process: JSON-RPC lines on its stdin and stdout."""

    def __init__(self, name: str, spec: dict, home: str = ""):
        self.name, self.spec, self.home = name, spec, home
        self.proc: Any = None
        self.conn: Optional[Connection] = None
        self.reading: Optional[asyncio.Future] = None

    async def open(self, on_notification: Callable) -> None:
        import subprocess
        env = {k: v for k, v in os.environ.items() if k in MCP_ENV}
        env.update(self.spec.get("env") or {})
        log_file = open(os.path.join(self.home, "qcr.log"), "ab") \
            if self.home and os.path.isdir(self.home) else None
        try:
            self.proc = await start_process(    # its own group: stopped with its children
                self.spec["command"], *self.spec.get("args", []), env=env,
                cwd=self.spec.get("cwd"), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=log_file or subprocess.DEVNULL, limit=MAX_FRAME_BYTES)
        except OSError as e:
            raise McpError(f"cannot start {self.spec['command']}: {e.strerror or e}") from None
        finally:
            if log_file:
                log_file.close()

        async def refuse(method: str, params: dict) -> Any:     # no roots, no sampling
            raise RpcError.method_not_found(method)
        self.conn = Connection(self.proc.stdin.write, refuse, on_notification,
                               cancel_method=None)    # (MCP has notifications/cancelled)
        self.reading = asyncio.ensure_future(self.conn.serve(self.proc.stdout))
        self.reading.add_done_callback(lambda _: self.conn.cancel_pending())

    @property
    def last_id(self) -> int:
        return self.conn.next_id - 1 if self.conn else 0

    async def request(self, method: str, params: dict) -> Any:
        if self.reading is None or self.reading.done():
            raise McpError(f"the server {self.name} has exited")
        try:
            return await self.conn.request(method, params)
        except asyncio.CancelledError:
            if self.reading.done():
                raise McpError(f"the server {self.name} exited mid-call") from None
            raise

    def notify(self, method: str, params: dict) -> None:
        if self.conn is not None and self.reading is not None and not self.reading.done():
            self.conn.notify(method, params)

    async def close(self) -> None:
        """The MCP SDK's order: close stdin, wait a moment, terminate, wait, kill -- the
        whole process group at the end, so the server's own children go too."""
        proc = self.proc
        if proc is None:
            return
        if proc.returncode is None:
            try:
                proc.stdin.close()
            except OSError:
                pass
            for stop in (None, proc.terminate, proc.kill):
                if stop:
                    try:
                        stop()
                    except ProcessLookupError:
                        break
                try:
                    await asyncio.wait_for(proc.wait(), 1.0)
                    break
                except asyncio.TimeoutError:
                    continue
        stop_group(proc.pid)


class HttpTransport:
    """Streamable HTTP: each message a POST; the answer JSON or a short SSE stream. The
    server's Mcp-Session-Id is kept and sent back."""

    def __init__(self, name: str, spec: dict):
        self.name, self.spec, self.session_id, self.next_id = name, spec, None, 0
        self.on_notification: Callable = lambda method, params: None
        self.version = ""

    async def open(self, on_notification: Callable) -> None:
        loop = asyncio.get_running_loop()      # post() runs in a thread: hand over
        self.on_notification = lambda method, params: loop.call_soon_threadsafe(
            on_notification, method, params)

    def post(self, message: dict) -> Any:
        """One POST (in a thread): the response to `message`, or None for a notification."""
        import urllib.error
        headers = {"Content-Type": "application/json",
                   "Accept": "application/json, text/event-stream"}
        if self.session_id:
            headers["Mcp-Session-Id"] = self.session_id
        if self.version:
            headers["MCP-Protocol-Version"] = self.version
        try:
            with open_url(self.spec["url"], json.dumps(message).encode(), headers,
                          self.spec.get("headers"), MCP_HTTP_TIMEOUT, redirects=0,
                          method="POST") as response:     # (the URL the user cleared)
                self.session_id = response.headers.get("Mcp-Session-Id") or self.session_id
                if "id" not in message or response.status == 202:
                    return None
                if "text/event-stream" in response.headers.get("Content-Type", ""):
                    for data in parse_sse(bounded_lines(response)):
                        reply = loads(data)
                        if reply.get("id") == message["id"] and "method" not in reply:
                            return reply
                        if "method" in reply and "id" not in reply:
                            self.on_notification(reply["method"], reply.get("params") or {})
                    raise McpError(f"{self.name} ended its stream without an answer")
                return loads(response.read(MAX_EVENT_BYTES))
        except urllib.error.HTTPError as e:
            raise McpError(f"{self.name} answered HTTP {e.code} {e.reason}") from None
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise McpError(f"cannot reach {self.spec['url']}: {getattr(e, 'reason', e)}") \
                from None

    @property
    def last_id(self) -> int:
        return self.next_id - 1

    async def request(self, method: str, params: dict) -> Any:
        request_id, self.next_id = self.next_id, self.next_id + 1
        reply = await asyncio.to_thread(self.post, {"jsonrpc": "2.0", "id": request_id,
                                                    "method": method, "params": params})
        return answer_of(reply, self.name)

    def notify(self, method: str, params: dict) -> None:
        message = {"jsonrpc": "2.0", "method": method, "params": params}
        asyncio.ensure_future(asyncio.to_thread(self.post, message)).add_done_callback(
            lambda f: f.cancelled() or f.exception())

    async def close(self) -> None:
        pass


class SseTransport:
    """The older HTTP+SSE transport: a GET stream whose first event names the URL to POST
    to; every answer comes back on the stream."""

    def __init__(self, name: str, spec: dict):
        self.name, self.spec, self.next_id = name, spec, 0
        self.pending: dict = {}
        self.closed = False
        self.endpoint: Optional[str] = None
        self.stream: Any = None
        self.on_notification: Callable = lambda method, params: None

    async def open(self, on_notification: Callable) -> None:
        from urllib.parse import urljoin
        self.on_notification = on_notification
        loop = asyncio.get_running_loop()
        ready = loop.create_future()

        def read() -> None:
            try:
                self.stream = open_url(self.spec["url"], None, {"Accept": "text/event-stream"},
                                       self.spec.get("headers"), None,   # idle is fine
                                       redirects=0)
                event = ""
                data: list = []
                for raw in bounded_lines(self.stream):
                    line = raw.decode("utf-8", "replace").rstrip("\r\n")
                    if line.startswith("event:"):
                        event = line[6:].strip()
                    elif line.startswith("data:"):
                        data.append(line[5:].lstrip())
                    elif not line and data:
                        text, data = "\n".join(data), []
                        if event == "endpoint":     # where messages go: the same origin
                            endpoint = urljoin(self.spec["url"], text)    # only, as cleared
                            if origin_of(endpoint) != origin_of(self.spec["url"]):
                                raise McpError(f"the server named an endpoint on another "
                                               f"origin ({origin_of(endpoint)}); refused")
                            loop.call_soon_threadsafe(
                                lambda: ready.done() or ready.set_result(endpoint))
                        else:
                            loop.call_soon_threadsafe(self.receive, text)
                        event = ""
            except Exception as e:
                failure = McpError(f"cannot reach {self.spec['url']}: {getattr(e, 'reason', e)}")
                loop.call_soon_threadsafe(
                    lambda: ready.done() or ready.set_exception(failure))
            loop.call_soon_threadsafe(self.lost)
        threading.Thread(target=read, daemon=True).start()
        self.endpoint = await asyncio.wait_for(ready, MCP_HTTP_TIMEOUT)

    @property
    def last_id(self) -> int:
        return self.next_id - 1

    def receive(self, text: str) -> None:
        try:
            message = loads(text)
        except ValueError:
            return
        future = self.pending.pop(message.get("id"), None) if "method" not in message else None
        if future is not None and not future.done():
            future.set_result(message)
        elif "method" in message and "id" not in message:
            self.on_notification(message["method"], message.get("params") or {})

    def lost(self) -> None:
        self.closed = True
        for future in self.pending.values():
            if not future.done():
                future.set_exception(McpError(f"{self.name} closed its event stream"))
        self.pending.clear()

    def send(self, message: dict) -> None:
        with open_url(self.endpoint, json.dumps(message).encode(),
                      {"Content-Type": "application/json"}, self.spec.get("headers"),
                      MCP_HTTP_TIMEOUT, redirects=0, method="POST"):
            pass

    async def request(self, method: str, params: dict) -> Any:
        if self.closed:
            raise McpError(f"{self.name} closed its event stream")
        request_id, self.next_id = self.next_id, self.next_id + 1
        future = asyncio.get_running_loop().create_future()
        self.pending[request_id] = future
        try:
            await asyncio.to_thread(self.send, {"jsonrpc": "2.0", "id": request_id,
                                                "method": method, "params": params})
        except Exception as e:
            self.pending.pop(request_id, None)
            raise McpError(f"cannot send to {self.name}: {getattr(e, 'reason', e)}") from None
        return answer_of(await future, self.name)

    def notify(self, method: str, params: dict) -> None:
        message = {"jsonrpc": "2.0", "method": method, "params": params}
        asyncio.ensure_future(asyncio.to_thread(self.send, message)).add_done_callback(
            lambda f: f.cancelled() or f.exception())

    async def close(self) -> None:
        stream, self.stream = self.stream, None
        if stream is not None:
            import socket
            try:
                stream.fp.raw._sock.shutdown(socket.SHUT_RDWR)
            except Exception:
                pass


def answer_of(reply: Any, name: str) -> Any:
    """The result of a JSON-RPC response from an HTTP transport; errors raised."""
    if not isinstance(reply, dict):
        raise McpError(f"{name} sent no answer")
    if reply.get("error") is not None:
        error = reply["error"] if isinstance(reply["error"], dict) else {}
        raise RpcError(error.get("code", INTERNAL_ERROR), str(error.get("message", "error")),
                       error.get("data"))
    return reply.get("result")


TRANSPORTS = {"stdio": StdioTransport, "http": HttpTransport, "sse": SseTransport}


class McpServer:
    """One MCP server of a session: started at most once at a time, restarted on the next
    use after a crash or a timeout; its tools listed (all pages) and kept up to date."""

    def __init__(self, name: str, spec: dict, config: Config, trusted: bool = True):
        self.name, self.spec, self.config = name, spec, config
        self.trusted = trusted       # configured by the user, not by a repository
        self.transport: Any = None
        self.tools: list = []
        self.error = ""
        self.starting: Optional[asyncio.Future] = None
        self.refreshing: Optional[asyncio.Future] = None   # tools/list after list_changed

    @property
    def ready(self) -> bool:
        return self.transport is not None and not self.error

    def start(self) -> Any:
        if self.starting is None or (self.starting.done() and not self.ready):
            self.error = ""
            self.starting = asyncio.ensure_future(self._start())
        return self.starting

    async def _start(self) -> None:
        kind = self.spec.get("type", "stdio")
        transport = TRANSPORTS[kind](self.name, self.spec, *(
            [self.config.home] if kind == "stdio" else []))
        try:
            await transport.open(self.notified)
            result = await asyncio.wait_for(transport.request("initialize", {
                "protocolVersion": MCP_VERSIONS[0], "capabilities": {},
                "clientInfo": {"name": "qcr", "version": __version__}}), MCP_HTTP_TIMEOUT)
            version = (result or {}).get("protocolVersion")
            if version not in MCP_VERSIONS:
                raise McpError(f"it speaks MCP {version!r}; qcr speaks {', '.join(MCP_VERSIONS)}")
            if isinstance(transport, HttpTransport):
                transport.version = version
            transport.notify("notifications/initialized", {})
            self.transport = transport
            await self.list_tools()
        except (McpError, RpcError, asyncio.TimeoutError, OSError) as e:
            self.error = str(e) or type(e).__name__
            self.transport = None
            await transport.close()

    async def list_tools(self) -> None:
        tools, cursor = [], None
        for _ in range(100):              # pages, to a sane limit
            result = await self.transport.request("tools/list",
                                                  {"cursor": cursor} if cursor else {})
            tools += [t for t in (result or {}).get("tools", [])
                      if isinstance(t, dict) and isinstance(t.get("name"), str)]
            cursor = (result or {}).get("nextCursor")
            if not cursor:
                break
        self.tools = tools

    def notified(self, method: str, params: dict) -> None:
        if method == "notifications/tools/list_changed" and self.ready:
            self.refreshing = asyncio.ensure_future(self.list_tools())
            self.refreshing.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def call(self, tool_name: str, arguments: dict) -> dict:
        """tools/call; a timeout, crash or cancel leaves the server to be restarted."""
        if not self.ready:
            await self.start()
            if not self.ready:
                raise McpError(f"the server {self.name} is not running: {self.error}")
        transport = self.transport
        try:
            result = await asyncio.wait_for(transport.request("tools/call", {
                "name": tool_name, "arguments": arguments}), self.config.mcp_call_timeout)
        except asyncio.TimeoutError:
            await self.stop()
            raise McpError(f"{self.name} did not answer within {self.config.mcp_call_timeout:g}"
                           " s; it will be restarted on the next call") from None
        except asyncio.CancelledError:
            transport.notify("notifications/cancelled", {
                "requestId": transport.last_id, "reason": "the user cancelled the turn"})
            raise
        except McpError:
            await self.stop()
            raise
        if self.refreshing is not None and not self.refreshing.done():
            await asyncio.wait([self.refreshing], timeout=5)   # the model's next step sees it
        return result if isinstance(result, dict) else {}

    async def stop(self) -> None:
        transport, self.transport = self.transport, None
        if transport is not None:
            await transport.close()


def mcp_specs(entries: Any) -> dict:
    """Server specs by name, from ACP's list (env and headers as name/value lists) or from
    mcp.json's object (env and headers as objects); anything malformed is dropped."""
    found = {}
    items = entries.items() if isinstance(entries, dict) else [
        (e.get("name"), e) for e in entries or [] if isinstance(e, dict)]
    for name, entry in items:
        if not isinstance(name, str) or not isinstance(entry, dict):
            continue
        kind = entry.get("type", "stdio")

        def pairs(value: Any) -> dict:
            if isinstance(value, dict):
                return {str(k): str(v) for k, v in value.items()}
            return {p["name"]: str(p.get("value", "")) for p in value or []
                    if isinstance(p, dict) and isinstance(p.get("name"), str)}
        if kind == "stdio" and isinstance(entry.get("command"), str):
            found[safe_name(name)] = {"type": "stdio", "command": entry["command"],
                                      "args": [str(a) for a in entry.get("args") or []],
                                      "env": pairs(entry.get("env"))}
        elif kind in ("http", "sse") and isinstance(entry.get("url"), str):
            found[safe_name(name)] = {"type": kind, "url": entry["url"],
                                      "headers": pairs(entry.get("headers"))}
    return found


def safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", name)[:40] or "server"


def mcp_tool(server: McpServer, spec: dict) -> Tool:
    """An MCP tool as one of qcr's. Its effects are unknown, so the policy takes it as
    execute -- unless it says it is read-only and its server is one the user configured
    (a project's server saying so is not believed)."""
    annotations = spec.get("annotations") if isinstance(spec.get("annotations"), dict) else {}
    read_only = annotations.get("readOnlyHint") is True and server.trusted
    title = annotations.get("title") or spec.get("title") or spec["name"]
    schema = spec.get("inputSchema") if isinstance(spec.get("inputSchema"), dict) else {}
    parameters = {"type": "object", "properties": schema.get("properties") or {},
                  "required": [r for r in schema.get("required") or [] if isinstance(r, str)]}

    async def run(ctx: ToolContext, **arguments) -> ToolResult:
        if not read_only:
            shown = json.dumps(arguments, indent=1)[:2000]
            await ctx.permit([text_content(f"{server.name}: {spec['name']}\n{shown}")],
                             ("execute", f"mcp:{server.name}:{spec['name']}",
                              f"`{spec['name']}` from {server.name}"))
        try:
            result = await server.call(spec["name"], arguments)
        except RpcError as e:
            raise ToolError(f"{server.name} refused the call: {e.message}") from None
        except McpError as e:
            raise ToolError(str(e)) from None
        return mcp_result(result)
    return Tool(f"mcp__{server.name}__{spec['name']}", "read" if read_only else "other", run,
                str(spec.get("description") or title), parameters,
                () if read_only else ("execute",), lambda args, ctx: f"{title} ({server.name})")


def mcp_result(result: dict) -> ToolResult:
    """MCP content as the model reads it and the user sees it; isError is a failure."""
    texts, shown = [], []
    for block in result.get("content") or []:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "image":
            texts.append(f"[an image ({block.get('mimeType')}) was returned and shown to the "
                         "user]")
            shown.append({"type": "content", "content": {
                "type": "image", "data": block.get("data", ""),
                "mimeType": block.get("mimeType", "image/png")}})
        elif kind == "resource":
            resource = block.get("resource") or {}
            texts.append(f"[resource {resource.get('uri')}]\n{resource.get('text', '')}")
        elif kind == "resource_link":
            texts.append(f"[link: {block.get('uri')}]")
    if not texts and result.get("structuredContent") is not None:
        texts.append(json.dumps(result["structuredContent"]))
    text = "\n".join(texts) or "(no output)"
    if result.get("isError"):
        raise ToolError(text)
    return ToolResult(text, [text_content(text[:4000])] + shown, {"content": result.get(
        "content"), "structuredContent": result.get("structuredContent")})


# -- Plugins -----------------------------------------------------------------------------------
#
# A plugin is a folder in ~/.qcr/plugins (for every project) or <project>/.qcr/plugins: a
# plugin.json (name, description, version, and mcpServers shaped as in mcp.json), slash
# commands in commands/*.md, and steering/*.md for the system prompt. A project's plugin is
# code that came with a repository, so its servers start only once the user has approved
# the exact command line (remembered in ~/.qcr/permissions.json).

def plugins(config: Config, cwd: str) -> list:
    """[(folder, plugin.json data, from the project?)] of every plugin that applies."""
    found = []
    for root, project in ((os.path.join(config.home, "plugins"), False),
                          (os.path.join(cwd, ".qcr", "plugins"), True)):
        try:
            names = sorted(os.listdir(root))
        except OSError:
            continue
        for name in names:
            folder = os.path.join(root, name)
            data = read_config_file(Config(), os.path.join(folder, "plugin.json"), False, cwd)
            if data or os.path.isdir(os.path.join(folder, "commands")):
                found.append((folder, data, project))
    return found


def folder_fingerprint(folder: str, most: int = 5000) -> str:
    """A digest of a plugin folder's files -- names, sizes, modification times -- so that an
    approval of its server lapses when its code changes (an edit, a git pull)."""
    seen = []
    for top, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            try:
                info = os.lstat(os.path.join(top, name))
            except OSError:
                continue
            seen.append(f"{os.path.relpath(os.path.join(top, name), folder)}"
                        f":{info.st_size}:{info.st_mtime_ns}")
            if len(seen) > most:
                return "too-many-files:" + digest(str(time.time()))   # asks every time
    return digest("\n".join(seen))


def session_mcp_specs(config: Config, cwd: str, from_client: list) -> list:
    """(name, spec, needs approval) for every server a session gets: the editor's, then
    ~/.qcr/mcp.json's, then plugins' (a project plugin's, of every transport, need the
    user's approval)."""
    user_file = read_config_file(Config(), os.path.join(config.home, "mcp.json"), False)
    found = [(n, s, False) for n, s in mcp_specs(from_client).items()]
    found += [(n, s, False) for n, s in mcp_specs(user_file.get("mcpServers")).items()]
    for folder, data, project in plugins(config, cwd):
        for name, spec in mcp_specs(data.get("mcpServers")).items():
            if spec["type"] == "stdio":
                spec["cwd"] = folder
            found.append((name, spec, project))
    seen, unique = set(), []
    for name, spec, approval in found:
        if name not in seen:
            seen.add(name)
            unique.append((name, spec, approval))
    return unique


# =============================================================================================
# 8. Config: where the model server is, and the limits
# =============================================================================================
#
# Precedence, lowest first: built-in defaults < ~/.qcr/config.json < --config FILE <
# OPENAI_* environment < QCR_* environment. An editor passes the environment through the
# agent's "env" setting, so that is the usual place for a per-editor choice.

@dataclass
class Config:
    """What the user configured (defaults < config.json < --config < environment) and the
    problems found reading it -- plus, still, what discovery and the servers' context
    windows taught qcr (`server_windows`, models found)."""
    provider: str = ""                           # "openai" (any compatible server) or "anthropic"
    base_url: str = ""
    api_key: str = ""
    anthropic_base_url: str = "https://api.anthropic.com"
    anthropic_api_key: str = ""
    model: str = ""
    models: list = field(default_factory=list)   # more models for the model selector
    temperature: Optional[float] = None
    max_tokens: Optional[int] = None
    max_turn_requests: int = 50                  # model calls in one prompt turn
    request_timeout: float = 300.0               # seconds without a byte from the server
    context_window: int = 0                      # tokens; 0 = by model name (see CONTEXT_WINDOWS)
    images: bool = True                          # send images (false: a text-only model)
    retry_budget: float = 30.0                   # seconds of retrying a busy or absent server
    send_reasoning: bool = False                 # send reasoning_content back (some want it)
    tool_protocol: str = "native"                # "text": tools described in the prompt
    web: bool = True                             # WebFetch and WebSearch offered
    search_backend: str = ""                     # searxng, brave, tavily, duckduckgo, or ""
    searxng_url: str = ""                        # a SearXNG instance
    search_url: str = ""                         # the search endpoint, overriding the backend's
    search_key: str = ""
    brave_key: str = ""
    tavily_key: str = ""
    thinking_budget: int = 0                     # Anthropic extended thinking, tokens; 0 = off
    local_servers: list = field(default_factory=lambda: list(LOCAL_SERVERS))  # probed if unset
    mcp_start_timeout: float = 15.0              # seconds a first prompt waits for MCP servers
    mcp_call_timeout: float = 120.0              # seconds one MCP tool call may take
    config_file: str = ""                        # --config FILE, to read again on sign-in
    compact_at: float = 0.8                      # share of the window that triggers compaction
    server_windows: dict = field(default_factory=dict)   # model -> window the server reported
    home: str = ""                               # ~/.qcr
    pass_env: list = field(default_factory=list)  # secret-looking variables commands may see
    max_reply_chars: int = 2_000_000             # text and thoughts in one model reply
    max_tool_calls: int = 64                     # tool calls run from one model reply
    max_argument_chars: int = 4_000_000          # one tool call's arguments, characters
    max_session_chars: int = 32_000_000          # a session file; beyond, old replay goes
    prices: dict = field(default_factory=dict)   # model pattern -> USD per million tokens
    problems: list = field(default_factory=list) # mistakes in the configuration, for the user


CONFIG_KEYS = {    # config.json key -> (Config attribute, type)
    "provider": ("provider", str), "baseUrl": ("base_url", str), "apiKey": ("api_key", str),
    "anthropicBaseUrl": ("anthropic_base_url", str),
    "anthropicApiKey": ("anthropic_api_key", str), "model": ("model", str),
    "models": ("models", list), "temperature": ("temperature", float),
    "maxTokens": ("max_tokens", int), "maxTurnRequests": ("max_turn_requests", int),
    "requestTimeout": ("request_timeout", float),
    "contextWindow": ("context_window", int), "compactAt": ("compact_at", float),
    "images": ("images", bool), "retryBudget": ("retry_budget", float),
    "sendReasoning": ("send_reasoning", bool), "thinkingBudget": ("thinking_budget", int),
    "localServers": ("local_servers", list), "toolProtocol": ("tool_protocol", str),
    "passEnv": ("pass_env", list), "maxReplyChars": ("max_reply_chars", int),
    "maxToolCalls": ("max_tool_calls", int), "maxToolArgumentChars": ("max_argument_chars", int),
    "maxSessionChars": ("max_session_chars", int), "prices": ("prices", dict),
    "mcpStartTimeout": ("mcp_start_timeout", float),
    "mcpCallTimeout": ("mcp_call_timeout", float),
    "web": ("web", bool), "searchBackend": ("search_backend", str),
    "searxngUrl": ("searxng_url", str), "searchUrl": ("search_url", str),
    "searchKey": ("search_key", str),
    "braveApiKey": ("brave_key", str), "tavilyApiKey": ("tavily_key", str),
}
ENV_KEYS = [       # environment variable -> config.json key; later ones win
    ("ANTHROPIC_BASE_URL", "anthropicBaseUrl"), ("ANTHROPIC_API_KEY", "anthropicApiKey"),
    ("OPENAI_BASE_URL", "baseUrl"), ("OPENAI_API_KEY", "apiKey"), ("OPENAI_MODEL", "model"),
    ("QCR_BASE_URL", "baseUrl"), ("QCR_API_KEY", "apiKey"), ("QCR_MODEL", "model"),
    ("QCR_MODELS", "models"), ("QCR_TEMPERATURE", "temperature"),
    ("QCR_MAX_TOKENS", "maxTokens"), ("QCR_MAX_TURN_REQUESTS", "maxTurnRequests"),
    ("QCR_REQUEST_TIMEOUT", "requestTimeout"), ("QCR_CONTEXT_WINDOW", "contextWindow"),
    ("QCR_COMPACT_AT", "compactAt"), ("QCR_IMAGES", "images"),
    ("QCR_PROVIDER", "provider"), ("QCR_RETRY_BUDGET", "retryBudget"),
    ("QCR_SEND_REASONING", "sendReasoning"), ("QCR_THINKING_BUDGET", "thinkingBudget"),
    ("QCR_LOCAL_SERVERS", "localServers"), ("QCR_TOOL_PROTOCOL", "toolProtocol"),
    ("QCR_WEB", "web"), ("SEARXNG_URL", "searxngUrl"), ("QCR_SEARCH_BACKEND", "searchBackend"),
    ("QCR_SEARCH_URL", "searchUrl"), ("QCR_SEARCH_KEY", "searchKey"),
    ("BRAVE_API_KEY", "braveApiKey"),
    ("TAVILY_API_KEY", "tavilyApiKey"), ("QCR_MCP_START_TIMEOUT", "mcpStartTimeout"),
    ("QCR_MCP_CALL_TIMEOUT", "mcpCallTimeout"), ("QCR_PASS_ENV", "passEnv"),
    ("QCR_MAX_REPLY_CHARS", "maxReplyChars"), ("QCR_MAX_TOOL_CALLS", "maxToolCalls"),
    ("QCR_MAX_TOOL_ARGUMENT_CHARS", "maxToolArgumentChars"),
    ("QCR_MAX_SESSION_CHARS", "maxSessionChars"),
]
LOCAL_SERVERS = ("http://127.0.0.1:11434/v1",   # Ollama
                 "http://127.0.0.1:8080/v1",    # llama.cpp's llama-server
                 "http://127.0.0.1:1234/v1",    # LM Studio
                 "http://127.0.0.1:8000/v1")    # vLLM
DISCOVERY_TIMEOUT = 0.8        # seconds for the whole search for a local server
DEFAULT_ANTHROPIC_MODEL = "claude-sonnet-4-5"   # when only ANTHROPIC_API_KEY is set


def load_config(path: Optional[str] = None, env: Optional[dict] = None) -> Config:
    """Build the configuration from its layers; mistakes are collected, never fatal."""
    env = os.environ if env is None else env
    config = Config(home=os.path.join(os.path.expanduser("~"), ".qcr"), config_file=path or "")
    user_file = os.path.join(config.home, "config.json")
    for source, required in ((user_file, False), (path, True)):
        if source:
            apply_config(config, read_config_file(config, source, required), source)
    for name, key in ENV_KEYS:
        if env.get(name):
            apply_config(config, {key: env[name]}, "$" + name)
    if not config.provider:     # an Anthropic key alone means Anthropic
        config.provider = "anthropic" if config.anthropic_api_key and not (
            config.base_url or config.api_key) else "openai"
    if config.provider not in PROVIDERS:
        config.problems.append(f"provider {config.provider!r} is not one of "
                               f"{', '.join(PROVIDERS)}; using openai")
        config.provider = "openai"
    if config.provider == "anthropic" and not config.model:
        config.model = env.get("ANTHROPIC_MODEL") or DEFAULT_ANTHROPIC_MODEL
    if not config.base_url and config.api_key:
        config.base_url = "https://api.openai.com/v1"
    return config


def read_config_file(config: Config, path: str, required: bool, project: str = "") -> dict:
    try:
        text = read_own_file(path, project, MAX_CONFIG_CHARS)
        if text is None:
            if required:
                config.problems.append(f"config file {path} does not exist")
            return {}
        data = loads(text)
    except (OSError, ValueError) as e:
        config.problems.append(f"config file {path} could not be read: {e}")
        return {}
    if not isinstance(data, dict):
        config.problems.append(f"config file {path} must hold a JSON object")
        return {}
    return data


MAX_CONFIG_CHARS = 1 << 20


def read_own_file(path: str, project: str = "", limit: int = -1) -> Optional[str]:
    """A file qcr reads for itself -- instructions, commands, settings: None if there is none.

    A file in the project (a repository's, so not to be trusted) is read only if it is a
    regular file, opened without blocking (a FIFO or a device planted there never hangs
    qcr), and only if its real path stays in the project: a link from AGENTS.md to
    ~/.ssh/id_rsa or /proc/self/environ is not followed. The user's own files (~/.qcr,
    --config) are read as they are. OSError says why a file was not read.
    """
    real = os.path.realpath(path)
    theirs = bool(project) and os.path.abspath(path).startswith(
        os.path.abspath(project).rstrip(os.sep) + os.sep)
    if theirs and not within(real, [project], resolved=True):
        raise OSError(f"it leads out of the project, to {real}")
    try:
        fd = os.open(real, os.O_RDONLY | (getattr(os, "O_NONBLOCK", 0) if theirs else 0))
    except FileNotFoundError:
        return None
    with open(fd, "rb") as f:
        if theirs and not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError("it is not a regular file")
        return f.read(limit).decode("utf-8", "replace")


def apply_config(config: Config, data: dict, source: str) -> None:
    for key, value in data.items():
        if key not in CONFIG_KEYS:
            config.problems.append(f"unknown setting {key!r} in {source} "
                                   f"(known: {', '.join(CONFIG_KEYS)})")
            continue
        attribute, kind = CONFIG_KEYS[key]
        try:
            if kind is list:
                value = [v.strip() for v in value.split(",") if v.strip() not in ("", "none")] \
                    if isinstance(value, str) else [str(v) for v in value]
            elif kind is str:
                if not isinstance(value, str):
                    raise TypeError("not a string")
            elif kind is dict:
                value = checked_prices(value)
            elif kind is bool:
                if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on",
                                                                "0", "false", "no", "off"):
                    value = value.lower() in ("1", "true", "yes", "on")
                if not isinstance(value, bool):
                    raise TypeError("not true or false")
            else:
                value = kind(value)
                if kind is int and value < 1 and key != "thinkingBudget":
                    raise ValueError("must be at least 1")
                if key == "compactAt" and not 0 < value <= 1:
                    raise ValueError("must be a share of the window, above 0 and at most 1")
        except (TypeError, ValueError) as e:
            config.problems.append(f"setting {key!r} in {source} is invalid ({e}); ignored")
            continue
        setattr(config, attribute, value)


def checked_prices(value: Any) -> dict:
    """`prices`: {"model pattern": {"input": 3, "output": 15, "cached": 0.3}}, in USD per
    million tokens (cached: input read from the server's cache; defaults to input)."""
    if not isinstance(value, dict):
        raise TypeError("not an object of model patterns")
    for pattern, price in value.items():
        if not isinstance(price, dict) or not all(
                isinstance(price.get(k), (int, float)) and not isinstance(price.get(k), bool)
                and 0 <= price[k] < 1e6 for k in ("input", "output")) or \
                not isinstance(price.get("cached", 0), (int, float)):
            raise ValueError(f"{pattern!r} needs input and output prices, numbers")
    return value


def server_json(url: str, api_key: str, timeout: float) -> Any:
    """GET a model server's JSON (its /models, llama.cpp's /props); None if it fails."""
    secrets = {"Authorization": "Bearer " + api_key} if api_key else {}
    try:
        with open_url(url, secrets=secrets, timeout=timeout) as response:
            return loads(response.read(1 << 20))
    except Exception:
        return None


def discover(urls: list, api_key: str = "") -> Optional[tuple]:
    """The first of these OpenAI-compatible servers that answers /models with a model:
    (base url, model ids), or None. All are asked at once, within DISCOVERY_TIMEOUT."""
    answers: dict = {}

    def ask(url: str) -> None:
        data = server_json(url.rstrip("/") + "/models", api_key, DISCOVERY_TIMEOUT)
        entries = data.get("data") if isinstance(data, dict) else None
        models = [m["id"] for m in entries or [] if isinstance(m, dict)
                  and isinstance(m.get("id"), str)]
        if models:
            answers[url] = models
    threads = [threading.Thread(target=ask, args=(url,), daemon=True) for url in urls]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + DISCOVERY_TIMEOUT + 0.2
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    found = [(url, answers[url]) for url in urls if url in answers]
    return found[0] if found else None


# =============================================================================================
# 9. The client side: headless mode, --client, and the self-test
# =============================================================================================
#
# ACP is symmetric JSON-RPC, so the editor's side reuses section 1's Connection. `Client`
# drives an agent through one prompt and prints what an editor would show. `qcr.py -p TEXT`
# wires it to qcr's own Agent in this process (two Connections joined back to back, the
# same frames as over pipes); `qcr.py --client -p TEXT -- CMD...` runs any ACP agent as a
# child and shows every frame; `qcr.py --selftest` runs `qcr.py --acp` against FakeModel, a
# scripted OpenAI-compatible model server on 127.0.0.1, and checks what comes back. The test
# suite reuses FakeModel with its own scripts.

def sse(obj: Any) -> bytes:
    """One server-sent event carrying a JSON object ("[DONE]" passes as is)."""
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


def completion_chunk(delta: Optional[dict] = None, finish: Optional[str] = None,
                     usage: Optional[dict] = None) -> dict:
    chunk: dict = {"id": "chatcmpl-qcr", "object": "chat.completion.chunk", "model": "scripted",
                   "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}]}
    if usage:
        chunk["usage"] = usage
    return chunk


SCRIPTED_USAGE = {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120}


def scripted_reply(text: str = "", calls: tuple = (), finish: Optional[str] = None,
                   usage: Optional[dict] = SCRIPTED_USAGE) -> list:
    """SSE events for one reply: text in small pieces, tool calls with split arguments."""
    events = [sse(completion_chunk({"role": "assistant", "content": ""}))]
    events += [sse(completion_chunk({"content": text[i:i + 8]})) for i in range(0, len(text), 8)]
    for index, (name, arguments) in enumerate(calls):
        encoded = json.dumps(arguments)
        half = len(encoded) // 2
        events.append(sse(completion_chunk({"tool_calls": [{
            "index": index, "id": f"call_{index}_{os.urandom(3).hex()}", "type": "function",
            "function": {"name": name, "arguments": encoded[:half]}}]})))
        events.append(sse(completion_chunk({"tool_calls": [{
            "index": index, "function": {"arguments": encoded[half:]}}]})))
    events.append(sse(completion_chunk(finish=finish or ("tool_calls" if calls else "stop"),
                                       usage=usage)))
    events.append(sse(b"[DONE]"))
    return events


class FakeModel:
    """An OpenAI-compatible chat server on 127.0.0.1 that answers from a script.

    `respond(body)` gets each request's JSON body and returns either a list of steps --
    bytes (or a function returning bytes, called as it is written) are written and flushed,
    a float pauses that many seconds, "drop" cuts the connection -- or a (status, JSON body)
    pair for an HTTP error.
    """

    def __init__(self, respond: Callable[[dict], Any]):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        fake = self
        self.respond, self.requests = respond, []
        self.disconnects = 0     # replies the client hung up on (a cancelled turn)
        self.routes: dict = {}   # GET path -> JSON, or (status, headers, bytes); else 404
        self.seen: list = []     # (path, headers) of each request

        class Handler(BaseHTTPRequestHandler):
            """The scripted model's HTTP side: each POST answered from the script."""

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                fake.seen.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
                fake.requests.append(body)
                fake.serve(self, body)

            def do_GET(self) -> None:
                fake.seen.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
                answer = fake.routes.get(self.path.split("?")[0], (404, {}, b"not found"))
                status, headers, data = answer if isinstance(answer, tuple) else (
                    200, {"Content-Type": "application/json"}, json.dumps(answer).encode())
                self.send_response(status)
                for name, value in dict(headers, **{"Content-Length": str(len(data))}).items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def serve(self, handler: Any, body: dict) -> None:
        steps = self.respond(body)
        try:
            if isinstance(steps, tuple):
                status, payload = steps
                data = json.dumps(payload).encode()
                handler.send_response(status)
                handler.send_header("Content-Type", "application/json")
                handler.send_header("Content-Length", str(len(data)))
                handler.end_headers()
                handler.wfile.write(data)
                return
            handler.send_response(200)
            handler.send_header("Content-Type", "text/event-stream")
            handler.end_headers()
            for step in steps:
                if step == "drop":
                    return
                if isinstance(step, float):
                    time.sleep(step)
                else:
                    handler.wfile.write(step() if callable(step) else step)
                    handler.wfile.flush()
        except OSError:      # the client went away (a cancelled turn)
            self.disconnects += 1

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def selftest_script(body: dict) -> Any:
    """The scripted model of --selftest: read, edit, plan, answer -- or talk slowly."""
    messages = body.get("messages", [])
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    if "slowly" in messages[last_user]["content"]:
        return [sse(completion_chunk({"content": "Thinking about it"}))] + \
               [0.05, sse(completion_chunk({"content": "."}))] * 200 + scripted_reply("Done.")
    step = sum(m["role"] == "assistant" for m in messages[last_user:])
    script = [
        ("Let me look at the file first.", (("ReadFile", {"path": "hello.py"}),)),
        ("", (("EditFile", {"path": "hello.py", "old_string": "world",
                            "new_string": "qcr"}),)),
        ("", (("TodoWrite", {"todos": [
            {"content": "Read hello.py", "status": "completed", "priority": "medium"},
            {"content": "Greet qcr instead of the world", "status": "completed",
             "priority": "high"}]}),)),
        ("Done: hello.py now greets qcr.", ()),
    ]
    text, calls = script[min(step, len(script) - 1)]
    return scripted_reply(text, calls)


class Client:
    """The editor's side of ACP, for a terminal or a test: one session, one prompt at a time.

    Updates are kept in `updates` and, with `out`, rendered as an editor would show them:
    streamed text, thoughts, tool calls with their status, the plan. Permission requests are
    answered by `permission(params)` -> optionId, else by `yes` (allow once), else by asking
    on the terminal, else rejected. The client offers no fs or terminal methods.
    """

    def __init__(self, out: Any = None, yes: bool = False, trace: Any = None,
                 permission: Optional[Callable] = None):
        self.out, self.yes, self.trace, self.permission = out, yes, trace, permission
        self.updates: list = []
        self.permissions: list = []
        self.on_update: Optional[Callable] = None
        self.conn: Optional[Connection] = None
        self.error_seen = False
        self._line_open = False

    def connect(self, reader: asyncio.StreamReader, write: Callable[[bytes], None]) -> Any:
        self.conn = Connection(write, self.on_request, self.on_notification, self.trace)
        return asyncio.ensure_future(self.conn.serve(reader))

    async def call(self, method: str, params: dict) -> Any:
        return await self.conn.request(method, params)

    async def on_request(self, method: str, params: dict) -> Any:
        if method != "session/request_permission":
            raise RpcError.method_not_found(method)
        self.permissions.append(params)
        options = [o for o in params.get("options", []) if isinstance(o, dict)]
        choice = self.permission(params) if self.permission else await self.ask(params, options)
        if choice is None:
            return {"outcome": {"outcome": "cancelled"}}
        return {"outcome": {"outcome": "selected", "optionId": choice}}

    async def ask(self, params: dict, options: list) -> Optional[str]:
        allow = [o["optionId"] for o in options if o.get("kind") == "allow_once"]
        reject = [o["optionId"] for o in options if o.get("kind") == "reject_once"]
        title = printable(str((params.get("toolCall") or {}).get("title", "a tool call")))
        if self.yes and allow:
            return allow[0]
        if not sys.stdin.isatty():
            self.say(f"\n[rejected {title}: not a terminal, and no --yes]\n")
            return reject[0] if reject else None
        names = "  ".join(f"[{i}] {o.get('name')}" for i, o in enumerate(options, 1))
        self.say(f"\n? {title}\n  {names}\n")
        answer = await asyncio.to_thread(input, "  choose: ")
        return options[int(answer) - 1]["optionId"] if answer.strip().isdigit() and \
            1 <= int(answer) <= len(options) else (reject[0] if reject else None)

    def on_notification(self, method: str, params: dict) -> None:
        if method != "session/update" or not isinstance(params.get("update"), dict):
            return
        update = params["update"]
        self.updates.append(update)
        if self.on_update:
            self.on_update(update)
        self.render(update)

    def say(self, text: str) -> None:
        if self.out is not None:
            self.out.write(text)
            self.out.flush()

    def render(self, update: dict) -> None:
        kind = update.get("sessionUpdate")
        content = update.get("content") if isinstance(update.get("content"), dict) else {}
        if kind == "agent_message_chunk" and content.get("type") == "text":
            text = content.get("text", "")
            self.error_seen |= text.lstrip().startswith("[error]") or "\n[error]" in text
            self.say(text)
            self._line_open = not text.endswith("\n")
        elif kind == "agent_thought_chunk" and content.get("type") == "text":
            self.say(content.get("text", ""))
        elif kind == "tool_call":
            self.say(("\n" if self._line_open else "") +
                     f"-> {update.get('title')}  [{update.get('kind', 'other')}]\n")
            self._line_open = False
        elif kind == "tool_call_update" and update.get("status") in ("completed", "failed"):
            mark = "ok" if update["status"] == "completed" else "failed"
            texts = [c["content"].get("text", "") for c in update.get("content") or []
                     if isinstance(c, dict) and c.get("type") == "content"]
            detail = f": {texts[0].splitlines()[0][:200]}" if texts and texts[0] and \
                mark == "failed" else ""
            self.say(f"   {mark}{detail}\n")
        elif kind == "plan":
            marks = {"completed": "[x]", "in_progress": "[>]", "pending": "[ ]"}
            self.say("".join(f"   {marks.get(e.get('status'), '[ ]')} {e.get('content')}\n"
                             for e in update.get("entries", [])))

    async def run(self, cwd: str, prompt: str, mode: Optional[str] = None,
                  model: Optional[str] = None) -> int:
        """initialize, session/new, the mode and model, one prompt: the exit status."""
        await self.call("initialize", {"protocolVersion": PROTOCOL_VERSION,
                                       "clientCapabilities": {},
                                       "clientInfo": {"name": "qcr-client",
                                                      "version": __version__}})
        session = await self.call("session/new", {"cwd": cwd, "mcpServers": []})
        session_id = session["sessionId"]
        if mode:
            await self.call("session/set_mode", {"sessionId": session_id, "modeId": mode})
        if model:
            await self.call("session/set_config_option", {"sessionId": session_id,
                                                          "configId": "model", "value": model})
        loop = asyncio.get_running_loop()
        cancel = lambda: self.conn.notify("session/cancel", {"sessionId": session_id})
        try:
            loop.add_signal_handler(signal_number("SIGINT"), cancel)   # Ctrl-C cancels
        except (NotImplementedError, RuntimeError, ValueError):
            pass
        result = await self.call("session/prompt", {"sessionId": session_id, "prompt": [
            {"type": "text", "text": prompt}]})
        stop = result.get("stopReason") if isinstance(result, dict) else None
        self.say(("\n" if self._line_open else "") + f"[{stop}]\n")
        return 0 if stop == "end_turn" and not self.error_seen else 1


def signal_number(name: str) -> int:
    import signal
    return getattr(signal, name)


async def headless(config: Config, prompt: str, mode: Optional[str], model: Optional[str],
                   yes: bool) -> int:
    """-p: one prompt, qcr's own Agent in this process, spoken to over ACP frames."""
    agent = Agent(config)
    to_agent = asyncio.StreamReader(limit=MAX_FRAME_BYTES)
    to_client = asyncio.StreamReader(limit=MAX_FRAME_BYTES)
    agent.conn = Connection(to_client.feed_data, agent.on_request, agent.on_notification)
    agent.conn.on_cancel = agent.cancel_request
    client = Client(out=sys.stdout, yes=yes)
    serving = asyncio.ensure_future(agent.conn.serve(to_agent))
    client.connect(to_client, to_agent.feed_data)
    try:
        return await client.run(os.getcwd(), prompt, mode, model)
    except RpcError as e:
        sys.stderr.write(f"qcr: {e.message}\n")
        return 2
    finally:
        to_agent.feed_eof()
        await serving
        await agent.shutdown()


async def drive(argv: list, prompt: str, mode: Optional[str], model: Optional[str],
                yes: bool) -> int:
    """--client: any ACP agent as a child process, every frame shown on stderr."""
    import subprocess
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, limit=MAX_FRAME_BYTES)
    except OSError as e:
        sys.stderr.write(f"qcr: cannot start {argv[0]}: {e}\n")
        return 2
    client = Client(out=sys.stdout, yes=yes, trace=make_trace("-", client=True))
    client.connect(proc.stdout, proc.stdin.write)
    try:
        return await client.run(os.getcwd(), prompt, mode, model)
    except (RpcError, EOFError, ConnectionError) as e:
        sys.stderr.write(f"qcr: the agent failed: {getattr(e, 'message', e)}\n")
        return 2
    finally:
        proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), 3)
        except asyncio.TimeoutError:
            proc.kill()


def selftest() -> int:
    """Drive `qcr.py --acp` through a real session and print what passed."""
    import tempfile
    results: list = []

    def check(name: str, ok: Any, detail: Any = "") -> None:
        results.append(bool(ok))
        sys.stdout.write(f"{'ok  ' if ok else 'FAIL'}  {name}"
                         f"{'' if ok or detail == '' else f'  ({detail})'}\n")
        sys.stdout.flush()

    model = FakeModel(selftest_script)
    with tempfile.TemporaryDirectory(prefix="qcr-selftest-") as home:
        project = os.path.join(home, "project")
        os.makedirs(project)
        write_text(os.path.join(project, "hello.py"), 'print("hello, world")\n')
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("OPENAI_", "QCR_", "ANTHROPIC_"))}
        env.update(HOME=home, QCR_BASE_URL=model.url, QCR_MODEL="scripted")
        asyncio.run(selftest_session(env, project, check))
        sessions = os.path.join(home, ".qcr", "sessions")
        saved = os.listdir(sessions) if os.path.isdir(sessions) else []
        check("the session was saved to ~/.qcr/sessions", len(saved) == 1, saved)
    model.close()
    passed = sum(results)
    sys.stdout.write(f"selftest: {passed} passed, {len(results) - passed} failed\n")
    return 0 if passed == len(results) else 1


async def selftest_session(env: dict, project: str, check: Callable) -> None:
    import subprocess
    proc = await asyncio.create_subprocess_exec(
        sys.executable, os.path.abspath(__file__), "--acp", cwd=project, env=env,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        limit=MAX_FRAME_BYTES)
    client = Client(permission=lambda params: "allow_once")
    serving = client.connect(proc.stdout, proc.stdin.write)
    try:
        await asyncio.wait_for(selftest_steps(client, project, check), 30)
    except Exception as e:      # a hang or a crash is one more failure, reported
        check("the session ran to its end", False, f"{type(e).__name__}: {e}")
    proc.stdin.close()
    try:
        code = await asyncio.wait_for(proc.wait(), 5)
    except asyncio.TimeoutError:
        proc.kill()
        code = None
    await asyncio.wait([serving], timeout=2)
    check("stdin EOF: qcr exits with status 0", code == 0, code)
    check("stdout carried protocol frames only", client.conn.bad_frames == 0,
          f"{client.conn.bad_frames} bad lines")
    stderr = (await proc.stderr.read()).decode("utf-8", "replace")
    check("stderr stayed quiet", not stderr.strip(), stderr[:300])


async def selftest_steps(client: Client, project: str, check: Callable) -> None:
    result = await client.call("initialize", {
        "protocolVersion": 1, "clientCapabilities": {},
        "clientInfo": {"name": "qcr-selftest", "version": __version__}})
    check("initialize answers protocolVersion 1", result.get("protocolVersion") == 1, result)
    result = await client.call("session/new", {"cwd": project, "mcpServers": []})
    session_id = result.get("sessionId", "")
    check("session/new gives a session with modes and config options",
          SESSION_ID_RE.fullmatch(session_id) and "configOptions" in result and
          result.get("modes", {}).get("currentModeId") == "default", result)

    result = await client.call("session/prompt", {
        "sessionId": session_id, "prompt": [{"type": "text", "text": "Greet qcr in hello.py"}]})
    check("the prompt ends with end_turn", result == {"stopReason": "end_turn"}, result)
    updates = client.updates
    kinds = [u["sessionUpdate"] for u in updates]
    calls = {u["toolCallId"]: u for u in updates if u["sessionUpdate"] == "tool_call"}
    final = {u["toolCallId"]: u.get("status") for u in updates
             if u["sessionUpdate"] == "tool_call_update" and "status" in u}
    check("answer text streams as agent_message_chunk", "agent_message_chunk" in kinds, kinds)
    check("ReadFile and EditFile are shown as read and edit tool calls",
          [c["kind"] for c in calls.values()][:2] == ["read", "edit"], list(calls.values()))
    check("every tool call completes", calls and all(final.get(c) == "completed"
                                                     for c in calls), final)
    check("the edit asked for permission, showing the diff", len(client.permissions) == 1 and
          client.permissions[0]["toolCall"]["content"][0]["type"] == "diff", client.permissions)
    with open(os.path.join(project, "hello.py"), encoding="utf-8") as f:
        check("hello.py was edited on disk", f.read() == 'print("hello, qcr")\n')
    plans = [u for u in updates if u["sessionUpdate"] == "plan"]
    check("the to-do list arrives as a plan", plans and len(plans[-1]["entries"]) == 2, plans)

    started: list = []

    def cancel_on_first_chunk(update: dict) -> None:
        if update["sessionUpdate"] == "agent_message_chunk" and not started:
            started.append(time.monotonic())
            client.conn.notify("session/cancel", {"sessionId": session_id})
    client.on_update = cancel_on_first_chunk
    result = await client.call("session/prompt", {
        "sessionId": session_id, "prompt": [{"type": "text", "text": "Talk slowly"}]})
    elapsed = f" (answered in {(time.monotonic() - started[0]) * 1000:.0f} ms)" if started else ""
    check("session/cancel ends a streaming turn with cancelled" + elapsed,
          result == {"stopReason": "cancelled"}, result)


# =============================================================================================
# 10. CLI
# =============================================================================================

def make_trace(target: Optional[str], client: bool = False) -> Optional[Callable]:
    """--trace: every frame, both ways, with a timestamp. "->" is editor to agent, "<-" agent
    to editor, on either side of the connection."""
    if target is None:
        return None
    stream = sys.stderr if target == "-" else open(target, "a", encoding="utf-8")

    def trace(direction: str, frame: bytes) -> None:
        if client:
            direction = "->" if direction == "<-" else "<-"
        now = time.time()
        stamp = time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now * 1000) % 1000:03d}"
        stream.write(f"{stamp} {direction} {frame.decode('utf-8', 'replace').rstrip()}\n")
        stream.flush()
    return trace


async def stdin_reader() -> asyncio.StreamReader:
    """stdin as an asyncio stream: a pipe directly, a terminal or file through a thread."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=MAX_FRAME_BYTES)
    mode = os.fstat(0).st_mode
    if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                     os.fdopen(0, "rb", buffering=0, closefd=False))
        return reader

    def pump() -> None:
        while True:
            data = os.read(0, 1 << 16)
            if not data:
                break
            loop.call_soon_threadsafe(reader.feed_data, data)
        loop.call_soon_threadsafe(reader.feed_eof)
    threading.Thread(target=pump, daemon=True, name="qcr-stdin").start()
    return reader


async def serve(config: Config, write: Callable[[bytes], None], trace: Any) -> None:
    """The agent on stdin/stdout until EOF -- or SIGTERM or SIGHUP, which end it the same
    way: running turns cancelled and answered, children stopped, sessions saved, exit 0."""
    import signal
    sys.setswitchinterval(0.001)   # a thread's work holds the loop up ~1 ms at a time, not 5
    agent = Agent(config)
    agent.conn = Connection(write, agent.on_request, agent.on_notification, trace)
    agent.conn.on_cancel = agent.cancel_request
    reader = await stdin_reader()
    for name in ("SIGTERM", "SIGHUP"):
        try:
            asyncio.get_running_loop().add_signal_handler(getattr(signal, name),
                                                          reader.feed_eof)
        except (AttributeError, NotImplementedError, RuntimeError):
            pass        # no such signal here (Windows)
    try:
        await agent.conn.serve(reader)
    finally:                  # (a crash of the loop itself included)
        try:
            await agent.shutdown()
        finally:
            stop_children()


def serve_acp(config: Config, trace: Optional[str]) -> int:
    """--acp: protocol frames on the real stdout; everything else is kept off it."""
    frames = os.fdopen(os.dup(1), "wb", buffering=1 << 18)
    os.dup2(2, 1)                # a stray print, or a child's output, lands on stderr
    sys.stdout = sys.stderr
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    state = {"broken": False, "flush_due": False}

    def flush() -> None:
        state["flush_due"] = False
        if not state["broken"]:
            try:
                frames.flush()
            except OSError:      # the client closed our stdout; keep going quietly
                state["broken"] = True

    def write(data: bytes) -> None:
        """Frames are buffered and flushed once the loop has run what is ready: a burst of
        chunks costs one write(2), and no frame waits longer than one loop iteration."""
        if state["broken"]:
            return
        try:
            frames.write(data)
        except OSError:
            state["broken"] = True
            return
        if not state["flush_due"]:
            state["flush_due"] = True
            loop.call_soon(flush)

    loop.run_until_complete(serve(config, write, make_trace(trace)))
    flush()
    sys.stderr.flush()
    os._exit(0)     # threads blocked in reads must not hold the exit up


def login(config: Config) -> int:
    """--login: choose a model server, key and model in a terminal, test the connection, and
    save ~/.qcr/config.json (readable by you alone). The editor's "Set up a model" runs this."""
    import getpass
    say = sys.stdout.write
    say("qcr setup: pick the model qcr talks to. Saved to ~/.qcr/config.json.\n\n")

    def ask(question: str, default: str = "") -> str:
        answer = input(f"{question}{f' [{default}]' if default else ''}: ").strip()
        return answer or default
    found = discover(config.local_servers)
    if found:
        say(f"Found a model server on this machine: {found[0]} ({len(found[1])} models).\n")
    choice = ask("Provider: 1) an OpenAI-compatible server (Ollama, llama.cpp, vLLM, LM Studio, "
                 "OpenAI, OpenRouter, ...)  2) Anthropic", "1")
    settings: dict = {}
    if choice == "2":
        settings["provider"] = "anthropic"
        settings["anthropicApiKey"] = getpass.getpass("Anthropic API key: ").strip()
        settings["model"] = ask("Model", DEFAULT_ANTHROPIC_MODEL)
    else:
        settings["provider"] = "openai"
        settings["baseUrl"] = ask("Base URL", found[0] if found else "https://api.openai.com/v1")
        key = getpass.getpass("API key (empty for none): ").strip()
        if key:
            settings["apiKey"] = key
        models = (discover([settings["baseUrl"]], key) or (None, []))[1]
        for i, model in enumerate(models[:30], 1):
            say(f"  {i}) {model}\n")
        model = ask("Model (a number above, or a model id)", "1" if models else "")
        settings["model"] = models[int(model) - 1] if model.isdigit() and \
            1 <= int(model) <= len(models) else model
    test = Config(**{**config.__dict__, "problems": [], "models": []})
    apply_config(test, settings, "the setup")
    say("Testing the connection ... ")
    sys.stdout.flush()
    try:
        reply = asyncio.run(make_provider(test, test.model).stream(
            [{"role": "user", "content": "Answer with the word OK."}], [], Reply(),
            lambda kind, text: None))
        say(f"ok (the model said: {reply.text.strip()[:60]!r})\n")
    except ProviderError as e:
        say(f"failed: {e}\n")
        if ask("Save anyway? (y/n)", "n").lower() != "y":
            return 1
    path = os.path.join(config.home, "config.json")
    saved = read_config_file(Config(), path, False)
    saved.update(settings)
    os.makedirs(config.home, exist_ok=True)
    temporary = path + ".tmp"
    with open(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        json.dump(saved, f, indent=2)
    os.chmod(temporary, 0o600)
    os.replace(temporary, path)
    say(f"Saved {path}. In your editor, choose \"Use my configuration\" or start a new "
        "thread.\n")
    return 0


def main(argv: Optional[list] = None) -> int:
    import argparse
    argv = sys.argv[1:] if argv is None else list(argv)
    agent_argv = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(
        prog="qcr.py", description="A coding agent for editors that speak the Agent Client "
        "Protocol (Zed, JetBrains, Neovim, Emacs).",
        epilog="Configuration: ~/.qcr/config.json, or OPENAI_BASE_URL, OPENAI_MODEL and "
        "OPENAI_API_KEY in the environment (QCR_* variables override them). See the README.")
    parser.add_argument("--acp", action="store_true",
                        help="serve ACP on stdin/stdout (what an editor runs)")
    parser.add_argument("--selftest", action="store_true",
                        help="run a scripted session against qcr itself; no model needed")
    parser.add_argument("--config", metavar="FILE", help="read settings from this JSON file")
    parser.add_argument("--trace", nargs="?", const="-", metavar="FILE",
                        help="log every frame in both directions to FILE (default: stderr)")
    parser.add_argument("-p", "--prompt", metavar="TEXT",
                        help="run one prompt here, without an editor, and print the result")
    parser.add_argument("--mode", choices=MODE_IDS, help="with -p: the session's mode")
    parser.add_argument("--model", help="with -p: the model")
    parser.add_argument("--yes", action="store_true",
                        help="with -p: allow every permission request once, without asking")
    parser.add_argument("--client", action="store_true",
                        help="with -p: drive the ACP agent given after -- (e.g. -- python3 "
                             "qcr.py --acp) and show every frame on stderr")
    parser.add_argument("--login", action="store_true",
                        help="set up the model server, key and model in this terminal")
    parser.add_argument("--version", action="version", version=f"qcr {__version__}")
    parser.add_argument("--search-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.search_worker:
        return search_worker()
    if args.selftest:
        return selftest()
    if args.login:
        try:
            return login(load_config(args.config))
        except (EOFError, KeyboardInterrupt):
            sys.stdout.write("\nqcr setup: nothing was saved.\n")
            return 1
    if args.acp:
        return serve_acp(load_config(args.config), args.trace)
    if args.client:
        if not agent_argv or not args.prompt:
            parser.error("--client needs -p TEXT and the agent's command after --")
        return asyncio.run(drive(agent_argv, args.prompt, args.mode, args.model, args.yes))
    if args.prompt:
        config = load_config(args.config)
        return asyncio.run(headless(config, args.prompt, args.mode, args.model, args.yes))
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
