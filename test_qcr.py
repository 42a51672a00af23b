#!/usr/bin/env python3
"""Tests for qcr.py: the real `qcr.py --acp` process, driven over pipes.

Run:  python3 test_qcr.py          (or: python3 -m unittest -v test_qcr)

Each test starts qcr with a temporary HOME and a fake OpenAI-compatible model server on
127.0.0.1 (qcr.FakeModel, port 0) that replays a script, then plays the editor: it sends
real frames, answers qcr's permission requests, and reads real files.
Sections follow qcr.py's numbering.
"""
from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
QCR = os.path.join(HERE, "qcr.py")
sys.path.insert(0, HERE)
import qcr  # noqa: E402  (importing runs nothing)

from qcr import completion_chunk, scripted_reply, sse  # noqa: E402

ALLOW = {"outcome": {"outcome": "selected", "optionId": "allow_once"}}
ALLOW_ALWAYS = {"outcome": {"outcome": "selected", "optionId": "allow_session"}}
REJECT = {"outcome": {"outcome": "selected", "optionId": "reject_once"}}


# =============================================================================================
# 0. Harness
# =============================================================================================

class Script:
    """A fake model's replies, one per request, in order; the last one repeats."""

    def __init__(self, *replies):
        self.replies = list(replies)
        self.count = 0

    def __call__(self, body):
        reply = self.replies[min(self.count, len(self.replies) - 1)]
        self.count += 1
        return reply(body) if callable(reply) else reply


def slow_reply(chunks=400, pause=0.05):
    """A reply that streams for a long time: the thing to cancel."""
    return [sse(completion_chunk({"content": "Working"}))] + \
        [pause, sse(completion_chunk({"content": "."}))] * chunks + scripted_reply("late")


class Schema:
    """The official ACP v1 JSON schema, to check every frame qcr writes in these tests.

    Active when QCR_ACP_SCHEMA names the schema.json shipped in the official SDK packages
    (.ci/run fetches it) and the jsonschema package is importable; otherwise None.
    """

    def __init__(self, path):
        from jsonschema import Draft202012Validator, FormatChecker
        with open(path, encoding="utf-8") as f:
            self.root = json.load(f)
        self.defs = self.root["$defs"]
        self.request, self.response, self.notification = {}, {}, {}
        for name, definition in self.defs.items():     # the schema names its methods
            method = definition.get("x-method")
            if method:
                table = self.response if name.endswith("Response") else \
                    self.notification if name.endswith("Notification") else self.request
                table[method] = name
        self.formats = FormatChecker()
        for fmt, low, high in (("int32", -2 ** 31, 2 ** 31 - 1), ("int64", -2 ** 63, 2 ** 63 - 1),
                               ("uint16", 0, 2 ** 16 - 1), ("uint32", 0, 2 ** 32 - 1),
                               ("uint64", 0, 2 ** 64 - 1)):
            self.formats.checks(fmt)(lambda v, lo=low, hi=high: not isinstance(v, int) or
                                     isinstance(v, bool) or lo <= v <= hi)
        self.validator, self.cache = Draft202012Validator, {}

    def check(self, type_name, value, where):
        if type_name not in self.cache:
            self.cache[type_name] = self.validator(
                {"$defs": self.defs, "$ref": f"#/$defs/{type_name}"}, format_checker=self.formats)
        return [f"{where} ({type_name}): {e.message[:200]} at {list(e.absolute_path)}"
                for e in self.cache[type_name].iter_errors(value)]

    def problems(self, frame, answered=None, side="agent"):
        """What is wrong with one frame sent by `side`; `answered` is the method it answers."""
        if frame.get("jsonrpc") != "2.0":
            return ["jsonrpc is not 2.0"]
        method = frame.get("method")
        if method is not None and "id" not in frame:
            name = self.notification.get(method) or ("SessionNotification"
                                                     if method == "session/update" else None)
            return self.check(name, frame.get("params"), method) if name else \
                [f"no such notification {method}"]
        if method is not None:
            name = self.request.get(method)
            if not name or self.defs[name].get("x-side") == side:
                return [f"{side} sent a request the other side does not have: {method}"]
            return self.check(name, frame.get("params"), method)
        if "error" in frame:
            error = frame["error"]
            ok = isinstance(error, dict) and isinstance(error.get("code"), int) and \
                isinstance(error.get("message"), str) and "result" not in frame
            return [] if ok else [f"malformed error response: {frame}"]
        name = self.response.get(answered)
        return self.check(name, frame.get("result"), f"result of {answered}") if name else []


def load_schema():
    path = os.environ.get("QCR_ACP_SCHEMA")
    if not path:
        return None
    try:
        return Schema(path)
    except ImportError:
        return None


SCHEMA = load_schema()


def strict_json(text):
    """json.loads, minus NaN and Infinity, which strict clients (Zed's serde) reject."""
    def reject(constant):
        raise ValueError(constant)
    return json.loads(text, parse_constant=reject)


def agent_children(pid, marker):
    """Live child processes of pid whose command line contains marker."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().split(")")[-1].split()
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            if fields[1] == str(pid) and fields[0] != "Z" and marker.encode() in cmdline:
                found.append(int(entry))
    return found


class AcpProcess:
    """`qcr.py --acp` as a child process, spoken to the way an editor does."""

    def __init__(self, home, cwd, env=None, args=()):
        environ = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "QCR_", "ANTHROPIC_"))}
        environ["HOME"] = home
        environ.update(env or {})
        self.proc = subprocess.Popen([sys.executable, QCR, "--acp", *args], cwd=cwd,
                                     env=environ, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.frames = queue.Queue()
        self.bad_lines, self.stderr = [], bytearray()
        self.next_id = 1
        self.lock = threading.Lock()        # the editor's threads answer too
        self.received = []                  # every frame qcr wrote, for the schema check
        self.sent_methods = {}              # id of each request we sent -> its method
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()

    def _read_stdout(self):
        for line in self.proc.stdout:
            try:
                frame = strict_json(line.decode("utf-8"))
                assert isinstance(frame, dict) and frame.get("jsonrpc") == "2.0"
                self.received.append(frame)
                self.frames.put(frame)
            except (ValueError, AssertionError):
                self.bad_lines.append(line)
        self.frames.put(None)

    def _read_stderr(self):
        for line in self.proc.stderr:
            self.stderr.extend(line)

    def send_raw(self, data: bytes):
        with self.lock:
            self.proc.stdin.write(data)
            self.proc.stdin.flush()

    def send(self, message):
        if "method" in message and "id" in message:
            self.sent_methods[json.dumps(message["id"])] = message["method"]
        self.send_raw(json.dumps(message).encode() + b"\n")

    def request(self, method, params=None, request_id=None):
        if request_id is None:
            request_id, self.next_id = self.next_id, self.next_id + 1
        self.send({"jsonrpc": "2.0", "id": request_id, "method": method,
                   "params": {} if params is None else params})
        return request_id

    def notify(self, method, params):
        self.send({"jsonrpc": "2.0", "method": method, "params": params})

    def recv(self, timeout=10):
        try:
            frame = self.frames.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no frame from qcr within {timeout}s; stderr: "
                                 f"{self.stderr.decode(errors='replace')[-2000:]}") from None
        if frame is None:
            raise AssertionError("qcr closed stdout; stderr: "
                                 + self.stderr.decode(errors="replace")[-2000:])
        return frame

    def wait(self, request_id, answer=ALLOW, on_update=None, timeout=15):
        """Read until the response to request_id: (response, updates, qcr's requests).

        qcr's own requests are answered with `answer(frame)` (or the dict itself); None
        leaves them unanswered.
        """
        updates, requests = [], []
        deadline = time.monotonic() + timeout
        while True:
            frame = self.recv(max(0.05, deadline - time.monotonic()))
            if frame.get("method") == "session/update":
                updates.append(frame["params"]["update"])
                if on_update:
                    on_update(frame["params"]["update"])
            elif "method" in frame and "id" in frame:
                requests.append(frame)
                result = answer(frame) if callable(answer) else answer
                if result is not None:
                    self.send({"jsonrpc": "2.0", "id": frame["id"], "result": result})
            elif "method" not in frame and frame.get("id") == request_id:
                return frame, updates, requests

    def call(self, method, params=None, **kw):
        return self.wait(self.request(method, params), **kw)

    def close(self, timeout=5):
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None


class AcpTestCase(unittest.TestCase):
    """A temporary HOME and project, a fake model, and qcr processes that are cleaned up."""

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="qcr-test-")
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.home = os.path.join(self.tmp, "home")
        self.project = os.path.join(self.tmp, "project")
        os.makedirs(self.home)
        os.makedirs(self.project)
        self.model = None
        self.agents = []

    def tearDown(self):
        if SCHEMA is not None:       # every frame qcr wrote in this test, against the schema
            problems = []
            for agent in self.agents:
                for frame in agent.received:
                    answered = agent.sent_methods.get(json.dumps(frame.get("id")))
                    problems += SCHEMA.problems(frame, answered)
            self.assertEqual(problems, [], "frames that break the ACP schema")
        for agent in self.agents:
            if agent.proc.poll() is None:
                agent.proc.kill()
                agent.proc.wait()
            for stream in (agent.proc.stdin, agent.proc.stdout, agent.proc.stderr):
                try:
                    stream.close()
                except OSError:
                    pass
        if self.model:
            self.model.close()

    def fake_model(self, *replies):
        self.model = qcr.FakeModel(Script(*replies))
        return self.model

    def start(self, env=None, args=(), model="test-model"):
        environ = {"QCR_RETRY_BUDGET": "0",       # errors at once, unless a test wants retries
                   "QCR_LOCAL_SERVERS": "none"}   # never the developer's own model servers
        if self.model and model:
            environ.update(QCR_BASE_URL=self.model.url, QCR_MODEL=model)
        elif model:        # configured, but nothing listens there
            environ.update(QCR_BASE_URL="http://127.0.0.1:9/v1", QCR_MODEL=model)
        environ.update(env or {})
        agent = AcpProcess(self.home, self.project, environ, args)
        self.agents.append(agent)
        return agent

    def new_session(self, agent, cwd=None, capabilities=None):
        response, _, _ = agent.call("initialize", {"protocolVersion": 1,
                                                   "clientCapabilities": capabilities or {}})
        self.assertEqual(response["result"]["protocolVersion"], 1)
        response, _, _ = agent.call("session/new", {"cwd": cwd or self.project,
                                                    "mcpServers": []})
        self.commands = agent.recv()["params"]["update"]     # announced right after
        self.assertEqual(self.commands["sessionUpdate"], "available_commands_update")
        return response["result"]["sessionId"]

    def prompt(self, agent, session_id, text, **kw):
        return agent.call("session/prompt", {"sessionId": session_id,
                                             "prompt": [{"type": "text", "text": text}]}, **kw)

    def write(self, name, text):
        path = os.path.join(self.project, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        return path

    def read(self, name):
        with open(os.path.join(self.project, name), encoding="utf-8", newline="") as f:
            return f.read()

    # -- domain assertions ------------------------------------------------------------------
    def assertResult(self, response, result=None):
        self.assertNotIn("error", response, response)
        if result is not None:
            self.assertEqual(response["result"], result)

    def assertRpcError(self, response, code, mentions=None):
        self.assertIn("error", response, response)
        self.assertEqual(response["error"]["code"], code, response)
        self.assertNotIn("result", response)
        if mentions:
            self.assertIn(mentions, json.dumps(response["error"]))

    def assertClean(self, agent):
        """Nothing but frames on stdout, and nothing on stderr."""
        self.assertEqual(agent.bad_lines, [])
        self.assertEqual(agent.stderr.decode(errors="replace"), "")

    def tool_messages(self, request_index=-1):
        """The tool results the model got in one request."""
        return [m["content"] for m in self.model.requests[request_index]["messages"]
                if m["role"] == "tool"]


def without_ids(updates):
    """Updates without their messageIds (random), to compare with what is expected."""
    return [{k: v for k, v in u.items() if k != "messageId"} for u in updates]


def kill_loop(start, new_session, cwd, home, kills, pause):
    """Start qcr, open one session (reloaded after the first time), prompt, SIGKILL it
    after pause() seconds; `kills` times. (tool calls the client saw completed, those the
    file holds completed, reloads answered)."""
    session_id, seen, loaded = None, set(), 0
    for _ in range(kills):
        agent = start()
        if session_id is None:
            session_id = new_session(agent)
        else:
            agent.call("initialize", {"protocolVersion": 1})
            response, _, _ = agent.call("session/load", {"sessionId": session_id, "cwd": cwd,
                                                         "mcpServers": []})
            loaded += "result" in response
        agent.request("session/prompt", {"sessionId": session_id, "prompt": [
            {"type": "text", "text": "read on"}]})
        time.sleep(pause())
        agent.proc.kill()
        agent.proc.wait()
        while True:
            frame = agent.frames.get(timeout=5)
            if frame is None:
                break
            update = frame.get("params", {}).get("update", {})
            if update.get("sessionUpdate") == "tool_call_update" and \
                    update.get("status") == "completed":
                seen.add(update["toolCallId"])
    saved = read_session_file(os.path.join(home, ".qcr", "sessions", session_id + ".json"))
    done = {u["toolCallId"] for u in saved["transcript"]
            if u["sessionUpdate"] == "tool_call" and u.get("status") == "completed"}
    return seen, done, loaded


def read_session_file(path):
    """A session file: a metadata line, then the body line."""
    with open(path, encoding="ascii") as f:
        meta, body = f.read().splitlines()
    return dict(json.loads(body), **json.loads(meta))


def write_session_file(path, meta, body):
    """A session file in qcr's format, with whatever content a test wants in it."""
    body = json.dumps(body)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="ascii") as f:
        f.write(json.dumps(dict(meta, bodyChars=len(body))) + "\n" + body + "\n")


def kinds(updates):
    return [u["sessionUpdate"] for u in updates]


def text_of(updates, kind="agent_message_chunk"):
    return "".join(u["content"]["text"] for u in updates if u["sessionUpdate"] == kind)


def final_status(updates):
    """toolCallId -> the last status reported."""
    status = {}
    for u in updates:
        if u["sessionUpdate"] in ("tool_call", "tool_call_update") and "status" in u:
            status[u["toolCallId"]] = u["status"]
    return status


def tool_updates(updates):
    return [u for u in updates if u["sessionUpdate"] in ("tool_call", "tool_call_update")]


def calls(*pairs):
    """A reply that calls the tools given as (name, arguments) pairs."""
    return scripted_reply(calls=pairs)


# =============================================================================================
# 1. Wire
# =============================================================================================

class TestWire(AcpTestCase):
    BAD_FRAMES = [   # (raw line, expected error code, expected id)
        (b"{not json", qcr.PARSE_ERROR, None),
        (b"\xff\xfe invalid utf-8", qcr.PARSE_ERROR, None),
        (b"[" * 100000 + b"]" * 100000, qcr.PARSE_ERROR, None),
        (b'[{"jsonrpc":"2.0","id":1,"method":"initialize"}]', qcr.INVALID_REQUEST, None),
        (b'"a string"', qcr.INVALID_REQUEST, None),
        (b'{"jsonrpc":"2.0","id":{"x":1},"method":"initialize"}', qcr.INVALID_REQUEST, None),
        (b'{"jsonrpc":"2.0","id":true,"method":"initialize"}', qcr.INVALID_REQUEST, None),
        (b'{"jsonrpc":"1.0","id":7,"method":"initialize"}', qcr.INVALID_REQUEST, 7),
        (b'{"jsonrpc":"2.0","id":8,"method":42}', qcr.INVALID_REQUEST, 8),
        (b'{"jsonrpc":"2.0","id":9}', qcr.INVALID_REQUEST, 9),
        (b'{"jsonrpc":"2.0","id":10,"method":"no/such"}', qcr.METHOD_NOT_FOUND, 10),
        (b'{"jsonrpc":"2.0","id":11,"method":"initialize","params":[1]}', qcr.INVALID_PARAMS, 11),
        (b'{"jsonrpc":"2.0","id":12,"method":"initialize","params":{}}', qcr.INVALID_PARAMS, 12),
        (b'{"jsonrpc":"2.0","id":"s","method":"session/new","params":{}}',
         qcr.INVALID_PARAMS, "s"),
        (b'{"jsonrpc":"2.0","id":13,"method":"initialize","params":{"protocolVersion":NaN}}',
         qcr.PARSE_ERROR, None),
        ('{"jsonrpc":"2.0","id":14,"method":"initialize"}'.encode("utf-16"),
         qcr.PARSE_ERROR, None),
        (b'{"jsonrpc":"2.0","id":15,"method":"init\xed\xa0\x80"}', qcr.PARSE_ERROR, None),
    ]

    def test_bad_frames_get_the_right_error_and_the_loop_goes_on(self):
        agent = self.start()
        for raw, code, request_id in self.BAD_FRAMES:
            with self.subTest(raw=raw[:60]):
                agent.send_raw(raw + b"\n")
                response = agent.recv()
                self.assertRpcError(response, code)
                self.assertEqual(response["id"], request_id)
        response, _, _ = agent.call("initialize", {"protocolVersion": 1})
        self.assertEqual(response["result"]["protocolVersion"], 1)
        self.assertClean(agent)

    def test_error_messages_name_the_method_and_the_field(self):
        agent = self.start()
        response, _, _ = agent.call("session/fly", {})
        self.assertRpcError(response, qcr.METHOD_NOT_FOUND, "session/fly")
        response, _, _ = agent.call("session/new", {"mcpServers": []})
        self.assertRpcError(response, qcr.INVALID_PARAMS, "cwd")
        self.assertEqual(response["error"]["data"], {"field": "cwd"})

    def test_ids_are_echoed_with_their_type(self):
        agent = self.start()
        for request_id in ("0b3c1e2a-uuid-like", 0, 2 ** 53, "7", -3, 7.5):
            with self.subTest(id=request_id):
                response, _, _ = agent.wait(agent.request("initialize", {"protocolVersion": 1},
                                                          request_id=request_id))
                self.assertEqual(response["id"], request_id)
                self.assertIs(type(response["id"]), type(request_id))

    def test_notifications_and_stray_responses_get_no_answer(self):
        agent = self.start()
        agent.notify("notifications/initialized", {})
        agent.notify("$/cancel_request", {"requestId": 1})
        agent.notify("session/cancel", {"sessionId": "acp-unknown"})
        agent.send({"jsonrpc": "2.0", "id": 999, "result": {}})
        agent.send({"jsonrpc": "2.0", "id": 998, "error": {"code": 1, "message": "x"}})
        response, _, _ = agent.call("initialize", {"protocolVersion": 1}, timeout=5)
        self.assertEqual(response["id"], 1)     # the first frame back answers our request
        self.assertClean(agent)

    def test_a_ten_mebibyte_frame_is_accepted(self):
        self.fake_model(scripted_reply("Read it all."))
        agent = self.start()
        session_id = self.new_session(agent)
        big = "x" * (10 * 1024 * 1024)
        response, updates, _ = agent.call("session/prompt", {"sessionId": session_id, "prompt": [
            {"type": "text", "text": "Summarise"},
            {"type": "resource", "resource": {"uri": "file:///big.txt", "text": big}}]},
            timeout=60)
        self.assertResult(response, {"stopReason": "end_turn"})
        self.assertIn(big, self.model.requests[0]["messages"][-1]["content"])
        self.assertEqual(text_of(updates), "Read it all.")

    def test_a_cancel_right_behind_its_prompt_is_not_lost(self):
        self.fake_model(slow_reply())
        agent = self.start()
        session_id = self.new_session(agent)
        prompt = {"jsonrpc": "2.0", "id": 50, "method": "session/prompt", "params": {
            "sessionId": session_id, "prompt": [{"type": "text", "text": "go"}]}}
        cancel = {"jsonrpc": "2.0", "method": "session/cancel",
                  "params": {"sessionId": session_id}}
        agent.send_raw(json.dumps(prompt).encode() + b"\n" + json.dumps(cancel).encode() + b"\n")
        response, _, _ = agent.wait(50)
        self.assertResult(response, {"stopReason": "cancelled"})
        agent.notify("session/cancel", {"sessionId": [1]})   # a malformed cancel: ignored
        agent.notify("session/cancel", {})
        response, _, _ = agent.call("initialize", {"protocolVersion": 1})
        self.assertResult(response)
        self.assertClean(agent)

    def test_stdin_eof_exits_zero_even_mid_turn(self):
        self.fake_model(slow_reply())
        agent = self.start()
        session_id = self.new_session(agent)
        request_id = agent.request("session/prompt", {"sessionId": session_id, "prompt": [
            {"type": "text", "text": "go"}]})
        self.assertEqual(agent.recv()["params"]["update"]["sessionUpdate"],
                         "session_info_update")
        agent.recv()    # the stream has begun
        start = time.monotonic()
        self.assertEqual(agent.close(timeout=5), 0)
        self.assertLess(time.monotonic() - start, 5)
        frames = []
        while True:
            try:
                frame = agent.frames.get(timeout=1)
            except queue.Empty:
                break
            if frame is None:
                break
            frames.append(frame)
        answers = [f for f in frames if f.get("id") == request_id]
        self.assertEqual([a.get("result") for a in answers], [{"stopReason": "cancelled"}])
        self.assertClean(agent)


def processes_with(marker):
    """Live processes (anyone's children or not) whose command line holds marker."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and alive(int(entry)):
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                continue
    return found


class TestSignals(AcpTestCase):
    def test_sigterm_and_sighup_end_qcr_as_eof_does(self):
        """A turn running a command, an MCP server with a child of its own: the signal
        cancels and answers the turn, saves, stops every process qcr started, exits 0."""
        for number, name in ((signal.SIGTERM, "SIGTERM"), (signal.SIGHUP, "SIGHUP")):
            with self.subTest(signal=name):
                # unique to this run: CI runs several Pythons' suites side by side
                marker = f"{987 if number == signal.SIGTERM else 986}.{os.getpid()}5"
                self.fake_model(calls(("Shell", {"command": f"sleep {marker}1 & sleep {marker}2"})),
                                scripted_reply("never"))
                agent = self.start()
                server = {"name": "kid", "command": "bash", "env": [], "args": [
                    "-c", f"sleep {marker}3 & exec {sys.executable} {os.path.abspath(__file__)} "
                    "--fake-mcp"]}
                agent.call("initialize", {"protocolVersion": 1})
                response, _, _ = agent.call("session/new", {"cwd": self.project,
                                                            "mcpServers": [server]})
                session_id = response["result"]["sessionId"]
                agent.call("session/set_mode", {"sessionId": session_id, "modeId": "yolo"})
                request_id = agent.request("session/prompt", {"sessionId": session_id,
                                                              "prompt": [{"type": "text",
                                                                          "text": "go"}]})
                deadline = time.monotonic() + 15
                while len(processes_with(marker)) < 3:      # (cmdline is NUL-separated)
                    self.assertLess(time.monotonic(), deadline, "the processes never started")
                    time.sleep(0.05)
                agent.proc.send_signal(number)
                response, _, _ = agent.wait(request_id)
                self.assertResult(response, {"stopReason": "cancelled"})
                self.assertEqual(agent.proc.wait(10), 0)
                time.sleep(0.3)
                self.assertEqual(processes_with(marker), [])
                saved = read_session_file(os.path.join(self.home, ".qcr", "sessions",
                                                       session_id + ".json"))
                self.assertIn("Cancelled by the user.", json.dumps(saved["transcript"]))
                self.assertClean(agent)
                self.model.close()


    def test_whatever_ends_qcr_its_children_are_stopped(self):
        """The last resort for any way out of the loop (a crash of its own included):
        every process group qcr started and has not stopped is stopped."""
        marker = f"982.{os.getpid()}"

        async def crash():
            task = asyncio.ensure_future(qcr.run_command(
                f"sleep {marker}1 & sleep {marker}2; wait", self.project, 30))
            deadline = time.monotonic() + 10
            while len(processes_with(marker)) < 2:
                self.assertLess(time.monotonic(), deadline)
                await asyncio.sleep(0.02)
            qcr.stop_children()             # what serve() does on its way out, however
            await asyncio.wait_for(task, 5)
        asyncio.run(crash())
        time.sleep(0.1)
        left = processes_with(marker)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        self.assertEqual(left, [])
        self.assertEqual(qcr.CHILD_GROUPS, set())

    def test_a_cancel_while_a_command_starts_leaves_nothing_behind(self):
        """A cancel (or the signal's cancel) that lands while bash is being started, after
        it exists but before qcr holds its handle: bash and what it began are stopped."""
        async def cancelled_at_start(marker):
            task = asyncio.ensure_future(qcr.run_command(
                f"sleep {marker}1 & sleep {marker}2; wait", self.project, 30))
            await asyncio.sleep(0)      # the start is under way: bash exists ...
            time.sleep(0.1)             # ... and starts its children, the loop held here
            task.cancel()
            with self.assertRaises(asyncio.CancelledError):
                await asyncio.wait_for(task, 5)
        marker = f"985.{os.getpid()}"
        asyncio.run(cancelled_at_start(marker))
        time.sleep(0.1)
        left = processes_with(marker)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        self.assertEqual(left, [])


class TestBadInput(AcpTestCase):
    """Wrong parameters get -32602 or a failed tool result -- never -32603 -- and nothing
    qcr writes, frame or file, ever holds NaN or Infinity."""

    def test_wrong_params_are_invalid_params(self):
        agent = self.start()
        session_id = self.new_session(agent)
        for method, params in (
                ("session/list", {"cursor": "9" * 5000}),
                ("session/prompt", {"sessionId": session_id, "prompt": [
                    {"type": "resource_link", "uri": "file:///etc/passwd%00.txt",
                     "name": "x"}]}),
                ("session/prompt", {"sessionId": session_id, "prompt": [
                    {"type": "resource_link", "uri": "file:///tmp/a\u0000b", "name": "x"}]})):
            with self.subTest(method=method, params=str(params)[:60]):
                self.assertRpcError(agent.call(method, params)[0], qcr.INVALID_PARAMS)
        agent.send_raw(b'{"jsonrpc":"2.0","id":"big","method":"session/set_mode","params":'
                       b'{"sessionId":"x","modeId":"plan","n":1e999}}\n')
        response, _, _ = agent.wait("big")
        self.assertRpcError(response, qcr.INVALID_PARAMS, "too large")
        agent.send_raw(b'{"jsonrpc":"2.0","id":"deep","method":"session/prompt","params":'
                       b'{"sessionId":"x","prompt":' + b"[" * 100000 + b"]" * 100000 + b'}}\n')
        response, _, _ = agent.wait("deep")          # valid JSON, too deep: its own id
        self.assertRpcError(response, qcr.INVALID_PARAMS, "nested too deeply")
        self.assertClean(agent)

    def test_file_names_that_are_not_utf8_read_cleanly(self):
        with open(os.path.join(self.project.encode(), b"caf\xe9.txt"), "w") as f:
            f.write("x\n")
        self.fake_model(calls(("LS", {})), calls(("Glob", {"pattern": "*.txt"})),
                        scripted_reply("ok"))
        agent = self.start()
        _, updates, _ = self.prompt(agent, self.new_session(agent), "go")
        self.assertEqual(self.tool_messages(1), ["caf\\xe9.txt  (2 bytes)"])
        self.assertEqual(self.tool_messages(2)[-1], "caf\\xe9.txt")
        self.assertNotIn("\\ud", json.dumps(agent.received))     # valid for the editor too
        self.assertClean(agent)

    def test_a_very_deep_tree_is_searched_without_recursion(self):
        self.addCleanup(subprocess.run, ["rm", "-rf", os.path.join(self.project, "d")])
        here = os.getcwd()
        os.chdir(self.project)
        try:
            for _ in range(1200):           # deeper than Python's recursion limit
                os.mkdir("d")
                os.chdir("d")
            with open("deep.txt", "w") as f:
                f.write("found me\n")
        finally:
            os.chdir(here)
        self.fake_model(calls(("Glob", {"pattern": "**/deep.txt"})),
                        calls(("Grep", {"pattern": "found me"})), scripted_reply("ok"))
        agent = self.start()
        self.prompt(agent, self.new_session(agent), "find it")
        self.assertTrue(self.tool_messages(1)[0].endswith("d/d/deep.txt"))
        self.assertTrue(self.tool_messages(2)[-1].endswith("deep.txt:1: found me"))
        self.assertClean(agent)

    def test_hostile_tool_arguments_are_failed_results_and_the_session_reloads(self):
        deep = "[" * 100000 + "]" * 100000
        self.fake_model(
            [sse(completion_chunk({"tool_calls": [{"index": 0, "id": "c1", "function": {
                "name": "ReadFile", "arguments": '{"path": "a", "offset": 1e999}'}}]})),
             sse(completion_chunk({"tool_calls": [{"index": 1, "id": "c2", "function": {
                 "name": "ReadFile", "arguments": '{"path": ' + deep + '}'}}]})),
             sse(completion_chunk(finish="tool_calls")), sse(b"[DONE]")],
            scripted_reply("ok"))
        agent = self.start()
        session_id = self.new_session(agent)
        response, updates, _ = self.prompt(agent, session_id, "go")
        self.assertResult(response, {"stopReason": "end_turn"})
        results = self.tool_messages(1)
        self.assertIn("too large", results[0])
        self.assertIn("nested too deeply", results[1])
        agent.close()
        path = os.path.join(self.home, ".qcr", "sessions", session_id + ".json")
        with open(path) as f:
            strict_json(f.readline())
            strict_json(f.readline())          # no NaN, no Infinity in the file
        agent = self.start()
        agent.call("initialize", {"protocolVersion": 1})
        response, replayed, _ = agent.call("session/load", {
            "sessionId": session_id, "cwd": self.project, "mcpServers": []})
        self.assertResult(response)
        self.assertEqual(sorted(final_status(replayed).values()), ["failed", "failed"])
        self.assertEqual(agent.bad_lines, [])


class TestConnectionInProcess(unittest.TestCase):
    """The error boundary, with handlers that crash on purpose."""

    def run_lines(self, lines, on_request):
        import asyncio
        written = []

        async def go():
            conn = qcr.Connection(written.append, on_request, lambda m, p: None)
            reader = asyncio.StreamReader()
            reader.feed_data(b"".join(lines))
            reader.feed_eof()
            await conn.serve(reader)
            await asyncio.gather(*conn.tasks)
        asyncio.run(go())
        return [json.loads(w) for w in written]

    def test_a_crashing_handler_gives_internal_error_and_the_loop_goes_on(self):
        async def on_request(method, params):
            if method == "boom":
                raise KeyError("oops")
            return {"ok": method}
        stderr = sys.stderr
        sys.stderr = open(os.devnull, "w")
        try:
            out = self.run_lines([b'{"jsonrpc":"2.0","id":1,"method":"boom"}\n',
                                  b'{"jsonrpc":"2.0","id":2,"method":"fine"}\n'], on_request)
        finally:
            sys.stderr.close()
            sys.stderr = stderr
        by_id = {o["id"]: o for o in out}
        self.assertEqual(by_id[1]["error"]["code"], qcr.INTERNAL_ERROR)
        self.assertIn("KeyError", by_id[1]["error"]["message"])
        self.assertEqual(by_id[2]["result"], {"ok": "fine"})

    def test_an_oversized_line_gets_one_error_and_the_next_frame_is_served(self):
        import asyncio
        written = []

        async def on_request(method, params):
            return {"ok": method}

        async def go():
            conn = qcr.Connection(written.append, on_request, lambda m, p: None)
            reader = asyncio.StreamReader(limit=1024)
            reader.feed_data(b'{"jsonrpc":"2.0","id":1,"method":"' + b"x" * 5000 + b'"}\n')
            reader.feed_data(b'{"jsonrpc":"2.0","id":2,"method":"fine"}\n')
            reader.feed_eof()
            await conn.serve(reader)
            await asyncio.gather(*conn.tasks)
        asyncio.run(go())
        out = [json.loads(w) for w in written]
        self.assertEqual([(o["id"], o.get("error", {}).get("code")) for o in out],
                         [(None, qcr.INVALID_REQUEST), (2, None)])

    def test_lone_surrogates_never_reach_the_wire(self):
        frame = qcr.encode_frame({"text": "a\ud800b", "pair": "\U0001F600"})
        self.assertEqual(json.loads(frame), {"text": "a\ufffdb", "pair": "\U0001F600"})

    def test_empty_results_are_objects_never_null(self):
        async def on_request(method, params):
            return None
        out = self.run_lines([b'{"jsonrpc":"2.0","id":"a","method":"x"}\n'], on_request)
        self.assertEqual(out, [{"jsonrpc": "2.0", "id": "a", "result": {}}])


# =============================================================================================
# 2. ACP handlers
# =============================================================================================

class TestInitialize(AcpTestCase):
    def test_any_protocol_version_is_answered_with_1(self):
        agent = self.start()
        for version in (1, "1", "2025-07-09", 2, None, {"weird": True}):
            with self.subTest(version=version):
                response, _, _ = agent.call("initialize", {"protocolVersion": version})
                self.assertEqual(response["result"]["protocolVersion"], 1)

    def test_capabilities_and_agent_info(self):
        agent = self.start()
        response, _, _ = agent.call("initialize", {"protocolVersion": "2025-07-09",
                                                   "capabilities": {}})
        result = response["result"]
        self.assertEqual(result["agentInfo"]["name"], "qcr")
        self.assertEqual(result["agentInfo"]["version"], qcr.__version__)
        self.assertEqual([m["id"] for m in result["authMethods"]], ["reload"])
        caps = result["agentCapabilities"]
        self.assertTrue(caps["loadSession"])
        self.assertEqual(caps["promptCapabilities"],
                         {"image": True, "audio": False, "embeddedContext": True})
        self.assertEqual(caps["mcpCapabilities"], {"http": True, "sse": True})


class TestTodaysAcp(AcpTestCase):
    """What the current stable schema added, each gated on what the client advertises."""
    EVERYTHING = {"session": {"notices": {}, "compaction": {}}}

    def bad_config(self):
        os.makedirs(os.path.join(self.home, ".qcr"), exist_ok=True)
        with open(os.path.join(self.home, ".qcr", "config.json"), "w") as f:
            json.dump({"bogus": 1}, f)

    def test_qcrs_own_notes_are_notices_when_the_client_shows_them(self):
        self.bad_config()
        self.fake_model(scripted_reply("ok"))
        for capabilities, noticed in (({}, False), (self.EVERYTHING, True)):
            with self.subTest(notices=noticed):
                agent = self.start()
                session_id = self.new_session(agent, capabilities=capabilities)
                _, updates, _ = self.prompt(agent, session_id, "hi")
                notices = [u for u in updates if u["sessionUpdate"] == "notice"]
                said = text_of(updates)
                if noticed:
                    self.assertEqual(said, "ok")
                    self.assertEqual(notices[0]["severity"], "warning")
                    self.assertIn("unknown setting 'bogus'", notices[0]["title"])
                else:
                    self.assertEqual(notices, [])
                    self.assertIn("[warning] unknown setting 'bogus'", said)
                agent.close()
                _, replay, _ = self.reopen_with(session_id, capabilities)
                self.assertNotIn("notice", kinds(replay))       # live only, never replayed

    def test_a_retry_is_a_notice(self):
        self.fake_model((503, {"error": "overloaded"}), scripted_reply("Finally."))
        agent = self.start(env={"QCR_RETRY_BUDGET": "20"})
        session_id = self.new_session(agent, capabilities=self.EVERYTHING)
        _, updates, _ = self.prompt(agent, session_id, "hi", timeout=30)
        notices = [u for u in updates if u["sessionUpdate"] == "notice"]
        self.assertEqual(text_of(updates), "Finally.")
        self.assertEqual(notices[0]["severity"], "warning")
        self.assertRegex(notices[0]["title"], r"^[^\[_].*HTTP 503.*retrying in \d+ s$")

    def reopen_with(self, session_id, capabilities):
        agent = self.start()
        agent.call("initialize", {"protocolVersion": 1, "clientCapabilities": capabilities})
        response, replay, _ = agent.call("session/load", {
            "sessionId": session_id, "cwd": self.project, "mcpServers": []})
        return agent, replay, response

    def test_compaction_as_the_protocol_has_it(self):
        def model(body):
            if body["messages"][0]["content"] == qcr.COMPACT_INSTRUCTIONS:
                return scripted_reply("SUMMARY: short answers.")
            return scripted_reply("word " * 800, usage=None)
        self.model = qcr.FakeModel(model)
        agent = self.start(env={"QCR_CONTEXT_WINDOW": "1000"})
        session_id = self.new_session(agent, capabilities=self.EVERYTHING)
        self.prompt(agent, session_id, "first")
        _, updates, _ = self.prompt(agent, session_id, "second")
        shown = [u for u in updates if u["sessionUpdate"].startswith("compaction")]
        self.assertEqual([(u["sessionUpdate"], u.get("status")) for u in shown],
                         [("compaction_update", "in_progress"),
                          ("compaction_summary_chunk", None),
                          ("compaction_update", "completed")])
        self.assertEqual(len({u["compactionId"] for u in shown}), 1)
        self.assertEqual(shown[1]["content"]["text"], "SUMMARY: short answers.")
        numbers = shown[2]["_meta"]["qcr"]
        self.assertGreater(numbers["tokensBefore"], numbers["tokensAfter"])
        self.assertNotIn("tool_call", kinds(updates))
        agent.close()
        for capabilities, expected in ((self.EVERYTHING, "compaction_update"),
                                       ({}, "agent_message_chunk")):
            with self.subTest(capabilities=capabilities):
                agent, replay, _ = self.reopen_with(session_id, capabilities)
                if expected == "compaction_update":
                    entity = [u for u in replay if u["sessionUpdate"] == expected]
                    self.assertEqual(entity[0]["status"], "completed")
                    self.assertEqual(entity[0]["summary"][0]["text"], "SUMMARY: short answers.")
                else:
                    self.assertIn("[the conversation was compacted]", text_of(replay))
                    self.assertNotIn("compaction_update", kinds(replay))
                agent.close()

    def test_logout_forgets_the_key_and_asks_for_sign_in_again(self):
        os.makedirs(os.path.join(self.home, ".qcr"))
        path = os.path.join(self.home, ".qcr", "config.json")
        self.fake_model(scripted_reply("ok"))
        with open(path, "w") as f:
            json.dump({"baseUrl": self.model.url, "model": "m", "apiKey": "sk-forget-me"}, f)
        agent = self.start()
        response, _, _ = agent.call("initialize", {"protocolVersion": 1})
        self.assertEqual(response["result"]["agentCapabilities"]["auth"], {"logout": {}})
        self.assertResult(agent.call("logout", {})[0], {})
        with open(path) as f:
            kept = json.load(f)
        self.assertEqual(kept, {"baseUrl": self.model.url, "model": "m"})
        new = {"cwd": self.project, "mcpServers": []}
        self.assertRpcError(agent.call("session/new", new)[0], qcr.AUTH_REQUIRED, "signed out")
        self.assertResult(agent.call("authenticate", {"methodId": "reload"})[0], {})
        self.assertIn("sessionId", agent.call("session/new", new)[0]["result"])
        self.assertClean(agent)

    def test_tool_names_and_message_ids(self):
        self.write("a.txt", "x\n")
        self.fake_model([sse(completion_chunk({"content": "Let me "})),
                         sse(completion_chunk({"content": "look."}))] +
                        calls(("ReadFile", {"path": "a.txt"})), scripted_reply("Done."))
        agent = self.start()
        _, updates, _ = self.prompt(agent, self.new_session(agent), "go")
        card = [u for u in updates if u["sessionUpdate"] == "tool_call"][0]
        self.assertEqual(card["name"], "ReadFile")
        chunks = [u for u in updates if u["sessionUpdate"] == "agent_message_chunk"]
        before, after = chunks[:2], chunks[2:]
        self.assertEqual(len({c["messageId"] for c in before}), 1)   # one message
        self.assertNotEqual(before[0]["messageId"], after[0]["messageId"])   # then another

    def test_cancel_request_both_ways(self):
        self.fake_model(slow_reply(), calls(("WriteFile", {"path": "b.txt", "content": "x"})),
                        scripted_reply("never"))
        agent = self.start()
        session_id = self.new_session(agent)
        prompt = agent.request("session/prompt", {"sessionId": session_id,
                                                  "prompt": [{"type": "text", "text": "go"}]})
        while agent.recv().get("params", {}).get("update", {}).get(
                "sessionUpdate") != "agent_message_chunk":
            pass                                                   # the stream has begun
        agent.notify("$/cancel_request", {"requestId": prompt})    # the client's form
        response, _, _ = agent.wait(prompt)
        self.assertResult(response, {"stopReason": "cancelled"})
        prompt = agent.request("session/prompt", {"sessionId": session_id,
                                                  "prompt": [{"type": "text", "text": "edit"}]})
        while True:
            frame = agent.recv()
            if frame.get("method") == "session/request_permission":
                break
        agent.notify("session/cancel", {"sessionId": session_id})
        frames = []
        while not (frames and frames[-1].get("id") == prompt and "method" not in frames[-1]):
            frames.append(agent.recv())
        told = [f for f in frames if f.get("method") == "$/cancel_request"]
        self.assertEqual(told[0]["params"], {"requestId": frame["id"]})   # qcr's form
        self.assertResult(frames[-1], {"stopReason": "cancelled"})
        self.assertFalse(os.path.exists(os.path.join(self.project, "b.txt")))

    def option(self, options, option_id):
        found = [o for o in options if o["id"] == option_id]
        return found[0] if found else None

    def test_thinking_level_for_the_models_that_take_one(self):
        self.fake_model(scripted_reply("ok"))
        agent = self.start(env={"QCR_MODEL": "gpt-oss-20b"})
        agent.call("initialize", {"protocolVersion": 1})
        response, _, _ = agent.call("session/new", {"cwd": self.project, "mcpServers": []})
        session_id = response["result"]["sessionId"]
        level = self.option(response["result"]["configOptions"], "thought_level")
        self.assertEqual((level["category"], level["currentValue"]), ("thought_level", "default"))
        self.assertEqual([o["value"] for o in level["options"]],
                         ["default", "low", "medium", "high"])
        response, _, _ = agent.call("session/set_config_option", {
            "sessionId": session_id, "configId": "thought_level", "value": "high"})
        self.assertEqual(self.option(response["result"]["configOptions"],
                                     "thought_level")["currentValue"], "high")
        self.prompt(agent, session_id, "think hard")
        self.assertEqual(self.model.requests[-1]["reasoning_effort"], "high")
        self.prompt(agent, session_id, "/effort low")
        self.prompt(agent, session_id, "and now")
        self.assertEqual(self.model.requests[-1]["reasoning_effort"], "low")
        self.assertRpcError(agent.call("session/set_config_option", {
            "sessionId": session_id, "configId": "thought_level", "value": "max"})[0],
            qcr.INVALID_PARAMS)
        agent.close()
        agent = self.start(env={"QCR_MODEL": "gpt-oss-20b"})          # kept with the session
        agent.call("initialize", {"protocolVersion": 1})
        response, _, _ = agent.call("session/load", {"sessionId": session_id,
                                                     "cwd": self.project, "mcpServers": []})
        self.assertEqual(self.option(response["result"]["configOptions"],
                                     "thought_level")["currentValue"], "low")
        agent.close()
        agent = self.start(env={"QCR_MODEL": "plain-coder"})          # takes neither
        session_id = self.new_session(agent)
        response, _, _ = agent.call("session/set_config_option", {
            "sessionId": session_id, "configId": "mode", "value": "default"})
        self.assertIsNone(self.option(response["result"]["configOptions"], "thought_level"))
        self.prompt(agent, session_id, "hi")
        self.assertNotIn("reasoning_effort", self.model.requests[-1])

    def test_thinking_budgets_for_anthropic(self):
        config = qcr.Config(provider="anthropic", max_tokens=4096)
        messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
        for effort, budget in (("high", 24576), ("low", 2048), ("off", None), ("", None)):
            with self.subTest(effort=effort):
                body = qcr.make_provider(config, "claude-sonnet-4-5", effort).request_body(
                    messages, [])
                self.assertEqual(body.get("thinking", {}).get("budget_tokens"), budget)
                if budget:
                    self.assertGreater(body["max_tokens"], budget)
        self.assertEqual(qcr.effort_levels(config, "claude-3-5-haiku-latest"), [])

    def test_automatic_compaction_can_be_switched_off(self):
        self.model = qcr.FakeModel(lambda body: scripted_reply("word " * 800, usage=None))
        for capabilities, kind in (({"session": {"configOptions": {"boolean": {}}}}, "boolean"),
                                   ({}, "select")):
            with self.subTest(kind=kind):
                agent = self.start(env={"QCR_CONTEXT_WINDOW": "1000"})
                session_id = self.new_session(agent, capabilities=capabilities)
                off = {"sessionId": session_id, "configId": "auto_compact", "value": False}
                off = dict(off, type="boolean") if kind == "boolean" else dict(off, value="off")
                response, _, _ = agent.call("session/set_config_option", off)
                switch = self.option(response["result"]["configOptions"], "auto_compact")
                self.assertEqual(switch["type"], kind)
                self.assertIn(switch["currentValue"], (False, "off"))
                for text in ("one", "two", "three"):
                    _, updates, _ = self.prompt(agent, session_id, text)
                    self.assertNotIn("tool_call", kinds(updates))     # never compacted
                agent.close()

    def test_cost_when_the_price_is_known(self):
        os.makedirs(os.path.join(self.home, ".qcr"))
        with open(os.path.join(self.home, ".qcr", "config.json"), "w") as f:
            json.dump({"prices": {"paid-*": {"input": 2, "output": 10}}}, f)
        usage = {"prompt_tokens": 1000, "completion_tokens": 100, "total_tokens": 1100}
        self.fake_model(scripted_reply("ok", usage=usage))
        for model, cost in (("paid-model", 0.003), ("free-local-model", None)):
            with self.subTest(model=model):
                agent = self.start(env={"QCR_MODEL": model})
                session_id = self.new_session(agent)
                for total in (1, 2):
                    _, updates, _ = self.prompt(agent, session_id, "hi")
                    usage_updates = [u for u in updates if u["sessionUpdate"] == "usage_update"]
                    if cost is None:     # a local server, no price configured: no cost
                        self.assertNotIn("cost", usage_updates[-1])
                    else:                # cumulative: 1,000 x $2 + 100 x $10 per million
                        self.assertEqual(usage_updates[-1]["cost"],
                                         {"amount": round(cost * total, 6), "currency": "USD"})
                agent.close()
        self.assertIsNone(qcr.price_of(qcr.Config(base_url="http://127.0.0.1:8080/v1"),
                                       "gpt-4o"))
        self.assertEqual(qcr.price_of(qcr.Config(base_url="https://api.openai.com/v1"),
                                      "gpt-4o-mini-2024")["input"], 0.15)

    def test_what_the_acp_registry_checks(self):
        """The registry's gate, as its verify_agents.py does it: an empty HOME, TERM=dumb,
        its own initialize line; the first stdout line must be the answer, with an
        authMethods entry of type agent or terminal (a method with no type is agent)."""
        home = tempfile.mkdtemp(prefix="qcr-registry-")
        self.addCleanup(shutil.rmtree, home, True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "QCR_"))}
        env.update(HOME=home, TERM="dumb")
        proc = subprocess.Popen([sys.executable, QCR, "--acp"], cwd=home, env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        proc.stdin.write(json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize",
                                     "params": {"protocolVersion": 1, "clientInfo": {
                                         "name": "ACP Registry Validator", "version": "1.0.0"},
                                         "clientCapabilities": {
                                             "terminal": True, "fs": {"readTextFile": True,
                                                                      "writeTextFile": True},
                                             "_meta": {"terminal_output": True,
                                                       "terminal-auth": True}}}}).encode()
                         + b"\n")
        proc.stdin.flush()
        first = json.loads(proc.stdout.readline())
        proc.terminate()
        proc.communicate(timeout=5)
        self.assertNotIn("error", first)
        methods = first["result"]["authMethods"]
        self.assertTrue(methods)
        self.assertTrue(any(m.get("type", "agent") in ("agent", "terminal") for m in methods))


class TestSessionSetup(AcpTestCase):
    def test_new_session_has_modes_and_config_options_in_sync(self):
        agent = self.start(env={"QCR_MODEL": "m1", "QCR_MODELS": "m1,m2"})
        agent.call("initialize", {"protocolVersion": 1})
        response, _, _ = agent.call("session/new", {"cwd": self.project, "mcpServers": []})
        result = response["result"]
        self.assertRegex(result["sessionId"], r"^acp-[0-9a-f]{16}-[0-9a-f]{16}$")
        self.assertEqual(result["modes"]["currentModeId"], "default")
        self.assertEqual([m["id"] for m in result["modes"]["availableModes"]],
                         ["default", "plan", "auto-edit", "yolo"])
        options = {o["id"]: o for o in result["configOptions"]}
        self.assertEqual(options["mode"]["currentValue"], "default")
        self.assertEqual(options["mode"]["category"], "mode")
        self.assertEqual(options["model"]["currentValue"], "m1")
        self.assertEqual([o["value"] for o in options["model"]["options"]], ["m1", "m2"])
        other, _, _ = agent.call("session/new", {"cwd": self.project, "mcpServers": []})
        self.assertNotEqual(other["result"]["sessionId"], result["sessionId"])

    def test_cwd_must_be_an_absolute_existing_directory(self):
        agent = self.start()
        file_path = self.write("a.txt", "x")
        for cwd in ("relative/dir", os.path.join(self.tmp, "missing"), file_path, 42, None):
            with self.subTest(cwd=cwd):
                response, _, _ = agent.call("session/new", {"cwd": cwd, "mcpServers": []})
                self.assertRpcError(response, qcr.INVALID_PARAMS, "cwd")
        response, _, _ = agent.call("session/new", {"cwd": self.project, "mcpServers": "x"})
        self.assertRpcError(response, qcr.INVALID_PARAMS, "mcpServers")

    def test_set_mode_and_config_options(self):
        agent = self.start(env={"QCR_MODEL": "m1", "QCR_MODELS": "m2"})
        session_id = self.new_session(agent)
        response, updates, _ = agent.call("session/set_mode", {"sessionId": session_id,
                                                               "modeId": "plan"})
        self.assertResult(response, {})
        self.assertEqual(kinds(updates), ["current_mode_update", "config_option_update"])
        self.assertEqual(updates[0]["currentModeId"], "plan")
        response, updates, _ = agent.call("session/set_config_option", {
            "sessionId": session_id, "configId": "mode", "value": "auto-edit"})
        options = {o["id"]: o for o in response["result"]["configOptions"]}
        self.assertEqual(options["mode"]["currentValue"], "auto-edit")
        self.assertEqual(updates[0], {"sessionUpdate": "current_mode_update",
                                      "currentModeId": "auto-edit"})
        response, _, _ = agent.call("session/set_config_option", {
            "sessionId": session_id, "configId": "model", "value": "m2"})
        options = {o["id"]: o for o in response["result"]["configOptions"]}
        self.assertEqual(options["model"]["currentValue"], "m2")
        bad = [("session/set_mode", {"modeId": "turbo"}, "modeId"),
               ("session/set_config_option", {"configId": "speed", "value": "x"}, "configId"),
               ("session/set_config_option", {"configId": "model", "value": "m9"}, "value"),
               ("session/set_config_option", {"configId": "mode", "value": 3}, "value")]
        for method, params, field_name in bad:
            with self.subTest(params=params):
                response, _, _ = agent.call(method, dict(params, sessionId=session_id))
                self.assertRpcError(response, qcr.INVALID_PARAMS, field_name)

    def test_unknown_session_is_resource_not_found(self):
        agent = self.start()
        self.new_session(agent)
        for method, extra in (("session/prompt", {"prompt": []}),
                              ("session/set_mode", {"modeId": "plan"})):
            with self.subTest(method=method):
                response, _, _ = agent.call(method, dict(extra, sessionId="acp-nope"))
                self.assertRpcError(response, qcr.RESOURCE_NOT_FOUND)
                self.assertEqual(response["error"]["data"], {"sessionId": "acp-nope"})

    def test_malformed_prompt_blocks_are_invalid_params(self):
        agent = self.start()
        session_id = self.new_session(agent)
        for prompt, field_name in (("hi", "prompt"), ([{"type": "text"}], "prompt[0].text"),
                                   ([{"type": "video"}], "prompt[0].type"), ([7], "prompt[0]"),
                                   ([{"type": "resource", "resource": {}}],
                                    "prompt[0].resource")):
            with self.subTest(prompt=prompt):
                response, _, _ = agent.call("session/prompt", {"sessionId": session_id,
                                                               "prompt": prompt})
                self.assertRpcError(response, qcr.INVALID_PARAMS, field_name)


# =============================================================================================
# 3. Sessions: persistence and load
# =============================================================================================

class TestPersistence(AcpTestCase):
    def session_file(self, session_id):
        return os.path.join(self.home, ".qcr", "sessions", session_id + ".json")

    def test_saved_after_each_step_and_loaded_after_restart(self):
        self.write("a.py", "x = 1\n")
        self.fake_model(calls(("EditFile", {"path": "a.py", "old_string": "1",
                                            "new_string": "2"})),
                        scripted_reply("Changed it."))
        agent = self.start()
        session_id = self.new_session(agent)
        seen_on_disk = []

        def answer(frame):   # while permission is pending, the model's reply reaches disk
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                messages = read_session_file(self.session_file(session_id))["messages"]
                if len(messages) > 1:
                    break
                time.sleep(0.02)
            seen_on_disk.append(messages)
            return ALLOW
        response, updates, _ = self.prompt(agent, session_id, "make it 2", answer=answer)
        self.assertResult(response, {"stopReason": "end_turn"})
        self.assertEqual([m["role"] for m in seen_on_disk[0]], ["user", "assistant"])
        self.assertEqual(seen_on_disk[0][1]["tool_calls"][0]["function"]["name"], "EditFile")
        self.assertEqual(agent.close(), 0)
        saved = read_session_file(self.session_file(session_id))
        self.assertEqual([m["role"] for m in saved["messages"]],
                         ["user", "assistant", "tool", "assistant"])
        self.assertEqual(saved["title"], "make it 2")
        self.assertNotIn("apiKey", json.dumps(saved))

        agent = self.start()
        agent.call("initialize", {"protocolVersion": 1})
        response, replay, _ = agent.call("session/load", {"sessionId": session_id,
                                                          "cwd": self.project,
                                                          "mcpServers": []})
        self.assertEqual(response["result"]["modes"]["currentModeId"], "default")
        self.assertEqual(kinds(replay), ["user_message_chunk", "tool_call",
                                         "agent_message_chunk", "session_info_update"])
        self.assertEqual(kinds([agent.recv()["params"]["update"]]),
                         ["available_commands_update"])
        self.assertEqual(replay[0]["content"]["text"], "make it 2")
        call = replay[1]
        self.assertEqual((call["kind"], call["status"]), ("edit", "completed"))
        self.assertEqual(call["content"][0], {"type": "diff", "path": os.path.join(
            self.project, "a.py"), "oldText": "x = 1\n", "newText": "x = 2\n"})
        self.assertEqual(call["rawInput"], {"path": "a.py", "old_string": "1", "new_string": "2"})
        self.assertEqual(text_of(replay), "Changed it.")
        live = [u for u in updates if u["sessionUpdate"] == "tool_call"][0]
        self.assertEqual(call["toolCallId"], live["toolCallId"])
        # and the conversation goes on where it was
        response, _, _ = self.prompt(agent, session_id, "thanks")
        self.assertResult(response, {"stopReason": "end_turn"})
        self.assertEqual([m["role"] for m in self.model.requests[-1]["messages"]],
                         ["system", "user", "assistant", "tool", "assistant", "user"])

    def test_a_session_file_is_trusted_for_nothing(self):
        session_id = "acp-" + "4" * 16 + "-" + "5" * 16
        write_session_file(self.session_file(session_id), {
            "sessionId": "acp-" + "9" * 16 + "-" + "9" * 16, "cwd": 3, "title": 5,
            "mode": "chaos", "updated": 1.0}, {
            "messages": "x", "allowed": {"k": {"allow": "yes"}}, "transcript": [
                {"sessionUpdate": "plan", "entries": "zz"},
                {"sessionUpdate": "agent_message_chunk",
                 "content": {"type": "text", "text": "kept"}},
                {"sessionUpdate": "tool_call_update", "toolCallId": "x"}, 7]})
        agent = self.start()
        agent.call("initialize", {"protocolVersion": 1})
        response, replay, _ = agent.call("session/load", {
            "sessionId": session_id, "cwd": self.project, "mcpServers": []})
        self.assertEqual(response["result"]["modes"]["currentModeId"], "default")
        self.assertEqual(without_ids(replay), [{"sessionUpdate": "agent_message_chunk",
                                                "content": {"type": "text", "text": "kept"}}])
        self.assertClean(agent)

    def test_a_reloaded_session_offers_the_model_configured_now(self):
        self.fake_model(scripted_reply("ok"))
        agent = self.start(model=None, env={"QCR_BASE_URL": self.model.url})
        session_id = self.new_session(agent)
        response, updates, _ = self.prompt(agent, session_id, "hi")
        self.assertIn("no model is configured", text_of(updates))
        response, _, _ = agent.call("session/set_config_option", {
            "sessionId": session_id, "configId": "model", "value": "(none)"})
        self.assertResult(response)
        agent.close()
        agent = self.start(model="now-configured")
        agent.call("initialize", {"protocolVersion": 1})
        response, _, _ = agent.call("session/load", {"sessionId": session_id,
                                                     "cwd": self.project, "mcpServers": []})
        options = {o["id"]: o for o in response["result"]["configOptions"]}
        self.assertEqual(options["model"]["currentValue"], "now-configured")
        response, updates, _ = self.prompt(agent, session_id, "again")
        self.assertEqual(text_of(updates), "ok")
        self.assertEqual(self.model.requests[-1]["model"], "now-configured")
        roles = [m["role"] for m in self.model.requests[-1]["messages"]]
        self.assertEqual(roles, ["system", "user"])    # the failed turn's prompt is merged
        self.assertIn("hi\n\nagain", self.model.requests[-1]["messages"][1]["content"])

    def test_a_new_session_is_a_file_at_once_and_save_failures_are_told(self):
        agent = self.start()
        session_id = self.new_session(agent)
        agent.close()
        path = os.path.join(self.home, ".qcr", "sessions", session_id + ".json")
        self.assertEqual(read_session_file(path)["messages"], [])
        agent = self.start()                 # never prompted, still a session everywhere
        agent.call("initialize", {"protocolVersion": 1})
        listed = agent.call("session/list", {})[0]["result"]["sessions"]
        self.assertEqual([s["sessionId"] for s in listed], [session_id])
        params = {"sessionId": session_id, "cwd": self.project, "mcpServers": []}
        self.assertResult(agent.call("session/resume", params)[0])
        self.assertResult(agent.call("session/close", {"sessionId": session_id})[0])
        self.assertResult(agent.call("session/delete", {"sessionId": session_id})[0])
        self.assertEqual(agent.call("session/list", {})[0]["result"]["sessions"], [])
        agent.close()
        shutil.rmtree(os.path.join(self.home, ".qcr", "sessions"))
        os.makedirs(os.path.join(self.home, ".qcr"), exist_ok=True)
        with open(os.path.join(self.home, ".qcr", "sessions"), "w") as f:
            f.write("a file where the folder should be")
        self.fake_model(calls(("LS", {})), scripted_reply("ok"))
        agent = self.start()
        response, updates, _ = self.prompt(agent, self.new_session(agent), "hi")
        self.assertResult(response, {"stopReason": "end_turn"})
        self.assertEqual(text_of(updates).count("this session cannot be saved"), 1)
        self.assertClean(agent)

    def test_every_step_seen_completed_survives_sigkill(self):
        """Kill qcr at random moments of a long turn, many times: every tool call the
        client saw completed is completed in the file, and the file always loads."""
        import random
        seed = random.randrange(10 ** 6)
        rng = random.Random(seed)
        self.write("a.txt", "x\n")
        self.fake_model(lambda body: [0.01] + calls(("ReadFile", {"path": "a.txt"})))
        seen, done, loaded = kill_loop(self.start, self.new_session, self.project, self.home,
                                       12, lambda: rng.uniform(0.05, 0.6))
        self.assertGreater(len(seen), 3, f"seed {seed}: too few steps to prove anything")
        self.assertEqual(seen - done, set(), f"seed {seed}: seen completed, lost on disk")
        self.assertEqual(loaded, 11)

    def test_two_processes_on_one_session_keep_both_versions(self):
        self.fake_model(scripted_reply("from A"), scripted_reply("from B"))
        first = self.start()
        session_id = self.new_session(first)
        params = {"sessionId": session_id, "cwd": self.project, "mcpServers": []}
        second = self.start()
        second.call("initialize", {"protocolVersion": 1})
        self.assertResult(second.call("session/load", params)[0])
        self.prompt(first, session_id, "A speaks")
        _, updates, _ = self.prompt(second, session_id, "B speaks")
        deadline = time.monotonic() + 5
        while "another qcr changed this session" not in text_of(updates):
            self.assertLess(time.monotonic(), deadline, text_of(updates))
            frame = second.recv()
            updates.append(frame["params"]["update"])
        first.close()
        second.close()
        path = os.path.join(self.home, ".qcr", "sessions", session_id + ".json")
        said = [m["content"] for m in read_session_file(path)["messages"]]
        self.assertEqual(said, ["A speaks", "from A"])
        aside = [n for n in os.listdir(os.path.dirname(path)) if ".conflict-" in n]
        self.assertEqual(len(aside), 1)
        said = [m["content"] for m in read_session_file(
            os.path.join(os.path.dirname(path), aside[0]))["messages"]]
        self.assertEqual(said, ["B speaks", "from B"])

    def test_load_refuses_foreign_ids_and_reports_missing_and_damaged_files(self):
        agent = self.start()
        agent.call("initialize", {"protocolVersion": 1})
        params = {"cwd": self.project, "mcpServers": []}
        for bad in ("../../etc/passwd", "acp-../x", "/tmp/x", "acp-1-2"):
            with self.subTest(id=bad):
                response, _, _ = agent.call("session/load", dict(params, sessionId=bad))
                self.assertRpcError(response, qcr.INVALID_PARAMS, "sessionId")
        missing = "acp-" + "0" * 16 + "-" + "1" * 16
        response, _, _ = agent.call("session/load", dict(params, sessionId=missing))
        self.assertRpcError(response, qcr.RESOURCE_NOT_FOUND)
        self.assertEqual(response["error"]["data"], {"sessionId": missing})
        response, _, _ = agent.call("initialize", {"protocolVersion": 1})
        self.assertResult(response)


class TestSharedFiles(AcpTestCase):
    def test_what_qcr_keeps_is_private_and_left_whole(self):
        self.fake_model(calls(("WriteFile", {"path": "a.txt", "content": "x"})),
                        scripted_reply("ok"))
        agent = self.start()
        session_id = self.new_session(agent)
        self.prompt(agent, session_id, "go", answer={"outcome": {
            "outcome": "selected", "optionId": "allow_project"}})
        agent.send({"jsonrpc": "2.0", "id": 999, "result": {}})   # logged: no such request
        agent.call("session/list", {})
        agent.close()
        qcr_home = os.path.join(self.home, ".qcr")
        for path, mode in ((qcr_home, 0o700), (os.path.join(qcr_home, "sessions"), 0o700),
                           (os.path.join(qcr_home, "sessions", session_id + ".json"), 0o600),
                           (os.path.join(qcr_home, "permissions.json"), 0o600),
                           (os.path.join(qcr_home, "qcr.log"), 0o600)):
            with self.subTest(path=path):
                self.assertEqual(stat_mode(path), mode)
        left = [n for _, _, names in os.walk(qcr_home) for n in names if n.endswith(".tmp")]
        self.assertEqual(left, [])

    def test_answers_remembered_at_once_by_two_writers_are_all_kept(self):
        path = os.path.join(self.home, ".qcr", "permissions.json")
        session = qcr.Session(id="acp-0000000000000000-0000000000000000", cwd=self.project)

        def remember(writer):
            ledger = qcr.Ledger(path)        # each its own, as two qcr processes are
            for i in range(40):
                asyncio.run(ledger.remember(session, "project", f"key-{writer}-{i}", True,
                                            "label"))
        threads = [threading.Thread(target=remember, args=(w,)) for w in "ab"]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        kept = qcr.Ledger(path).read()["projects"][self.project]
        self.assertEqual(len(kept), 80)


def visible(updates):
    """The thread a client shows: text runs joined, tool calls in their final state, plans."""
    thread, calls = [], {}
    for u in updates:
        kind = u["sessionUpdate"]
        if kind.endswith("_chunk"):
            if thread and thread[-1][0] == kind:
                thread[-1][1] += u["content"]["text"]
            else:
                thread.append([kind, u["content"]["text"]])
        elif kind == "tool_call":
            calls[u["toolCallId"]] = {k: v for k, v in u.items() if k != "sessionUpdate"}
            thread.append(["tool", u["toolCallId"]])
        elif kind == "tool_call_update":
            calls[u["toolCallId"]].update({k: v for k, v in u.items() if k != "sessionUpdate"})
        elif kind == "plan":
            thread.append(["plan", u["entries"]])
    return [[kind, calls[value] if kind == "tool" else value] for kind, value in thread]


class TestSessionsThatLast(AcpTestCase):
    def session_file(self, session_id):
        return os.path.join(self.home, ".qcr", "sessions", session_id + ".json")

    def reopen(self, method, session_id, **kw):
        agent = self.start(**kw)
        agent.call("initialize", {"protocolVersion": 1})
        response, updates, _ = agent.call(method, {"sessionId": session_id,
                                                   "cwd": self.project, "mcpServers": []})
        return agent, response, updates

    def test_load_after_restart_shows_what_was_seen_live(self):
        self.write("a.py", "x = 1\n")
        self.fake_model(
            [sse(completion_chunk({"reasoning_content": "Let me look."}))] +
            scripted_reply("Reading first.", calls=(("ReadFile", {"path": "a.py"}),)),
            calls(("EditFile", {"path": "a.py", "old_string": "1", "new_string": "2"})),
            calls(("WriteFile", {"path": "b.py", "content": "nope"})),
            calls(("TodoWrite", {"todos": [{"content": "Edit a.py", "status": "completed"}]})),
            scripted_reply("Done: **x is 2**."),
            scripted_reply("Second answer."))
        agent = self.start()
        session_id = self.new_session(agent)
        answers = [ALLOW, REJECT]
        _, live1, _ = self.prompt(agent, session_id, "set x to 2",
                                  answer=lambda frame: answers.pop(0))
        _, live2, _ = self.prompt(agent, session_id, "and then?")
        self.assertEqual(agent.close(), 0)
        live = ([{"sessionUpdate": "user_message_chunk",
                  "content": {"type": "text", "text": "set x to 2"}}] + live1 +
                [{"sessionUpdate": "user_message_chunk",
                  "content": {"type": "text", "text": "and then?"}}] + live2)
        agent, response, replay = self.reopen("session/load", session_id)
        self.assertResult(response)
        self.assertEqual(visible(replay), visible(live))
        self.assertEqual(replay[-1]["sessionUpdate"], "session_info_update")
        self.assertEqual(replay[-1]["title"], "set x to 2")
        statuses = [v["status"] for k, v in visible(replay) if k == "tool"]
        self.assertEqual(statuses, ["completed", "completed", "failed", "completed"])
        self.assertClean(agent)

    def test_list_resume_close_and_delete(self):
        self.fake_model(scripted_reply("one"), scripted_reply("two"), slow_reply(),
                        scripted_reply("three"))
        agent = self.start()
        response, _, _ = agent.call("initialize", {"protocolVersion": 1})
        self.assertEqual(response["result"]["agentCapabilities"]["sessionCapabilities"],
                         {"list": {}, "resume": {}, "close": {}, "delete": {},
                          "additionalDirectories": {}})
        first = self.new_session(agent)
        self.prompt(agent, first, "first session")
        other = os.path.join(self.tmp, "other")
        os.makedirs(other)
        second = self.new_session(agent, cwd=other)
        self.prompt(agent, second, "second session")
        response, _, _ = agent.call("session/list", {})
        listed = response["result"]["sessions"]
        self.assertEqual([s["sessionId"] for s in listed], [second, first])
        self.assertEqual(listed[1]["title"], "first session")
        self.assertEqual(listed[1]["cwd"], self.project)
        self.assertRegex(listed[1]["updatedAt"], r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")
        self.assertNotIn("nextCursor", response["result"])
        response, _, _ = agent.call("session/list", {"cwd": other})
        self.assertEqual([s["sessionId"] for s in response["result"]["sessions"]], [second])
        agent.close()

        agent, response, updates = self.reopen("session/resume", first)
        self.assertEqual(response["result"]["modes"]["currentModeId"], "default")
        self.assertEqual(updates, [])                       # resume does not replay
        self.assertEqual(agent.recv()["params"]["update"]["sessionUpdate"],
                         "available_commands_update")
        request_id = agent.request("session/prompt", {"sessionId": first, "prompt": [
            {"type": "text", "text": "slow one"}]})
        while agent.recv()["params"]["update"]["sessionUpdate"] != "agent_message_chunk":
            pass
        self.assertEqual(self.model.requests[-1]["messages"][1]["content"], "first session")
        close_id = agent.request("session/close", {"sessionId": first})
        response, _, _ = agent.wait(request_id)
        self.assertResult(response, {"stopReason": "cancelled"})
        response, _, _ = agent.wait(close_id)
        self.assertResult(response, {})
        response, _, _ = self.prompt(agent, first, "still there?")
        self.assertRpcError(response, qcr.RESOURCE_NOT_FOUND)
        response, replay, _ = agent.call("session/load", {"sessionId": first,
                                                          "cwd": self.project,
                                                          "mcpServers": []})
        self.assertIn("slow one", json.dumps(replay))     # closed, not forgotten

        response, _, _ = agent.call("session/delete", {"sessionId": first})
        self.assertResult(response, {})
        self.assertFalse(os.path.exists(self.session_file(first)))
        response, _, _ = agent.call("session/list", {})
        self.assertEqual([s["sessionId"] for s in response["result"]["sessions"]], [second])
        for method in ("session/delete", "session/resume"):
            response, _, _ = agent.call(method, {"sessionId": first, "cwd": self.project})
            self.assertRpcError(response, qcr.RESOURCE_NOT_FOUND)
        self.assertClean(agent)

    def test_list_pages_filters_and_refuses_bad_params(self):
        for i in range(60):
            session_id = f"acp-{i:016x}-{'a' * 16}"
            write_session_file(self.session_file(session_id), {
                "sessionId": session_id, "cwd": self.project if i % 2 else "/elsewhere",
                "title": f"session {i}", "updated": 1_700_000_000 + i},
                {"messages": [], "transcript": []})
        agent = self.start()
        response, _, _ = agent.call("session/list", {})
        page = response["result"]
        self.assertEqual(len(page["sessions"]), 50)
        self.assertEqual(page["sessions"][0]["title"], "session 59")
        response, _, _ = agent.call("session/list", {"cursor": page["nextCursor"]})
        self.assertEqual([s["title"] for s in response["result"]["sessions"]],
                         [f"session {i}" for i in range(9, -1, -1)])
        self.assertNotIn("nextCursor", response["result"])
        response, _, _ = agent.call("session/list", {"cwd": self.project})
        self.assertEqual(len(response["result"]["sessions"]), 30)
        for params, field_name in (({"cursor": "x"}, "cursor"), ({"cwd": "rel"}, "cwd")):
            response, _, _ = agent.call("session/list", params)
            self.assertRpcError(response, qcr.INVALID_PARAMS, field_name)

    def test_a_damaged_file_is_kept_skipped_by_list_and_told_in_the_thread(self):
        self.fake_model(scripted_reply("fine"))
        agent = self.start()
        session_id = self.new_session(agent)
        self.prompt(agent, session_id, "hello")
        agent.close()
        path = self.session_file(session_id)
        with open(path, "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(data[:-40])                      # truncated
        agent = self.start()
        response, _, _ = agent.call("session/list", {})
        self.assertEqual(response["result"]["sessions"], [])
        response, _, _ = agent.call("session/load", {"sessionId": session_id,
                                                     "cwd": self.project, "mcpServers": []})
        self.assertResult(response)
        notice = agent.recv()["params"]["update"]
        self.assertIn("could not be read (the file is truncated)", notice["content"]["text"])
        kept = [n for n in os.listdir(os.path.dirname(path)) if ".damaged-" in n]
        self.assertEqual(len(kept), 1)
        with open(os.path.join(os.path.dirname(path), kept[0]), "rb") as f:
            self.assertEqual(f.read(), data[:-40])   # nothing lost
        response, updates, _ = self.prompt(agent, session_id, "start again")
        self.assertEqual(text_of(updates), "fine")
        self.assertClean(agent)

    def test_usage_after_each_model_call(self):
        self.fake_model(calls(("LS", {})), scripted_reply("no usage here", usage=None))
        agent = self.start(env={"QCR_CONTEXT_WINDOW": "5000"})
        _, updates, _ = self.prompt(agent, self.new_session(agent), "hi")
        usage = [u for u in updates if u["sessionUpdate"] == "usage_update"]
        self.assertEqual(usage[0], {"sessionUpdate": "usage_update", "used": 120, "size": 5000})
        self.assertEqual(usage[1]["_meta"], {"estimated": True})
        self.assertGreater(usage[1]["used"], 100)
        self.model.close()
        for route, answer in (("/v1/models", {"data": [{"id": "test-model",
                                                         "max_model_len": 4096}]}),
                              ("/props", {"default_generation_settings": {"n_ctx": 8192}})):
            with self.subTest(route=route):
                self.fake_model(scripted_reply("ok"))
                self.model.routes[route] = answer
                agent = self.start()
                _, updates, _ = self.prompt(agent, self.new_session(agent), "hi")
                usage = [u for u in updates if u["sessionUpdate"] == "usage_update"]
                self.assertEqual(usage[0]["size"], 4096 if route == "/v1/models" else 8192)
                self.model.close()
        for model, size in (("gpt-4o", 128_000), ("qwen3-coder-plus", 262_144),
                            ("some-local-thing", qcr.DEFAULT_CONTEXT_WINDOW)):
            self.assertEqual(qcr.context_window(qcr.Config(), model), size)

    def test_compaction_when_the_window_fills_and_on_demand(self):
        def model(body):
            if body["messages"][0]["content"] == qcr.COMPACT_INSTRUCTIONS:
                return scripted_reply("SUMMARY: the user wants long answers.")
            said = [m["content"] for m in body["messages"] if m["role"] == "user"]
            if said[-1] == "first" and body["messages"][-1]["role"] == "user":
                return calls(("TodoWrite", {"todos": [{"content": "Keep me",
                                                       "status": "in_progress"}]}))
            return scripted_reply("word " * 800, usage=None)
        self.model = qcr.FakeModel(model)
        agent = self.start(env={"QCR_CONTEXT_WINDOW": "1000"})
        session_id = self.new_session(agent)
        self.prompt(agent, session_id, "first")
        _, updates, _ = self.prompt(agent, session_id, "second")
        compacted = [v for k, v in visible(updates) if k == "tool"]
        self.assertEqual(len(compacted), 1)
        card = compacted[0]
        self.assertEqual((card["title"], card["status"]), ("Compact the conversation",
                                                           "completed"))
        self.assertIn("SUMMARY: the user wants long answers.", card["content"][0]["content"]["text"])
        self.assertGreater(card["rawOutput"]["tokensBefore"], card["rawOutput"]["tokensAfter"])
        sent = self.model.requests[-1]["messages"]
        self.assertEqual([m["role"] for m in sent], ["system", "user"])
        self.assertTrue(sent[1]["content"].startswith(qcr.SUMMARY_INTRO))
        self.assertIn("[in_progress] Keep me", sent[1]["content"])     # the plan survives
        self.assertTrue(sent[1]["content"].endswith("second"))

        _, updates, _ = self.prompt(agent, session_id, "/compact keep the file names")
        self.assertIn("In the summary, also: keep the file names",
                      self.model.requests[-1]["messages"][1]["content"])
        self.assertEqual(kinds(updates)[:1], ["tool_call"])
        agent.close()
        agent, _, replay = self.reopen("session/load", session_id)   # the full history
        self.assertEqual(text_of(replay).count("word"), 1600)
        self.assertEqual(len([u for u in replay if u["sessionUpdate"] == "tool_call"]), 3)

    def test_sigkill_at_any_moment_leaves_a_loadable_file(self):
        self.fake_model(calls(("Think", {"thought": "step " * 200})))
        session_id = None
        for delay in (0.15, 0.3, 0.45, 0.6, 0.8):
            agent = self.start()
            if session_id is None:
                session_id = self.new_session(agent)
            else:
                agent.call("initialize", {"protocolVersion": 1})
                response, _, _ = agent.call("session/load", {
                    "sessionId": session_id, "cwd": self.project, "mcpServers": []})
                self.assertResult(response)
                after = agent.recv()["params"]["update"]     # a damaged file would be told
                self.assertEqual(after["sessionUpdate"], "available_commands_update")
            agent.request("session/prompt", {"sessionId": session_id, "prompt": [
                {"type": "text", "text": "think a lot"}]})
            time.sleep(delay)
            agent.proc.send_signal(signal.SIGKILL)
            agent.proc.wait()
            saved = read_session_file(self.session_file(session_id))
            self.assertGreater(len(saved["messages"]), 0)
        agent, response, replay = self.reopen("session/load", session_id)
        self.assertEqual(agent.recv()["params"]["update"]["sessionUpdate"],
                         "available_commands_update")
        self.assertEqual(sorted(os.listdir(os.path.dirname(self.session_file(session_id)))),
                         [session_id + ".json"])

    def test_a_long_session_keeps_its_file_bounded(self):
        """Past maxSessionChars the oldest replay goes (with a note saying so); the newest
        stays, and the file still loads."""
        self.fake_model(*[scripted_reply(f"answer {i} " + "z" * 5000) for i in range(10)])
        agent = self.start(env={"QCR_MAX_SESSION_CHARS": "40000"})
        session_id = self.new_session(agent)
        for i in range(10):
            self.prompt(agent, session_id, f"question {i}")
        agent.close()
        saved = read_session_file(self.session_file(session_id))
        self.assertLess(len(json.dumps(saved["transcript"])), 40000)
        agent, response, replay = self.reopen("session/load", session_id)
        said = text_of(replay)
        self.assertTrue(said.startswith("[the earlier part of this thread was not kept"), said[:80])
        self.assertIn("answer 9", said)
        self.assertNotIn("answer 0", said)

    def test_two_processes_write_their_own_sessions(self):
        self.fake_model(*[calls(("LS", {}))] * 6 + [scripted_reply("done")])
        one, two = self.start(), self.start()
        first, second = self.new_session(one), self.new_session(two)
        requests = [(one, one.request("session/prompt", {"sessionId": first, "prompt": [
                        {"type": "text", "text": "one"}]})),
                    (two, two.request("session/prompt", {"sessionId": second, "prompt": [
                        {"type": "text", "text": "two"}]}))]
        for agent, request_id in requests:
            response, _, _ = agent.wait(request_id)
            self.assertResult(response)
        for session_id, text in ((first, "one"), (second, "two")):
            saved = read_session_file(self.session_file(session_id))
            self.assertEqual(saved["messages"][0]["content"], text)
        response, _, _ = one.call("session/list", {})
        self.assertEqual(len(response["result"]["sessions"]), 2)


class TestUndo(AcpTestCase):
    """Every file change can be reverted: /undo, /undo N, /undo <tool call>."""

    def read(self, name):
        with open(os.path.join(self.project, name)) as f:
            return f.read()

    def test_every_kind_of_change_comes_back(self):
        self.write("a.txt", "one\n")
        self.write("b.txt", "keep me\n")
        self.write("c.txt", "moved\n")
        self.fake_model(calls(("WriteFile", {"path": "new.txt", "content": "fresh\n"}),
                              ("EditFile", {"path": "a.txt", "old_string": "one",
                                            "new_string": "two"}),
                              ("DeleteFile", {"path": "b.txt"}),
                              ("MoveFile", {"source": "c.txt", "destination": "sub/d.txt"})),
                        scripted_reply("done"))
        agent = self.start()
        session_id = self.new_session(agent)
        agent.call("session/set_mode", {"sessionId": session_id, "modeId": "yolo"})
        _, updates, _ = self.prompt(agent, session_id, "change things")
        cards = [u for u in updates if u["sessionUpdate"] == "tool_call_update"
                 and u.get("status") == "completed"]
        self.assertTrue(all(c["rawOutput"]["undo"].startswith("/undo call") for c in cards))
        self.assertEqual(self.read("a.txt"), "two\n")
        _, updates, _ = self.prompt(agent, session_id, "/undo 4")
        undone = [v for k, v in visible(updates) if k == "tool"]
        self.assertEqual([c["status"] for c in undone], ["completed"] * 4)
        self.assertTrue(all(c["title"].startswith("Undo: ") for c in undone))
        self.assertEqual(self.read("a.txt"), "one\n")
        self.assertEqual(self.read("b.txt"), "keep me\n")
        self.assertEqual(self.read("c.txt"), "moved\n")
        self.assertFalse(os.path.exists(os.path.join(self.project, "new.txt")))
        self.assertFalse(os.path.exists(os.path.join(self.project, "sub", "d.txt")))
        _, updates, _ = self.prompt(agent, session_id, "/undo")
        self.assertEqual(text_of(updates), "Nothing to undo.")
        self.assertClean(agent)

    def test_an_undo_that_now_leads_outside_asks(self):
        """The folder of a change swapped for a link out of the project since: undoing it
        would write there, so the user is asked again."""
        self.fake_model(calls(("WriteFile", {"path": "sub/f.txt", "content": "new\n"})),
                        scripted_reply("done"))
        agent = self.start()
        session_id = self.new_session(agent)
        agent.call("session/set_mode", {"sessionId": session_id, "modeId": "yolo"})
        self.prompt(agent, session_id, "write")
        outside = os.path.join(self.tmp, "elsewhere")
        os.makedirs(outside)
        with open(os.path.join(outside, "f.txt"), "w") as f:
            f.write("new\n")                      # what the change left, so no conflict
        shutil.rmtree(os.path.join(self.project, "sub"))
        os.symlink(outside, os.path.join(self.project, "sub"))
        _, updates, requests = self.prompt(agent, session_id, "/undo", answer=REJECT)
        self.assertEqual(len(requests), 1)
        self.assertIn(outside, json.dumps(requests[0]["params"]["toolCall"]["content"]))
        self.assertTrue(os.path.exists(os.path.join(outside, "f.txt")))
        self.assertEqual(list(final_status(updates).values()), ["failed"])

    def test_after_a_restart_by_tool_call_with_a_conflict_check(self):
        self.write("a.txt", "one\n")
        self.fake_model(calls(("EditFile", {"path": "a.txt", "old_string": "one",
                                            "new_string": "two"})), scripted_reply("done"))
        agent = self.start()
        session_id = self.new_session(agent)
        agent.call("session/set_mode", {"sessionId": session_id, "modeId": "auto-edit"})
        _, updates, _ = self.prompt(agent, session_id, "edit")
        call_id = [u for u in updates if u["sessionUpdate"] == "tool_call"][0]["toolCallId"]
        agent.close()
        self.write("a.txt", "two\nand the user's own line\n")     # changed since
        agent = self.start()
        agent.call("initialize", {"protocolVersion": 1})
        agent.call("session/load", {"sessionId": session_id, "cwd": self.project,
                                    "mcpServers": []})
        for answer, expected, status in ((REJECT, "two\nand the user's own line\n", "failed"),
                                         (ALLOW, "one\n", "completed")):
            with self.subTest(answer=answer):
                _, updates, requests = self.prompt(agent, session_id, f"/undo {call_id}",
                                                   answer=answer)
                self.assertEqual(len(requests), 1)
                shown = requests[0]["params"]["toolCall"]["content"]
                self.assertIn("has changed since", shown[0]["content"]["text"])
                self.assertEqual((shown[1]["oldText"], shown[1]["newText"]),
                                 ("two\nand the user's own line\n", "one\n"))
                self.assertEqual(self.read("a.txt"), expected)
                self.assertEqual(list(final_status(updates).values()), [status])
        self.prompt(agent, session_id, "and now?")
        self.assertIn("The user reverted a change of yours",
                      json.dumps(self.model.requests[-1]["messages"]))


class TestSlashCommands(AcpTestCase):
    def test_commands_are_announced_with_user_and_project_ones(self):
        os.makedirs(os.path.join(self.home, ".qcr", "commands"))
        with open(os.path.join(self.home, ".qcr", "commands", "explain.md"), "w") as f:
            f.write("# Explain the code\nExplain $ARGUMENTS simply.\n")
        self.write(".qcr/commands/review.md",
                   "---\ndescription: Review a file\nargument-hint: <path>\n---\n"
                   "Review $ARGUMENTS carefully.\n")
        self.write(".qcr/commands/mode.md", "A project cannot shadow a built-in.\n")
        agent = self.start()
        self.new_session(agent)
        commands = {c["name"]: c for c in self.commands["availableCommands"]}
        self.assertEqual(sorted(commands), ["compact", "effort", "explain", "init", "mode",
                                            "model", "permissions", "review", "undo"])
        self.assertEqual(commands["review"], {"name": "review", "description": "Review a file",
                                              "input": {"hint": "<path>"}})
        self.assertEqual(commands["explain"]["description"], "Explain the code")
        self.assertEqual(commands["mode"]["input"], {"hint": "default | plan | auto-edit | yolo"})

    def test_template_commands_unknown_words_and_a_changing_set(self):
        self.write(".qcr/commands/review.md", "Review $ARGUMENTS carefully.\n")
        self.fake_model(scripted_reply("ok"))
        agent = self.start()
        session_id = self.new_session(agent)
        self.prompt(agent, session_id, "/review src/a.py")
        self.assertEqual(self.model.requests[-1]["messages"][-1]["content"],
                         "Review src/a.py carefully.")
        self.prompt(agent, session_id, "/frobnicate now")
        self.assertEqual(self.model.requests[-1]["messages"][-1]["content"], "/frobnicate now")
        self.write(".qcr/commands/ship.md", "Ship it.\n")
        _, updates, _ = self.prompt(agent, session_id, "/ship")
        self.assertEqual(updates[0]["sessionUpdate"], "available_commands_update")
        self.assertIn("ship", [c["name"] for c in updates[0]["availableCommands"]])
        self.assertEqual(self.model.requests[-1]["messages"][-1]["content"], "Ship it.")
        agent.close()
        agent = self.start()
        agent.call("initialize", {"protocolVersion": 1})
        _, replay, _ = agent.call("session/load", {"sessionId": session_id,
                                                   "cwd": self.project, "mcpServers": []})
        said = [u["content"]["text"] for u in replay if u["sessionUpdate"] == "user_message_chunk"]
        self.assertEqual(said, ["/review src/a.py", "/frobnicate now", "/ship"])

    def test_mode_model_and_permissions(self):
        self.fake_model(calls(("WriteFile", {"path": "a.txt", "content": "1"})),
                        scripted_reply("written"), calls(("WriteFile", {"path": "b.txt",
                                                                        "content": "2"})),
                        scripted_reply("written again"))
        agent = self.start(env={"QCR_MODELS": "other-model"})
        session_id = self.new_session(agent)
        _, updates, _ = self.prompt(agent, session_id, "/mode plan")
        self.assertEqual(kinds(updates), ["current_mode_update", "config_option_update",
                                          "agent_message_chunk"])
        self.assertEqual(text_of(updates), "Mode: **plan**.")
        _, updates, _ = self.prompt(agent, session_id, "/mode sideways")
        self.assertIn("Choose one of: `default`, `plan`, `auto-edit`", text_of(updates))
        self.prompt(agent, session_id, "/mode default")
        _, updates, _ = self.prompt(agent, session_id, "/model other-model")
        options = {o["id"]: o for o in updates[0]["configOptions"]}
        self.assertEqual(options["model"]["currentValue"], "other-model")
        self.assertEqual(self.model.requests, [])          # none of that asked the model
        self.prompt(agent, session_id, "write a", answer=ALLOW_ALWAYS)
        self.assertEqual(self.model.requests[-1]["model"], "other-model")
        _, updates, _ = self.prompt(agent, session_id, "/permissions")
        self.assertIn("1. allow file changes for this session", text_of(updates))
        _, updates, _ = self.prompt(agent, session_id, "/permissions revoke 1")
        self.assertIn("Revoked: allow file changes for this session", text_of(updates))
        _, _, requests = self.prompt(agent, session_id, "write b")
        self.assertEqual(len(requests), 1)                 # it asks again

    def test_init_asks_the_model_to_write_qcr_md(self):
        self.fake_model(calls(("WriteFile", {"path": "QCR.md", "content": "# Notes\n"})),
                        scripted_reply("Wrote QCR.md."))
        agent = self.start()
        session_id = self.new_session(agent)
        self.prompt(agent, session_id, "/init focus on tests")
        self.assertEqual(self.read("QCR.md"), "# Notes\n")
        sent = self.model.requests[0]["messages"][-1]["content"]
        self.assertTrue(sent.startswith(qcr.INIT_PROMPT))
        self.assertTrue(sent.endswith("focus on tests"))
        self.prompt(agent, session_id, "/compact")        # two steps: something to summarise


# =============================================================================================
# 4. Provider: the model server, well and badly behaved
# =============================================================================================

class TestProvider(AcpTestCase):
    def test_a_hostile_model_server_is_held_to_bounds(self):
        """A reply too long, thousands of tool calls in one reply, arguments too large:
        each ends with a clear message (and a result for the model), the session stays
        small and usable."""
        self.write("a.txt", "x\n")
        flood = [sse(completion_chunk({"tool_calls": [{
            "index": i, "id": f"c{i}", "function": {"name": "ReadFile",
                                                   "arguments": '{"path": "a.txt"}'}}]}))
            for i in range(5000)]
        huge = [sse(completion_chunk({"tool_calls": [{"index": 0, "id": "big", "function": {
            "name": "WriteFile", "arguments": '{"path": "b.txt", "content": "'}}]}))] + [
            sse(completion_chunk({"tool_calls": [{"index": 0, "function": {
                "arguments": "y" * 100_000}}]})) for _ in range(60)]
        self.fake_model(flood + [sse(completion_chunk(finish="tool_calls")), sse(b"[DONE]")],
                        huge + [sse(completion_chunk(finish="tool_calls")), sse(b"[DONE]")],
                        [sse(completion_chunk({"content": "z" * 50_000})),
                         sse(completion_chunk({"content": "z" * 60_000})),
                         sse(completion_chunk(finish="stop")), sse(b"[DONE]")])
        agent = self.start(env={"QCR_MAX_REPLY_CHARS": "100000",
                                "QCR_MAX_TOOL_ARGUMENT_CHARS": "1000000"})
        session_id = self.new_session(agent)
        agent.call("session/set_mode", {"sessionId": session_id, "modeId": "yolo"})
        response, updates, _ = self.prompt(agent, session_id, "go", timeout=60)
        self.assertResult(response, {"stopReason": "end_turn"})
        cards = [u for u in updates if u["sessionUpdate"] == "tool_call"]
        self.assertEqual(len(cards), 64 + 1)                  # maxToolCalls, then the big one
        said = text_of(updates)
        self.assertIn("4936 tool calls of that reply were not run", said)
        self.assertIn("runs at most 64 from one reply", json.dumps(self.model.requests[1]))
        self.assertIn("maxToolArgumentChars", self.tool_messages(2)[-1])
        self.assertFalse(os.path.exists(os.path.join(self.project, "b.txt")))
        self.assertIn("[error] the model's reply passed 100,000 characters", said)
        self.assertLess(os.path.getsize(os.path.join(
            self.home, ".qcr", "sessions", session_id + ".json")), 1_000_000)
        self.model.respond = Script(scripted_reply("still here"))
        response, updates, _ = self.prompt(agent, session_id, "hello?")
        self.assertEqual(text_of(updates), "still here")

    def test_a_local_server_that_is_not_running_is_said_soon(self):
        """Connection refused on this machine (Ollama not started) is not retried for the
        whole budget (60 s here): the answer comes well inside this test's 15 s wait."""
        agent = self.start(env={"QCR_RETRY_BUDGET": "60"})     # 127.0.0.1:9: nobody there
        response, updates, _ = self.prompt(agent, self.new_session(agent), "hi", timeout=15)
        self.assertResult(response, {"stopReason": "end_turn"})
        said = text_of(updates)
        self.assertIn("[error] cannot reach the model server at http://127.0.0.1:9/v1", said)
        self.assertIn("retrying in", said)
        self.assertNotIn(" -- ", said.split("[error]")[0])      # the notes read cleanly

    def test_streaming_text_thoughts_and_request_shape(self):
        self.fake_model([sse(completion_chunk({"reasoning_content": "Hmm, "})),
                         sse(completion_chunk({"reasoning": "let me see."})),
                         sse(completion_chunk({"content": None})),
                         sse(completion_chunk({"content": "Hello"})),
                         sse(completion_chunk({"content": " there"}, finish="stop")),
                         sse(b"[DONE]")])
        agent = self.start(env={"QCR_API_KEY": "sk-test", "QCR_TEMPERATURE": "0.2"})
        session_id = self.new_session(agent)
        response, updates, _ = self.prompt(agent, session_id, "hi")
        self.assertResult(response, {"stopReason": "end_turn"})
        self.assertEqual(text_of(updates, "agent_thought_chunk"), "Hmm, let me see.")
        self.assertEqual(text_of(updates), "Hello there")
        body = self.model.requests[0]
        self.assertTrue(body["stream"])
        self.assertEqual(body["stream_options"], {"include_usage": True})
        self.assertEqual(body["model"], "test-model")
        self.assertEqual(body["temperature"], 0.2)
        self.assertEqual(body["messages"][0]["role"], "system")
        self.assertEqual(body["messages"][-1], {"role": "user", "content": "hi"})
        self.assertIn("ReadFile", [t["function"]["name"] for t in body["tools"]])
        self.assertClean(agent)

    def test_o_series_and_codex_models_get_no_sampling_params(self):
        for model, sent in (("o3-mini", False), ("openai/o1", False), ("gpt-5.2-codex", False),
                            ("gpt-4o", True), ("qwen3-coder", True)):
            with self.subTest(model=model):
                self.assertEqual(qcr.takes_sampling_params(model), sent)
        self.fake_model(scripted_reply("ok"))
        agent = self.start(env={"QCR_TEMPERATURE": "0.5"}, model="o4-mini")
        self.prompt(agent, self.new_session(agent), "hi")
        self.assertNotIn("temperature", self.model.requests[0])
        self.assertNotIn("top_p", self.model.requests[0])

    def test_tool_call_deltas_are_assembled(self):
        args = json.dumps({"path": "a.txt"})
        pieces = [args[i:i + 3] for i in range(0, len(args), 3)]
        stream = [sse(completion_chunk({"tool_calls": [{"index": 0, "id": "c1", "type":
                  "function", "function": {"name": "ReadFile", "arguments": ""}}]}))]
        stream += [sse(completion_chunk({"tool_calls": [{"index": 0, "function": {
            "arguments": p}}]})) for p in pieces]
        stream += [sse(completion_chunk({"tool_calls": [{"index": 1, "id": "c2", "function": {
            "name": "LS", "arguments": "{}"}}]}))]   # a second call, whole in one delta
        stream += [sse(completion_chunk(finish="tool_calls")), sse(b"[DONE]")]
        self.write("a.txt", "alpha\n")
        self.fake_model(stream, scripted_reply("done"))
        agent = self.start()
        response, updates, _ = self.prompt(agent, self.new_session(agent), "read")
        self.assertResult(response, {"stopReason": "end_turn"})
        self.assertEqual([u["title"] for u in updates if u["sessionUpdate"] == "tool_call"],
                         ["Read a.txt", "List ."])
        sent = self.model.requests[1]["messages"]
        self.assertEqual([c["id"] for c in sent[2]["tool_calls"]], ["c1", "c2"])
        self.assertEqual(sent[3], {"role": "tool", "tool_call_id": "c1",
                                   "content": "     1\talpha"})

    def test_a_server_that_ignores_stream_is_understood(self):
        whole = {"choices": [{"message": {"role": "assistant", "content": "Whole answer"},
                              "finish_reason": "stop"}]}

        class Whole(Script):
            pass
        self.model = qcr.FakeModel(lambda body: (200, whole))
        agent = self.start()
        response, updates, _ = self.prompt(agent, self.new_session(agent), "hi")
        self.assertResult(response, {"stopReason": "end_turn"})
        self.assertEqual(text_of(updates), "Whole answer")

    def test_stop_reasons(self):
        cases = [([sse(completion_chunk({"content": "cut"}, finish="length")), sse(b"[DONE]")],
                  "max_tokens"),
                 ([sse(completion_chunk({"content": ""}, finish="content_filter")),
                   sse(b"[DONE]")], "refusal")]
        for stream, reason in cases:
            with self.subTest(reason=reason):
                self.fake_model(stream)
                agent = self.start()
                response, _, _ = self.prompt(agent, self.new_session(agent), "hi")
                self.assertResult(response, {"stopReason": reason})
                self.model.close()

    def test_the_tool_loop_limit(self):
        self.fake_model(calls(("LS", {})))
        agent = self.start(env={"QCR_MAX_TURN_REQUESTS": "3"})
        response, updates, _ = self.prompt(agent, self.new_session(agent), "loop forever")
        self.assertResult(response, {"stopReason": "max_turn_requests"})
        self.assertEqual(len(self.model.requests), 3)
        self.assertEqual(kinds(updates).count("tool_call"), 3)

    def check_error_then_recovery(self, first, expected, env=None):
        self.fake_model(first, scripted_reply("Recovered."))
        agent = self.start(env=env)
        session_id = self.new_session(agent)
        response, updates, _ = self.prompt(agent, session_id, "hi")
        self.assertResult(response, {"stopReason": "end_turn"})
        message = text_of(updates)
        self.assertIn("[error]", message)
        self.assertIn(expected, message)
        response, updates, _ = self.prompt(agent, session_id, "again")
        self.assertResult(response, {"stopReason": "end_turn"})
        self.assertEqual(text_of(updates), "Recovered.")
        self.assertClean(agent)
        return message

    def test_http_500_is_reported_and_the_session_goes_on(self):
        self.check_error_then_recovery((500, {"error": {"message": "GPU on fire"}}),
                                       "HTTP 500: GPU on fire")

    def test_http_401_says_to_check_the_key(self):
        message = self.check_error_then_recovery((401, {"error": "bad key"}), "HTTP 401")
        self.assertIn("OPENAI_API_KEY", message)

    def test_a_stream_dropped_midway_is_reported(self):
        message = self.check_error_then_recovery(
            [sse(completion_chunk({"content": "Half an ans"})), "drop"], "connection dropped")
        self.assertTrue(message.startswith("Half an ans\n\n[error]"))
        self.assertEqual(self.model.requests[1]["messages"][2],
                         {"role": "assistant", "content": "Half an ans"})

    def test_a_malformed_stream_is_reported(self):
        self.check_error_then_recovery([b"data: {oops\n\n"], "malformed stream")

    def test_a_refused_connection_is_reported(self):
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]      # closed once the with ends: nothing listens
        agent = self.start(env={"QCR_BASE_URL": f"http://127.0.0.1:{port}/v1",
                                "QCR_MODEL": "m"})
        session_id = self.new_session(agent)
        for _ in range(2):
            response, updates, _ = self.prompt(agent, session_id, "hi")
            self.assertResult(response, {"stopReason": "end_turn"})
            self.assertIn("cannot reach the model server", text_of(updates))
        self.assertClean(agent)

    def test_no_model_anywhere_asks_the_editor_to_sign_in(self):
        agent = self.start(model=None)
        response, _, _ = agent.call("initialize", {"protocolVersion": 1})
        self.assertEqual([m["id"] for m in response["result"]["authMethods"]], ["reload"])
        response, _, _ = agent.call("initialize", {"protocolVersion": 1, "clientCapabilities": {
            "auth": {"terminal": True}}})
        methods = response["result"]["authMethods"]
        self.assertEqual(methods[0], {"id": "login", "type": "terminal", "args": ["--login"],
                                      "name": "Set up a model", "description": methods[0][
                                          "description"]})
        response, _, _ = agent.call("session/new", {"cwd": self.project, "mcpServers": []})
        self.assertRpcError(response, qcr.AUTH_REQUIRED, "--login")
        response, _, _ = agent.call("authenticate", {"methodId": "reload"})
        self.assertRpcError(response, qcr.AUTH_REQUIRED)
        self.fake_model(scripted_reply("Configured now."))
        os.makedirs(os.path.join(self.home, ".qcr"), exist_ok=True)
        with open(os.path.join(self.home, ".qcr", "config.json"), "w") as f:
            json.dump({"baseUrl": self.model.url, "model": "from-file"}, f)
        response, _, _ = agent.call("authenticate", {"methodId": "reload"})
        self.assertResult(response, {})
        response, updates, _ = self.prompt(agent, self.new_session(agent), "hi")
        self.assertEqual(text_of(updates), "Configured now.")
        response, _, _ = agent.call("authenticate", {"methodId": "bogus"})
        self.assertRpcError(response, qcr.INVALID_PARAMS, "methodId")

    def test_a_local_model_server_is_found_when_none_is_configured(self):
        self.fake_model(scripted_reply("Local answer."))
        self.model.routes["/v1/models"] = {"data": [{"id": "local-a"}, {"id": "local-b"}]}
        agent = self.start(model=None, env={
            "QCR_LOCAL_SERVERS": f"http://127.0.0.1:9/v1,{self.model.url}"})
        agent.call("initialize", {"protocolVersion": 1})
        response, _, _ = agent.call("session/new", {"cwd": self.project, "mcpServers": []})
        options = {o["id"]: o for o in response["result"]["configOptions"]}
        self.assertEqual(options["model"]["currentValue"], "local-a")
        self.assertEqual([o["value"] for o in options["model"]["options"]],
                         ["local-a", "local-b"])
        notice = agent.recv()["params"]["update"]
        self.assertIn(f"uses the model server it found at {self.model.url}",
                      notice["content"]["text"])
        session_id = response["result"]["sessionId"]
        agent.recv()                                   # the commands
        response, updates, _ = self.prompt(agent, session_id, "hi")
        self.assertEqual(text_of(updates), "Local answer.")
        self.assertEqual(self.model.requests[0]["model"], "local-a")


def anthropic_events(*events):
    """Anthropic's stream: an "event:" line naming each event, then its data."""
    return [f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events]


class TestProviderQuirks(AcpTestCase):
    """Streams as real servers send them, and servers that fail."""

    def test_busy_servers_are_retried_with_their_retry_after(self):
        self.fake_model((429, {"error": {"message": "slow down"}}),
                        (503, {"error": "overloaded"}), scripted_reply("Finally."))
        retry_after = []
        original = self.model.serve

        def serve(handler, body):       # the first answer carries Retry-After: 1
            if not retry_after:
                retry_after.append(True)
                data = b'{"error": {"message": "slow down"}}'
                handler.send_response(429)
                handler.send_header("Retry-After", "1")
                handler.send_header("Content-Length", str(len(data)))
                handler.end_headers()
                handler.wfile.write(data)
                return
            original(handler, body)
        self.model.serve = serve
        agent = self.start(env={"QCR_RETRY_BUDGET": "20"})
        response, updates, _ = self.prompt(agent, self.new_session(agent), "hi")
        self.assertResult(response, {"stopReason": "end_turn"})
        text = text_of(updates)
        self.assertIn("HTTP 429: slow down; retrying in 1 s", text)
        self.assertIn("HTTP 503", text)
        self.assertTrue(text.endswith("Finally."))
        self.assertEqual(len(self.model.requests), 4)

    def test_no_retry_once_the_reply_has_begun_and_none_past_the_budget(self):
        self.fake_model([sse(completion_chunk({"content": "Half"})), "drop"],
                        scripted_reply("never"))
        agent = self.start(env={"QCR_RETRY_BUDGET": "20"})
        response, updates, _ = self.prompt(agent, self.new_session(agent), "hi")
        self.assertIn("[error]", text_of(updates))
        self.assertEqual(len(self.model.requests), 1)
        self.model.close()
        self.fake_model((503, {"error": "down"}))
        agent = self.start(env={"QCR_RETRY_BUDGET": "2.5"})
        response, updates, _ = self.prompt(agent, self.new_session(agent), "hi")
        self.assertIn("[error] the model server answered HTTP 503", text_of(updates))
        self.assertLessEqual(len(self.model.requests), 3)

    def test_cancel_interrupts_the_wait_between_tries(self):
        self.fake_model((503, {"error": "down"}))
        original = self.model.serve

        def serve(handler, body):
            handler.send_response(503)
            handler.send_header("Retry-After", "30")
            handler.send_header("Content-Length", "2")
            handler.end_headers()
            handler.wfile.write(b"{}")
        self.model.serve = serve
        agent = self.start(env={"QCR_RETRY_BUDGET": "60"})
        session_id = self.new_session(agent)

        def cancel_on_note(update):
            if "retrying in 30 s" in json.dumps(update):
                agent.notify("session/cancel", {"sessionId": session_id})
        response, _, _ = self.prompt(agent, session_id, "hi", on_update=cancel_on_note,
                                     timeout=10)
        self.assertResult(response, {"stopReason": "cancelled"})

    def test_think_tags_become_thoughts_even_split_across_chunks(self):
        pieces = ["<thi", "nk>Let me ", "plan.</thi", "nk>The answer", " is 4."]
        self.fake_model([sse(completion_chunk({"content": p})) for p in pieces] +
                        [sse(completion_chunk(finish="stop")), sse(b"[DONE]")])
        agent = self.start()
        _, updates, _ = self.prompt(agent, self.new_session(agent), "2+2?")
        self.assertEqual(text_of(updates, "agent_thought_chunk"), "Let me plan.")
        self.assertEqual(text_of(updates), "The answer is 4.")

    def test_think_state_belongs_to_one_reply(self):
        """An unclosed <think> does not turn the next reply into thoughts; a reply that
        ends in "<" keeps it."""
        def reply(*pieces):
            return [sse(completion_chunk({"content": p})) for p in pieces] + \
                [sse(completion_chunk(finish="stop")), sse(b"[DONE]")]
        self.write("a.txt", "x\n")
        self.fake_model([sse(completion_chunk({"content": "<think>never closed"}))] +
                        calls(("ReadFile", {"path": "a.txt"})), reply("Plain answer, 1 <"))
        agent = self.start()
        _, updates, _ = self.prompt(agent, self.new_session(agent), "go")
        self.assertEqual(text_of(updates), "Plain answer, 1 <")

    def test_tool_call_shapes_of_real_servers(self):
        self.write("a.txt", "alpha\n")
        ollama = [sse(completion_chunk({"tool_calls": [{"function": {
            "name": "ReadFile", "arguments": {"path": "a.txt"}}}]})),   # whole, no id
            sse(completion_chunk(finish="tool_calls")), sse(b"[DONE]")]
        reused = [sse(completion_chunk({"tool_calls": [{"index": 0, "id": "x1", "function": {
            "name": "LS", "arguments": "{}"}}]})),
            sse(completion_chunk({"tool_calls": [{"index": 0, "id": "x2", "function": {
                "name": "ReadFile", "arguments": '{"path": '}}]})),
            sse(completion_chunk({"tool_calls": [{"index": 0, "function": {
                "arguments": '"a.txt'}}]})),      # and left unclosed: repaired
            sse(completion_chunk(finish="tool_calls"))]       # no [DONE], no usage
        self.fake_model(ollama, reused, scripted_reply("ok", usage=None))
        agent = self.start()
        _, updates, _ = self.prompt(agent, self.new_session(agent), "go")
        titles = [u["title"] for u in updates if u["sessionUpdate"] == "tool_call"]
        self.assertEqual(titles, ["Read a.txt", "List .", "Read a.txt"])
        self.assertEqual(list(final_status(updates).values()), ["completed"] * 3)
        sent = self.model.requests[2]["messages"]
        self.assertEqual(sent[4]["tool_calls"][1]["function"]["arguments"], '{"path": "a.txt"}')

    def test_reasoning_goes_back_only_where_configured(self):
        for env, sent in (({}, False), ({"QCR_SEND_REASONING": "true"}, True)):
            with self.subTest(env=env):
                self.fake_model([sse(completion_chunk({"reasoning_content": "hmm"}))] +
                                calls(("LS", {})), scripted_reply("ok"))
                agent = self.start(env=env)
                self.prompt(agent, self.new_session(agent), "go")
                assistant = self.model.requests[1]["messages"][2]
                self.assertEqual(assistant.get("reasoning_content") == "hmm", sent)
                self.model.close()

    def test_a_model_without_tool_calls_gets_the_text_protocol(self):
        self.write("a.txt", "alpha\n")
        answers = [scripted_reply("Let me read it.\n```tool\n{\"name\": \"ReadFile\", "
                                  "\"arguments\": {\"path\": \"a.txt\"}}\n```\n"),
                   scripted_reply("It says alpha.")]

        def model(body):
            if "tools" in body:
                return (400, {"error": {"message": "model gemma:2b does not support tools"}})
            return answers.pop(0)
        self.model = qcr.FakeModel(model)
        agent = self.start()
        response, updates, _ = self.prompt(agent, self.new_session(agent), "what is in a.txt?")
        self.assertResult(response, {"stopReason": "end_turn"})
        self.assertIn("[note] test-model does not take tool definitions", text_of(updates))
        self.assertEqual([u["title"] for u in updates if u["sessionUpdate"] == "tool_call"],
                         ["Read a.txt"])
        last = self.model.requests[-1]
        self.assertNotIn("tools", last)
        self.assertIn("To use a tool, write a fenced block tagged `tool`",
                      last["messages"][0]["content"])
        self.assertEqual([m["role"] for m in last["messages"]],
                         ["system", "user", "assistant", "user"])
        self.assertEqual(last["messages"][3]["content"], "[tool result]\n     1\talpha")
        self.assertTrue(text_of(updates).endswith("It says alpha."))

    def test_only_the_servers_own_words_switch_to_the_text_protocol(self):
        """llama.cpp without --jinja says so with a 500; a 400 about something else (with
        qcr's hint about tools appended to it) must not switch anything."""
        for status, message, switched in (
                (500, "tools param requires --jinja flag", True),
                (400, "the prompt is not valid", False),
                (400, "messages: unexpected role", False)):
            with self.subTest(message=message):
                def model(body):
                    if "tools" in body:
                        return (status, {"error": {"message": message}})
                    return scripted_reply("fine")
                self.model = qcr.FakeModel(model)
                agent = self.start()
                _, updates, _ = self.prompt(agent, self.new_session(agent), "hi")
                self.assertEqual("does not take tool definitions" in text_of(updates),
                                 switched, text_of(updates))
                agent.close()
                self.model.close()
        self.model = None

    def test_anthropic_messages_api(self):
        tool_use = [
            {"type": "message_start", "message": {"usage": {"input_tokens": 50}}},
            {"type": "content_block_start", "index": 0,
             "content_block": {"type": "thinking", "thinking": ""}},
            {"type": "content_block_delta", "index": 0,
             "delta": {"type": "thinking_delta", "thinking": "Read it first."}},
            {"type": "content_block_delta", "index": 0,
             "delta": {"type": "signature_delta", "signature": "sig-123"}},
            {"type": "content_block_stop", "index": 0},
            {"type": "content_block_start", "index": 1,
             "content_block": {"type": "text", "text": ""}},
            {"type": "content_block_delta", "index": 1,
             "delta": {"type": "text_delta", "text": "Reading."}},
            {"type": "content_block_start", "index": 2,
             "content_block": {"type": "tool_use", "id": "toolu_1", "name": "ReadFile",
                               "input": {}}},
            {"type": "content_block_delta", "index": 2,
             "delta": {"type": "input_json_delta", "partial_json": '{"path": "a'}},
            {"type": "content_block_delta", "index": 2,
             "delta": {"type": "input_json_delta", "partial_json": '.txt"}'}},
            {"type": "message_delta", "delta": {"stop_reason": "tool_use"},
             "usage": {"output_tokens": 20}},
            {"type": "message_stop"}]
        answer = [{"type": "message_start", "message": {"usage": {"input_tokens": 90}}},
                  {"type": "content_block_start", "index": 0,
                   "content_block": {"type": "text", "text": ""}},
                  {"type": "content_block_delta", "index": 0,
                   "delta": {"type": "text_delta", "text": "It says alpha."}},
                  {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                   "usage": {"output_tokens": 5}},
                  {"type": "message_stop"}]
        self.write("a.txt", "alpha\n")
        self.fake_model(anthropic_events(*tool_use), anthropic_events(*answer))
        agent = self.start(model=None, env={"ANTHROPIC_API_KEY": "sk-ant-test",
                                            "ANTHROPIC_BASE_URL": self.model.url,
                                            "ANTHROPIC_MODEL": "claude-test"})
        response, updates, _ = self.prompt(agent, self.new_session(agent), "what is in a.txt?")
        self.assertResult(response, {"stopReason": "end_turn"})
        self.assertEqual(text_of(updates, "agent_thought_chunk"), "Read it first.")
        self.assertEqual(text_of(updates), "Reading.It says alpha.")
        usage = [u for u in updates if u["sessionUpdate"] == "usage_update"]
        self.assertEqual(usage[0]["used"], 70)
        path, headers = self.model.seen[0]
        self.assertEqual(path, "/v1/messages")
        self.assertEqual((headers["x-api-key"], headers["anthropic-version"]),
                         ("sk-ant-test", "2023-06-01"))
        first = self.model.requests[0]
        self.assertEqual(first["model"], "claude-test")
        self.assertIn("You are qcr", first["system"])
        self.assertEqual(first["messages"], [{"role": "user", "content": [
            {"type": "text", "text": "what is in a.txt?"}]}])
        self.assertIn("input_schema", first["tools"][0])
        second = self.model.requests[1]["messages"]
        self.assertEqual(second[1], {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Read it first.", "signature": "sig-123"},
            {"type": "text", "text": "Reading."},
            {"type": "tool_use", "id": "toolu_1", "name": "ReadFile",
             "input": {"path": "a.txt"}}]})
        self.assertEqual(second[2], {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "     1\talpha"}]})

    def test_anthropic_stop_reasons_and_errors(self):
        for stop, reason in (("max_tokens", "max_tokens"), ("refusal", "refusal")):
            with self.subTest(stop=stop):
                self.fake_model(anthropic_events(
                    {"type": "message_start", "message": {"usage": {"input_tokens": 1}}},
                    {"type": "message_delta", "delta": {"stop_reason": stop}, "usage": {}},
                    {"type": "message_stop"}))
                agent = self.start(model=None, env={"ANTHROPIC_API_KEY": "k",
                                                    "ANTHROPIC_BASE_URL": self.model.url})
                response, _, _ = self.prompt(agent, self.new_session(agent), "hi")
                self.assertResult(response, {"stopReason": reason})
                self.assertEqual(self.model.requests[0]["model"], qcr.DEFAULT_ANTHROPIC_MODEL)
                self.model.close()
        self.fake_model(anthropic_events({"type": "error", "error": {
            "type": "invalid_request_error", "message": "prompt is too long"}}))
        agent = self.start(model=None, env={"ANTHROPIC_API_KEY": "k",
                                            "ANTHROPIC_BASE_URL": self.model.url})
        _, updates, _ = self.prompt(agent, self.new_session(agent), "hi")
        self.assertIn("[error] the model server reported an error mid-stream: prompt is too long",
                      text_of(updates))


# =============================================================================================
# 5. Tools
# =============================================================================================

class TestTools(AcpTestCase):
    def run_tool(self, name, args, answer=ALLOW, env=None, mode=None):
        """Let the model call one tool: (status, result the model got, updates, requests)."""
        self.fake_model(calls((name, args)), scripted_reply("ok"))
        agent = self.start(env=env)
        session_id = self.new_session(agent)
        if mode:
            agent.call("session/set_mode", {"sessionId": session_id, "modeId": mode})
        response, updates, requests = self.prompt(agent, session_id, "do it", answer=answer)
        self.assertResult(response, {"stopReason": "end_turn"})
        self.assertClean(agent)
        status = list(final_status(updates).values())
        self.assertEqual(len(status), 1, updates)
        self.model.close()
        self.all_updates = updates
        return status[0], self.tool_messages(1)[0], tool_updates(updates), requests

    def test_tool_call_lifecycle_for_an_edit(self):
        path = self.write("src/app.py", "def f():\n    return 1\n")
        status, result, updates, requests = self.run_tool(
            "EditFile", {"path": "src/app.py", "old_string": "return 1",
                         "new_string": "return 2"})
        self.assertEqual(status, "completed")
        self.assertEqual(self.read("src/app.py"), "def f():\n    return 2\n")
        self.assertIn("replaced 1 occurrence", result)
        tool = updates
        self.assertEqual([(u["sessionUpdate"], u.get("status")) for u in tool],
                         [("tool_call", "pending"), ("tool_call_update", "in_progress"),
                          ("tool_call_update", "completed")])
        first = tool[0]
        self.assertEqual((first["title"], first["kind"]), ("Edit src/app.py", "edit"))
        self.assertEqual(first["locations"], [{"path": path}])
        self.assertEqual(first["rawInput"]["new_string"], "return 2")
        diff = {"type": "diff", "path": path, "oldText": "def f():\n    return 1\n",
                "newText": "def f():\n    return 2\n"}
        self.assertEqual(tool[-1]["content"], [diff])
        self.assertEqual(tool[-1]["locations"], [{"path": path, "line": 2}])
        self.assertEqual(len(requests), 1)
        permission = requests[0]
        self.assertEqual(permission["method"], "session/request_permission")
        self.assertEqual(permission["params"]["toolCall"]["content"], [diff])
        self.assertEqual([(o["optionId"], o["kind"]) for o in permission["params"]["options"]],
                         [("allow_once", "allow_once"), ("allow_session", "allow_always"),
                          ("allow_project", "allow_always"), ("allow_global", "allow_always"),
                          ("reject_once", "reject_once"), ("reject_session", "reject_always"),
                          ("reject_project", "reject_always")])
        # the permission request comes after the announcement, before in_progress
        self.assertEqual(permission["params"]["toolCall"]["toolCallId"], first["toolCallId"])

    def test_edit_failures_tell_the_model_what_to_do(self):
        self.write("a.py", "x = 1\nx = 1\n")
        cases = [({"path": "a.py", "old_string": "y = 1", "new_string": "z"}, "not found"),
                 ({"path": "a.py", "old_string": "x = 1", "new_string": "x = 2"},
                  "occurs 2 times"),
                 ({"path": "nope.py", "old_string": "a", "new_string": "b"}, "WriteFile"),
                 ({"path": "a.py", "old_string": "x", "new_string": "x"}, "the same"),
                 ({"path": "a.py", "old_string": "x"}, "missing required argument 'new_string'"),
                 ({"path": "a.py", "old_string": 5, "new_string": "b"}, "must be a string")]
        for args, expected in cases:
            with self.subTest(args=args):
                status, result, _, requests = self.run_tool("EditFile", args)
                self.assertEqual(status, "failed")
                self.assertIn(expected, result)
                self.assertEqual(requests, [])      # nothing to approve: it failed first
        self.assertEqual(self.read("a.py"), "x = 1\nx = 1\n")

    def test_edit_replace_all_and_crlf_and_create(self):
        self.write("a.txt", "one\r\ntwo\r\none\r\n")
        status, result, _, _ = self.run_tool("EditFile", {
            "path": "a.txt", "old_string": "one\ntwo", "new_string": "1\n2"})
        self.assertEqual(status, "completed", result)
        self.assertEqual(self.read("a.txt"), "1\r\n2\r\none\r\n")
        status, _, _, _ = self.run_tool("EditFile", {
            "path": "a.txt", "old_string": "\r\n", "new_string": "\n", "replace_all": "true"})
        self.assertEqual(self.read("a.txt"), "1\n2\none\n")
        status, _, _, _ = self.run_tool("EditFile", {
            "path": "new/b.txt", "old_string": "", "new_string": "fresh\n"})
        self.assertEqual((status, self.read("new/b.txt")), ("completed", "fresh\n"))

    def test_a_file_too_large_to_hold_is_paged_in_bounded_memory(self):
        """A 96 MiB log of one line: ReadFile shows its head, and qcr's memory stays far
        below the file's size (it is read in blocks, never whole)."""
        with open(os.path.join(self.project, "huge.log"), "wb") as f:
            for _ in range(96):
                f.write(b"y" * (1 << 20))
        self.fake_model(calls(("ReadFile", {"path": "huge.log"})), scripted_reply("ok"))
        agent = self.start()
        self.prompt(agent, self.new_session(agent), "read it", timeout=60)
        with open(f"/proc/{agent.proc.pid}/status") as f:
            peak = [int(line.split()[1]) for line in f if line.startswith("VmHWM")][0] // 1024
        result = self.tool_messages(1)[0]
        self.assertTrue(result.startswith("     1\t" + "y" * 100), result[:40])
        self.assertIn("[line cut]", result)
        self.assertLess(peak, 80, "MiB at peak")

    def test_write_delete_and_move(self):
        status, result, updates, _ = self.run_tool("WriteFile", {"path": "d/n.txt",
                                                                 "content": "hi\n"})
        self.assertEqual((status, self.read("d/n.txt")), ("completed", "hi\n"))
        self.assertIsNone(updates[-1]["content"][0]["oldText"])
        status, result, _, _ = self.run_tool("MoveFile", {"source": "d/n.txt",
                                                          "destination": "e/m.txt"})
        self.assertEqual(status, "completed", result)
        self.assertEqual(self.read("e/m.txt"), "hi\n")
        self.assertFalse(os.path.exists(os.path.join(self.project, "d/n.txt")))
        status, _, updates, _ = self.run_tool("DeleteFile", {"path": "e/m.txt"})
        self.assertEqual(status, "completed")
        self.assertFalse(os.path.exists(os.path.join(self.project, "e/m.txt")))
        self.assertEqual(updates[0]["kind"], "delete")
        for name, args, expected in (("DeleteFile", {"path": "e"}, "is a directory"),
                                     ("DeleteFile", {"path": "zz"}, "no such file"),
                                     ("MoveFile", {"source": "zz", "destination": "y"},
                                      "no such file")):
            with self.subTest(name=name, args=args):
                status, result, _, _ = self.run_tool(name, args)
                self.assertEqual(status, "failed")
                self.assertIn(expected, result)

    def test_read_file_pages_binary_and_missing(self):
        self.write("long.txt", "".join(f"line {i}\n" for i in range(1, 3001)))
        status, result, updates, requests = self.run_tool("ReadFile", {"path": "long.txt"})
        self.assertEqual(status, "completed")
        self.assertEqual(requests, [])
        self.assertTrue(result.startswith("     1\tline 1\n"))
        self.assertIn("[lines 1-2000 of 3000; read on with offset=2001]", result)
        status, result, updates, _ = self.run_tool("ReadFile", {"path": "long.txt",
                                                                "offset": "2999", "limit": 5})
        self.assertEqual(result, "  2999\tline 2999\n  3000\tline 3000")
        self.assertEqual(updates[-1]["locations"],
                         [{"path": os.path.join(self.project, "long.txt"), "line": 2999}])
        with open(os.path.join(self.project, "blob.bin"), "wb") as f:
            f.write(b"\x00\x01\x02" * 100)
        status, result, _, _ = self.run_tool("ReadFile", {"path": "blob.bin"})
        self.assertIn("binary file (300 bytes)", result)
        status, result, _, _ = self.run_tool("ReadFile", {"path": "missing.txt"})
        self.assertEqual(status, "failed")
        self.assertIn("no such file", result)

    def test_search_tools_skip_git_and_ignored_files(self):
        self.write("src/main.py", "import os\nTODO = 'find me'\n")
        self.write("src/lib/util.py", "def todo():\n    pass\n")
        self.write("build/out.py", "TODO = 'ignored'\n")
        self.write(".gitignore", "build/\n")
        self.write("README.md", "todo list\n")
        os.makedirs(os.path.join(self.project, ".git"))
        self.write(".git/config.py", "TODO = 'git internals'\n")
        status, result, _, _ = self.run_tool("Glob", {"pattern": "**/*.py"})
        self.assertEqual(result.splitlines(), ["src/lib/util.py", "src/main.py"])
        status, result, _, _ = self.run_tool("Glob", {"pattern": "*.md"})
        self.assertEqual(result, "README.md")
        status, result, updates, _ = self.run_tool("Grep", {"pattern": "todo",
                                                            "ignore_case": True})
        self.assertEqual(result.splitlines(), ["README.md:1: todo list",
                                               "src/lib/util.py:1: def todo():",
                                               "src/main.py:2: TODO = 'find me'"])
        self.assertEqual(updates[-1]["locations"][0],
                         {"path": os.path.join(self.project, "README.md"), "line": 1})
        status, result, _, _ = self.run_tool("Grep", {"pattern": "TODO", "glob": "*.py"})
        self.assertEqual(result, "src/main.py:2: TODO = 'find me'")
        status, result, _, _ = self.run_tool("Grep", {"pattern": "(unclosed"})
        self.assertEqual(status, "failed")
        self.assertIn("invalid regular expression", result)
        status, result, _, _ = self.run_tool("LS", {"path": "src"})
        self.assertEqual(result.splitlines(), ["lib/", "main.py  (27 bytes)"])

    def test_search_inside_a_git_repository_uses_git(self):
        if shutil.which("git") is None:
            self.skipTest("git is not installed")
        self.write("keep.py", "needle\n")
        self.write("logs/debug.log", "needle\n")
        self.write(".gitignore", "*.log\n")
        subprocess.run(["git", "init", "-q", self.project], check=True)
        status, result, _, _ = self.run_tool("Grep", {"pattern": "needle"})
        self.assertEqual(result, "keep.py:1: needle")

    def test_shell_output_exit_code_and_timeout(self):
        status, result, updates, requests = self.run_tool(
            "Shell", {"command": "echo out; echo err >&2; pwd; exit 3"})
        self.assertEqual(status, "completed")
        self.assertEqual(result, f"out\nerr\n{self.project}\n[exit code 3]")
        self.assertEqual(updates[0]["title"], "echo out; echo err >&2; pwd; exit 3")
        self.assertEqual(updates[0]["kind"], "execute")
        self.assertIn("echo out", json.dumps(requests[0]["params"]["toolCall"]))
        status, result, _, _ = self.run_tool("Shell", {"command": "echo start; sleep 30",
                                                       "timeout": 1})
        self.assertIn("start", result)
        self.assertIn("[timed out after 1s; the command was killed]", result)
        status, result, _, _ = self.run_tool("Shell", {"command": "yes | head -c 100000"})
        self.assertIn("bytes of output omitted", result)
        self.assertLess(len(result), qcr.SHELL_OUTPUT_CHARS + 200)

    def test_think_and_todo_write(self):
        status, result, updates, requests = self.run_tool("Think", {"thought": "Plan first."})
        self.assertEqual((status, updates[0]["kind"], requests), ("completed", "think", []))
        status, result, updates, _ = self.run_tool("TodoWrite", {"todos": [
            {"content": "a", "status": "completed"},
            {"content": "b", "status": "in_progress", "priority": "high"},
            {"content": "c", "status": "todo", "priority": "urgent"}]})
        plans = [u for u in self.all_updates if u["sessionUpdate"] == "plan"]
        self.assertEqual(plans[0]["entries"], [
            {"content": "a", "status": "completed", "priority": "medium"},
            {"content": "b", "status": "in_progress", "priority": "high"},
            {"content": "c", "status": "pending", "priority": "medium"}])
        self.assertIn("1 pending, 1 in progress, 1 completed", result)
        status, result, _, _ = self.run_tool("TodoWrite", {"todos": [{"status": "x"}]})
        self.assertEqual(status, "failed")

    def test_files_that_would_block_are_refused(self):
        os.mkfifo(os.path.join(self.project, "pipe"))
        for name, args in (("ReadFile", {"path": "pipe"}), ("EditFile", {
                "path": "pipe", "old_string": "a", "new_string": "b"})):
            with self.subTest(tool=name):
                status, result, _, _ = self.run_tool(name, args)
                self.assertEqual(status, "failed")
                self.assertIn("not a regular file", result)

    def test_an_empty_file_can_be_filled_with_edit(self):
        self.write("empty.txt", "")
        status, result, updates, _ = self.run_tool("EditFile", {
            "path": "empty.txt", "old_string": "", "new_string": "now full\n"})
        self.assertEqual((status, self.read("empty.txt")), ("completed", "now full\n"))
        self.assertEqual(updates[-1]["content"][0]["oldText"], "")

    def test_a_bad_glob_is_a_failed_result(self):
        status, result, _, _ = self.run_tool("Glob", {"pattern": "[z-a]"})
        self.assertEqual(status, "failed")
        self.assertIn("invalid glob pattern", result)

    def test_a_background_child_does_not_hold_the_shell_tool(self):
        status, result, _, _ = self.run_tool("Shell", {"command": "sleep 30 & echo bg"})
        self.assertEqual(result, "bg\n[exit code 0]")

    def test_approving_a_compound_command_always_covers_that_command_only(self):
        self.fake_model(calls(("Shell", {"command": "printf a; printf b"})),
                        calls(("Shell", {"command": "printf a; printf b"})),
                        calls(("Shell", {"command": "printf a; touch pwned"})),
                        scripted_reply("ok"))
        agent = self.start()
        answers = [ALLOW_ALWAYS, REJECT]
        _, _, requests = self.prompt(agent, self.new_session(agent), "go",
                                     answer=lambda frame: answers.pop(0))
        self.assertEqual(len(requests), 2)       # the same command again was not asked
        self.assertIn("Allow this exact command for this session",
                      [o["name"] for o in requests[0]["params"]["options"]])
        self.assertFalse(os.path.exists(os.path.join(self.project, "pwned")))

    @unittest.skipUnless(shutil.which("rg"), "ripgrep is not installed (.ci/run installs it)")
    def test_ripgrep_and_the_python_search_find_the_same(self):
        """Grep uses ripgrep when it is installed: the same files, the same hits."""
        self.write(".gitignore", "build/\n")
        self.write("src/a.py", "needle = 1\nx = 'Needle'\n")
        self.write("src/.hidden.py", "needle hidden\n")
        self.write("build/out.py", "needle ignored\n")
        self.write("docs/n.md", "a needle in the docs\n")
        with open(os.path.join(self.project, "bin.dat"), "wb") as f:
            f.write(b"needle\0\0binary")
        with open(os.path.join(self.project, "big.txt"), "w") as f:
            f.write("needle\n" + "x" * (9 << 20))
        results = {}
        for engine, path in (("rg", os.environ["PATH"]),
                             ("python", os.pathsep.join(
                                 p for p in os.environ["PATH"].split(os.pathsep)
                                 if not os.path.exists(os.path.join(p, "rg"))))):
            self.fake_model(calls(("Grep", {"pattern": "needle", "ignore_case": True})),
                            calls(("Grep", {"pattern": "needle", "glob": "*.py"})),
                            scripted_reply("ok"))
            agent = self.start(env={"PATH": path})
            self.prompt(agent, self.new_session(agent), "find")
            results[engine] = (self.tool_messages(1), self.tool_messages(2)[-1])
            self.model.close()
        self.assertEqual(results["rg"], results["python"])
        self.assertEqual(results["rg"][0][0].splitlines(), [
            "docs/n.md:1: a needle in the docs", "src/.hidden.py:1: needle hidden",
            "src/a.py:1: needle = 1", "src/a.py:2: x = 'Needle'"])

    def test_a_runaway_regex_cannot_freeze_the_agent(self):
        self.write("redos.txt", "a" * 60 + "b\n")
        # (a lookbehind: ripgrep, when installed, cannot take it, so Python's re runs it)
        self.fake_model(calls(("Grep", {"pattern": "(?<!x)(a+)+$", "path": "redos.txt"})),
                        scripted_reply("ok"))
        agent = self.start()
        session_id = self.new_session(agent)
        request_id = agent.request("session/prompt", {"sessionId": session_id, "prompt": [
            {"type": "text", "text": "search"}]})
        while agent.recv().get("params", {}).get("update", {}).get("status") != "in_progress":
            pass
        deadline = time.monotonic() + 10
        while not agent_children(agent.proc.pid, "--search-worker"):
            self.assertLess(time.monotonic(), deadline, "no search worker started")
            time.sleep(0.05)
        response, _, _ = agent.call("session/set_mode", {"sessionId": session_id,
                                                         "modeId": "plan"})
        self.assertResult(response, {})          # the loop still answers
        agent.notify("session/cancel", {"sessionId": session_id})
        response, _, _ = agent.wait(request_id)
        self.assertResult(response, {"stopReason": "cancelled"})
        deadline = time.monotonic() + 5
        while agent_children(agent.proc.pid, "--search-worker"):
            self.assertLess(time.monotonic(), deadline, "the search worker survived")
            time.sleep(0.05)

    def test_bad_calls_are_failed_results_the_model_can_read(self):
        self.fake_model(scripted_reply(calls=(("Teleport", {}),)), scripted_reply("ok"))
        agent = self.start()
        self.prompt(agent, self.new_session(agent), "go")
        self.assertIn("there is no tool named 'Teleport'", self.tool_messages(1)[0])
        stream = [sse(completion_chunk({"tool_calls": [{"index": 0, "id": "c1", "function": {
            "name": "ReadFile", "arguments": '{"path": "a", oops}'}}]})),
            sse(completion_chunk(finish="tool_calls")), sse(b"[DONE]")]
        self.fake_model(stream, scripted_reply("ok"))
        agent = self.start()
        response, updates, _ = self.prompt(agent, self.new_session(agent), "go")
        self.assertResult(response, {"stopReason": "end_turn"})
        self.assertIn("not valid JSON", self.tool_messages(1)[0])
        self.assertEqual(list(final_status(updates).values()), ["failed"])
        self.assertClean(agent)
        self.fake_model(calls(("ReadFile", {"path": float("nan")})), scripted_reply("ok"))
        agent = self.start()
        response, updates, _ = self.prompt(agent, self.new_session(agent), "go")
        self.assertIn("not valid JSON", self.tool_messages(1)[0])
        self.assertClean(agent)       # no NaN was echoed in rawInput


class TestWebTools(AcpTestCase):
    PAGE = (b"<!DOCTYPE html><html><head><title>Release notes</title><style>p{}</style>"
            b"<script>alert(1)</script></head><body><h1>Version 2</h1><p>Faster <b>and</b> "
            b"safer.</p><ul><li>See <a href='/docs/start'>the guide</a></li></ul></body></html>")

    def serve_page(self, routes):
        server = qcr.FakeModel(lambda body: (200, {}))
        server.routes.update(routes)
        self.addCleanup(server.close)
        self.site = server
        return server.url.rsplit("/v1", 1)[0]

    def test_web_fetch_reads_pages_and_refuses_what_it_should(self):
        site = self.serve_page({
            "/notes": (200, {"Content-Type": "text/html; charset=utf-8"}, self.PAGE),
            "/moved": (302, {"Location": "/notes"}, b""),
            "/sneaky": (302, {"Location": "file:///etc/passwd"}, b""),
            "/ftp": (302, {"Location": "ftp://example.com/x"}, b""),
            "/loop": (302, {"Location": "/loop"}, b""),
            "/blob": (200, {"Content-Type": "application/octet-stream"}, b"\0\1\2" * 10)})
        status, result, updates, _ = self.run_web("WebFetch", {"url": site + "/moved"})
        self.assertEqual(status, "completed")
        self.assertEqual(result, f"{site}/notes\n\n# Release notes\n\n# Version 2\n\n"
                                 f"Faster and safer.\n\n- See [the guide]({site}/docs/start)")
        self.assertEqual(updates[0]["kind"], "fetch")
        for url, expected in ((site + "/sneaky", "which is not http(s)"),
                              (site + "/ftp", "which is not http(s)"),
                              (site + "/loop", "more than 5 redirects"),
                              (site + "/blob", "is not text"),
                              ("file:///etc/passwd", "only http and https"),
                              ("http://127.0.0.1:9/", "is this machine offline?")):
            with self.subTest(url=url):
                status, result, _, _ = self.run_web("WebFetch", {"url": url})
                self.assertEqual(status, "failed")
                self.assertIn(expected, result)

    def run_web(self, name, args, env=None):
        self.fake_model(calls((name, args)), scripted_reply("ok"))
        agent = self.start(env=env)
        _, updates, _ = self.prompt(agent, self.new_session(agent), "go")
        self.model.close()
        status = list(final_status(updates).values())
        return status[0], self.tool_messages(1)[0], tool_updates(updates), self.model.requests

    def test_web_search_backends(self):
        site = self.serve_page({
            "/search": {"results": [{"title": "ACP", "url": "https://acp.example/",
                                     "content": "The protocol."}]},
            "/brave": {"web": {"results": [{"title": "Brave hit", "url": "https://b.example/",
                                            "description": "From Brave."}]}},
            "/ddg": (200, {"Content-Type": "text/html"},
                     b'<a rel="nofollow" class="result__a" href="//duckduckgo.com/l/?uddg='
                     b'https%3A%2F%2Fd.example%2Fpage&amp;rut=x">Duck <b>hit</b></a>'
                     b'<a class="result__snippet" href="#">Keyless &amp; free.</a>')})
        cases = [({"SEARXNG_URL": site}, "1. ACP\n   https://acp.example/\n   The protocol."),
                 ({"BRAVE_API_KEY": "b-key", "QCR_SEARCH_URL": site + "/brave"},
                  "1. Brave hit\n   https://b.example/\n   From Brave."),
                 ({"QCR_SEARCH_URL": site + "/ddg"},
                  "1. Duck hit\n   https://d.example/page\n   Keyless & free.")]
        for env, expected in cases:
            with self.subTest(env=env):
                status, result, updates, _ = self.run_web("WebSearch", {"query": "acp"}, env)
                self.assertEqual((status, result), ("completed", expected))
                self.assertEqual(updates[0]["kind"], "search")
        brave = [h for p, h in self.site.seen if p.startswith("/brave")]
        self.assertEqual(brave[0]["x-subscription-token"], "b-key")

    def test_tavily_and_the_web_switched_off(self):
        tavily = qcr.FakeModel(lambda body: (200, {"results": [
            {"title": "T", "url": "https://t.example/", "content": f"for {body['query']}"}]}))
        self.addCleanup(tavily.close)
        status, result, _, _ = self.run_web("WebSearch", {"query": "q"}, {
            "TAVILY_API_KEY": "t-key", "QCR_SEARCH_URL": tavily.url + "/search"})
        self.assertEqual(result, "1. T\n   https://t.example/\n   for q")
        self.assertEqual(tavily.requests[0]["api_key"], "t-key")
        status, result, _, requests = self.run_web("WebFetch", {"url": "https://x.example/"},
                                                   {"QCR_WEB": "false"})
        self.assertEqual(status, "failed")
        self.assertIn("there is no tool named 'WebFetch'", result)
        offered = [t["function"]["name"] for t in requests[0]["tools"]]
        self.assertNotIn("WebFetch", offered)
        self.assertNotIn("WebSearch", offered)


class TestScheduledPrompts(AcpTestCase):
    def cron_frames(self, agent, count, timeout=10):
        """The next `count` updates of scheduled turns (they come with no prompt of ours)."""
        found = []
        deadline = time.monotonic() + timeout
        while len(found) < count:
            frame = agent.recv(max(0.1, deadline - time.monotonic()))
            update = frame.get("params", {}).get("update", {})
            if update.get("_meta", {}).get("source") == "cron":
                found.append(update)
        return found

    def test_a_job_fires_on_an_idle_session_marked_as_cron(self):
        def model(body):
            said = [m["content"] for m in body["messages"] if m["role"] == "user"]
            if said[-1] == "cron ping":
                return scripted_reply("Pong from cron.")
            if body["messages"][-1]["role"] == "user":
                return calls(("CronCreate", {"schedule": "every 1s", "prompt": "cron ping",
                                             "recurring": False}),
                             ("CronCreate", {"schedule": "every banana", "prompt": "x"}))
            return scripted_reply("Scheduled.")
        self.model = qcr.FakeModel(model)
        agent = self.start()
        session_id = self.new_session(agent)
        _, updates, _ = self.prompt(agent, session_id, "remind me in a second")
        self.assertEqual(list(final_status(updates).values()), ["completed", "failed"])
        self.assertIn("invalid schedule 'every banana'", self.tool_messages(1)[1])
        fired = self.cron_frames(agent, 2)
        job_id = fired[0]["_meta"]["jobId"]
        self.assertRegex(job_id, r"^job-[0-9a-f]{6}$")
        self.assertEqual(fired[0]["sessionUpdate"], "user_message_chunk")
        self.assertEqual(fired[0]["content"]["text"], "cron ping")
        rest = self.cron_frames(agent, 1)
        while text_of(fired + rest) != "Pong from cron.":
            rest += self.cron_frames(agent, 1)
        self.assertTrue(all(u["_meta"] == {"source": "cron", "jobId": job_id}
                            for u in fired + rest))
        time.sleep(1.5)                                  # once means once: no second start
        later = [f["params"]["update"] for f in list(agent.frames.queue) if f and
                 f.get("params", {}).get("update", {}).get("sessionUpdate") ==
                 "user_message_chunk"]
        self.assertEqual(later, [])
        self.assertClean(agent)

    def test_jobs_are_saved_and_come_back_and_can_be_deleted(self):
        def model(body):
            last = body["messages"][-1]
            said = [m["content"] for m in body["messages"] if m["role"] == "user"]
            if last["role"] == "tool":
                return scripted_reply("Done.")
            if said[-1] == "schedule it":
                return calls(("CronCreate", {"schedule": "0 0 1 1 *", "prompt": "new year"}))
            if said[-1] == "what is scheduled?":
                return calls(("CronList", {}))
            return calls(("CronDelete", {"id": said[-1].split()[-1]}))
        self.model = qcr.FakeModel(model)
        agent = self.start()
        session_id = self.new_session(agent)
        self.prompt(agent, session_id, "schedule it")
        job_id = re.search(r"job-[0-9a-f]{6}", self.tool_messages(1)[0]).group(0)
        agent.close()
        agent = self.start()
        agent.call("initialize", {"protocolVersion": 1})
        agent.call("session/load", {"sessionId": session_id, "cwd": self.project,
                                    "mcpServers": []})
        self.prompt(agent, session_id, "what is scheduled?")
        listed = self.tool_messages(-1)[-1]
        self.assertIn(f"{job_id}: 0 0 1 1 * (recurring), next at ", listed)
        self.assertIn("-01-01 00:00:00: new year", listed)
        self.prompt(agent, session_id, f"delete {job_id}")
        self.assertEqual(self.tool_messages(-1)[-1], f"Removed {job_id}.")
        self.prompt(agent, session_id, "what is scheduled?")
        self.assertEqual(self.tool_messages(-1)[-1], "Nothing is scheduled.")

    def test_cron_expressions(self):
        base = time.mktime((2026, 12, 2, 11, 59, 30, 0, 0, -1))     # a Wednesday
        for expression, expected in (("*/15 * * * *", (2026, 12, 2, 12, 0)),
                                     ("0 9 * * 1-5", (2026, 12, 3, 9, 0)),
                                     ("30 2 1 * *", (2027, 1, 1, 2, 30)),
                                     ("0 12 * * 0", (2026, 12, 6, 12, 0)),
                                     ("0 12 * * 7", (2026, 12, 6, 12, 0))):
            with self.subTest(expression=expression):
                fires = time.localtime(qcr.next_run(expression, base))
                self.assertEqual(tuple(fires)[:5], expected)
        self.assertEqual(qcr.next_run("every 10m", base), base + 600)
        for bad in ("* * *", "61 * * * *", "0 0 31 2 *"):
            with self.subTest(bad=bad), self.assertRaises(ValueError):
                qcr.next_run(bad, base)


class TestPermissionsAndModes(AcpTestCase):
    def test_reject_leaves_the_file_and_tells_the_model(self):
        self.write("a.txt", "old\n")
        self.fake_model(calls(("WriteFile", {"path": "a.txt", "content": "new\n"})),
                        scripted_reply("ok"))
        agent = self.start()
        _, updates, requests = self.prompt(agent, self.new_session(agent), "go", answer=REJECT)
        self.assertEqual(self.read("a.txt"), "old\n")
        self.assertEqual(list(final_status(updates).values()), ["failed"])
        self.assertIn("The user declined", self.tool_messages(1)[0])

    def test_always_allow_is_remembered_for_the_session(self):
        self.fake_model(calls(("WriteFile", {"path": "a.txt", "content": "1"})),
                        calls(("WriteFile", {"path": "b.txt", "content": "2"})),
                        calls(("Shell", {"command": "echo one"})),
                        calls(("Shell", {"command": "echo two"})),
                        calls(("Shell", {"command": "ls"})),
                        scripted_reply("ok"))
        agent = self.start()
        response, updates, requests = self.prompt(agent, self.new_session(agent), "go",
                                                  answer=ALLOW_ALWAYS)
        self.assertEqual(self.read("b.txt"), "2")
        titles = [r["params"]["toolCall"]["title"] for r in requests]
        self.assertEqual(titles, ["Write a.txt", "echo one", "ls"])
        self.assertIn("Allow `echo` commands for this session",
                      [o["name"] for o in requests[1]["params"]["options"]])

    def test_plan_mode_refuses_changes_whatever_the_model_asks(self):
        self.write("a.txt", "keep\n")
        self.fake_model(calls(("EditFile", {"path": "a.txt", "old_string": "keep",
                                            "new_string": "lose"})),
                        calls(("Shell", {"command": "touch made-it"})),
                        scripted_reply("ok"))
        agent = self.start()
        session_id = self.new_session(agent)
        agent.call("session/set_mode", {"sessionId": session_id, "modeId": "plan"})
        response, updates, requests = self.prompt(agent, session_id, "go")
        self.assertEqual(requests, [])
        self.assertEqual(self.read("a.txt"), "keep\n")
        self.assertFalse(os.path.exists(os.path.join(self.project, "made-it")))
        self.assertEqual(list(final_status(updates).values()), ["failed", "failed"])
        self.assertIn("plan mode", self.tool_messages(2)[0])
        offered = [t["function"]["name"] for t in self.model.requests[0]["tools"]]
        self.assertNotIn("EditFile", offered)
        self.assertIn("Grep", offered)
        self.assertIn("PLAN mode", self.model.requests[0]["messages"][0]["content"])

    def test_auto_edit_changes_files_but_asks_before_commands(self):
        self.fake_model(calls(("WriteFile", {"path": "a.txt", "content": "auto"})),
                        calls(("Shell", {"command": "echo hi"})), scripted_reply("ok"))
        agent = self.start()
        session_id = self.new_session(agent)
        agent.call("session/set_mode", {"sessionId": session_id, "modeId": "auto-edit"})
        _, updates, requests = self.prompt(agent, session_id, "go")
        self.assertEqual(self.read("a.txt"), "auto")
        self.assertEqual([r["params"]["toolCall"]["title"] for r in requests], ["echo hi"])

    def test_a_client_error_on_permission_is_a_failed_call(self):
        self.fake_model(calls(("WriteFile", {"path": "a.txt", "content": "x"})),
                        scripted_reply("ok"))
        agent = self.start()
        session_id = self.new_session(agent)
        request_id = agent.request("session/prompt", {"sessionId": session_id, "prompt": [
            {"type": "text", "text": "go"}]})
        response, updates, requests = agent.wait(request_id, answer=lambda frame: agent.send(
            {"jsonrpc": "2.0", "id": frame["id"], "error": {"code": -32603, "message": "no"}}))
        self.assertResult(response, {"stopReason": "end_turn"})
        self.assertFalse(os.path.exists(os.path.join(self.project, "a.txt")))
        self.assertIn("The permission request was cancelled or failed", self.tool_messages(1)[0])


# The policy as the README states it: (call, what it does) -> verdict per mode. Written out
# here, not read from qcr, so a change to qcr's table that breaks a promise fails a test.
POLICY_ROWS = {    #                 default  plan      auto-edit  yolo
    "read":                         ("allow", "allow",  "allow",   "allow"),
    "read outside":                 ("ask",   "refuse", "ask",     "allow"),
    "write":                        ("ask",   "refuse", "allow",   "allow"),
    "write outside":                ("ask",   "refuse", "ask",     "allow"),
    "delete":                       ("ask",   "refuse", "allow",   "allow"),
    "delete outside":               ("ask",   "refuse", "ask",     "allow"),
    "execute":                      ("ask",   "refuse", "ask",     "allow"),
    "write inside .git":            ("ask",   "refuse", "ask",     "allow"),
    "schedule":                     ("ask",   "refuse", "ask",     "allow"),
    "network private":              ("ask",   "ask",    "ask",     "ask"),
}


class TestHostileModel(AcpTestCase):
    """A model (and a repository) trying every route around the modes. Each action either
    does not happen or happens only after a permission request; canaries outside the
    project show what escaped."""

    def setUp(self):
        super().setUp()
        self.outside = os.path.join(self.tmp, "outside")
        os.makedirs(self.outside)

    def outside_file(self, name, text="outside\n"):
        path = os.path.join(self.outside, name)
        with open(path, "w") as f:
            f.write(text)
        return path

    def test_the_policy_table_row_by_row(self):
        """Every row of the README's table, in every mode, over real pipes."""
        self.fake_model()
        self.model.routes["/page"] = (200, {"Content-Type": "text/plain"}, b"a page")
        page = self.model.url.rsplit("/", 1)[0] + "/page"
        rows = [("read", ("ReadFile", {"path": "a.txt"})),
                ("read outside", ("ReadFile", {"path": "../outside/secret.txt"})),
                ("write", ("WriteFile", {"path": "new.txt", "content": "x"})),
                ("write outside", ("WriteFile", {"path": "../outside/new.txt",
                                                 "content": "x"})),
                ("delete", ("DeleteFile", {"path": "del.txt"})),
                ("delete outside", ("DeleteFile", {"path": "../outside/del.txt"})),
                ("execute", ("Shell", {"command": "touch ran-it"})),
                ("write inside .git", ("WriteFile", {"path": ".git/hooks/pre-commit",
                                                     "content": "#!/bin/sh\n"})),
                ("schedule", ("CronCreate", {"schedule": "every 1h", "prompt": "hello"})),
                ("network private", ("WebFetch", {"url": page}))]
        effect_seen = {   # did the call's effect happen? (read and network: it completed)
            "write": lambda: os.path.exists(os.path.join(self.project, "new.txt")),
            "write outside": lambda: os.path.exists(os.path.join(self.outside, "new.txt")),
            "delete": lambda: not os.path.exists(os.path.join(self.project, "del.txt")),
            "delete outside": lambda: not os.path.exists(os.path.join(self.outside, "del.txt")),
            "execute": lambda: os.path.exists(os.path.join(self.project, "ran-it")),
            "write inside .git": lambda: os.path.exists(
                os.path.join(self.project, ".git", "hooks", "pre-commit"))}
        for column, mode in enumerate(("default", "plan", "auto-edit", "yolo")):
            with self.subTest(mode=mode):
                for name in ("new.txt", "ran-it", ".git/hooks/pre-commit"):
                    if os.path.exists(os.path.join(self.project, name)):
                        os.remove(os.path.join(self.project, name))
                self.write("a.txt", "inside\n")
                self.write("del.txt", "x\n")
                self.write(".git/hooks/.keep", "")
                self.outside_file("secret.txt")
                self.outside_file("del.txt")
                if os.path.exists(os.path.join(self.outside, "new.txt")):
                    os.remove(os.path.join(self.outside, "new.txt"))
                self.model.respond = Script(*[calls(c) for _, c in rows],
                                            scripted_reply("done"))
                agent = self.start()
                session_id = self.new_session(agent)
                agent.call("session/set_mode", {"sessionId": session_id, "modeId": mode})
                _, updates, requests = self.prompt(agent, session_id, "go", timeout=30)
                ids = [u["toolCallId"] for u in updates if u["sessionUpdate"] == "tool_call"]
                asked = {r["params"]["toolCall"]["toolCallId"] for r in requests}
                status = final_status(updates)
                for (row, _), call_id in zip(rows, ids):
                    expected = POLICY_ROWS[row][column]
                    done = effect_seen[row]() if row in effect_seen else \
                        status[call_id] == "completed"
                    got = "refuse" if not done and call_id not in asked else \
                        "ask" if call_id in asked else "allow"
                    self.assertEqual((row, got), (row, expected))
                    self.assertEqual(done, expected != "refuse", row)
                agent.close()

    def test_a_scheduled_turn_is_never_the_user(self):
        """A job's prompt is the model's text: never a slash command, and its turn cannot
        change the mode or schedule more."""
        def model(body):
            said = [m["content"] for m in body["messages"] if m["role"] == "user"]
            last = body["messages"][-1]
            if said[-1] == "/mode yolo" and last["role"] == "user":
                return calls(("CronCreate", {"schedule": "every 1s", "prompt": "again"}))
            if said[-1] == "/mode yolo":
                return scripted_reply("cron done")
            if last["role"] == "user":
                return calls(("CronCreate", {"schedule": "every 1s", "prompt": "/mode yolo",
                                             "recurring": False}))
            return scripted_reply("scheduled")
        self.model = qcr.FakeModel(model)
        agent = self.start()
        session_id = self.new_session(agent)
        _, updates, requests = self.prompt(agent, session_id, "schedule a mode change")
        self.assertEqual(len(requests), 1)            # scheduling asks, in default mode
        self.assertIn("scheduling prompts", json.dumps(requests[0]["params"]["options"]))
        frames, deadline = [], time.monotonic() + 10
        while "cron done" not in text_of(frames):
            frame = agent.recv(max(0.1, deadline - time.monotonic()))
            self.assertNotIn("id", frame, "a scheduled turn asked for permission")
            frames.append(frame["params"]["update"])
        self.assertNotIn("current_mode_update", kinds(frames))
        self.assertIn("/mode yolo", [m["content"] for m in self.model.requests[-2]["messages"]
                                     if m["role"] == "user"])
        tool_results = [m["content"] for m in self.model.requests[-1]["messages"]
                        if m["role"] == "tool"]
        self.assertIn("scheduled turns may not schedule prompts", tool_results[-1])
        response, _, _ = agent.call("session/set_mode", {"sessionId": session_id,
                                                         "modeId": "default"})
        listed = agent.call("session/list", {})[0]["result"]["sessions"]
        self.assertEqual(len(listed), 1)
        agent.close()
        self.assertEqual(read_session_file(os.path.join(
            self.home, ".qcr", "sessions", session_id + ".json"))["mode"], "default")

    def test_a_reopened_session_runs_no_job_until_the_user_acts(self):
        self.fake_model(calls(("CronCreate", {"schedule": "every 2s", "prompt": "tick",
                                              "recurring": False})),
                        scripted_reply("scheduled"), scripted_reply("answered"))
        agent = self.start()
        session_id = self.new_session(agent)
        self.prompt(agent, session_id, "schedule it")
        agent.close()                                 # before it is due
        time.sleep(2.2)
        agent = self.start()
        agent.call("initialize", {"protocolVersion": 1})
        agent.call("session/load", {"sessionId": session_id, "cwd": self.project,
                                    "mcpServers": []})
        time.sleep(1.5)                               # due, but nobody has acted here yet
        self.assertFalse([f for f in list(agent.frames.queue) if f and f.get(
            "params", {}).get("update", {}).get("_meta", {}).get("source") == "cron"])
        requests_before = len(self.model.requests)
        self.prompt(agent, session_id, "hello")
        deadline = time.monotonic() + 10
        while not any(f and f.get("params", {}).get("update", {}).get("_meta") for f in
                      [agent.recv(max(0.1, deadline - time.monotonic()))]):
            pass
        self.assertGreater(len(self.model.requests), requests_before)

    def test_repository_git_configuration_runs_nothing(self):
        """core.fsmonitor (and its kin) in .git/config would run a program on every file
        listing; Glob and Grep list through git all the same, and nothing runs."""
        canary = os.path.join(self.outside, "CANARY")
        subprocess.run(["git", "init", "-q", self.project], check=True)
        for key, value in (("core.fsmonitor", f"touch {canary}; false"),
                           ("core.pager", f"touch {canary}"),
                           ("diff.external", f"touch {canary}")):
            subprocess.run(["git", "-C", self.project, "config", key, value], check=True)
        self.write("src/app.py", "needle = 1\n")
        self.write("src/hidden.py", "needle = 2\n")
        with open(os.path.join(self.project, ".git", "info", "exclude"), "a") as f:
            f.write("hidden.py\n")          # only git itself knows this rule
        self.fake_model(calls(("Glob", {"pattern": "*.py"})),
                        calls(("Grep", {"pattern": "needle"})), scripted_reply("ok"))
        agent = self.start()
        self.prompt(agent, self.new_session(agent), "look")
        self.assertFalse(os.path.exists(canary), "the repository ran a program")
        self.assertEqual(self.tool_messages(1), ["src/app.py"])
        self.assertEqual(self.tool_messages(2)[-1], "src/app.py:1: needle = 1")

    def test_command_scopes_cover_only_what_bash_would_split_alike(self):
        exact = "this exact command"
        for command, label in (
                ("pytest -q tests", "`pytest` commands"),
                ("make test", "`make test` commands"),
                ("git status --short", "`git status` commands"),
                ("git config user.name x", "`git config` commands"),
                ("python3 setup.py test", "`python3 setup.py` commands"),
                ("python3 -m pytest -q", "`python3 -m pytest` commands"),
                ("npm test", "`npm test` commands"), ("ls -la", "`ls` commands"),
                ('git "-c" "core.sshCommand=touch x" ls-remote', exact),
                ("git '-c' 'core.fsmonitor=touch x' status", exact),
                ('python3 "-c" x', exact), ('perl -esystem"touch x"', exact),
                ("bash -xc ls", exact), ("node -pe 1", exact), ("git -C /tmp status", exact),
                ("git --git-dir=evil status", exact), ("git --exec-path=. x", exact),
                ('tar "--checkpoint-action=exec=touch p" -cf a.tar .', exact),
                ("rsync -avze ssh a b", exact), ('"git" status', exact),
                ("git submodule foreach x", exact), ("git rebase -x x", exact),
                ("ls\u00a0-la", exact), ("ls\u2003x", exact), ("ls\tx", exact),
                ("ls x\x1b[2K", exact), ("ls é", exact), ("echo a; rm -rf ~", exact),
                ("./run.sh", exact), ("/usr/bin/env ls", exact), ("FOO=1 make", exact),
                ("env touch x", exact), ("xargs rm", exact), ("sudo ls", exact),
                ("time make", exact), ("nohup make", exact), ("python3 -c print", exact),
                ("node -e x", exact), ("bash -c x", exact), ("node --eval=x", exact),
                ("git -c core.pager=x log", exact), ("npx cowsay", exact),
                ("find . -exec rm {} +", exact), ("sed -e x f", exact)):
            with self.subTest(command=command):
                self.assertEqual(qcr.shell_scope(command)[1], label)
        self.assertEqual(qcr.printable("echo hi\rrm -rf /\u202e"),
                         "echo hi\\rrm -rf /\\u202e")

    def approve_then_try(self, first, *others):
        """The user allows `first` "always"; every one of `others` must still ask."""
        self.fake_model(*[calls(("Shell", {"command": c})) for c in (first,) + others],
                        scripted_reply("ok"))
        agent = self.start()
        answers = iter([ALLOW_ALWAYS] + [REJECT] * len(others))
        _, updates, requests = self.prompt(agent, self.new_session(agent), "go",
                                           answer=lambda frame: next(answers))
        self.assertEqual(len(requests), 1 + len(others))
        return updates, requests

    def test_an_approved_wrapper_does_not_carry_other_programs(self):
        updates, requests = self.approve_then_try("env echo one", "env touch pwned",
                                                  "echo hi\rtouch pwned2")
        self.assertIn("Allow this exact command for this session",
                      [o["name"] for o in requests[0]["params"]["options"]])
        self.assertFalse(os.path.exists(os.path.join(self.project, "pwned")))
        self.assertEqual(requests[2]["params"]["toolCall"]["title"], "echo hi\\rtouch pwned2")
        call = requests[0]["params"]["toolCall"]
        self.assertEqual((call["kind"], call["status"], call["rawInput"]),
                         ("execute", "pending", {"command": "env echo one"}))
        self.assertIn("locations", call)

    def test_a_folder_swapped_for_a_symlink_while_the_card_is_open(self):
        self.write("sub/f.txt", "old\n")
        self.fake_model(calls(("WriteFile", {"path": "sub/f.txt", "content": "new\n"})),
                        scripted_reply("ok"))
        agent = self.start()

        def swap_then_allow(frame):
            shutil.move(os.path.join(self.project, "sub"), os.path.join(self.tmp, "moved"))
            os.symlink(self.outside, os.path.join(self.project, "sub"))
            return ALLOW
        _, updates, requests = self.prompt(agent, self.new_session(agent), "go",
                                           answer=swap_then_allow)
        self.assertEqual(len(requests), 1)
        self.assertFalse(os.path.exists(os.path.join(self.outside, "f.txt")))
        self.assertEqual(list(final_status(updates).values()), ["failed"])
        self.assertIn("now leads to", self.tool_messages(1)[0])

    def test_an_outside_approval_is_per_effect(self):
        self.outside_file("notes.txt", "secret\n")
        self.fake_model(calls(("ReadFile", {"path": "../outside/notes.txt"})),
                        calls(("WriteFile", {"path": "../outside/notes.txt", "content": "x"})),
                        calls(("DeleteFile", {"path": "../outside/notes.txt"})),
                        calls(("ReadFile", {"path": "../outside/notes.txt"})),
                        scripted_reply("ok"))
        agent = self.start()
        session_id = self.new_session(agent)
        agent.call("session/set_mode", {"sessionId": session_id, "modeId": "auto-edit"})
        answers = iter([ALLOW_ALWAYS, REJECT, REJECT])
        _, updates, requests = self.prompt(agent, session_id, "go",
                                           answer=lambda frame: next(answers))
        self.assertEqual(len(requests), 3)       # the second read was covered, nothing else
        self.assertIn("reading in", requests[0]["params"]["options"][1]["name"])
        self.assertIn("changes in", requests[1]["params"]["options"][1]["name"])
        self.assertIn("deleting in", requests[2]["params"]["options"][1]["name"])
        with open(os.path.join(self.outside, "notes.txt")) as f:
            self.assertEqual(f.read(), "secret\n")

    def test_files_qcr_reads_for_itself_stay_in_the_project(self):
        """AGENTS.md, steering and command files that a repository links out of the project
        (a key, qcr's own environment) or plants as a FIFO or /dev/stdin: none is read, and
        nothing hangs, in any mode."""
        secret = self.outside_file("id_rsa", "PRIVATE-KEY-42\n")
        os.symlink(secret, os.path.join(self.project, "AGENTS.md"))
        os.mkfifo(os.path.join(self.project, "CLAUDE.md"))
        os.makedirs(os.path.join(self.project, ".qcr", "steering"))
        os.makedirs(os.path.join(self.project, ".qcr", "commands"))
        os.symlink("/proc/self/environ", os.path.join(self.project, ".qcr", "steering", "e.md"))
        os.symlink(secret, os.path.join(self.project, ".qcr", "commands", "key.md"))
        os.symlink("/dev/stdin", os.path.join(self.project, ".qcr", "commands", "in.md"))
        self.write(".qcr/commands/fine.md", "# A fine command\nDo it.\n")
        self.fake_model(scripted_reply("ok"))
        agent = self.start(env={"QCR_TEST_SECRET": "ENV-SECRET-43"})
        session_id = self.new_session(agent)
        names = [c["name"] for c in self.commands["availableCommands"]]
        self.assertIn("fine", names)
        self.assertNotIn("key", names)
        self.assertNotIn("in", names)
        response, _, requests = self.prompt(agent, session_id, "hello", timeout=10)
        self.assertResult(response, {"stopReason": "end_turn"})
        self.assertEqual(requests, [])
        sent = json.dumps(self.model.requests)
        self.assertNotIn("PRIVATE-KEY-42", sent)
        self.assertNotIn("ENV-SECRET-43", sent)
        self.assertResult(agent.call("session/list", {})[0])
        self.assertClean(agent)

    def test_changes_that_could_run_programs_ask_even_in_auto_edit(self):
        """A plugin's server code, the git folder a .git file names, qcr's own ledger (the
        project is HOME), a file hard-linked to .git/config: each change asks."""
        subprocess.run(["git", "init", "-q", self.project], check=True)
        os.link(os.path.join(self.project, ".git", "config"),
                os.path.join(self.project, "cfg.txt"))
        worktree = os.path.join(self.project, "wt")
        self.write("wt/.git", "gitdir: ./.bare\n")
        self.write("wt/.bare/HEAD", "ref: refs/heads/main\n")
        targets = [".qcr/plugins/p/server.py", "wt/.bare/hooks/pre-commit", "cfg.txt",
                   os.path.join(self.home, ".qcr", "permissions.json")]
        self.fake_model(*[calls(("WriteFile", {"path": t, "content": "[core]\nfsmonitor = x\n"}))
                          for t in targets], scripted_reply("ok"))
        agent = self.start()
        session_id = self.new_session(agent)
        agent.call("session/set_mode", {"sessionId": session_id, "modeId": "auto-edit"})
        agent.call("session/set_config_option", {"sessionId": session_id,
                                                 "configId": "mode", "value": "auto-edit"})
        response, _, requests = self.prompt(agent, session_id, "go", answer=REJECT)
        self.assertEqual(len(requests), len(targets), [r["params"]["toolCall"]["title"]
                                                       for r in requests])
        self.assertFalse(os.path.exists(os.path.join(self.project, ".qcr", "plugins")))
        self.assertFalse(os.path.exists(os.path.join(worktree, ".bare", "hooks")))
        with open(os.path.join(self.project, ".git", "config")) as f:
            self.assertNotIn("fsmonitor", f.read())
        self.assertIn("other names (hard links)", json.dumps(requests[2]))

    def test_home_as_the_project_keeps_qcrs_own_files_guarded(self):
        self.fake_model(calls(("WriteFile", {"path": ".qcr/permissions.json", "content":
                                             '{"global": {}}'})), scripted_reply("ok"))
        agent = self.start()
        session_id = self.new_session(agent, cwd=self.home)
        agent.call("session/set_mode", {"sessionId": session_id, "modeId": "auto-edit"})
        _, _, requests = self.prompt(agent, session_id, "go", answer=REJECT)
        self.assertEqual(len(requests), 1)
        self.assertIn(".qcr", requests[0]["params"]["options"][1]["name"])

    def test_a_quoted_flag_does_not_stretch_an_approved_scope(self):
        subprocess.run(["git", "init", "-q", self.project], check=True)
        _, requests = self.approve_then_try(
            "git status", 'git "-c" "core.fsmonitor=touch pwned" status',
            "git config core.fsmonitor 'touch pwned'")
        self.assertIn("`git status` commands", json.dumps(requests[0]["params"]["options"]))
        self.assertFalse(os.path.exists(os.path.join(self.project, "pwned")))

    def test_an_edit_outside_is_no_oracle_for_an_unread_file(self):
        """EditFile's "not found" would say what an outside file holds: the read is cleared
        first -- refused in plan mode, asked for in default -- before any matching."""
        self.outside_file("token", "token=K\n")
        for mode, answer, asked in (("plan", ALLOW, 0), ("default", REJECT, 1)):
            with self.subTest(mode=mode):
                self.fake_model(*[calls(("EditFile", {"path": "../outside/token",
                                                      "old_string": guess, "new_string": "x"}))
                                  for guess in ("token=Z", "token=K")], scripted_reply("ok"))
                agent = self.start()
                session_id = self.new_session(agent)
                agent.call("session/set_mode", {"sessionId": session_id, "modeId": mode})
                _, _, requests = self.prompt(agent, session_id, "go", answer=answer)
                self.assertEqual(len(requests), 2 * asked)
                first, second = self.tool_messages(1)[0], self.tool_messages(2)[-1]
                self.assertNotIn("not found", first)
                self.assertEqual(first.split(":")[0], second.split(":")[0])
                self.model.close()

    def test_search_does_not_pass_through_a_linked_folder(self):
        """A path that git lists through a folder linked out of the project (a crafted
        index): Grep and Glob leave it alone."""
        self.outside_file("secret.txt", "TOPSECRET-IDX\n")
        subprocess.run(["git", "init", "-q", self.project], check=True)
        os.symlink(self.outside, os.path.join(self.project, "link"))
        blob = subprocess.run(["git", "-C", self.project, "hash-object", "-w", "--stdin"],
                              input=b"x\n", capture_output=True, check=True).stdout.decode()
        subprocess.run(["git", "-C", self.project, "update-index", "--add", "--cacheinfo",
                        f"100644,{blob.strip()},link/secret.txt"], check=True)
        self.fake_model(calls(("Grep", {"pattern": "TOPSECRET"})),
                        calls(("Glob", {"pattern": "**/secret.txt"})), scripted_reply("ok"))
        agent = self.start()
        self.prompt(agent, self.new_session(agent), "go")
        self.assertNotIn("TOPSECRET-IDX", self.tool_messages(1)[0])
        self.assertNotIn("link/secret.txt", self.tool_messages(2)[-1])

    def test_grep_and_glob_never_follow_links_out_or_open_special_files(self):
        self.outside_file("secret.txt", "TOPSECRET\n")
        self.write("ok.txt", "TOPSECRET is a word here\n")
        os.symlink(os.path.join(self.outside, "secret.txt"), os.path.join(self.project, "leak.txt"))
        os.symlink(self.outside, os.path.join(self.project, "outdir"))
        os.symlink(os.path.join(self.project, "ok.txt"), os.path.join(self.project, "same.txt"))
        os.mkfifo(os.path.join(self.project, "pipe.txt"))
        self.fake_model(calls(("Grep", {"pattern": "TOPSECRET"})),
                        calls(("Glob", {"pattern": "**/*.txt"})), scripted_reply("ok"))
        agent = self.start()
        self.prompt(agent, self.new_session(agent), "look", timeout=20)
        self.assertEqual(self.tool_messages(1)[0].splitlines(),      # (links: not searched,
                         ["ok.txt:1: TOPSECRET is a word here"])     # by either engine)
        self.assertEqual(sorted(self.tool_messages(2)[1].splitlines()), ["ok.txt", "same.txt"])

    def test_commands_do_not_see_secrets(self):
        self.fake_model(calls(("Shell", {"command": "env"})), scripted_reply("ok"))
        agent = self.start(env={"QCR_API_KEY": "sk-model-key-1", "GITHUB_TOKEN": "ghp_2",
                                "MY_SERVICE_PASSWORD": "hunter3", "AWS_SECRET_ACCESS_KEY": "a4",
                                "INNOCENT": "sk-model-key-1", "DEPLOY_TOKEN": "let-me-5",
                                "QCR_PASS_ENV": "DEPLOY_TOKEN", "HARMLESS": "visible-6"})
        session_id = self.new_session(agent)
        agent.call("session/set_mode", {"sessionId": session_id, "modeId": "yolo"})
        self.prompt(agent, session_id, "env")
        output = self.tool_messages(1)[0]
        for secret in ("sk-model-key-1", "ghp_2", "hunter3", "a4\n"):
            self.assertNotIn(secret, output)
        self.assertIn("DEPLOY_TOKEN=let-me-5", output)
        self.assertIn("HARMLESS=visible-6", output)

    def test_model_server_credentials_never_follow_a_redirect_elsewhere(self):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        self.fake_model(scripted_reply("hello"))
        elsewhere = self.model.url.replace("127.0.0.1", "localhost")

        class Redirect(BaseHTTPRequestHandler):
            def do_POST(self):
                self.send_response(302)
                self.send_header("Location", elsewhere + "/chat/completions")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass
        server = ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        self.addCleanup(server.server_close)
        self.addCleanup(server.shutdown)
        agent = self.start(env={"QCR_BASE_URL": f"http://127.0.0.1:{server.server_address[1]}/v1",
                                "QCR_API_KEY": "sk-secret-key"})
        self.prompt(agent, self.new_session(agent), "hi")
        self.assertTrue(self.model.seen, "the redirect was not followed")
        for path, headers in self.model.seen:
            self.assertNotIn("sk-secret-key", json.dumps(headers))


class FakeEditor:
    """An ACP client that implements the editor's methods for real: fs/* on the disk (with
    unsaved buffers that win over it), terminal/* with real child processes, permission and
    elicitation answers from the test. Pass it as `answer=` to AcpProcess.wait."""

    CAPABILITIES = {"fs": {"readTextFile": True, "writeTextFile": True}, "terminal": True}

    def __init__(self, agent, project, permission=ALLOW, elicit=None, format_on_save=None):
        self.agent, self.project = agent, project
        self.permission, self.elicit, self.format_on_save = permission, elicit, format_on_save
        self.buffers, self.writes, self.calls, self.terminals = {}, [], [], {}

    def __call__(self, frame):
        method, params = frame["method"], frame["params"]
        self.calls.append((method, params))
        handler = getattr(self, method.replace("/", "_"), None)
        if handler is None:
            return self.error(frame, -32601, "Method not found")
        return handler(frame, params)

    def error(self, frame, code, message):
        self.agent.send({"jsonrpc": "2.0", "id": frame["id"],
                         "error": {"code": code, "message": message}})

    def methods(self):
        return [m for m, _ in self.calls]

    def session_request_permission(self, frame, params):
        return self.permission(frame) if callable(self.permission) else self.permission

    def elicitation_create(self, frame, params):
        return self.elicit(params)

    def fs_read_text_file(self, frame, params):
        path = params["path"]
        if not path.startswith(self.project + os.sep):
            return self.error(frame, -32002, "path is outside the project")
        if path in self.buffers:
            return {"content": self.buffers[path]}
        try:
            with open(path, encoding="utf-8", newline="") as f:
                return {"content": f.read()}
        except OSError:
            return self.error(frame, -32002, "not found")

    def fs_write_text_file(self, frame, params):
        path, content = params["path"], params["content"]
        if not path.startswith(self.project + os.sep):
            return self.error(frame, -32603, "invalid path")
        self.writes.append((path, content))
        if self.format_on_save:
            content = self.format_on_save(content)
        with open(path, "w", encoding="utf-8", newline="") as f:
            f.write(content)
        self.buffers.pop(path, None)
        return {}

    def terminal_create(self, frame, params):
        proc = subprocess.Popen([params["command"]] + params.get("args", []),
                                cwd=params.get("cwd"), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        terminal = {"proc": proc, "output": bytearray(), "released": False}

        def read():
            for chunk in iter(lambda: proc.stdout.read1(4096), b""):
                terminal["output"].extend(chunk)
            proc.stdout.close()
        threading.Thread(target=read, daemon=True).start()
        terminal_id = f"term-{len(self.terminals)}"
        self.terminals[terminal_id] = terminal
        return {"terminalId": terminal_id}

    def exit_status(self, proc):
        code = proc.returncode
        return {"exitCode": code if code >= 0 else None,
                "signal": signal.Signals(-code).name if code < 0 else None}

    def terminal_wait_for_exit(self, frame, params):
        proc = self.terminals[params["terminalId"]]["proc"]

        def wait():       # answered when the process ends, while other frames flow
            proc.wait()
            self.agent.send({"jsonrpc": "2.0", "id": frame["id"],
                             "result": self.exit_status(proc)})
        threading.Thread(target=wait, daemon=True).start()
        return None

    def terminal_output(self, frame, params):
        terminal = self.terminals[params["terminalId"]]
        proc = terminal["proc"]
        if proc.poll() is not None:
            time.sleep(0.1)    # let the reader thread drain the pipe
        result = {"output": terminal["output"].decode(errors="replace"), "truncated": False}
        if proc.poll() is not None:
            result["exitStatus"] = self.exit_status(proc)
        return result

    def terminal_kill(self, frame, params):
        proc = self.terminals[params["terminalId"]]["proc"]
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        return {}

    def terminal_release(self, frame, params):
        self.terminal_kill(frame, params)
        self.terminals[params["terminalId"]]["released"] = True
        return {}

    def close(self):
        for terminal in self.terminals.values():
            if terminal["proc"].poll() is None:
                os.killpg(terminal["proc"].pid, signal.SIGKILL)
                terminal["proc"].wait()


class TestEditorIntegration(AcpTestCase):
    def editor_session(self, agent, capabilities=FakeEditor.CAPABILITIES, **kw):
        params = {"cwd": self.project, "mcpServers": []}
        if "dirs" in kw:
            params["additionalDirectories"] = kw.pop("dirs")
        editor = FakeEditor(agent, self.project, **kw)
        self.addCleanup(editor.close)
        response, _, _ = agent.call("initialize", {"protocolVersion": 1,
                                                   "clientCapabilities": capabilities})
        response, _, _ = agent.call("session/new", params)
        agent.recv()                                    # the commands
        return editor, response["result"]["sessionId"]

    def test_files_go_through_the_editor_with_its_unsaved_buffers(self):
        path = self.write("a.py", "x = 1\n")
        self.fake_model(calls(("ReadFile", {"path": "a.py"})),
                        calls(("EditFile", {"path": "a.py", "old_string": "x = 'unsaved'",
                                            "new_string": "x = 2"})),
                        scripted_reply("done"))
        agent = self.start()
        editor, session_id = self.editor_session(agent)
        editor.buffers[path] = "x = 'unsaved'\n"
        response, updates, _ = self.prompt(agent, session_id, "edit", answer=editor)
        self.assertResult(response, {"stopReason": "end_turn"})
        self.assertEqual(self.tool_messages(1)[0], "     1\tx = 'unsaved'")
        self.assertEqual(editor.writes, [(path, "x = 2\n")])
        self.assertEqual(self.read("a.py"), "x = 2\n")
        self.assertIn("fs/read_text_file", editor.methods())
        self.assertClean(agent)

    def test_an_editor_refusal_stands_and_qcr_does_not_go_around_it(self):
        self.write("kept.txt", "mine\n")
        self.fake_model(calls(("ReadFile", {"path": "kept.txt"})),
                        calls(("WriteFile", {"path": "kept.txt", "content": "theirs\n"})),
                        calls(("WriteFile", {"path": "new.txt", "content": "n\n"})),
                        calls(("WriteFile", {"path": "new2.txt", "content": "n\n"})),
                        scripted_reply("ok"))
        agent = self.start()
        editor, session_id = self.editor_session(agent)
        refusals = iter([(-32603, "the file is locked"), (-32601, "Method not found")])

        def refuse(frame, params):
            code, message = next(refusals)
            return editor.error(frame, code, message)
        editor.fs_read_text_file = lambda frame, params: editor.error(frame, -32603, "busy") \
            if params["path"].endswith("kept.txt") else FakeEditor.fs_read_text_file(
                editor, frame, params)
        editor.fs_write_text_file = refuse
        _, updates, _ = self.prompt(agent, session_id, "go", answer=editor)
        results = [self.tool_messages(i)[-1] for i in (1, 2, 3)]
        self.assertIn("the editor could not read", results[0])
        self.assertIn("busy", results[0])
        self.assertIn("could not read", results[1])      # a change reads first, too
        self.assertEqual(self.read("kept.txt"), "mine\n")
        self.assertIn("the editor refused to write", results[2])
        self.assertIn("the file is locked", results[2])
        self.assertFalse(os.path.exists(os.path.join(self.project, "new.txt")))
        self.assertEqual(self.read("new2.txt"), "n\n")   # no such method after all: disk

    def test_a_file_changed_behind_qcrs_back_is_not_clobbered(self):
        for capabilities in (FakeEditor.CAPABILITIES, {}):
            with self.subTest(through_editor=bool(capabilities)):
                self.write("a.py", "x = 1\n")

                def change_it(body):       # while the model "thinks", someone edits the file
                    self.write("a.py", "x = 1\ny = 'theirs'\n")
                    return calls(("WriteFile", {"path": "a.py", "content": "x = 2\n"}))
                self.fake_model(calls(("ReadFile", {"path": "a.py"})), change_it,
                                scripted_reply("ok"))
                agent = self.start()
                editor, session_id = self.editor_session(agent, capabilities)
                _, updates, _ = self.prompt(agent, session_id, "go", answer=editor)
                self.assertIn("has changed since you last read it", self.tool_messages(2)[-1])
                self.assertEqual(self.read("a.py"), "x = 1\ny = 'theirs'\n")
                self.assertEqual(list(final_status(updates).values()), ["completed", "failed"])
                self.model.close()

    def test_what_format_on_save_leaves_is_what_qcr_remembers(self):
        self.write("a.py", "x = 1\n")
        self.fake_model(calls(("WriteFile", {"path": "a.py", "content": "x=2"})),
                        calls(("EditFile", {"path": "a.py", "old_string": "x = 2",
                                            "new_string": "x = 3"})),
                        scripted_reply("ok"))
        agent = self.start()
        editor, session_id = self.editor_session(
            agent, format_on_save=lambda text: text.replace("x=2", "x = 2") + "\n")
        _, updates, _ = self.prompt(agent, session_id, "go", answer=editor)
        self.assertEqual(list(final_status(updates).values()), ["completed", "completed"])
        self.assertEqual(self.read("a.py"), "x = 3\n\n")

    def test_shell_runs_in_the_editors_terminal(self):
        self.fake_model(calls(("Shell", {"command": "echo hi from $0; exit 4"})),
                        scripted_reply("ok"))
        agent = self.start(env={"SOME_DEPLOY_TOKEN": "t0ken"})
        editor, session_id = self.editor_session(agent)
        _, updates, _ = self.prompt(agent, session_id, "run", answer=editor)
        create = [p for m, p in editor.calls if m == "terminal/create"][0]
        self.assertEqual((create["command"], create["args"], create["cwd"]),
                         (qcr.SHELL, ["-c", "echo hi from $0; exit 4"], self.project))
        self.assertIn({"type": "terminal", "terminalId": "term-0"},
                      [c for u in updates for c in u.get("content") or []])
        self.assertEqual(self.tool_messages(1)[0], f"hi from {qcr.SHELL}\n[exit code 4]")
        self.assertTrue(editor.terminals["term-0"]["released"])
        self.assertEqual(editor.methods()[-1], "terminal/release")
        self.assertIn({"name": "SOME_DEPLOY_TOKEN", "value": ""}, create["env"])  # blanked
        self.assertTrue(all(e["value"] == "" for e in create["env"]))
        agent.close()
        agent = self.start()               # a new process: the terminal is long gone
        agent.call("initialize", {"protocolVersion": 1})
        _, replayed, _ = agent.call("session/load", {"sessionId": session_id,
                                                     "cwd": self.project, "mcpServers": []})
        card = [u for u in replayed if u["sessionUpdate"] == "tool_call"][0]
        self.assertEqual(card["content"], [{"type": "content", "content": {
            "type": "text", "text": f"$ echo hi from $0; exit 4\nhi from {qcr.SHELL}\n"
                                    "[exit code 4]"}}])

    def test_a_terminal_is_killed_and_released_on_timeout_and_on_cancel(self):
        self.fake_model(calls(("Shell", {"command": "echo start; sleep 30", "timeout": 1})),
                        scripted_reply("ok"))
        agent = self.start()
        editor, session_id = self.editor_session(agent)
        self.prompt(agent, session_id, "run", answer=editor)
        self.assertIn("[timed out after 1s; the command was killed]", self.tool_messages(1)[0])
        self.assertIn("start", self.tool_messages(1)[0])
        self.assertIn("terminal/kill", editor.methods())
        self.assertTrue(editor.terminals["term-0"]["released"])
        self.model.close()

        self.fake_model(calls(("Shell", {"command": "sleep 30"})), scripted_reply("ok"))
        agent = self.start()
        editor, session_id = self.editor_session(agent)

        def cancel_when_waiting(frame):
            result = editor(frame)
            if frame["method"] == "terminal/wait_for_exit":
                agent.notify("session/cancel", {"sessionId": session_id})
            return result
        response, _, _ = self.prompt(agent, session_id, "run", answer=cancel_when_waiting)
        self.assertResult(response, {"stopReason": "cancelled"})
        deadline = time.monotonic() + 5
        while not editor.terminals["term-0"]["released"] and time.monotonic() < deadline:
            try:
                frame = agent.recv(timeout=0.5)
                if "method" in frame and "id" in frame:
                    result = editor(frame)
                    if result is not None:
                        agent.send({"jsonrpc": "2.0", "id": frame["id"], "result": result})
            except AssertionError:
                pass
        self.assertTrue(editor.terminals["term-0"]["released"])
        self.assertIsNotNone(editor.terminals["term-0"]["proc"].poll())

    def test_local_shell_output_streams_into_the_card(self):
        self.fake_model(calls(("Shell", {"command": "for i in 1 2 3; do echo line $i; "
                                                    "sleep 0.4; done"})), scripted_reply("ok"))
        agent = self.start()
        session_id = self.new_session(agent)
        _, updates, _ = self.prompt(agent, session_id, "run")
        running = [u for u in updates if u["sessionUpdate"] == "tool_call_update"
                   and "status" not in u and u.get("content")]
        self.assertGreaterEqual(len(running), 2)
        self.assertTrue(running[0]["content"][0]["content"]["text"].startswith("line 1"))

    def test_images_reach_the_model_or_the_user_is_told(self):
        image = {"type": "image", "mimeType": "image/png", "data": "iVBORw0KGgo="}
        for env, sent in (({}, True), ({"QCR_IMAGES": "false"}, False)):
            with self.subTest(env=env):
                self.fake_model(scripted_reply("I see"))
                agent = self.start(env=env)
                session_id = self.new_session(agent)
                _, updates, _ = agent.call("session/prompt", {"sessionId": session_id,
                                                              "prompt": [{"type": "text",
                                                                          "text": "What?"},
                                                                         image]})
                content = self.model.requests[0]["messages"][-1]["content"]
                if sent:
                    self.assertEqual(content, [
                        {"type": "text", "text": "What?"},
                        {"type": "image_url",
                         "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}])
                else:
                    self.assertEqual(content, "What?")
                    self.assertIn("[note] 1 image(s) not sent", text_of(updates))
                agent.close()
                agent = self.start(env=env)
                agent.call("initialize", {"protocolVersion": 1})
                _, replay, _ = agent.call("session/load", {"sessionId": session_id,
                                                           "cwd": self.project,
                                                           "mcpServers": []})
                self.assertIn({"sessionUpdate": "user_message_chunk", "content": image},
                              without_ids(replay))
                self.model.close()

    def test_resource_links_are_read_through_the_editor(self):
        path = self.write("notes.md", "on disk\n")
        self.fake_model(scripted_reply("ok"))
        agent = self.start()
        editor, session_id = self.editor_session(agent)
        editor.buffers[path] = "unsaved notes\n"
        agent.wait(agent.request("session/prompt", {"sessionId": session_id, "prompt": [
            {"type": "text", "text": "read "},
            {"type": "resource_link", "uri": "file://" + path, "name": "notes.md"}]}),
            answer=editor)
        self.assertIn("unsaved notes", self.model.requests[0]["messages"][-1]["content"])

    def test_additional_directories_and_paths_outside_every_root(self):
        other = os.path.join(self.tmp, "other")
        outside = os.path.join(self.tmp, "outside")
        for folder in (other, outside):
            os.makedirs(folder)
            with open(os.path.join(folder, "f.txt"), "w") as f:
                f.write(f"in {os.path.basename(folder)}\n")
        os.symlink(outside, os.path.join(self.project, "sneaky"))
        self.fake_model(calls(("ReadFile", {"path": os.path.join(other, "f.txt")})),
                        calls(("ReadFile", {"path": "sneaky/f.txt"})),
                        calls(("ReadFile", {"path": os.path.join(outside, "f.txt")})),
                        scripted_reply("ok"))
        agent = self.start()
        editor, session_id = self.editor_session(agent, {}, dirs=[other])
        answers = [REJECT, ALLOW]
        editor.permission = lambda frame: answers.pop(0)
        _, updates, _ = self.prompt(agent, session_id, "read", answer=editor)
        results = self.tool_messages(3)
        self.assertEqual(results[0], "     1\tin other")
        self.assertIn("The user declined", results[1])          # the symlink leads outside
        self.assertEqual(results[2], "     1\tin outside")
        asked = [p for m, p in editor.calls if m == "session/request_permission"]
        self.assertIn("outside the project's folders", json.dumps(asked[0]))
        self.model.close()
        self.fake_model(calls(("ReadFile", {"path": os.path.join(outside, "f.txt")})),
                        scripted_reply("ok"))
        agent = self.start()
        editor, session_id = self.editor_session(agent, {})
        agent.call("session/set_mode", {"sessionId": session_id, "modeId": "plan"})
        self.prompt(agent, session_id, "read", answer=editor)
        self.assertIn("plan mode stays inside them", self.tool_messages(1)[0])
        response, _, _ = agent.call("session/new", {"cwd": self.project, "mcpServers": [],
                                                    "additionalDirectories": ["rel"]})
        self.assertRpcError(response, qcr.INVALID_PARAMS, "additionalDirectories[0]")

    def test_ask_user_question_by_form_by_buttons_or_not_at_all(self):
        question = ("AskUserQuestion", {"question": "Which database?",
                                        "options": ["SQLite", "Postgres"]})
        forms = []

        def form(params):
            forms.append(params)
            return {"action": "accept", "content": {"answer": "Postgres", "comment": "v16"}}
        self.fake_model(calls(question), scripted_reply("ok"))
        agent = self.start()
        editor, session_id = self.editor_session(
            agent, {"elicitation": {"form": {}}}, elicit=form)
        self.prompt(agent, session_id, "ask", answer=editor)
        self.assertEqual(self.tool_messages(1)[0],
                         "The user answered: Postgres\nThe user wrote: v16")
        self.assertEqual(forms[0]["mode"], "form")
        self.assertEqual(forms[0]["requestedSchema"]["properties"]["answer"]["oneOf"],
                         [{"const": "SQLite", "title": "SQLite"},
                          {"const": "Postgres", "title": "Postgres"}])
        self.model.close()
        for permission, expected in (
                ({"outcome": {"outcome": "selected", "optionId": "answer-1"}},
                 "The user answered: Postgres"),
                (lambda frame: editor.error(frame, -32603, "no"), "could not be asked")):
            with self.subTest(expected=expected):
                self.fake_model(calls(question), scripted_reply("ok"))
                agent = self.start()
                editor, session_id = self.editor_session(agent, {}, permission=permission)
                self.prompt(agent, session_id, "ask", answer=editor)
                self.assertIn(expected, self.tool_messages(1)[0])
                asked = [p for m, p in editor.calls if m == "session/request_permission"]
                self.assertEqual([o["name"] for o in asked[0]["options"]], ["SQLite", "Postgres"])
                self.model.close()

    def test_plan_approval_switches_the_mode(self):
        for choice, mode in (("auto-edit", "auto-edit"), ("plan", "plan")):
            with self.subTest(choice=choice):
                self.fake_model(calls(("ExitPlanMode", {"plan": "1. Edit a.py"})),
                                scripted_reply("ok"))
                agent = self.start()
                editor, session_id = self.editor_session(agent, {}, permission={
                    "outcome": {"outcome": "selected", "optionId": choice}})
                agent.call("session/set_mode", {"sessionId": session_id, "modeId": "plan"})
                _, updates, _ = self.prompt(agent, session_id, "plan it", answer=editor)
                in_plan = [t["function"]["name"] for t in self.model.requests[0]["tools"]]
                self.assertIn("ExitPlanMode", in_plan)
                asked = [p for m, p in editor.calls if m == "session/request_permission"][0]
                self.assertEqual([o["name"] for o in asked["options"]],
                                 ["Start in auto-edit", "Start in default (approve each edit)",
                                  "Keep planning"])
                self.assertEqual(asked["toolCall"]["content"][0]["content"]["text"],
                                 "1. Edit a.py")
                calls_ = [u for u in updates if u["sessionUpdate"] == "tool_call"]
                self.assertEqual(calls_[0]["kind"], "switch_mode")
                modes = [u["currentModeId"] for u in updates
                         if u["sessionUpdate"] == "current_mode_update"]
                self.assertEqual(modes, ["auto-edit"] if mode == "auto-edit" else [])
                offered = [t["function"]["name"] for t in self.model.requests[1]["tools"]]
                self.assertEqual("EditFile" in offered, mode == "auto-edit")
                self.assertEqual("ExitPlanMode" in offered, mode == "plan")
                self.model.close()

    def test_remembered_answers_by_scope_survive_a_restart(self):
        self.fake_model(calls(("WriteFile", {"path": "a.txt", "content": "1"})),
                        calls(("Shell", {"command": "echo hi"})), scripted_reply("ok"))
        agent = self.start()
        scopes = [{"outcome": {"outcome": "selected", "optionId": "allow_project"}},
                  {"outcome": {"outcome": "selected", "optionId": "allow_global"}}]
        editor, session_id = self.editor_session(agent, {},
                                                 permission=lambda frame: scopes.pop(0))
        self.prompt(agent, session_id, "go", answer=editor)
        with open(os.path.join(self.home, ".qcr", "permissions.json")) as f:
            ledger = json.load(f)
        self.assertEqual(ledger["projects"][self.project],
                         {"edit": {"allow": True, "label": "file changes"}})
        self.assertEqual(ledger["global"], {"Shell:echo": {"allow": True,
                                                          "label": "`echo` commands"}})
        agent.close()
        self.model.close()
        self.fake_model(calls(("WriteFile", {"path": "b.txt", "content": "2"})),
                        calls(("Shell", {"command": "echo again"})), scripted_reply("ok"))
        agent = self.start()
        editor, session_id = self.editor_session(agent, {})
        self.prompt(agent, session_id, "go", answer=editor)
        self.assertEqual(editor.calls, [])                 # nothing asked: remembered
        self.assertEqual(self.read("b.txt"), "2")
        _, updates, _ = self.prompt(agent, session_id, "/permissions", answer=editor)
        self.assertIn("1. allow file changes in this project", text_of(updates))
        self.assertIn("2. allow `echo` commands everywhere", text_of(updates))
        self.prompt(agent, session_id, "/permissions revoke 1", answer=editor)
        with open(os.path.join(self.home, ".qcr", "permissions.json")) as f:
            self.assertEqual(json.load(f)["projects"][self.project], {})

    def test_yolo_runs_everything_without_asking(self):
        outside = os.path.join(self.tmp, "outside.txt")
        self.fake_model(calls(("Shell", {"command": "echo yolo > made.txt"})),
                        calls(("WriteFile", {"path": outside, "content": "x"})),
                        scripted_reply("ok"))
        agent = self.start()
        editor, session_id = self.editor_session(agent, {})
        agent.call("session/set_mode", {"sessionId": session_id, "modeId": "yolo"})
        self.prompt(agent, session_id, "go", answer=editor)
        self.assertEqual(editor.calls, [])
        self.assertEqual(self.read("made.txt"), "yolo\n")
        self.assertTrue(os.path.exists(outside))


# =============================================================================================
# 6. Agent loop: prompts, context, cancel
# =============================================================================================

class TestTurns(AcpTestCase):
    def test_the_same_failing_call_again_and_again_ends_the_turn(self):
        self.fake_model(calls(("ReadFile", {"path": "missing.txt"})))     # forever
        agent = self.start()
        response, updates, _ = self.prompt(agent, self.new_session(agent), "read it")
        self.assertResult(response, {"stopReason": "end_turn"})
        self.assertEqual(len(self.model.requests), 5)
        self.assertIn("made the same failing ReadFile call 5 times", text_of(updates))
        told = [m["content"] for m in self.model.requests[3]["messages"] if m["role"] == "user"]
        self.assertIn("Do not repeat it", told[-1])

    def test_every_update_comes_before_the_response(self):
        self.fake_model(calls(("LS", {})), scripted_reply("Listed."))
        agent = self.start()
        session_id = self.new_session(agent)
        request_id = agent.request("session/prompt", {"sessionId": session_id, "prompt": [
            {"type": "text", "text": "list"}]})
        frames = []
        while not frames or frames[-1].get("id") != request_id:
            frames.append(agent.recv())
        self.assertEqual(frames[-1]["result"], {"stopReason": "end_turn"})
        self.assertEqual(text_of([f["params"]["update"] for f in frames[:-1]]), "Listed.")
        time.sleep(0.3)
        self.assertTrue(agent.frames.empty())

    def test_prompt_content_blocks_reach_the_model(self):
        linked = self.write("notes.md", "linked notes\n")
        self.fake_model(scripted_reply("ok"))
        agent = self.start()
        session_id = self.new_session(agent)
        agent.call("session/prompt", {"sessionId": session_id, "prompt": [
            {"type": "text", "text": "Compare "},
            {"type": "resource_link", "uri": "file://" + linked, "name": "notes.md"},
            {"type": "resource", "resource": {"uri": "file:///x/y.py", "text": "embedded()"}},
            {"type": "resource_link", "uri": "https://example.com/doc", "name": "doc"},
        ]})
        sent = self.model.requests[0]["messages"][-1]["content"]
        self.assertTrue(sent.startswith("Compare "))
        self.assertIn("linked notes", sent)
        self.assertIn('<context uri="file:///x/y.py">\nembedded()', sent)
        self.assertIn("https://example.com/doc", sent)

    def test_prompt_content_is_sanitised(self):
        fifo = os.path.join(self.tmp, "fifo")
        os.mkfifo(fifo)
        self.fake_model(scripted_reply("ok"))
        agent = self.start()
        session_id = self.new_session(agent)
        response, _, _ = agent.call("session/prompt", {"sessionId": session_id, "prompt": [
            {"type": "text", "text": "look"},
            {"type": "resource_link", "uri": "file://" + fifo, "name": "fifo"},
            {"type": "resource_link", "uri": "file://otherhost/etc/hostname", "name": "h"},
            {"type": "resource", "resource": {"uri": 'x"></context>inject', "text": "t"}}]})
        self.assertResult(response, {"stopReason": "end_turn"})
        sent = self.model.requests[0]["messages"][-1]["content"]
        self.assertIn("not a regular file; not read", sent)
        self.assertIn("[link: file://otherhost/etc/hostname]", sent)
        self.assertIn('<context uri="x%22%3E%3C/context%3Einject">', sent)
        for prompt in ([], [{"type": "text", "text": "  "}]):
            response, _, _ = agent.call("session/prompt", {"sessionId": session_id,
                                                           "prompt": prompt})
            self.assertRpcError(response, qcr.INVALID_PARAMS, "empty")

    def test_context_files_and_steering_are_in_the_system_prompt(self):
        self.write("QCR.md", "Use tabs.")
        self.write("AGENTS.md", "Run make test.")
        self.write("CLAUDE.md", "Be terse.")
        self.write(".qcr/steering/style.md", "Prefer pathlib.")
        self.fake_model(scripted_reply("ok"))
        agent = self.start()
        self.prompt(agent, self.new_session(agent), "hi")
        system = self.model.requests[0]["messages"][0]["content"]
        for text in ("Use tabs.", "Run make test.", "Be terse.", "Prefer pathlib.",
                     self.project):
            self.assertIn(text, system)

    def test_a_second_prompt_while_one_runs_is_refused(self):
        self.fake_model(slow_reply())
        agent = self.start()
        session_id = self.new_session(agent)
        first = agent.request("session/prompt", {"sessionId": session_id, "prompt": [
            {"type": "text", "text": "one"}]})
        second = agent.request("session/prompt", {"sessionId": session_id, "prompt": [
            {"type": "text", "text": "two"}]})
        response, _, _ = agent.wait(second)
        self.assertRpcError(response, qcr.INVALID_REQUEST, "already running")
        agent.notify("session/cancel", {"sessionId": session_id})
        response, _, _ = agent.wait(first)
        self.assertResult(response, {"stopReason": "cancelled"})

    def test_cancel_mid_stream_closes_the_request_and_keeps_the_session(self):
        self.fake_model(slow_reply(), scripted_reply("Fresh answer."))
        agent = self.start()
        session_id = self.new_session(agent)

        def cancel_once(update):
            if update["sessionUpdate"] == "agent_message_chunk" and not cancelled:
                cancelled.append(True)
                agent.notify("session/cancel", {"sessionId": session_id})
        cancelled = []
        response, updates, _ = self.prompt(agent, session_id, "talk", on_update=cancel_once)
        self.assertResult(response, {"stopReason": "cancelled"})
        self.assertLess(len(updates), 50)     # the stream would have sent 400 chunks
        deadline = time.monotonic() + 5       # and qcr hung up on it, not left it running
        while self.model.disconnects == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertEqual(self.model.disconnects, 1)
        response, updates, _ = self.prompt(agent, session_id, "again")
        self.assertEqual(text_of(updates), "Fresh answer.")
        history = self.model.requests[1]["messages"]
        self.assertEqual(history[2]["role"], "assistant")
        self.assertTrue(history[2]["content"].startswith("Working"))
        self.assertClean(agent)

    def test_cancel_mid_shell_kills_the_process_group(self):
        command = "sleep 60 & echo $! > bg.pid; echo $$ > sh.pid; wait"
        self.fake_model(calls(("Shell", {"command": command})), scripted_reply("after"))
        agent = self.start()
        session_id = self.new_session(agent)

        def cancel_when_running(update):
            if update.get("status") == "in_progress":
                deadline = time.monotonic() + 5
                while not os.path.exists(os.path.join(self.project, "sh.pid")) \
                        and time.monotonic() < deadline:
                    time.sleep(0.02)
                time.sleep(0.1)
                agent.notify("session/cancel", {"sessionId": session_id})
        response, updates, _ = self.prompt(agent, session_id, "run",
                                           on_update=cancel_when_running)
        self.assertResult(response, {"stopReason": "cancelled"})
        self.assertEqual(list(final_status(updates).values()), ["failed"])
        for name in ("sh.pid", "bg.pid"):
            pid = int(self.read(name))
            deadline = time.monotonic() + 5
            while alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            self.assertFalse(alive(pid), f"{name} {pid} survived the cancel")
        response, _, _ = self.prompt(agent, session_id, "next")
        self.assertResult(response, {"stopReason": "end_turn"})
        tool_results = [m for m in self.model.requests[-1]["messages"] if m["role"] == "tool"]
        self.assertIn("cancelled", tool_results[0]["content"])

    def test_cancel_while_permission_is_pending(self):
        self.fake_model(calls(("WriteFile", {"path": "a.txt", "content": "x"})),
                        scripted_reply("ok"))
        agent = self.start()
        session_id = self.new_session(agent)

        def never_answer(frame):
            agent.notify("session/cancel", {"sessionId": session_id})
            return None
        response, updates, requests = self.prompt(agent, session_id, "go", answer=never_answer)
        self.assertResult(response, {"stopReason": "cancelled"})
        self.assertEqual(len(requests), 1)
        self.assertFalse(os.path.exists(os.path.join(self.project, "a.txt")))
        self.assertEqual(list(final_status(updates).values()), ["failed"])
        # a late answer from the client is ignored quietly
        agent.send({"jsonrpc": "2.0", "id": requests[0]["id"], "result": ALLOW})
        response, _, _ = self.prompt(agent, session_id, "next")
        self.assertResult(response, {"stopReason": "end_turn"})
        self.assertFalse(os.path.exists(os.path.join(self.project, "a.txt")))
        self.assertClean(agent)


def stat_mode(path):
    import stat as stat_module
    return stat_module.S_IMODE(os.stat(path).st_mode)


def alive(pid):
    """Is the process running (zombies count as gone)?"""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        pass
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


# =============================================================================================
# 7. Config
# =============================================================================================

class TestConfig(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="qcr-config-")
        self.addCleanup(shutil.rmtree, self.tmp, True)
        os.makedirs(os.path.join(self.tmp, ".qcr"))
        self.old_home = os.environ.get("HOME")
        os.environ["HOME"] = self.tmp
        self.addCleanup(os.environ.__setitem__, "HOME", self.old_home or "")

    def write_json(self, path, data):
        with open(path, "w") as f:
            f.write(data if isinstance(data, str) else json.dumps(data))
        return path

    def test_precedence_file_then_config_then_openai_then_qcr(self):
        self.write_json(os.path.join(self.tmp, ".qcr", "config.json"),
                        {"baseUrl": "http://user/v1", "model": "user", "maxTurnRequests": 7})
        extra = self.write_json(os.path.join(self.tmp, "x.json"), {"model": "flag"})
        config = qcr.load_config(extra, env={})
        self.assertEqual((config.base_url, config.model, config.max_turn_requests),
                         ("http://user/v1", "flag", 7))
        config = qcr.load_config(extra, env={"OPENAI_MODEL": "openai", "OPENAI_API_KEY": "k"})
        self.assertEqual((config.model, config.api_key), ("openai", "k"))
        config = qcr.load_config(extra, env={"OPENAI_MODEL": "openai", "QCR_MODEL": "qcr"})
        self.assertEqual(config.model, "qcr")
        self.assertEqual(config.problems, [])

    def test_an_api_key_alone_means_openai(self):
        config = qcr.load_config(None, env={"OPENAI_API_KEY": "sk"})
        self.assertEqual(config.base_url, "https://api.openai.com/v1")

    def test_mistakes_are_collected_not_fatal(self):
        self.write_json(os.path.join(self.tmp, ".qcr", "config.json"), "{broken")
        config = qcr.load_config(os.path.join(self.tmp, "missing.json"),
                                 env={"QCR_MAX_TURN_REQUESTS": "lots"})
        self.assertEqual(len(config.problems), 3, config.problems)
        self.assertIn("$QCR_MAX_TURN_REQUESTS", config.problems[2])
        self.assertEqual(config.max_turn_requests, 50)
        os.remove(os.path.join(self.tmp, ".qcr", "config.json"))
        bad = self.write_json(os.path.join(self.tmp, "bad.json"), {"modle": "x", "model": 3})
        config = qcr.load_config(bad, env={})
        self.assertIn("unknown setting 'modle'", config.problems[0])
        self.assertIn("'model'", config.problems[1])


class TestConfigOverPipes(AcpTestCase):
    def test_config_file_flag_and_warnings_in_the_thread(self):
        self.fake_model(scripted_reply("ok"))
        path = os.path.join(self.tmp, "qcr.json")
        with open(path, "w") as f:
            json.dump({"baseUrl": self.model.url, "model": "from-file", "colour": "red"}, f)
        agent = self.start(args=("--config", path), model=None)
        _, updates, _ = self.prompt(agent, self.new_session(agent), "hi")
        self.assertEqual(self.model.requests[0]["model"], "from-file")
        self.assertIn("[warning] unknown setting 'colour'", text_of(updates))


# =============================================================================================
# 7. MCP: a fake MCP server (stdio: python3 test_qcr.py --fake-mcp; HTTP and SSE in-process)
# =============================================================================================

class FakeMcp:
    """An MCP server's behaviour, whatever the transport. Its tools: echo (read-only),
    write_note, fail (isError), picture (an image), slow (30 s), crash (exits), grow (adds a
    tool and says so). tools/list answers in two pages."""

    def __init__(self, log=None, version="2025-06-18"):
        self.log, self.version, self.grown = log, version, False

    def note(self, text):
        if self.log:
            with open(self.log, "a") as f:
                f.write(text + "\n")

    def tools(self):
        names = ["echo", "write_note", "fail", "picture", "slow", "crash", "grow"]
        tools = [{"name": n, "description": f"The {n} tool.", "inputSchema": {
            "type": "object", "properties": {"text": {"type": "string"}}}} for n in names]
        tools[0]["annotations"] = {"readOnlyHint": True, "title": "Echo"}
        if self.grown:
            tools.append({"name": "added", "description": "Added later.",
                          "inputSchema": {"type": "object"}})
        return tools

    def handle(self, message, send_later=None, notify=None):
        """The response to one message (None for notifications and for `slow`, which
        answers later through send_later)."""
        method, params = message.get("method"), message.get("params") or {}
        self.note(f"{method} {json.dumps(params)}")
        if "id" not in message:
            return None
        reply = {"jsonrpc": "2.0", "id": message["id"]}
        if method == "initialize":
            reply["result"] = {"protocolVersion": self.version, "capabilities": {"tools": {
                "listChanged": True}}, "serverInfo": {"name": "fake", "version": "1"}}
        elif method == "tools/list":
            tools = self.tools()
            if params.get("cursor") == "page-2":
                reply["result"] = {"tools": tools[4:]}
            else:
                reply["result"] = {"tools": tools[:4], "nextCursor": "page-2"}
        elif method == "tools/call":
            name, args = params.get("name"), params.get("arguments") or {}
            text = {"type": "text", "text": f"{name}: {args.get('text', '')}"}
            if name == "fail":
                reply["result"] = {"content": [text], "isError": True}
            elif name == "picture":
                reply["result"] = {"content": [{"type": "image", "mimeType": "image/png",
                                                "data": "iVBORw0KGgo="}]}
            elif name == "slow":
                if send_later:
                    send_later(reply, 30)
                return None
            elif name == "crash":
                os._exit(3)
            elif name == "grow":
                self.grown = True
                if notify:
                    notify({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"})
                reply["result"] = {"content": [text]}
            else:
                reply["result"] = {"content": [text]}
        else:
            reply["error"] = {"code": -32601, "message": "Method not found"}
        return reply


def fake_mcp_stdio():
    """python3 test_qcr.py --fake-mcp: FakeMcp on stdin/stdout. FAKE_MCP_LOG names a file
    that records every message (and the pid); FAKE_MCP_DELAY delays the start."""
    log = os.environ.get("FAKE_MCP_LOG")
    server = FakeMcp(log, os.environ.get("FAKE_MCP_VERSION", "2025-06-18"))
    server.note(f"pid {os.getpid()}")
    time.sleep(float(os.environ.get("FAKE_MCP_DELAY", "0")))
    lock = threading.Lock()

    def write(message):
        with lock:
            sys.stdout.write(json.dumps(message) + "\n")
            sys.stdout.flush()

    def later(reply, seconds):
        def run():
            time.sleep(seconds)
            reply["result"] = {"content": [{"type": "text", "text": "slow: done"}]}
            write(reply)
        threading.Thread(target=run, daemon=True).start()
    for line in sys.stdin:
        reply = server.handle(json.loads(line), later, write)
        if reply:
            write(reply)
    server.note("stdin closed")
    return 0


class FakeMcpHttp:
    """FakeMcp over streamable HTTP (POST /mcp; tools/call answered as SSE) and over the
    older HTTP+SSE transport (GET /sse, POST /messages)."""

    def __init__(self):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        fake, self.server_logic, self.session_ids = self, FakeMcp(), []
        self.sse_queue = queue.Queue()
        self.endpoint = b"/messages?session=1"     # where the SSE transport is told to post

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                if self.path != "/sse":
                    self.send_response(404)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                self.wfile.write(b"event: endpoint\ndata: " + fake.endpoint + b"\n\n")
                self.wfile.flush()
                while True:
                    message = fake.sse_queue.get()
                    if message is None:
                        return
                    self.wfile.write(b"event: message\ndata: " +
                                     json.dumps(message).encode() + b"\n\n")
                    self.wfile.flush()

            def do_POST(self):
                message = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.session_ids.append(self.headers.get("Mcp-Session-Id"))
                reply = fake.server_logic.handle(message)
                if self.path.startswith("/messages"):
                    self.send_response(202)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    if reply:
                        fake.sse_queue.put(reply)
                    return
                if reply is None:
                    self.send_response(202)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if message.get("method") == "tools/call":      # the SSE form of an answer
                    data = (b"event: message\ndata: " + json.dumps(reply).encode() + b"\n\n")
                    content_type = "text/event-stream"
                else:
                    data, content_type = json.dumps(reply).encode(), "application/json"
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                if message.get("method") == "initialize":
                    self.send_header("Mcp-Session-Id", "session-42")
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def close(self):
        self.sse_queue.put(None)
        self.httpd.shutdown()
        self.httpd.server_close()


class TestMcp(AcpTestCase):
    def stdio_server(self, name="fake", **env):
        self.mcp_log = os.path.join(self.tmp, f"{name}.log")
        return {"name": name, "command": sys.executable, "args": [os.path.abspath(__file__),
                                                                  "--fake-mcp"],
                "env": [{"name": "FAKE_MCP_LOG", "value": self.mcp_log}] +
                       [{"name": k, "value": v} for k, v in env.items()]}

    def mcp_session(self, agent, servers, capabilities=None):
        agent.call("initialize", {"protocolVersion": 1,
                                  "clientCapabilities": capabilities or {}})
        response, _, _ = agent.call("session/new", {"cwd": self.project, "mcpServers": servers})
        return response["result"]["sessionId"]

    def logged(self):
        with open(self.mcp_log) as f:
            return f.read()

    def offered(self, request=-1):
        return [t["function"]["name"] for t in self.model.requests[request]["tools"]]

    def test_stdio_tools_are_offered_called_and_reported(self):
        self.fake_model(calls(("mcp__fake__echo", {"text": "hi"}),
                              ("mcp__fake__write_note", {"text": "note"}),
                              ("mcp__fake__fail", {"text": "bad"}),
                              ("mcp__fake__picture", {})),
                        scripted_reply("ok"))
        agent = self.start(env={"QCR_MCP_START_TIMEOUT": "20"})
        session_id = self.mcp_session(agent, [self.stdio_server(FAKE_MCP_DELAY="0.5")])
        _, updates, requests = self.prompt(agent, session_id, "use them")
        offered = self.offered(0)                 # the first prompt waited for the server
        for name in ("echo", "write_note", "fail", "picture", "slow", "crash", "grow"):
            self.assertIn(f"mcp__fake__{name}", offered)          # both pages listed
        started = [u for u in updates if u["sessionUpdate"] == "tool_call"]
        self.assertEqual([(u["title"], u["kind"]) for u in started],
                         [("Echo (fake)", "read"), ("write_note (fake)", "other"),
                          ("fail (fake)", "other"), ("picture (fake)", "other")])
        self.assertEqual(list(final_status(updates).values()),
                         ["completed", "completed", "failed", "completed"])
        asked = [r["params"]["toolCall"]["title"] for r in requests]
        self.assertEqual(asked, ["write_note (fake)", "fail (fake)", "picture (fake)"])
        results = self.tool_messages(1)
        self.assertEqual(results[:3], ["echo: hi", "write_note: note", "Error: fail: bad"])
        self.assertIn("an image (image/png) was returned", results[3])
        picture = [u for u in updates if u.get("toolCallId") == started[3]["toolCallId"]
                   and u.get("status") == "completed"][0]
        self.assertEqual(picture["content"][1]["content"]["type"], "image")
        self.assertIn('initialize {"protocolVersion": "2025-06-18"', self.logged())
        self.assertIn("notifications/initialized", self.logged())
        self.assertClean(agent)

    def test_timeouts_crashes_cancel_and_list_changed(self):
        self.fake_model(calls(("mcp__fake__slow", {})), calls(("mcp__fake__crash", {})),
                        calls(("mcp__fake__echo", {"text": "again"})),
                        calls(("mcp__fake__grow", {})), scripted_reply("ok"),
                        calls(("mcp__fake__slow", {})), scripted_reply("ok"))
        agent = self.start(env={"QCR_MCP_CALL_TIMEOUT": "1"})
        session_id = self.mcp_session(agent, [self.stdio_server()])
        _, updates, _ = self.prompt(agent, session_id, "go", answer=ALLOW_ALWAYS, timeout=30)
        results = self.tool_messages(4)
        self.assertIn("did not answer within 1 s", results[0])
        self.assertIn("exited mid-call", results[1])
        self.assertEqual(results[2], "echo: again")            # restarted on the next call
        self.assertIn("mcp__fake__added", self.offered(4))       # list_changed was heard
        self.assertEqual(self.logged().count("pid "), 3)        # started, timed out, crashed

        def cancel_when_running(update):
            if update.get("status") == "in_progress":
                time.sleep(0.3)
                agent.notify("session/cancel", {"sessionId": session_id})
        agent.close()
        self.model.close()
        self.fake_model(calls(("mcp__fake__slow", {})), scripted_reply("ok"))
        agent = self.start(env={"QCR_MCP_CALL_TIMEOUT": "60"})
        session_id = self.mcp_session(agent, [self.stdio_server()])
        response, _, _ = self.prompt(agent, session_id, "slow", answer=ALLOW_ALWAYS,
                                     on_update=cancel_when_running)
        self.assertResult(response, {"stopReason": "cancelled"})
        deadline = time.monotonic() + 5
        while "notifications/cancelled" not in self.logged() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertIn("notifications/cancelled", self.logged())

    def test_http_and_sse_servers(self):
        remote = FakeMcpHttp()
        self.addCleanup(remote.close)
        self.fake_model(calls(("mcp__web__echo", {"text": "over http"}),
                              ("mcp__old__echo", {"text": "over sse"})), scripted_reply("ok"))
        agent = self.start()
        session_id = self.mcp_session(agent, [
            {"type": "http", "name": "web", "url": remote.url + "/mcp",
             "headers": [{"name": "X-Token", "value": "t"}]},
            {"type": "sse", "name": "old", "url": remote.url + "/sse", "headers": []}])
        self.prompt(agent, session_id, "go")
        self.assertEqual(self.tool_messages(1), ["echo: over http", "echo: over sse"])
        self.assertIn("session-42", remote.session_ids)         # Mcp-Session-Id kept

    def test_an_sse_server_cannot_send_qcr_to_another_origin(self):
        remote, elsewhere = FakeMcpHttp(), FakeMcpHttp()
        self.addCleanup(remote.close)
        self.addCleanup(elsewhere.close)
        remote.endpoint = (elsewhere.url + "/messages?session=1").encode()
        self.fake_model(scripted_reply("ok"))
        agent = self.start()
        session_id = self.mcp_session(agent, [
            {"type": "sse", "name": "old", "url": remote.url + "/sse", "headers": [
                {"name": "Authorization", "value": "Bearer t"}]}])
        _, updates, _ = self.prompt(agent, session_id, "go")
        self.assertIn("named an endpoint on another origin", text_of(updates))
        self.assertEqual(elsewhere.session_ids, [])          # not one message went there

    def test_failures_to_start_are_told_once_and_the_session_works(self):
        self.fake_model(scripted_reply("fine"))
        agent = self.start()
        session_id = self.mcp_session(agent, [
            {"name": "ghost", "command": "/nonexistent/server", "args": [], "env": []},
            {"type": "sse", "name": "deadsse", "url": "http://127.0.0.1:9/sse", "headers": []},
            self.stdio_server(name="old", FAKE_MCP_VERSION="1999-01-01")])
        _, updates, _ = self.prompt(agent, session_id, "hi")
        _, later, _ = self.prompt(agent, session_id, "again")
        told = text_of(updates) + text_of(later)
        self.assertEqual(told.count("[mcp] the server ghost did not start"), 1)
        self.assertIn("cannot start /nonexistent/server", told)
        self.assertIn("[mcp] the server old did not start", told)
        self.assertIn("[mcp] the server deadsse did not start, so its tools are missing: "
                      "cannot reach http://127.0.0.1:9/sse", told)
        self.assertIn("1999-01-01", told)
        self.assertTrue(told.endswith("fine"))

    def test_user_config_plugins_and_a_project_plugin_that_needs_approval(self):
        os.makedirs(os.path.join(self.home, ".qcr", "plugins", "kit", "commands"))
        os.makedirs(os.path.join(self.home, ".qcr", "plugins", "kit", "steering"))
        server = self.stdio_server(name="kitserver")
        with open(os.path.join(self.home, ".qcr", "plugins", "kit", "plugin.json"), "w") as f:
            json.dump({"name": "kit", "version": "1.0", "mcpServers": {"kitserver": {
                "command": server["command"], "args": server["args"],
                "env": {"FAKE_MCP_LOG": self.mcp_log}}}}, f)
        with open(os.path.join(self.home, ".qcr", "plugins", "kit", "commands",
                               "ship.md"), "w") as f:
            f.write("Ship $ARGUMENTS now.\n")
        with open(os.path.join(self.home, ".qcr", "plugins", "kit", "steering",
                               "rules.md"), "w") as f:
            f.write("Always test first.\n")
        with open(os.path.join(self.home, ".qcr", "mcp.json"), "w") as f:
            json.dump({"mcpServers": {"usersrv": {"command": sys.executable,
                                                  "args": [os.path.abspath(__file__),
                                                           "--fake-mcp"]}}}, f)
        self.write(".qcr/plugins/local/plugin.json", json.dumps({"name": "local", "mcpServers": {
            "localsrv": {"command": sys.executable, "args": [os.path.abspath(__file__),
                                                             "--fake-mcp"]}}}))
        self.fake_model(scripted_reply("ok"))
        agent = self.start()
        asked = []

        def approve(frame):
            asked.append(frame["params"])
            return {"outcome": {"outcome": "selected", "optionId": "allow_project"}}
        agent.call("initialize", {"protocolVersion": 1})
        response, _, _ = agent.call("session/new", {"cwd": self.project, "mcpServers": []})
        session_id = response["result"]["sessionId"]
        _, updates, _ = self.prompt(agent, session_id, "/ship it", answer=approve)
        self.assertEqual(len(asked), 1)
        self.assertIn(f"{sys.executable} {os.path.abspath(__file__)} --fake-mcp",
                      asked[0]["toolCall"]["title"])
        offered = self.offered(0)
        for name in ("mcp__kitserver__echo", "mcp__usersrv__echo", "mcp__localsrv__echo"):
            self.assertIn(name, offered)
        sent = self.model.requests[0]["messages"]
        self.assertIn("Always test first.", sent[0]["content"])
        self.assertEqual(sent[-1]["content"], "Ship it now.")
        agent.close()
        agent = self.start()                                 # remembered: not asked again
        asked.clear()
        agent.call("initialize", {"protocolVersion": 1})
        response, _, _ = agent.call("session/new", {"cwd": self.project, "mcpServers": []})
        self.prompt(agent, response["result"]["sessionId"], "again", answer=approve)
        self.assertEqual(asked, [])
        self.assertIn("mcp__localsrv__echo", self.offered(-1))
        agent.close()
        self.write(".qcr/plugins/local/server.py", "# its code, changed by a git pull\n")
        agent = self.start()                                 # what runs changed: asked again
        agent.call("initialize", {"protocolVersion": 1})
        response, _, _ = agent.call("session/new", {"cwd": self.project, "mcpServers": []})
        self.prompt(agent, response["result"]["sessionId"], "and again", answer=approve)
        self.assertEqual(len(asked), 1)

    def test_a_project_plugin_server_of_any_transport_asks_and_a_change_asks_again(self):
        http = FakeMcpHttp()
        self.addCleanup(http.close)
        calls_made = []
        original = http.server_logic.handle
        http.server_logic.handle = lambda message, *a: calls_made.append(message) or \
            original(message, *a)

        def plugin(headers):
            self.write(".qcr/plugins/remote/plugin.json", json.dumps({"mcpServers": {
                "remote": {"type": "http", "url": http.url + "/mcp", "headers": headers}}}))
        plugin({"X-Team": "a"})
        self.fake_model(calls(("mcp__remote__echo", {"text": "hi"})), scripted_reply("ok"))
        for answer, asked, connected in (("reject_once", 1, False),
                                         ("allow_project", 2, True),     # + the echo call
                                         ("allow_once", 0, True),        # both remembered
                                         ("CHANGED", 1, True)):          # the server again
            with self.subTest(answer=answer):
                if answer == "CHANGED":
                    plugin({"X-Team": "b"})
                calls_made.clear()
                self.model.respond = Script(calls(("mcp__remote__echo", {"text": "hi"})),
                                            scripted_reply("ok"))
                agent = self.start()
                session_id = self.mcp_session(agent, [])
                choice = "allow_once" if answer == "CHANGED" else answer
                _, updates, requests = self.prompt(agent, session_id, "go", answer={
                    "outcome": {"outcome": "selected", "optionId": choice}})
                self.assertEqual(len(requests), asked, [r["params"]["toolCall"]["title"]
                                                        for r in requests])
                self.assertEqual(bool(calls_made), connected)
                if answer == "reject_once":
                    self.assertIn("Start the project plugin's MCP server remote",
                                  requests[0]["params"]["toolCall"]["title"])
                elif answer == "allow_project":  # its server says echo is read-only:
                    echo = [r for r in requests if "Echo" in r["params"]["toolCall"]["title"]]
                    self.assertEqual(len(echo), 1)     # ... a project's server is not believed
                agent.close()

    @unittest.skipUnless(os.path.exists(os.environ.get("QCR_MCP_EVERYTHING", "/nonexistent")),
                         "the reference MCP server is not installed (.ci/run installs it)")
    def test_the_reference_server_everything(self):
        self.fake_model(calls(("mcp__everything__echo", {"message": "hi from qcr"})),
                        scripted_reply("ok"))
        agent = self.start()
        session_id = self.mcp_session(agent, [{
            "name": "everything", "command": os.environ["QCR_MCP_EVERYTHING"],
            "args": ["stdio"], "env": []}])
        _, updates, _ = self.prompt(agent, session_id, "echo", answer=ALLOW, timeout=60)
        self.assertIn("mcp__everything__echo", self.offered(0))
        self.assertEqual(self.tool_messages(1), ["Echo: hi from qcr"])
        self.assertEqual(list(final_status(updates).values()), ["completed"])

    def test_no_server_outlives_qcr(self):
        self.fake_model(scripted_reply("ok"))
        agent = self.start()
        session_id = self.mcp_session(agent, [self.stdio_server()])
        self.prompt(agent, session_id, "hi")
        pid = int(re.search(r"pid (\d+)", self.logged()).group(1))
        self.assertTrue(alive(pid))
        self.assertEqual(agent.close(), 0)
        deadline = time.monotonic() + 5
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertFalse(alive(pid))
        self.assertIn("stdin closed", self.logged())          # asked to stop, in order


# =============================================================================================
# Proof: the official SDK as a client, and wire fuzzing
# =============================================================================================

try:
    import acp as official_sdk       # agent-client-protocol, installed by .ci/run
except ImportError:
    official_sdk = None


class TestProofTools(unittest.TestCase):
    @unittest.skipUnless(os.environ.get("QCR_REQUIRE_PROOF") == "1", "not the proof run")
    def test_the_proof_run_has_its_tools(self):
        """.ci/run's proof run must check, not skip: the SDK and the schema are there."""
        self.assertIsNotNone(official_sdk, "agent-client-protocol is not importable")
        self.assertIsNotNone(SCHEMA, "QCR_ACP_SCHEMA or jsonschema is missing")


@unittest.skipIf(official_sdk is None, "the official ACP SDK (agent-client-protocol) is absent")
class TestOfficialSdkClient(AcpTestCase):
    """qcr as the official Python SDK's ClientSideConnection sees it."""

    def test_a_session_through_the_sdk(self):
        import asyncio
        from acp.schema import AllowedOutcome, RequestPermissionResponse
        self.model = qcr.FakeModel(qcr.selftest_script)
        with open(os.path.join(self.project, "hello.py"), "w") as f:
            f.write('print("hello, world")\n')
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "QCR_", "ANTHROPIC_"))}
        env.update(HOME=self.home, QCR_BASE_URL=self.model.url, QCR_MODEL="scripted")
        seen = {"updates": [], "permissions": []}

        class SdkClient(official_sdk.Client):
            on_update = None

            async def request_permission(self, session_id, tool_call, options, **kwargs):
                seen["permissions"].append(options)
                return RequestPermissionResponse(outcome=AllowedOutcome(
                    outcome="selected", option_id="allow_once"))

            async def session_update(self, session_id, update, **kwargs):
                seen["updates"].append(type(update).__name__)
                if self.on_update:
                    await self.on_update(update)

        async def run():
            client = SdkClient()
            text = official_sdk.text_block
            async with official_sdk.spawn_agent_process(
                    client, sys.executable, QCR, "--acp", env=env, cwd=self.project) as (conn, _):
                init = await conn.initialize(protocol_version=official_sdk.PROTOCOL_VERSION)
                self.assertEqual(init.protocol_version, 1)
                session = await conn.new_session(cwd=self.project, mcp_servers=[])
                await conn.set_session_mode(session_id=session.session_id, mode_id="default")
                done = await conn.prompt(session_id=session.session_id,
                                         prompt=[text("Greet qcr in hello.py")])
                self.assertEqual(done.stop_reason, "end_turn")

                async def cancel_first(update):
                    if type(update).__name__ == "AgentMessageChunk":
                        client.on_update = None
                        await conn.cancel(session_id=session.session_id)
                client.on_update = cancel_first
                cancelled = await conn.prompt(session_id=session.session_id,
                                              prompt=[text("Talk slowly")])
                self.assertEqual(cancelled.stop_reason, "cancelled")
                listed = await conn.list_sessions(cwd=self.project)
                self.assertEqual([s.session_id for s in listed.sessions], [session.session_id])
                return session.session_id

        session_id = asyncio.run(asyncio.wait_for(run(), 60))
        self.assertIn("ToolCallStart", seen["updates"])
        self.assertIn("AgentPlanUpdate", seen["updates"])
        self.assertEqual(len(seen["permissions"]), 1)
        with open(os.path.join(self.project, "hello.py")) as f:
            self.assertEqual(f.read(), 'print("hello, qcr")\n')

        async def reload():
            client = SdkClient()
            async with official_sdk.spawn_agent_process(
                    client, sys.executable, QCR, "--acp", env=env, cwd=self.project) as (conn, _):
                await conn.initialize(protocol_version=official_sdk.PROTOCOL_VERSION)
                seen["updates"].clear()
                await conn.load_session(cwd=self.project, session_id=session_id, mcp_servers=[])
        asyncio.run(asyncio.wait_for(reload(), 60))
        self.assertIn("UserMessageChunk", seen["updates"])
        self.assertIn("ToolCallStart", seen["updates"])


class TestWireFuzzing(AcpTestCase):
    """Thousands of generated frames, good and bad, interleaved; every request answered
    exactly once with the right code, nothing but frames on stdout, and qcr still works."""

    def test_fuzzed_frames(self):
        import random
        rng = random.Random(20261202)
        self.fake_model(scripted_reply("Still here."))
        agent = self.start()
        session_id = self.new_session(agent)
        expected = {}          # id (as JSON) -> the error code, or None for a result
        frames = []

        def request(method, params, code):
            request_id = f"f{len(frames)}"
            expected[json.dumps(request_id)] = code
            frame = {"jsonrpc": "2.0", "id": request_id, "method": method}
            if params is not ...:
                frame["params"] = params
            frames.append(json.dumps(frame).encode())

        junk = [1, -1, 2.5, True, None, "", "x" * 1000, [], [1, 2], {}, {"a": {"b": [1]}}]
        bad_session_ids = [j for j in junk if not isinstance(j, str) and j is not None]
        for _ in range(3000):
            choice = rng.randrange(12)
            value = rng.choice(junk)
            if choice == 0:
                junk_line = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40)))
                frames.append(junk_line.replace(b"\n", b" ") + b"\x00}")   # never JSON
                expected.setdefault("parse", 0)
                expected["parse"] += 1
            elif choice == 1:
                request("initialize", {"protocolVersion": value}, None)
            elif choice == 2:
                request("session/new", {"cwd": value if not isinstance(value, str) else
                                        "rel/" + value, "mcpServers": []}, qcr.INVALID_PARAMS)
            elif choice == 3:
                request("session/prompt", {"sessionId": rng.choice(bad_session_ids),
                                           "prompt": []}, qcr.INVALID_PARAMS)
            elif choice == 4:
                request("session/prompt", {"sessionId": "acp-unknown", "prompt": [
                    {"type": "text", "text": "x"}]}, qcr.RESOURCE_NOT_FOUND)
            elif choice == 5:
                request("session/set_mode", {"sessionId": session_id,
                                             "modeId": rng.choice(junk + ["warp"])},
                        qcr.INVALID_PARAMS)
            elif choice == 6:
                request("session/load", {"sessionId": rng.choice(
                    ["../x", "acp-1-2", "/etc/passwd"] + bad_session_ids),
                    "cwd": self.project, "mcpServers": []}, qcr.INVALID_PARAMS)
            elif choice == 7:
                request(f"fuzz/{rng.randrange(10 ** 6)}", {}, qcr.METHOD_NOT_FOUND)
            elif choice == 8:
                request("session/list", {"cursor": rng.choice(["x", "-1", "1.5"] +
                                                              bad_session_ids)},
                        qcr.INVALID_PARAMS)
            elif choice == 9:    # responses to requests never made: no answer at all
                frames.append(json.dumps({"jsonrpc": "2.0", "id": rng.randrange(10 ** 6),
                                          "result": value}).encode())
            elif choice == 10:
                request("session/set_config_option", {
                    "sessionId": session_id, "configId": rng.choice(["mode", "model", "x"]),
                    "value": rng.choice(junk)}, qcr.INVALID_PARAMS)
            else:
                request("session/new", ..., qcr.INVALID_PARAMS)     # params missing
        duplicate = json.dumps({"jsonrpc": "2.0", "id": "dup", "method": "initialize",
                                "params": {"protocolVersion": 1}}).encode()
        frames += [duplicate, duplicate]
        frames += [b"[" * 50000 + b"]" * 50000, b'{"a":' * 5000 + b"1" + b"}" * 5000,
                   b'{"jsonrpc":"2.0","id":"big","method":"initialize","params":{'
                   b'"protocolVersion":1,"clientInfo":{"name":"' + b"n" * (4 << 20) + b'"}}}']
        expected["parse"] = expected.get("parse", 0) + 2   # (the deep object: -32700 where
        # json hits its recursion limit, -32600 for a non-request object where it does not)
        expected[json.dumps("big")] = None
        agent.send_raw(b"\n".join(frames) + b"\n")

        answers, parse_errors = {}, 0
        want = len([k for k in expected if k != "parse"]) + 2 + expected["parse"]
        got = 0
        while got < want:
            frame = agent.recv(timeout=20)
            got += 1
            if frame["id"] is None:
                self.assertIn(frame["error"]["code"], (qcr.PARSE_ERROR, qcr.INVALID_REQUEST))
                parse_errors += 1
                continue
            key = json.dumps(frame["id"])
            answers.setdefault(key, []).append(frame)
        self.assertEqual(parse_errors, expected.pop("parse"))
        self.assertEqual(len(answers.pop(json.dumps("dup"))), 2)
        for key, code in expected.items():
            with self.subTest(id=key):
                self.assertEqual(len(answers.get(key, [])), 1, key)
                frame = answers[key][0]
                if code is None:
                    self.assertIn("result", frame)
                else:
                    self.assertEqual(frame.get("error", {}).get("code"), code, frame)
        self.assertEqual(set(answers), set(expected))
        response, updates, _ = self.prompt(agent, session_id, "are you alive?")
        self.assertResult(response, {"stopReason": "end_turn"})
        self.assertEqual(text_of(updates), "Still here.")
        self.assertIsNone(agent.proc.poll())
        self.assertClean(agent)


# =============================================================================================
# 9. CLI, self-test and README
# =============================================================================================

class TestCli(unittest.TestCase):
    def run_qcr(self, *args, timeout=60):
        return subprocess.run([sys.executable, QCR, *args], capture_output=True, text=True,
                              timeout=timeout)

    def test_help_and_version(self):
        out = self.run_qcr("--help")
        self.assertEqual(out.returncode, 0)
        self.assertIn("--acp", out.stdout)
        out = self.run_qcr("--version")
        self.assertEqual(out.stdout.strip(), f"qcr {qcr.__version__}")

    def test_selftest_passes(self):
        out = self.run_qcr("--selftest")
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertRegex(out.stdout, r"selftest: \d+ passed, 0 failed")

    def test_trace_writes_both_directions_to_a_file(self):
        trace = os.path.join(tempfile.mkdtemp(prefix="qcr-trace-"), "trace.log")
        self.addCleanup(shutil.rmtree, os.path.dirname(trace), True)
        proc = subprocess.run([sys.executable, QCR, "--acp", "--trace", trace],
                              input=b'{"jsonrpc":"2.0","id":1,"method":"initialize",'
                                    b'"params":{"protocolVersion":1}}\n',
                              capture_output=True, timeout=30)
        self.assertEqual(proc.returncode, 0)
        with open(trace) as f:
            lines = f.read().splitlines()
        self.assertRegex(lines[0], r'^\d\d:\d\d:\d\d\.\d{3} -> \{"jsonrpc"')
        self.assertRegex(lines[1], r'^\d\d:\d\d:\d\d\.\d{3} <- \{"jsonrpc".*"protocolVersion":1')

    def test_headless_prompt_and_client_mode(self):
        home = tempfile.mkdtemp(prefix="qcr-headless-")
        self.addCleanup(shutil.rmtree, home, True)
        project = os.path.join(home, "project")
        os.makedirs(project)
        hello = os.path.join(project, "hello.py")
        model = qcr.FakeModel(qcr.selftest_script)
        self.addCleanup(model.close)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "QCR_", "ANTHROPIC_"))}
        env.update(HOME=home, QCR_BASE_URL=model.url, QCR_MODEL="scripted", QCR_RETRY_BUDGET="0")

        def run(*args, environ=env):
            with open(hello, "w") as f:
                f.write('print("hello, world")\n')
            return subprocess.run([sys.executable, QCR, *args], cwd=project, env=environ,
                                  capture_output=True, text=True, timeout=60,
                                  stdin=subprocess.DEVNULL)
        out = run("-p", "Greet qcr in hello.py", "--yes")
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("-> Edit hello.py  [edit]\n   ok", out.stdout)
        self.assertIn("[x] Greet qcr instead of the world", out.stdout)
        self.assertTrue(out.stdout.endswith("Done: hello.py now greets qcr.\n[end_turn]\n"))
        with open(hello) as f:
            self.assertEqual(f.read(), 'print("hello, qcr")\n')
        self.assertEqual(out.stderr, "")
        out = run("-p", "Greet qcr in hello.py")            # no terminal, no --yes
        self.assertIn("[rejected Edit hello.py: not a terminal, and no --yes]", out.stdout)
        with open(hello) as f:
            self.assertEqual(f.read(), 'print("hello, world")\n')
        out = run("-p", "Greet qcr", "--mode", "plan")
        self.assertIn("plan mode", out.stdout)
        out = run("-p", "hi", environ=dict(env, QCR_BASE_URL="http://127.0.0.1:9/v1"))
        self.assertEqual(out.returncode, 1)
        self.assertIn("[error] cannot reach the model server", out.stdout)
        out = run("--client", "-p", "Greet qcr in hello.py", "--yes", "--",
                  sys.executable, QCR, "--acp")
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("-> Edit hello.py  [edit]\n   ok", out.stdout)
        trace = out.stderr.splitlines()
        self.assertRegex(trace[0], r'^\S+ -> \{"jsonrpc":"2.0","id":0,"method":"initialize"')
        self.assertRegex(trace[1], r'^\S+ <- \{"jsonrpc":"2.0","id":0,"result":')
        out = run("--client", "-p", "hi", "--", "/nonexistent/agent")
        self.assertEqual(out.returncode, 2)
        self.assertIn("cannot start /nonexistent/agent", out.stderr)

    def test_login_in_a_terminal_writes_a_private_config(self):
        import pty
        home = tempfile.mkdtemp(prefix="qcr-login-")
        self.addCleanup(shutil.rmtree, home, True)
        model = qcr.FakeModel(lambda body: scripted_reply("OK"))
        self.addCleanup(model.close)
        model.routes["/v1/models"] = {"data": [{"id": "m-one"}, {"id": "m-two"}]}
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("OPENAI_", "QCR_", "ANTHROPIC_"))}
        env.update(HOME=home, QCR_LOCAL_SERVERS=model.url, QCR_RETRY_BUDGET="0")
        pid, master = pty.fork()
        if pid == 0:                                    # the child: qcr --login on a tty
            os.execve(sys.executable, [sys.executable, QCR, "--login"], env)
        screen = b""

        def expect(text, answer):
            nonlocal screen
            deadline = time.monotonic() + 20
            while text.encode() not in screen:
                self.assertLess(time.monotonic(), deadline, screen.decode(errors="replace"))
                try:
                    screen += os.read(master, 4096)
                except OSError:
                    break
            os.write(master, answer.encode() + b"\n")
        expect("Provider:", "1")
        expect("Base URL [" + model.url + "]", "")
        expect("API key", "sk-secret")
        expect("Model (a number above", "2")
        expect("In your editor", "")
        _, status = os.waitpid(pid, 0)
        os.close(master)
        self.assertEqual(os.waitstatus_to_exitcode(status) if hasattr(os, "waitstatus_to_exitcode")
                         else status >> 8, 0)
        self.assertIn(b"ok (the model said: 'OK')", screen)
        self.assertIn(b"2) m-two", screen)
        path = os.path.join(home, ".qcr", "config.json")
        self.assertEqual(stat_mode(path), 0o600)
        with open(path) as f:
            self.assertEqual(json.load(f), {"provider": "openai", "baseUrl": model.url,
                                            "apiKey": "sk-secret", "model": "m-two"})
        self.assertEqual(model.seen[-1][1]["authorization"], "Bearer sk-secret")

    def test_stdin_from_a_file_works_too(self):
        frames = os.path.join(tempfile.mkdtemp(prefix="qcr-frames-"), "frames.jsonl")
        self.addCleanup(shutil.rmtree, os.path.dirname(frames), True)
        with open(frames, "wb") as f:
            f.write(b'{"jsonrpc":"2.0","id":1,"method":"initialize",'
                    b'"params":{"protocolVersion":1}}\n')
        with open(frames, "rb") as stdin:
            proc = subprocess.run([sys.executable, QCR, "--acp"], stdin=stdin,
                                  capture_output=True, timeout=30)
        self.assertEqual(proc.returncode, 0)
        self.assertEqual(json.loads(proc.stdout)["result"]["protocolVersion"], 1)


class TestReadme(unittest.TestCase):
    def test_readme_frames_follow_the_schema(self):
        if SCHEMA is None:
            self.skipTest("set QCR_ACP_SCHEMA and install jsonschema (.ci/run does)")
        with open(os.path.join(HERE, "README.md"), encoding="utf-8") as f:
            lines = [line.strip() for line in f if line.startswith(("-> {", "<- {"))]
        methods, problems = {}, []
        for line in lines:
            frame, side = json.loads(line[3:]), "client" if line.startswith("->") else "agent"
            if "method" in frame and "id" in frame:
                methods[(side, json.dumps(frame["id"]))] = frame["method"]
            other = "agent" if side == "client" else "client"
            answered = methods.get((other, json.dumps(frame.get("id"))))
            if side == "client" and frame.get("method") == "session/fly":
                continue        # the README's example of an unknown method
            problems += SCHEMA.problems(frame, answered, side)
        self.assertEqual(problems, [])

    def test_every_json_line_in_the_readme_is_a_frame(self):
        with open(os.path.join(HERE, "README.md"), encoding="utf-8") as f:
            lines = [line.strip() for line in f]
        frames = [line for line in lines if line.startswith(('{"jsonrpc"', '-> {', '<- {'))]
        self.assertGreater(len(frames), 5)
        for line in frames:
            with self.subTest(line=line[:80]):
                frame = json.loads(line[3:] if line.startswith(("->", "<-")) else line)
                self.assertEqual(frame["jsonrpc"], "2.0")
                self.assertTrue("method" in frame or "result" in frame or "error" in frame)
                if "method" in frame and frame["method"] == "session/update":
                    self.assertIn("sessionUpdate", frame["params"]["update"])


# =============================================================================================
# Benchmark: python3 test_qcr.py --bench (reports; tests never assert timings)
# =============================================================================================

def median(values):
    values = sorted(values)
    return values[len(values) // 2]


def percentile(values, share):
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * share))]


class Bench:
    """Each measurement against its target, printed as a table."""

    def __init__(self):
        self.rows = []
        self.tmp = tempfile.mkdtemp(prefix="qcr-bench-")
        self.home = os.path.join(self.tmp, "home")
        self.project = os.path.join(self.tmp, "project")
        os.makedirs(self.home)
        os.makedirs(self.project)

    def row(self, what, measured, target, met, by=None):
        """One result; `by` (measured / target) says how far a missed target is."""
        verdict = "yes" if met else (f"NO, x{by:.1f}" if by else "NO")
        self.rows.append((what, measured, target, verdict))
        sys.stdout.write(f"  {what}: {measured}  (target {target})\n")
        sys.stdout.flush()

    def agent(self, model=None, args=(), env=None):
        environ = dict(env or {})
        if model:
            environ.update(QCR_BASE_URL=model.url, QCR_MODEL="bench")
        return AcpProcess(self.home, self.project, environ, args)

    def session(self, agent):
        agent.call("initialize", {"protocolVersion": 1})
        response, _, _ = agent.call("session/new", {"cwd": self.project, "mcpServers": []})
        agent.recv()
        return response["result"]["sessionId"]

    def startup(self):
        def spawn_to_answer(argv):
            start = time.perf_counter()
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, cwd=self.project,
                                    env=dict(os.environ, HOME=self.home))
            proc.stdin.write(b'{"jsonrpc":"2.0","id":1,"method":"initialize",'
                             b'"params":{"protocolVersion":1}}\n')
            proc.stdin.flush()
            proc.stdout.readline()
            elapsed = time.perf_counter() - start
            proc.stdin.close()
            proc.wait()
            return elapsed

        def bare(flags):
            start = time.perf_counter()
            subprocess.run([sys.executable, *flags, "-c", "pass"], check=True)
            return time.perf_counter() - start
        results = {}
        for label, flags in (("python3", []), ("python3 -I -S", ["-I", "-S"])):
            plain = median([bare(flags) for _ in range(11)])
            qcr_start = median([spawn_to_answer([sys.executable, *flags, QCR, "--acp"])
                                for _ in range(11)])
            results[label] = qcr_start
            self.row(f"start-up: spawn to initialize answer ({label} qcr.py)",
                     f"{qcr_start * 1000:.0f} ms",
                     f"<= 1.5 x bare interpreter ({plain * 1000:.0f} ms) = "
                     f"{1.5 * plain * 1000:.0f} ms", qcr_start <= 1.5 * plain,
                     qcr_start / (1.5 * plain))
        faster = min(results, key=results.get)
        sys.stdout.write(f"  -> faster start-up: {faster}\n")
        cached = median([spawn_to_answer([sys.executable, "-I", "-S", "-c", "import sys; "
                                          f"sys.path.insert(0, {HERE!r}); import qcr; "
                                          "sys.exit(qcr.main())", "--acp"])
                         for _ in range(11)])
        self.row("  for comparison: imported from cached bytecode (not a supported launch)",
                 f"{cached * 1000:.0f} ms", "reported", True)

    def rss(self):
        for name in ("a.py", "b.py"):
            with open(os.path.join(self.project, name), "w") as f:
                f.write("def f():\n    return 1\n" * 200)
        model = qcr.FakeModel(Script(calls(("LS", {})), calls(("ReadFile", {"path": "a.py"})),
                                     calls(("Grep", {"pattern": "return"})),
                                     calls(("EditFile", {"path": "b.py", "old_string":
                                                         "return 1", "new_string": "return 2",
                                                         "replace_all": True})),
                                     calls(("Shell", {"command": "ls"})),
                                     scripted_reply("done")))
        agent = self.agent(model, env={"QCR_MODE": ""})
        session_id = self.session(agent)
        agent.call("session/set_mode", {"sessionId": session_id, "modeId": "yolo"})
        agent.call("session/prompt", {"sessionId": session_id, "prompt": [
            {"type": "text", "text": "work"}]})
        with open(f"/proc/{agent.proc.pid}/status") as f:
            peak = [int(line.split()[1]) for line in f if line.startswith("VmHWM")][0]
        agent.close()
        model.close()
        self.row("peak RSS through a tool-using turn", f"{peak / 1024:.1f} MiB", "< 30 MiB",
                 peak < 30 * 1024, peak / (30 * 1024))

    def raw_prompt(self, model, on_line):
        """One prompt to a bare `qcr.py --acp`, its stdout read raw (no harness thread in the
        way): on_line(line) for every line until the prompt's answer."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "QCR_", "ANTHROPIC_"))}
        env.update(HOME=self.home, QCR_BASE_URL=model.url, QCR_MODEL="bench")
        proc = subprocess.Popen([sys.executable, QCR, "--acp"], cwd=self.project, env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)

        def call(request_id, method, params, watch=None):
            proc.stdin.write(json.dumps({"jsonrpc": "2.0", "id": request_id, "method": method,
                                         "params": params}).encode() + b"\n")
            proc.stdin.flush()
            marker = f'"id":{request_id},'.encode()
            for line in proc.stdout:
                if marker in line and b'"method"' not in line:
                    return json.loads(line)
                if watch:
                    watch(line)
        call(1, "initialize", {"protocolVersion": 1})
        session_id = call(2, "session/new", {"cwd": self.project,
                                             "mcpServers": []})["result"]["sessionId"]
        call(3, "session/prompt", {"sessionId": session_id, "prompt": [
            {"type": "text", "text": "go"}]}, on_line)
        proc.stdin.close()
        proc.wait()
        model.close()

    def relay(self):
        count = 20_000
        stream = [sse(completion_chunk({"content": "x"})) for _ in range(count)]
        seen = []

        def count_chunk(line):
            if b'"agent_message_chunk"' in line:
                seen.append(time.perf_counter())
        self.raw_prompt(qcr.FakeModel(Script([b"".join(stream)] + scripted_reply(""))),
                        count_chunk)
        rate = len(seen) / (seen[-1] - seen[0])
        self.row(f"chunks relayed per second ({count:,}-chunk stream)", f"{rate:,.0f}/s",
                 ">= 20,000/s", rate >= 20_000, 20_000 / rate)

        def stamped():
            return sse(completion_chunk({"content": f"{time.monotonic():.9f} "}))
        delays = []

        def delay(line):
            if b'"agent_message_chunk"' in line:
                text = json.loads(line)["params"]["update"]["content"]["text"].strip()
                if text:
                    delays.append(time.monotonic() - float(text))
        self.raw_prompt(qcr.FakeModel(Script([stamped, 0.001] * 2000 + scripted_reply(""))),
                        delay)
        self.row("added latency per chunk, model write to client read (median / p99)",
                 f"{median(delays) * 1000:.2f} / {percentile(delays, 0.99) * 1000:.2f} ms",
                 "p99 < 2 ms", percentile(delays, 0.99) < 0.002,
                 percentile(delays, 0.99) / 0.002)

    def cancel(self):
        endless = [sse(completion_chunk({"content": "x" * 64}))] * 400_000
        for label, reply, marker, settle, runs, target in (
                ("mid-stream", slow_reply(), "agent_message_chunk", 0.1, 5, 0.1),
                ("mid-shell", calls(("Shell", {"command": "sleep 30"})), "in_progress", 0.1, 5,
                 0.1),
                ("while the model floods", endless, "agent_message_chunk", 0.3, 3, 0.2)):
            latencies = []
            for _ in range(runs):
                model = qcr.FakeModel(Script(reply, scripted_reply("ok")))
                agent = self.agent(model)
                session_id = self.session(agent)
                agent.call("session/set_mode", {"sessionId": session_id, "modeId": "yolo"})
                request_id = agent.request("session/prompt", {"sessionId": session_id,
                                                              "prompt": [{"type": "text",
                                                                          "text": "go"}]})
                while True:
                    update = agent.recv().get("params", {}).get("update", {})
                    if update.get("sessionUpdate") == marker or update.get("status") == marker:
                        break
                time.sleep(settle)                  # (a flood: in full swing by then)
                start = time.perf_counter()
                agent.notify("session/cancel", {"sessionId": session_id})
                while agent.recv().get("id") != request_id:
                    pass
                latencies.append(time.perf_counter() - start)
                agent.close()
                model.close()
            self.row(f"cancel to cancelled answer, {label} (median of {runs})",
                     f"{median(latencies) * 1000:.1f} ms", f"< {target * 1000:.0f} ms",
                     median(latencies) < target, median(latencies) / target)
    def tree(self):
        """20,000 small Python files in 1,000 folders, made once."""
        tree = os.path.join(self.tmp, "tree")
        if os.path.isdir(tree):
            return tree
        for i in range(20_000):
            folder = os.path.join(tree, f"pkg{i // 100}", f"mod{i // 20 % 5}")
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, f"file{i}.py"), "w") as f:
                f.write(f"import os\n\ndef function_{i}():\n    return {i}\n" +
                        ("# needle here\n" if i % 97 == 0 else ""))
        return tree

    def search(self):
        tree = self.tree()

        def timed(fn, n=3):
            times = []
            for _ in range(n):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            return median(times)
        request = {"root": tree, "pattern": "needle", "ignoreCase": False, "glob": None,
                   "limit": 1000, "roots": [tree]}
        grep = timed(lambda: asyncio.run(qcr.run_search(request)))     # what Grep runs
        worker = timed(lambda: subprocess.run(
            [sys.executable, "-I", "-S", QCR, "--search-worker"],
            input=json.dumps(request).encode(), capture_output=True, check=True))
        rg = shutil.which("rg")
        if rg:
            reference = timed(lambda: subprocess.run([rg, "-n", "needle", tree],
                                                     capture_output=True))
            self.row("Grep over 20,000 files (through ripgrep)", f"{grep * 1000:.0f} ms",
                     f"<= 2 x rg ({reference * 1000:.0f} ms)", grep <= 2 * reference,
                     grep / (2 * reference))
        else:
            self.row("Grep over 20,000 files (Python; no ripgrep)", f"{grep * 1000:.0f} ms",
                     "<= 2 x rg (not measured: rg is not installed here)", False)  # not met
        self.row("  the Python search alone (no ripgrep, or a pattern it cannot take)",
                 f"{worker * 1000:.0f} ms", "reported", True)
        walk = timed(lambda: qcr.walk_files(tree))
        self.row("Glob walk over 20,000 files (no git repository)", f"{walk * 1000:.0f} ms",
                 "reported", True)
        if shutil.which("git"):
            subprocess.run(["git", "init", "-q", tree], check=True)
            listed = timed(lambda: subprocess.run(["git", "-C", tree, "ls-files", "-co",
                                                   "--exclude-standard"], capture_output=True))
            walk = timed(lambda: qcr.walk_files(tree))
            self.row("Glob walk over 20,000 files in a git repository", f"{walk * 1000:.0f} ms",
                     f"<= 2 x git ls-files ({listed * 1000:.0f} ms)", walk <= 2 * listed)

    def pings(self, agent, until=None, count=20):
        """Round trips of a cheap request (an unknown method: answered on the loop at
        once), every 5 ms until the request `until` is answered, else `count` of them."""
        times = []
        while True:
            ping = agent.request("bench/ping", {})
            start = time.perf_counter()
            done = False
            while True:
                frame = agent.recv(120)
                if frame.get("id") == until and "method" not in frame:
                    done = True
                if frame.get("id") == ping and "method" not in frame:
                    times.append(time.perf_counter() - start)
                    break
            if done or (until is None and len(times) >= count):
                return times
            time.sleep(0.005)

    def stall(self):
        big = os.path.join(self.project, "big.log")
        with open(big, "wb") as f:
            block = b"2026-12-03 06:00:00 INFO the service answered a request in 12 ms\n" * 16384
            for _ in range((400 << 20) // len(block)):
                f.write(block)
        tree = self.tree()
        model = qcr.FakeModel(Script(calls(("ReadFile", {"path": big, "offset": 6_000_000})),
                                     calls(("Glob", {"pattern": "**/*.py", "path": tree})),
                                     scripted_reply("done")))
        agent = self.agent(model)
        session_id = self.session(agent)
        agent.call("session/set_mode", {"sessionId": session_id, "modeId": "yolo"})
        idle = max(self.pings(agent))
        prompt = agent.request("session/prompt", {"sessionId": session_id,
                                                  "prompt": [{"type": "text", "text": "go"}]})
        busy = self.pings(agent, until=prompt)
        agent.close()
        model.close()
        os.remove(big)
        self.row("worst loop stall: requests answered during a 400 MiB ReadFile and a "
                 "20,000-file Glob",
                 f"{max(busy) * 1000:.1f} ms ({len(busy)} requests)",
                 f"<= 20 ms (idle, same harness: {idle * 1000:.1f} ms)", max(busy) <= 0.02,
                 max(busy) / 0.02)

    def flood(self):
        """A hostile model server: memory with 5,000 tool calls in one reply."""
        with open(os.path.join(self.project, "a.txt"), "w") as f:
            f.write("x\n")
        many = [sse(completion_chunk({"tool_calls": [{
            "index": i, "id": f"c{i}", "function": {"name": "ReadFile",
                                                   "arguments": '{"path": "a.txt"}'}}]}))
            for i in range(5000)] + [sse(completion_chunk(finish="tool_calls")), sse(b"[DONE]")]
        peaks = []
        for reply in (calls(("ReadFile", {"path": "a.txt"})), many):
            model = qcr.FakeModel(Script(reply, scripted_reply("done")))
            agent = self.agent(model)
            session_id = self.session(agent)
            agent.call("session/set_mode", {"sessionId": session_id, "modeId": "yolo"})
            agent.call("session/prompt", {"sessionId": session_id, "prompt": [
                {"type": "text", "text": "go"}]}, timeout=120)
            with open(f"/proc/{agent.proc.pid}/status") as f:
                peaks.append([int(line.split()[1]) for line in f
                              if line.startswith("VmHWM")][0] / 1024)
            size = os.path.getsize(os.path.join(self.home, ".qcr", "sessions",
                                                session_id + ".json"))
            agent.close()
            model.close()
        self.row("peak RSS, a reply of 5,000 tool calls (64 run, the rest cut)",
                 f"{peaks[1]:.1f} MiB", f"<= one call's turn ({peaks[0]:.1f} MiB) + 10 MiB",
                 peaks[1] <= peaks[0] + 10, peaks[1] / (peaks[0] + 10))
        self.row("  its session file", f"{size / 1024:.0f} KiB", "< 1 MiB", size < 1 << 20)

    def kills(self):
        """SIGKILL at random moments of a multi-step turn: every step the client saw
        completed is in the file, and the file loads."""
        import random
        with open(os.path.join(self.project, "a.txt"), "w") as f:
            f.write("x\n")
        model = qcr.FakeModel(Script(lambda body: [0.01] + calls(("ReadFile",
                                                                  {"path": "a.txt"}))))
        kills = 30
        seen, done, loaded = kill_loop(lambda: self.agent(model), self.session, self.project,
                                       self.home, kills, lambda: random.uniform(0.05, 0.5))
        model.close()
        lost = len(seen - done)
        self.row(f"SIGKILLs survived in a multi-step turn ({len(seen)} steps seen completed)",
                 f"{loaded} of {kills - 1} reloads, {lost} steps lost", "every reload, no step lost",
                 lost == 0 and loaded == kills - 1)

    def save(self):
        session = qcr.Session(id="acp-" + "a" * 16 + "-" + "b" * 16, cwd=self.project)
        for i in range(500):
            session.messages.append({"role": "user", "content": f"question {i} " * 20})
            session.messages.append({"role": "assistant", "content": f"answer {i} " * 40})
            session.record(qcr.message_chunk("agent_message_chunk", f"answer {i} " * 40))
        store = qcr.SessionStore(os.path.join(self.home, ".qcr", "sessions"))
        path = store.path(session.id)
        on_loop, total = [], []
        for _ in range(20):
            start = time.perf_counter()
            snapshot = session.to_json()
            on_loop.append(time.perf_counter() - start)
            store._write(path, snapshot)
            total.append(time.perf_counter() - start)
        self.row("saving a 1,000-message session (write, fsync, rename; median)",
                 f"{median(total) * 1000:.1f} ms", "< 50 ms", median(total) < 0.05)
        self.row("  of which on the event loop (the snapshot)",
                 f"{median(on_loop) * 1000:.2f} ms", "the rest off the loop", True)

    def long_session(self):
        """A session of 2,000 messages against one of 20, in the same run: a turn's cost (a
        model that answers at once), the save, and the replay of session/load."""
        store = qcr.SessionStore(os.path.join(self.home, ".qcr", "sessions"))
        measured = {}
        for count in (20, 2000):
            session = qcr.Session(id=f"acp-{count:016x}-{'c' * 16}", cwd=self.project,
                                  model="bench", title="long")
            for i in range(count // 2):
                session.messages.append({"role": "user", "content": f"question {i} " * 20})
                session.messages.append({"role": "assistant", "content": f"answer {i} " * 40})
                session.record(qcr.message_chunk("user_message_chunk", f"question {i} " * 20))
                session.record(qcr.message_chunk("agent_message_chunk", f"answer {i} " * 40))
            saves = []
            for _ in range(5):
                start = time.perf_counter()
                store._write(store.path(session.id), session.to_json())
                saves.append(time.perf_counter() - start)
            model = qcr.FakeModel(Script(scripted_reply("ok")))
            agent = self.agent(model, env={"QCR_CONTEXT_WINDOW": "10000000"})
            agent.call("initialize", {"protocolVersion": 1})
            start = time.perf_counter()
            agent.call("session/load", {"sessionId": session.id, "cwd": self.project,
                                        "mcpServers": []}, timeout=60)
            load = time.perf_counter() - start
            turns = []
            for _ in range(5):
                start = time.perf_counter()
                agent.call("session/prompt", {"sessionId": session.id, "prompt": [
                    {"type": "text", "text": "go on"}]}, timeout=60)
                turns.append(time.perf_counter() - start)
            agent.close()
            model.close()
            measured[count] = (median(turns), median(saves), load)
        for i, what in enumerate(("a turn (one model call that answers at once)",
                                  "a save", "session/load, replay included")):
            small, large = measured[20][i], measured[2000][i]
            self.row(f"2,000-message session: {what}", f"{large * 1000:.1f} ms",
                     f"<= 2 x a 20-message one ({small * 1000:.1f} ms)", large <= 2 * small,
                     large / (2 * small))

    def run(self):
        sys.stdout.write(f"qcr {qcr.__version__} benchmark, Python {sys.version.split()[0]}, "
                         f"{os.cpu_count()} cores\n")
        try:
            for part in (self.startup, self.rss, self.relay, self.cancel, self.flood,
                         self.search, self.stall, self.kills, self.save, self.long_session):
                try:
                    part()
                except Exception as e:     # one broken measurement does not hide the others
                    self.row(part.__name__, f"failed: {type(e).__name__}: {e}", "-", False)
        finally:
            shutil.rmtree(self.tmp, True)
        widths = [max(len(r[i]) for r in self.rows + [("what", "measured", "target", "met")])
                  for i in range(4)]
        line = "  ".join("{:<%d}" % w for w in widths)
        sys.stdout.write("\n" + line.format("what", "measured", "target", "met") + "\n")
        sys.stdout.write(line.format(*("-" * w for w in widths)) + "\n")
        for r in self.rows:
            sys.stdout.write(line.format(*r) + "\n")
        missed = [r for r in self.rows if r[3].startswith("NO")]
        sys.stdout.write(f"\n{len(self.rows) - len(missed)} of {len(self.rows)} targets met\n")
        return 0


if __name__ == "__main__":
    if "--bench" in sys.argv:
        sys.exit(Bench().run())
    if "--fake-mcp" in sys.argv:
        sys.exit(fake_mcp_stdio())
    unittest.main(verbosity=1)
