# Servers for the egress proxy tests, on 127.0.0.1 ports of their own: a package
# mirror (a PEP 503 simple index with one wheel built here, and a bare git repository
# served over git's "dumb" HTTP protocol) and a forbidden server that counts every
# connection it accepts. Writes {"mirror": port, "forbidden": port} to argv[2] once
# both listen; serves until killed. argv[1] is the directory to serve from.
import base64
import hashlib
import http.server
import json
import os
import socketserver
import subprocess
import sys
import threading
import zipfile

root, ports_file = sys.argv[1], sys.argv[2]
counter = os.path.join(root, "forbidden-connections")


def wheel(path):
    files = {
        "demo_pkg/__init__.py": b'GREETING = "hello from the mirror"\n',
        "demo_pkg-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: demo-pkg\nVersion: 1.0\n",
        "demo_pkg-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: airlock-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append("%s,sha256=%s,%d" % (name, digest, len(data)))
    record.append("demo_pkg-1.0.dist-info/RECORD,,")
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr("demo_pkg-1.0.dist-info/RECORD", "\n".join(record) + "\n")


os.makedirs(os.path.join(root, "files"), exist_ok=True)
os.makedirs(os.path.join(root, "simple", "demo-pkg"), exist_ok=True)
wheel(os.path.join(root, "files", "demo_pkg-1.0-py3-none-any.whl"))
with open(os.path.join(root, "simple", "demo-pkg", "index.html"), "w") as f:
    f.write('<html><body><a href="../../files/demo_pkg-1.0-py3-none-any.whl">'
            "demo_pkg-1.0-py3-none-any.whl</a></body></html>\n")
with open(os.path.join(root, "simple", "index.html"), "w") as f:
    f.write('<html><body><a href="demo-pkg/">demo-pkg</a></body></html>\n')

work = os.path.join(root, "work")
git = ["git", "-c", "user.name=test", "-c", "user.email=test@example.com",
       "-c", "init.defaultBranch=main"]
subprocess.run(git + ["init", "-q", work], check=True)
with open(os.path.join(work, "README"), "w") as f:
    f.write("cloned through the proxy\n")
subprocess.run(git + ["-C", work, "add", "README"], check=True)
subprocess.run(git + ["-C", work, "commit", "-q", "-m", "first"], check=True)
bare = os.path.join(root, "repo.git")
subprocess.run(git + ["clone", "-q", "--bare", work, bare], check=True)
subprocess.run(["git", "-C", bare, "update-server-info"], check=True)

with open(counter, "w") as f:
    f.write("0")
lock = threading.Lock()


class Quiet(http.server.SimpleHTTPRequestHandler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, directory=root, **kwargs)

    def log_message(self, *args):
        pass


class Counting(socketserver.BaseRequestHandler):
    def handle(self):
        with lock:
            with open(counter) as f:
                seen = int(f.read() or "0")
            with open(counter, "w") as f:
                f.write(str(seen + 1))
        self.request.sendall(b"HTTP/1.0 200 OK\r\n\r\nyou should never see this\n")


class Threads(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True


class CountingServer(socketserver.ThreadingMixIn, socketserver.TCPServer):
    daemon_threads = True
    allow_reuse_address = True


mirror = Threads(("127.0.0.1", 0), Quiet)
forbidden = CountingServer(("127.0.0.1", 0), Counting)
threading.Thread(target=forbidden.serve_forever, daemon=True).start()
with open(ports_file + ".partial", "w") as f:
    json.dump({"mirror": mirror.server_address[1], "forbidden": forbidden.server_address[1]}, f)
os.rename(ports_file + ".partial", ports_file)
mirror.serve_forever()
