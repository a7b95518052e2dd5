#!/usr/bin/env python3
"""A stand-in for the clouds' instance metadata services, for tests only: no cloud is reachable
from this machine or CI. It speaks the requests and answers each provider documents for its
notices (and refuses requests without the headers the real services require):

- AWS IMDSv2: PUT /latest/api/token (X-aws-ec2-metadata-token-ttl-seconds) gives a token that
  every GET must carry (X-aws-ec2-metadata-token, else 401);
  /latest/meta-data/spot/instance-action and events/recommendations/rebalance are 404 until
  armed; events/maintenance/scheduled is a JSON list.
- GCP: /computeMetadata/v1/instance/{preempted,maintenance-event} need Metadata-Flavor: Google
  (else 403); with wait_for_change=true they hold the request until the value differs from
  last_etag (or timeout_sec passes) and answer with an ETag.
- Azure: /metadata/instance/compute/name and /metadata/scheduledevents need Metadata: true
  (else 400); a POST of {"StartRequests": [{"EventId": ...}]} acknowledges events.

Control (not part of any cloud's API): GET /_standin/arm?kind=<aws-spot|aws-rebalance|
aws-scheduled|gcp-preempted|gcp-maintenance|azure-preempt|azure-terminate>[&seconds=N] arms a
notice due in N seconds (default 120); GET /_standin/acks lists acknowledged Azure events;
GET /_standin/requests counts the requests served.

Several machines at once: a path may start with /<machine>/ (e.g. a node's name: the local
cluster's agents are given http://<host>:<port>/$(NODE_NAME)); each machine has its own notices
and, on Azure, is the VM of that name.

Usage: metadata-standin.py [--host H] [--port P] [--vm-name NAME]; prints "listening <port>".
"""
import argparse
import email.utils
import hashlib
import json
import sys
import threading
import time
import uuid
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

ROOTS = ("latest", "computeMetadata", "metadata", "_standin")


def new_state():
    return {
    "tokens": set(),
    "aws_spot": None,
    "aws_rebalance": None,
    "aws_scheduled": [],
    "gcp": {"preempted": "FALSE", "maintenance-event": "NONE"},
    "azure_events": [],
    "azure_incarnation": 1,
    "acks": [],
    "requests": 0,
}


MACHINES = {}
LOCK = threading.Condition()
VM_NAME = "stasis-standin-vm"


def rfc3339(t):
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def etag(v):
    return hashlib.sha256(v.encode()).hexdigest()[:16]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def route(self):
        """The URL with its machine prefix taken off; self.st and self.vm are that machine's."""
        u = urlparse(self.path)
        parts = u.path.split("/")
        machine = ""
        if len(parts) > 2 and parts[1] and parts[1] not in ROOTS:
            machine = parts[1]
            u = u._replace(path="/" + "/".join(parts[2:]))
        with LOCK:
            self.st = MACHINES.setdefault(machine, new_state())
        self.vm = machine or VM_NAME
        return u

    def send(self, code, body="", ctype="text/plain", headers=None):
        data = body.encode() if isinstance(body, str) else body
        try:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            # A client that gave up on a long poll (the agent asks again).
            self.close_connection = True

    def do_PUT(self):
        u = self.route()
        with LOCK:
            self.st["requests"] += 1
        if u.path == "/latest/api/token":
            ttl = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
            if not ttl or not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
                return self.send(400, "missing or invalid X-aws-ec2-metadata-token-ttl-seconds")
            tok = uuid.uuid4().hex
            with LOCK:
                self.st["tokens"].add(tok)
            return self.send(200, tok, headers={"X-aws-ec2-metadata-token-ttl-seconds": ttl})
        self.send(404, "not found")

    def do_POST(self):
        u = self.route()
        with LOCK:
            self.st["requests"] += 1
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n) if n else b""
        if u.path == "/metadata/scheduledevents":
            if self.headers.get("Metadata") != "true":
                return self.send(400, '{"error": "Bad request. Required metadata header not specified"}')
            try:
                req = json.loads(body)
                ids = [r["EventId"] for r in req["StartRequests"]]
            except (ValueError, KeyError, TypeError):
                return self.send(400, '{"error": "malformed StartRequests"}')
            with LOCK:
                self.st["acks"].extend(ids)
                self.st["azure_events"] = [e for e in self.st["azure_events"] if e["EventId"] not in ids]
                self.st["azure_incarnation"] += 1
            return self.send(200, "")
        self.send(404, "not found")

    def do_GET(self):
        u = self.route()
        with LOCK:
            self.st["requests"] += 1
        q = {k: v[0] for k, v in parse_qs(u.query).items()}
        p = u.path
        if p.startswith("/_standin/"):
            return self.control(p, q)
        if p.startswith("/latest/meta-data/"):
            with LOCK:
                ok = self.headers.get("X-aws-ec2-metadata-token") in self.st["tokens"]
            if not ok:
                return self.send(401, "")
            key = p[len("/latest/meta-data/"):]
            with LOCK:
                if key == "spot/instance-action":
                    v = self.st["aws_spot"]
                    return self.send(200, json.dumps(v), "application/json") if v else self.send(404, "")
                if key == "events/recommendations/rebalance":
                    v = self.st["aws_rebalance"]
                    return self.send(200, json.dumps(v), "application/json") if v else self.send(404, "")
                if key == "events/maintenance/scheduled":
                    return self.send(200, json.dumps(self.st["aws_scheduled"]), "application/json")
            return self.send(404, "")
        if p.startswith("/computeMetadata/v1/instance/"):
            if self.headers.get("Metadata-Flavor") != "Google":
                return self.send(403, "Missing Metadata-Flavor:Google header.")
            key = p[len("/computeMetadata/v1/instance/"):]
            if key not in ("preempted", "maintenance-event"):
                return self.send(404, "")
            deadline = time.time() + min(int(q.get("timeout_sec", "60")), 300)
            with LOCK:
                if q.get("wait_for_change") == "true":
                    last = q.get("last_etag")
                    while last is not None and etag(self.st["gcp"][key]) == last and time.time() < deadline:
                        LOCK.wait(timeout=max(0.0, deadline - time.time()))
                    if last is None:
                        # Without last_etag the first answer is immediate (as the service does).
                        pass
                v = self.st["gcp"][key]
            return self.send(200, v, headers={"ETag": etag(v), "Metadata-Flavor": "Google"})
        if p == "/metadata/instance/compute/name":
            if self.headers.get("Metadata") != "true":
                return self.send(400, '{"error": "Bad request. Required metadata header not specified"}')
            return self.send(200, self.vm)
        if p == "/metadata/scheduledevents":
            if self.headers.get("Metadata") != "true":
                return self.send(400, '{"error": "Bad request. Required metadata header not specified"}')
            with LOCK:
                doc = {"DocumentIncarnation": self.st["azure_incarnation"], "Events": self.st["azure_events"]}
            return self.send(200, json.dumps(doc), "application/json")
        self.send(404, "not found")

    def control(self, p, q):
        if p == "/_standin/acks":
            with LOCK:
                return self.send(200, json.dumps(self.st["acks"]), "application/json")
        if p == "/_standin/requests":
            with LOCK:
                return self.send(200, str(self.st["requests"]))
        if p != "/_standin/arm":
            return self.send(404, "")
        kind = q.get("kind", "")
        due = time.time() + int(q.get("seconds", "120"))
        with LOCK:
            if kind == "aws-spot":
                self.st["aws_spot"] = {"action": "terminate", "time": rfc3339(due)}
            elif kind == "aws-rebalance":
                self.st["aws_rebalance"] = {"noticeTime": rfc3339(time.time())}
            elif kind == "aws-scheduled":
                self.st["aws_scheduled"].append({
                    "NotBefore": email.utils.formatdate(due, usegmt=True)[5:],
                    "Code": "system-reboot", "Description": "scheduled reboot",
                    "EventId": "instance-event-" + uuid.uuid4().hex[:17],
                    "NotAfter": email.utils.formatdate(due + 1000, usegmt=True)[5:], "State": "active"})
            elif kind == "gcp-preempted":
                self.st["gcp"]["preempted"] = "TRUE"
            elif kind == "gcp-maintenance":
                self.st["gcp"]["maintenance-event"] = "TERMINATE_ON_HOST_MAINTENANCE"
            elif kind in ("azure-preempt", "azure-terminate"):
                self.st["azure_events"].append({
                    "EventId": str(uuid.uuid4()).upper(),
                    "EventStatus": "Scheduled",
                    "EventType": "Preempt" if kind == "azure-preempt" else "Terminate",
                    "ResourceType": "VirtualMachine",
                    "Resources": [self.vm],
                    "NotBefore": email.utils.formatdate(due, usegmt=True),
                    "Description": "", "EventSource": "Platform", "DurationInSeconds": -1})
                self.st["azure_incarnation"] += 1
            else:
                return self.send(400, "unknown kind")
            LOCK.notify_all()
        self.send(200, "armed " + kind)


def main():
    global VM_NAME
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--vm-name", default=VM_NAME)
    a = ap.parse_args()
    VM_NAME = a.vm_name
    srv = ThreadingHTTPServer((a.host, a.port), Handler)
    srv.daemon_threads = True
    print(f"listening {srv.server_address[1]}", flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
