# Run inside a `network = "proxy"` sandbox as an attacker would: every way out that is
# not the proxy, and every way through the proxy that its rules refuse. Prints one JSON
# object: attempt name -> what happened. argv: mirror port, forbidden port, a port of
# the orchestrator on the host, the host directory of the workers' sockets.
import json
import socket
import ssl
import sys

mirror, forbidden, orchestrator = (int(a) for a in sys.argv[1:4])
sockets = sys.argv[4]
PROXY = ("127.0.0.1", 3128)
out = {}


def attempt(name, fn):
    try:
        out[name] = fn()
    except Exception as e:  # what failed, and how
        out[name] = "error: %s: %s" % (type(e).__name__, e)


def direct(host, port):
    def go():
        s = socket.create_connection((host, port), timeout=3)
        s.close()
        return "connected"
    return go


def status_of(request, then=None):
    def go():
        s = socket.create_connection(PROXY, timeout=5)
        s.sendall(request)
        head = b""
        while b"\r\n\r\n" not in head and len(head) < 65536:
            chunk = s.recv(4096)
            if not chunk:
                break
            head += chunk
        line = head.split(b"\r\n", 1)[0].decode("latin-1")
        body = head.split(b"\r\n\r\n", 1)[1].decode("latin-1", "replace") if b"\r\n\r\n" in head else ""
        result = line + " | " + body.strip()[:300]
        if then is not None:
            result += " | " + then(s)
        s.close()
        return result
    return go


def connect(target):
    return ("CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n" % (target, target)).encode()


def client_hello(sni):
    ctx = ssl.create_default_context()
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing, server_hostname=sni)
    try:
        tls.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return outgoing.read()


def send_hello(sni):
    def go(s):
        s.sendall(client_hello(sni))
        s.settimeout(5)
        try:
            data = s.recv(4096)
        except OSError as e:
            return "after hello: %s" % e
        return "after hello: closed" if not data else "after hello: " + data.hex()
    return go


attempt("direct-forbidden", direct("127.0.0.1", forbidden))
attempt("direct-orchestrator", direct("127.0.0.1", orchestrator))
attempt("direct-outside", direct("192.0.2.1", 80))
attempt("connect-forbidden", status_of(connect("forbidden.test:%d" % forbidden)))
attempt("connect-other-port", status_of(connect("mirror.test:%d" % forbidden)))
attempt("connect-ip-literal", status_of(connect("127.0.0.1:%d" % forbidden)))
attempt("connect-rebind", status_of(connect("rebind.example:%d" % forbidden)))
attempt("connect-orchestrator", status_of(connect("localhost:%d" % orchestrator)))
attempt("sni-mismatch", status_of(connect("mirror.test:%d" % mirror), send_hello("forbidden.test")))
attempt("plain-forbidden", status_of(
    ("GET http://forbidden.test:%d/ HTTP/1.1\r\nHost: forbidden.test:%d\r\n\r\n" % (forbidden, forbidden)).encode()))
attempt("host-mismatch", status_of(
    ("GET http://mirror.test:%d/simple/ HTTP/1.1\r\nHost: forbidden.test:%d\r\n\r\n" % (mirror, forbidden)).encode()))
attempt("plain-allowed", status_of(
    ("GET http://mirror.test:%d/simple/ HTTP/1.1\r\nHost: mirror.test:%d\r\n\r\n" % (mirror, mirror)).encode()))
attempt("not-http", status_of(b"\x16\x03\x01\x00\x05hello\r\n\r\n"))


def udp():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.sendto(b"x", ("127.0.0.1", forbidden))
    return "sent"


def raw():
    socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    return "opened"


def inet6():
    s = socket.create_connection(("::1", forbidden), timeout=3)
    s.close()
    return "connected"


def worker_socket(group):
    def go():
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(3)
        s.connect("%s/%s.sock" % (sockets, group))
        s.close()
        return "connected"
    return go


for group in ("shell", "fs", "http", "db"):
    attempt("worker-socket-" + group, worker_socket(group))
attempt("udp", udp)
attempt("raw", raw)
attempt("inet6", inet6)
print(json.dumps(out))
